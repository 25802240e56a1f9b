"""StableLatentMoETransformerConfig: derived Megatron fields and one clear error per wrong value
(SPEC §1-§4)."""

import dataclasses

import pytest
import torch.nn.functional as F

from megatron_latentmoe.config import (
    QUANTILE_HISTOGRAM,
    StableLatentMoETransformerConfig,
    k3_full_scale_config,
    tiny_config,
)
from megatron_latentmoe.fields import AUX_LOSSES, BALANCERS, ConfigError


def test_situ_turns_on_gated_module_activation():
    cfg = tiny_config()
    assert cfg.gated_linear_unit and cfg.use_te_activation_func and not cfg.bias_activation_fusion
    swiglu = tiny_config(hidden_act="swiglu")
    assert swiglu.gated_linear_unit and swiglu.activation_func is F.silu
    assert not swiglu.use_te_activation_func
    # a copy of a SiTU-GLU config switched to SwiGLU drops the activation module too
    assert not dataclasses.replace(cfg, hidden_act="swiglu").use_te_activation_func


def test_situ_turns_off_the_fused_swiglu_the_command_line_asks_for():
    """Megatron's bias_swiglu_fusion is on unless --no-bias-swiglu-fusion (the CPU run turns it
    off): SiTU-GLU is no SwiGLU, and Megatron refuses it beside use_te_activation_func."""
    assert tiny_config(bias_activation_fusion=True).bias_activation_fusion is False
    assert tiny_config(hidden_act="swiglu", bias_activation_fusion=True).bias_activation_fusion


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


def test_zero_shared_expert_width_means_none():
    """The table's "0 = none" holds in Python too (Megatron itself refuses 0 and wants None)."""
    assert (
        tiny_config(moe_shared_expert_intermediate_size=0).moe_shared_expert_intermediate_size
        is None
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
    # also when it equals the pattern first_k derives: given, not derived, so not derived again
    same = tiny_config(num_layers=4, first_k_dense_replace=1, moe_layer_freq=[0, 1, 1, 1])
    assert dataclasses.replace(same, first_k_dense_replace=0).moe_layer_freq == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="first_k_dense_replace=2 is not allowed"):
        dataclasses.replace(same, first_k_dense_replace=2)
    # a replace that gives its own pattern keeps it (not the one derived from first_k)
    mine = dataclasses.replace(cfg, first_k_dense_replace=0, moe_layer_freq=[0, 1, 0, 1])
    assert mine.moe_layer_freq == [0, 1, 0, 1]
    assert dataclasses.replace(cfg, first_k_dense_replace=0, moe_layer_freq=2).moe_layer_freq == 2
    full = k3_full_scale_config()
    assert full.moe_layer_freq == [0] + [1] * 92
    assert (full.moe_latent_size, full.num_moe_experts, full.moe_router_topk) == (3584, 896, 16)


def test_the_full_scale_config_is_a_qb_sigmoid_router_without_biases():
    """SPEC §3-§5: QB balances (no aux loss), sigmoid scores in fp32, no linear biases."""
    full = k3_full_scale_config()
    assert full.moe_router_load_balancing_type == QUANTILE_HISTOGRAM
    assert full.uses_quantile_balancing
    assert (full.moe_router_score_function, full.moe_router_dtype) == ("sigmoid", "fp32")
    assert (full.moe_aux_loss_coeff, full.add_bias_linear) == (0.0, False)


