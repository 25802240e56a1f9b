"""Parameter ledger (SPEC §5): the K3 numbers, a hand-built module, config readers, the CLI."""

import dataclasses
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from megatron_latentmoe.ledger import (
    K3_FULL_SCALE,
    LatentMoEShape,
    format_ledger,
    parameter_ledger,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(REPO, "tools", "ledger.py")


def sig(x, digits=3):
    return float(f"{x:.{digits}g}")


# ---------------------------------------------------------------------------- SPEC §5


def test_k3_preset_reproduces_spec_numbers():
    led = parameter_ledger(K3_FULL_SCALE)
    assert led["num_moe_layers"] == 92 and led["num_dense_layers"] == 1
    allm, act = led["all_moe_layers"], led["activated_per_token_per_moe_layer"]
    # routed expert params over all MoE layers: 2.72 T, 98 % of the model's 2.78 T
    assert sig(allm["routed_expert_params"]) == 2.72e12
    assert round(100 * allm["routed_expert_params"] / 2.78e12) == 98
    # activated per token per layer: 528 M (16 experts) / 132 M (shared) / 51 M (W_down + W_up)
    assert sig(act["routed_experts"]) == 528e6
    assert sig(act["shared_experts"]) == 132e6
    assert sig(act["projections"], 2) == 51e6
    # "≈ 711 M": the sum of the rounded items; the exact sum is 711.99 M
    assert 528 + 132 + 51 == 711
    assert 711e6 <= act["total_excl_router"] < 712e6
    # "≈ 65 B" over the 92 MoE layers
    assert 65e9 <= allm["activated_per_token_excl_router"] < 66e9
    assert allm["activated_per_token_excl_router"] == 92 * act["total_excl_router"]
    # the router is not in those figures: all n scores are computed for every token
    assert act["total"] == act["total_excl_router"] + 896 * 7168


def test_k3_remaining_activated_params_are_attention():
    """Seed 000: 104.2 B activated = ~65 B MoE + dense FFN 0.7 B + embedding and LM head 1.2 B
    each + attention (KDA ~30 B + MLA ~6 B). The ledger's part leaves ~36 B for attention."""
    led = parameter_ledger(K3_FULL_SCALE)
    assert round(led["dense_layers"]["ffn_params"] / 1e9, 1) == 0.7
    assert round(led["embedding"]["input_embedding_params"] / 1e9, 1) == 1.2
    assert round(led["embedding"]["lm_head_params"] / 1e9, 1) == 1.2
    ours = (
        led["all_moe_layers"]["activated_per_token_excl_router"]
        + led["dense_layers"]["ffn_params"]
        + led["embedding"]["total_params"]
    )
    assert abs((104.2e9 - ours) - 36e9) < 1e9


def test_k3_exact_counts():
    p = parameter_ledger(K3_FULL_SCALE)["per_moe_layer"]
    assert p["routed_expert_params_each"] == 3 * 3584 * 3072
    assert p["shared_expert_params"] == 3 * 7168 * 6144
    assert p["projection_params"] == 2 * 7168 * 3584 + 3584
    assert p["router_params"] == 896 * 7168
    assert p["router_bias_buffer"] == 896


# ---------------------------------------------------------------------------- hand-built module

TINY = LatentMoEShape(
    hidden_size=8,
    latent_size=4,
    moe_ffn_hidden_size=6,
    num_experts=5,
    topk=2,
    shared_ffn_hidden_size=2 * 6,
    num_layers=3,
    first_k_dense_replace=1,
    dense_ffn_hidden_size=10,
    vocab_size=11,
    latent_norm=True,
    tie_word_embeddings=False,
)


def gated_mlp(d_in, ff, d_out):
    return nn.ModuleDict(
        dict(
            gate=nn.Linear(d_in, ff, bias=False),
            up=nn.Linear(d_in, ff, bias=False),
            down=nn.Linear(ff, d_out, bias=False),
        )
    )


class TinyMoELayer(nn.Module):
    def __init__(self, s: LatentMoEShape):
        super().__init__()
        d, lat = s.hidden_size, s.latent_size
        self.router = nn.Linear(d, s.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(s.num_experts))
        self.down = nn.Linear(d, lat, bias=False)
        self.experts = nn.ModuleList(
            gated_mlp(lat, s.moe_ffn_hidden_size, lat) for _ in range(s.num_experts)
        )
        self.norm = nn.RMSNorm(lat) if s.latent_norm else nn.Identity()
        self.up = nn.Linear(lat, d, bias=False)
        self.shared = (
            gated_mlp(d, s.shared_ffn_hidden_size, d) if s.shared_ffn_hidden_size else None
        )


class TinyModel(nn.Module):
    def __init__(self, s: LatentMoEShape):
        super().__init__()
        self.embed = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(
            gated_mlp(s.hidden_size, s.dense_ffn_hidden_size, s.hidden_size)
            if i < s.first_k_dense_replace
            else TinyMoELayer(s)
            for i in range(s.num_layers)
        )
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        if s.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight


def n_params(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("shared", [12, 0])
def test_tiny_config_matches_module(tied, norm, shared):
    s = dataclasses.replace(
        TINY, tie_word_embeddings=tied, latent_norm=norm, shared_ffn_hidden_size=shared
    )
    model = TinyModel(s)
    led = parameter_ledger(s)
    assert led["totals"]["counted_params"] == n_params(model)  # parameters() dedups the tie
    moe = [m for m in model.layers if isinstance(m, TinyMoELayer)]
    dense = [m for m in model.layers if not isinstance(m, TinyMoELayer)]
    assert len(moe) == led["num_moe_layers"] and len(dense) == led["num_dense_layers"]
    layer = moe[0]
    p = led["per_moe_layer"]
    assert p["routed_expert_params_each"] == n_params(layer.experts[0])
    assert p["routed_expert_params"] == n_params(layer.experts)
    assert p["shared_expert_params"] == (n_params(layer.shared) if layer.shared else 0)
    assert p["projection_params"] == n_params(layer.down) + n_params(layer.up) + n_params(
        layer.norm
    )
    assert p["router_params"] == n_params(layer.router)
    assert p["router_bias_buffer"] == layer.expert_bias.numel()
    assert p["total_params"] == n_params(layer)
    assert led["all_moe_layers"]["total_params"] == sum(n_params(m) for m in moe)
    assert led["dense_layers"]["ffn_params"] == sum(n_params(m) for m in dense)
    assert led["embedding"]["total_params"] == n_params(model.embed) + (
        0 if tied else n_params(model.lm_head)
    )
    # activated: the k chosen experts, shared, projections, router
    act = led["activated_per_token_per_moe_layer"]
    chosen = [layer.experts[j] for j in (3, 1)]  # any k = 2 experts
    assert act["routed_experts"] == sum(n_params(e) for e in chosen)
    assert act["total"] == n_params(layer) - sum(
        n_params(e) for j, e in enumerate(layer.experts) if j not in (3, 1)
    )
    assert led["all_moe_layers"]["router_bias_buffer"] == sum(m.expert_bias.numel() for m in moe)


def test_tiny_hand_computed():
    led = parameter_ledger(TINY)
    # expert 3*4*6 = 72; routed 5*72 = 360; shared 3*8*12 = 288; proj 2*8*4 + 4 = 68; router 40
    assert led["per_moe_layer"]["routed_expert_params"] == 360
    assert led["per_moe_layer"]["shared_expert_params"] == 288
    assert led["per_moe_layer"]["projection_params"] == 68
    assert led["per_moe_layer"]["router_params"] == 40
    assert led["per_moe_layer"]["total_params"] == 756
    assert led["activated_per_token_per_moe_layer"]["total"] == 2 * 72 + 288 + 68 + 40
    assert led["dense_layers"]["ffn_params"] == 3 * 8 * 10
    assert led["embedding"]["total_params"] == 2 * 11 * 8
    assert led["totals"]["counted_params"] == 2 * 756 + 240 + 176
    # W_down d x l, W_up l x d, the latent norm's l
    p = led["per_moe_layer"]
    assert (p["latent_down_proj_params"], p["latent_up_proj_params"]) == (8 * 4, 4 * 8)
    assert p["latent_norm_params"] == 4
    assert led["not_counted"] == (
        "attention (model-specific; K3: KDA + MLA layers), norms outside the MoE block, MTP and "
        "vision modules are not counted"
    )
    t = led["totals"]
    assert t["routed_share_of_counted"] == 2 * 360 / 1928
    assert t["ffn_activated_per_token"] == 2 * 540 + 240  # 2 MoE layers + the dense one
    assert t["activated_per_token"] == 2 * 540 + 240 + 176
    assert led["bytes"]["bf16"] == {
        "routed_experts": 2 * 720,
        "shared_experts": 2 * 576,
        "projections": 2 * 136,
        "routers": 2 * 80,
        "dense_ffn": 2 * 240,
        "embedding_and_lm_head": 2 * 176,
        "total": 2 * 1928,
    }


def test_shares_of_the_ffn_and_the_dense_layers_every_token_passes():
    """MoE share = all MoE layers / FFN, routed share = routed experts / FFN (not / counted);
    a token passes every dense layer; no dense layer: no dense FFN, whatever its width says."""
    t = parameter_ledger(TINY)["totals"]
    assert t["ffn_params"] == 2 * 756 + 240
    assert t["moe_share_of_ffn"] == 2 * 756 / 1752
    assert t["routed_share_of_ffn"] == 2 * 360 / 1752
    two_dense = dataclasses.replace(TINY, num_layers=4, first_k_dense_replace=2)
    assert parameter_ledger(two_dense)["dense_layers"] == {
        "ffn_params_per_layer": 3 * 8 * 10,
        "ffn_params": 2 * 3 * 8 * 10,
        "activated_per_token": 2 * 3 * 8 * 10,
    }
    no_dense = dataclasses.replace(TINY, first_k_dense_replace=0)  # dense_ffn_hidden_size=10
    assert parameter_ledger(no_dense)["dense_layers"] == {
        "ffn_params_per_layer": 0,
        "ffn_params": 0,
        "activated_per_token": 0,
    }


@pytest.mark.parametrize(
    "x,text",
    [
        (999_700_000, "1.00 B"),
        (999_999, "1.00 M"),
        (9_996_000_000, "10.0 B"),
        (2.7227e12, "2.72 T"),
        (51_380_224, "51.4 M"),
        (1234, "1.23 K"),
        (12, "12"),
        (0, "0"),
    ],
)
def test_human_rounds_before_choosing_the_unit(x, text):
    from megatron_latentmoe.ledger import _human

    assert _human(x) == text


def test_stable_latentmoe_config_layout_is_what_megatron_builds():
    pytest.importorskip("megatron.core")
    from megatron_latentmoe.config import tiny_config

    cfg = tiny_config(num_layers=4, first_k_dense_replace=1)
    assert LatentMoEShape.from_megatron_config(cfg).first_k_dense_replace == 1
    every_layer = tiny_config(num_layers=4, moe_layer_freq=[0, 0, 1, 1])
    assert LatentMoEShape.from_megatron_config(every_layer).first_k_dense_replace == 2


def test_format_ledger_units():
    text = format_ledger(parameter_ledger(K3_FULL_SCALE))
    for needle in (
        "2.72 T",
        "528 M",
        "132 M",
        "51.4 M",
        "65.5 B",
        "712 M",
        "705 M",
        "1.17 B",
        "attention",
    ):
        assert needle in text, needle
    assert "2,722,740,830,208" in text
    small = format_ledger(parameter_ledger(TINY))
    assert "756" in small and "not counted" in small


# ---------------------------------------------------------------------------- a Megatron model

MEGATRON_MODELS = {  # tiny_config overrides, tied embeddings
    "dense-first": (dict(num_layers=3, first_k_dense_replace=1), False),
    "all-moe-no-shared-no-norm-tied": (
        dict(moe_shared_expert_intermediate_size=None, latent_moe_use_norm=False),
        True,
    ),
}
MEGATRON_VOCAB = 96


def _megatron_models(rank, world_size):
    """(the ledger's shape of the config, {state-dict key: numel}) of each MEGATRON_MODELS model,
    as Megatron builds it (a one-rank gloo world)."""
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.model import build_gpt_model

    initialize_parallel_cpu()
    out = []
    for overrides, tied in MEGATRON_MODELS.values():
        config = tiny_config(**overrides)
        model = build_gpt_model(
            config,
            vocab_size=MEGATRON_VOCAB,
            max_sequence_length=16,
            share_embeddings_and_output_weights=tied,
        )
        config.padded_vocab_size = MEGATRON_VOCAB  # what megatron.training's args add
        config.share_embeddings_and_output_weights = tied
        sizes = {k: v.numel() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        out.append((LatentMoEShape.from_megatron_config(config), sizes))
    return out


@pytest.fixture(scope="module")
def megatron_models():
    pytest.importorskip("megatron.core")
    from tests.parallel.launcher import run_distributed

    (models,) = run_distributed(_megatron_models, 1, timeout=300)
    return dict(zip(MEGATRON_MODELS, models, strict=True))


MEGATRON_GROUPS = {  # ledger entry -> the state-dict keys it counts (by a part of their name)
    ("all_moe_layers", "routed_expert_params"): (".mlp.experts.local_experts.",),
    ("all_moe_layers", "shared_expert_params"): (".mlp.shared_experts.",),
    ("all_moe_layers", "projection_params"): (
        ".mlp.fc1_latent_proj.",
        ".mlp.routed_expert_norm.",
        ".mlp.fc2_latent_proj.",
    ),
    ("all_moe_layers", "router_params"): (".mlp.router.weight",),
    ("all_moe_layers", "router_bias_buffer"): (".mlp.router.expert_bias",),
    ("dense_layers", "ffn_params"): (".mlp.linear_fc1.", ".mlp.linear_fc2."),
    ("embedding", "input_embedding_params"): ("embedding.word_embeddings.",),
    ("embedding", "lm_head_params"): ("output_layer.",),
}


@pytest.mark.parametrize("kind", MEGATRON_MODELS)
def test_ledger_is_a_hand_count_of_the_megatron_models_state_dict(megatron_models, kind):
    """Each ledger entry == the state-dict tensors of the model Megatron builds from the config
    (the ledger reads the config's fields); what it leaves out is attention and the norms outside
    the MoE block."""
    shape, sizes = megatron_models[kind]
    led = parameter_ledger(shape)

    def count(parts, layer=None):
        prefix = "" if layer is None else f"decoder.layers.{layer}."
        return sum(
            n for k, n in sizes.items() if k.startswith(prefix) and any(p in k for p in parts)
        )

    for (group, entry), parts in MEGATRON_GROUPS.items():
        assert led[group][entry] == count(parts), (group, entry)
    counted = [
        p for (_, e), parts in MEGATRON_GROUPS.items() if e != "router_bias_buffer" for p in parts
    ]
    assert led["totals"]["counted_params"] == count(counted)
    left_out = {k for k in sizes if not any(p in k for ps in MEGATRON_GROUPS.values() for p in ps)}
    assert all(".self_attention." in k or k.endswith("layernorm.weight") for k in left_out)
    # one MoE layer (the last), and what one token activates there: k of its n experts
    last = shape.num_layers - 1
    per = led["per_moe_layer"]
    experts = [f".local_experts.{j}." for j in range(shape.num_experts)]
    assert per["routed_expert_params_each"] == count(experts[:1], last)
    assert per["total_params"] == count(counted, last)
    act = led["activated_per_token_per_moe_layer"]
    assert act["routed_experts"] == count(experts[: shape.topk], last)
    assert act["total"] == count(counted, last) - count(experts[shape.topk :], last)
    assert led["num_dense_layers"] == shape.first_k_dense_replace == (kind == "dense-first")


# ---------------------------------------------------------------------------- config readers

K3_HF = {
    "hidden_size": 7168,
    "routed_expert_hidden_size": 3584,
    "moe_intermediate_size": 3072,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_shared_experts": 2,
    "first_k_dense_replace": 1,
    "intermediate_size": 32768,
    "num_hidden_layers": 93,
    "vocab_size": 163840,
    "latent_moe_use_norm": True,
    "tie_word_embeddings": False,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
}


def test_from_hf_config():
    assert LatentMoEShape.from_hf_config(K3_HF) == K3_FULL_SCALE
    assert (
        LatentMoEShape.from_hf_config({"text_config": K3_HF, "vision_config": {}}) == K3_FULL_SCALE
    )
    no_shared = dict(K3_HF, num_shared_experts=0)
    assert LatentMoEShape.from_hf_config(no_shared).shared_ffn_hidden_size == 0
    for key in ("routed_expert_hidden_size", "num_experts_per_token", "num_hidden_layers"):
        bad = {k: v for k, v in K3_HF.items() if k != key}
        with pytest.raises(ValueError, match=key):
            LatentMoEShape.from_hf_config(bad)
    with pytest.raises(ValueError, match="intermediate_size"):
        LatentMoEShape.from_hf_config({k: v for k, v in K3_HF.items() if k != "intermediate_size"})


def _mcore_ns(**over):
    base = dict(
        hidden_size=7168,
        moe_latent_size=3584,
        moe_ffn_hidden_size=3072,
        num_moe_experts=896,
        moe_router_topk=16,
        moe_shared_expert_intermediate_size=6144,
        num_layers=93,
        first_k_dense_replace=1,
        ffn_hidden_size=32768,
        latent_moe_use_norm=True,
        padded_vocab_size=163840,
    )
    base.update(over)
    return types.SimpleNamespace(**base)


def test_from_megatron_config_namespace():
    assert LatentMoEShape.from_megatron_config(_mcore_ns()) == K3_FULL_SCALE
    s = LatentMoEShape.from_megatron_config(
        _mcore_ns(
            moe_shared_expert_intermediate_size=None,
            padded_vocab_size=None,
            vocab_size=1000,
            share_embeddings_and_output_weights=True,
        )
    )
    assert s.shared_ffn_hidden_size == 0 and s.vocab_size == 1000 and s.tie_word_embeddings
    # the embedding has the padded vocabulary's rows: padded_vocab_size wins over vocab_size
    assert LatentMoEShape.from_megatron_config(_mcore_ns(vocab_size=163000)).vocab_size == 163840
    ns = _mcore_ns()
    del ns.first_k_dense_replace
    ns.moe_layer_freq = [0] * 3 + [1] * 90
    assert LatentMoEShape.from_megatron_config(ns).first_k_dense_replace == 3
    ns.moe_layer_freq = [0, 1] * 46 + [1]
    with pytest.raises(ValueError, match="moe_layer_freq"):
        LatentMoEShape.from_megatron_config(ns)
    # the built layout (moe_layer_freq) wins over first_k_dense_replace, and they must agree
    ns = _mcore_ns(first_k_dense_replace=1, moe_layer_freq=[0] * 2 + [1] * 91)
    with pytest.raises(ValueError, match="first_k_dense_replace=1 disagrees"):
        LatentMoEShape.from_megatron_config(ns)
    with pytest.raises(ValueError, match="moe_latent_size"):
        LatentMoEShape.from_megatron_config(_mcore_ns(moe_latent_size=None))
    with pytest.raises(ValueError, match="gated_linear_unit"):
        LatentMoEShape.from_megatron_config(_mcore_ns(gated_linear_unit=False))


def test_config_readers_other_spellings_and_refusals():
    """megatron.training's args names (num_experts, untie_embeddings_and_output_weights), HF's
    tie_word_embeddings; each refusal names the field, the value and what the ledger reads."""
    ns = _mcore_ns(num_moe_experts=None, num_experts=448, moe_router_topk=8)
    assert LatentMoEShape.from_megatron_config(ns) == dataclasses.replace(
        K3_FULL_SCALE, num_experts=448, topk=8
    )
    for tie in (True, False):
        ns = _mcore_ns(untie_embeddings_and_output_weights=not tie)
        assert LatentMoEShape.from_megatron_config(ns).tie_word_embeddings is tie
        ns = _mcore_ns(tie_word_embeddings=tie)
        assert LatentMoEShape.from_megatron_config(ns).tie_word_embeddings is tie
    # the built layout wins; moe_layer_freq 1 leaves it to first_k_dense_replace (absent: 0)
    ns = _mcore_ns(moe_layer_freq=1)
    del ns.first_k_dense_replace
    assert LatentMoEShape.from_megatron_config(ns).first_k_dense_replace == 0
    assert LatentMoEShape.from_megatron_config(_mcore_ns(moe_layer_freq=None)) == K3_FULL_SCALE
    for k in (0, 1, 93):  # the list's leading zeros, up to every layer
        ns = _mcore_ns(moe_layer_freq=[0] * k + [1] * (93 - k), first_k_dense_replace=0)
        assert LatentMoEShape.from_megatron_config(ns).first_k_dense_replace == k
    refusals = (
        (
            _mcore_ns(moe_layer_freq=2),
            "moe_layer_freq=2: the ledger needs the first-k-dense layout: moe_layer_freq 1 (with "
            "first_k_dense_replace) or [0]*k + [1]*rest",
        ),
        (
            _mcore_ns(moe_layer_freq=[0] + [1] * 91),  # 92 entries, 93 layers
            f"moe_layer_freq={[0] + [1] * 91}: the ledger needs [0]*k + [1]*(num_layers-k) with "
            "num_layers=93 (or moe_layer_freq 1 with first_k_dense_replace)",
        ),
        (
            _mcore_ns(first_k_dense_replace=1, moe_layer_freq=[0] * 2 + [1] * 91),
            f"first_k_dense_replace=1 disagrees with moe_layer_freq={[0] * 2 + [1] * 91} (2 dense "
            "layers first)",
        ),
        (
            _mcore_ns(hidden_size=None),
            "Megatron config field hidden_size is required for the ledger (got None or missing)",
        ),
    )
    for ns, text in refusals:
        with pytest.raises(ValueError) as info:
            LatentMoEShape.from_megatron_config(ns)
        assert str(info.value) == text
    for config, text in (
        ([K3_HF], "HF config must be a mapping; got list"),
        (
            {k: v for k, v in K3_HF.items() if k != "intermediate_size"},
            "HF config key 'intermediate_size' is required when first_k_dense_replace=1 (missing)",
        ),
        (
            {k: v for k, v in K3_HF.items() if k != "hidden_size"},
            "HF config: missing key(s) ['hidden_size']",
        ),
    ):
        with pytest.raises(ValueError) as info:
            LatentMoEShape.from_hf_config(config)
        assert str(info.value) == text
    # without dense layers, intermediate_size is not a dense FFN's width; it may be absent, and
    # so may the vocabulary
    assert LatentMoEShape.from_hf_config(dict(K3_HF, first_k_dense_replace=0)) == (
        dataclasses.replace(K3_FULL_SCALE, first_k_dense_replace=0, dense_ffn_hidden_size=0)
    )
    moe_only = {k: v for k, v in K3_HF.items() if k not in ("intermediate_size", "vocab_size")}
    shape = LatentMoEShape.from_hf_config(dict(moe_only, first_k_dense_replace=0))
    assert (shape.dense_ffn_hidden_size, shape.vocab_size, shape.num_layers) == (0, 0, 93)


def test_shape_defaults():
    """Only the five MoE sizes are needed: one MoE layer, no shared experts, no dense layers, no
    vocabulary, the latent norm, untied."""
    shape = LatentMoEShape(
        hidden_size=8, latent_size=4, moe_ffn_hidden_size=6, num_experts=5, topk=2
    )
    assert dataclasses.asdict(shape) == dict(
        hidden_size=8,
        latent_size=4,
        moe_ffn_hidden_size=6,
        num_experts=5,
        topk=2,
        shared_ffn_hidden_size=0,
        num_layers=1,
        first_k_dense_replace=0,
        dense_ffn_hidden_size=0,
        vocab_size=0,
        latent_norm=True,
        tie_word_embeddings=False,
    )
    dense = parameter_ledger(shape)["dense_layers"]
    assert dense == {"ffn_params_per_layer": 0, "ffn_params": 0, "activated_per_token": 0}


def test_from_real_transformer_config():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=3,
        hidden_size=8,
        num_attention_heads=1,
        ffn_hidden_size=10,
        num_moe_experts=5,
        moe_router_topk=2,
        moe_ffn_hidden_size=6,
        moe_latent_size=4,
        moe_shared_expert_intermediate_size=12,
        moe_layer_freq=[0, 1, 1],
        gated_linear_unit=True,
        add_bias_linear=False,
    )
    cfg.latent_moe_use_norm = True
    cfg.padded_vocab_size = 11
    assert LatentMoEShape.from_megatron_config(cfg) == TINY


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("hidden_size", 0, "an integer >= 1"),
        ("latent_size", -1, "an integer >= 1"),
        ("moe_ffn_hidden_size", 2.5, "an integer >= 1"),
        ("num_experts", 0, "an integer >= 1"),
        ("topk", 0, "an integer >= 1"),
        ("topk", 897, "an integer in [1, num_experts=896)"),
        # QB's top-(k+1) needs k < num_experts, as the model's config says
        ("topk", 896, "an integer in [1, num_experts=896)"),
        ("shared_ffn_hidden_size", -1, "an integer >= 0"),
        ("num_layers", 0, "an integer >= 1"),
        ("first_k_dense_replace", 94, "an integer in [0, num_layers=93]"),
        ("first_k_dense_replace", -1, "an integer >= 0"),
        ("vocab_size", -5, "an integer >= 0"),
        ("dense_ffn_hidden_size", -1, "an integer >= 0"),
        ("dense_ffn_hidden_size", 0, "> 0 when first_k_dense_replace=1 layers are dense"),
        ("latent_norm", 1, "True or False"),
        ("tie_word_embeddings", "no", "True or False"),
        ("hidden_size", True, "an integer >= 1"),
        ("num_experts", "896", "an integer >= 1"),
    ],
)
def test_bad_fields_raise_with_field_name(field, value, allowed):
    with pytest.raises(ValueError) as info:
        dataclasses.replace(K3_FULL_SCALE, **{field: value})
    assert str(info.value) == f"{field}={value!r} is not allowed: {allowed}"


