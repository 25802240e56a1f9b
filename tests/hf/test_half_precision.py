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
