"""SiTU-GLU, the bounded gated activation of Stable LatentMoE (SPEC §2, formula 12).

    softcap(x, b)  = b * tanh(x / b)
    SiTU-GLU(g, u) = [softcap(g, b1) * sigmoid(g)] * softcap(u, b2)      b1 = 4, b2 = 25

Properties (checked in tests/unit/test_situ.py):
  * |out| < b1 * b2 for every input (tanh in (-1, 1), sigmoid in (0, 1));
  * first-order equal to SwiGLU = silu(g) * u near 0, and converges pointwise to it as b1, b2 -> inf;
  * the math runs in fp32 (fp64 stays fp64) and the result is cast back to the input dtype.

Memory: the autograd functions here save only their inputs, in the input dtype (for a bf16 fc1
output that is 2 bytes per element of the packed [..., 2F] tensor), and recompute tanh / sigmoid
in backward with closed-form derivatives. A plain autograd composition in fp32 would keep the fp32
upcasts plus several fp32 intermediates alive until backward.

This module must not import Megatron: the pure-PyTorch reference and the exported HF modeling
code use it too. `SiTUGLU` only duck-types Megatron's activation-module protocol
(``submodules.activation_func(config=config)`` then ``module(packed_fc1_output)``).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "DEFAULT_SITU_BETA",
    "DEFAULT_SITU_LINEAR_BETA",
    "SiTUGLU",
    "situ_glu",
    "situ_glu_packed",
    "situ_glu_reference",
    "validate_situ_beta",
]

DEFAULT_SITU_BETA = 4.0  # b1, config key `activation_situ_beta`
DEFAULT_SITU_LINEAR_BETA = 25.0  # b2, config key `activation_situ_linear_beta`


def validate_situ_beta(name: str, value: Any) -> float:
    """Return ``value`` as a float, or raise ValueError if it is not a finite real number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{name} must be a finite real number in (0, inf); got {value!r} "
            f"of type {type(value).__name__}"
        )
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise ValueError(f"{name} must be a finite real number in (0, inf); got {value!r}")
    return v


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 math for half / bf16 / fp32 inputs; fp64 inputs keep fp64 (gradcheck, references).
    return torch.float64 if dtype == torch.float64 else torch.float32


# The elementwise math runs over blocks of rows, so that the fp32 temporaries never cost more
# than a few blocks (the inputs themselves stay in their dtype). On CPU the block (1M elements,
# 4 MiB of fp32 per temporary) lets the allocator reuse the temporaries instead of page-faulting
# fresh whole-tensor allocations: about 2-3x faster fwd+bwd at 4096 x 3072 than unblocked (see
# benchmarks/bench_situ.py). Smaller blocks were no faster and multiply the number of op launches
# (each a parallel region, which costs a lot when the cores are oversubscribed). On an
# accelerator the block is large: few launches, bounded transient fp32 footprint (a fused kernel
# would remove both costs).
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


