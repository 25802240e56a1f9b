"""Megatron ``ModuleSpec``s for a GPT decoder with Stable LatentMoE blocks (SPEC §1, §2).

Built by swapping submodules in Megatron's own GPT layer specs, never by forking them:

* a backend spec provider that answers "which activation" with SiTU-GLU (when
  ``hidden_act == "situ"``) and, for the local backend, "which norm" with Megatron's torch
  RMSNorm made SP-capable by ``compat.core``;
* Megatron's ``get_mlp_module_spec_for_backend`` / ``get_moe_module_spec_for_backend`` with that
  provider give the dense MLP and the experts / shared experts;
* the MoE layer becomes ``StableLatentMoELayer`` with the latent projections, the latent norm and
  the QB router plugged in; with ``moe_expert_weight_qat`` the routed experts' linears
  fake-quantize their weights (``moe/qat.py``); without ``moe_latent_size`` it stays Megatron's own
  ``MoELayer`` with the router swapped (QB as a drop-in for any Megatron MoE), and with
  ``moe_expert_weight_qat`` its experts' linears too. Every balancing type gets a load-counting
  router (``moe/router.py``), so the balance metrics exist for all.

Two variants with the same numerics: ``local`` (pure PyTorch / Megatron-Core modules; runs
anywhere) and ``te`` (Transformer Engine linears, grouped GEMM experts, TE norms; usable under
TE FP8 autocast). The first ``first_k_dense_replace`` layers are dense MLP layers (SiTU-GLU, or
SwiGLU with ``hidden_act == "swiglu"``).
"""

from __future__ import annotations

import dataclasses
from functools import partial

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_submodules,
    get_gpt_layer_with_transformer_engine_submodules,
    get_mlp_module_spec_for_backend,
)
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)

from megatron_latentmoe.compat.core import apply_core_compat
from megatron_latentmoe.config import StableLatentMoETransformerConfig
from megatron_latentmoe.fields import moe_layer_pattern, not_allowed
from megatron_latentmoe.moe.experts import BatchedActivationSequentialMLP
from megatron_latentmoe.moe.latent_projection import LatentProjection
from megatron_latentmoe.moe.layer import StableLatentMoELayer, StableLatentMoESubmodules
from megatron_latentmoe.moe.qat import with_expert_weight_qat
from megatron_latentmoe.moe.router import BalanceCountingRouter, QuantileBalancingRouter
from megatron_latentmoe.ops.situ import SiTUGLU

BACKENDS = ("local", "te")


class _LocalBackend(LocalSpecProvider):
    """Megatron's local backend with SiTU-GLU and its torch RMSNorm, which ``compat.core`` lets
    accept sequence parallelism."""

    def __init__(self, activation):
        apply_core_compat()
        self._activation = activation

    def activation_func(self):
        return self._activation

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return WrappedTorchNorm


def _te_backend(activation):
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    class _TEBackend(TESpecProvider):
        """Megatron's TE backend with SiTU-GLU as the (fused-GEMM-compatible) activation."""

        def activation_func(self):
            return activation

    return _TEBackend()


def _provider(config: StableLatentMoETransformerConfig, backend: str):
    """The checked backend's spec provider, SiTU-GLU when ``hidden_act == "situ"``."""
    if backend not in BACKENDS:
        raise not_allowed("backend", backend, f"one of {BACKENDS}")
    if backend == "te" and not HAVE_TE:
        raise not_allowed(
            "backend",
            backend,
            "'local' here: Transformer Engine is not installed "
            "(pip install 'megatron-latentmoe[te]' on a CUDA machine)",
        )
    if not isinstance(config, StableLatentMoETransformerConfig):
        raise not_allowed("type(config)", type(config).__name__, "StableLatentMoETransformerConfig")
    activation = SiTUGLU if config.hidden_act == "situ" else None
    return _LocalBackend(activation) if backend == "local" else _te_backend(activation)


