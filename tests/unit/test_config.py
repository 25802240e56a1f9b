"""StableLatentMoETransformerConfig: derived Megatron fields and one clear error per wrong value
(SPEC §1-§4)."""

import pytest
import torch.nn.functional as F

from megatron_latentmoe.config import (
    QUANTILE_HISTOGRAM,
    StableLatentMoETransformerConfig,
    k3_full_scale_config,
    stable_latentmoe_fields,
    tiny_config,
)


def test_situ_turns_on_gated_module_activation():
    cfg = tiny_config()
    assert cfg.gated_linear_unit and cfg.use_te_activation_func and not cfg.bias_activation_fusion
    swiglu = tiny_config(hidden_act="swiglu")
    assert swiglu.gated_linear_unit and swiglu.activation_func is F.silu
    assert not swiglu.use_te_activation_func


def test_first_k_dense_replace_sets_the_layer_pattern():
    cfg = tiny_config(num_layers=4, first_k_dense_replace=1)
    assert cfg.moe_layer_freq == [0, 1, 1, 1]
    # the same pattern given explicitly (as the converter and copies of a config do) is accepted
    same = tiny_config(num_layers=4, first_k_dense_replace=1, moe_layer_freq=[0, 1, 1, 1])
    assert same.moe_layer_freq == [0, 1, 1, 1]
    assert (
        StableLatentMoETransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4
        ).normalization
        == "RMSNorm"
    )


def test_a_replaced_config_derives_the_layer_pattern_again():
    import dataclasses

    cfg = tiny_config(num_layers=4, first_k_dense_replace=1)
    assert dataclasses.replace(cfg, num_layers=6).moe_layer_freq == [0, 1, 1, 1, 1, 1]
    assert dataclasses.replace(cfg, first_k_dense_replace=2).moe_layer_freq == [0, 0, 1, 1]
    assert dataclasses.replace(cfg, first_k_dense_replace=0).moe_layer_freq == 1
    # an explicit pattern is the user's: kept by a replace, and checked against first_k
    explicit = tiny_config(num_layers=4, moe_layer_freq=[0, 0, 1, 1])
    assert dataclasses.replace(explicit, hidden_size=128).moe_layer_freq == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="first_k_dense_replace=1 is not allowed"):
        dataclasses.replace(explicit, first_k_dense_replace=1)
    full = k3_full_scale_config()
    assert full.moe_layer_freq == [0] + [1] * 92
    assert (full.moe_latent_size, full.num_moe_experts, full.moe_router_topk) == (3584, 896, 16)


def test_added_fields_are_listed():
    assert set(stable_latentmoe_fields()) == {
        "hidden_act",
        "activation_situ_beta",
        "activation_situ_linear_beta",
        "latent_moe_use_norm",
        "first_k_dense_replace",
        "moe_qb_num_bins",
        "moe_qb_binning",
        "moe_qb_absorb_coeff",
        "moe_qb_rescore_iters",
        "moe_qb_rescore_solves",
        "moe_qb_calibrate_batches",
        "moe_expert_weight_qat",
    }


