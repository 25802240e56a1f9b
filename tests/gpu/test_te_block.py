"""GPU + Transformer Engine checks of the block (skipped on CPU; their CPU twins are
tests/unit/test_block_vs_reference.py and tests/parallel/*).

* TE spec == local spec on the same weights (bf16 tolerance), output and input gradient;
* under TE FP8 autocast (delayed scaling; MXFP8 where the GPU supports it) the block trains a few
  steps, its loss goes down, and its output stays close to the bf16 output.

Run on a GPU machine with TE: ``bash tools/gpu_checks.sh`` (also runs the GPU benchmarks).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

D, LATENT, FFN, EXPERTS, TOPK, TOKENS = 256, 128, 256, 8, 2, 512
BF16_RTOL = 2e-2  # bf16 has 8 mantissa bits; two GEMM paths differ by accumulation order
FP8_RTOL = 0.15  # fp8 e4m3 activations: ~3 mantissa bits per GEMM input


def _te_available():
    try:
        import transformer_engine  # noqa: F401

        return torch.cuda.is_available()
    except ImportError:
        return False


needs_te = pytest.mark.skipif(not _te_available(), reason="needs a CUDA GPU and Transformer Engine")


def _config(**overrides):
    from megatron_latentmoe.config import tiny_config

    values = dict(hidden_size=D, moe_latent_size=LATENT, moe_ffn_hidden_size=FFN,
                  num_moe_experts=EXPERTS, moe_router_topk=TOPK,
                  moe_shared_expert_intermediate_size=2 * FFN, num_attention_heads=8,
                  ffn_hidden_size=4 * D, params_dtype=torch.bfloat16, bf16=True,
                  moe_router_dtype="fp32", use_cpu_initialization=False)
    values.update(overrides)
    return tiny_config(**values)


def local_to_te_state(state: dict) -> dict:
    """Local-spec MoE layer names -> TE-spec names (SequentialMLP -> TEGroupedMLP experts)."""
    out = {}
    for name, value in state.items():
        if name.startswith("experts.local_experts."):
            _, _, j, linear, kind = name.split(".")
            out[f"experts.{linear}.{kind}{j}"] = value
        else:
            out[name] = value
    return out


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@needs_te
def test_te_spec_equals_local_spec(megatron_world):
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    local_cfg = _config()
    te_cfg = _config(moe_grouped_gemm=True)
    local = get_stable_latentmoe_mlp_spec(local_cfg, "local")(config=local_cfg, layer_number=1).cuda()
    te = get_stable_latentmoe_mlp_spec(te_cfg, "te")(config=te_cfg, layer_number=1).cuda()
    missing, unexpected = te.load_state_dict(local_to_te_state(local.state_dict()), strict=False)
    assert not unexpected and all("_extra_state" in k for k in missing), (missing, unexpected)
    x = torch.randn(TOKENS, 1, D, device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for layer in (local, te):
        inp = x.clone().requires_grad_()
        out, _ = layer(inp)
        out.float().square().sum().backward()
        outs.append(out.detach())
        grads.append(inp.grad)
    assert _rel(outs[1], outs[0]) < BF16_RTOL
    assert _rel(grads[1], grads[0]) < BF16_RTOL


def _fp8_recipes():
    from transformer_engine.common import recipe

    recipes = {"delayed": recipe.DelayedScaling()}
    major, _ = torch.cuda.get_device_capability()
    if major >= 10 and hasattr(recipe, "MXFP8BlockScaling"):
        recipes["mxfp8"] = recipe.MXFP8BlockScaling()
    return recipes


@needs_te
@pytest.mark.parametrize("name", ["delayed", "mxfp8"])
def test_fp8_autocast_trains_and_stays_close_to_bf16(megatron_world, name):
    import transformer_engine.pytorch as te_pt

    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    recipes = _fp8_recipes()
    if name not in recipes:
        pytest.skip(f"{name} needs a GPU with compute capability >= 10 (this one: "
                    f"{torch.cuda.get_device_capability()})")
    cfg = _config(moe_grouped_gemm=True, fp8="hybrid" if name == "delayed" else "e4m3",
                  fp8_recipe=name, moe_router_padding_for_quantization=True)
    layer = get_stable_latentmoe_mlp_spec(cfg, "te")(config=cfg, layer_number=1).cuda()
    torch.manual_seed(0)
    x = torch.randn(TOKENS, 1, D, device="cuda", dtype=torch.bfloat16)
    target = torch.randn_like(x)
    with torch.no_grad():
        ref, _ = layer(x)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):
        with te_pt.fp8_autocast(enabled=True, fp8_recipe=recipes[name]):
            out, _ = layer(x)
        loss = (out.float() - target.float()).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with torch.no_grad():
        bf16_out, _ = layer(x)
        with te_pt.fp8_autocast(enabled=True, fp8_recipe=recipes[name]):
            fp8_out, _ = layer(x)
    assert _rel(fp8_out, bf16_out) < FP8_RTOL
    assert ref.shape == fp8_out.shape
