"""SiTU-GLU (SPEC §2): formula, gradients, dtype handling, bound, SwiGLU limit, memory, layout."""

import math
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron_latentmoe.hf.modeling_stable_latentmoe import (
    situ_glu as situ_glu_reference,
)
from megatron_latentmoe.ops.situ import (
    DEFAULT_SITU_BETA,
    DEFAULT_SITU_LINEAR_BETA,
    SiTUGLU,
    situ_glu_packed,
)

B1, B2 = DEFAULT_SITU_BETA, DEFAULT_SITU_LINEAR_BETA


def situ_glu(g, u, beta=B1, linear_beta=B2):
    """The op on separate gate / up tensors: packed [g | u], the layout SiTUGLU is handed."""
    return situ_glu_packed(torch.cat([g, u], -1), beta, linear_beta)


def formula_fp64(g, u, b1=B1, b2=B2):
    """SPEC §2 written out directly, in fp64."""
    g, u = g.double(), u.double()
    return (b1 * torch.tanh(g / b1)) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


def swiglu_fp64(g, u):
    g, u = g.double(), u.double()
    return g * torch.sigmoid(g) * u


def _inputs(shape, scale=1.0, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    u = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    return g, u


def saved_bytes(fn, *tensors):
    """Bytes autograd keeps for backward while running fn(*tensors) (via saved_tensors_hooks)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*tensors)
    # count each storage once (two views of one buffer are one allocation)
    seen, total = set(), 0
    for t in saved:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return out, saved, total


# ---------------------------------------------------------------------------- formula


@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0])
def test_formula_matches_direct_fp64(scale):
    g, u = _inputs((257, 33), scale)
    out = situ_glu(g, u)
    assert out.dtype == torch.float32 and out.shape == g.shape
    torch.testing.assert_close(out.double(), formula_fp64(g, u), rtol=2e-6, atol=1e-6)
    g64, u64 = g.double(), u.double()
    torch.testing.assert_close(situ_glu(g64, u64), formula_fp64(g64, u64), rtol=1e-13, atol=1e-13)


def test_formula_custom_betas_and_hf_situandmul():
    g, u = _inputs((64, 16), 5.0, torch.float64)
    torch.testing.assert_close(situ_glu(g, u, 2.0, 7.0), formula_fp64(g, u, 2.0, 7.0))
    # The HF reference (seed 000, SituAndMul): split the packed tensor, fp32 math, cast back.
    x = torch.cat([g, u], -1).to(torch.bfloat16)
    gate, up = x[..., :16].float(), x[..., 16:].float()
    hf = ((B1 * torch.tanh(gate / B1) * torch.sigmoid(gate)) * (B2 * torch.tanh(up / B2))).to(
        x.dtype
    )
    assert torch.equal(situ_glu_packed(x), hf)


def test_reference_matches_function():
    g, u = _inputs((100, 10), 4.0)
    # to the last fp32 bit: the packed op reads strided halves, which round apart by 1 ulp
    torch.testing.assert_close(situ_glu(g, u), situ_glu_reference(g, u), rtol=2**-22, atol=0)


# ---------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("scale", [0.5, 4.0, 40.0])
def test_gradcheck_fp64_both_inputs(scale):
    g, u = _inputs((6, 5), scale, torch.float64, seed=1)
    g.requires_grad_(True)
    u.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b), (g, u))
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, 1.5, 3.0), (g, u))


def test_gradcheck_packed_and_single_input():
    x = (torch.randn(3, 4, 10, dtype=torch.float64) * 3).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: situ_glu_packed(a), (x,))
    g, u = _inputs((5, 4), 3.0, torch.float64)
    g.requires_grad_(True)  # u needs no grad
    assert torch.autograd.gradcheck(lambda a: situ_glu(a, u), (g,))
    g2 = g.detach()
    u.requires_grad_(True)  # g needs no grad
    assert torch.autograd.gradcheck(lambda b: situ_glu(g2, b), (u,))


def test_grad_matches_autograd_of_reference_fp32():
    g, u = _inputs((300, 20), 6.0)
    g1, u1 = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    g2, u2 = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    w = torch.randn(300, 20)
    (situ_glu(g1, u1) * w).sum().backward()
    (situ_glu_reference(g2, u2) * w).sum().backward()
    torch.testing.assert_close(g1.grad, g2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(u1.grad, u2.grad, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_in_out_fp32_inside(dtype):
    # 32 seeded draws: a 1-ulp difference of the fp32 math only shows where it crosses a bf16 /
    # fp16 rounding boundary (upcasting gate and up separately failed 3 bf16 and 5 fp16 seeds of
    # these on AVX-512)
    for seed in range(32):
        g, u = _inputs((512, 24), 8.0, dtype, seed=seed)
        out = situ_glu(g, u)
        assert out.dtype == dtype
        # fp32 internal math: exactly the fp32 path on the same (upcast) values, rounded once.
        assert torch.equal(out, situ_glu(g.float(), u.float()).to(dtype)), seed
        # ... closer to the exact value than the same formula computed natively in `dtype`.
        exact = formula_fp64(g, u)
        native = (B1 * torch.tanh(g / B1)) * torch.sigmoid(g) * (B2 * torch.tanh(u / B2))
        assert (out.double() - exact).abs().sum() < (native.double() - exact).abs().sum()
        # gradients: returned in the input dtype, equal to the fp32 path's gradients rounded once
        gl, ul = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
        gf, uf = g.float().requires_grad_(True), u.float().requires_grad_(True)
        grad = _inputs((512, 24), 1.0, dtype, seed=1000 + seed)[0]
        situ_glu(gl, ul).backward(grad)
        situ_glu(gf, uf).backward(grad.float())
        assert gl.grad.dtype == dtype and ul.grad.dtype == dtype
        assert torch.equal(gl.grad, gf.grad.to(dtype)), seed
        assert torch.equal(ul.grad, uf.grad.to(dtype)), seed


# ---------------------------------------------------------------------------- bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_output_bounded_on_huge_inputs(dtype):
    vals = torch.tensor([-1e4, -1e3, -50.0, -5.0, 0.0, 5.0, 50.0, 1e3, 1e4], dtype=dtype)
    g, u = torch.meshgrid(vals, vals, indexing="ij")
    g, u = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    out = situ_glu(g, u)
    assert torch.isfinite(out).all()
    # mathematically |out| < b1*b2; in floating point tanh/sigmoid round to 1 at +-1e4
    assert out.abs().max().item() <= B1 * B2
    assert out.abs().max().item() >= 0.999 * B1 * B2  # ... and the bound is approached
    out.sum().backward()
    assert torch.isfinite(g.grad).all() and torch.isfinite(u.grad).all()
    # random huge inputs
    gr, ur = _inputs((4096,), 1e4, dtype)
    assert situ_glu(gr, ur).abs().max().item() <= B1 * B2


def test_strict_bound_fp64_and_infinities():
    g, u = _inputs((10000,), 10.0, torch.float64)
    assert situ_glu(g, u).abs().max().item() < B1 * B2
    inf = torch.tensor([math.inf, -math.inf, math.inf, -math.inf])
    out = situ_glu(inf, torch.tensor([math.inf, math.inf, -math.inf, -math.inf]))
    assert torch.equal(out, torch.tensor([100.0, 0.0, -100.0, 0.0]))


def test_bound_with_custom_betas():
    g, u = _inputs((5000,), 1e3)
    assert situ_glu(g, u, 2.0, 3.0).abs().max().item() <= 6.0


# ---------------------------------------------------------------------------- SwiGLU relations


def test_swiglu_limit_monotone():
    g, u = _inputs((2000,), 3.0, torch.float64)
    ref = swiglu_fp64(g, u)
    errs = []
    for beta in [3.0, 10.0, 1e2, 1e3, 1e4, 1e5, 1e6]:
        errs.append((situ_glu(g, u, beta, beta) - ref).abs().max().item())
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False)), errs
    assert errs[-1] < 1e-6, errs


def test_first_order_equal_to_swiglu_near_zero():
    g, u = _inputs((500,), 1.0, torch.float64)
    rel_errs = []
    for eps in [1e-1, 1e-2, 1e-3]:
        ge, ue = g * eps, u * eps
        a, b = situ_glu(ge, ue), swiglu_fp64(ge, ue)
        rel_errs.append(((a - b).abs() / b.abs().clamp_min(1e-300)).max().item())
        # softcap(x, b) = x - x^3 / (3 b^2) + ...: the gate factor and silu agree to first order
        gate_factor = B1 * torch.tanh(ge / B1) * torch.sigmoid(ge)
        # silu(g) - softcap(g, b1) sigmoid(g) = sigmoid(g) (g - b1 tanh(g / b1)),
        # and |g - b1 tanh(g / b1)| <= |g|^3 / (3 b1^2)
        bound = torch.sigmoid(ge) * ge.abs() ** 3 / (3 * B1**2)
        assert ((gate_factor - F.silu(ge)).abs() <= bound * (1 + 1e-6) + 1e-18).all()
    # relative error falls like eps^2 (i.e. the difference is third order in the inputs)
    assert rel_errs[1] < rel_errs[0] / 50 and rel_errs[2] < rel_errs[1] / 50, rel_errs
    assert rel_errs[2] < 1e-6
    # Jacobian near 0 agrees with SwiGLU's
    x0g, x0u = g[:8] * 1e-3, u[:8] * 1e-3
    jg = torch.autograd.functional.jacobian(lambda a, b: situ_glu(a, b), (x0g, x0u))
    js = torch.autograd.functional.jacobian(swiglu_fp64, (x0g, x0u))
    for a, b in zip(jg, js, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)


# ---------------------------------------------------------------------------- memory


def test_memory_lean_packed_saves_only_x():
    x = torch.randn(128, 2 * 48, dtype=torch.bfloat16, requires_grad=True)
    out, saved, nbytes = saved_bytes(situ_glu_packed, x)
    assert len(saved) == 1 and saved[0].data_ptr() == x.data_ptr()
    assert nbytes == x.numel() * x.element_size()
    # and the node holds nothing else: the gradient flows straight to the input
    assert out.grad_fn.next_functions[0][0].variable is x
    # fewer bytes than SwiGLU itself (silu(g) * u saves g, silu(g) and u)
    x2 = x.detach().clone().requires_grad_(True)
    _, _, nbytes_swiglu = saved_bytes(lambda t: F.silu(t[..., :48]) * t[..., 48:], x2)
    assert nbytes <= nbytes_swiglu
    # a naive autograd composition keeps the fp32 upcasts and intermediates
    g, u = (t.detach().clone().requires_grad_(True) for t in (x[:, :48], x[:, 48:]))
    out_naive, saved_naive, nbytes_naive = saved_bytes(situ_glu_reference, g, u)
    torch.testing.assert_close(out, out_naive)
    assert len(saved_naive) > len(saved)
    assert nbytes_naive >= 3 * nbytes, (nbytes_naive, nbytes)


def test_inplace_modification_of_saved_input_is_detected():
    g, u = _inputs((8, 4), 1.0)
    g.requires_grad_(True)
    h = torch.cat([g, u], -1) * 1.0
    out = situ_glu_packed(h)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ---------------------------------------------------------------------------- packed layout


def test_packed_layout_gate_first_then_up():
    g, u = _inputs((2, 3, 5, 7), 4.0, torch.float64)
    x = torch.cat([g, u], dim=-1).requires_grad_(True)
    out = situ_glu_packed(x)
    assert out.shape == (2, 3, 5, 7)
    torch.testing.assert_close(out, formula_fp64(g, u), rtol=1e-14, atol=1e-14)
    gg, uu = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    grad = torch.randn_like(out)
    out.backward(grad)
    situ_glu(gg, uu).backward(grad)
    torch.testing.assert_close(x.grad, torch.cat([gg.grad, uu.grad], -1), rtol=1e-14, atol=1e-14)
    # swapping the halves is a different function (guards against an up|gate mix-up)
    assert not torch.allclose(situ_glu_packed(torch.cat([u, g], -1)), out)


def test_packed_non_contiguous_and_empty():
    base = torch.randn(10, 3, 8)
    x = base.transpose(0, 1)  # non-contiguous
    torch.testing.assert_close(
        situ_glu_packed(x), situ_glu(x[..., :4], x[..., 4:]), rtol=1e-6, atol=1e-6
    )
    e = torch.zeros(0, 8, requires_grad=True)  # an expert that received no tokens
    out = situ_glu_packed(e)
    assert out.shape == (0, 4)
    out.sum().backward()
    assert e.grad.shape == (0, 8)
    z = torch.zeros(3, 0, requires_grad=True)  # zero-width (F = 0)
    situ_glu_packed(z).sum().backward()
    assert z.grad.shape == (3, 0)


def test_packed_bad_shapes():
    with pytest.raises(ValueError, match="even"):
        situ_glu_packed(torch.randn(3, 5))
    with pytest.raises(ValueError, match="even"):
        situ_glu_packed(torch.tensor(1.0))
    with pytest.raises(TypeError, match="floating-point"):
        situ_glu_packed(torch.ones(6, dtype=torch.int64))


# ---------------------------------------------------------------------------- betas


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, math.inf, math.nan, "4", None, True])
@pytest.mark.parametrize("which", ["beta", "linear_beta"])
def test_bad_beta_raises(bad, which):
    g, u = _inputs((3,), 1.0)
    kwargs = {which: bad}
    with pytest.raises(ValueError) as ei:
        situ_glu(g, u, **kwargs)
    msg = str(ei.value)
    assert which in msg and repr(bad) in msg and "a positive finite number" in msg
    with pytest.raises(ValueError, match=which):
        situ_glu_packed(torch.cat([g, u]), **kwargs)


def test_beta_any_real_number_as_its_float():
    """The fields' rule (a positive finite number) on the float a ``numbers.Real`` equals: NumPy
    scalars and fractions pass as their value; one whose float is 0 is refused (it would divide
    by zero in the softcap)."""
    import fractions

    import numpy as np

    x = torch.randn(3, 6, dtype=torch.float64)
    for b1, b2 in ((np.float32(2.0), np.int64(9)), (fractions.Fraction(1, 2), np.float64(25.0))):
        torch.testing.assert_close(
            situ_glu_packed(x, b1, b2), formula_fp64(x[..., :3], x[..., 3:], float(b1), float(b2))
        )
        assert SiTUGLU(beta=b1, linear_beta=b2).beta == float(b1)
    tiny = fractions.Fraction(1, 10**400)
    with pytest.raises(ValueError) as ei:
        situ_glu_packed(x, beta=tiny)
    assert str(ei.value) == f"beta={tiny!r} is not allowed: a positive finite number"


# ---------------------------------------------------------------------------- module


def test_module_reads_config_and_kwargs_override():
    cfg = types.SimpleNamespace(activation_situ_beta=2.0, activation_situ_linear_beta=9.0)
    m = SiTUGLU(config=cfg)
    assert (m.beta, m.linear_beta) == (2.0, 9.0)
    assert list(m.parameters()) == [] and list(m.buffers()) == []
    x = torch.randn(4, 6, 10, dtype=torch.float64)
    torch.testing.assert_close(m(x), formula_fp64(x[..., :5], x[..., 5:], 2.0, 9.0))
    assert SiTUGLU(config=cfg, beta=3.0).beta == 3.0
    assert SiTUGLU(config=cfg, linear_beta=3.0).linear_beta == 3.0
    d = SiTUGLU()
    assert (d.beta, d.linear_beta) == (B1, B2)
    # a config without the fields (plain TransformerConfig) falls back to the SPEC defaults
    assert SiTUGLU(config=types.SimpleNamespace()).beta == B1
    assert "beta=2.0" in repr(m)


def test_module_bad_config_beta():
    with pytest.raises(ValueError, match="activation_situ_beta.*-1"):
        SiTUGLU(config=types.SimpleNamespace(activation_situ_beta=-1.0))
    with pytest.raises(ValueError, match="activation_situ_linear_beta"):
        SiTUGLU(linear_beta=0.0)


def test_module_in_megatron_mlp():
    """Megatron builds it as submodules.activation_func(config=config) and calls it on the packed
    fc1 output (use_te_activation_func=True; config.activation_func must stay F.silu to pass
    TransformerConfig's validation)."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    class LocalLinear(torch.nn.Linear):
        def __init__(self, in_f, out_f, *, config, init_method, bias, **kwargs):
            super().__init__(in_f, out_f, bias=False)

        def forward(self, x):
            return super().forward(x), None

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        ffn_hidden_size=6,
        num_attention_heads=1,
        gated_linear_unit=True,
        activation_func=F.silu,
        use_te_activation_func=True,
        bias_activation_fusion=False,
        add_bias_linear=False,
    )
    cfg.activation_situ_beta, cfg.activation_situ_linear_beta = 2.0, 3.0
    mlp = MLP(
        cfg,
        MLPSubmodules(linear_fc1=LocalLinear, linear_fc2=LocalLinear, activation_func=SiTUGLU),
        ffn_hidden_size=6,
    )
    assert isinstance(mlp.activation_func, SiTUGLU) and mlp.activation_func.beta == 2.0
    x = torch.randn(5, 2, 8)
    y, _ = mlp(x)
    h = mlp.linear_fc1(x)[0]
    ref = mlp.linear_fc2(situ_glu(h[..., :6], h[..., 6:], 2.0, 3.0))[0]
    torch.testing.assert_close(y, ref)


def test_situ_module_does_not_import_megatron():
    code = (
        "import sys, megatron_latentmoe.ops.situ, megatron_latentmoe.ops\n"
        "bad = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- blocking, autocast


@pytest.mark.parametrize("block", [1, 7, 16, 64, 1 << 18])
def test_blocked_math_matches_unblocked(monkeypatch, block):
    import megatron_latentmoe.ops.situ as situ_mod

    x = (torch.randn(3, 11, 2 * 9, dtype=torch.float64) * 4).requires_grad_(True)
    grad = torch.randn(3, 11, 9, dtype=torch.float64)
    monkeypatch.setattr(situ_mod, "CPU_BLOCK_ELEMS", block)
    out = situ_glu_packed(x)
    out.backward(grad)
    gg, uu = (x.detach()[..., s].clone().requires_grad_(True) for s in (slice(9), slice(9, 18)))
    ref = formula_fp64(gg, uu)
    torch.testing.assert_close(out, ref, rtol=1e-14, atol=1e-14)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, torch.cat([gg.grad, uu.grad], -1), rtol=1e-12, atol=1e-12)


def test_autocast_does_not_lower_the_math():
    g, u = _inputs((64, 32), 5.0)
    ref = situ_glu(g, u)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = situ_glu(g, u)
    assert out.dtype == torch.float32 and torch.equal(out, ref)


# ---------------------------------------------------------------------------- compiled CPU path


def test_fused_formula_matches_fp64_reference():
    """The exp-based formula the compiled CPU path (and the Triton kernels) use, run eagerly in
    fp32, against the fp64 reference: values, both gradients, across the series / exp switch."""
    import megatron_latentmoe.ops.situ as situ_mod

    mags = torch.logspace(-8, 4, 2000, dtype=torch.float64)
    g = torch.cat([mags, -mags, mags, -mags])
    u = torch.cat([mags.flip(0), mags, -mags, -mags.flip(0)])
    grad = torch.randn(g.shape, dtype=torch.float64)
    out = situ_mod._fused_forward(g.float(), u.float(), B1, B2)
    dg, du = situ_mod._fused_backward(g.float(), u.float(), grad.float(), B1, B2)
    gg, uu = g.float().double().requires_grad_(True), u.float().double().requires_grad_(True)
    ref = formula_fp64(gg, uu)
    ref.backward(grad.float().double())
    rel = ((out.double() - ref) / ref.abs().clamp_min(1e-30)).abs().max().item()
    assert rel < 2e-6, rel
    torch.testing.assert_close(dg.double(), gg.grad, rtol=2e-6, atol=2e-5)
    torch.testing.assert_close(du.double(), uu.grad, rtol=2e-6, atol=2e-5)
    assert out.abs().max().item() <= B1 * B2


def test_fused_tanh_series_truncation_error():
    """``_tanh_sech2`` in fp64, so that only the formula's own error shows: below |x| = 1/4 the
    Taylor series up to x^9 is off by its first dropped term, 1382/155925 |x|^11, at most
    8.5e-9 relative to tanh(x) (1.1e-9 for sech^2); above, the exp formula is exact to fp64
    rounding. (The fp32 test above, 2e-6, cannot see a wrong x^9 coefficient: 3.3e-7.)"""
    import megatron_latentmoe.ops.situ as situ_mod

    x = torch.linspace(-0.3, 0.3, 6001, dtype=torch.float64)
    t, sech2 = situ_mod._tanh_sech2(x)
    ref = torch.tanh(x)
    nonzero = x != 0
    t_rel = ((t - ref)[nonzero] / ref[nonzero]).abs().max().item()
    sech2_rel = ((sech2 - (1 - ref * ref)) / (1 - ref * ref)).abs().max().item()
    assert t_rel < 1e-8, t_rel
    assert sech2_rel < 2e-9, sech2_rel
    assert torch.equal(t[~nonzero], ref[~nonzero])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_formula_low_precision_is_fp32_rounded_once(dtype):
    """The fused formula (compiled CPU path, run eagerly here) on bf16 / fp16 inputs computes in
    fp32 and rounds once: bit-equal to the fp32 call on the upcast inputs, cast back, in the
    input's dtype (gradients too)."""
    import megatron_latentmoe.ops.situ as situ_mod

    g, u = _inputs((64, 48), 4.0, dtype=dtype, seed=7)
    grad = _inputs((64, 48), 1.0, dtype=dtype, seed=8)[0]
    out = situ_mod._fused_forward(g, u, B1, B2)
    dg, du = situ_mod._fused_backward(g, u, grad, B1, B2)
    ref = situ_mod._fused_forward(g.float(), u.float(), B1, B2)
    ref_dg, ref_du = situ_mod._fused_backward(g.float(), u.float(), grad.float(), B1, B2)
    for got, want in ((out, ref), (dg, ref_dg), (du, ref_du)):
        assert got.dtype == dtype
        assert torch.equal(got, want.to(dtype)), (got.float() - want).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cpu_path_matches_eager(monkeypatch, dtype):
    """Above COMPILE_MIN_ELEMS the CPU op runs the torch.compile'd loop: same values and gradients
    as the eager math within fp32 rounding (bf16: within one output rounding), input-only saved."""
    import megatron_latentmoe.ops.situ as situ_mod

    x = (torch.randn(64, 2 * 48, dtype=torch.float64) * 4).to(dtype)
    grad = torch.randn(64, 48, dtype=torch.float64).to(dtype)
    results = {}
    for name, threshold in (("eager", 1 << 62), ("compiled", 1)):
        monkeypatch.setattr(situ_mod, "COMPILE_MIN_ELEMS", threshold)
        assert situ_mod._path(x, 64 * 48) == name
        xp = x.clone().requires_grad_(True)
        _, saved, _ = saved_bytes(situ_glu_packed, xp)
        assert len(saved) == 1 and saved[0] is xp
        out = situ_glu_packed(xp)
        out.backward(grad)
        results[name] = (out, xp.grad)
    assert not situ_mod._compile_failed
    rtol, atol = (2e-6, 2e-5) if dtype == torch.float32 else (2**-7, 1e-2)
    for a, b in zip(results["compiled"], results["eager"], strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol)


def test_compiling_turned_off_runs_the_eager_math(monkeypatch):
    """``set_cpu_compile(False)`` (the entry point's ``--disable-jit-fuser``) keeps tensors above
    COMPILE_MIN_ELEMS on the eager math, and on again compiles them."""
    import megatron_latentmoe.ops.situ as situ_mod

    monkeypatch.setattr(situ_mod, "_compile_enabled", True)
    x = torch.randn(8, 2 * 4)
    big = situ_mod.COMPILE_MIN_ELEMS
    assert situ_mod._path(x, big) == "compiled"
    situ_mod.set_cpu_compile(False)
    assert situ_mod._path(x, big) == "eager"
    assert situ_mod._path(x.double(), big) == "eager"
    situ_mod.set_cpu_compile(True)
    assert situ_mod._path(x, big) == "compiled"


def test_only_fused_dtypes_and_non_empty_tensors_leave_the_eager_math(monkeypatch):
    """fp64 (gradcheck, references) and empty tensors stay on the eager math even where the size
    threshold would send them to the compiled path."""
    import megatron_latentmoe.ops.situ as situ_mod

    monkeypatch.setattr(situ_mod, "_compile_enabled", True)
    monkeypatch.setattr(situ_mod, "_compile_failed", False)
    x = torch.randn(8, 2 * 4)
    big = situ_mod.COMPILE_MIN_ELEMS
    assert [situ_mod._path(x.to(dt), big) for dt in situ_mod.FUSED_DTYPES] == ["compiled"] * 3
    assert situ_mod._path(x.double(), big) == "eager"
    monkeypatch.setattr(situ_mod, "COMPILE_MIN_ELEMS", 0)
    assert situ_mod._path(x, 1) == "compiled"
    assert situ_mod._path(x, 0) == "eager"


def test_a_compiler_failure_falls_back_to_the_eager_math_for_good(monkeypatch):
    """If inductor cannot compile, the op warns once, returns the eager result, and every later
    call above the threshold takes the eager math without trying to compile again."""
    import megatron_latentmoe.ops.situ as situ_mod

    calls = []

    def broken(name):
        calls.append(name)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(situ_mod, "_compiled", broken)
    monkeypatch.setattr(situ_mod, "_compile_enabled", True)
    monkeypatch.setattr(situ_mod, "_compile_failed", False)
    monkeypatch.setattr(situ_mod, "COMPILE_MIN_ELEMS", 1)
    g, u = _inputs((4, 6), 3.0)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        out = situ_glu(g, u)
    assert calls == ["fwd"] and situ_mod._compile_failed
    assert situ_mod._path(g, 24) == "eager"
    torch.testing.assert_close(out.double(), formula_fp64(g, u), rtol=1e-6, atol=1e-6)
    again = situ_glu(g, u)
    assert calls == ["fwd"] and torch.equal(again, out)


def test_compiled_path_plumbing_with_the_formula_run_eagerly(monkeypatch):
    """The compiled CPU path's calls, with ``torch.compile`` replaced by the plain functions (no
    compile cost): taken from rows x F = COMPILE_MIN_ELEMS output elements on (counted over all
    leading dims), handed the gate / up halves, its results reshaped back; values and gradients
    equal the eager math within fp32 rounding, on a 3-d non-contiguous input."""
    import megatron_latentmoe.ops.situ as situ_mod

    fns = {"fwd": situ_mod._fused_forward, "bwd_packed": situ_mod._fused_backward_packed}
    calls = []

    def plain(name):
        calls.append(name)
        return fns[name]

    monkeypatch.setattr(situ_mod, "_compiled", plain)
    monkeypatch.setattr(situ_mod, "_compile_enabled", True)
    monkeypatch.setattr(situ_mod, "_compile_failed", False)
    base = torch.randn(3, 2 * 8, 11, dtype=torch.float64) * 4
    x64 = base.transpose(1, 2)  # [3, 11, 16], non-contiguous
    grad = torch.randn(3, 11, 8, dtype=torch.float64)
    results = {}
    for name, threshold in (("eager", 3 * 11 * 8 + 1), ("compiled", 3 * 11 * 8)):
        monkeypatch.setattr(situ_mod, "COMPILE_MIN_ELEMS", threshold)
        xp = x64.float().requires_grad_(True)
        out = situ_glu_packed(xp)
        out.backward(grad.float())
        results[name] = (out, xp.grad)
    assert calls == ["fwd", "bwd_packed"]
    gg, uu = (x64[..., s].clone().requires_grad_(True) for s in (slice(8), slice(8, 16)))
    ref = formula_fp64(gg, uu)
    ref.backward(grad)
    for out, dx in results.values():
        assert out.shape == (3, 11, 8) and dx.shape == (3, 11, 16)
        torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(
            dx.double(), torch.cat([gg.grad, uu.grad], -1), rtol=2e-5, atol=2e-5
        )
