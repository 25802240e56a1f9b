"""The Stable LatentMoE model, described once: one row per hyper-parameter.

Every other description derives from :data:`FIELDS` (nothing here imports torch, Megatron or
transformers, so the CLIs read it before anything heavy):

* ``convert.arch.ModelArch`` (the converter's model description) has one dataclass field per
  row, and its HF / Megatron-config / megatron.training-args translators are loops over the rows;
* ``config.StableLatentMoETransformerConfig`` gets the rows Megatron has no field for
  (``added=True``), with their defaults and docs;
* ``training.arguments`` adds one flag per added row, with the row's default and help;
* ``ledger.LatentMoEShape`` reads HF and Megatron configs through :func:`read_hf` /
  :func:`read_megatron`, so an absent key means the same there as in the converter;
* ``hf/configuration_stable_latentmoe.py`` ships next to every exported checkpoint and must stay
  self-contained (it imports only transformers), so it keeps its own keyword defaults;
  ``tests/unit/test_fields.py`` pins its keys and defaults to the ``hf`` / ``hf_default``
  columns, and fails when one copy drifts.

Modelled on Megatron-Bridge's ``CONFIG_MAPPING`` (one list of (HF key, Megatron field) pairs
drives both directions) and megablocks' single ``Arguments`` dataclass.

Defaults: ``default`` is the Megatron side's (``ModelArch``, the fields we add to the Megatron
config, their flags). ``hf_default`` is the HF config class's keyword default, i.e. what a
``config.json`` WITHOUT the key means to transformers; every reader of an HF config uses it for
an absent key (``required`` rows are refused instead). The two differ where the HF class
defaults to the full-scale K3 value (SPEC §5): the sizes, which have no Megatron default,
``num_shared_experts`` (HF: K3's 2; Megatron: 0, none) and ``first_k_dense_replace`` (HF: K3's 1
dense layer; Megatron: 0, so small configs stay valid); and for ``max_position_embeddings`` (HF
131072, Megatron 4096) and the token ids (HF None; Megatron the shipped tokenizer's).

Adding a model hyper-parameter: one row here (and, for the HF model to use it, the keyword in the
shipped HF config file, which the pin test demands).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

QUANTILE_HISTOGRAM = "quantile_histogram"
"""``moe_router_load_balancing_type`` value that selects our QB router (SPEC §4)."""
AUX_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
"""Megatron's aux-loss types, the ones QB may be combined with (in a list, coefficient 0 for QB)."""
MEGATRON_BALANCERS = (*AUX_LOSSES, "sinkhorn", "quantile_balancing", "none")
"""Megatron-Core 0.19.2's ``moe_router_load_balancing_type`` values (the choices of its
``--moe-router-load-balancing-type``; ``TransformerConfig`` itself checks none: its router falls
back to plain top-k on any other string)."""
BALANCERS = (*MEGATRON_BALANCERS, QUANTILE_HISTOGRAM)
"""Every ``moe_router_load_balancing_type`` this model runs; a list of several may hold only
distinct aux losses, with or without QB (Megatron's router applies no other type in a list)."""


def balancer_list(lb) -> list:
    """``moe_router_load_balancing_type`` as a list (Megatron takes a string or a list)."""
    return list(lb) if isinstance(lb, (list, tuple)) else [lb]


HIDDEN_ACTS = ("situ", "swiglu")
"""``hidden_act``: SiTU-GLU (SPEC §2) or plain SwiGLU (ablations); HF calls SwiGLU ``silu``."""

QB_BINNINGS = ("uniform", "centered")
"""``moe_qb_binning``: SPEC §4's uniform bins, or bins centred on each expert's bias."""

QB_MIN_BINS = {"uniform": 512, "centered": 64}
"""Fewest ``moe_qb_num_bins`` per binning. QB's bias is within one bin width of the exact quantile;
a router's sigmoid scores spread only ~0.01-0.015 over tokens in training, and the widths are
``(max b - min b + 2) / B`` (uniform: 0.004 at 512) and ~``0.06 / B`` at the bias (centered: 1e-3
at 64). Measured on such scores (``balancing.py`` against ``balancing_reference.py``, 5 seeds,
MaxVio of the next fresh batch under the solved bias; 128 experts top-4 on 2048 and 8192 tokens,
8 top-2 on 512 and 2048): at the minimum MaxVio is within 0.06 of B = 1000's in every case, the
next size down is not (uniform 384: up to +0.10, 256: see ``_QB_MIN_BINS_WHY``; centered 48: +0.07,
32: the same), and tiny.sh trained with B = 2, or 4 centered, balanced worse than no QB."""
QB_MAX_CELLS = 2**31 - 1 - 5
"""Most cells ``num_moe_experts * moe_qb_num_bins`` of one router's QB histogram: with its 5 header
words (``balancing.HEADER_FIELDS``; ``tests/unit/test_balancing.py`` pins the sum) a router packs
at most 2**31 - 1 int32 words for the step-end all-reduce."""
_QB_MIN_BINS_WHY = {
    "uniform": ("2/B = 0.004", "MaxVio 0.66 at 256 bins against 0.45 at 1000, 128 experts top-4"),
    "centered": ("~0.001 next to the bias", "MaxVio 0.51 at 32 bins against 0.43 at 1000"),
}
"""(bin width at the minimum, a measurement below it) for the refusal's message."""

EXPERT_WEIGHT_QATS = ("none", "mxfp4")
"""``moe_expert_weight_qat``: off, or fake-quantize the routed experts' weights to MXFP4."""

