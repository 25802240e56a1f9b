"""One config for a Stable LatentMoE model: Megatron's ``TransformerConfig`` plus SPEC §1–§4 fields.

Megatron names are reused wherever Megatron already has the knob; the fields it adds, and the HF
name of every field, are rows of :data:`megatron_latentmoe.fields.FIELDS` (one table for the HF
config, the converter, the ledger and the command line).

Every rule is stated once, in :func:`megatron_latentmoe.fields.check_stable_latentmoe` (no
Megatron import): a wrong value raises ``fields.ConfigError`` naming the field, the value and what
is allowed, before Megatron's own checks run (theirs are asserts deep inside module constructors).
The command line runs the same function on the parsed flags (the error then names the flags), the
converter on its model description.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_latentmoe.fields import (
    ADDED,
    FIELDS,
    QUANTILE_HISTOGRAM,
    balancer_list,
    check_stable_latentmoe,
    hf_defaults,
    megatron_values,
    read_hf,
    table_fields,
)


@dataclass
@table_fields(ADDED)
class StableLatentMoETransformerConfig(TransformerConfig):
    """``TransformerConfig`` + the Stable LatentMoE fields (SPEC §1, §2, §4): the ``added`` rows
    of ``megatron_latentmoe.fields.FIELDS`` (their defaults and docs are there)."""

    normalization: str = "RMSNorm"
    """Megatron's field, re-defaulted: every norm of the model is an RMSNorm (SPEC §1); the
    only value allowed."""

    gated_linear_unit: bool = True
    """Megatron's field, re-defaulted: SiTU-GLU and SwiGLU (``hidden_act``) are both gated; the
    only value allowed."""

    activation_func: Callable = F.silu
    """Megatron's field, re-defaulted to SwiGLU's; ``hidden_act`` chooses the activation (SiTU-GLU
    comes from the spec's activation module), so no other value is allowed."""

    latent_moe_use_norm: bool | None = None
    """The ``latent_moe_use_norm`` row, defaulting as its flag ``--moe-latent-norm`` does: None
    (not given) = on iff ``moe_latent_size`` is set, so that leaving the latent size out gives
    Megatron's MoELayer; True without a latent size is refused."""

    _layer_freq_derived: list[int] | None = dataclasses.field(default=None, repr=False)
    """Internal: the ``moe_layer_freq`` derived from ``first_k_dense_replace`` (None: it was
    given), so that a ``dataclasses.replace`` that keeps it derives it again from the new values
    (and one that gives another ``moe_layer_freq`` keeps that)."""

    _latent_norm_derived: bool | None = dataclasses.field(default=None, repr=False)
    """Internal: the ``latent_moe_use_norm`` derived from ``moe_latent_size`` (None: it was
    given), so that a ``dataclasses.replace`` that keeps it derives it again."""

    def __post_init__(self):
        if self.moe_layer_freq == self._layer_freq_derived:  # a copy that kept it: derive again
            self.moe_layer_freq = 1
        self._layer_freq_derived = None
        if self.latent_moe_use_norm == self._latent_norm_derived:  # a copy that kept it
            self.latent_moe_use_norm = None
        self._latent_norm_derived = None
        if self.latent_moe_use_norm is None:
            self.latent_moe_use_norm = self._latent_norm_derived = self.moe_latent_size is not None
        if self.moe_shared_expert_intermediate_size == 0:  # the table's "0 = none" (Megatron: None)
            self.moe_shared_expert_intermediate_size = None
        check_stable_latentmoe(lambda name: getattr(self, name))
        self._apply_stable_latentmoe_defaults()
        super().__post_init__()

    def _apply_stable_latentmoe_defaults(self) -> None:
        """Translate our fields into the Megatron fields that implement them."""
        if self.hidden_act == "situ":
            # Megatron's MLP / experts call the spec's activation module on the packed
            # [gate, up] fc1 output when use_te_activation_func is set (specs.py provides SiTUGLU).
            self.use_te_activation_func = True
            self.bias_activation_fusion = False
        elif self.hidden_act == "swiglu":
            self.use_te_activation_func = False
        if (self.uses_quantile_balancing or self.moe_latent_size) and self.moe_router_dtype is None:
            # router logits, scores and mixing weights in fp32, whatever the balancer, on the
            # Stable LatentMoE block (a plain Megatron MoE keeps Megatron's default unless QB)
            self.moe_router_dtype = "fp32"
        if self.num_moe_experts and self.first_k_dense_replace and self.moe_layer_freq == 1:
            k = self.first_k_dense_replace
            self.moe_layer_freq = [0] * k + [1] * (self.num_layers - k)
            self._layer_freq_derived = list(self.moe_layer_freq)

    @property
    def uses_quantile_balancing(self) -> bool:
        return QUANTILE_HISTOGRAM in balancer_list(self.moe_router_load_balancing_type)


SMALL_RUN = dict(
    moe_router_score_function="sigmoid",
    moe_aux_loss_coeff=0.0,
    moe_token_dispatcher_type="alltoall",
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_cpu_initialization=True,
    init_method_std=0.02,
)
"""The run settings of the small fp32 configs (:func:`tiny_config`, the converter's
``ModelArch.to_megatron_config``): sigmoid router, no aux loss, no biases, no dropout, CPU init."""


def tiny_config(**overrides) -> StableLatentMoETransformerConfig:
    """A small fp32 Stable LatentMoE config for tests and demos (the CPU default run's model is
    ``examples/args/tiny.sh``)."""
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
        moe_router_load_balancing_type=QUANTILE_HISTOGRAM,
        **SMALL_RUN,
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
