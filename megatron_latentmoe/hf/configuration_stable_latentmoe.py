# Copyright 2026 The megatron-latentmoe authors. Licensed under the Apache License, Version 2.0.
"""Configuration of the Stable LatentMoE causal LM (model_type ``"stable_latentmoe"``).

This file is copied next to the weights of every exported checkpoint and loaded with
``trust_remote_code=True``. It imports only ``transformers``.

The MoE-block keys follow the Kimi convention of the reference HF code (see SPEC §6). Defaults are
the full-scale K3 values where the specification states them (d=7168, l=3584, m_e=3072, n=896,
k=16, N_s=2, 93 layers with the first one dense, vocab 163840, rms_norm_eps 1e-5, SiTU-GLU with
b1=4, b2=25). The attention here is plain GQA (the Megatron ``SelfAttention`` stand-in); its sizes
and the dense MLP width (32768, i.e. the ~0.7 B dense FFN of the parameter ledger) are not given by
the specification and are stand-ins too.
"""

from __future__ import annotations

from transformers import PretrainedConfig

HIDDEN_ACTS = ("situ", "silu")
"""``situ`` = SiTU-GLU (SPEC §2); ``silu`` = plain SwiGLU, for comparisons."""
ROUTER_ACTIVATION_FUNCS = ("sigmoid",)
TOPK_METHODS = ("noaux_tc",)

AUTO_MAP = {
    "AutoConfig": "configuration_stable_latentmoe.StableLatentMoEConfig",
    "AutoModel": "modeling_stable_latentmoe.StableLatentMoEModel",
    "AutoModelForCausalLM": "modeling_stable_latentmoe.StableLatentMoEForCausalLM",
}
"""Default ``auto_map`` written to config.json; it resolves once the two .py files sit next to
it."""