ACTIVATION_FUNC_ALLOWED = (
    "F.silu, the default: hidden_act chooses the activation ('situ' or 'swiglu')"
)
"""What ``activation_func`` allows: SiTU-GLU and SwiGLU are both hidden_act's."""

HF_FIXED = {
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "topk_method": "noaux_tc",
    "num_expert_group": 1,
}
"""HF config keys with the one value the Megatron model implements (SPEC §3)."""

MODEL_FIXED = {
    "normalization": (("RMSNorm",), "'RMSNorm' (SPEC §1)"),
    "layernorm_zero_centered_gamma": ((False, None), "False (plain RMSNorm weights, SPEC §1)"),
    "moe_router_num_groups": ((1, None), "None or 1 (no group-limited routing, SPEC §3)"),
    "gated_linear_unit": ((True, None), "True (SiTU-GLU and SwiGLU, hidden_act, are gated)"),
}
"""Megatron fields with one value in every Stable LatentMoE model: (the values allowed, the first
the one written; what is allowed). ``check_stable_latentmoe`` refuses any other value, and so
does ``check_hf_exportable`` (they are :data:`MEGATRON_FIXED` rows), which alone checks the raw
Megatron args of a checkpoint the converter reads."""

MEGATRON_FIXED = {
    "qk_layernorm": ((False,), "False (the HF model has no q/k norms)"),
    "add_bias_linear": ((False,), "False (bias-free linears)"),
    "add_qkv_bias": ((False,), "False"),
    "normalization": MODEL_FIXED["normalization"],
    "rotary_interleaved": ((False,), "False (rotate-half RoPE)"),
    "rotary_percent": ((1.0,), "1.0"),
    "position_embedding_type": (("rope",), "'rope'"),
    "apply_residual_connection_post_layernorm": ((False,), "False"),
    "layernorm_zero_centered_gamma": MODEL_FIXED["layernorm_zero_centered_gamma"],
    "moe_router_score_function": (("sigmoid",), "'sigmoid' (SPEC §3)"),
    "moe_router_num_groups": MODEL_FIXED["moe_router_num_groups"],
    "gated_linear_unit": MODEL_FIXED["gated_linear_unit"],
    "multi_latent_attention": ((False,), "False (GQA attention only)"),
    "moe_shared_expert_gate": ((False,), "False (the HF model's shared experts have no gate)"),
    "moe_router_force_load_balancing": (
        (False,),
        "False (benchmark-only random routing; the HF model routes by the router's scores)",
    ),
    "moe_router_force_biased": (
        (None,),
        "None (benchmark-only biased random routing; the HF model routes by the router's scores)",
    ),
    # Megatron's own GLU options (hidden_act=swiglu trains with them): the HF model's SwiGLU
    # computes silu(gate) * up alone
    "glu_linear_offset": ((0.0,), "0.0 (the HF model's SwiGLU adds no offset to its up branch)"),
    "activation_func_clamp_value": (
        (None,),
        "None (the HF model's SwiGLU clamps neither branch)",
    ),
}
"""Megatron fields whose other values the HF model does not implement: (the values allowed, the
first the one written; what is allowed). ``check_hf_exportable`` refuses any other value (None:
absent from the config or args it reads, not checked); the :data:`MODEL_FIXED` rows are rules of
every config besides."""


class _Sentinel:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


REQUIRED = _Sentinel("REQUIRED")
"""``default`` of a row without one (the Megatron side must give it)."""
_SAME = _Sentinel("SAME")


class ConfigError(ValueError):
    """A wrong value: ``field=value is not allowed: <allowed>``, where ``allowed`` may name other
    fields (``{name}`` placeholders filled from ``refs``), so that the command line can say the
    same with flags and the converter with its own names (:meth:`render`)."""

    def __init__(self, field: str, value: Any, allowed: str, **refs: Any):
        self.field, self.value, self.allowed, self.refs = field, value, allowed, refs
        super().__init__(self.render(lambda name, v: f"{name}={v!r}"))

    def render(self, name_value: Callable[[str, Any], str]) -> str:
        """The message with every ``field=value`` written by ``name_value(field, value)``."""
        allowed = self.allowed.format(**{k: name_value(k, v) for k, v in self.refs.items()})
        return f"{name_value(self.field, self.value)} is not allowed: {allowed}"


def not_allowed(
    field: str, value: Any, allowed: str, error: type = ValueError, **refs: Any
) -> Exception:
    """The one error of a wrong value, as an ``error``: ``field=value is not allowed:
    <allowed>`` (:class:`ConfigError`'s message; ``refs`` fill ``{name}`` placeholders)."""
    return error(str(ConfigError(field, value, allowed, **refs)))