@pytest.mark.parametrize(
    "overrides, field, allowed",
    [
        (
            dict(moe_latent_size=33, tensor_model_parallel_size=2, sequence_parallel=True),
            "moe_latent_size=33",
            "multiple of tensor_model_parallel_size=2",
        ),
        (
            dict(num_moe_experts=6, expert_model_parallel_size=4),
            "num_moe_experts=6",
            "multiple of expert_model_parallel_size=4",
        ),
        (dict(num_moe_experts=4, moe_router_topk=4), "moe_router_topk=4", "[1, num_moe_experts=4)"),
        (dict(activation_situ_beta=0.0), "activation_situ_beta=0.0", "positive"),
        (dict(activation_situ_linear_beta=-1.0), "activation_situ_linear_beta=-1.0", "positive"),
        (dict(moe_latent_size=None), "latent_moe_use_norm=True", "moe_latent_size is set"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'", "'situ'"),
        (dict(first_k_dense_replace=2), "first_k_dense_replace=2", "num_layers=2"),
        (
            dict(moe_router_score_function="softmax"),
            "moe_router_score_function='softmax'",
            "'sigmoid'",
        ),
        (
            dict(moe_router_enable_expert_bias=True),
            "moe_router_enable_expert_bias=True",
            "QB router owns expert_bias",
        ),
        (dict(moe_aux_loss_coeff=0.01), "moe_aux_loss_coeff=0.01", "0 with quantile_histogram"),
        (dict(moe_qb_absorb_coeff=-0.1), "moe_qb_absorb_coeff=-0.1", "a finite number >= 0"),
        (
            dict(moe_router_load_balancing_type="aux_loss", moe_qb_absorb_coeff=0.3),
            "moe_qb_absorb_coeff=0.3",
            "quantile_histogram",
        ),
        (dict(moe_qb_rescore_iters=-1), "moe_qb_rescore_iters=-1", "an integer >= 0"),
        (
            dict(moe_router_load_balancing_type="aux_loss", moe_qb_rescore_iters=50),
            "moe_qb_rescore_iters=50",
            "quantile_histogram",
        ),
        (dict(moe_qb_rescore_solves=0), "moe_qb_rescore_solves=0", "a positive integer"),
        (
            dict(moe_qb_rescore_solves=2),
            "moe_qb_rescore_solves=2",
            "1 unless moe_qb_rescore_iters > 0",
        ),
        (
            dict(moe_router_load_balancing_type=["quantile_histogram", "sinkhorn"]),
            "moe_router_load_balancing_type=['quantile_histogram', 'sinkhorn']",
            "alone or with distinct aux losses",
        ),
        (
            dict(
                moe_router_load_balancing_type=["quantile_histogram", "seq_aux_loss"],
                moe_aux_loss_coeff=[0.1, 0.1],
            ),
            "moe_aux_loss_coeff=[0.1, 0.1]",
            "0 for 'quantile_histogram'",
        ),
        (
            dict(
                moe_router_load_balancing_type=["quantile_histogram", "seq_aux_loss"],
                moe_aux_loss_coeff=0.1,
            ),
            "moe_aux_loss_coeff=0.1",
            "one coefficient per balancing type",
        ),
        (dict(moe_qb_num_bins=1), "moe_qb_num_bins=1", "integer >= 2"),
        (dict(moe_qb_binning="log"), "moe_qb_binning='log'", "'centered'"),
        (
            dict(moe_router_topk_scaling_factor=0.0),
            "moe_router_topk_scaling_factor=0.0",
            "positive",
        ),
        (
            dict(moe_shared_expert_overlap=True),
            "moe_shared_expert_overlap=True",
            "full-width input",
        ),
        (dict(first_k_dense_replace=1.5), "first_k_dense_replace=1.5", "an integer"),
        (
            dict(num_layers=4, moe_layer_freq=[1, 1, 0, 0], first_k_dense_replace=1),
            "first_k_dense_replace=1",
            "0 when moe_layer_freq=[1, 1, 0, 0]",
        ),
        (dict(normalization="LayerNorm"), "normalization='LayerNorm'", "'RMSNorm'"),
        (dict(layernorm_zero_centered_gamma=True), "layernorm_zero_centered_gamma=True", "False"),
        (
            dict(use_transformer_engine_op_fuser=True),
            "use_transformer_engine_op_fuser=True",
            "hidden_act='situ'",
        ),
        (
            dict(activation_func_fp8_input_store=True),
            "activation_func_fp8_input_store=True",
            "hidden_act='situ'",
        ),
        (
            dict(moe_apply_probs_on_input=True, moe_router_topk=1),
            "moe_apply_probs_on_input=True",
            "p * E(z)",
        ),
        (dict(moe_enable_routing_replay=True), "moe_enable_routing_replay=True", "replay"),
        (
            dict(moe_qb_binning="centered", moe_qb_num_bins=999),
            "moe_qb_num_bins=999",
            "even integer",
        ),
    ],
)
def test_wrong_values_name_field_value_and_allowed(overrides, field, allowed):
    with pytest.raises(ValueError) as err:
        tiny_config(**overrides)
    assert field in str(err.value) and allowed in str(err.value)


def test_qb_is_selected_by_the_load_balancing_type():
    assert tiny_config().uses_quantile_balancing
    assert tiny_config().moe_router_dtype == "fp32"  # router math in fp32 unless asked otherwise
    assert tiny_config(moe_router_dtype="fp64").moe_router_dtype == "fp64"
    assert tiny_config().moe_router_load_balancing_type == QUANTILE_HISTOGRAM
    plain = tiny_config(moe_router_load_balancing_type="none")
    assert not plain.uses_quantile_balancing
    with_aux = tiny_config(
        moe_router_load_balancing_type=["seq_aux_loss", "quantile_histogram"],
        moe_aux_loss_coeff=[0.3, 0.0],
    )
    assert with_aux.uses_quantile_balancing
    assert isinstance(plain, StableLatentMoETransformerConfig)