def test_the_tiny_config_runs_without_dropout_or_biases():
    """SMALL_RUN: the small fp32 configs compare bit for bit, so nothing random in a forward."""
    cfg = tiny_config()
    assert (cfg.hidden_dropout, cfg.attention_dropout) == (0.0, 0.0)
    assert (cfg.add_bias_linear, cfg.moe_aux_loss_coeff) == (False, 0.0)
    assert (cfg.moe_router_score_function, cfg.moe_token_dispatcher_type) == ("sigmoid", "alltoall")
    assert (cfg.use_cpu_initialization, cfg.init_method_std) == (True, 0.02)


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
        # inf softcaps / absorption: the row kinds say "finite" (a NaN loss, not a message)
        (
            dict(activation_situ_beta=float("inf")),
            "activation_situ_beta=inf",
            "a positive finite number",
        ),
        (dict(moe_qb_absorb_coeff=float("inf")), "moe_qb_absorb_coeff=inf", "a finite number >= 0"),
        (
            dict(moe_latent_size=None, latent_moe_use_norm=True),
            "latent_moe_use_norm=True",
            "moe_latent_size is set",
        ),
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
        # Megatron's activation fields would be overwritten by hidden_act's: refused instead
        (dict(gated_linear_unit=False), "gated_linear_unit=False", "are gated"),
        (dict(activation_func=F.gelu), "activation_func='gelu'", "hidden_act chooses"),
        (
            dict(hidden_act="swiglu", activation_func=F.relu),
            "activation_func='relu'",
            "hidden_act chooses",
        ),
        (
            dict(moe_router_load_balancing_type="aux_loss", moe_qb_absorb_coeff=0.3),
            "moe_qb_absorb_coeff=0.3",
            "quantile_histogram",
        ),
        *(  # else silently ignored: Megatron applies it to softmax scores only
            (
                dict(moe_router_pre_softmax=True, **balancer),
                "moe_router_pre_softmax=True",
                "False with moe_router_score_function='sigmoid' (Megatron's pre-softmax",
            )
            for balancer in ({}, dict(moe_router_load_balancing_type="aux_loss"))
        ),
        (  # else silently ignored: the QB router's routing is its own, unfused
            dict(moe_router_fusion=True),
            "moe_router_fusion=True",
            "False with quantile_histogram balancing: its top-(k+1) routing",
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
            "a list of distinct aux losses",
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
        (dict(moe_qb_num_bins=1), "moe_qb_num_bins=1", "an integer >= 512"),
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
        (  # Megatron applies its GLU clamp / linear offset in its own GLU only: SiTU-GLU would
            # silently ignore them (its bound is the softcaps', SPEC §2)
            dict(activation_func_clamp_value=7.0),
            "activation_func_clamp_value=7.0",
            "hidden_act='situ'",
        ),
        (dict(glu_linear_offset=1.0), "glu_linear_offset=1.0", "hidden_act='situ'"),
        (  # Megatron's FusedSharedExpertMLP hard-codes TE's ScaledSwiGLU: shared experts
            # would silently run SwiGLU instead of SiTU-GLU (SPEC §2: shared experts use it too)
            dict(use_grouped_gemm_for_shared_expert=True),
            "use_grouped_gemm_for_shared_expert=True",
            "hidden_act='situ'",
        ),
        (
            dict(moe_apply_probs_on_input=True, moe_router_topk=1),
            "moe_apply_probs_on_input=True",
            "p * E(z)",
        ),
        (dict(moe_enable_routing_replay=True), "moe_enable_routing_replay=True", "replay"),
        # zero-width experts: the routed branch would silently be RMSNorm(0) = 0
        (dict(moe_ffn_hidden_size=0), "moe_ffn_hidden_size=0", "a positive integer"),
        (dict(moe_ffn_hidden_size=-4), "moe_ffn_hidden_size=-4", "a positive integer"),
        (  # else a RuntimeError (a view of the QKV output) in the first forward
            dict(num_attention_heads=4, num_query_groups=3),
            "num_query_groups=3",
            "a divisor of num_attention_heads=4",
        ),
        # widths a (expert) tensor-parallel rank would split unevenly: refused here, not as
        # Megatron's "63 is not divisible by 2" assert while the model is built
        (
            dict(moe_ffn_hidden_size=47, expert_tensor_parallel_size=2),
            "moe_ffn_hidden_size=47",
            "multiple of expert_tensor_parallel_size=2",
        ),
        (
            dict(moe_ffn_hidden_size=47, tensor_model_parallel_size=2, sequence_parallel=True),
            "moe_ffn_hidden_size=47",
            "multiple of tensor_model_parallel_size=2",
        ),
        (
            dict(
                moe_shared_expert_intermediate_size=95,
                tensor_model_parallel_size=2,
                expert_tensor_parallel_size=1,
                sequence_parallel=True,
            ),
            "moe_shared_expert_intermediate_size=95",
            "multiple of tensor_model_parallel_size=2",
        ),
        (
            dict(
                ffn_hidden_size=127,
                num_layers=3,
                first_k_dense_replace=1,
                tensor_model_parallel_size=2,
                sequence_parallel=True,
            ),
            "ffn_hidden_size=127",
            "multiple of tensor_model_parallel_size=2",
        ),
        # an interleaved fc1 would be split into gate / up wrongly by SiTU-GLU and the export
        (dict(moe_mlp_glu_interleave_size=32), "moe_mlp_glu_interleave_size=32", "None with"),
        (
            dict(moe_shared_expert_glu_interleave_size=32),
            "moe_shared_expert_glu_interleave_size=32",
            "None with",
        ),
        (
            dict(moe_qb_binning="centered", moe_qb_num_bins=999),
            "moe_qb_num_bins=999",
            "even integer",
        ),
        (dict(moe_router_num_groups=2), "moe_router_num_groups=2", "None or 1"),
        *(  # dense layers given by moe_layer_freq split ffn_hidden_size over TP too
            (
                dict(moe_layer_freq=freq, ffn_hidden_size=127, tensor_model_parallel_size=2),
                "ffn_hidden_size=127",
                "a multiple of tensor_model_parallel_size=2",
            )
            for freq in (2, [0, 1])
        ),
        (
            dict(
                moe_router_load_balancing_type=["seq_aux_loss", QUANTILE_HISTOGRAM],
                moe_aux_loss_coeff=[0.0],
            ),
            "moe_aux_loss_coeff=[0.0]",
            "one coefficient per balancing type",
        ),
        (
            dict(moe_expert_capacity_factor=1.0),
            "moe_expert_capacity_factor=1.0",
            "None with quantile_histogram balancing",
        ),
        (
            dict(num_layers=4, first_k_dense_replace=1, moe_layer_freq=2),
            "first_k_dense_replace=1",
            "0 when moe_layer_freq=2 is set",
        ),
        (dict(moe_router_topk=0), "moe_router_topk=0", "an integer in [1, num_moe_experts=8)"),
        (  # else a ZeroDivisionError while the layers are built
            dict(moe_layer_freq=0, first_k_dense_replace=0),
            "moe_layer_freq=0",
            "a positive integer (every N-th layer is MoE) or a list of 0 / 1, one per layer",
        ),
        (
            dict(moe_router_load_balancing_type="aux_loss", moe_qb_calibrate_batches=4),
            "moe_qb_calibrate_batches=4",
            "0 unless moe_router_load_balancing_type has quantile_histogram",
        ),
    ],
)
def test_wrong_values_name_field_value_and_allowed(overrides, field, allowed):
    with pytest.raises(ValueError) as err:
        tiny_config(**overrides)
    assert field in str(err.value) and allowed in str(err.value)


