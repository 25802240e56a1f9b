"""One config for a Stable LatentMoE model: Megatron's ``TransformerConfig`` plus SPEC §1–§4 fields.

Megatron names are reused wherever Megatron already has the knob:

=====================================  =====================================================
SPEC / HF name                         field here
=====================================  =====================================================
l, ``routed_expert_hidden_size``       ``moe_latent_size`` (Megatron's)
``latent_moe_use_norm``                ``latent_moe_use_norm`` (new: RMSNorm over l)
``hidden_act = situ``                  ``hidden_act`` (new: ``"situ"`` or ``"swiglu"``)
b1 / b2                                ``activation_situ_beta`` / ``activation_situ_linear_beta``
``routed_scaling_factor``              ``moe_router_topk_scaling_factor`` (Megatron's)
``first_k_dense_replace``              ``first_k_dense_replace`` (new; sets ``moe_layer_freq``)
QB router (SPEC §4)                    ``moe_router_load_balancing_type = "quantile_histogram"``
QB bins B / binning                    ``moe_qb_num_bins`` / ``moe_qb_binning`` (new)
=====================================  =====================================================

Every wrong value raises ``ValueError`` naming the field, the value and what is allowed, before
Megatron's own checks run (theirs are asserts deep inside module constructors).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_latentmoe.choices import HIDDEN_ACTS, QB_BINNINGS, QUANTILE_HISTOGRAM



def _fail(field: str, value, allowed: str) -> None:
    raise ValueError(f"{field}={value!r} is not allowed: {allowed}")


@dataclass
class StableLatentMoEConfig(TransformerConfig):
    """``TransformerConfig`` + the Stable LatentMoE fields (SPEC §1, §2, §4)."""

    normalization: str = "RMSNorm"
    """Megatron's field, re-defaulted: every norm of the model is an RMSNorm (SPEC §1); the
    only value allowed."""

    hidden_act: str = "situ"
    """SPEC §2: ``"situ"`` = SiTU-GLU in routed experts, shared experts and dense MLPs;
    ``"swiglu"`` = plain SwiGLU (for ablations)."""

    activation_situ_beta: float = 4.0
    """b1 of SiTU-GLU: softcap of the gate's linear factor (SPEC §2)."""

    activation_situ_linear_beta: float = 25.0
    """b2 of SiTU-GLU: softcap of the up branch (SPEC §2)."""

    latent_moe_use_norm: bool = True
    """RMSNorm over the latent width between combine and W_up (SPEC §1)."""

    first_k_dense_replace: int = 0
    """The first k layers use a dense SiTU-GLU MLP instead of the block (SPEC §1)."""

    moe_qb_num_bins: int = 1000
    """Histogram bins B per expert for Quantile Balancing (SPEC §4, appendix D)."""

    moe_qb_binning: str = "uniform"
    """``"uniform"``: B equal bins over [min(b)-1, max(b)+1] (SPEC §4). ``"centered"``: per-expert
    bins centred on that expert's bias, finer near it (same traffic; ~6x closer to the exact
    quantile at equal B, see benchmarks/bench_balancing.py)."""

    _layer_freq_from_first_k: bool = dataclasses.field(default=False, repr=False)
    """Internal: ``moe_layer_freq`` was derived from ``first_k_dense_replace`` (not given), so a
    ``dataclasses.replace`` of this config derives it again from the new values."""

    def __post_init__(self):
        if self._layer_freq_from_first_k:  # a copy (dataclasses.replace): derive it again
            self.moe_layer_freq, self._layer_freq_from_first_k = 1, False
        self._validate_stable_latentmoe()
        self._apply_stable_latentmoe_defaults()
        super().__post_init__()

    # ------------------------------------------------------------------ derived Megatron fields
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
        if self.moe_router_load_balancing_type == QUANTILE_HISTOGRAM and self.moe_router_dtype is None:
            self.moe_router_dtype = "fp32"  # router logits, scores and mixing weights in fp32
        if self.num_moe_experts and self.first_k_dense_replace and self.moe_layer_freq == 1:
            k = self.first_k_dense_replace
            self.moe_layer_freq = [0] * k + [1] * (self.num_layers - k)
            self._layer_freq_from_first_k = True

    # ------------------------------------------------------------------ validation
    def _validate_stable_latentmoe(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            _fail("hidden_act", self.hidden_act, f"one of {HIDDEN_ACTS}")
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                _fail(name, value, "a positive number (softcap scale, SPEC §2)")
        k_dense = self.first_k_dense_replace
        if isinstance(k_dense, bool) or not isinstance(k_dense, int) or not (
            0 <= k_dense < max(self.num_layers, 1)
        ):
            _fail("first_k_dense_replace", k_dense, f"an integer in [0, num_layers={self.num_layers})")
        if self.normalization != "RMSNorm":
            _fail("normalization", self.normalization, "'RMSNorm' (SPEC §1)")
        if self.layernorm_zero_centered_gamma:
            _fail("layernorm_zero_centered_gamma", True, "False (plain RMSNorm weights, SPEC §1)")
        if self.hidden_act == "situ":
            # Megatron's fused expert / activation kernels implement SwiGLU only: with these on,
            # the experts would silently run SwiGLU or fail deep inside TE.
            for name in ("use_transformer_engine_op_fuser", "activation_func_fp8_input_store"):
                if getattr(self, name):
                    _fail(name, True, "False with hidden_act='situ' (Megatron fuses SwiGLU only)")
        if not self.num_moe_experts:
            return
        if self.latent_moe_use_norm and not self.moe_latent_size:
            _fail(
                "latent_moe_use_norm",
                self.latent_moe_use_norm,
                "False unless moe_latent_size is set (the norm is over the latent width)",
            )
        dense_then_moe = [0] * k_dense + [1] * (self.num_layers - k_dense)
        if k_dense and self.moe_layer_freq not in (1, dense_then_moe):
            _fail(
                "first_k_dense_replace",
                k_dense,
                f"0 when moe_layer_freq={self.moe_layer_freq!r} is set (it would override the "
                f"pattern); or moe_layer_freq 1 or {dense_then_moe}",
            )
        for name, why in (
            ("moe_apply_probs_on_input", "the block weights expert OUTPUTS: p * E(z) (SPEC §1)"),
            ("moe_enable_routing_replay", "the Stable LatentMoE routers do not record or replay"),
        ):
            if getattr(self, name):
                _fail(name, True, f"False ({why})")
        n, k = self.num_moe_experts, self.moe_router_topk
        ep = self.expert_model_parallel_size
        if n % ep:
            _fail("num_moe_experts", n, f"a multiple of expert_model_parallel_size={ep}")
        if not (1 <= k < n):
            _fail("moe_router_topk", k, f"an integer in [1, num_moe_experts={n})")
        scale = self.moe_router_topk_scaling_factor
        if scale is not None and not scale > 0:
            _fail("moe_router_topk_scaling_factor", scale, "None or a positive number")
        if self.moe_latent_size is not None:
            latent, tp = self.moe_latent_size, self.tensor_model_parallel_size
            if not (0 < latent):
                _fail("moe_latent_size", latent, "a positive integer")
            if latent % tp:
                _fail("moe_latent_size", latent, f"a multiple of tensor_model_parallel_size={tp}")
            if self.moe_shared_expert_overlap:
                _fail(
                    "moe_shared_expert_overlap",
                    True,
                    "False with moe_latent_size (shared experts see the full-width input)",
                )
        if self.moe_router_load_balancing_type == QUANTILE_HISTOGRAM:
            self._validate_quantile_balancing(n, k)

    def _validate_quantile_balancing(self, n: int, k: int) -> None:
        if self.moe_router_score_function != "sigmoid":
            _fail(
                "moe_router_score_function",
                self.moe_router_score_function,
                "'sigmoid' with quantile_histogram balancing (SPEC §3)",
            )
        if self.moe_router_enable_expert_bias:
            _fail(
                "moe_router_enable_expert_bias",
                True,
                "False with quantile_histogram: the QB router owns expert_bias and Megatron's "
                "sign update would fight it",
            )
        coeff = self.moe_aux_loss_coeff
        if any(c != 0 for c in (coeff if isinstance(coeff, list) else [coeff])):
            _fail("moe_aux_loss_coeff", coeff, "0 with quantile_histogram balancing")
        if self.moe_router_num_groups not in (None, 1):
            _fail("moe_router_num_groups", self.moe_router_num_groups, "None or 1 (SPEC §3)")
        if not (isinstance(self.moe_qb_num_bins, int) and self.moe_qb_num_bins >= 2):
            _fail("moe_qb_num_bins", self.moe_qb_num_bins, "an integer >= 2")
        if self.moe_qb_binning not in QB_BINNINGS:
            _fail("moe_qb_binning", self.moe_qb_binning, f"one of {QB_BINNINGS}")
        if self.moe_qb_binning == "centered" and self.moe_qb_num_bins % 2:
            _fail("moe_qb_num_bins", self.moe_qb_num_bins,
                  "an even integer with moe_qb_binning='centered' (half the bins each side of the bias)")
        if self.moe_expert_capacity_factor is not None:
            _fail(
                "moe_expert_capacity_factor",
                self.moe_expert_capacity_factor,
                "None with quantile_histogram (QB balances without dropping tokens)",
            )

    @property
    def uses_quantile_balancing(self) -> bool:
        return self.moe_router_load_balancing_type == QUANTILE_HISTOGRAM


def stable_latentmoe_fields() -> tuple[str, ...]:
    """Names of the fields this config adds to ``TransformerConfig``."""
    base = {f.name for f in dataclasses.fields(TransformerConfig)}
    return tuple(
        f.name for f in dataclasses.fields(StableLatentMoEConfig)
        if f.name not in base and not f.name.startswith("_")
    )


def tiny_config(**overrides) -> StableLatentMoEConfig:
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
    return StableLatentMoEConfig(**values)


def k3_full_scale_config(**overrides) -> StableLatentMoEConfig:
    """SPEC §5 full-scale block numbers (attention sizes are Megatron GQA stand-ins)."""
    values = dict(
        num_layers=93,
        hidden_size=7168,
        num_attention_heads=64,
        num_query_groups=8,
        ffn_hidden_size=32768,
        num_moe_experts=896,
        moe_router_topk=16,
        moe_ffn_hidden_size=3072,
        moe_latent_size=3584,
        moe_shared_expert_intermediate_size=2 * 3072,
        first_k_dense_replace=1,
        moe_router_score_function="sigmoid",
        moe_router_load_balancing_type=QUANTILE_HISTOGRAM,
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=0.0,
        layernorm_epsilon=1e-5,
        add_bias_linear=False,
    )
    values.update(overrides)
    return StableLatentMoEConfig(**values)
