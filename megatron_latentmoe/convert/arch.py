"""The model hyper-parameters a conversion needs (``ModelArch``) and where they come from.

A Megatron ``torch_dist`` checkpoint holds tensors, not a model description. ``ModelArch`` is the
small, framework-neutral description the converter works from; it can be read from (first match
wins, see :func:`resolve_arch`):

1. an explicit file (``--megatron-config FILE``): JSON or YAML, either

   * Megatron style: a flat mapping of ``StableLatentMoEConfig`` field names (``num_layers``,
     ``hidden_size``, ``num_moe_experts``, ``moe_latent_size``, ``hidden_act``, ...) plus the
     four ``build_gpt_model`` arguments ``vocab_size``, ``max_sequence_length``,
     ``rotary_base`` and ``share_embeddings_and_output_weights``; or
   * a Hugging Face ``config.json`` of model_type ``stable_latentmoe`` (recognised by its
     ``model_type`` key);

2. the checkpoint's own common state, key ``stable_latentmoe_config`` (a plain dict written by
   this converter's importer and by :func:`arch_common_state`; add it to the state dict you pass
   to ``dist_checkpointing.save`` when saving without ``megatron.training``);

3. the checkpoint's common state, key ``args``: the ``argparse.Namespace`` that
   ``megatron.training`` saves. Its fields carry ``TransformerConfig`` names (Megatron builds its
   command line from the dataclass), plus ``num_experts``, ``padded_vocab_size``,
   ``max_position_embeddings``, ``rotary_base``, ``untie_embeddings_and_output_weights``,
   ``group_query_attention`` and ``swiglu``. The Stable LatentMoE fields are read under their
   ``StableLatentMoEConfig`` names (``hidden_act``, ``activation_situ_beta``,
   ``activation_situ_linear_beta``, ``latent_moe_use_norm``, ``first_k_dense_replace``); a
   Namespace without them is refused (name the missing ones) rather than guessed.

The checkpoint's tensor shapes are then checked against the description (``names.py``), so a
wrong config file fails with the tensor and the expected / found shapes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .errors import ConversionError

ARCH_STATE_KEY = "stable_latentmoe_config"
"""Common-state key under which the converter stores ``ModelArch.to_dict()``."""

MEGATRON_ACTS = {"situ": "situ", "swiglu": "silu"}
"""Megatron ``hidden_act`` -> HF ``hidden_act``."""
HF_ACTS = {v: k for k, v in MEGATRON_ACTS.items()}

BUILDER_KEYS = ("vocab_size", "max_sequence_length", "rotary_base", "share_embeddings_and_output_weights")
"""Keys of a Megatron-style config file that are ``build_gpt_model`` arguments, not config fields."""

# Default token ids of the shipped tokenizer (megatron_latentmoe/data/assets/tokenizer).
DEFAULT_BOS_ID, DEFAULT_EOS_ID, DEFAULT_PAD_ID = 0, 0, 1


def _fail(source: str, key: str, value: Any, allowed: str) -> ConversionError:
    return ConversionError(f"{source}: {key}={value!r} is not supported: {allowed}")


@dataclass(frozen=True)
class ModelArch:
    """What a Stable LatentMoE GPT looks like, in Megatron's terms (HF names in comments)."""

    num_layers: int  # num_hidden_layers
    hidden_size: int  # d
    ffn_hidden_size: int  # intermediate_size (dense MLP of the first_k_dense_replace layers)
    num_attention_heads: int
    num_query_groups: int  # num_key_value_heads
    kv_channels: int  # head_dim
    vocab_size: int  # rows of the embedding / output layer (Megatron's padded vocabulary)
    num_experts: int  # n
    moe_router_topk: int  # k = num_experts_per_token
    moe_ffn_hidden_size: int  # m_e = moe_intermediate_size
    moe_latent_size: int  # l = routed_expert_hidden_size
    max_position_embeddings: int = 4096
    rotary_base: float = 10000.0  # rope_theta
    layernorm_epsilon: float = 1e-5  # rms_norm_eps
    tie_embeddings: bool = False  # tie_word_embeddings
    hidden_act: str = "situ"  # Megatron name: "situ" | "swiglu" (HF "silu")
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    latent_moe_use_norm: bool = True
    moe_shared_expert_intermediate_size: int = 0  # N_s * m_e; 0 = no shared experts
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0  # moe_router_topk_scaling_factor
    # Megatron-only: how the router's bias is maintained (does not change the weights' layout).
    moe_router_load_balancing_type: str = "quantile_histogram"
    bos_token_id: Optional[int] = DEFAULT_BOS_ID
    eos_token_id: Optional[int] = DEFAULT_EOS_ID
    pad_token_id: Optional[int] = DEFAULT_PAD_ID

    def __post_init__(self):
        self.validate("model config")

    # ------------------------------------------------------------------ checks
    def validate(self, source: str) -> None:
        for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_query_groups", "kv_channels", "vocab_size", "num_experts",
                    "moe_router_topk", "moe_ffn_hidden_size", "moe_latent_size",
                    "max_position_embeddings"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise _fail(source, key, value, "a positive integer")
        if self.num_attention_heads % self.num_query_groups:
            raise _fail(source, "num_query_groups", self.num_query_groups,
                        f"a divisor of num_attention_heads={self.num_attention_heads}")
        if self.kv_channels % 2:
            raise _fail(source, "kv_channels", self.kv_channels, "an even head dim (RoPE)")
        if self.hidden_act not in MEGATRON_ACTS:
            raise _fail(source, "hidden_act", self.hidden_act, f"one of {tuple(MEGATRON_ACTS)}")
        for key in ("activation_situ_beta", "activation_situ_linear_beta", "layernorm_epsilon",
                    "rotary_base", "routed_scaling_factor"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                value > 0 and math.isfinite(value)
            ):
                raise _fail(source, key, value, "a positive finite number")
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise _fail(source, "moe_router_topk", self.moe_router_topk,
                        f"an integer in [1, num_experts={self.num_experts}]")
        if not 0 <= self.first_k_dense_replace < self.num_layers:
            raise _fail(source, "first_k_dense_replace", self.first_k_dense_replace,
                        f"an integer in [0, num_layers={self.num_layers})")
        s = self.moe_shared_expert_intermediate_size
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise _fail(source, "moe_shared_expert_intermediate_size", s, "an integer >= 0")
        if s % self.moe_ffn_hidden_size:
            raise _fail(source, "moe_shared_expert_intermediate_size", s,
                        f"a multiple of moe_ffn_hidden_size={self.moe_ffn_hidden_size} (HF stores "
                        "num_shared_experts = shared width / moe_intermediate_size)")
        if not isinstance(self.latent_moe_use_norm, bool) or not isinstance(self.tie_embeddings, bool):
            raise _fail(source, "latent_moe_use_norm/tie_embeddings",
                        (self.latent_moe_use_norm, self.tie_embeddings), "booleans")

    # ------------------------------------------------------------------ derived
    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def num_shared_experts(self) -> int:
        return self.moe_shared_expert_intermediate_size // self.moe_ffn_hidden_size

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def homogeneous_layers(self) -> bool:
        """Megatron stacks all layers' tensors on one leading axis in the checkpoint when every
        layer has the same structure (no dense first layers)."""
        return self.first_k_dense_replace == 0

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping, source: str = "stable_latentmoe_config") -> "ModelArch":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConversionError(f"{source}: unknown field(s) {unknown}; known: {sorted(known)}")
        try:
            return cls(**dict(values))
        except TypeError as e:
            raise ConversionError(f"{source}: {e}") from None

    # ------------------------------------------------------------------ HF
    def to_hf_config_kwargs(self) -> dict:
        """Keyword arguments of the HF ``StableLatentMoEConfig`` (SPEC §6 + attention keys)."""
        return dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.ffn_hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_query_groups,
            head_dim=self.kv_channels,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=float(self.rotary_base),
            rms_norm_eps=float(self.layernorm_epsilon),
            tie_word_embeddings=self.tie_embeddings,
            hidden_act=MEGATRON_ACTS[self.hidden_act],
            activation_situ_beta=float(self.activation_situ_beta),
            activation_situ_linear_beta=float(self.activation_situ_linear_beta),
            routed_expert_hidden_size=self.moe_latent_size,
            latent_moe_use_norm=self.latent_moe_use_norm,
            moe_router_activation_func="sigmoid",
            moe_renormalize=True,
            routed_scaling_factor=float(self.routed_scaling_factor),
            topk_method="noaux_tc",
            num_expert_group=1,
            num_experts=self.num_experts,
            num_experts_per_token=self.moe_router_topk,
            moe_intermediate_size=self.moe_ffn_hidden_size,
            num_shared_experts=self.num_shared_experts,
            first_k_dense_replace=self.first_k_dense_replace,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )

    @classmethod
    def from_hf_config(cls, cfg: Mapping, source: str = "config.json") -> "ModelArch":
        """From an HF ``config.json`` dict of model_type ``stable_latentmoe``."""
        if cfg.get("model_type") != "stable_latentmoe":
            raise _fail(source, "model_type", cfg.get("model_type"), "'stable_latentmoe'")
        fixed = {"moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
                 "num_expert_group": 1, "moe_renormalize": True}
        for key, want in fixed.items():
            if key in cfg and cfg[key] != want:
                raise _fail(source, key, cfg[key], f"{want!r} (the only routing Megatron's model implements)")
        act = cfg.get("hidden_act", "situ")
        if act not in HF_ACTS:
            raise _fail(source, "hidden_act", act, f"one of {tuple(HF_ACTS)}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_experts", "num_experts_per_token",
                    "moe_intermediate_size", "routed_expert_hidden_size")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ConversionError(f"{source}: missing key(s) {missing}")
        heads = cfg["num_attention_heads"]
        kv = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id", DEFAULT_EOS_ID)
        return cls(
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=kv,
            kv_channels=head_dim,
            vocab_size=cfg["vocab_size"],
            num_experts=cfg["num_experts"],
            moe_router_topk=cfg["num_experts_per_token"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_latent_size=cfg["routed_expert_hidden_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rotary_base=cfg.get("rope_theta", 10000.0),
            layernorm_epsilon=cfg.get("rms_norm_eps", 1e-5),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hidden_act=HF_ACTS[act],
            activation_situ_beta=cfg.get("activation_situ_beta", 4.0),
            activation_situ_linear_beta=cfg.get("activation_situ_linear_beta", 25.0),
            latent_moe_use_norm=cfg.get("latent_moe_use_norm", True),
            moe_shared_expert_intermediate_size=cfg.get("num_shared_experts", 0) * cfg["moe_intermediate_size"],
            first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
            routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
            bos_token_id=cfg.get("bos_token_id", DEFAULT_BOS_ID),
            eos_token_id=eos[0] if isinstance(eos, list) and eos else eos,
            pad_token_id=cfg.get("pad_token_id", DEFAULT_PAD_ID),
        )

    # ------------------------------------------------------------------ Megatron
    @classmethod
    def from_megatron_config(
        cls,
        config,
        *,
        vocab_size: int,
        max_sequence_length: int,
        rotary_base: float = 10000.0,
        share_embeddings_and_output_weights: bool = False,
        source: str = "StableLatentMoEConfig",
    ) -> "ModelArch":
        """From a ``StableLatentMoEConfig`` (or any object / mapping with its field names)."""
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, Mapping) else (
            lambda k, d=None: getattr(config, k, d))
        return cls._from_megatron_fields(
            get, vocab_size=vocab_size, max_position_embeddings=max_sequence_length,
            rotary_base=rotary_base, tie=share_embeddings_and_output_weights, source=source)

    @classmethod
    def from_megatron_args(cls, args, source: str = "checkpoint args") -> "ModelArch":
        """From the ``argparse.Namespace`` that ``megatron.training`` stores as ``args``."""
        ours = ("hidden_act", "activation_situ_beta", "activation_situ_linear_beta",
                "latent_moe_use_norm", "first_k_dense_replace")
        missing = [k for k in ours if not hasattr(args, k)]
        if missing:
            raise ConversionError(
                f"{source}: the saved megatron.training arguments lack the Stable LatentMoE "
                f"field(s) {missing}; pass the model description with --megatron-config FILE "
                "(JSON/YAML of StableLatentMoEConfig fields, or an HF config.json)")
        if getattr(args, "position_embedding_type", "rope") != "rope":
            raise _fail(source, "position_embedding_type", args.position_embedding_type, "'rope'")
        vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None)
        if vocab is None:
            raise ConversionError(f"{source}: neither padded_vocab_size nor vocab_size is set")

        def get(k, d=None):
            if k == "num_moe_experts":
                return getattr(args, "num_experts", None) or getattr(args, k, d)
            if k == "num_query_groups" and not getattr(args, "group_query_attention", True):
                return None
            return getattr(args, k, d)

        return cls._from_megatron_fields(
            get, vocab_size=vocab,
            max_position_embeddings=getattr(args, "max_position_embeddings", None)
            or getattr(args, "seq_length", 4096),
            rotary_base=getattr(args, "rotary_base", 10000),
            tie=not getattr(args, "untie_embeddings_and_output_weights", False), source=source)

    @classmethod
    def _from_megatron_fields(cls, get, *, vocab_size, max_position_embeddings, rotary_base, tie,
                              source) -> "ModelArch":
        unsupported = {
            "qk_layernorm": (False, "False (the HF model has no q/k norms)"),
            "add_bias_linear": (False, "False (bias-free linears)"),
            "add_qkv_bias": (False, "False"),
            "normalization": ("RMSNorm", "'RMSNorm'"),
            "rotary_interleaved": (False, "False (rotate-half RoPE)"),
            "apply_residual_connection_post_layernorm": (False, "False"),
            "layernorm_zero_centered_gamma": (False, "False"),
            "moe_router_score_function": ("sigmoid", "'sigmoid' (SPEC §3)"),
            "multi_latent_attention": (False, "False (GQA attention only)"),
        }
        for key, (want, allowed) in unsupported.items():
            value = get(key, want)
            if value is not None and value != want:
                raise _fail(source, key, value, allowed)
        rotary_percent = get("rotary_percent", 1.0)
        if rotary_percent not in (None, 1.0):
            raise _fail(source, "rotary_percent", rotary_percent, "1.0")
        groups = get("moe_router_num_groups", None)
        if groups not in (None, 1):
            raise _fail(source, "moe_router_num_groups", groups, "None or 1 (SPEC §3)")
        n = get("num_moe_experts")
        if not n:
            raise _fail(source, "num_moe_experts", n, "a positive integer (a Stable LatentMoE model)")
        latent = get("moe_latent_size")
        if not latent:
            raise _fail(source, "moe_latent_size", latent, "a positive integer (the latent width l)")
        act = get("hidden_act", "situ")
        if act not in MEGATRON_ACTS:
            raise _fail(source, "hidden_act", act, f"one of {tuple(MEGATRON_ACTS)}")
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        if not hidden or not heads:
            raise ConversionError(f"{source}: hidden_size and num_attention_heads are required")
        num_layers = get("num_layers")
        first_k = get("first_k_dense_replace", 0) or 0
        freq = get("moe_layer_freq", 1)
        if freq is not None and freq != 1:
            pattern = [1 if i % freq == 0 else 0 for i in range(num_layers)] if isinstance(freq, int) else list(freq)
            want = [0] * first_k + [1] * (num_layers - first_k)
            if pattern != want:
                raise _fail(source, "moe_layer_freq", freq,
                            f"1 or {want} (only the first first_k_dense_replace={first_k} layers "
                            "may be dense, as in the HF model)")
        lb = get("moe_router_load_balancing_type", "quantile_histogram") or "none"
        if isinstance(lb, (list, tuple)):
            lb = lb[0]
        scale = get("moe_router_topk_scaling_factor", None)
        shared = get("moe_shared_expert_intermediate_size", None) or 0
        return cls(
            num_layers=num_layers,
            hidden_size=hidden,
            ffn_hidden_size=get("ffn_hidden_size") or 4 * hidden,
            num_attention_heads=heads,
            num_query_groups=get("num_query_groups") or heads,
            kv_channels=get("kv_channels") or hidden // heads,
            vocab_size=vocab_size,
            num_experts=n,
            moe_router_topk=get("moe_router_topk", 2),
            moe_ffn_hidden_size=get("moe_ffn_hidden_size") or get("ffn_hidden_size"),
            moe_latent_size=latent,
            max_position_embeddings=max_position_embeddings,
            rotary_base=float(rotary_base),
            layernorm_epsilon=float(get("layernorm_epsilon", 1e-5)),
            tie_embeddings=bool(tie),
            hidden_act=act,
            activation_situ_beta=get("activation_situ_beta", 4.0),
            activation_situ_linear_beta=get("activation_situ_linear_beta", 25.0),
            latent_moe_use_norm=bool(get("latent_moe_use_norm", True)),
            moe_shared_expert_intermediate_size=shared,
            first_k_dense_replace=first_k,
            routed_scaling_factor=float(scale) if scale else 1.0,
            moe_router_load_balancing_type=lb,
        )

    def to_megatron_config(self, **overrides):
        """A ``StableLatentMoEConfig`` of this architecture (fp32, CPU init, no dropout, TP=EP=PP=1
        unless overridden): what ``verify`` and the tests build the Megatron model from."""
        from megatron_latentmoe.config import QUANTILE_HISTOGRAM, StableLatentMoEConfig

        qb = self.moe_router_load_balancing_type == QUANTILE_HISTOGRAM
        values = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.kv_channels,
            num_moe_experts=self.num_experts,
            moe_router_topk=self.moe_router_topk,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_latent_size=self.moe_latent_size,
            latent_moe_use_norm=self.latent_moe_use_norm,
            moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size or None,
            first_k_dense_replace=self.first_k_dense_replace,
            hidden_act=self.hidden_act,
            activation_situ_beta=float(self.activation_situ_beta),
            activation_situ_linear_beta=float(self.activation_situ_linear_beta),
            moe_router_topk_scaling_factor=(
                None if self.routed_scaling_factor == 1.0 else float(self.routed_scaling_factor)),
            moe_router_score_function="sigmoid",
            moe_router_load_balancing_type=QUANTILE_HISTOGRAM if qb else "none",
            moe_router_enable_expert_bias=not qb,
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            layernorm_epsilon=float(self.layernorm_epsilon),
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            init_method_std=0.02,
        )
        values.update(overrides)
        return StableLatentMoEConfig(**values)

    def builder_kwargs(self) -> dict:
        """The ``build_gpt_model`` keyword arguments besides the config."""
        return dict(
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_position_embeddings,
            rotary_base=self.rotary_base,
            share_embeddings_and_output_weights=self.tie_embeddings,
        )

    def megatron_args_namespace(self):
        """A ``megatron.training``-style ``args`` Namespace describing this model (stored in the
        common state of imported checkpoints: ``--use-checkpoint-args`` and the resume-time
        argument checks read it). The parallel sizes are 1: imports are written like a one-rank
        save (whole tensors) and load at any layout."""
        from argparse import Namespace

        return Namespace(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads,
            group_query_attention=self.num_query_groups != self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.kv_channels,
            max_position_embeddings=self.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=self.rotary_base,
            rotary_percent=1.0,
            rotary_interleaved=False,
            normalization="RMSNorm",
            layernorm_epsilon=self.layernorm_epsilon,
            swiglu=True,
            add_bias_linear=False,
            add_qkv_bias=False,
            qk_layernorm=False,
            untie_embeddings_and_output_weights=not self.tie_embeddings,
            padded_vocab_size=self.vocab_size,
            num_experts=self.num_experts,
            moe_router_topk=self.moe_router_topk,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_latent_size=self.moe_latent_size,
            moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size or None,
            moe_layer_freq=[0] * self.first_k_dense_replace + [1] * (self.num_layers - self.first_k_dense_replace),
            moe_router_score_function="sigmoid",
            moe_router_topk_scaling_factor=(
                None if self.routed_scaling_factor == 1.0 else self.routed_scaling_factor),
            moe_router_load_balancing_type=self.moe_router_load_balancing_type,
            hidden_act=self.hidden_act,
            activation_situ_beta=self.activation_situ_beta,
            activation_situ_linear_beta=self.activation_situ_linear_beta,
            latent_moe_use_norm=self.latent_moe_use_norm,
            first_k_dense_replace=self.first_k_dense_replace,
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
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConversionError(f"config file {path!r} cannot be read: {e}") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ConversionError(f"config file {path!r} is YAML but PyYAML is not installed "
                                  "(pip install pyyaml, or give JSON)") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConversionError(f"config file {path!r} is not valid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConversionError(f"config file {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"config file {path!r}: expected a mapping at top level, got {type(data).__name__}")
    return data


def arch_from_config_file(path: str | os.PathLike) -> ModelArch:
    """A ``ModelArch`` from a Megatron-style JSON/YAML file or an HF ``config.json``."""
    data = read_config_file(path)
    source = f"config file {os.fspath(path)!r}"
    if "model_type" in data:
        return ModelArch.from_hf_config(data, source=source)
    from megatron_latentmoe.config import StableLatentMoEConfig

    fields = {f.name for f in dataclasses.fields(StableLatentMoEConfig)}
    unknown = sorted(set(data) - fields - set(BUILDER_KEYS))
    if unknown:
        raise ConversionError(
            f"{source}: unknown field(s) {unknown}: expected StableLatentMoEConfig fields and "
            f"{list(BUILDER_KEYS)}")
    for key in ("vocab_size", "max_sequence_length"):
        if key not in data:
            raise ConversionError(f"{source}: missing {key!r} (a build_gpt_model argument)")
    return ModelArch.from_megatron_config(
        {k: v for k, v in data.items() if k not in BUILDER_KEYS},
        vocab_size=data["vocab_size"],
        max_sequence_length=data["max_sequence_length"],
        rotary_base=data.get("rotary_base", 10000.0),
        share_embeddings_and_output_weights=bool(data.get("share_embeddings_and_output_weights", False)),
        source=source,
    )


def resolve_arch(common_state: Optional[Mapping], config_file: Optional[str] = None,
                 checkpoint: str = "checkpoint") -> tuple[ModelArch, str]:
    """The model description and where it came from (see the module docstring for the order)."""
    if config_file:
        return arch_from_config_file(config_file), f"config file {config_file}"
    common_state = common_state or {}
    if ARCH_STATE_KEY in common_state:
        return (ModelArch.from_dict(common_state[ARCH_STATE_KEY], source=f"{checkpoint}: {ARCH_STATE_KEY}"),
                f"checkpoint common state ({ARCH_STATE_KEY})")
    if common_state.get("args") is not None:
        return (ModelArch.from_megatron_args(common_state["args"], source=f"{checkpoint}: args"),
                "checkpoint common state (megatron.training args)")
    raise ConversionError(
        f"{checkpoint}: the checkpoint carries no model description (no 'args' saved by "
        f"megatron.training, no '{ARCH_STATE_KEY}'); pass --megatron-config FILE (JSON/YAML of "
        "StableLatentMoEConfig fields + vocab_size/max_sequence_length, or an HF config.json)")
