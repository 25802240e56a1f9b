"""MXFP4 (OCP Microscaling v1.0): quantize, dequantize, pack, and the QAT fake-quant.

A weight ``W [..., K]`` (K = the GEMM reduction dim, the last dim of an ``nn.Linear`` weight) is
cut into blocks of ``BLOCK = 32`` consecutive values along K. Each block stores

* one shared scale ``X = 2**s`` as an E8M0 byte ``s + 127`` (OCP §6.3 "minimally supported"
  rule: ``s = floor(log2(max|v|)) - 2``, 2 = emax of E2M1, so the block max lands in [4, 8));
* 32 FP4 E2M1 elements ``v / X`` rounded to nearest, ties to even, onto
  ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` with sign, saturating at 6 (the values in (6, 8) clamp).

Edge cases: an all-zero block gets the smallest scale (byte 0, ``2**-127``) and zero codes; a
block whose ``floor(log2 max)`` is below ``-125`` also uses byte 0 (E8M0 has no smaller scale),
its elements are then quantized against ``2**-127`` exactly. The sign bit of a value that rounds
to zero is kept (``-0.0``), as torchao and compressed-tensors do.

Packing (compressed-tensors ``mxfp4-pack-quantized``, torchao's ``pack_uint4``): element ``2i``
in the low nibble, ``2i+1`` in the high nibble of byte ``i``; a nibble is ``sign << 3 | code``.

``quantize_mxfp4`` / ``dequantize_mxfp4`` are the export / load path and reject NaN / inf with an
error naming the tensor. ``fake_quantize_mxfp4`` is the training path: the same numbers
(``dequantize(quantize(w))`` bit for bit, in ``w``'s dtype, exact in bf16 and fp32), with a
straight-through gradient, no host synchronisation (a non-finite block comes out NaN and the
step's NaN check catches it). Pure torch; bit-exact against torchao's ``to_mx(...,
ScaleCalculationMode.FLOOR)`` (``tests/unit/test_mxfp4.py``) for every block whose max is at
least ``2**-124``. Below that both store scale byte 0, but torchao rounds the elements against
``2**-126`` (its bytes then decode to about half the value: ``2e-38`` comes back as
``8.8e-39``); here they are rounded against the ``2**-127`` the byte stores (``2e-38`` -> 3.0 x
``2**-127`` = ``1.8e-38``, as OCP's rule gives).
"""

from __future__ import annotations

import torch

BLOCK = 32
"""Elements per shared scale (OCP MX v1.0)."""

BITS_PER_PARAM = 4 + 8 / BLOCK
"""Storage cost: a 4-bit element plus its share of an 8-bit scale = 4.25 bits."""

E8M0_BIAS = 127
E2M1_EMAX = 2
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitude of E2M1 code 0..7 (bit 3 is the sign)."""

# Round-to-nearest-even decision points between consecutive codes k and k+1: a magnitude
# strictly above the midpoint moves up; AT the midpoint it moves up only if k+1 is even.
_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def check_width(width: int, what: str) -> None:
    """Raise ``ValueError`` unless ``width`` (a reduction dim) is a multiple of ``BLOCK``."""
    if width % BLOCK:
        raise ValueError(
            f"{what}={width} is not a multiple of the MXFP4 block size {BLOCK}: "
            "MXFP4 blocks run along the reduction dim and are never padded"
        )


def _blocks(w: torch.Tensor, what: str) -> torch.Tensor:
    if w.dim() < 1:
        raise ValueError(f"{what}: a scalar cannot be MXFP4-quantized")
    check_width(w.shape[-1], f"{what} reduction width (last dim)")
    return w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)


def _scale_exponent(blocks: torch.Tensor) -> torch.Tensor:
    """Unbiased E8M0 exponent per block, int32, shape [..., nblocks, 1]."""
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # floor(log2(amax)) read off the fp32 exponent field (-127 for zero / subnormal amax).
    floor_log2 = ((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS
    return (floor_log2 - E2M1_EMAX).clamp(min=-E8M0_BIAS)


def _codes(scaled: torch.Tensor) -> torch.Tensor:
    """E2M1 nibble (sign << 3 | code) of values already divided by their block scale."""
    mag = scaled.abs()
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for mid, up_on_tie in _MIDPOINTS:
        code += (mag >= mid) if up_on_tie else (mag > mid)
    return code | (torch.signbit(scaled).to(torch.uint8) << 3)


def _lut(device, dtype=torch.float32) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags]).to(dtype)


def _check_finite(w: torch.Tensor, what: str) -> None:
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).sum().item()
        raise ValueError(
            f"{what} has {bad} NaN/inf value(s): MXFP4 (E8M0 scales, E2M1 elements) "
            "encodes finite values only"
        )


def quantize_mxfp4(w: torch.Tensor, what: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., K]`` -> ``(packed uint8 [..., K/2], scales uint8 E8M0 [..., K/32])``.

    ``K`` must be a multiple of 32 and every value finite (``ValueError`` naming ``what``)."""
    blocks = _blocks(w, what)
    _check_finite(blocks, what)
    exp = _scale_exponent(blocks)
    codes = _codes(blocks * torch.exp2(-exp.float())).reshape(*w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp + E8M0_BIAS).to(torch.uint8).squeeze(-1)


def dequantize_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``(packed [..., K/2], scales [..., K/32])`` -> ``[..., K]`` in ``dtype`` (exact for bf16
    and fp32 except scales below their normal range)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scales {scales.dtype}"
        )
    k = packed.shape[-1] * 2
    if tuple(scales.shape) != (*packed.shape[:-1], k // BLOCK) or k % BLOCK:
        raise ValueError(
            f"MXFP4 scales of shape {tuple(scales.shape)} do not fit packed values of "
            f"shape {tuple(packed.shape)} (one scale per {BLOCK} values)"
        )
    if (scales == 255).any():
        raise ValueError("MXFP4 scales hold the E8M0 NaN byte 255")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], k)
    values = _lut(packed.device)[codes.long()].reshape(*packed.shape[:-1], k // BLOCK, BLOCK)
    scale = torch.exp2(scales.float() - E8M0_BIAS).unsqueeze(-1)
    return (values * scale).reshape(*packed.shape[:-1], k).to(dtype)


def mxfp4_round_trip(w: torch.Tensor) -> torch.Tensor:
    """``dequantize(quantize(w))`` in ``w``'s dtype without the finiteness check (no host sync)."""
    blocks = _blocks(w, "weight")
    exp = _scale_exponent(blocks).float()
    codes = _codes(blocks * torch.exp2(-exp))
    values = _lut(w.device)[codes.long()] * torch.exp2(exp)
    values = torch.where(torch.isfinite(blocks).all(-1, keepdim=True), values, float("nan"))
    return values.reshape(w.shape).to(w.dtype)


class _FakeQuantizeMXFP4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return mxfp4_round_trip(w)

    @staticmethod
    def backward(ctx, grad):
        return grad


def fake_quantize_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 fake-quant of a weight along its last (reduction) dim, straight-through gradient:
    the forward sees ``dequantize(quantize(w))``, ``d out / d w`` is the identity."""
    return _FakeQuantizeMXFP4.apply(w)
