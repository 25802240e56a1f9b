"""One config for a Stable LatentMoE model: Megatron's ``TransformerConfig`` plus SPEC §1–§4 fields.

Megatron names are reused wherever Megatron already has the knob; the fields it adds, and the HF
name of every field, are rows of :data:`megatron_latentmoe.fields.FIELDS` (one table for the HF
config, the converter, the ledger and the command line).

Every rule is stated once, in :func:`check_stable_latentmoe`: a wrong value raises
:class:`ConfigError` naming the field, the value and what is allowed, before Megatron's own checks
run (theirs are asserts deep inside module constructors). The command line runs the same function
on the parsed flags and prints the error with flag names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_latentmoe.fields import (
    ADDED,
    FIELDS,
    QUANTILE_HISTOGRAM,
    hf_defaults,
    megatron_values,
    read_hf,
)


class ConfigError(ValueError):
    """A wrong config value: ``field=value is not allowed: <allowed>`` (``fields.not_allowed``'s
    style), where ``allowed`` may
    name other fields (``{name}`` placeholders filled from ``refs``), so the command line can
    say the same with flags (:meth:`render`)."""

    def __init__(self, field: str, value: Any, allowed: str, **refs: Any):
        self.field, self.value, self.allowed, self.refs = field, value, allowed, refs
        super().__init__(self.render(lambda name, v: f"{name}={v!r}"))

    def render(self, name_value: Callable[[str, Any], str]) -> str:
        """The message with every ``field=value`` written by ``name_value(field, value)``."""
        allowed = self.allowed.format(**{k: name_value(k, v) for k, v in self.refs.items()})
        return f"{name_value(self.field, self.value)} is not allowed: {allowed}"


def _with_table_fields(cls):
    """Add the table's ``added`` rows as dataclass fields (before ``@dataclass`` runs)."""
    own = dict(cls.__dict__.get("__annotations__", {}))
    cls.__annotations__ = {f.name: f.python_type for f in ADDED}
    cls.__annotations__.update(own)
    for f in ADDED:
        setattr(cls, f.name, f.default)
    return cls


@dataclass
@_with_table_fields
class StableLatentMoETransformerConfig(TransformerConfig):
    """``TransformerConfig`` + the Stable LatentMoE fields (SPEC §1, §2, §4): the ``added`` rows
    of ``megatron_latentmoe.fields.FIELDS`` (their defaults and docs are there)."""

    normalization: str = "RMSNorm"
    """Megatron's field, re-defaulted: every norm of the model is an RMSNorm (SPEC §1); the
    only value allowed."""

    _layer_freq_from_first_k: bool = dataclasses.field(default=False, repr=False)
    """Internal: ``moe_layer_freq`` was derived from ``first_k_dense_replace`` (not given), so a
    ``dataclasses.replace`` of this config derives it again from the new values."""

    def __post_init__(self):
        if self._layer_freq_from_first_k:  # a copy (dataclasses.replace): derive it again
            self.moe_layer_freq, self._layer_freq_from_first_k = 1, False
        check_stable_latentmoe(lambda name: getattr(self, name))
        self._apply_stable_latentmoe_defaults()
        super().__post_init__()

    def _apply_stable_latentmoe_defaults(self) -> None:
        """Translate our fields into the Megatron fields that implement them."""
        if self.hidden_act == "situ":
            # Megatron's MLP / experts call the spec's activation module on the packed
            # [gate, up] fc1 output when use_te_activation_func is set (specs.py provides SiTUGLU).
            self.gated_linear_unit = True
            self.use_te_activation_func = True
            self.bias_activation_fusion = False
        elif self.hidden_act == "swiglu":
            self.gated_linear_unit = True
            self.activation_func = F.silu
            self.use_te_activation_func = False
        if self.uses_quantile_balancing and self.moe_router_dtype is None:
            self.moe_router_dtype = "fp32"  # router logits, scores and mixing weights in fp32
        if self.num_moe_experts and self.first_k_dense_replace and self.moe_layer_freq == 1:
            k = self.first_k_dense_replace
            self.moe_layer_freq = [0] * k + [1] * (self.num_layers - k)
            self._layer_freq_from_first_k = True

    @property
    def uses_quantile_balancing(self) -> bool:
        return self.moe_router_load_balancing_type == QUANTILE_HISTOGRAM