@pytest.mark.parametrize("layers", [0, -1])
def test_a_layer_count_below_one_is_refused(layers):
    """0 (Megatron's own default) passed the config and failed as a ZeroDivisionError in
    Megatron's weight init."""
    with pytest.raises(ConfigError) as err:
        tiny_config(num_layers=layers, first_k_dense_replace=0)
    assert str(err.value) == f"num_layers={layers} is not allowed: a positive integer"


@pytest.mark.parametrize("groups", [0, -2])
def test_a_query_group_count_below_one_is_refused(groups):
    """0 passed the config and failed as a ZeroDivisionError while building the attention; -2
    built a model. The HF config refuses both (num_key_value_heads) with the same words."""
    with pytest.raises(ConfigError) as err:
        tiny_config(num_query_groups=groups)
    assert str(err.value) == f"num_query_groups={groups} is not allowed: a positive integer"


def test_a_bool_is_no_count():
    """True is an int to Python: the count rows refuse it all the same."""
    with pytest.raises(ConfigError) as err:
        tiny_config(moe_qb_calibrate_batches=True)
    assert str(err.value) == "moe_qb_calibrate_batches=True is not allowed: an integer >= 0"


def test_several_qb_solves_per_rescored_step_are_accepted_with_rescoring():
    cfg = tiny_config(moe_qb_rescore_iters=50, moe_qb_rescore_solves=3)
    assert (cfg.moe_qb_rescore_iters, cfg.moe_qb_rescore_solves) == (50, 3)


def test_a_dense_model_splits_its_ffn_over_tensor_parallel_ranks():
    """No experts: every layer is dense, so ffn_hidden_size is split over TP."""
    with pytest.raises(ConfigError) as err:
        StableLatentMoETransformerConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            ffn_hidden_size=127,
            tensor_model_parallel_size=2,
        )
    assert str(err.value) == (
        "ffn_hidden_size=127 is not allowed: a multiple of tensor_model_parallel_size=2"
    )