def test_the_limits_themselves_are_allowed():
    """k = n - 1, every layer dense, no shared experts, no vocabulary: a ledger, with the MoE
    entries 0 where there is no MoE layer."""
    assert dataclasses.replace(K3_FULL_SCALE, topk=895).topk == 895
    dense = dataclasses.replace(
        TINY, first_k_dense_replace=3, shared_ffn_hidden_size=0, vocab_size=0
    )
    led = parameter_ledger(dense)
    assert (led["num_moe_layers"], led["num_dense_layers"]) == (0, 3)
    assert led["all_moe_layers"]["total_params"] == 0
    assert led["totals"]["ffn_params"] == led["totals"]["counted_params"] == 3 * 3 * 8 * 10
    assert led["totals"]["moe_share_of_ffn"] == led["totals"]["routed_share_of_ffn"] == 0
    assert led["totals"]["activated_per_token"] == 3 * 3 * 8 * 10


def test_dense_layers_need_dense_ffn():
    with pytest.raises(ValueError, match="dense_ffn_hidden_size"):
        dataclasses.replace(K3_FULL_SCALE, dense_ffn_hidden_size=0)
    s = dataclasses.replace(K3_FULL_SCALE, first_k_dense_replace=0, dense_ffn_hidden_size=0)
    assert parameter_ledger(s)["dense_layers"]["ffn_params"] == 0
    with pytest.raises(TypeError):
        parameter_ledger({"hidden_size": 1})


