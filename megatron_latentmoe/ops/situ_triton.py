"""Fused SiTU-GLU (SPEC §2) as Triton kernels: one read of (gate, up), one write of the output in
forward; one read of (gate, up, grad) and one write of (d gate, d up) in backward. fp32 math
inside for bf16 / fp16 / fp32 tensors; the result is stored in the input dtype.

``ops/situ.py`` calls these for CUDA tensors. The same kernels run on the CPU under
``TRITON_INTERPRET=1`` (tests/unit/test_situ_triton.py), so they avoid libdevice (the
interpreter has no extern functions): tanh and sigmoid are written with ``tl.exp``.

    tanh(x) = sign(x) (1 - e) / (1 + e),   e = exp(-2|x|)        for |x| >= 1/4
            = x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835       for |x| < 1/4
    1 - tanh(x)^2 = 4e / (1 + e)^2                               (no cancellation near |x| -> inf)

The series is cut where the exp form loses digits to the cancellation in 1 - e (relative error
~eps / (2|x|)): at |x| = 1/4 the next series term is 9e-9 relative, the exp form ~5e-7.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program; one row per program along grid axis 0 (rows may be > 65535)


@triton.jit
def _tanh_and_sech2(x):
    """tanh(x) and 1 - tanh(x)^2 in fp32 (see module docstring)."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    t_exp = (1.0 - e) / (1.0 + e)
    t_exp = tl.where(x < 0, -t_exp, t_exp)
    x2 = x * x
    t_ser = x * (
        1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0))))
    )
    small = ax < 0.25
    t = tl.where(small, t_ser, t_exp)
    one_plus = 1.0 + e
    sech2 = tl.where(small, 1.0 - t_ser * t_ser, 4.0 * e / (one_plus * one_plus))
    return t, sech2


@triton.jit
def _situ_fwd_kernel(
    g_ptr, u_ptr, out_ptr, n_cols, stride_in, stride_out, b1, b2, BLOCK_SIZE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    t1, _ = _tanh_and_sech2(g / b1)
    t2, _ = _tanh_and_sech2(u / b2)
    s = 1.0 / (1.0 + tl.exp(-g))
    out = (b1 * t1) * s * (b2 * t2)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_bwd_kernel(
    g_ptr,
    u_ptr,
    go_ptr,
    dg_ptr,
    du_ptr,
    n_cols,
    stride_in,
    stride_go,
    b1,
    b2,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    go = tl.load(go_ptr + row * stride_go + cols, mask=mask, other=0.0).to(tl.float32)
    t1, sech2_1 = _tanh_and_sech2(g / b1)
    t2, sech2_2 = _tanh_and_sech2(u / b2)
    s = 1.0 / (1.0 + tl.exp(-g))
    a = b1 * t1 * s  # A(g) = softcap(g, b1) sigmoid(g)
    dg = go * (b2 * t2) * (s * sech2_1 + a * (1.0 - s))
    du = go * a * sech2_2
    tl.store(dg_ptr + row * stride_in + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * stride_in + cols, du.to(du_ptr.dtype.element_ty), mask=mask)


def _grid(rows: int, cols: int):
    if cols > 65535 * BLOCK:  # grid axis 1 holds at most 65535 programs
        raise ValueError(
            f"SiTU-GLU Triton kernels take rows of at most {65535 * BLOCK} columns; got {cols}"
        )
    return (rows, triton.cdiv(cols, BLOCK))


def situ_fwd(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    """out[r, c] = SiTU-GLU(g[r, c], u[r, c]) for [R, F] views with unit column stride and the
    same row stride (the two halves of a packed [R, 2F] tensor, or two contiguous tensors)."""
    _check_views(g, u)
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if out.numel():
        _situ_fwd_kernel[_grid(*g.shape)](
            g, u, out, g.shape[1], g.stride(0), out.stride(0), b1, b2, BLOCK_SIZE=BLOCK
        )
    return out


def situ_bwd(
    g: torch.Tensor,
    u: torch.Tensor,
    grad: torch.Tensor,
    dg: torch.Tensor,
    du: torch.Tensor,
    b1: float,
    b2: float,
) -> None:
    """Writes d gate / d up into ``dg`` / ``du`` (views laid out like ``g`` / ``u``, e.g. the
    halves of one packed gradient buffer) from the saved inputs and d out ([R, F], unit column
    stride)."""
    _check_views(g, u, dg, du)
    if grad.stride(-1) != 1 or grad.shape != g.shape:
        raise ValueError(
            f"grad must be [R, F] = {tuple(g.shape)} with unit column stride; got "
            f"shape {tuple(grad.shape)}, strides {grad.stride()}"
        )
    if grad.numel():
        _situ_bwd_kernel[_grid(*g.shape)](
            g, u, grad, dg, du, g.shape[1], g.stride(0), grad.stride(0), b1, b2, BLOCK_SIZE=BLOCK
        )


def _check_views(*views: torch.Tensor) -> None:
    first = views[0]
    for v in views:
        if (
            v.dim() != 2
            or v.stride(1) != 1
            or v.shape != first.shape
            or v.stride(0) != first.stride(0)
        ):
            raise ValueError(
                "SiTU-GLU Triton views must be 2-D [R, F] with unit column stride and "
                f"one shared row stride; got shapes {[tuple(t.shape) for t in views]}, "
                f"strides {[t.stride() for t in views]}"
            )