@dataclass(frozen=True)
class ModelField:
    """One hyper-parameter and every name it has."""

    name: str
    """``ModelArch`` field; also the ``megatron.training`` args dest unless ``args`` says."""
    hf: str | None
    """HF ``config.json`` key (None: Megatron-only)."""
    default: Any = REQUIRED
    """Megatron-side default (``ModelArch``, added config field, CLI flag); REQUIRED: none."""
    hf_default: Any = _SAME
    """HF class default = meaning of an absent ``config.json`` key (default: ``default``)."""
    required: bool = False
    """Readers refuse an HF config without the key (the HF default is only an example)."""
    kind: Any = "positive int"
    """Check: "positive int", "int >= 0", "number >= 0", "positive number", "bool", "token id",
    "str", or a tuple of allowed values."""
    megatron: Any = _SAME
    """``TransformerConfig`` field (default: ``name``); None: a ``build_gpt_model`` argument."""
    builder: str | None = None
    """The ``build_gpt_model`` keyword for ``megatron=None`` rows."""
    args: Any = _SAME
    """``megatron.training`` args attribute (default: ``name``); None: not in the args."""
    none_is: Any = None
    """What Megatron's None means (a value, or a function of the other values)."""
    to_hf: Callable[[Any, Mapping], Any] | None = None
    from_hf: Callable[[Any, Mapping], Any] | None = None
    added: bool = False
    """A field ``StableLatentMoETransformerConfig`` adds to ``TransformerConfig`` (with a flag)."""
    flag: str | None = None
    """The flag of an added field (default: --name-with-dashes)."""
    help: str = ""

    def __post_init__(self):
        if self.hf_default is _SAME:
            object.__setattr__(self, "hf_default", self.default)
        if self.megatron is _SAME:
            object.__setattr__(self, "megatron", self.name)
        if self.args is _SAME:
            object.__setattr__(self, "args", self.name)
        if self.added and self.flag is None:
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))

    @property
    def python_type(self) -> type:
        return type(self.kind[0]) if isinstance(self.kind, tuple) else _KINDS[self.kind][0]

    def problem(self, value: Any) -> str | None:
        """What is allowed, when ``value`` is not of this row's kind (None when it is)."""
        if isinstance(self.kind, tuple):
            return None if value in self.kind else f"one of {self.kind}"
        _, ok, allowed = _KINDS[self.kind]
        return None if ok(value) else allowed


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