def _forward_math(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    """SiTU-GLU in the compute dtype of g / u (upcasts once; returns a new compute-dtype tensor)."""
    cd = _compute_dtype(g.dtype)
    g, u = g.to(cd), u.to(cd)
    out = torch.div(g, b1).tanh_().mul_(b1).mul_(torch.sigmoid(g))
    return out.mul_(torch.div(u, b2).tanh_().mul_(b2))


def _backward_math(
    g: torch.Tensor, u: torch.Tensor, grad: torch.Tensor, b1: float, b2: float,
    need_g: bool = True, need_u: bool = True,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Closed-form input gradients, returned in the compute dtype.

    A(g) = b1 tanh(g/b1) sigmoid(g)    A'(g) = s (1 - t1^2) + A (1 - s)
    B(u) = b2 tanh(u/b2)               B'(u) = 1 - t2^2
    d/dg = grad * B * A'(g),           d/du = grad * A * B'(u)
    with t1 = tanh(g/b1), s = sigmoid(g), t2 = tanh(u/b2).
    """
    cd = _compute_dtype(g.dtype)
    g, u, grad = g.to(cd), u.to(cd), grad.to(cd)
    t1 = torch.div(g, b1).tanh_()
    s = torch.sigmoid(g)
    t2 = torch.div(u, b2).tanh_()
    a = torch.mul(t1, s).mul_(b1)  # A(g)
    dg = du = None
    if need_u:
        du = torch.mul(t2, t2).neg_().add_(1.0).mul_(a).mul_(grad)
    if need_g:
        dg = t1.mul_(t1).neg_().add_(1.0).mul_(s)  # s (1 - t1^2)
        dg.add_(s.neg_().add_(1.0).mul_(a))  # + A (1 - s)
        dg.mul_(t2).mul_(grad).mul_(b2)  # * B(u) * grad
    return dg, du


class _SiTUGLUFunction(torch.autograd.Function):
    """out = SiTU-GLU(gate, up) for same-shape tensors; saves only gate and up."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, b1: float, b2: float):
        ctx.b1, ctx.b2 = b1, b2
        ctx.save_for_backward(gate, up)
        g, u = gate.reshape(-1), up.reshape(-1)
        out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
        with _no_autocast(g):
            for i, j in _row_blocks(g.numel(), 1, g.device):
                out[i:j].copy_(_forward_math(g[i:j], u[i:j], b1, b2))
        return out.view(gate.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        need_g, need_u = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g, u, go = gate.reshape(-1), up.reshape(-1), grad_out.reshape(-1)
        dg = torch.empty(g.shape, dtype=gate.dtype, device=gate.device) if need_g else None
        du = torch.empty(u.shape, dtype=up.dtype, device=up.device) if need_u else None
        with _no_autocast(g):
            for i, j in _row_blocks(g.numel(), 1, g.device):
                dgi, dui = _backward_math(g[i:j], u[i:j], go[i:j], ctx.b1, ctx.b2, need_g, need_u)
                if need_g:
                    dg[i:j].copy_(dgi)
                if need_u:
                    du[i:j].copy_(dui)
        return (None if dg is None else dg.view(gate.shape),
                None if du is None else du.view(up.shape), None, None)


class _SiTUGLUPackedFunction(torch.autograd.Function):
    """out = SiTU-GLU(x[..., :F], x[..., F:]); saves only x; the gradient is written into one
    [..., 2F] buffer (no chunk / cat nodes in the graph)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, b1: float, b2: float):
        ctx.b1, ctx.b2 = b1, b2
        ctx.save_for_backward(x)
        f = x.shape[-1] // 2
        x2 = x.reshape(math.prod(x.shape[:-1]), 2 * f)
        out = torch.empty((x2.shape[0], f), dtype=x.dtype, device=x.device)
        with _no_autocast(x):
            for i, j in _row_blocks(x2.shape[0], 2 * f, x.device):
                out[i:j].copy_(_forward_math(x2[i:j, :f], x2[i:j, f:], b1, b2))
        return out.view(*x.shape[:-1], f)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        f = x.shape[-1] // 2
        x2 = x.reshape(math.prod(x.shape[:-1]), 2 * f)
        go = grad_out.reshape(x2.shape[0], f)
        dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        with _no_autocast(x):
            for i, j in _row_blocks(x2.shape[0], 2 * f, x.device):
                dg, du = _backward_math(x2[i:j, :f], x2[i:j, f:], go[i:j], ctx.b1, ctx.b2)
                dx[i:j, :f].copy_(dg)
                dx[i:j, f:].copy_(du)
        return dx.view(x.shape), None, None


def _check_floating(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor; got dtype {t.dtype}")


def situ_glu(
    gate: torch.Tensor,
    up: torch.Tensor,
    beta: float = DEFAULT_SITU_BETA,
    linear_beta: float = DEFAULT_SITU_LINEAR_BETA,
) -> torch.Tensor:
    """SiTU-GLU(gate, up) = [softcap(gate, beta) * sigmoid(gate)] * softcap(up, linear_beta).

    ``gate`` and ``up`` must have the same shape, dtype and device. Computed in fp32 (fp64 for
    fp64 inputs), returned in the input dtype. Backward saves only the two inputs.
    """
    b1 = validate_situ_beta("beta", beta)
    b2 = validate_situ_beta("linear_beta", linear_beta)
    _check_floating("gate", gate)
    _check_floating("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape; got {tuple(gate.shape)} "
                         f"and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate and up must have the same dtype; got {gate.dtype} and {up.dtype}")
    return _SiTUGLUFunction.apply(gate, up, b1, b2)


def situ_glu_packed(
    x: torch.Tensor,
    beta: float = DEFAULT_SITU_BETA,
    linear_beta: float = DEFAULT_SITU_LINEAR_BETA,
) -> torch.Tensor:
    """SiTU-GLU on a packed [..., 2F] tensor: first half gate, second half up -> [..., F].

    This is the layout of Megatron's gated fc1 output on each tensor-parallel rank (and of the
    HF ``SituAndMul`` input). Backward saves only ``x``.
    """
    b1 = validate_situ_beta("beta", beta)
    b2 = validate_situ_beta("linear_beta", linear_beta)
    _check_floating("x", x)
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(
            f"situ_glu_packed expects a last dimension of even size 2F (gate | up); "
            f"got shape {tuple(x.shape)}"
        )
    return _SiTUGLUPackedFunction.apply(x, b1, b2)


def situ_glu_reference(
    gate: torch.Tensor,
    up: torch.Tensor,
    beta: float = DEFAULT_SITU_BETA,
    linear_beta: float = DEFAULT_SITU_LINEAR_BETA,
) -> torch.Tensor:
    """The formula as plain autograd ops (fp32 math, cast back). Not memory-lean: autograd keeps
    the fp32 upcasts and intermediates. For tests and benchmarks only."""
    b1 = validate_situ_beta("beta", beta)
    b2 = validate_situ_beta("linear_beta", linear_beta)
    cd = _compute_dtype(gate.dtype)
    g, u = gate.to(cd), up.to(cd)
    out = (b1 * torch.tanh(g / b1)) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))
    return out.to(gate.dtype)


class SiTUGLU(torch.nn.Module):
    """Megatron activation module for ``hidden_act = situ`` on the packed GLU fc1 output.

    Megatron's ``MLP`` and ``TEGroupedMLP`` / ``SequentialMLP`` (when
    ``config.use_te_activation_func`` is True and ``submodules.activation_func`` is set) build it as
    ``SiTUGLU(config=config)`` and call ``module(fc1_output)`` with fc1_output [..., 2F]
    (gate | up, after any bias is added and any GLU interleaving removed). Returns [..., F].

    b1 / b2 come from, in order: the keyword arguments, ``config.activation_situ_beta`` /
    ``config.activation_situ_linear_beta`` (if the config has them and they are not None), and
    the SPEC defaults 4.0 / 25.0.
    """

    def __init__(
        self,
        config: Any = None,
        *,
        beta: Optional[float] = None,
        linear_beta: Optional[float] = None,
    ):
        super().__init__()
        if beta is None:
            beta = getattr(config, "activation_situ_beta", None) if config is not None else None
        if linear_beta is None:
            linear_beta = (getattr(config, "activation_situ_linear_beta", None)
                           if config is not None else None)
        self.beta = validate_situ_beta(
            "activation_situ_beta", DEFAULT_SITU_BETA if beta is None else beta)
        self.linear_beta = validate_situ_beta(
            "activation_situ_linear_beta",
            DEFAULT_SITU_LINEAR_BETA if linear_beta is None else linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return situ_glu_packed(x, self.beta, self.linear_beta)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, linear_beta={self.linear_beta}"
