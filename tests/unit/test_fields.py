"""The one table of model fields (``megatron_latentmoe.fields``): every copy agrees with it.

The HF config file ships next to every checkpoint and keeps its own keyword defaults; the Megatron
config, the CLI flags, the converter (``ModelArch``) and the ledger derive theirs from the table.
These tests fail when any of them drifts from the table (a changed default, a missing key).
"""

import argparse
import importlib.util
import inspect
from pathlib import Path

import pytest

from megatron_latentmoe.convert.arch import ModelArch
from megatron_latentmoe.fields import ADDED, BY_NAME, FIELDS, HF_FIXED, REQUIRED, hf_defaults
from megatron_latentmoe.ledger import _TABLE_NAMES, K3_FULL_SCALE, LatentMoEShape

HF_FILE = (
    Path(__file__).resolve().parents[2] / "megatron_latentmoe/hf/configuration_stable_latentmoe.py"
)
HF_ONLY = {"initializer_range", "use_cache", "attention_dropout", "output_router_logits"}
"""HF keyword arguments that do not describe the model's weights or math (not in the table)."""

SMALL = dict(
    num_layers=3,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    vocab_size=128,
    num_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_latent_size=32,
)
"""The rows without a Megatron-side default, at a small size."""


def hf_config_class():
    spec = importlib.util.spec_from_file_location("_hf_configuration_under_test", HF_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StableLatentMoEConfig


def hf_required(arch: ModelArch) -> dict:
    """The required HF keys of ``arch`` only: everything else is left to the defaults."""
    kwargs = arch.to_hf_config_kwargs()
    return {f.hf: kwargs[f.hf] for f in FIELDS if f.required}


def test_the_shipped_hf_config_has_the_tables_keys_and_defaults():
    params = inspect.signature(hf_config_class().__init__).parameters
    hf_keys = {name for name in params if name not in ("self", "kwargs")}
    assert hf_keys == set(hf_defaults()) | set(HF_FIXED) | HF_ONLY
    for key, default in {**hf_defaults(), **HF_FIXED}.items():
        assert params[key].default == default, (key, params[key].default, default)
        assert type(params[key].default) is type(default), key


def test_the_megatron_config_and_the_flags_have_the_tables_defaults():
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    from megatron_latentmoe.config import StableLatentMoETransformerConfig
    from megatron_latentmoe.training.arguments import add_stable_latentmoe_args

    base = {f.name for f in dataclasses.fields(TransformerConfig)}
    added = tuple(
        f.name
        for f in dataclasses.fields(StableLatentMoETransformerConfig)
        if f.name not in base and not f.name.startswith("_")
    )
    assert added == tuple(f.name for f in ADDED)  # the config adds exactly the table's fields
    config_defaults = {
        f.name: f.default for f in dataclasses.fields(StableLatentMoETransformerConfig)
    }
    parser = argparse.ArgumentParser()  # Megatron's parser has these flags; ours extends them
    parser.add_argument("--moe-router-load-balancing-type", nargs="+", choices=["aux_loss", "none"])
    parser.add_argument("--yaml-cfg")
    add_stable_latentmoe_args(parser)
    flags = parser.parse_args([])
    for f in ADDED:
        # the one bool field / flag defaults to "on iff moe_latent_size is set" (None until
        # resolved), in Python as on the command line; the table's True is the HF side's
        assert config_defaults[f.name] == (None if f.kind == "bool" else f.default), f.name
        assert getattr(flags, f.name) == (None if f.kind == "bool" else f.default), f.name
        assert f.flag in parser.format_help()


def test_an_hf_config_without_the_optional_keys_means_the_same_everywhere():
    """Absent keys: the converter, the ledger and transformers (the HF class) read the same."""
    arch = ModelArch(**dict(SMALL, num_attention_heads=16, num_query_groups=8, kv_channels=4))
    given = dict(model_type="stable_latentmoe", **hf_required(arch))
    from_hf = ModelArch.from_hf_config(given)
    hf = hf_config_class()(**hf_required(arch))
    kwargs = from_hf.to_hf_config_kwargs()
    for f in FIELDS:
        if f.hf:
            assert kwargs[f.hf] == getattr(hf, f.hf), f.hf
        if f.hf and not f.required and f.name != "kv_channels":
            want = (
                f.hf_default
                if f.from_hf is None or f.hf_default is None
                else f.from_hf(f.hf_default, given)
            )
            assert getattr(from_hf, f.name) == want, f.name
    assert from_hf.latent_moe_use_norm is True  # was False in the ledger, True in the converter
    shape = LatentMoEShape.from_hf_config(given)
    for ours, name in _TABLE_NAMES.items():
        if name != "ffn_hidden_size":  # the ledger counts the dense FFN only for dense layers
            assert getattr(shape, ours) == getattr(from_hf, name), ours


PROJECT_DEFAULTS = {"moe_router_load_balancing_type": "quantile_histogram"}
"""Rows of Megatron's own fields whose table default is this project's, not Megatron's (Megatron:
'aux_loss'): the converter's verify builds the QB router unless the checkpoint says otherwise."""


def test_megatrons_own_fields_have_megatrons_defaults():
    """A row of a Megatron field defaults to what Megatron's None / default means."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    megatron = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    checked = 0
    for f in FIELDS:
        if f.added or not f.megatron or f.default is REQUIRED or f.megatron in PROJECT_DEFAULTS:
            continue
        default = megatron[f.megatron]
        assert (f.none_is if default is None else default) == f.default, f.name
        checked += 1
    assert checked >= 3


def test_a_megatron_config_without_the_optional_fields_means_the_same_everywhere():
    from megatron_latentmoe.config import StableLatentMoETransformerConfig

    fields = {BY_NAME[k].megatron: v for k, v in SMALL.items() if BY_NAME[k].megatron}
    builder = {BY_NAME[k].builder: v for k, v in SMALL.items() if BY_NAME[k].builder}
    builder["max_sequence_length"] = BY_NAME["max_position_embeddings"].default
    from_dict = ModelArch.from_megatron_config(fields, builder)
    config = StableLatentMoETransformerConfig(
        **fields, moe_router_score_function="sigmoid", add_bias_linear=False, **PROJECT_DEFAULTS
    )
    assert ModelArch.from_megatron_config(config, builder) == from_dict == ModelArch(**SMALL)
    shape = LatentMoEShape.from_megatron_config(config)
    for ours, name in _TABLE_NAMES.items():
        if name not in ("vocab_size", "ffn_hidden_size", "tie_embeddings"):  # builder arguments
            assert getattr(shape, ours) == getattr(from_dict, name), ours


def test_megatrons_none_for_a_width_means_megatrons_default():
    """kv_channels None: hidden_size / num_attention_heads (not / num_query_groups, which GQA
    makes differ); moe_ffn_hidden_size None: ffn_hidden_size (not hidden_size)."""
    fields = {BY_NAME[k].megatron: v for k, v in SMALL.items() if BY_NAME[k].megatron}
    builder = {BY_NAME[k].builder: v for k, v in SMALL.items() if BY_NAME[k].builder}
    fields.update(kv_channels=None, moe_ffn_hidden_size=None)
    arch = ModelArch.from_megatron_config(fields, builder)
    assert (arch.kv_channels, arch.moe_ffn_hidden_size) == (64 // 4, 96)


def test_megatrons_none_for_the_ffn_width_and_the_query_groups():
    """ffn_hidden_size None: Megatron's 4 * hidden_size (and the unset expert width follows it);
    num_query_groups None: one group per head (no GQA)."""
    fields = {BY_NAME[k].megatron: v for k, v in SMALL.items() if BY_NAME[k].megatron}
    builder = {BY_NAME[k].builder: v for k, v in SMALL.items() if BY_NAME[k].builder}
    fields.update(ffn_hidden_size=None, num_query_groups=None, moe_ffn_hidden_size=None)
    arch = ModelArch.from_megatron_config(fields, builder)
    assert (arch.ffn_hidden_size, arch.moe_ffn_hidden_size, arch.num_query_groups) == (256, 256, 4)


def test_the_builder_and_args_names_are_megatrons():
    """builder_kwargs are build_gpt_model's own keywords (the defaults: its RoPE base and untied
    embeddings), and the vocabulary is stored as megatron.training's padded_vocab_size."""
    from megatron_latentmoe.model import build_gpt_model

    a = ModelArch(**SMALL)
    params = inspect.signature(build_gpt_model).parameters
    kwargs = a.builder_kwargs()
    assert set(kwargs) == {
        "vocab_size",
        "max_sequence_length",
        "rotary_base",
        "share_embeddings_and_output_weights",
    }
    assert set(kwargs) <= set(params)
    for name in ("rotary_base", "share_embeddings_and_output_weights"):
        assert kwargs[name] == params[name].default, name
    assert a.megatron_args_namespace().padded_vocab_size == 128


