"""The pure-PyTorch reference of the Stable LatentMoE block (SPEC §1–§3); no Megatron import.

Everything here is re-exported from the HF modeling code (``megatron_latentmoe.hf``), which is the
single implementation of the math: the exported checkpoints run exactly this code.

Typical use in tests::

    from megatron_latentmoe.reference import StableLatentMoEConfig, StableLatentMoEBlock
    cfg = StableLatentMoEConfig(hidden_size=64, routed_expert_hidden_size=32, num_experts=8,
                                num_experts_per_token=2, moe_intermediate_size=48, ...)
    block = StableLatentMoEBlock(cfg)            # names as in HF checkpoints (SPEC §6)
    # routing: MoERouting(topk_indices, topk_probs, scores, router_logits)
    y, routing = block(x, return_routing=True)
"""

from megatron_latentmoe.hf.configuration_stable_latentmoe import StableLatentMoEConfig
from megatron_latentmoe.hf.modeling_stable_latentmoe import *  # noqa: F401,F403 (its __all__)
from megatron_latentmoe.hf.modeling_stable_latentmoe import __all__ as _modeling_all

__all__ = ["StableLatentMoEConfig", *_modeling_all]
