"""Build Megatron's ``GPTModel`` with Stable LatentMoE blocks (the one place the model is
assembled).

The training entry point's model provider, the converter and the tests all call
``build_gpt_model`` so that a checkpoint written by one is read by the others.
Attention is Megatron's standard GQA self-attention with RoPE (SPEC leaves attention
model-specific; K3's KDA / MLA layers are out of scope here).
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel

from megatron_latentmoe.config import StableLatentMoETransformerConfig
from megatron_latentmoe.specs import get_stable_latentmoe_block_spec


def build_gpt_model(
    config: StableLatentMoETransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    backend: str = "local",
    pre_process: bool = True,
    post_process: bool = True,
    share_embeddings_and_output_weights: bool = False,
    rotary_base: int = 10000,
    vp_stage: int | None = None,
    pg_collection=None,
) -> GPTModel:
    """A ``GPTModel`` for this pipeline stage with our block spec (``backend``: local or te)."""
    return GPTModel(
        config=config,
        transformer_layer_spec=get_stable_latentmoe_block_spec(config, backend, vp_stage=vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