def test_the_token_id_defaults_are_the_shipped_tokenizers():
    """bos / eos / pad default to the ids of the tokenizer shipped in data/assets/tokenizer."""
    import json

    tokenizer = HF_FILE.parents[1] / "data/assets/tokenizer/tokenizer_config.json"
    config = json.loads(tokenizer.read_text())
    ids = {token["content"]: int(i) for i, token in config["added_tokens_decoder"].items()}
    for name in ("bos", "eos", "pad"):
        assert BY_NAME[f"{name}_token_id"].default == ids[config[f"{name}_token"]], name


def test_hidden_act_swiglu_is_silu_in_hf_and_an_unknown_one_is_refused():
    """HF calls SwiGLU 'silu' (both ways); a hidden_act the model has not is refused by name,
    not read as SiTU-GLU."""
    from megatron_latentmoe.convert.errors import ConversionError

    swiglu = ModelArch(**SMALL, hidden_act="swiglu")
    given = dict(model_type="stable_latentmoe", **swiglu.to_hf_config_kwargs())
    assert given["hidden_act"] == "silu"
    assert ModelArch.from_hf_config(given).hidden_act == "swiglu"
    with pytest.raises(ConversionError) as err:
        ModelArch.from_hf_config(dict(given, hidden_act="gelu"))
    assert str(err.value) == (
        "config.json: hidden_act='gelu' is not allowed: one of ('situ', 'swiglu')"
    )