def check_stable_latentmoe(get: Callable[[str], Any]) -> None:
    """Every rule of a Stable LatentMoE config, stated once: raises :class:`ConfigError`.
    ``get(field)`` reads a ``StableLatentMoETransformerConfig`` field (the config itself, or the
    parsed command line before Megatron's ``validate_args``: see ``training.arguments``)."""
    for f in ADDED:
        allowed = f.problem(get(f.name))
        if allowed:
            raise ConfigError(f.name, get(f.name), allowed)
    num_layers, k_dense = get("num_layers"), get("first_k_dense_replace")
    if not k_dense < max(num_layers, 1):
        raise ConfigError("first_k_dense_replace", k_dense, "an integer in [0, {num_layers})",
                          num_layers=num_layers)
    if get("normalization") != "RMSNorm":
        raise ConfigError("normalization", get("normalization"), "'RMSNorm' (SPEC §1)")
    if get("layernorm_zero_centered_gamma"):
        raise ConfigError("layernorm_zero_centered_gamma", True,
                          "False (plain RMSNorm weights, SPEC §1)")
    if get("hidden_act") == "situ":
        # Megatron's fused expert / activation kernels implement SwiGLU only: with these on,
        # the experts would silently run SwiGLU or fail deep inside TE.
        for name in ("use_transformer_engine_op_fuser", "activation_func_fp8_input_store"):
            if get(name):
                raise ConfigError(name, True, "False with {hidden_act} (Megatron fuses SwiGLU "
                                  "only)", hidden_act="situ")
    groups = get("moe_router_num_groups")
    if groups not in (None, 1):
        raise ConfigError("moe_router_num_groups", groups,
                          "None or 1 (no group-limited routing, SPEC §3)")
    n = get("num_moe_experts")
    if not n:
        return
    latent = get("moe_latent_size")
    if get("latent_moe_use_norm") and not latent:
        raise ConfigError("latent_moe_use_norm", True,
                          "False unless moe_latent_size is set (the norm is over the latent width)")
    dense_then_moe = [0] * k_dense + [1] * (num_layers - k_dense)
    freq = get("moe_layer_freq")
    if k_dense and freq not in (1, dense_then_moe):
        raise ConfigError("first_k_dense_replace", k_dense,
                          f"0 when {{moe_layer_freq}} is set (it would override the pattern); or "
                          f"moe_layer_freq 1 or {dense_then_moe}", moe_layer_freq=freq)
    for name, why in (
        ("moe_apply_probs_on_input", "the block weights expert OUTPUTS: p * E(z) (SPEC §1)"),
        ("moe_enable_routing_replay", "the Stable LatentMoE routers do not record or replay"),
    ):
        if get(name):
            raise ConfigError(name, True, f"False ({why})")
    ep, k = get("expert_model_parallel_size"), get("moe_router_topk")
    if n % ep:
        raise ConfigError("num_moe_experts", n, "a multiple of {expert_model_parallel_size}",
                          expert_model_parallel_size=ep)
    if not 1 <= k < n:
        raise ConfigError("moe_router_topk", k, "an integer in [1, {num_moe_experts})",
                          num_moe_experts=n)
    scale = get("moe_router_topk_scaling_factor")
    if scale is not None and not scale > 0:
        raise ConfigError("moe_router_topk_scaling_factor", scale, "None or a positive number")
    if latent is not None:
        tp = get("tensor_model_parallel_size")
        if not latent > 0:
            raise ConfigError("moe_latent_size", latent, "a positive integer")
        if latent % tp:
            raise ConfigError("moe_latent_size", latent,
                              "a multiple of {tensor_model_parallel_size}",
                              tensor_model_parallel_size=tp)
        if get("moe_shared_expert_overlap"):
            raise ConfigError("moe_shared_expert_overlap", True,
                              "False with moe_latent_size (shared experts see the full-width "
                              "input)")
    lb = get("moe_router_load_balancing_type")
    if isinstance(lb, (list, tuple)) and QUANTILE_HISTOGRAM in lb and len(lb) > 1:
        raise ConfigError("moe_router_load_balancing_type", lb,
                          f"{QUANTILE_HISTOGRAM!r} alone (it cannot be combined with other types)")
    if lb in (QUANTILE_HISTOGRAM, [QUANTILE_HISTOGRAM]):
        _check_quantile_balancing(get)
    if get("moe_expert_weight_qat") != "none":
        _check_expert_weight_qat(get)


