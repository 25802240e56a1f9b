"""The layer specs (``specs.py``): which class builds each submodule, for every combination of
latent / plain MoE, shared experts or none, dense-first layers, SiTU-GLU / SwiGLU, MXFP4 QAT and
pipeline stage (local backend; Transformer Engine is absent here and refused by name). Specs are
built without a process group: no module is instantiated."""

import pytest
from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_latentmoe.config import tiny_config
from megatron_latentmoe.moe.experts import BatchedActivationSequentialMLP
from megatron_latentmoe.moe.latent_projection import LatentProjection
from megatron_latentmoe.moe.layer import StableLatentMoELayer
from megatron_latentmoe.moe.qat import MXFP4ColumnParallelLinear, MXFP4RowParallelLinear
from megatron_latentmoe.moe.router import BalanceCountingRouter, QuantileBalancingRouter
from megatron_latentmoe.ops.situ import SiTUGLU
from megatron_latentmoe.specs import (
    get_dense_mlp_spec,
    get_stable_latentmoe_block_spec,
    get_stable_latentmoe_layer_specs,
    get_stable_latentmoe_mlp_spec,
)

DENSE_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
"""Megatron's local-spec checkpoint renames of a dense layer's norms (TE's fused names)."""
MOE_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
"""A MoE layer keeps its pre-MLP norm under its own name (TE MoE layers have a separate one)."""

DENSE_MODEL = dict(
    num_layers=2,
    num_moe_experts=None,
    moe_latent_size=None,
    moe_ffn_hidden_size=None,
    moe_shared_expert_intermediate_size=None,
)
"""tiny_config without experts: every layer dense."""


def _kind(layer_spec):
    """'dense' or 'moe' from a layer spec's MLP builder, checking the layer's common parts."""
    sub = layer_spec.submodules
    assert layer_spec.module is TransformerLayer
    assert sub.input_layernorm is WrappedTorchNorm and sub.pre_mlp_layernorm is WrappedTorchNorm
    if sub.mlp.func == MLP.as_mlp_submodule:
        assert sub.sharded_state_dict_keys_map == DENSE_KEYS
        mlp = sub.mlp.keywords["submodules"]
        assert (mlp.linear_fc1, mlp.linear_fc2) == (ColumnParallelLinear, RowParallelLinear)
        return "dense"
    assert sub.mlp.func in (StableLatentMoELayer, MoELayer)
    assert sub.sharded_state_dict_keys_map == MOE_KEYS
    return "moe"


@pytest.mark.parametrize(
    "overrides, kinds",
    [
        (dict(num_layers=3), ["moe"] * 3),
        (dict(num_layers=3, first_k_dense_replace=1), ["dense", "moe", "moe"]),
        (dict(num_layers=4, first_k_dense_replace=2), ["dense", "dense", "moe", "moe"]),
        (dict(num_layers=4, moe_layer_freq=2), ["moe", "dense", "moe", "dense"]),
        (dict(num_layers=5, moe_layer_freq=3), ["moe", "dense", "dense", "moe", "dense"]),
        (dict(num_layers=3, moe_layer_freq=[0, 1, 0]), ["dense", "moe", "dense"]),
        (DENSE_MODEL, ["dense", "dense"]),
    ],
)
def test_the_layer_pattern_is_dense_first_then_moe(overrides, kinds):
    specs = get_stable_latentmoe_layer_specs(tiny_config(**overrides))
    assert [_kind(s) for s in specs] == kinds


@pytest.mark.parametrize("qk", [False, True])
def test_qk_layernorm_gives_every_layer_q_and_k_norms(qk):
    specs = get_stable_latentmoe_layer_specs(tiny_config(first_k_dense_replace=1, qk_layernorm=qk))
    norm = WrappedTorchNorm if qk else IdentityOp
    for spec in specs:
        attention = spec.submodules.self_attention.submodules
        assert (attention.q_layernorm, attention.k_layernorm) == (norm, norm)


@pytest.mark.parametrize("shared", [0, 96])
@pytest.mark.parametrize("act", ["situ", "swiglu"])
def test_the_latent_moe_layer_spec(shared, act):
    cfg = tiny_config(moe_shared_expert_intermediate_size=shared, hidden_act=act)
    spec = get_stable_latentmoe_mlp_spec(cfg)
    assert spec.func is StableLatentMoELayer
    sub = spec.keywords["submodules"]
    activation = SiTUGLU if act == "situ" else None
    assert sub.router is QuantileBalancingRouter
    assert (sub.latent_down_proj, sub.latent_up_proj) == (LatentProjection, LatentProjection)
    assert sub.routed_expert_norm is WrappedTorchNorm
    assert sub.experts.func is BatchedActivationSequentialMLP
    experts = sub.experts.keywords["submodules"]
    assert (experts.linear_fc1, experts.linear_fc2) == (ColumnParallelLinear, RowParallelLinear)
    assert experts.activation_func is activation
    if shared:
        shared_mlp = sub.shared_experts.keywords["submodules"]
        assert (shared_mlp.linear_fc1, shared_mlp.linear_fc2, shared_mlp.activation_func) == (
            ColumnParallelLinear,
            RowParallelLinear,
            activation,
        )
    else:
        assert sub.shared_experts is None
    dense = get_dense_mlp_spec(cfg).keywords["submodules"]
    assert dense.activation_func is activation