def test_a_zero_glu_clamp_is_refused_with_situ():
    """Only unset (None) is off: a clamp of 0.0 is still Megatron's GLU option."""
    with pytest.raises(ConfigError) as err:
        tiny_config(activation_func_clamp_value=0.0)
    assert str(err.value) == (
        "activation_func_clamp_value=0.0 is not allowed: unset (None) with hidden_act='situ' "
        "(Megatron's GLU option; SiTU-GLU is bounded by its softcaps, activation_situ_beta / "
        "activation_situ_linear_beta)"
    )


def test_widths_that_tensor_parallelism_splits_evenly_are_accepted():
    cfg = tiny_config(
        num_layers=3,
        first_k_dense_replace=1,
        ffn_hidden_size=126,
        moe_ffn_hidden_size=47,  # split by ETP 1 only
        moe_shared_expert_intermediate_size=94,
        tensor_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        sequence_parallel=True,
    )
    assert cfg.expert_tensor_parallel_size == 1
    # no dense layer: the dense width is never split
    tiny_config(ffn_hidden_size=127, tensor_model_parallel_size=2, sequence_parallel=True)


def test_a_shared_width_the_hf_model_cannot_express_trains():
    """Megatron trains any shared-expert width; the HF model (num_shared_experts experts of the
    routed width) only multiples of the expert width: the converter's rule, not the config's."""
    from megatron_latentmoe.fields import ConfigError, check_hf_exportable

    cfg = tiny_config(moe_shared_expert_intermediate_size=72)  # moe_ffn_hidden_size 48
    with pytest.raises(ConfigError, match="a multiple of moe_ffn_hidden_size=48"):
        check_hf_exportable(lambda name: getattr(cfg, name, None))
    check_hf_exportable(lambda name: getattr(tiny_config(), name, None))  # 96 = 2 x 48
    # flags not yet through Megatron's config: an unset expert width is ffn_hidden_size's
    unset = dict(
        moe_shared_expert_intermediate_size=96, moe_ffn_hidden_size=None, moe_latent_size=32
    )
    with pytest.raises(ConfigError, match="a multiple of moe_ffn_hidden_size=128"):
        check_hf_exportable({**unset, "ffn_hidden_size": 128}.get)
    check_hf_exportable({**unset, "ffn_hidden_size": 48}.get)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(moe_shared_expert_gate=True),
            "moe_shared_expert_gate=True is not allowed: False (the HF model's shared experts "
            "have no gate)",
        ),
        (
            dict(moe_router_force_load_balancing=True),
            "moe_router_force_load_balancing=True is not allowed: False (benchmark-only random "
            "routing; the HF model routes by the router's scores)",
        ),
        (
            dict(moe_router_load_balancing_type="aux_loss", moe_router_score_function="softmax"),
            "moe_router_score_function='softmax' is not allowed: 'sigmoid' (SPEC §3)",
        ),
        (
            dict(moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0),
            "moe_router_load_balancing_type='quantile_balancing' is not allowed: a balancer other "
            "than Megatron-Core's quantile_balancing, which routes on the router's logits minus "
            "its per-expert qb_beta: the HF model selects on sigmoid scores plus "
            "e_score_correction_bias, which cannot express it (quantile_histogram, ours, keeps "
            "that bias)",
        ),
        *(
            (  # QB as a drop-in for a Megatron MoE (its MoELayer), with a softmax router or not:
                # named for the latent, the cause (training did not warn; the converter named the
                # router, and then the latent once fixed)
                dict(moe_latent_size=None, **router),
                "moe_latent_size=None is not allowed: a positive integer (the HF model is the "
                "Stable LatentMoE block, its routed experts in a latent of this width); unset, "
                "the MoE layers are Megatron's MoELayer (QB as a drop-in), which the HF model "
                "does not implement",
            )
            for router in (
                {},
                dict(
                    moe_router_load_balancing_type="aux_loss", moe_router_score_function="softmax"
                ),
            )
        ),
        *(
            (
                dict(moe_layer_freq=freq, first_k_dense_replace=0),
                f"moe_layer_freq={freq!r} is not allowed: 1 or [0] * k + [1] * (2 - k) "
                "(num_layers=2): only the first layers may be dense, as in the HF model",
            )
            for freq in ([1, 0], 2, [0, 0])
        ),
    ],
)
def test_megatron_options_the_hf_model_cannot_express_train(overrides, message):
    """Megatron trains them on the block; the converter refuses their checkpoints by name and
    training warns at start-up (both through ``check_hf_exportable``)."""
    from megatron_latentmoe.fields import check_hf_exportable

    cfg = tiny_config(**overrides)
    with pytest.raises(ConfigError) as err:
        check_hf_exportable(lambda name: getattr(cfg, name, None))
    assert str(err.value) == message


