"""Half precision and mixed precision as a transformers user runs them.

Mixed-precision fine-tuning (``Trainer(bf16=True)``, accelerate ``mixed_precision="bf16"``) keeps
fp32 weights and runs the forward under ``torch.autocast``, which casts every ``F.linear`` to bf16
whatever its input dtype. The router must still compute its logits in fp32 (SPEC §3: router math
in fp32) and so choose the experts an fp32 router chooses on the same hidden states.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_latentmoe.hf import StableLatentMoEBlock, StableLatentMoEForCausalLM  # noqa: E402
from megatron_latentmoe.hf import modeling_stable_latentmoe as modeling  # noqa: E402
from tests.unit.test_hf_modeling import randomize_, tiny_config  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_stays_fp32_under_autocast(dtype):
    cfg = tiny_config(hidden_size=64, num_experts=64, num_experts_per_token=4)
    torch.manual_seed(0)
    block = StableLatentMoEBlock(cfg)
    randomize_(block, std=0.3)
    block.gate.e_score_correction_bias.copy_(0.05 * torch.randn(cfg.num_experts))
    x = torch.randn(4096, cfg.hidden_size)
    with torch.no_grad():
        ref = block.gate(x)
        with torch.autocast("cpu", dtype=dtype):
            logits = block.gate.router_logits(x)
            got = block.gate(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, block.gate.router_logits(x))
    assert torch.equal(got.topk_indices, ref.topk_indices)
    assert torch.equal(got.topk_probs, ref.topk_probs)


def test_model_under_autocast_routes_its_hidden_states_like_fp32():
    """A whole fp32 model under bf16 autocast (the Trainer's bf16=True path), training mode with
    gradients: each MoE layer picks, for the hidden states it actually sees, the experts of an
    fp32 router (computed here in fp64)."""
    cfg = tiny_config(hidden_size=64, num_experts=32, num_experts_per_token=4)
    torch.manual_seed(0)
    model = StableLatentMoEForCausalLM(cfg).train()
    randomize_(model, std=0.3)
    for block in model.model.moe_blocks().values():
        block.gate.e_score_correction_bias.copy_(0.02 * torch.randn(cfg.num_experts))
    seen = []
    for block in model.model.moe_blocks().values():
        block.gate.register_forward_hook(
            lambda mod, args, out: seen.append((mod, args[0].detach(), out.topk_indices))
        )
    ids = torch.randint(3, cfg.vocab_size, (8, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert seen
    for gate, x, chosen in seen:
        scores = torch.sigmoid(x.double() @ gate.weight.double().T)
        biased = scores + gate.e_score_correction_bias.double()
        expected = torch.topk(biased, gate.top_k, dim=-1).indices
        differ = (chosen.sort(-1).values != expected.sort(-1).values).any(-1)
        assert int(differ.sum()) == 0, f"{int(differ.sum())} of {len(differ)} tokens"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_model_routes_with_fp32_router_math(dtype):
    """A model loaded in bf16 / fp16 (``from_pretrained(dtype=...)`` or ``.to(dtype)``) keeps the
    router's logits in fp32 math on the half-precision hidden states and weights (SPEC §3), so it
    picks the experts an fp32 router picks for those same inputs: a half-precision matmul rounds
    the logits (~3 significant digits in bf16) and flips near-tied selections."""
    cfg = tiny_config(hidden_size=64, num_experts=64, num_experts_per_token=4)
    torch.manual_seed(0)
    block = StableLatentMoEBlock(cfg)
    randomize_(block, std=0.3)
    block.gate.e_score_correction_bias.copy_(0.05 * torch.randn(cfg.num_experts))
    block = block.to(dtype)
    x = torch.randn(4096, cfg.hidden_size).to(dtype)
    w32 = block.gate.weight.float()
    with torch.no_grad():
        logits = block.gate.router_logits(x)
        routing = block.gate(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ w32.T, rtol=1e-5, atol=1e-5)
    biased = (
        torch.sigmoid(x.double() @ w32.double().T) + block.gate.e_score_correction_bias.double()
    )
    expected = torch.topk(biased, cfg.num_experts_per_token, dim=-1).indices
    differ = (routing.topk_indices.sort(-1).values != expected.sort(-1).values).any(-1)
    assert int(differ.sum()) == 0, f"{int(differ.sum())} of {len(differ)} tokens"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_block_combines_the_experts_in_fp32(dtype):
    """The latent combine ``u = sum_j p_j E_j(z)`` accumulates in fp32 and rounds once: with every
    expert the identity and renormalised weights (sum 1 to ~1e-7), u is z bit for bit. Rounding
    the weights or the partial sums to half precision moves u by up to an ulp per term."""
    cfg = tiny_config(num_experts=8, num_experts_per_token=4)
    torch.manual_seed(0)
    block = StableLatentMoEBlock(cfg)
    randomize_(block, std=0.3)
    block = block.to(dtype)
    block.experts = torch.nn.ModuleList(torch.nn.Identity() for _ in range(cfg.num_experts))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, cfg.hidden_size, generator=gen).to(dtype)
    z = (1.0 + torch.rand(64, cfg.routed_expert_hidden_size, generator=gen)).to(dtype)
    with torch.no_grad():
        routing = block.gate(x)
        u = block.moe_infer(z, routing.topk_indices, routing.topk_probs)
    assert routing.topk_probs.dtype == torch.float32
    assert float((routing.topk_probs.sum(-1) - 1).abs().max()) < 1e-6
    assert u.dtype == dtype
    assert torch.equal(u, z), f"{int((u != z).sum())} of {z.numel()} latent values differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_angles_are_fp32_math_for_half_precision_models(dtype):
    """cos / sin for a half-precision model are computed in fp32 and rounded once: bf16 cannot
    hold positions above 256 exactly (599 -> 600), so half-precision angles would be off by up to
    whole radians. Compared with fp64 within one half-precision ulp of values in [-1, 1]."""
    positions = torch.arange(0, 1200)[None]
    head_dim, theta = 8, 10000.0
    cos, sin = modeling.rope_cos_sin(positions, head_dim, theta, dtype)
    assert cos.dtype == sin.dtype == dtype and cos.shape == (1, 1200, head_dim)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions[0, :, None].double() * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[None]
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    torch.testing.assert_close(cos.double(), angles.cos(), rtol=0, atol=ulp)
    torch.testing.assert_close(sin.double(), angles.sin(), rtol=0, atol=ulp)


@pytest.mark.parametrize(
    "cast",
    [
        lambda m: m.half(),
        lambda m: m.bfloat16(),
        lambda m: m.to(torch.float16),
        lambda m: m.to(dtype=torch.bfloat16),
    ],
    ids=["half", "bfloat16", "to_fp16", "to_bf16"],
)
def test_selection_bias_stays_fp32_bit_exact_through_half_precision_casts(cast):
    """SPEC §6: the QB bias is fp32. Rounding it to fp16 / bf16 moves it by up to ~1e-3 relative,
    enough to flip near-tied selections; every half-precision cast must leave it untouched."""
    cfg = tiny_config(num_experts=8)
    block = StableLatentMoEBlock(cfg)
    bias = torch.linspace(-0.3, 0.3, 8) + 1e-6
    assert not torch.equal(bias.half().float(), bias) and not torch.equal(bias.bfloat16(), bias)
    block.gate.e_score_correction_bias.copy_(bias)
    block = cast(block)
    assert block.gate.weight.dtype in (torch.float16, torch.bfloat16)
    kept = block.gate.e_score_correction_bias
    assert kept.dtype == torch.float32
    assert torch.equal(kept, bias)