_KINDS = {
    "positive int": (int, lambda v: _is_int(v) and v > 0, "a positive integer"),
    "int >= 0": (int, lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "token id": (
        int | None,
        lambda v: v is None or (_is_int(v) and v >= 0),
        "None or an integer >= 0",
    ),
    "number >= 0": (float, lambda v: _is_finite_number(v) and v >= 0, "a finite number >= 0"),
    "positive number": (
        float,
        lambda v: _is_finite_number(v) and v > 0,
        "a positive finite number",
    ),
    "bool": (bool, lambda v: isinstance(v, bool), "True or False"),
    "str": (str, lambda v: isinstance(v, str), "a string"),
}
"""Row kinds: (Python type, check, what is allowed)."""


_HF_ACT = {"situ": "situ", "swiglu": "silu"}


def _first(value, _values):
    return value[0] if isinstance(value, (list, tuple)) and value else value


# A table, one row per field (as Megatron-Bridge's CONFIG_MAPPING): kept compact.
# fmt: off
FIELDS: tuple[ModelField, ...] = (
    # ---- sizes (REQUIRED on the Megatron side; the HF class defaults to the K3 values)
    ModelField("num_layers", "num_hidden_layers", hf_default=93, required=True),
    ModelField("hidden_size", "hidden_size", hf_default=7168, required=True),
    ModelField("ffn_hidden_size", "intermediate_size", hf_default=32768, required=True,
               none_is=lambda v: 4 * v["hidden_size"],
               help="Width of the dense MLP of the first_k_dense_replace layers."),
    ModelField("num_attention_heads", "num_attention_heads", hf_default=64, required=True),
    ModelField("num_query_groups", "num_key_value_heads", hf_default=8,
               none_is=lambda v: v["num_attention_heads"]),
    ModelField("kv_channels", "head_dim", hf_default=None,
               none_is=lambda v: v["hidden_size"] // v["num_attention_heads"]),
    ModelField("vocab_size", "vocab_size", hf_default=163840, required=True, megatron=None,
               builder="vocab_size", args="padded_vocab_size",
               help="Rows of the embedding / output layer (Megatron's padded vocabulary)."),
    ModelField("num_experts", "num_experts", hf_default=896, required=True,
               megatron="num_moe_experts", help="n"),
    ModelField("moe_router_topk", "num_experts_per_token", hf_default=16, required=True,
               help="k"),
    ModelField("moe_ffn_hidden_size", "moe_intermediate_size", hf_default=3072, required=True,
               none_is=lambda v: v["ffn_hidden_size"], help="m_e"),
    ModelField("moe_latent_size", "routed_expert_hidden_size", hf_default=3584, required=True,
               help="l, the latent width of the routed experts"),
    # ---- everything else has one default
    ModelField("max_position_embeddings", "max_position_embeddings", 4096, hf_default=131072,
               megatron=None, builder="max_sequence_length"),
    ModelField("rotary_base", "rope_theta", 10000.0, kind="positive number", megatron=None,
               builder="rotary_base"),
    ModelField("layernorm_epsilon", "rms_norm_eps", 1e-5, kind="positive number"),
    ModelField("tie_embeddings", "tie_word_embeddings", False, kind="bool", megatron=None,
               builder="share_embeddings_and_output_weights", args=None),
    ModelField("hidden_act", "hidden_act", "situ", kind=HIDDEN_ACTS, added=True,
               to_hf=lambda v, _: _HF_ACT[v],
               from_hf=lambda v, _: {h: m for m, h in _HF_ACT.items()}.get(v, v),
               help="SPEC §2: 'situ' = SiTU-GLU in routed experts, shared experts and dense MLPs; "
               "'swiglu' = plain SwiGLU (HF 'silu', for ablations)."),
    ModelField("activation_situ_beta", "activation_situ_beta", 4.0, kind="positive number",
               added=True, help="b1 of SiTU-GLU: softcap of the gate's linear factor (SPEC §2)."),
    ModelField("activation_situ_linear_beta", "activation_situ_linear_beta", 25.0,
               kind="positive number", added=True,
               help="b2 of SiTU-GLU: softcap of the up branch (SPEC §2)."),
    ModelField("latent_moe_use_norm", "latent_moe_use_norm", True, kind="bool", added=True,
               flag="--moe-latent-norm",
               help="RMSNorm over the latent width between combine and W_up (SPEC §1)."),
    ModelField("moe_shared_expert_intermediate_size", "num_shared_experts", 0, hf_default=2,
               kind="int >= 0", none_is=0,
               to_hf=lambda v, a: v // a["moe_ffn_hidden_size"],
               from_hf=lambda v, c: v * c["moe_intermediate_size"],
               help="N_s * m_e: the ONE shared gated MLP (0 = none; HF stores N_s)."),
    ModelField("first_k_dense_replace", "first_k_dense_replace", 0, hf_default=1,
               kind="int >= 0", added=True,
               help="The first K layers use a dense MLP instead of the MoE block (SPEC §1; K3: 1). "
               "Sets Megatron's moe_layer_freq."),
    ModelField("moe_router_topk_scaling_factor", "routed_scaling_factor", 1.0,
               kind="positive number", none_is=1.0,
               help="Multiplies the routing probabilities."),
    # ---- Megatron-only: the router's bias update (does not change the weights' layout)
    ModelField("moe_router_load_balancing_type", None, QUANTILE_HISTOGRAM, kind="str"),
    ModelField("moe_router_enable_expert_bias", None, False, kind="bool",
               help="Megatron's sign-update expert bias (with a balancing type other than "
               "quantile_histogram). A router with neither has no expert_bias tensor; its HF "
               "export carries e_score_correction_bias = 0, which selects the same experts."),
    ModelField("moe_qb_num_bins", None, 1000, added=True,
               help="Histogram bins B per expert for Quantile Balancing (SPEC §4, appendix D); "
               "at least "
               + " or ".join(f"{n} {binning}" for binning, n in QB_MIN_BINS.items())
               + " bins (QB_MIN_BINS)."),
    ModelField("moe_qb_binning", None, "uniform", kind=QB_BINNINGS, added=True,
               help="QB histogram bins: 'uniform' over [min(b)-1, max(b)+1] (SPEC §4), or "
               "'centered' on each expert's bias (same traffic; closer to the exact quantile at "
               "equal B, measured by benchmarks/bench_balancing.py: "
               "balancing.CenteredQuantileHistogram)."),
    ModelField("moe_qb_absorb_coeff", None, 0.0, kind="number >= 0", added=True,
               help="c of QB's absorption loss -c * sum_j (b_j - mean(b)) * P_j, P_j = expert "
               "j's mean router score over the micro-batch's tokens: it teaches the router to "
               "take over QB's bias, so that the token, not the bias, decides the selections "
               "(moe/router.py; 0 = off). Measured: c = 1 closes QB's loss gap at d 128 but "
               "destabilises training at d 512 (benchmarks/BALANCE_RACE.md)."),
    ModelField("moe_qb_rescore_iters", None, 0, kind="int >= 0", added=True,
               help="For the first N iterations, QB solves the next step's bias from this "
               "step's batch as the UPDATED model scores it: one forward-only pass of the "
               "batch after the optimizer step (no backward), so the bias follows the fast "
               "early-training drift of the router and its inputs (training/qb_rescore.py; "
               "0 = off)."),
    ModelField("moe_qb_rescore_solves", None, 1, kind="positive int", added=True,
               help="QB solves per rescored step: S - 1 extra solves, each an integer all-reduce "
               "of the histograms and another forward-only pass of the batch under the bias it "
               "solved, so the bias moves all the way in the warm-up's collapse (the one-solve "
               "default keeps one all-reduce per step; needs --moe-qb-rescore-iters)."),
    ModelField("moe_qb_calibrate_batches", None, 0, kind="int >= 0", added=True,
               help="Before iteration 1 of a run that starts at iteration 0, solve QB's bias "
               "layer by layer on the run's LAST N global batches at the initial weights "
               "(forward-only passes), instead of starting from 0: iteration 1 is routed "
               "balanced too (training/qb_calibrate.py; 0 = off; N < --train-iters)."),
    ModelField("moe_expert_weight_qat", None, "none", kind=EXPERT_WEIGHT_QATS, added=True,
               help="Quantization-aware training of the routed experts (SPEC §5): 'mxfp4' "
               "fake-quantizes every routed expert's w1/w3/w2 to MXFP4 in the forward "
               "(straight-through gradient; master weights and optimizer state keep their "
               "dtype; moe/qat.py). Off by default; may be switched on when resuming."),
    # ---- HF-only: token ids (defaults: the shipped tokenizer's, data/assets/tokenizer)
    ModelField("bos_token_id", "bos_token_id", 0, hf_default=None, kind="token id",
               megatron=None, args=None),
    ModelField("eos_token_id", "eos_token_id", 0, hf_default=None, kind="token id",
               megatron=None, args=None, from_hf=_first),
    ModelField("pad_token_id", "pad_token_id", 1, hf_default=None, kind="token id",
               megatron=None, args=None),
)
# fmt: on

BY_NAME = {f.name: f for f in FIELDS}
ADDED = tuple(f for f in FIELDS if f.added)
"""The rows ``StableLatentMoETransformerConfig`` adds to Megatron's ``TransformerConfig``."""


def table_fields(rows):
    """Class decorator (applied before ``@dataclass``): one annotated field per row of ``rows``,
    defaulting to the row's ``default`` (none for REQUIRED rows)."""

    def add(cls):
        own = dict(cls.__dict__.get("__annotations__", {}))
        cls.__annotations__ = {f.name: f.python_type for f in rows}
        cls.__annotations__.update(own)
        for f in rows:
            if f.default is not REQUIRED and f.name not in own:  # the class may re-default
                setattr(cls, f.name, f.default)
        return cls

    return add


def hf_defaults() -> dict:
    """{HF key: HF class default} of every row with an HF key (pinned to the shipped HF file)."""
    return {f.hf: f.hf_default for f in FIELDS if f.hf}


def read_hf(config: Mapping, names, error: type = ValueError, source: str = "HF config") -> dict:
    """{name: value} of the rows ``names`` from an HF config dict: an absent key means the HF
    class's default; an absent required key is refused, naming every missing one."""
    rows = [BY_NAME[n] for n in names]
    missing = [f.hf for f in rows if f.required and config.get(f.hf) is None]
    if missing:
        raise error(f"{source}: missing key(s) {missing}")
    out = {}
    for f in rows:
        value = config.get(f.hf)
        if value is None:
            value = f.hf_default  # in HF units, like the key
        if value is not None and f.from_hf is not None:
            value = f.from_hf(value, config)
        out[f.name] = value
    return out


def read_megatron(get: Callable[[ModelField], Any], names) -> dict:
    """{name: value} of the rows ``names`` (in table order) from a Megatron config or args:
    ``get(row)`` returns the value or None when absent; Megatron's None becomes what it means
    (``none_is``, which may use rows read before it), else the row's default."""
    out = {}
    for f in FIELDS:
        if f.name not in names:
            continue
        value = get(f)
        if value is None:
            value = f.none_is(out) if callable(f.none_is) else f.none_is
        if value is None:
            value = None if f.default is REQUIRED else f.default
        out[f.name] = value
    return out


def megatron_values(values: Mapping) -> dict:
    """{Megatron config field: value} of the rows in ``values`` that have one (None where
    Megatron's None means the value)."""
    out = {}
    for name, value in values.items():
        f = BY_NAME[name]
        if f.megatron:
            fixed = f.none_is is not None and not callable(f.none_is)
            out[f.megatron] = None if fixed and value == f.none_is else value
    return out


# ------------------------------------------------------------------------------------ rules
def fixed_values() -> dict:
    """{field: the value written} of every :data:`MEGATRON_FIXED` row (the first allowed)."""
    return {name: values[0] for name, (values, _) in MEGATRON_FIXED.items()}


def _check_fixed(get: Callable[[str], Any], table: Mapping, unset_ok: bool) -> None:
    """Refuse a value that its ``table`` row (:data:`MODEL_FIXED`, :data:`MEGATRON_FIXED`) does
    not allow; None passes too when ``unset_ok`` (the field is absent)."""
    for name, (values, allowed) in table.items():
        value = get(name)
        if not (value in values or (unset_ok and value is None)):
            raise ConfigError(name, value, allowed)


def check_stable_latentmoe(get: Callable[[str], Any]) -> None:
    """Every rule of a Stable LatentMoE config, stated once: raises :class:`ConfigError`.
    ``get(field)`` reads a ``StableLatentMoETransformerConfig`` field, None when not set: the
    config itself (``config``), the parsed command line before Megatron's ``validate_args``
    (``training.arguments``), or the converter's model description (``convert.arch``)."""
    for f in ADDED:
        allowed = f.problem(get(f.name))
        if allowed:
            raise ConfigError(f.name, get(f.name), allowed)
    num_layers, k_dense = get("num_layers"), get("first_k_dense_replace")
    if not (_is_int(num_layers) and num_layers > 0):  # 0: a ZeroDivisionError in Megatron's init
        raise ConfigError("num_layers", num_layers, "a positive integer")
    if not k_dense < num_layers:
        raise ConfigError(
            "first_k_dense_replace",
            k_dense,
            "an integer in [0, {num_layers})",
            num_layers=num_layers,
        )
    _check_fixed(get, MODEL_FIXED, unset_ok=False)  # None as the rows say: normalization's refused
    act = get("activation_func")
    if act is not None and getattr(act, "__name__", None) != "silu":
        raise ConfigError("activation_func", getattr(act, "__name__", act), ACTIVATION_FUNC_ALLOWED)
    if get("hidden_act") == "situ":
        # Megatron's fused expert / activation kernels implement SwiGLU only: with these on,
        # the experts would silently run SwiGLU or fail deep inside TE (the grouped-GEMM shared
        # expert, FusedSharedExpertMLP, always builds TE's ScaledSwiGLU).
        for name in (
            "use_transformer_engine_op_fuser",
            "activation_func_fp8_input_store",
            "use_grouped_gemm_for_shared_expert",
        ):
            if get(name):
                raise ConfigError(
                    name,
                    True,
                    "False with {hidden_act} (Megatron fuses SwiGLU only)",
                    hidden_act="situ",
                )
        # Megatron applies these in its own GLU only (never to the activation module SiTU-GLU
        # is): they would be silently ignored. SiTU-GLU's bound is its softcaps' (SPEC §2).
        for name, off, allowed in (
            ("activation_func_clamp_value", None, "unset (None)"),
            ("glu_linear_offset", 0.0, "0.0"),
        ):
            value = get(name)
            if value is not None and value != off:
                raise ConfigError(
                    name,
                    value,
                    f"{allowed} with {{hidden_act}} (Megatron's GLU option; SiTU-GLU is bounded by "
                    "its softcaps, activation_situ_beta / activation_situ_linear_beta)",
                    hidden_act="situ",
                )
    heads, query_groups = get("num_attention_heads"), get("num_query_groups")
    if _is_int(query_groups) and query_groups < 1:  # 0: a ZeroDivisionError building attention
        raise ConfigError("num_query_groups", query_groups, "a positive integer")
    if _is_int(heads) and _is_int(query_groups) and heads % query_groups:
        raise ConfigError(  # else a shape error in the first forward of the attention
            "num_query_groups",
            query_groups,
            "a divisor of {num_attention_heads}",
            num_attention_heads=heads,
        )
    _check_tensor_parallel_widths(get)
    n = get("num_moe_experts")
    if not n:
        return
    latent = get("moe_latent_size")
    if latent is not None and not (_is_int(latent) and latent > 0):
        raise ConfigError(
            "moe_latent_size",
            latent,
            "a positive integer, or unset (None) for a plain Megatron MoE",
        )
    moe_ffn = get("moe_ffn_hidden_size")
    if moe_ffn is not None and not (_is_int(moe_ffn) and moe_ffn > 0):
        raise ConfigError(  # 0: experts of width 0, a routed branch of zeros, trained silently
            "moe_ffn_hidden_size",
            moe_ffn,
            "a positive integer, or unset (None) for ffn_hidden_size",
        )
    if get("latent_moe_use_norm") and not latent:
        raise ConfigError(
            "latent_moe_use_norm",
            True,
            "False unless moe_latent_size is set (the norm is over the latent width)",
        )
    dense_then_moe = [0] * k_dense + [1] * (num_layers - k_dense)
    freq = get("moe_layer_freq")
    if _is_int(freq) and freq < 1:  # else a ZeroDivisionError while the layers are built
        raise ConfigError(
            "moe_layer_freq",
            freq,
            "a positive integer (every N-th layer is MoE) or a list of 0 / 1, one per layer",
        )
    if k_dense and freq not in (1, dense_then_moe):
        raise ConfigError(
            "first_k_dense_replace",
            k_dense,
            f"0 when {{moe_layer_freq}} is set (it would override the pattern); or "
            f"moe_layer_freq 1 or {dense_then_moe}",
            moe_layer_freq=freq,
        )
    for name, why in (
        ("moe_apply_probs_on_input", "the block weights expert OUTPUTS: p * E(z) (SPEC §1)"),
        ("moe_enable_routing_replay", "the Stable LatentMoE routers do not record or replay"),
    ):
        if get(name):
            raise ConfigError(name, True, f"False ({why})")
    ep, k = get("expert_model_parallel_size") or 1, get("moe_router_topk")
    if n % ep:
        raise ConfigError(
            "num_moe_experts",
            n,
            "a multiple of {expert_model_parallel_size}",
            expert_model_parallel_size=ep,
        )
    if not 1 <= k < n:
        raise ConfigError(
            "moe_router_topk", k, "an integer in [1, {num_moe_experts})", num_moe_experts=n
        )
    scale = get("moe_router_topk_scaling_factor")
    if scale is not None and not scale > 0:
        raise ConfigError("moe_router_topk_scaling_factor", scale, "None or a positive number")
    if latent is not None:
        tp = get("tensor_model_parallel_size") or 1
        if latent % tp:
            raise ConfigError(
                "moe_latent_size",
                latent,
                "a multiple of {tensor_model_parallel_size}",
                tensor_model_parallel_size=tp,
            )
        if get("moe_shared_expert_overlap"):
            raise ConfigError(
                "moe_shared_expert_overlap",
                True,
                "False with moe_latent_size (shared experts see the full-width input)",
            )
        for name in ("moe_mlp_glu_interleave_size", "moe_shared_expert_glu_interleave_size"):
            if get(name) is not None:
                raise ConfigError(  # else the export splits fc1 into gate / up wrongly
                    name,
                    get(name),
                    "None with moe_latent_size (gate and up stay two halves of fc1, as the HF "
                    "export and SiTU-GLU read them)",
                )
    score = get("moe_router_score_function")
    if get("moe_router_pre_softmax") and score != "softmax":
        raise ConfigError(  # else silently ignored: Megatron applies it to softmax scores only
            "moe_router_pre_softmax",
            True,
            "False with {moe_router_score_function} (Megatron's pre-softmax applies to softmax "
            "scores only; sigmoid scores are renormalised over the k chosen experts, SPEC §3)",
            moe_router_score_function=score,
        )
    lb = get("moe_router_load_balancing_type")  # None: not set (Megatron's default)
    balancers = [] if lb is None else balancer_list(lb)
    ok = set(AUX_LOSSES) | {QUANTILE_HISTOGRAM} if len(balancers) > 1 else set(BALANCERS)
    if lb is not None and (
        not balancers
        or not all(isinstance(b, str) and b in ok for b in balancers)
        or len(set(balancers)) < len(balancers)
    ):
        raise ConfigError(
            "moe_router_load_balancing_type",
            lb,
            f"one of {list(BALANCERS)}, or a list of distinct aux losses of {list(AUX_LOSSES)} "
            f"with or without {QUANTILE_HISTOGRAM!r} (Megatron-Core applies no other type in a "
            "list)",
        )
    if QUANTILE_HISTOGRAM in balancers:
        _check_quantile_balancing(get, balancers)
    else:
        for field, why in (
            ("moe_qb_absorb_coeff", "it teaches the router QB's bias"),
            ("moe_qb_rescore_iters", "it re-solves QB's bias"),
            ("moe_qb_calibrate_batches", "it solves QB's bias before training"),
        ):
            if get(field):
                raise ConfigError(
                    field,
                    get(field),
                    f"0 unless moe_router_load_balancing_type has quantile_histogram ({why})",
                )
    solves = get("moe_qb_rescore_solves")
    if solves not in (None, 1) and not get("moe_qb_rescore_iters"):
        raise ConfigError(
            "moe_qb_rescore_solves",
            solves,
            "1 unless moe_qb_rescore_iters > 0 with quantile_histogram (it solves rescored steps)",
        )
    if get("moe_expert_weight_qat") not in (None, "none"):
        _check_expert_weight_qat(get)


def _expert_width(get: Callable[[str], Any]) -> Any:
    """The routed experts' width: ``moe_ffn_hidden_size``, Megatron's default when unset being
    ``ffn_hidden_size``."""
    width = get("moe_ffn_hidden_size")
    return get("ffn_hidden_size") if width is None else width


def moe_layer_pattern(freq: int | list, num_layers: int) -> list[int]:
    """Megatron's ``moe_layer_freq`` as one entry per layer (1: MoE, 0: dense): an int N makes
    every N-th layer from the first MoE, a list is the pattern itself."""
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    return list(freq)


def check_hf_exportable(get: Callable[[str], Any]) -> None:
    """What the HF model (K3 naming) cannot express in a config that trains: raises
    :class:`ConfigError`. The converter refuses such a checkpoint; training warns at start-up."""
    latent = get("moe_latent_size")
    if not latent:  # first: the cause, before the rules a plain Megatron MoE may break
        raise ConfigError(
            "moe_latent_size",
            latent,
            "a positive integer (the HF model is the Stable LatentMoE block, its routed experts "
            "in a latent of this width); unset, the MoE layers are Megatron's MoELayer (QB as a "
            "drop-in), which the HF model does not implement",
        )
    _check_fixed(get, MEGATRON_FIXED, unset_ok=True)
    act = get("activation_func")
    if isinstance(act, str) and act != "silu":  # a config file's, by name: it was left unread
        # and the model exported with hidden_act's activation (a function is the config's,
        # checked by check_stable_latentmoe)
        raise ConfigError("activation_func", act, ACTIVATION_FUNC_ALLOWED)
    freq, layers = get("moe_layer_freq"), get("num_layers")
    if _is_int(layers) and (isinstance(freq, (list, tuple)) or (_is_int(freq) and freq > 1)):
        pattern = moe_layer_pattern(freq, layers)
        dense = pattern.index(1) if 1 in pattern else layers
        if dense == layers or pattern != [0] * dense + [1] * (layers - dense):
            raise ConfigError(
                "moe_layer_freq",
                freq,
                f"1 or [0] * k + [1] * ({layers} - k) ({{num_layers}}): only the first layers "
                "may be dense, as in the HF model",
                num_layers=layers,
            )
    balancers = get("moe_router_load_balancing_type")
    if "quantile_balancing" in balancer_list(balancers):
        raise ConfigError(
            "moe_router_load_balancing_type",
            balancers,
            "a balancer other than Megatron-Core's quantile_balancing, which routes on the "
            "router's logits minus its per-expert qb_beta: the HF model selects on sigmoid scores "
            "plus e_score_correction_bias, which cannot express it (quantile_histogram, ours, "
            "keeps that bias)",
        )
    shared, expert = get("moe_shared_expert_intermediate_size"), _expert_width(get)
    if _is_int(shared) and _is_int(expert) and expert > 0 and shared % expert:
        raise ConfigError(
            "moe_shared_expert_intermediate_size",
            shared,
            "a multiple of {moe_ffn_hidden_size} (the HF model stores num_shared_experts = "
            "shared width / moe_intermediate_size)",
            moe_ffn_hidden_size=expert,
        )


def _check_tensor_parallel_widths(get: Callable[[str], Any]) -> None:
    """Every gated MLP's intermediate is split over its tensor-parallel ranks: the dense MLPs' and
    the shared experts' over TP, the routed experts' over expert TP (default: TP). A width they do
    not divide would fail as Megatron's bare "N is not divisible by M" while the model is built.
    A width still None (the command line before Megatron's validate_args) is checked later, by
    the config built from the args."""
    tp = get("tensor_model_parallel_size") or 1
    etp_name = "expert_tensor_parallel_size"
    if get(etp_name) is None:
        etp_name = "tensor_model_parallel_size"  # Megatron's default for the expert TP size
    etp = get(etp_name) or 1
    n, k_dense, freq = get("num_moe_experts"), get("first_k_dense_replace"), get("moe_layer_freq")
    pattern = freq if isinstance(freq, (list, tuple)) else []
    has_dense = not n or bool(k_dense) or 0 in pattern or (_is_int(freq) and freq not in (None, 1))
    ffn = get("ffn_hidden_size")
    widths = [("ffn_hidden_size", ffn, "tensor_model_parallel_size", tp)] if has_dense else []
    if n:
        widths += [
            ("moe_ffn_hidden_size", _expert_width(get), etp_name, etp),
            (
                "moe_shared_expert_intermediate_size",
                get("moe_shared_expert_intermediate_size"),
                "tensor_model_parallel_size",
                tp,
            ),
        ]
    for name, width, by_name, by in widths:
        if _is_int(width) and width > 0 and width % by:
            raise ConfigError(name, width, f"a multiple of {{{by_name}}}", **{by_name: by})


def _check_expert_weight_qat(get: Callable[[str], Any]) -> None:
    from megatron_latentmoe.ops.mxfp4 import BLOCK  # torch: only when QAT is asked for

    qat = {"moe_expert_weight_qat": get("moe_expert_weight_qat")}
    # MXFP4 blocks run along each GEMM's reduction dim: w1/w3 reduce over the latent width,
    # w2 over its expert-tensor-parallel shard of moe_ffn_hidden_size (blocks never straddle
    # shards, so every layout quantizes exactly like one process).
    etp = get("expert_tensor_parallel_size") or get("tensor_model_parallel_size") or 1
    # a width still None (flags before Megatron's validate_args) waits for the config
    name = "moe_latent_size" if get("moe_latent_size") else "hidden_size"
    if _is_int(get(name)) and get(name) % BLOCK:
        raise ConfigError(
            name, get(name), f"a multiple of {BLOCK} with {{moe_expert_weight_qat}}", **qat
        )
    ffn = _expert_width(get)
    if _is_int(ffn) and ffn % (BLOCK * etp):
        raise ConfigError(
            "moe_ffn_hidden_size",
            ffn,
            f"a multiple of {BLOCK} x "
            "{expert_tensor_parallel_size} with {moe_expert_weight_qat}",
            expert_tensor_parallel_size=etp,
            **qat,
        )
    if get("fp8") and get("fp8_recipe") != "mxfp8":
        raise ConfigError(
            "fp8_recipe",
            get("fp8_recipe"),
            "'mxfp8' with {moe_expert_weight_qat} "
            "(MXFP4 weights are exact in MXFP8; per-tensor FP8 scales would re-round "
            "them)",
            **qat,
        )
    if get("fp8_param"):
        raise ConfigError(
            "fp8_param",
            True,
            "False with {moe_expert_weight_qat} (the fake-quant "
            "reads high-precision master weights)",
            **qat,
        )


def _check_quantile_balancing(get: Callable[[str], Any], balancers: list) -> None:
    qb = "quantile_histogram balancing"
    score = get("moe_router_score_function")
    if score != "sigmoid":
        raise ConfigError("moe_router_score_function", score, f"'sigmoid' with {qb} (SPEC §3)")
    if get("moe_router_enable_expert_bias"):
        raise ConfigError(
            "moe_router_enable_expert_bias",
            True,
            "False with quantile_histogram: the QB router owns expert_bias and "
            "Megatron's sign update would fight it",
        )
    if get("moe_router_fusion"):
        raise ConfigError(  # else silently ignored: the QB router routes with its own top-(k+1)
            "moe_router_fusion",
            True,
            f"False with {qb}: its top-(k+1) routing and cutoffs have no fused kernel "
            "(Megatron's own quantile_balancing refuses it too)",
        )
    coeff = get("moe_aux_loss_coeff")
    coeffs = balancer_list(coeff)  # Megatron takes one coefficient or one per balancing type
    if len(balancers) == 1 and any(coeffs):  # None: not set
        raise ConfigError("moe_aux_loss_coeff", coeff, f"0 with {qb}")
    if len(balancers) > 1 and (
        len(coeffs) != len(balancers) or coeffs[balancers.index(QUANTILE_HISTOGRAM)]
    ):
        raise ConfigError(
            "moe_aux_loss_coeff",
            coeff,
            f"one coefficient per balancing type of {balancers}, 0 for {QUANTILE_HISTOGRAM!r}",
        )
    bins, binning = (
        get("moe_qb_num_bins"),
        get("moe_qb_binning") or BY_NAME["moe_qb_binning"].default,
    )
    least = QB_MIN_BINS[binning]
    if bins < least:
        width, below = _QB_MIN_BINS_WHY[binning]
        raise ConfigError(
            "moe_qb_num_bins",
            bins,
            f"an {'even ' if binning == 'centered' else ''}integer >= {least} with "
            f"{{moe_qb_binning}}: the bias is within one bin width of the exact quantile (at "
            f"{least} bins: {width}) and router scores spread only ~0.01 over tokens (measured: "
            f"{below})",
            moe_qb_binning=binning,
        )
    n = get("num_moe_experts")
    if bins * n > QB_MAX_CELLS:  # else refused only when the model is built, as a traceback
        raise ConfigError(
            "moe_qb_num_bins",
            bins,
            f"an integer <= {QB_MAX_CELLS // n} with {{num_moe_experts}} (the histogram's "
            f"num_moe_experts x moe_qb_num_bins int32 counts: at most {QB_MAX_CELLS})",
            num_moe_experts=n,
        )
    if binning == "centered" and bins % 2:
        raise ConfigError(
            "moe_qb_num_bins",
            bins,
            "an even integer with {moe_qb_binning} (half the bins each side of the bias)",
            moe_qb_binning="centered",
        )
    if get("moe_expert_capacity_factor") is not None:
        raise ConfigError(
            "moe_expert_capacity_factor",
            get("moe_expert_capacity_factor"),
            f"None with {qb} (QB balances without dropping tokens)",
        )