def test_swiglu_keeps_megatrons_glu_clamp_and_offset():
    """Megatron's own GLU (hidden_act=swiglu) honours them: allowed there."""
    cfg = tiny_config(hidden_act="swiglu", activation_func_clamp_value=7.0, glu_linear_offset=1.0)
    assert (cfg.activation_func_clamp_value, cfg.glu_linear_offset) == (7.0, 1.0)


def test_qb_is_selected_by_the_load_balancing_type():
    assert tiny_config().uses_quantile_balancing
    assert tiny_config().moe_router_dtype == "fp32"  # router math in fp32 unless asked otherwise
    assert tiny_config(moe_router_dtype="fp64").moe_router_dtype == "fp64"
    assert tiny_config().moe_router_load_balancing_type == QUANTILE_HISTOGRAM
    plain = tiny_config(moe_router_load_balancing_type="none")
    assert not plain.uses_quantile_balancing
    assert plain.moe_router_dtype == "fp32"  # every balancer's router in fp32 on the block
    megatron_moe = tiny_config(moe_router_load_balancing_type="aux_loss", moe_latent_size=None)
    assert megatron_moe.moe_router_dtype is None  # Megatron's own MoE: Megatron's default
    with_aux = tiny_config(
        moe_router_load_balancing_type=["seq_aux_loss", "quantile_histogram"],
        moe_aux_loss_coeff=[0.3, 0.0],
    )
    assert with_aux.uses_quantile_balancing
    assert isinstance(plain, StableLatentMoETransformerConfig)


BALANCER_TYPES_ALLOWED = (
    "one of ['aux_loss', 'seq_aux_loss', 'global_aux_loss', 'sinkhorn', 'quantile_balancing', "
    "'none', 'quantile_histogram'], or a list of distinct aux losses of ['aux_loss', "
    "'seq_aux_loss', 'global_aux_loss'] with or without 'quantile_histogram' (Megatron-Core "
    "applies no other type in a list)"
)


def _coeff(lb):
    return [0.0] * len(lb) if isinstance(lb, list) else 0.0


@pytest.mark.parametrize(
    "lb",
    [
        "quantile_histgram",  # a typo: Megatron's router would silently route plain top-k
        "foo",
        ["aux_loss", "foo"],
        ["aux_loss", "sinkhorn"],  # Megatron's router applies sinkhorn only on its own
        ["quantile_balancing", "seq_aux_loss"],
        ["quantile_histogram", "sinkhorn"],
        ["seq_aux_loss", "seq_aux_loss"],  # Megatron reads the first coefficient only
        [],
        [None],
    ],
)
def test_an_unknown_load_balancing_type_is_refused_naming_the_allowed(lb):
    with pytest.raises(ConfigError) as err:
        tiny_config(moe_router_load_balancing_type=lb, moe_aux_loss_coeff=_coeff(lb))
    assert str(err.value) == (
        f"moe_router_load_balancing_type={lb!r} is not allowed: {BALANCER_TYPES_ALLOWED}"
    )


@pytest.mark.parametrize(
    "lb",
    [
        *BALANCERS,
        *([b] for b in BALANCERS),  # the command line's one-element list, before validate_args
        list(AUX_LOSSES),
        ["quantile_histogram", "seq_aux_loss"],
        ["global_aux_loss", "quantile_histogram", "aux_loss"],
    ],
)
def test_every_megatron_balancing_type_and_ours_is_accepted(lb):
    cfg = tiny_config(moe_router_load_balancing_type=lb, moe_aux_loss_coeff=_coeff(lb))
    assert cfg.moe_router_load_balancing_type == lb


