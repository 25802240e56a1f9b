"""The Stable LatentMoE layer (SPEC §1) as a Megatron ``MoELayer`` subclass.

Data path, one direction::

    router(x) -> W_down(x) -> dispatch(l) -> experts(l) -> combine(l)
        -> RMSNorm(l) -> W_up -> + shared(x)

Megatron's ``MoELayer.forward`` is reused unchanged; only two hooks are overridden:
``preprocess`` applies W_down before the dispatcher sees the tokens (so dispatch and combine
move l-wide vectors) and ``postprocess`` applies the latent RMSNorm and W_up after combine.
Router, dispatchers (allgather / alltoall / flex), experts, shared experts and all parallelism
(TP, SP, EP, ETP, PP, DP) are Megatron's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import maybe_skip_or_early_return_by_cudagraph
from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

from megatron_latentmoe.config import StableLatentMoETransformerConfig
from megatron_latentmoe.fields import not_allowed
from megatron_latentmoe.moe.checkpoint_names import LEGACY_NORM_NAME, NORM_NAME
from megatron_latentmoe.moe.latent_projection import LatentProjection


@dataclass
class StableLatentMoESubmodules(MoESubmodules):
    """``MoESubmodules`` + the shared latent projections and the latent norm."""

    latent_down_proj: type | None = None
    """W_down, d -> l: ``LatentProjection`` (local) or ``TELinear`` duplicated (TE)."""
    latent_up_proj: type | None = None
    """W_up, l -> d."""
    routed_expert_norm: type | None = None
    """RMSNorm over l (used when ``config.latent_moe_use_norm``)."""


class StableLatentMoELayer(MoELayer):
    """SPEC §1 block: full-width router, ONE W_down, latent experts, latent RMSNorm, ONE W_up.

    Parameter names: ``router.weight`` / ``router.expert_bias`` (the QB bias, HF
    ``gate.e_score_correction_bias``), ``fc1_latent_proj.weight`` (W_down, as in Megatron's
    LatentMoE), ``routed_expert_norm.weight`` (Megatron-Bridge's K3 name and HF's),
    ``fc2_latent_proj.weight`` (W_up), ``experts.*``, ``shared_experts.*``.

    Checkpoints written before the norm was renamed store it as ``latent_norm``: a plain state
    dict with that name loads as is; for a ``torch_dist`` checkpoint set
    ``checkpoint_norm_name = LEGACY_NORM_NAME`` (:func:`use_legacy_names_of`) so the sharded
    state dict asks for (and saves) the old key.
    """

    checkpoint_norm_name = NORM_NAME

    def __init__(
        self,
        config: StableLatentMoETransformerConfig,
        submodules: StableLatentMoESubmodules,
        layer_number: int | None = None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        name: str | None = None,
    ):
        if not config.moe_latent_size:
            raise not_allowed(
                "moe_latent_size",
                config.moe_latent_size,
                "a positive latent width l (StableLatentMoELayer)",
            )
        # Megatron's MoELayer builds its own TE-only latent projections whenever
        # moe_latent_size is set. Build the parent as a plain MoE and hand the real config to
        # the experts only, so they (and only they) run in latent width.
        parent_config = copy.copy(config)
        parent_config.moe_latent_size = None
        experts_builder = submodules.experts

        def latent_experts(num_local_experts, _parent_config, **kwargs):
            return experts_builder(num_local_experts, config, **kwargs)

        parent_submodules = MoESubmodules(
            experts=latent_experts,
            shared_experts=submodules.shared_experts,
            router=submodules.router,
        )
        super().__init__(
            config=parent_config,
            submodules=parent_submodules,
            layer_number=layer_number,
            pg_collection=pg_collection,
            is_mtp_layer=is_mtp_layer,
            name=name,
        )
        self.config = config
        self.submodules = submodules
        if config.moe_token_dispatcher_type == "flex":
            # The flex dispatcher sizes its buffers from the config's latent width.
            self.token_dispatcher = MoEFlexTokenDispatcher(
                self.num_local_experts,
                self.local_expert_indices,
                config=config,
                pg_collection=pg_collection,
            )

        d, latent = config.hidden_size, config.moe_latent_size
        prefix = f"{name}." if name else ""
        self.fc1_latent_proj = submodules.latent_down_proj(
            d,
            latent,
            config=config,
            init_method=config.init_method,
            bias=False,
            name=prefix + "fc1_latent_proj",
            **_duplicated_linear_kwargs(submodules.latent_down_proj),
        )
        self.routed_expert_norm = (
            submodules.routed_expert_norm(
                config=config, hidden_size=latent, eps=config.layernorm_epsilon
            )
            if config.latent_moe_use_norm
            else None
        )
        self.fc2_latent_proj = submodules.latent_up_proj(
            latent,
            d,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            name=prefix + "fc2_latent_proj",
            **_duplicated_linear_kwargs(submodules.latent_up_proj),
        )

    @maybe_skip_or_early_return_by_cudagraph("preprocess")
    def preprocess(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ):
        """W_down once per token, before dispatch: the dispatcher only ever sees l-wide rows."""
        latent_states, _ = self.fc1_latent_proj(hidden_states)
        return self.token_dispatcher.dispatch_preprocess(latent_states, routing_map, probs)

    def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None):
        """Combined latent rows -> RMSNorm(l) -> W_up once per token -> + shared experts(x)."""
        latent_output = self.token_dispatcher.combine_postprocess(output)
        if self.routed_expert_norm is not None:
            latent_output = self.routed_expert_norm(latent_output)
        output, _ = self.fc2_latent_proj(latent_output)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.checkpoint_norm_name != NORM_NAME:
            new, old = f"mlp.{NORM_NAME}.", f"mlp.{self.checkpoint_norm_name}."
            for value in sharded.values():
                if isinstance(value, ShardedTensor) and new in value.key:
                    value.key = value.key.replace(new, old)
        return sharded

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        old = f"{prefix}{LEGACY_NORM_NAME}."
        for key in [k for k in state_dict if k.startswith(old)]:
            state_dict[f"{prefix}{NORM_NAME}." + key[len(old) :]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def use_legacy_names_of(model, checkpoint_keys) -> bool:
    """Make every Stable LatentMoE layer of ``model`` read and write the latent norm under the
    name ``checkpoint_keys`` (a ``torch_dist`` checkpoint's tensor keys) use. True if they are
    the old names."""
    legacy = any(f"mlp.{LEGACY_NORM_NAME}." in key for key in checkpoint_keys)
    for module in model.modules():
        if isinstance(module, StableLatentMoELayer):
            module.checkpoint_norm_name = LEGACY_NORM_NAME if legacy else NORM_NAME
    return legacy


def _duplicated_linear_kwargs(linear_cls) -> dict:
    """TE's ``TELinear`` needs to be told it is replicated; our local projection already is."""
    if linear_cls is LatentProjection:
        return {}
    return dict(
        parallel_mode="duplicated",
        skip_bias_add=False,
        skip_weight_param_allocation=False,
        is_expert=False,
    )