def _layer_submodules(config: StableLatentMoETransformerConfig, backend: str, moe: bool):
    """Megatron's GPT layer submodules for this backend (attention, norms), MLP still Megatron's.

    Local: with ``normalization="RMSNorm"`` Megatron picks ``WrappedTorchNorm`` for every norm."""
    if backend == "local":
        sub = get_gpt_layer_local_submodules(
            num_experts=None, qk_layernorm=config.qk_layernorm, normalization="RMSNorm"
        )
        keys_map = dict(sub.sharded_state_dict_keys_map)
        if moe:  # TE MoE layers keep a separate pre-MLP norm: checkpoint it under the same name
            keys_map.pop("pre_mlp_layernorm.", None)
        return dataclasses.replace(sub, sharded_state_dict_keys_map=keys_map)
    return get_gpt_layer_with_transformer_engine_submodules(
        num_experts=config.num_moe_experts if moe else None,
        moe_grouped_gemm=moe,
        qk_layernorm=config.qk_layernorm,
        use_te_activation_func=config.use_te_activation_func,
    )


def get_stable_latentmoe_mlp_spec(config: StableLatentMoETransformerConfig, backend: str = "local"):
    """The MoE-layer builder: ``partial(StableLatentMoELayer, submodules=...)``, or without
    ``moe_latent_size`` Megatron's own MoE layer spec with our router (and QAT experts)."""
    megatron_moe = get_moe_module_spec_for_backend(
        backend=_provider(config, backend),
        num_experts=config.num_moe_experts,
        # TE: grouped-GEMM experts when config.moe_grouped_gemm (training turns it on), else
        # SequentialMLP of TE linears (the fallback where cuBLASLt lacks grouped GEMM).
        moe_grouped_gemm=backend == "te" and bool(config.moe_grouped_gemm),
        use_te_activation_func=config.use_te_activation_func,
    )
    router = QuantileBalancingRouter if config.uses_quantile_balancing else BalanceCountingRouter
    moe_sub = megatron_moe.keywords["submodules"]
    if not config.moe_latent_size:
        plain = dataclasses.replace(
            moe_sub, router=router, experts=with_expert_weight_qat(moe_sub.experts, config)
        )
        return partial(megatron_moe.func, submodules=plain)
    experts = moe_sub.experts
    if experts.func is SequentialMLP:  # one activation call for all local experts
        experts = partial(BatchedActivationSequentialMLP, *experts.args, **experts.keywords)
    if backend == "local":
        down = up = LatentProjection
        norm = WrappedTorchNorm
    else:
        from megatron.core.extensions.transformer_engine import TELinear, TENorm

        down = up = TELinear
        norm = TENorm
    return partial(
        StableLatentMoELayer,
        submodules=StableLatentMoESubmodules(
            experts=with_expert_weight_qat(experts, config),
            shared_experts=moe_sub.shared_experts
            if config.moe_shared_expert_intermediate_size
            else None,
            router=router,
            latent_down_proj=down,
            latent_up_proj=up,
            routed_expert_norm=norm,
        ),
    )


def get_dense_mlp_spec(config: StableLatentMoETransformerConfig, backend: str = "local"):
    """The dense (first_k_dense_replace) MLP builder, SiTU-GLU when ``hidden_act == "situ"``."""
    return get_mlp_module_spec_for_backend(
        backend=_provider(config, backend),
        num_experts=None,
        use_te_activation_func=config.use_te_activation_func,
    )


def get_stable_latentmoe_layer_specs(
    config: StableLatentMoETransformerConfig, backend: str = "local"
) -> list[ModuleSpec]:
    """One ``TransformerLayer`` spec per layer of the whole model (dense first, then MoE)."""
    dense_mlp = get_dense_mlp_spec(config, backend)  # checks config and backend first
    dense = ModuleSpec(
        module=TransformerLayer,
        submodules=dataclasses.replace(
            _layer_submodules(config, backend, moe=False), mlp=dense_mlp
        ),
    )
    if not config.num_moe_experts:
        return [dense] * config.num_layers
    moe = ModuleSpec(
        module=TransformerLayer,
        submodules=dataclasses.replace(
            _layer_submodules(config, backend, moe=True),
            mlp=get_stable_latentmoe_mlp_spec(config, backend),
        ),
    )
    pattern = moe_layer_pattern(config.moe_layer_freq, config.num_layers)
    return [moe if is_moe else dense for is_moe in pattern]


def get_stable_latentmoe_block_spec(
    config: StableLatentMoETransformerConfig,
    backend: str = "local",
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """The decoder block spec for this pipeline stage (``GPTModel(transformer_layer_spec=...)``)."""
    layer_specs = get_stable_latentmoe_layer_specs(config, backend)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if backend == "local":
        final_norm = WrappedTorchNorm
    else:
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    return TransformerBlockSubmodules(
        layer_specs=layer_specs[offset : offset + count], layer_norm=final_norm
    )