@pytest.mark.parametrize(
    "binning, bins, allowed",
    [
        (
            "uniform",
            511,
            "an integer >= 512 with moe_qb_binning='uniform': the bias is within one bin width of "
            "the exact quantile (at 512 bins: 2/B = 0.004) and router scores spread only ~0.01 "
            "over tokens (measured: MaxVio 0.66 at 256 bins against 0.45 at 1000, 128 experts "
            "top-4)",
        ),
        (
            "centered",
            62,
            "an even integer >= 64 with moe_qb_binning='centered': the bias is within one bin "
            "width of the exact quantile (at 64 bins: ~0.001 next to the bias) and router scores "
            "spread only ~0.01 over tokens (measured: MaxVio 0.51 at 32 bins against 0.43 at "
            "1000)",
        ),
    ],
)
def test_too_few_qb_bins_are_refused_saying_why(binning, bins, allowed):
    """The audit's runs (uniform B=2, centered B=2 and B=4) balanced worse than no bias at all."""
    for few in (2, 4, bins):
        with pytest.raises(ConfigError) as err:
            tiny_config(moe_qb_binning=binning, moe_qb_num_bins=few)
        assert str(err.value) == f"moe_qb_num_bins={few} is not allowed: {allowed}"
    least = bins + 1 if binning == "uniform" else bins + 2
    assert tiny_config(moe_qb_binning=binning, moe_qb_num_bins=least).moe_qb_num_bins == least


