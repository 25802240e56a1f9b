"""The model hyper-parameters a conversion needs (``ModelArch``) and where they come from.

A Megatron ``torch_dist`` checkpoint holds tensors, not a model description. ``ModelArch`` is the
small, framework-neutral description the converter works from; it can be read from (first match
wins, see :func:`resolve_arch`):

1. an explicit file (``--megatron-config FILE``): JSON or YAML, either

   * Megatron style: a flat mapping of ``StableLatentMoETransformerConfig`` field names
     (``num_layers``, ``hidden_size``, ``num_moe_experts``, ``moe_latent_size``, ``hidden_act``,
     ...) plus the four ``build_gpt_model`` arguments ``vocab_size``, ``max_sequence_length``,
     ``rotary_base`` and ``share_embeddings_and_output_weights``; or
   * a Hugging Face ``config.json`` of model_type ``stable_latentmoe`` (recognised by its
     ``model_type`` key);

2. the checkpoint's own common state, key ``stable_latentmoe_config`` (a plain dict written by
   this converter's importer and by :func:`arch_common_state`; add it to the state dict you pass
   to ``dist_checkpointing.save`` when saving without ``megatron.training``);

3. the checkpoint's common state, key ``args``: the ``argparse.Namespace`` that
   ``megatron.training`` saves (the ``args`` column of the table); a Namespace without the
   Stable LatentMoE fields is refused (naming the missing ones) rather than guessed.

Every translation is a loop over the rows of ``megatron_latentmoe.fields.FIELDS``. The checkpoint's
tensor shapes are then checked against the description (``names.py``), so a
wrong config file fails with the tensor and the expected / found shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_latentmoe.fields import (
    BY_NAME,
    FIELDS,
    HF_FIXED,
    QUANTILE_HISTOGRAM,
    ConfigError,
    ModelField,
    balancer_list,
    check_hf_exportable,
    check_stable_latentmoe,
    fixed_values,
    megatron_values,
    moe_layer_pattern,
    not_allowed,
    read_hf,
    read_megatron,
    table_fields,
)

from .errors import ConversionError

ARCH_STATE_KEY = "stable_latentmoe_config"
"""Common-state key under which the converter stores ``ModelArch.to_dict()``."""

BUILDER_KEYS = tuple(f.builder for f in FIELDS if f.builder)
"""Keys of a Megatron-style config file that are ``build_gpt_model`` arguments."""

LEGACY_NAMES = {"routed_scaling_factor": "moe_router_topk_scaling_factor"}
"""Old ``ModelArch`` field names, as stored in checkpoints' common state -> today's."""


@dataclass(frozen=True)
@table_fields(FIELDS)
class ModelArch:
    """What a Stable LatentMoE GPT looks like: one field per row of ``fields.FIELDS`` (Megatron
    names; the rows give the HF keys)."""

    def __post_init__(self):
        self.validate("model config")

    # ------------------------------------------------------------------ checks
    def validate(self, source: str) -> None:
        """Each row's kind, the model config's rules (``fields.check_stable_latentmoe``, on the
        Megatron fields this description implies) and what the HF model can express besides;
        a wrong value raises :class:`ConversionError` naming ``source`` and the field."""

        def fail(key, value, allowed, **refs):
            return not_allowed(f"{source}: {key}", value, allowed, ConversionError, **refs)

        for f in FIELDS:
            allowed = f.problem(getattr(self, f.name))
            if allowed:
                raise fail(f.name, getattr(self, f.name), allowed)
        megatron = fixed_values()
        megatron.update(self.megatron_config_kwargs(), moe_layer_freq=self.moe_layer_freq)
        try:
            check_stable_latentmoe(megatron.get)
            check_hf_exportable(megatron.get)
        except ConfigError as err:  # named as this description names them
            names = {f.megatron: f.name for f in FIELDS if f.megatron}
            raise ConversionError(
                f"{source}: " + err.render(lambda key, value: f"{names.get(key, key)}={value!r}")
            ) from None
        if self.kv_channels % 2:
            raise fail("kv_channels", self.kv_channels, "an even head dim (RoPE)")

    # ------------------------------------------------------------------ derived
    @property
    def has_expert_bias(self) -> bool:
        """Whether the Megatron routers have an ``expert_bias`` (QB's, or the sign update's)."""
        return (
            self.moe_router_load_balancing_type == QUANTILE_HISTOGRAM
            or self.moe_router_enable_expert_bias
        )

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def homogeneous_layers(self) -> bool:
        """Megatron stacks all layers' tensors on one leading axis in the checkpoint when every
        layer has the same structure (no dense first layers)."""
        return self.first_k_dense_replace == 0

    @property
    def moe_layer_freq(self) -> list[int]:
        k = self.first_k_dense_replace
        return [0] * k + [1] * (self.num_layers - k)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping, source: str = "stable_latentmoe_config") -> ModelArch:
        values = {LEGACY_NAMES.get(k, k): v for k, v in values.items()}
        unknown = sorted(set(values) - set(BY_NAME))
        if unknown:
            raise ConversionError(f"{source}: unknown field(s) {unknown}; known: {sorted(BY_NAME)}")
        try:
            return cls(**values)
        except TypeError as e:
            raise ConversionError(f"{source}: {e}") from None
        except ConversionError as e:  # a refused value: named as this source names it
            raise ConversionError(str(e).replace("model config", source, 1)) from None

    # ------------------------------------------------------------------ HF
    def to_hf_config_kwargs(self) -> dict:
        """Keyword arguments of the HF config class: one per row with an HF key."""
        values = self.to_dict()
        out = {
            f.hf: f.to_hf(values[f.name], values) if f.to_hf else values[f.name]
            for f in FIELDS
            if f.hf
        }
        return {**out, **HF_FIXED}

    @classmethod
    def from_hf_config(cls, cfg: Mapping, source: str = "config.json") -> ModelArch:
        """From an HF ``config.json`` dict of model_type ``stable_latentmoe`` (absent keys: the
        HF class's defaults, except the sizes, which must be given)."""
        if cfg.get("model_type") != "stable_latentmoe":
            raise not_allowed(
                f"{source}: model_type",
                cfg.get("model_type"),
                "'stable_latentmoe'",
                ConversionError,
            )
        for key, want in HF_FIXED.items():
            if key in cfg and cfg[key] != want:
                raise not_allowed(
                    f"{source}: {key}",
                    cfg[key],
                    f"{want!r} (the only routing Megatron's model implements)",
                    ConversionError,
                )
        values = read_hf(cfg, [f.name for f in FIELDS if f.hf], ConversionError, source)
        if values["kv_channels"] is None:
            values["kv_channels"] = values["hidden_size"] // values["num_attention_heads"]
        arch = cls.__new__(cls)
        for name, value in values.items():  # validate with the source named
            object.__setattr__(arch, name, value)
        for f in FIELDS:
            if not f.hf:
                object.__setattr__(arch, f.name, f.default)
        arch.validate(source)
        return arch

    # ------------------------------------------------------------------ Megatron
    @classmethod
    def from_megatron(cls, raw, get, source: str) -> ModelArch:
        """From Megatron values: ``raw(field)`` reads a Megatron field, ``get(row)`` a row's value
        (both None when absent). The fields the HF model cannot express are refused; so is a
        dense/MoE layer pattern other than the first ``first_k_dense_replace`` layers dense
        (``moe_layer_freq`` ``[0] * k + [1] * rest`` alone means ``first_k_dense_replace=k``)."""
        try:
            check_hf_exportable(raw)  # MEGATRON_FIXED, on the fields as Megatron names them
        except ConfigError as err:
            raise ConversionError(f"{source}: {err}") from None
        for name in ("num_experts", "hidden_size", "num_attention_heads", "num_layers"):
            if not get(BY_NAME[name]):
                raise not_allowed(
                    f"{source}: {BY_NAME[name].megatron}",
                    get(BY_NAME[name]),
                    "a positive integer (a Stable LatentMoE model)",
                    ConversionError,
                )
        values = read_megatron(get, BY_NAME)
        lb = balancer_list(values["moe_router_load_balancing_type"])  # QB, with aux losses or not
        values["moe_router_load_balancing_type"] = (
            QUANTILE_HISTOGRAM if QUANTILE_HISTOGRAM in lb else lb[0]
        )
        freq = raw("moe_layer_freq")
        if freq not in (None, 1):  # [0] * k + [1] * rest (check_hf_exportable refuses others)
            n, k = values["num_layers"], values["first_k_dense_replace"]
            # Megatron's own way to make the first layers dense (what first_k_dense_replace=k
            # builds): the model of first_k_dense_replace=k
            dense = moe_layer_pattern(freq, n).index(1)
            if k and dense != k:
                raise not_allowed(
                    f"{source}: moe_layer_freq",
                    freq,
                    f"1 or {[0] * k + [1] * (n - k)} (first_k_dense_replace={k}): only the first "
                    "layers may be dense, as in the HF model",
                    ConversionError,
                )
            values["first_k_dense_replace"] = dense
        try:
            return cls(**values)
        except ConversionError as e:
            raise ConversionError(str(e).replace("model config", source, 1)) from None

    @classmethod
    def from_megatron_config(cls, config, builder: Mapping, source: str = "Megatron config"):
        """From a Megatron config (object or mapping of its field names) plus the
        ``build_gpt_model`` keywords (``BUILDER_KEYS``)."""
        raw = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)

        def get(f: ModelField):
            return builder.get(f.builder) if f.builder else f.megatron and raw(f.megatron)

        return cls.from_megatron(raw, get, source)

    @classmethod
    def from_megatron_args(cls, args, source: str = "checkpoint args") -> ModelArch:
        """From the ``argparse.Namespace`` that ``megatron.training`` stores as ``args``."""
        missing = [f.name for f in FIELDS if f.added and f.hf and not hasattr(args, f.name)]
        if missing:
            raise ConversionError(
                f"{source}: the saved megatron.training arguments lack the Stable LatentMoE "
                f"field(s) {missing}; pass the model description with --megatron-config FILE "
                "(JSON/YAML of Megatron config fields, or an HF config.json)"
            )

        def raw(key):
            return getattr(args, key, None)

        def get(f: ModelField):
            if f.name == "tie_embeddings":
                return not getattr(args, "untie_embeddings_and_output_weights", False)
            if f.name == "num_query_groups" and not getattr(args, "group_query_attention", True):
                return None
            value = raw(f.args) if f.args else None
            fallback = {"vocab_size": "vocab_size", "max_position_embeddings": "seq_length"}
            return raw(fallback[f.name]) if value is None and f.name in fallback else value

        return cls.from_megatron(raw, get, source)

    def megatron_config_kwargs(self) -> dict:
        """The Megatron config fields of this architecture (None where Megatron means it)."""
        return megatron_values(self.to_dict())

    def to_megatron_config(self, **overrides):
        """A Megatron config of this architecture (fp32, CPU init, no dropout, TP=EP=PP=1 unless
        overridden): what ``verify`` and the tests build the Megatron model from."""
        from megatron_latentmoe.config import SMALL_RUN, StableLatentMoETransformerConfig

        qb = self.moe_router_load_balancing_type == QUANTILE_HISTOGRAM
        values = dict(
            self.megatron_config_kwargs(),
            **SMALL_RUN,
            moe_router_load_balancing_type=QUANTILE_HISTOGRAM if qb else "none",
        )
        values.update(overrides)
        return StableLatentMoETransformerConfig(**values)

    def builder_kwargs(self) -> dict:
        """The ``build_gpt_model`` keyword arguments besides the config."""
        return {f.builder: getattr(self, f.name) for f in FIELDS if f.builder}

    def megatron_args_namespace(self):
        """A ``megatron.training``-style ``args`` Namespace describing this model (stored in the
        common state of imported checkpoints: ``--use-checkpoint-args`` and the resume-time
        argument checks read it). The parallel sizes are 1: imports are written like a one-rank
        save (whole tensors) and load at any layout."""
        from argparse import Namespace

        config = self.megatron_config_kwargs()
        args = {
            f.args: config[f.megatron] if f.megatron else getattr(self, f.name)
            for f in FIELDS
            if f.args
        }
        return Namespace(
            **args,
            moe_layer_freq=self.moe_layer_freq,
            group_query_attention=self.num_query_groups != self.num_attention_heads,
            untie_embeddings_and_output_weights=not self.tie_embeddings,
            **fixed_values(),
            swiglu=True,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=1,
            expert_tensor_parallel_size=1,
            ckpt_format="torch_dist",
            no_save_optim=True,
            no_save_rng=True,
        )


