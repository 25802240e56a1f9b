"""The fused SiTU-GLU Triton kernels compiled for the GPU (CUDA only; the interpreter twin is
tests/unit/test_situ_triton.py): values and gradients against the fp64 reference with the GPU's
round-to-nearest output conversion, and proof that routed experts, shared experts and dense
MLPs of both specs call them on CUDA."""

import pytest
import torch

from megatron_latentmoe.hf.modeling_stable_latentmoe import situ_glu as reference
from megatron_latentmoe.ops import situ, situ_triton

pytestmark = pytest.mark.gpu
B1, B2 = situ.DEFAULT_SITU_BETA, situ.DEFAULT_SITU_LINEAR_BETA
# half an ulp of the output dtype (round to nearest) + the kernel's fp32 error (~1e-6 relative)
RTOL = {torch.float32: 2e-6, torch.bfloat16: 2**-8 + 2e-6, torch.float16: 2**-11 + 2e-6}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernels_on_gpu_match_fp64(dtype):
    rows, f = 4096, 3072
    x = (torch.randn(rows, 2 * f, device="cuda", dtype=torch.float64) * 4).to(dtype)
    grad = torch.randn(rows, f, device="cuda").to(dtype)
    assert situ._path(x, rows * f) == "triton"
    xt = x.clone().requires_grad_(True)
    out = situ.situ_glu_packed(xt)
    out.backward(grad)
    xr = x.double().requires_grad_(True)
    ref = reference(xr[:, :f], xr[:, f:], B1, B2)
    ref.backward(grad.double())
    rtol = RTOL[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=1e-6 * B1 * B2)
    scale = grad.double().abs().max().item() * B1 * B2
    torch.testing.assert_close(xt.grad.double(), xr.grad, rtol=rtol, atol=1e-6 * scale)
    assert out.abs().max().item() <= B1 * B2


def _count_kernel_calls(monkeypatch):
    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = situ_triton.situ_fwd, situ_triton.situ_bwd

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(situ_triton, "situ_fwd", count("fwd", fwd))
    monkeypatch.setattr(situ_triton, "situ_bwd", count("bwd", bwd))
    return calls


@pytest.mark.parametrize("backend", ["local", "te"])
def test_specs_run_the_kernels_on_cuda(megatron_world, monkeypatch, backend):
    """Experts, shared experts and the dense MLP call the fused kernels once each per fwd / bwd."""
    from tests.gpu.test_te_block import NO_GROUPED_GEMM, _te_available

    if backend == "te" and not _te_available():
        pytest.skip("needs Transformer Engine")
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import (
        get_dense_mlp_spec,
        get_stable_latentmoe_mlp_spec,
    )

    cfg = tiny_config(
        hidden_size=128,
        moe_latent_size=64,
        moe_ffn_hidden_size=128,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_shared_expert_intermediate_size=256,
        params_dtype=torch.bfloat16,
        bf16=True,
        moe_router_dtype="fp32",
        use_cpu_initialization=False,
        moe_grouped_gemm=backend == "te" and not NO_GROUPED_GEMM,
    )
    moe = get_stable_latentmoe_mlp_spec(cfg, backend)(config=cfg, layer_number=1).cuda()
    from megatron.core.transformer.spec_utils import build_module

    dense = build_module(get_dense_mlp_spec(cfg, backend), config=cfg).cuda()
    calls = _count_kernel_calls(monkeypatch)
    x = torch.randn(256, 1, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, _ = moe(x)
    out.float().sum().backward()
    # grouped experts: one activation call for all experts; sequential: one per expert with tokens
    experts_calls = 1 if cfg.moe_grouped_gemm else 4
    assert calls["fwd"] >= experts_calls + 1 and calls["bwd"] == calls["fwd"], calls
    before = dict(calls)
    y, _ = dense(x)
    y.float().sum().backward()
    assert calls["fwd"] == before["fwd"] + 1 and calls["bwd"] == before["bwd"] + 1, calls