def test_a_bool_row_refuses_an_int():
    from megatron_latentmoe.convert.errors import ConversionError

    with pytest.raises(ConversionError) as err:
        ModelArch(**SMALL, tie_embeddings=1)
    assert str(err.value) == "model config: tie_embeddings=1 is not allowed: True or False"


@pytest.mark.parametrize(
    "change",
    [
        {},
        dict(moe_router_topk_scaling_factor=2.5),
        dict(hidden_act="swiglu", tie_embeddings=True),
        dict(
            first_k_dense_replace=1,
            moe_shared_expert_intermediate_size=64,
            latent_moe_use_norm=False,
        ),
        dict(bos_token_id=None, eos_token_id=3, pad_token_id=None),
    ],
)
def test_every_round_trip_goes_through_the_table(change):
    a = ModelArch(**SMALL, **change)
    assert (
        ModelArch.from_hf_config(dict(model_type="stable_latentmoe", **a.to_hf_config_kwargs()))
        == a
    )
    assert ModelArch.from_megatron_args(a.megatron_args_namespace()) == _megatron_side(a)
    assert ModelArch.from_megatron_config(
        a.to_megatron_config(), a.builder_kwargs()
    ) == _megatron_side(a)
    assert ModelArch.from_dict(a.to_dict()) == a


def _megatron_side(a: ModelArch) -> ModelArch:
    """Megatron does not store the HF-only rows (token ids): they come back as defaults."""
    import dataclasses

    return dataclasses.replace(
        a, **{f.name: f.default for f in FIELDS if not f.megatron and not f.builder}
    )


def test_routed_scaling_factor_is_one_row():
    """moe_router_topk_scaling_factor reaches every side from its row alone."""
    a = ModelArch(**SMALL, moe_router_topk_scaling_factor=2.5)
    assert a.to_hf_config_kwargs()["routed_scaling_factor"] == 2.5
    assert a.to_megatron_config().moe_router_topk_scaling_factor == 2.5
    assert a.megatron_args_namespace().moe_router_topk_scaling_factor == 2.5
    assert ModelArch(**SMALL).to_megatron_config().moe_router_topk_scaling_factor is None
    # checkpoints written before the row had its Megatron name
    old = dict(a.to_dict(), routed_scaling_factor=2.5)
    del old["moe_router_topk_scaling_factor"]
    assert ModelArch.from_dict(old) == a


def test_k3_presets_are_the_hf_defaults():
    from megatron_latentmoe.config import k3_full_scale_config

    k3 = ModelArch.from_hf_config(dict(model_type="stable_latentmoe", **hf_defaults()))
    assert LatentMoEShape.from_hf_config(hf_defaults()) == K3_FULL_SCALE
    config = k3_full_scale_config()
    for f in FIELDS:
        if f.megatron and f.hf:
            want = k3.megatron_config_kwargs()[f.megatron]
            assert getattr(config, f.megatron) == want, f.name


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(moe_router_topk=8),
            "moe_router_topk=8 is not allowed: an integer in [1, num_experts=8)",
        ),
        (
            dict(first_k_dense_replace=3),
            "first_k_dense_replace=3 is not allowed: an integer in [0, num_layers=3)",
        ),
        (
            dict(moe_qb_num_bins=256),
            "moe_qb_num_bins=256 is not allowed: an integer >= 512 with moe_qb_binning='uniform'"
            ": the bias is within one bin width of the exact quantile (at 512 bins: 2/B = 0.004)"
            " and router scores spread only ~0.01 over tokens (measured: MaxVio 0.66 at 256 bins"
            " against 0.45 at 1000, 128 experts top-4)",
        ),
        (
            dict(moe_router_load_balancing_type="quantile_histgram"),
            "moe_router_load_balancing_type='quantile_histgram' is not allowed: one of "
            "['aux_loss', 'seq_aux_loss', 'global_aux_loss', 'sinkhorn', 'quantile_balancing', "
            "'none', 'quantile_histogram'], or a list of distinct aux losses of ['aux_loss', "
            "'seq_aux_loss', 'global_aux_loss'] with or without 'quantile_histogram' "
            "(Megatron-Core applies no other type in a list)",
        ),
        (
            dict(num_query_groups=3),
            "num_query_groups=3 is not allowed: a divisor of num_attention_heads=4",
        ),
    ],
)
def test_the_converter_runs_the_configs_rules(change, message):
    """ModelArch states no rule of the config again: it runs fields.check_stable_latentmoe and
    names the fields its own way (num_experts, not num_moe_experts)."""
    from megatron_latentmoe.convert.errors import ConversionError

    with pytest.raises(ConversionError) as err:
        ModelArch(**dict(SMALL, **change))
    assert str(err.value) == f"model config: {message}"


