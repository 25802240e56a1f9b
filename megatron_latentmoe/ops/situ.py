"""SiTU-GLU, the bounded gated activation of Stable LatentMoE: formula and properties in SPEC §2
(fp32 math, |out| < b1 b2, SwiGLU limit; tests/unit/test_situ.py checks each).

Memory: the autograd function saves only its input, in the input dtype (for a bf16 fc1 output
that is 2 bytes per element of the packed [..., 2F] tensor), and recomputes tanh / sigmoid in
backward with closed-form derivatives. A plain autograd composition in fp32 would keep the fp32
upcasts plus several fp32 intermediates alive until backward.

Three implementations of the same formula, chosen per call by ``_path``:

* CUDA, bf16 / fp16 / fp32: the fused Triton kernels of ``ops/situ_triton.py`` (one pass over
  memory each way; this is what routed experts, shared experts and dense MLPs run on a GPU, in
  the local and the TE spec alike, since both build ``SiTUGLU``);
* CPU, bf16 / fp16 / fp32, at least ``COMPILE_MIN_ELEMS`` output elements: the same exp-based
  formula as the Triton kernels, fused by ``torch.compile`` (inductor) into one loop per pass.
  ``torch.tanh`` costs 3.2 ns per fp32 element on this AVX2 CPU against 1.0 ns for ``torch.exp``
  (measured, 1 thread), so the fused loop writes tanh with exp. fwd+bwd at [512, 2x384] fp32,
  side by side: compiled with torch.tanh 0.73x the eager time, the exp form 0.52x (1.9x SwiGLU's
  time, eager 3.6x). In benchmarks/bench_block.py SiTU-GLU's share of the block's fwd+bwd falls
  from 16.7 % (eager) to 7.0 % (fused; ``situ_share_eager`` / ``situ_share`` of
  benchmarks/results/bench_block.json);
* everything else (fp64, small tensors whose compile would not pay back, a machine where
  inductor cannot compile, a process that turned compiling off with `set_cpu_compile`, as
  Megatron's ``--disable-jit-fuser`` does): the eager blocked math below with ``torch.tanh``.

The reference formula (plain autograd, the one the HF modeling file ships) is
``hf.modeling_stable_latentmoe.situ_glu``; the tests compare all three paths with it in fp64.

This module must not import Megatron: the exported HF modeling code and the pure-PyTorch
reference stay importable without it. `SiTUGLU` only duck-types Megatron's activation-module
protocol (``submodules.activation_func(config=config)`` then ``module(packed_fc1_output)``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import warnings
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from megatron_latentmoe.fields import BY_NAME, not_allowed

DEFAULT_SITU_BETA: float = BY_NAME["activation_situ_beta"].default  # b1 (SPEC §2)
DEFAULT_SITU_LINEAR_BETA: float = BY_NAME["activation_situ_linear_beta"].default  # b2


_BETA_ROWS = {"beta": "activation_situ_beta", "linear_beta": "activation_situ_linear_beta"}


def validate_situ_beta(name: str, value: Any) -> float:
    """``value`` as a float, or the ValueError of the fields' rule for b1 / b2 (``name``: the
    field, or this module's keyword for it): a positive finite number. Any ``numbers.Real`` but
    bool counts as the float it equals (a NumPy scalar too, as these ops always accepted)."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    allowed = BY_NAME[_BETA_ROWS.get(name, name)].problem(float(value) if real else value)
    if allowed:
        raise not_allowed(name, value, allowed)
    return float(value)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 math for half / bf16 / fp32 inputs; fp64 inputs keep fp64 (gradcheck, references).
    return torch.float64 if dtype == torch.float64 else torch.float32


# The elementwise math runs over blocks of rows, so that the fp32 temporaries never cost more
# than a few blocks (the inputs themselves stay in their dtype). On CPU the block (1M elements,
# 4 MiB of fp32 per temporary) lets the allocator reuse the temporaries instead of page-faulting
# fresh whole-tensor allocations: fwd+bwd at 4096 x 3072 1.7x (fp32) / 2.6x (bf16) faster than
# unblocked (measured on the eager path with CPU_BLOCK_ELEMS = 2**40, 1 thread, min of 3, torch
# 2.13 CPU; benchmarks/bench_situ.py does not time it). Smaller blocks were no faster and multiply
# the number of op launches (each a parallel region, which costs a lot when the cores are
# oversubscribed). On an accelerator (where this path runs only for fp64, or without Triton)
# the block is large: few launches, bounded transient fp32 footprint.
CPU_BLOCK_ELEMS = 1 << 20
DEVICE_BLOCK_ELEMS = 1 << 24