def arch_common_state(arch: ModelArch) -> dict:
    """``{ARCH_STATE_KEY: arch.to_dict()}``: merge into the state dict given to
    ``dist_checkpointing.save`` so the exporter needs no ``--megatron-config``."""
    return {ARCH_STATE_KEY: arch.to_dict()}


# ------------------------------------------------------------------------------ config files
def read_config_file(path: str | os.PathLike) -> dict:
    """Parse a JSON or YAML config file into a dict (errors name the file)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConversionError(f"config file {path!r} does not exist or is not a file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConversionError(f"config file {path!r} cannot be read: {e}") from None
    except UnicodeDecodeError as e:  # a binary file (a weights shard): was a traceback
        raise ConversionError(f"config file {path!r} is not a UTF-8 text file: {e}") from None
    kind, parse, error = "JSON", json.loads, json.JSONDecodeError
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ConversionError(
                f"config file {path!r} is YAML but PyYAML is not installed "
                "(pip install pyyaml, or give JSON)"
            ) from None
        kind, parse, error = "YAML", yaml.safe_load, yaml.YAMLError
    try:
        data = parse(text)
    except error as e:
        raise ConversionError(f"config file {path!r} is not valid {kind}: {e}") from None
    if not isinstance(data, dict):
        raise ConversionError(
            f"config file {path!r}: expected a mapping at top level, got {type(data).__name__}"
        )
    return data


def arch_from_config_file(path: str | os.PathLike) -> ModelArch:
    """A ``ModelArch`` from a Megatron-style JSON/YAML file or an HF ``config.json``."""
    data = read_config_file(path)
    source = f"config file {os.fspath(path)!r}"
    if "model_type" in data:
        return ModelArch.from_hf_config(data, source=source)
    from megatron_latentmoe.config import StableLatentMoETransformerConfig

    fields = {f.name for f in dataclasses.fields(StableLatentMoETransformerConfig)}
    unknown = sorted(set(data) - fields - set(BUILDER_KEYS))
    if unknown:
        raise ConversionError(
            f"{source}: unknown field(s) {unknown}: expected StableLatentMoETransformerConfig "
            f"fields and {list(BUILDER_KEYS)}"
        )
    for key in ("vocab_size", "max_sequence_length"):
        if key not in data:
            raise ConversionError(f"{source}: missing {key!r} (a build_gpt_model argument)")
    return ModelArch.from_megatron_config(data, data, source=source)


def resolve_arch(
    common_state: Mapping | None,
    config_file: str | None = None,
    checkpoint: str = "checkpoint",
) -> tuple[ModelArch, str]:
    """The model description and where it came from (see the module docstring for the order)."""
    if config_file:
        return arch_from_config_file(config_file), f"config file {config_file}"
    common_state = common_state or {}
    if ARCH_STATE_KEY in common_state:
        return (
            ModelArch.from_dict(
                common_state[ARCH_STATE_KEY], source=f"{checkpoint}: {ARCH_STATE_KEY}"
            ),
            f"checkpoint common state ({ARCH_STATE_KEY})",
        )
    if common_state.get("args") is not None:
        return (
            ModelArch.from_megatron_args(common_state["args"], source=f"{checkpoint}: args"),
            "checkpoint common state (megatron.training args)",
        )
    raise ConversionError(
        f"{checkpoint}: the checkpoint carries no model description (no 'args' saved by "
        f"megatron.training, no '{ARCH_STATE_KEY}'); pass --megatron-config FILE (JSON/YAML of "
        "Megatron config fields + vocab_size/max_sequence_length, or an HF config.json)"
    )
