"""MXFP4 quantizer (``ops/mxfp4.py``): OCP MX v1.0 rules, bit-exact vs torchao, STE gradient."""

import math

import pytest
import torch

from megatron_latentmoe.ops.mxfp4 import (
    BLOCK,
    dequantize_mxfp4,
    fake_quantize_mxfp4,
    mxfp4_round_trip,
    quantize_mxfp4,
)


def _torchao_to_mx():
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except ImportError:
        pytest.skip("torchao (reference MX implementation) is not installed")

    def reference(x):
        scale, packed = to_mx(
            x.contiguous(), torch.float4_e2m1fn_x2, BLOCK, ScaleCalculationMode.FLOOR
        )
        return packed.view(torch.uint8), scale.view(torch.uint8)

    return reference


def _cases():
    g = torch.Generator().manual_seed(0)
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        for mag in (1e-30, 1e-3, 1.0, 7.0, 1e4, 1e30):
            name = f"randn*{mag:g}-{str(dtype)[6:]}"
            cases[name] = (torch.randn(6, 4, 96, generator=g) * mag).to(dtype)
    # heavy tails: one big value per block, the rest underflow / round to zero
    x = torch.randn(16, 64, generator=g) * torch.exp(4 * torch.randn(16, 64, generator=g))
    cases["lognormal"] = x
    # every E2M1 tie, saturation band (6, 8) and negative zeros, for several block scales
    grid = torch.tensor(
        [
            4.0,
            0.25,
            0.75,
            1.25,
            1.75,
            2.5,
            3.5,
            5.0,
            7.0,
            7.99,
            6.0,
            5.01,
            4.99,
            0.2499,
            0.2501,
            0.0,
            -0.0,
            -0.1,
            -0.25,
            -0.75,
            -5.0,
            -7.5,
            3.0,
            1.5,
            0.5,
            1.0,
            2.0,
            2.4999,
            2.5001,
            3.4999,
            1.7499,
            0.7499,
        ]
    )
    cases["ties"] = torch.stack([grid * 2.0**e for e in (-20, -3, 0, 5, 40)])
    cases["zeros"] = torch.zeros(3, 64)
    return cases


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_bit_exact_against_torchao(name):
    reference = _torchao_to_mx()
    x = CASES[name]
    packed, scales = quantize_mxfp4(x)
    want_packed, want_scales = reference(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(packed, want_packed)


def test_spec_rules_by_hand():
    # block max 4 -> scale 2**(floor(log2 4) - 2) = 1: values are their own E2M1 codes
    packed, scales = quantize_mxfp4(CASES["ties"][2:3])
    assert scales.tolist() == [[127]]
    got = dequantize_mxfp4(packed, scales)[0].tolist()
    want = [
        4,
        0,
        1,
        1,
        2,
        2,
        4,
        4,
        6,
        6,
        6,
        6,
        4,
        0,
        0.5,
        0,
        0,
        0,
        0,
        -1,
        -4,
        -6,
        3,
        1.5,
        0.5,
        1,
        2,
        2,
        3,
        3,
        1.5,
        0.5,
    ]  # ties to even, (6, 8) saturates to 6
    assert got == want
    # signs of values rounding to zero are kept (-0.0), as in the reference libraries
    assert packed[0, 8] >> 4 == 0x8 and packed[0, 9] & 0xF == 0x8  # elements 17 (-0.1), 18 (-0.25)
    # scale choice: floor(log2(amax)) - 2, per block of 32 along the last dim
    x = torch.zeros(2, 64)
    x[0, 0], x[0, 40], x[1, 5], x[1, 63] = 1.0, 7.99, 0.3, -1000.0
    _, s = quantize_mxfp4(x)
    expect = [
        [math.floor(math.log2(a)) - 2 + 127 for a in row] for row in ((1.0, 7.99), (0.3, 1000.0))
    ]
    assert s.tolist() == expect


def test_zero_and_tiny_blocks():
    packed, scales = quantize_mxfp4(torch.zeros(2, 32))
    assert scales.tolist() == [[0], [0]] and packed.eq(0).all()
    tiny = torch.full((1, 32), 2.0**-130)  # floor(log2) - 2 < -127: clamped to byte 0 (2**-127)
    packed, scales = quantize_mxfp4(tiny)
    assert scales.tolist() == [[0]]
    assert torch.equal(dequantize_mxfp4(packed, scales), torch.full((1, 32), 0.0))  # 2**-3 -> 0
    tiny[0, 0] = 2.0**-125  # 4 * 2**-127: representable exactly
    assert dequantize_mxfp4(*quantize_mxfp4(tiny))[0, 0].item() == 2.0**-125


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_a_clear_error(bad):
    w = torch.randn(4, 64)
    w[2, 33] = bad
    with pytest.raises(ValueError, match=r"experts\.3\.w1\.weight has 1 NaN/inf value"):
        quantize_mxfp4(w, "experts.3.w1.weight")
    # the training path never syncs: the block goes NaN (and the step's NaN check fires)
    out = mxfp4_round_trip(w)
    assert out[2, 32:].isnan().all() and out[2, :32].isfinite().all() and out[:2].isfinite().all()


def test_width_not_a_multiple_of_32_is_a_clear_error():
    with pytest.raises(
        ValueError, match="w2 reduction width.*=48 is not a multiple of the MXFP4 block size 32"
    ):
        quantize_mxfp4(torch.randn(4, 48), "w2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_idempotent_and_exact_in_dtype(dtype):
    w = (torch.randn(8, 256) * torch.exp(torch.randn(8, 256))).to(dtype)
    q = mxfp4_round_trip(w)
    assert q.dtype == dtype
    assert torch.equal(mxfp4_round_trip(q), q)
    packed, scales = quantize_mxfp4(w)
    deq = dequantize_mxfp4(packed, scales, dtype)
    assert deq.dtype == dtype and torch.equal(deq, q)
    assert torch.equal(quantize_mxfp4(q)[0], packed) and torch.equal(quantize_mxfp4(q)[1], scales)
    # a real approximation: at most half a code step of the block (relative 1/4 of 2**s * 2)
    s = 2.0 ** (torch.floor(torch.log2(w.float().reshape(8, 8, 32).abs().amax(-1))) - 2)
    err = (q.float() - w.float()).reshape(8, 8, 32).abs().amax(-1)
    assert (err <= s * 2 + 1e-30).all() and (err > 0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_straight_through_gradient(dtype):
    """In the weight's dtype (the GEMM takes it with bf16 activations), gradient unchanged."""
    w = torch.randn(6, 64, dtype=dtype, requires_grad=True)
    upstream = torch.randn(6, 64, dtype=dtype)
    out = fake_quantize_mxfp4(w)
    assert out.dtype == dtype and torch.equal(out.detach(), mxfp4_round_trip(w.detach()))
    out.backward(upstream)
    assert w.grad.dtype == dtype and torch.equal(w.grad, upstream)


def test_dequantize_rejects_bad_tensors():
    packed, scales = quantize_mxfp4(torch.randn(2, 64))
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(packed, scales[:, :1])
    with pytest.raises(ValueError, match="NaN byte 255"):
        dequantize_mxfp4(packed, torch.full_like(scales, 255))
    # signed bytes would shift the sign into the high nibble and index the code table from the end
    with pytest.raises(
        ValueError, match="must be uint8, got packed torch.int8 and scales torch.uint8"
    ):
        dequantize_mxfp4(packed.view(torch.int8), scales)
    with pytest.raises(
        ValueError, match="must be uint8, got packed torch.uint8 and scales torch.float32"
    ):
        dequantize_mxfp4(packed, scales.float())
    # 24 bytes = 48 values: not whole blocks, even though 48 // 32 = 1 scale column is given
    with pytest.raises(
        ValueError, match=r"scales of shape \(2, 1\) do not fit packed values of shape \(2, 24\)"
    ):
        dequantize_mxfp4(packed[:, :24], scales[:, :1])


def test_leading_dims_and_storage_cost():
    """A stacked [E, N, K] weight quantizes block-wise along K exactly like each [N, K] slice, and
    the bytes stored are BITS_PER_PARAM = 4.25 bits per value (a nibble + a byte per 32)."""
    from megatron_latentmoe.ops import mxfp4

    w = torch.randn(3, 5, 96) * torch.exp(torch.randn(3, 5, 96))
    packed, scales = quantize_mxfp4(w)
    assert packed.shape == (3, 5, 48) and scales.shape == (3, 5, 3)
    for e in range(3):
        p, s = quantize_mxfp4(w[e])
        assert torch.equal(packed[e], p) and torch.equal(scales[e], s)
    assert torch.equal(dequantize_mxfp4(packed, scales), mxfp4_round_trip(w))
    assert torch.equal(mxfp4_round_trip(w)[1], mxfp4_round_trip(w[1]))
    stored_bits = 8 * (packed.numel() + scales.numel())
    assert mxfp4.BITS_PER_PARAM == 4.25 == stored_bits / w.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_model_dequantizer_equals_ours_on_several_blocks(dtype):
    """The HF remote code carries its own copy of the dequantizer (it loads without this package):
    bit for bit ``ops.mxfp4.dequantize_mxfp4`` on weights of several blocks per row, scales
    spread over the E8M0 range. The exported test model has one block per row (width 32), where a
    block cut across instead of along each row gives the same numbers."""
    from megatron_latentmoe.hf import modeling_stable_latentmoe as modeling

    g = torch.Generator().manual_seed(1)
    block_scale = torch.exp2(torch.randint(-100, 100, (2, 5, 4, 1), generator=g).float())
    w = (torch.randn(2, 5, 4, 32, generator=g) * block_scale).reshape(2, 5, 128)
    packed, scales = quantize_mxfp4(w)
    assert scales.shape == (2, 5, 4) and len(scales.unique()) > 30
    got = modeling.dequantize_mxfp4(packed, scales, dtype)
    assert got.dtype == dtype and torch.equal(got, dequantize_mxfp4(packed, scales, dtype))
    assert torch.equal(got.signbit(), dequantize_mxfp4(packed, scales, dtype).signbit())