def _row_blocks(rows: int, row_elems: int, device: torch.device):
    """Yield (start, stop) row ranges covering [0, rows)."""
    block = CPU_BLOCK_ELEMS if device.type == "cpu" else DEVICE_BLOCK_ELEMS
    step = max(1, block // max(row_elems, 1))
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def _no_autocast(t: torch.Tensor):
    """The math must stay in the compute dtype even when the caller runs under autocast."""
    try:
        return torch.autocast(device_type=t.device.type, enabled=False)
    except RuntimeError:  # a device type without autocast support (e.g. meta)
        return contextlib.nullcontext()


def _upcast_block(xb: torch.Tensor) -> torch.Tensor:
    """A packed [rows, 2F] block in the compute dtype, upcast WHOLE (a view for fp32 / fp64).

    The math then runs on the same strided gate / up views whatever the input dtype. CPU kernels
    take a different loop for a strided row's tail (scalar std:: math) than for a contiguous run
    (vectorised SLEEF), 1 ulp apart: upcasting the halves separately (contiguous copies) made
    bf16 / fp16 outputs differ from "the fp32 path rounded once" for ~5 % of random [512, 24]
    inputs, gradients for ~10 % (AVX-512: an 8-element tail per 24-element row). fp32 numerics
    are unchanged by this (the same views as before)."""
    return xb.to(_compute_dtype(xb.dtype))


def _forward_math(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    """SiTU-GLU of g / u, already in the compute dtype (:func:`_upcast_block`); a new tensor."""
    out = torch.div(g, b1).tanh_().mul_(b1).mul_(torch.sigmoid(g))
    return out.mul_(torch.div(u, b2).tanh_().mul_(b2))


def _backward_math(
    g: torch.Tensor, u: torch.Tensor, grad: torch.Tensor, b1: float, b2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form input gradients of g / u, already in the compute dtype (:func:`_upcast_block`),
    returned in it.

    A(g) = b1 tanh(g/b1) sigmoid(g)    A'(g) = s (1 - t1^2) + A (1 - s)
    B(u) = b2 tanh(u/b2)               B'(u) = 1 - t2^2
    d/dg = grad * B * A'(g),           d/du = grad * A * B'(u)
    with t1 = tanh(g/b1), s = sigmoid(g), t2 = tanh(u/b2).
    """
    grad = grad.to(g.dtype)
    t1 = torch.div(g, b1).tanh_()
    s = torch.sigmoid(g)
    t2 = torch.div(u, b2).tanh_()
    a = torch.mul(t1, s).mul_(b1)  # A(g)
    du = torch.mul(t2, t2).neg_().add_(1.0).mul_(a).mul_(grad)
    dg = t1.mul_(t1).neg_().add_(1.0).mul_(s)  # s (1 - t1^2)
    dg.add_(s.neg_().add_(1.0).mul_(a))  # + A (1 - s)
    dg.mul_(t2).mul_(grad).mul_(b2)  # * B(u) * grad
    return dg, du


FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Below this many output elements the eager math runs on CPU. The first compiled call of a
# process costs ~2 s with a warm inductor cache and ~20 s cold on an idle core (measured 30 s and
# 80 s wall on 2 cores at load 15-25); each later fwd+bwd of 200k elements saves ~1.5 ms.
# 1 << 17 keeps the tests' tiny layers eager and compiles the expert / shared-expert / dense MLP
# activations of benchmarks/bench_block.py (512-2048 rows x 384-768 columns).
COMPILE_MIN_ELEMS = 1 << 17
_compile_failed = False
_compile_enabled = True


def set_cpu_compile(enabled: bool) -> None:
    """Turn the compiled CPU path on or off for this process (off: the eager math everywhere on
    CPU). The training entry point turns it off for Megatron's ``--disable-jit-fuser``, whose
    ``jit_fuser`` is ``torch.compile`` too. For a short run of a small model compiling does not
    pay: measured on a 2-core EPYC (1 thread), the first compiled fwd+bwd of a process takes
    4.3 s with a warm inductor cache, and ``tiny.sh``'s dense layer ([512, 2x256]) then saves
    1.4 ms a fwd+bwd (7.5 -> 6.1 ms), 0.9 s over the 600 calls a rank makes in the main job."""
    global _compile_enabled
    _compile_enabled = bool(enabled)


def _tanh_sech2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tanh(x) and 1 - tanh(x)^2 from one exp (the Triton kernels' formula, see situ_triton.py):
    sign(x)(1-e)/(1+e) and 4e/(1+e)^2 with e = exp(-2|x|); a Taylor series below |x| = 1/4."""
    ax = x.abs()
    e = torch.exp(-2.0 * ax)
    x2 = x * x
    series = x * (
        1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0))))
    )
    small = ax < 0.25
    t = torch.where(small, series, torch.copysign((1.0 - e) / (1.0 + e), x))
    sech2 = torch.where(small, 1.0 - series * series, 4.0 * e / ((1.0 + e) * (1.0 + e)))
    return t, sech2