@pytest.mark.parametrize("binning", ["uniform", "centered"])
def test_more_qb_bins_than_the_histogram_can_count_are_refused_naming_the_flag(binning):
    """The histogram's n x B int32 counts and its 5 header words stay within 2**31 - 1 words
    (``fields.QB_MAX_CELLS``, which ``balancing`` checks at build). The config refuses what the
    histogram refuses: ``--moe-qb-num-bins 300000000`` with 8 experts passed the flag check and
    then stopped the model build with a traceback ('num_experts*num_bins=2400000000; allowed:
    < 2**31')."""
    from megatron_latentmoe.balancing import HEADER_FIELDS, INT32_MAX, QuantileHistogram
    from megatron_latentmoe.fields import QB_MAX_CELLS

    assert QB_MAX_CELLS + len(HEADER_FIELDS) == INT32_MAX
    most = QB_MAX_CELLS // 8  # 268435455 (x 8 = 2147483640)
    with pytest.raises(ConfigError) as err:
        tiny_config(moe_qb_binning=binning, moe_qb_num_bins=most + 1)
    assert str(err.value) == (
        f"moe_qb_num_bins={most + 1} is not allowed: an integer <= {most} with "
        "num_moe_experts=8 (the histogram's num_moe_experts x moe_qb_num_bins int32 counts: at "
        "most 2147483642)"
    )
    assert tiny_config(moe_qb_binning=binning, moe_qb_num_bins=most - 1).moe_qb_num_bins == most - 1
    # the histogram itself draws the line at the same place (no counts are allocated on meta)
    QuantileHistogram(2, 1, QB_MAX_CELLS // 2, device="meta")
    with pytest.raises(
        ValueError, match=r"^num_experts\*num_bins=2147483644; allowed: <= 2147483642$"
    ):
        QuantileHistogram(2, 1, QB_MAX_CELLS // 2 + 1, device="meta")


@pytest.mark.parametrize("latent", [0, -4, 1.5])
def test_a_latent_size_that_is_not_a_positive_integer_names_moe_latent_size(latent):
    with pytest.raises(ConfigError) as err:
        tiny_config(moe_latent_size=latent)
    assert str(err.value) == (
        f"moe_latent_size={latent!r} is not allowed: a positive integer, or unset (None) for a "
        "plain Megatron MoE"
    )


PLAIN_MOE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=128,
    num_moe_experts=8,
    moe_router_topk=2,
    moe_router_score_function="sigmoid",
    moe_router_load_balancing_type="quantile_histogram",
    add_bias_linear=False,
)
"""A Megatron MoE with QB and no moe_latent_size (README: QB is a drop-in for a Megatron MoE)."""


def test_a_plain_moe_config_needs_no_latent_norm_flag():
    """latent_moe_use_norm defaults as --moe-latent-norm does: on iff moe_latent_size is set."""
    assert StableLatentMoETransformerConfig(**PLAIN_MOE).latent_moe_use_norm is False
    assert StableLatentMoETransformerConfig(**PLAIN_MOE, moe_latent_size=32).latent_moe_use_norm
    assert not tiny_config(latent_moe_use_norm=False).latent_moe_use_norm
    with pytest.raises(ConfigError) as err:  # asked for without a latent width: still refused
        StableLatentMoETransformerConfig(**PLAIN_MOE, latent_moe_use_norm=True)
    assert str(err.value) == (
        "latent_moe_use_norm=True is not allowed: False unless moe_latent_size is set (the norm "
        "is over the latent width)"
    )


def test_a_replaced_config_derives_the_latent_norm_again():
    plain, latent = StableLatentMoETransformerConfig(**PLAIN_MOE), tiny_config()
    assert dataclasses.replace(plain, moe_latent_size=32).latent_moe_use_norm is True
    assert dataclasses.replace(latent, moe_latent_size=None).latent_moe_use_norm is False
    # a value that was given is the user's: kept by a replace, and checked
    assert dataclasses.replace(latent, latent_moe_use_norm=False).latent_moe_use_norm is False
    off = tiny_config(latent_moe_use_norm=False)
    assert dataclasses.replace(off, hidden_size=128).latent_moe_use_norm is False
    with pytest.raises(ConfigError, match="latent_moe_use_norm=True is not allowed"):
        dataclasses.replace(plain, latent_moe_use_norm=True)


ROTARY_BASE = 50000
"""Not Megatron's default (10000), which every other test model uses."""


def _build_plain_moe(rank, world_size):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.model import build_gpt_model

    initialize_parallel_cpu()
    config = StableLatentMoETransformerConfig(**PLAIN_MOE, use_cpu_initialization=True)
    model = build_gpt_model(config, vocab_size=128, max_sequence_length=16, rotary_base=ROTARY_BASE)
    moe = [m for m in model.modules() if isinstance(m, MoELayer)]
    inv_freq = model.rotary_pos_emb.inv_freq
    return [type(m).__name__ for m in moe], [type(m.router) for m in moe], inv_freq


@pytest.fixture(scope="module")
def plain_moe_model():
    from tests.parallel.launcher import run_distributed

    (built,) = run_distributed(_build_plain_moe, 1, timeout=300)
    return built


def test_the_plain_moe_config_builds_megatrons_moe_layer_with_the_qb_router(plain_moe_model):
    from megatron_latentmoe.moe.router import QuantileBalancingRouter

    layers, routers, _ = plain_moe_model
    assert layers == ["MoELayer", "MoELayer"]
    assert routers == [QuantileBalancingRouter] * 2


def test_build_gpt_model_gives_rope_its_rotary_base(plain_moe_model):
    """--rotary-base reaches RoPE (build_gpt_model passes it on to GPTModel)."""
    import torch

    *_, inv_freq = plain_moe_model
    d = PLAIN_MOE["hidden_size"] // PLAIN_MOE["num_attention_heads"]
    expected = 1.0 / ROTARY_BASE ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    torch.testing.assert_close(inv_freq, expected)


def test_build_gpt_model_passes_every_argument_on(monkeypatch):
    """The stage (pre/post process, virtual stage), the backend, tied embeddings and the process
    groups reach the block spec and ``GPTModel``, which the training provider, the converter and
    the pipeline tests rely on (the provider's own test stubs ``build_gpt_model`` out)."""
    from megatron_latentmoe import model

    specs, models = [], []
    monkeypatch.setattr(
        model,
        "get_stable_latentmoe_block_spec",
        lambda config, backend, **kw: specs.append((config, backend, kw)) or "block spec",
    )
    monkeypatch.setattr(model, "GPTModel", lambda **kw: models.append(kw) or "model")
    config, pgs = tiny_config(), object()
    built = model.build_gpt_model(
        config,
        vocab_size=96,
        max_sequence_length=32,
        backend="te",
        pre_process=False,
        post_process=False,
        share_embeddings_and_output_weights=True,
        rotary_base=ROTARY_BASE,
        vp_stage=1,
        pg_collection=pgs,
    )
    assert built == "model"
    assert specs == [(config, "te", dict(vp_stage=1))]
    assert models == [
        dict(
            config=config,
            transformer_layer_spec="block spec",
            vocab_size=96,
            max_sequence_length=32,
            pre_process=False,
            post_process=False,
            share_embeddings_and_output_weights=True,
            position_embedding_type="rope",
            rotary_base=ROTARY_BASE,
            vp_stage=1,
            pg_collection=pgs,
        )
    ]