def _check_expert_weight_qat(get: Callable[[str], Any]) -> None:
    from megatron_latentmoe.ops.mxfp4 import BLOCK

    qat = {"moe_expert_weight_qat": get("moe_expert_weight_qat")}
    # MXFP4 blocks run along each GEMM's reduction dim: w1/w3 reduce over the latent width,
    # w2 over its expert-tensor-parallel shard of moe_ffn_hidden_size (blocks never straddle
    # shards, so every layout quantizes exactly like one process).
    etp = get("expert_tensor_parallel_size") or get("tensor_model_parallel_size")
    name = "moe_latent_size" if get("moe_latent_size") else "hidden_size"
    if get(name) % BLOCK:
        raise ConfigError(name, get(name), f"a multiple of {BLOCK} with {{moe_expert_weight_qat}}",
                          **qat)
    ffn = get("moe_ffn_hidden_size") or get("ffn_hidden_size")
    if ffn % (BLOCK * etp):
        raise ConfigError("moe_ffn_hidden_size", ffn, f"a multiple of {BLOCK} x "
                          "{expert_tensor_parallel_size} with {moe_expert_weight_qat}",
                          expert_tensor_parallel_size=etp, **qat)
    if get("fp8") and get("fp8_recipe") != "mxfp8":
        raise ConfigError("fp8_recipe", get("fp8_recipe"), "'mxfp8' with {moe_expert_weight_qat} "
                          "(MXFP4 weights are exact in MXFP8; per-tensor FP8 scales would re-round "
                          "them)", **qat)
    if get("fp8_param"):
        raise ConfigError("fp8_param", True, "False with {moe_expert_weight_qat} (the fake-quant "
                          "reads high-precision master weights)", **qat)


def _check_quantile_balancing(get: Callable[[str], Any]) -> None:
    qb = "quantile_histogram balancing"
    score = get("moe_router_score_function")
    if score != "sigmoid":
        raise ConfigError("moe_router_score_function", score, f"'sigmoid' with {qb} (SPEC §3)")
    if get("moe_router_enable_expert_bias"):
        raise ConfigError("moe_router_enable_expert_bias", True,
                          "False with quantile_histogram: the QB router owns expert_bias and "
                          "Megatron's sign update would fight it")
    coeff = get("moe_aux_loss_coeff")
    if any(c != 0 for c in (coeff if isinstance(coeff, list) else [coeff])):
        raise ConfigError("moe_aux_loss_coeff", coeff, f"0 with {qb}")
    bins = get("moe_qb_num_bins")
    if not bins >= 2:
        raise ConfigError("moe_qb_num_bins", bins, "an integer >= 2")
    if get("moe_qb_binning") == "centered" and bins % 2:
        raise ConfigError("moe_qb_num_bins", bins, "an even integer with {moe_qb_binning} "
                          "(half the bins each side of the bias)", moe_qb_binning="centered")
    if get("moe_expert_capacity_factor") is not None:
        raise ConfigError("moe_expert_capacity_factor", get("moe_expert_capacity_factor"),
                          f"None with {qb} (QB balances without dropping tokens)")


def stable_latentmoe_fields() -> tuple[str, ...]:
    """Names of the fields this config adds to ``TransformerConfig``."""
    base = {f.name for f in dataclasses.fields(TransformerConfig)}
    return tuple(
        f.name for f in dataclasses.fields(StableLatentMoETransformerConfig)
        if f.name not in base and not f.name.startswith("_")
    )


def tiny_config(**overrides) -> StableLatentMoETransformerConfig:
    """A small fp32 Stable LatentMoE config for tests, demos and the CPU default run."""
    values = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_latent_size=32,
        moe_shared_expert_intermediate_size=96,
        moe_router_score_function="sigmoid",
        moe_router_load_balancing_type=QUANTILE_HISTOGRAM,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        init_method_std=0.02,
    )
    values.update(overrides)
    return StableLatentMoETransformerConfig(**values)


def k3_full_scale_config(**overrides) -> StableLatentMoETransformerConfig:
    """SPEC §5 full-scale numbers: the HF config class's defaults (``fields.hf_defaults``; the
    attention sizes are Megatron GQA stand-ins)."""
    k3 = read_hf(hf_defaults(), [f.name for f in FIELDS if f.megatron and f.hf])
    values = dict(
        megatron_values(k3),
        moe_router_score_function="sigmoid",
        moe_router_load_balancing_type=QUANTILE_HISTOGRAM,
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=0.0,
        add_bias_linear=False,
    )
    values.update(overrides)
    return StableLatentMoETransformerConfig(**values)
