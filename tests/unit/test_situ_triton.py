"""The fused SiTU-GLU Triton kernels (ops/situ_triton.py) on the CPU under TRITON_INTERPRET=1,
against the fp64 reference formula (the HF modeling file's ``situ_glu``): values, gradients, the
bound |out| <= b1*b2, dtypes in and out, and the autograd wiring ops/situ.py uses on CUDA
(saves only its input). tests/gpu/test_situ_cuda.py runs the same kernels compiled on a GPU."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from megatron_latentmoe.hf.modeling_stable_latentmoe import situ_glu as reference
from megatron_latentmoe.ops import situ

B1, B2 = situ.DEFAULT_SITU_BETA, situ.DEFAULT_SITU_LINEAR_BETA
# One rounding to the output dtype plus the kernel's fp32 error (<= 1e-6 relative, see
# situ_triton.py), as a relative tolerance; atol covers results that underflow. bf16 gets one
# whole ulp (2^-7): Triton's interpreter converts fp32 -> bf16 by truncation, where the GPU
# rounds to nearest (half an ulp; tests/gpu/test_situ_cuda.py checks that).
TOL = {torch.float32: (2e-6, 1e-6), torch.bfloat16: (2**-7, 1e-6), torch.float16: (2**-10, 1e-6)}
# Edge values: the series / exp switch at |x| = 1/4 (g / b1 and u / b2), tiny, huge, infinite.
EDGES = [0.0, 1e-7, -1e-7, 0.999, 1.0, -1.0, 1.001, 6.25, -6.25, 30.0, -30.0, 1e4, -1e4]


@pytest.fixture(scope="module")
def kern():
    """A private copy of ops/situ_triton.py whose kernels run in Triton's interpreter."""
    pytest.importorskip("triton")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")  # read when @triton.jit decorates, i.e. at module load
    path = Path(situ.__file__).with_name("situ_triton.py")
    spec = importlib.util.spec_from_file_location("situ_triton_interpreted", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    mp.undo()


def _packed(rows, f, dtype, scale=4.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * f, generator=gen, dtype=torch.float64) * scale
    edges = torch.tensor(EDGES, dtype=torch.float64)
    x[0, : len(EDGES)] = edges  # gate edges (paired with random up values)
    x[1, f : f + len(EDGES)] = edges  # up edges
    x[2, : len(EDGES)] = edges
    x[2, f : f + len(EDGES)] = edges.flip(0)
    return x.to(dtype)


def _ref_fwd_bwd(x, grad):
    """fp64 reference value and gradient on exactly the (dtype-rounded) inputs."""
    f = x.shape[-1] // 2
    xr = x.double().requires_grad_(True)
    out = reference(xr[:, :f], xr[:, f:], B1, B2)
    out.backward(grad.double())
    return out.detach(), xr.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernels_match_fp64_reference(kern, dtype):
    rows, f = 6, 1100  # F > BLOCK: two column programs per row, the second one masked
    x = _packed(rows, f, dtype)
    grad = torch.randn(rows, f, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = kern.situ_fwd(x[:, :f], x[:, f:], B1, B2)
    dx = torch.empty_like(x)
    kern.situ_bwd(x[:, :f], x[:, f:], grad, dx[:, :f], dx[:, f:], B1, B2)
    ref, ref_dx = _ref_fwd_bwd(x, grad)
    assert out.dtype == dtype and dx.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol * B1 * B2)
    # gradients: the same relative tolerance on the scale of |grad| * max|d out / d x|
    scale = grad.double().abs().max().item() * B1 * B2
    torch.testing.assert_close(dx.double(), ref_dx, rtol=rtol, atol=atol * scale)
    assert out.abs().max().item() <= B1 * B2


def test_fp32_error_is_small_everywhere(kern):
    """Largest fp32 errors over a sweep of magnitudes (printed for the report)."""
    f = 4096
    g = torch.logspace(-8, 4, f, dtype=torch.float64)
    x = torch.stack([torch.cat([g, g.flip(0)]), torch.cat([-g, g]), torch.cat([g, -g])]).float()
    grad = torch.ones(3, f)
    out = kern.situ_fwd(x[:, :f], x[:, f:], B1, B2)
    dx = torch.empty_like(x)
    kern.situ_bwd(x[:, :f], x[:, f:], grad, dx[:, :f], dx[:, f:], B1, B2)
    ref, ref_dx = _ref_fwd_bwd(x, grad)
    rel = ((out.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
    abs_dx = (dx.double() - ref_dx).abs().max().item()
    print(f"fp32 kernel vs fp64: max rel err out {rel:.2e}, max abs err grad {abs_dx:.2e}")
    assert rel < 2e-6, rel
    assert abs_dx < 2e-5, abs_dx


def test_bound_and_infinities(kern):
    inf = math.inf
    g = torch.tensor([[inf, -inf, inf, -inf, 1e30, -1e30]])
    u = torch.tensor([[inf, inf, -inf, -inf, 1e30, 1e30]])
    out = kern.situ_fwd(g, u, B1, B2)
    assert torch.equal(out, torch.tensor([[100.0, 0.0, -100.0, 0.0, 100.0, 0.0]]))
    dg, du = torch.empty_like(g), torch.empty_like(u)
    kern.situ_bwd(g, u, torch.ones_like(g), dg, du, B1, B2)
    assert torch.isfinite(dg).all() and torch.isfinite(du).all()
    x = _packed(4, 300, torch.float32, scale=1e4)
    assert kern.situ_fwd(x[:, :300], x[:, 300:], 2.0, 3.0).abs().max().item() <= 6.0


def test_custom_betas_and_strided_rows(kern):
    # the halves of a wider buffer: row stride 2F + 6, unit column stride
    base = torch.randn(5, 2 * 70 + 6, dtype=torch.float64).float() * 3
    g, u = base[:, 3:73], base[:, 73:143]
    out = kern.situ_fwd(g, u, 1.5, 7.0)
    torch.testing.assert_close(
        out.double(), reference(g.double(), u.double(), 1.5, 7.0), rtol=2e-6, atol=1e-6
    )
    with pytest.raises(ValueError, match="unit column stride"):
        kern.situ_fwd(g.t(), u.t(), B1, B2)


def test_autograd_wiring_used_on_cuda(kern, monkeypatch):
    """ops/situ.py's CUDA path, run here with the interpreted kernels: same values and gradients
    as the fp64 reference, only the input saved."""
    monkeypatch.setattr(situ, "_triton_ops", lambda: kern)
    monkeypatch.setattr(situ, "_path", lambda t, n: "triton" if n else "eager")
    x = _packed(3, 40, torch.bfloat16).reshape(3, 1, 80).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = situ.situ_glu_packed(x)
    assert len(saved) == 1 and saved[0] is x
    grad = torch.randn(3, 1, 40).to(torch.bfloat16)
    out.backward(grad)
    ref, ref_dx = _ref_fwd_bwd(x.detach().reshape(3, 80), grad.reshape(3, 40))
    rtol, atol = TOL[torch.bfloat16]
    torch.testing.assert_close(out.double().reshape(3, 40), ref, rtol=rtol, atol=atol * B1 * B2)
    scale = grad.double().abs().max().item() * B1 * B2
    torch.testing.assert_close(x.grad.double().reshape(3, 80), ref_dx, rtol=rtol, atol=atol * scale)
