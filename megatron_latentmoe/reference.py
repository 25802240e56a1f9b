"""The pure-PyTorch reference of the Stable LatentMoE block (SPEC §1–§3); no Megatron import.

Everything here is re-exported from the HF modeling code (``megatron_latentmoe.hf``), which is the
single implementation of the math: the exported checkpoints run exactly this code.

Typical use in tests::

    from megatron_latentmoe.reference import StableLatentMoEConfig, StableLatentMoEBlock
    cfg = StableLatentMoEConfig(hidden_size=64, routed_expert_hidden_size=32, num_experts=8,
                                num_experts_per_token=2, moe_intermediate_size=48, ...)
    block = StableLatentMoEBlock(cfg)            # names as in HF checkpoints (SPEC §6)
    y, routing = block(x, return_routing=True)   # routing: MoERouting(topk_indices, topk_probs, scores)
"""

from megatron_latentmoe.hf.configuration_stable_latentmoe import StableLatentMoEConfig
from megatron_latentmoe.hf.modeling_stable_latentmoe import (
    ROUTER_PROB_EPS,
    MoERouting,
    StableLatentMoEAttention,
    StableLatentMoEBlock,
    StableLatentMoEDecoderLayer,
    StableLatentMoEExpert,
    StableLatentMoEForCausalLM,
    StableLatentMoEGate,
    StableLatentMoEMLP,
    StableLatentMoEModel,
    StableLatentMoERMSNorm,
    apply_rotary_pos_emb,
    build_attention_mask,
    compute_dtype,
    get_glu_activation,
    noaux_tc_routing,
    repeat_kv,
    rms_norm,
    rope_cos_sin,
    rotate_half,
    situ_glu,
    swiglu,
)

__all__ = [
    "ROUTER_PROB_EPS",
    "MoERouting",
    "StableLatentMoEAttention",
    "StableLatentMoEBlock",
    "StableLatentMoEConfig",
    "StableLatentMoEDecoderLayer",
    "StableLatentMoEExpert",
    "StableLatentMoEForCausalLM",
    "StableLatentMoEGate",
    "StableLatentMoEMLP",
    "StableLatentMoEModel",
    "StableLatentMoERMSNorm",
    "apply_rotary_pos_emb",
    "build_attention_mask",
    "compute_dtype",
    "get_glu_activation",
    "noaux_tc_routing",
    "repeat_kv",
    "rms_norm",
    "rope_cos_sin",
    "rotate_half",
    "situ_glu",
    "swiglu",
]