# ---------------------------------------------------------------------------- CLI


def run_cli(*args):
    return subprocess.run(
        [sys.executable, CLI, *args], capture_output=True, text=True, cwd="/", timeout=120
    )


def test_cli_default_prints_k3_numbers():
    r = run_cli()
    assert r.returncode == 0, r.stderr
    for needle in ("2.72 T", "528 M", "132 M", "51.4 M", "712 M", "65.5 B", "attention"):
        assert needle in r.stdout, needle


def test_cli_json_overrides_and_hf_config(tmp_path):
    r = run_cli("--json")
    assert r.returncode == 0, r.stderr
    led = json.loads(r.stdout)
    assert led == json.loads(json.dumps(parameter_ledger(K3_FULL_SCALE)))
    r = run_cli("--json", "--topk", "8", "--num-experts", "448", "--no-latent-norm")
    led = json.loads(r.stdout)
    assert led["shape"]["topk"] == 8 and led["per_moe_layer"]["router_bias_buffer"] == 448
    assert led["per_moe_layer"]["latent_norm_params"] == 0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(K3_HF, num_experts=64, num_experts_per_token=4)))
    r = run_cli("--hf-config", str(path), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["shape"]["num_experts"] == 64


def test_cli_errors():
    r = run_cli("--topk", "1000")
    assert r.returncode == 2 and "topk" in r.stderr
    r = run_cli("--hf-config", "/nonexistent/config.json")
    assert r.returncode == 2 and "config.json" in r.stderr


def test_cli_refusals_name_the_input(tmp_path, capsys):
    """Bad input: exit status 2 and one line naming the option, the value and what is allowed
    (the CLI's main() in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ledger_cli", CLI)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)

    def error(*argv):
        with pytest.raises(SystemExit) as info:
            cli.main(list(argv))
        assert info.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert error("--topk", "1000").endswith(
        "error: --topk=1000 is not allowed: an integer in [1, num_experts=896)"
    )
    assert error("--latent-size", "0").endswith(
        "error: --latent-size=0 is not allowed: an integer >= 1"
    )
    # the refused value is the preset's (topk 16), not an option's: its field is named
    assert error("--num-experts", "8").endswith(
        "error: topk=16 is not allowed: an integer in [1, num_experts=8)"
    )
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert error("--hf-config", str(bad)).endswith(
        f"error: --hf-config {bad}: Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1)"
    )
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x08\x80\xff")
    assert error("--hf-config", str(binary)).endswith(
        f"error: --hf-config {binary}: not a JSON text file ('utf-8' codec can't decode byte 0x80 "
        "in position 1: invalid start byte)"
    )
    short = tmp_path / "short.json"
    short.write_text(json.dumps({k: v for k, v in K3_HF.items() if k != "hidden_size"}))
    assert error("--hf-config", str(short)).endswith(
        f"error: --hf-config {short}: HF config: missing key(s) ['hidden_size']"
    )
    assert cli.main(["--preset", "k3", "--json", "--no-tie-word-embeddings"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(
        json.dumps(parameter_ledger(K3_FULL_SCALE))
    )
    assert cli.main(["--hidden-size", "1024", "--tie-word-embeddings", "--json"]) == 0
    shape = json.loads(capsys.readouterr().out)["shape"]
    assert shape == dict(
        dataclasses.asdict(K3_FULL_SCALE), hidden_size=1024, tie_word_embeddings=True
    )


def test_ledger_module_does_not_import_megatron():
    code = (
        "import sys, megatron_latentmoe.ledger\n"
        "bad = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_k3_bytes_bf16_vs_mxfp4_routed_experts():
    """SPEC §5 deployment: 2.72 T routed params at 4.25 bits ~ 1.45 TB vs 5.44 TB in bf16."""
    led = parameter_ledger(K3_FULL_SCALE)
    routed = led["all_moe_layers"]["routed_expert_params"]
    b16, bmx = led["bytes"]["bf16"], led["bytes"]["mxfp4_routed_experts"]
    assert b16["routed_experts"] == 2 * routed and bmx["routed_experts"] == routed * 17 / 32
    assert (
        round(b16["routed_experts"] / 1e12, 2) == 5.45
        and round(bmx["routed_experts"] / 1e12, 2) == 1.45
    )
    assert b16["routed_experts"] / bmx["routed_experts"] == 64 / 17  # 3.76x
    others = {k: v for k, v in b16.items() if k not in ("routed_experts", "total")}
    assert {k: bmx[k] for k in others} == others  # nothing else is quantized
    assert b16["total"] == 2 * led["totals"]["counted_params"]
    assert "1.45 T" in format_ledger(led) and "3.76x smaller" in format_ledger(led)
    # the bf16 bytes of all but the routed experts; the last total: MXFP4 experts, rest bf16
    lines = format_ledger(led).splitlines()
    (rest,) = [line for line in lines if line.startswith("  everything else")]
    assert (
        rest.endswith(" 41,053,458,432") and 41_053_458_432 == b16["total"] - b16["routed_experts"]
    )
    assert lines[-2].startswith("  total") and lines[-2].endswith(
        " 1,487,509,524,480  3.69x smaller"
    )