@pytest.mark.parametrize(
    "lb, router",
    [
        ("quantile_histogram", QuantileBalancingRouter),
        ("aux_loss", BalanceCountingRouter),
        ("none", BalanceCountingRouter),
        (["seq_aux_loss", "quantile_histogram"], QuantileBalancingRouter),
    ],
)
@pytest.mark.parametrize("latent", [32, None])
def test_every_balancer_gets_a_load_counting_router(lb, router, latent):
    coeff = [0.0] * len(lb) if isinstance(lb, list) else 0.0
    cfg = tiny_config(
        moe_latent_size=latent, moe_router_load_balancing_type=lb, moe_aux_loss_coeff=coeff
    )
    assert get_stable_latentmoe_mlp_spec(cfg).keywords["submodules"].router is router


def test_without_a_latent_size_the_layer_is_megatrons_moe_layer():
    spec = get_stable_latentmoe_mlp_spec(tiny_config(moe_latent_size=None))
    sub = spec.keywords["submodules"]
    assert spec.func is MoELayer and type(sub).__name__ == "MoESubmodules"
    assert sub.router is QuantileBalancingRouter
    assert sub.experts.func is SequentialMLP
    experts = sub.experts.keywords["submodules"]
    assert (experts.linear_fc1, experts.linear_fc2, experts.activation_func) == (
        ColumnParallelLinear,
        RowParallelLinear,
        SiTUGLU,
    )


def test_the_latent_layer_refuses_a_config_without_a_latent_size():
    """Refused by name before anything is built (no process group needed), not by an assert or
    a shape error deep inside Megatron's modules or ours."""
    spec = get_stable_latentmoe_mlp_spec(tiny_config())
    with pytest.raises(ValueError) as err:
        spec(config=tiny_config(moe_latent_size=None), layer_number=1)
    assert str(err.value) == (
        "moe_latent_size=None is not allowed: a positive latent width l (StableLatentMoELayer)"
    )


@pytest.mark.parametrize("latent", [64, None])
def test_mxfp4_qat_swaps_the_routed_experts_linears_only(latent):
    cfg = tiny_config(moe_latent_size=latent, moe_ffn_hidden_size=64, moe_expert_weight_qat="mxfp4")
    sub = get_stable_latentmoe_mlp_spec(cfg).keywords["submodules"]
    experts = sub.experts.keywords["submodules"]
    assert (experts.linear_fc1, experts.linear_fc2) == (
        MXFP4ColumnParallelLinear,
        MXFP4RowParallelLinear,
    )
    assert experts.activation_func is SiTUGLU
    shared = sub.shared_experts.keywords["submodules"]  # shared experts stay high precision
    assert (shared.linear_fc1, shared.linear_fc2) == (ColumnParallelLinear, RowParallelLinear)


def test_each_pipeline_stage_gets_its_layers():
    import torch

    cfg = tiny_config(
        num_layers=4,
        first_k_dense_replace=1,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    stages = [get_stable_latentmoe_block_spec(cfg, pp_rank=r) for r in (0, 1)]
    assert [[_kind(s) for s in b.layer_specs] for b in stages] == [["dense", "moe"], ["moe", "moe"]]
    assert all(b.layer_norm is WrappedTorchNorm for b in stages)
    whole = get_stable_latentmoe_block_spec(tiny_config(num_layers=3), pp_rank=0)
    assert len(whole.layer_specs) == 3


@pytest.mark.parametrize(
    "backend, config, message",
    [
        ("TE", None, "backend='TE' is not allowed: one of ('local', 'te')"),
        pytest.param(
            "te",
            None,
            "backend='te' is not allowed: 'local' here: Transformer Engine is not installed "
            "(pip install 'megatron-latentmoe[te]' on a CUDA machine)",
            marks=pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed"),
        ),
        (
            "local",
            "TransformerConfig",
            "type(config)='TransformerConfig' is not allowed: StableLatentMoETransformerConfig",
        ),
    ],
)
def test_a_wrong_backend_or_config_is_refused_by_every_builder(backend, config, message):
    cfg = tiny_config()
    if config == "TransformerConfig":
        from megatron.core.transformer import TransformerConfig

        cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    for build in (get_stable_latentmoe_layer_specs, get_stable_latentmoe_mlp_spec):
        with pytest.raises(ValueError) as err:
            build(cfg, backend)
        assert str(err.value) == message


def test_building_a_spec_installs_the_sp_capable_torch_norm():
    """A script that builds specs without the training entry point (which applies the core
    shims itself) still gets the torch RMSNorm that accepts sequence parallelism: Megatron's own
    asserts ``not config.sequence_parallel`` (MoE with TP>1 needs SP)."""
    from megatron_latentmoe.compat import core, registry

    was_applied = registry.is_applied(core.GROUP)
    registry.revert(core.GROUP)
    try:
        get_stable_latentmoe_mlp_spec(tiny_config())
        assert registry.is_applied(core.GROUP)
        cfg = tiny_config(tensor_model_parallel_size=2, sequence_parallel=True)
        norm = WrappedTorchNorm(cfg, 64)
        assert [p.sequence_parallel for p in norm.parameters()] == [True]
    finally:
        registry.revert(core.GROUP)
        if was_applied:
            core.apply_core_compat()