def _bad(key: str, value, allowed: str) -> ValueError:
    return ValueError(f"StableLatentMoEConfig: {key}={value!r} is not allowed; expected {allowed}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_INF = float("inf")


class StableLatentMoEConfig(PretrainedConfig):
    r"""Configuration for [`StableLatentMoEModel`] / [`StableLatentMoEForCausalLM`].

    The architecture and the block's formulas: ``modeling_stable_latentmoe.py``'s docstring.
    The FFN of the first ``first_k_dense_replace`` layers is a dense gated MLP of width
    ``intermediate_size``; every later layer uses the Stable LatentMoE block (SPEC §1).

    Args (beyond the usual decoder keys):
        hidden_act: ``"situ"`` (SiTU-GLU everywhere: dense MLP, routed and shared experts) or
            ``"silu"`` (SwiGLU).
        activation_situ_beta / activation_situ_linear_beta: b1 / b2 of SiTU-GLU.
        routed_expert_hidden_size: the latent width l of the routed experts.
        latent_moe_use_norm: RMSNorm over l between the latent combine and
            ``routed_expert_up_proj``.
        moe_router_activation_func: only ``"sigmoid"``.
        moe_renormalize: renormalise the k selected raw scores to sum 1 (only applied when k > 1,
            with a 1e-20 guard in the denominator, as Megatron-Core does).
        routed_scaling_factor: multiplies the routing probabilities.
        topk_method: only ``"noaux_tc"`` (bias used for selection only).
        num_expert_group: only 1 (no group-limited routing).
        num_experts / num_experts_per_token / moe_intermediate_size: n, k, m_e.
        num_shared_experts: N_s; stored as ONE gated MLP of width N_s * moe_intermediate_size
            (0 = no shared expert).
        first_k_dense_replace: number of leading dense layers.
        output_router_logits: return each MoE layer's fp32 router logits [B * S, n] as
            ``router_logits`` (transformers' MoE key; a forward's own argument overrides it).
    """

    model_type = "stable_latentmoe"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 7168,
        intermediate_size: int = 32768,
        num_hidden_layers: int = 93,
        num_attention_heads: int = 64,
        num_key_value_heads: int | None = 8,
        head_dim: int | None = None,
        max_position_embeddings: int = 131072,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        hidden_act: str = "situ",
        activation_situ_beta: float = 4.0,
        activation_situ_linear_beta: float = 25.0,
        routed_expert_hidden_size: int = 3584,
        latent_moe_use_norm: bool = True,
        moe_router_activation_func: str = "sigmoid",
        moe_renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        topk_method: str = "noaux_tc",
        num_expert_group: int = 1,
        num_experts: int = 896,
        num_experts_per_token: int = 16,
        moe_intermediate_size: int = 3072,
        num_shared_experts: int = 2,
        first_k_dense_replace: int = 1,
        attention_dropout: float = 0.0,
        output_router_logits: bool = False,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = (
            num_attention_heads if num_key_value_heads is None else num_key_value_heads
        )
        if (
            head_dim is None
            and _is_int(hidden_size)
            and _is_int(num_attention_heads)
            and num_attention_heads > 0
        ):
            head_dim = hidden_size // num_attention_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.moe_router_activation_func = moe_router_activation_func
        self.moe_renormalize = moe_renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.topk_method = topk_method
        self.num_expert_group = num_expert_group
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.moe_intermediate_size = moe_intermediate_size
        self.num_shared_experts = num_shared_experts
        self.first_k_dense_replace = first_k_dense_replace
        self.attention_dropout = attention_dropout
        self.output_router_logits = output_router_logits
        self._validate()
        if not isinstance(tie_word_embeddings, bool):  # transformers' key: any value ties if truthy
            raise _bad("tie_word_embeddings", tie_word_embeddings, "a bool")
        for key in ("rope_parameters", "rope_scaling"):  # transformers would call .get on them
            if kwargs.get(key) is not None and not isinstance(kwargs[key], dict):
                raise _bad(key, kwargs[key], "a dict or None")
        if kwargs.get("auto_map") is None:
            kwargs["auto_map"] = dict(AUTO_MAP)
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self._validate_rope()

    def _validate_rope(self) -> None:
        """The model applies plain RoPE with ``rope_theta``; refuse any RoPE scaling or a
        different theta given the transformers 5 way (``rope_parameters``, or the legacy
        ``rope_scaling`` that transformers converts into it), which would be silently ignored."""
        params = getattr(self, "rope_parameters", None) or {}  # a dict: checked in __init__
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise _bad(
                "rope_parameters",
                params,
                "no RoPE scaling (rope_type 'default'): the model applies plain RoPE",
            )
        theta = params.get("rope_theta")
        if theta is not None and not (_is_number(theta) and float(theta) == float(self.rope_theta)):
            raise _bad(
                "rope_parameters",
                params,
                f"rope_theta equal to the config's rope_theta={self.rope_theta} (the one used)",
            )

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "routed_expert_hidden_size",
            "num_experts",
            "num_experts_per_token",
            "moe_intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, key)
            if not (_is_int(value) and value > 0):
                raise _bad(key, value, "a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise _bad(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"a divisor of num_attention_heads={self.num_attention_heads}",
            )
        if self.head_dim % 2:
            raise _bad("head_dim", self.head_dim, "an even integer (RoPE rotates halves)")
        if self.hidden_act not in HIDDEN_ACTS:
            raise _bad("hidden_act", self.hidden_act, f"one of {HIDDEN_ACTS}")
        for key in (
            "activation_situ_beta",
            "activation_situ_linear_beta",
            "rope_theta",
            "rms_norm_eps",
            "routed_scaling_factor",
        ):
            value = getattr(self, key)
            if not (_is_number(value) and 0 < value < _INF):
                raise _bad(key, value, "a positive finite number")
        std = self.initializer_range  # the init's normal std: torch refuses one below 0
        if not (_is_number(std) and 0 <= std < _INF):
            raise _bad("initializer_range", std, "a finite number >= 0")
        if self.moe_router_activation_func not in ROUTER_ACTIVATION_FUNCS:
            raise _bad(
                "moe_router_activation_func",
                self.moe_router_activation_func,
                f"one of {ROUTER_ACTIVATION_FUNCS} (SPEC §3)",
            )
        if self.topk_method not in TOPK_METHODS:
            raise _bad("topk_method", self.topk_method, f"one of {TOPK_METHODS} (SPEC §3)")
        if self.num_expert_group != 1:
            raise _bad(
                "num_expert_group", self.num_expert_group, "1 (no group-limited routing, SPEC §3)"
            )
        if self.num_experts_per_token > self.num_experts:
            raise _bad(
                "num_experts_per_token",
                self.num_experts_per_token,
                f"an integer in [1, num_experts={self.num_experts}]",
            )
        for key in ("num_shared_experts", "first_k_dense_replace"):
            value = getattr(self, key)
            if not (_is_int(value) and value >= 0):
                raise _bad(key, value, "an integer >= 0")
        dropout = self.attention_dropout
        if not (_is_number(dropout) and 0 <= dropout < 1):
            raise _bad("attention_dropout", dropout, "a number in [0, 1)")
        for key in ("latent_moe_use_norm", "moe_renormalize", "use_cache", "output_router_logits"):
            if not isinstance(getattr(self, key), bool):
                raise _bad(key, getattr(self, key), "a bool")

    # ------------------------------------------------------------------ helpers
    def is_moe_layer(self, layer_idx: int) -> bool:
        """True if decoder layer ``layer_idx`` (0-based) uses the Stable LatentMoE block."""
        return layer_idx >= self.first_k_dense_replace

    def get_shared_expert_intermediate_size(self) -> int:
        """Width of the ONE shared-expert MLP (N_s * m_e; 0 = none)."""
        return self.num_shared_experts * self.moe_intermediate_size