def _fused_forward(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    g32, u32 = g.float(), u.float()
    t1, _ = _tanh_sech2(g32 / b1)
    t2, _ = _tanh_sech2(u32 / b2)
    return ((b1 * b2) * t1 * torch.sigmoid(g32) * t2).to(g.dtype)


def _fused_backward(g: torch.Tensor, u: torch.Tensor, grad: torch.Tensor, b1: float, b2: float):
    g32, u32, go = g.float(), u.float(), grad.float()
    t1, sech2_1 = _tanh_sech2(g32 / b1)
    t2, sech2_2 = _tanh_sech2(u32 / b2)
    s = torch.sigmoid(g32)
    a = b1 * t1 * s
    dg = go * (b2 * t2) * (s * sech2_1 + a * (1.0 - s))
    return dg.to(g.dtype), (go * a * sech2_2).to(u.dtype)


def _fused_backward_packed(x: torch.Tensor, grad: torch.Tensor, b1: float, b2: float):
    f = x.shape[-1] // 2
    return torch.cat(_fused_backward(x[..., :f], x[..., f:], grad, b1, b2), dim=-1)


@functools.cache
def _compiled(name: str):
    fn = {"fwd": _fused_forward, "bwd_packed": _fused_backward_packed}
    return torch.compile(fn[name], dynamic=True)


@functools.cache
def _triton_ops():
    """ops/situ_triton.py, or None where Triton is not importable (then the eager math runs)."""
    try:
        from megatron_latentmoe.ops import situ_triton
    except ImportError:
        return None
    return situ_triton


def _path(t: torch.Tensor, out_elems: int) -> str:
    """'triton', 'compiled' or 'eager' for an input like ``t`` (see the module docstring)."""
    if t.dtype not in FUSED_DTYPES or out_elems == 0:
        return "eager"
    if t.device.type == "cuda":
        return "triton" if _triton_ops() is not None else "eager"
    if (
        t.device.type == "cpu"
        and out_elems >= COMPILE_MIN_ELEMS
        and _compile_enabled
        and not _compile_failed
    ):
        return "compiled"
    return "eager"


def _run_compiled(name: str, *args):
    """The compiled function's result, or None after warning once if inductor cannot compile."""
    global _compile_failed
    try:
        with _no_autocast(args[0]):
            return _compiled(name)(*args)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back to eager for good
        _compile_failed = True
        warnings.warn(
            f"SiTU-GLU: torch.compile failed ({type(exc).__name__}: {exc}); "
            "using the eager math from now on",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


class _SiTUGLUPackedFunction(torch.autograd.Function):
    """out = SiTU-GLU(x[..., :F], x[..., F:]); saves only x; the gradient is written into one
    [..., 2F] buffer (no chunk / cat nodes in the graph)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, b1: float, b2: float):
        ctx.b1, ctx.b2 = b1, b2
        ctx.save_for_backward(x)
        f = x.shape[-1] // 2
        x2 = x.reshape(math.prod(x.shape[:-1]), 2 * f)
        path = _path(x2, x2.shape[0] * f)
        if path == "triton":
            x2 = x2.contiguous()
            out = _triton_ops().situ_fwd(x2[:, :f], x2[:, f:], b1, b2)
            return out.view(*x.shape[:-1], f)
        if path == "compiled":
            out = _run_compiled("fwd", x2[:, :f], x2[:, f:], b1, b2)
            if out is not None:
                return out.view(*x.shape[:-1], f)
        out = torch.empty((x2.shape[0], f), dtype=x.dtype, device=x.device)
        with _no_autocast(x):
            for i, j in _row_blocks(x2.shape[0], 2 * f, x.device):
                xb = _upcast_block(x2[i:j])
                out[i:j].copy_(_forward_math(xb[:, :f], xb[:, f:], b1, b2))
        return out.view(*x.shape[:-1], f)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        f = x.shape[-1] // 2
        x2 = x.reshape(math.prod(x.shape[:-1]), 2 * f)
        go = grad_out.reshape(x2.shape[0], f)
        path = _path(x2, x2.shape[0] * f)
        if path == "triton":
            x2, go = x2.contiguous(), go.contiguous()
            dx = torch.empty_like(x2)
            _triton_ops().situ_bwd(x2[:, :f], x2[:, f:], go, dx[:, :f], dx[:, f:], ctx.b1, ctx.b2)
            return dx.view(x.shape), None, None
        if path == "compiled":
            dx = _run_compiled("bwd_packed", x2, go, ctx.b1, ctx.b2)
            if dx is not None:
                return dx.view(x.shape), None, None
        dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        with _no_autocast(x):
            for i, j in _row_blocks(x2.shape[0], 2 * f, x.device):
                xb = _upcast_block(x2[i:j])
                dg, du = _backward_math(xb[:, :f], xb[:, f:], go[i:j], ctx.b1, ctx.b2)
                dx[i:j, :f].copy_(dg)
                dx[i:j, f:].copy_(du)
        return dx.view(x.shape), None, None


def _check_floating(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor; got dtype {t.dtype}")


def situ_glu_packed(
    x: torch.Tensor,
    beta: float = DEFAULT_SITU_BETA,
    linear_beta: float = DEFAULT_SITU_LINEAR_BETA,
) -> torch.Tensor:
    """SiTU-GLU on a packed [..., 2F] tensor: first half gate, second half up -> [..., F].

    This is the layout of Megatron's gated fc1 output on each tensor-parallel rank (and of the
    input of Kimi's ``SituAndMul``, quoted in seed 000; this package's HF model applies
    ``situ_glu`` to separate gate / up projections instead). Backward saves only ``x``.
    """
    b1 = validate_situ_beta("beta", beta)
    b2 = validate_situ_beta("linear_beta", linear_beta)
    _check_floating("x", x)
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(
            "situ_glu_packed expects a last dimension of even size 2F (gate | up); got shape "
            f"{tuple(x.shape)}"
        )
    return _SiTUGLUPackedFunction.apply(x, b1, b2)


class SiTUGLU(torch.nn.Module):
    """Megatron activation module for ``hidden_act = situ`` on the packed GLU fc1 output.

    Megatron's ``MLP`` and ``TEGroupedMLP`` / ``SequentialMLP`` (when
    ``config.use_te_activation_func`` is True and ``submodules.activation_func`` is set) build it as
    ``SiTUGLU(config=config)`` and call ``module(fc1_output)`` with fc1_output [..., 2F]
    (gate | up, after any bias is added and any GLU interleaving removed). Returns [..., F].

    b1 / b2 come from, in order: the keyword arguments, ``config.activation_situ_beta`` /
    ``config.activation_situ_linear_beta`` (if the config has them and they are not None), and
    the fields' defaults (``DEFAULT_SITU_BETA`` / ``DEFAULT_SITU_LINEAR_BETA``, SPEC §2).
    """

    def __init__(
        self,
        config: Any = None,
        *,
        beta: float | None = None,
        linear_beta: float | None = None,
    ):
        super().__init__()
        if beta is None:
            beta = getattr(config, "activation_situ_beta", None)
        if linear_beta is None:
            linear_beta = getattr(config, "activation_situ_linear_beta", None)
        self.beta = validate_situ_beta(
            "activation_situ_beta", DEFAULT_SITU_BETA if beta is None else beta
        )
        self.linear_beta = validate_situ_beta(
            "activation_situ_linear_beta",
            DEFAULT_SITU_LINEAR_BETA if linear_beta is None else linear_beta,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return situ_glu_packed(x, self.beta, self.linear_beta)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, linear_beta={self.linear_beta}"
