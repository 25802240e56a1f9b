"""Parameter ledger of a Stable LatentMoE model (SPEC §5): where the FFN parameters are, and how
many of them one token activates.

Counted per MoE layer (SPEC §1):
  routed experts   n x 3 l m_e        (W1 gate, W3 up: m_e x l each; W2 down: l x m_e)
  shared experts   3 d S              (one gated MLP of intermediate S = N_s m_e; S = 0: none)
  projections      2 d l (+ l)        (W_down d -> l, W_up l -> d, + RMSNorm(l) weight if used)
  router           n d                (+ n bias values: a non-trainable buffer, listed apart)
Activated per token per MoE layer: k routed experts, the shared experts, the projections and the
whole router (every token is scored against all n experts).
Dense layers (the first `first_k_dense_replace`): one gated MLP, 3 d dense_ffn_hidden_size.
Embedding V d and LM head V d (none when tied).
Bytes of the counted parameters: all bf16 (2 B), and the K3 deployment (routed experts MXFP4:
4.25 bits = an E2M1 element + its share of one E8M0 scale per 32, ``ops/mxfp4.py``; the rest
bf16). The fp32 router bias buffer is not counted.

NOT counted: attention (model-specific: K3 mixes KDA and MLA layers), the per-layer norms outside
the MoE block, MTP / vision modules. Every FFN is taken to be 3-matrix gated (SiTU-GLU) and
bias-free, as in SPEC §1-2.

No Megatron import at module level: the CLI (tools/ledger.py) and the HF side use this file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_latentmoe.fields import ConfigError, hf_defaults, read_hf, read_megatron

NOT_COUNTED = (
    "attention (model-specific; K3: KDA + MLA layers), norms outside the MoE block, MTP and "
    "vision modules are not counted"
)


@dataclass(frozen=True)
class LatentMoEShape:
    """The dimensions the ledger needs. Sizes are element counts (d, l, m_e, ...)."""

    hidden_size: int  # d
    latent_size: int  # l (W_down: d -> l)
    moe_ffn_hidden_size: int  # m_e, per routed expert
    num_experts: int  # n
    topk: int  # k
    shared_ffn_hidden_size: int = 0  # N_s * m_e; 0 = no shared experts
    num_layers: int = 1
    first_k_dense_replace: int = 0  # the first this-many layers are dense
    dense_ffn_hidden_size: int = 0  # intermediate of the dense layers' gated MLP
    vocab_size: int = 0  # 0 = embedding / LM head not counted
    latent_norm: bool = True  # RMSNorm(l) between combine and W_up (latent_moe_use_norm)
    tie_word_embeddings: bool = False

    def __post_init__(self):
        for name, low in (
            ("hidden_size", 1),
            ("latent_size", 1),
            ("moe_ffn_hidden_size", 1),
            ("num_experts", 1),
            ("topk", 1),
            ("num_layers", 1),
            ("shared_ffn_hidden_size", 0),
            ("first_k_dense_replace", 0),
            ("dense_ffn_hidden_size", 0),
            ("vocab_size", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(name, value, f"an integer >= {low}")
        for name in ("latent_norm", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "True or False")
        if self.topk >= self.num_experts:  # QB's top-(k+1) cutoff needs k + 1 experts
            raise ConfigError(
                "topk", self.topk, "an integer in [1, {num_experts})", num_experts=self.num_experts
            )
        if self.first_k_dense_replace > self.num_layers:
            raise ConfigError(
                "first_k_dense_replace",
                self.first_k_dense_replace,
                "an integer in [0, {num_layers}]",
                num_layers=self.num_layers,
            )
        if self.first_k_dense_replace > 0 and self.dense_ffn_hidden_size == 0:
            raise ConfigError(
                "dense_ffn_hidden_size",
                0,
                "> 0 when {first_k_dense_replace} layers are dense",
                first_k_dense_replace=self.first_k_dense_replace,
            )

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace

    @property
    def num_dense_layers(self) -> int:
        return self.first_k_dense_replace

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_megatron_config(cls, cfg: Any) -> LatentMoEShape:
        """From a Megatron TransformerConfig (or this project's extension of it, or
        megatron.training args), duck-typed; absent / None fields mean what ``fields.FIELDS``
        says (the sizes are required).

        The layer layout comes from moe_layer_freq (a list must be [0]*k + [1]*rest; 1 = all MoE
        unless first_k_dense_replace says otherwise; first_k_dense_replace must agree); the vocab
        from padded_vocab_size / vocab_size (absent: not counted); tying from
        share_embeddings_and_output_weights / untie_embeddings_and_output_weights /
        tie_word_embeddings.
        """
        if getattr(cfg, "gated_linear_unit", True) is False:
            raise ValueError(
                "gated_linear_unit=False: the ledger counts 3-matrix gated FFNs (SiTU-GLU) only"
            )

        def get(f):
            value = getattr(cfg, f.megatron, None) if f.megatron else None
            if value is None and f.name == "num_experts":
                value = getattr(cfg, "num_experts", None)
            if value is None and f.required and f.name not in ("vocab_size", "ffn_hidden_size"):
                raise ValueError(
                    f"Megatron config field {f.megatron} is required for the ledger "
                    "(got None or missing)"
                )
            return value

        v = read_megatron(get, _TABLE_NAMES.values())
        num_layers = v["num_layers"]
        # moe_layer_freq is what Megatron builds: it wins; first_k_dense_replace must agree
        freq = getattr(cfg, "moe_layer_freq", None)
        k_given = getattr(cfg, "first_k_dense_replace", None)
        if freq is None or freq == 1:  # unset or 1: first_k_dense_replace says (as in arch.py)
            k_dense = k_given or 0
        else:
            k_dense = _first_k_dense_from_layer_freq(freq, num_layers)
            if k_given and k_given != k_dense:  # 0: not set (the config default)
                raise ValueError(
                    f"first_k_dense_replace={k_given} disagrees with "
                    f"moe_layer_freq={freq} ({k_dense} dense layers first)"
                )
        v["first_k_dense_replace"] = k_dense
        vocab = getattr(cfg, "padded_vocab_size", None) or getattr(cfg, "vocab_size", None)
        v["vocab_size"] = vocab or 0
        if getattr(cfg, "share_embeddings_and_output_weights", None) is not None:
            v["tie_embeddings"] = bool(cfg.share_embeddings_and_output_weights)
        elif getattr(cfg, "untie_embeddings_and_output_weights", None) is not None:
            v["tie_embeddings"] = not bool(cfg.untie_embeddings_and_output_weights)
        else:
            v["tie_embeddings"] = bool(getattr(cfg, "tie_word_embeddings", False))
        return cls._from_table(v)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> LatentMoEShape:
        """From an HF config dict with the SPEC §6 keys (a nested ``text_config`` is used when the
        top level has no ``hidden_size``, as in multimodal configs). An absent key means the HF
        class's default (``fields.FIELDS``); the sizes are required, except vocab_size (absent:
        not counted) and intermediate_size (required when first_k_dense_replace > 0).
        """
        if not isinstance(config, Mapping):
            raise ValueError(f"HF config must be a mapping; got {type(config).__name__}")
        if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
            config = config["text_config"]
        optional = ("vocab_size", "ffn_hidden_size")
        v = read_hf(config, [n for n in _TABLE_NAMES.values() if n not in optional])
        v["vocab_size"] = config.get("vocab_size") or 0
        v["ffn_hidden_size"] = config.get("intermediate_size") or 0
        if v["first_k_dense_replace"] and not v["ffn_hidden_size"]:
            raise ValueError(
                "HF config key 'intermediate_size' is required when "
                f"first_k_dense_replace={v['first_k_dense_replace']} (missing)"
            )
        return cls._from_table(v)

    @classmethod
    def _from_table(cls, values: Mapping[str, Any]) -> LatentMoEShape:
        shape = {ours: values[name] for ours, name in _TABLE_NAMES.items()}
        if not shape["first_k_dense_replace"]:
            shape["dense_ffn_hidden_size"] = 0
        return cls(**shape)


_TABLE_NAMES = {
    "hidden_size": "hidden_size",
    "latent_size": "moe_latent_size",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "num_experts": "num_experts",
    "topk": "moe_router_topk",
    "shared_ffn_hidden_size": "moe_shared_expert_intermediate_size",
    "num_layers": "num_layers",
    "first_k_dense_replace": "first_k_dense_replace",
    "dense_ffn_hidden_size": "ffn_hidden_size",
    "vocab_size": "vocab_size",
    "latent_norm": "latent_moe_use_norm",
    "tie_word_embeddings": "tie_embeddings",
}
"""``LatentMoEShape`` field -> row of ``fields.FIELDS`` (the ledger's short names)."""


def _first_k_dense_from_layer_freq(freq: Any, num_layers: int) -> int:
    if isinstance(freq, int) and not isinstance(freq, bool):  # 1 is handled by the caller
        raise ValueError(
            f"moe_layer_freq={freq}: the ledger needs the first-k-dense layout: "
            "moe_layer_freq 1 (with first_k_dense_replace) or [0]*k + [1]*rest"
        )
    pattern = list(freq)
    k = 0
    while k < len(pattern) and pattern[k] == 0:
        k += 1
    if len(pattern) != num_layers or any(p != 1 for p in pattern[k:]):
        raise ValueError(
            f"moe_layer_freq={pattern}: the ledger needs [0]*k + [1]*(num_layers-k) "
            f"with num_layers={num_layers} (or moe_layer_freq 1 with first_k_dense_replace)"
        )
    return k


K3_FULL_SCALE = LatentMoEShape.from_hf_config(hf_defaults())
"""Kimi K3 (SPEC §5): the HF config class's defaults. The dense layer's FFN intermediate is not in
the SPEC: seed 000 says the layer-1 dense FFN has about 0.7 B parameters; 32768 gives
3 * 7168 * 32768 = 0.705 B."""


def parameter_ledger(shape: LatentMoEShape) -> dict:
    """Parameter counts (plain ints, plus a few ratios) for ``shape``; see the module docstring."""
    if not isinstance(shape, LatentMoEShape):
        raise TypeError(f"shape must be a LatentMoEShape; got {type(shape).__name__}")
    d, lat, m = shape.hidden_size, shape.latent_size, shape.moe_ffn_hidden_size
    n, k, S = shape.num_experts, shape.topk, shape.shared_ffn_hidden_size
    L_moe, L_dense = shape.num_moe_layers, shape.num_dense_layers

    expert = 3 * lat * m
    routed = n * expert
    shared = 3 * d * S
    down, up = d * lat, lat * d
    norm = lat if shape.latent_norm else 0
    proj = down + up + norm
    router = n * d
    layer_total = routed + shared + proj + router

    act_routed = k * expert
    act_excl_router = act_routed + shared + proj
    act_total = act_excl_router + router

    dense_layer = 3 * d * shape.dense_ffn_hidden_size if L_dense else 0
    dense_all = L_dense * dense_layer

    emb = shape.vocab_size * d
    head = 0 if shape.tie_word_embeddings else shape.vocab_size * d

    moe_all = L_moe * layer_total
    ffn_all = moe_all + dense_all  # > 0: with no MoE layer, the dense layers have a dense FFN
    counted = ffn_all + emb + head

    from megatron_latentmoe.ops.mxfp4 import BITS_PER_PARAM

    groups = {
        "routed_experts": L_moe * routed,
        "shared_experts": L_moe * shared,
        "projections": L_moe * proj,
        "routers": L_moe * router,
        "dense_ffn": dense_all,
        "embedding_and_lm_head": emb + head,
    }
    bf16_bytes = {g: 2 * v for g, v in groups.items()}
    mxfp4_bytes = dict(bf16_bytes, routed_experts=L_moe * routed * BITS_PER_PARAM / 8)
    return {
        "shape": dataclasses.asdict(shape),
        "num_moe_layers": L_moe,
        "num_dense_layers": L_dense,
        "per_moe_layer": {
            "routed_expert_params_each": expert,
            "routed_expert_params": routed,
            "shared_expert_params": shared,
            "latent_down_proj_params": down,
            "latent_up_proj_params": up,
            "latent_norm_params": norm,
            "projection_params": proj,
            "router_params": router,
            "router_bias_buffer": n,  # e_score_correction_bias: non-trainable, not in totals
            "total_params": layer_total,
        },
        "activated_per_token_per_moe_layer": {
            "routed_experts": act_routed,
            "shared_experts": shared,
            "projections": proj,
            "router": router,
            "total_excl_router": act_excl_router,
            "total": act_total,
        },
        "all_moe_layers": {
            "routed_expert_params": L_moe * routed,
            "shared_expert_params": L_moe * shared,
            "projection_params": L_moe * proj,
            "router_params": L_moe * router,
            "router_bias_buffer": L_moe * n,
            "total_params": moe_all,
            "activated_per_token": L_moe * act_total,
            "activated_per_token_excl_router": L_moe * act_excl_router,
        },
        "dense_layers": {
            "ffn_params_per_layer": dense_layer,
            "ffn_params": dense_all,
            "activated_per_token": dense_all,
        },
        "embedding": {
            "input_embedding_params": emb,
            "lm_head_params": head,
            "total_params": emb + head,
        },
        "totals": {
            "ffn_params": ffn_all,
            "moe_share_of_ffn": moe_all / ffn_all,
            "routed_share_of_ffn": L_moe * routed / ffn_all,
            "counted_params": counted,
            "routed_share_of_counted": L_moe * routed / counted,
            "activated_per_token": L_moe * act_total + dense_all + emb + head,
            "ffn_activated_per_token": L_moe * act_total + dense_all,
        },
        "bytes": {
            "routed_expert_bits_mxfp4": BITS_PER_PARAM,
            "bf16": {**bf16_bytes, "total": sum(bf16_bytes.values())},
            "mxfp4_routed_experts": {**mxfp4_bytes, "total": sum(mxfp4_bytes.values())},
        },
        "not_counted": NOT_COUNTED,
    }


def _human(x: float) -> str:
    """3 significant digits with a T / B / M / K suffix (rounded before the unit is chosen)."""
    if x == 0:
        return "0"
    x = float(f"{x:.3g}")
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            v = x / div
            digits = max(0, 2 - int(math.floor(math.log10(abs(v)))))
            return f"{v:.{digits}f} {suffix}"
    return f"{x:g}"


def format_ledger(ledger: Mapping[str, Any]) -> str:
    """A human table (values with T / B / M units and exact counts)."""
    s = ledger["shape"]
    p, a, al = (
        ledger["per_moe_layer"],
        ledger["activated_per_token_per_moe_layer"],
        ledger["all_moe_layers"],
    )
    dn, e, t = ledger["dense_layers"], ledger["embedding"], ledger["totals"]
    L_moe, L_dense = ledger["num_moe_layers"], ledger["num_dense_layers"]
    n_shared_note = f"3·d·{s['shared_ffn_hidden_size']}" if s["shared_ffn_hidden_size"] else "none"
    rows: list = [
        ("per MoE layer", None, None),
        ("  routed expert (one)", p["routed_expert_params_each"], "3·l·m_e"),
        ("  routed experts (all n)", p["routed_expert_params"], "n·3·l·m_e"),
        ("  shared experts", p["shared_expert_params"], n_shared_note),
        (
            "  W_down + W_up (+ norm)",
            p["projection_params"],
            "2·d·l" + (" + l" if s["latent_norm"] else ""),
        ),
        ("  router", p["router_params"], "n·d"),
        ("  router bias (buffer)", p["router_bias_buffer"], "n, non-trainable, not in totals"),
        ("  layer total", p["total_params"], None),
        ("activated per token, per MoE layer", None, None),
        (f"  {s['topk']} routed experts", a["routed_experts"], "k·3·l·m_e"),
        ("  shared experts", a["shared_experts"], None),
        ("  W_down + W_up (+ norm)", a["projections"], None),
        ("  subtotal (experts+shared+proj)", a["total_excl_router"], None),
        ("  router (all n scores)", a["router"], None),
        ("  total", a["total"], None),
        (f"all {L_moe} MoE layers", None, None),
        ("  routed experts", al["routed_expert_params"], None),
        ("  shared experts", al["shared_expert_params"], None),
        ("  W_down + W_up (+ norm)", al["projection_params"], None),
        ("  routers", al["router_params"], None),
        ("  total", al["total_params"], None),
        ("  activated per token (excl. router)", al["activated_per_token_excl_router"], None),
        ("  activated per token", al["activated_per_token"], None),
        (f"{L_dense} dense layer(s)", None, None),
        ("  FFN per layer", dn["ffn_params_per_layer"], "3·d·dense_ffn"),
        ("  FFN all dense layers", dn["ffn_params"], None),
        ("embedding / LM head", None, None),
        ("  input embedding", e["input_embedding_params"], "V·d"),
        ("  LM head", e["lm_head_params"], "tied" if s["tie_word_embeddings"] else "V·d"),
        ("totals (attention not counted)", None, None),
        ("  FFN (MoE + dense)", t["ffn_params"], None),
        ("  MoE share of FFN", None, _pct(t["moe_share_of_ffn"])),
        ("  routed share of FFN", None, _pct(t["routed_share_of_ffn"])),
        ("  counted (FFN + embeddings)", t["counted_params"], None),
        ("  activated per token (counted)", t["activated_per_token"], "FFN + embedding + LM head"),
    ]
    b = ledger["bytes"]
    b16, bmx = b["bf16"], b["mxfp4_routed_experts"]
    rows += [
        ("bytes of the counted params: all bf16", None, None),
        ("  routed experts", b16["routed_experts"], "2 B/param"),
        ("  everything else", b16["total"] - b16["routed_experts"], None),
        ("  total", b16["total"], None),
        ("bytes: routed experts MXFP4, rest bf16 (K3 deployment)", None, None),
        (
            "  routed experts",
            round(bmx["routed_experts"]),
            f"{b['routed_expert_bits_mxfp4']} bits/param (E2M1 + E8M0 per 32); "
            f"{b16['routed_experts'] / bmx['routed_experts']:.2f}x smaller",
        ),
        ("  total", round(bmx["total"]), f"{b16['total'] / bmx['total']:.2f}x smaller"),
    ]
    w = max(len(r[0]) for r in rows)
    out = [
        f"Stable LatentMoE parameter ledger: d={s['hidden_size']} l={s['latent_size']} "
        f"m_e={s['moe_ffn_hidden_size']} n={s['num_experts']} k={s['topk']} "
        f"shared={s['shared_ffn_hidden_size']} layers={s['num_layers']} "
        f"(dense {L_dense}, MoE {L_moe}) dense_ffn={s['dense_ffn_hidden_size']} "
        f"vocab={s['vocab_size']} latent_norm={s['latent_norm']} "
        f"tied={s['tie_word_embeddings']}",
    ]
    for label, value, note in rows:
        if value is None and note is None:
            out.append(label)
            continue
        vs = f"{_human(value):>9}  {value:>17,}" if value is not None else " " * 28
        out.append(f"{label:<{w}}  {vs}" + (f"  {note}" if note else ""))
    out.append(f"note: {ledger['not_counted']}")
    return "\n".join(out)


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"