def test_model_fixed_rows_are_one_rule_for_the_config_and_the_export():
    """The MODEL_FIXED fields: check_stable_latentmoe (config, flags, ModelArch) and
    check_hf_exportable (alone on a checkpoint's raw Megatron args) refuse the same values in the
    same words. None is a value to the config's check (normalization=None refused, the other two
    allow it) and an absent field to the export's."""
    from megatron_latentmoe.fields import (
        MODEL_FIXED,
        ConfigError,
        check_hf_exportable,
        check_stable_latentmoe,
        fixed_values,
    )

    arch = ModelArch(**SMALL)
    good = {
        **fixed_values(),
        **arch.megatron_config_kwargs(),
        "moe_layer_freq": arch.moe_layer_freq,
    }
    for name, value, allowed in (
        ("normalization", "LayerNorm", "'RMSNorm' (SPEC §1)"),
        ("layernorm_zero_centered_gamma", True, "False (plain RMSNorm weights, SPEC §1)"),
        ("moe_router_num_groups", 2, "None or 1 (no group-limited routing, SPEC §3)"),
    ):
        for check in (check_stable_latentmoe, check_hf_exportable):
            with pytest.raises(ConfigError) as err:
                check({**good, name: value}.get)
            assert str(err.value) == f"{name}={value!r} is not allowed: {allowed}"
    with pytest.raises(ConfigError) as err:
        check_stable_latentmoe({**good, "normalization": None}.get)
    assert str(err.value) == "normalization=None is not allowed: 'RMSNorm' (SPEC §1)"
    check_stable_latentmoe(
        {**good, "layernorm_zero_centered_gamma": None, "moe_router_num_groups": None}.get
    )
    check_hf_exportable({**good, **dict.fromkeys(MODEL_FIXED)}.get)


@pytest.mark.parametrize(
    "change, message",
    [
        # a negative id passed (token ids index the vocabulary)
        (dict(pad_token_id=-1), "pad_token_id=-1 is not allowed: None or an integer >= 0"),
        # an infinite RoPE base passed: inv_freq 0 for every pair but the first
        (
            dict(rotary_base=float("inf")),
            "rotary_base=inf is not allowed: a positive finite number",
        ),
    ],
)
def test_the_converter_checks_each_rows_kind(change, message):
    """Every row's kind is checked (not only the added rows' of the config's rules)."""
    from megatron_latentmoe.convert.errors import ConversionError

    with pytest.raises(ConversionError) as err:
        ModelArch(**dict(SMALL, **change))
    assert str(err.value) == f"model config: {message}"


def test_an_hf_config_with_a_null_size_or_an_eos_list():
    """A required key written as null is missing (not the K3 default); a list of eos ids (as
    transformers allows) becomes its first id."""
    from megatron_latentmoe.convert.errors import ConversionError

    given = dict(model_type="stable_latentmoe", **ModelArch(**SMALL).to_hf_config_kwargs())
    with pytest.raises(ConversionError) as err:
        ModelArch.from_hf_config(dict(given, hidden_size=None))
    assert str(err.value) == "config.json: missing key(s) ['hidden_size']"
    assert ModelArch.from_hf_config(dict(given, eos_token_id=[5, 3])).eos_token_id == 5


def test_the_balancing_types_are_megatrons_choices_and_ours():
    """fields.MEGATRON_BALANCERS is megatron-core's own list (its --moe-router-load-balancing-type
    choices): a megatron-core upgrade that adds or drops a type fails here, not silently."""
    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()  # megatron.training needs typing.override on Python 3.11
    from megatron.training.arguments import _add_moe_args

    from megatron_latentmoe.fields import BALANCERS, MEGATRON_BALANCERS, QUANTILE_HISTOGRAM

    parser = _add_moe_args(argparse.ArgumentParser())
    (action,) = [a for a in parser._actions if a.dest == "moe_router_load_balancing_type"]
    assert MEGATRON_BALANCERS == tuple(action.choices)
    assert BALANCERS == (*action.choices, QUANTILE_HISTOGRAM)
