"""The Megatron <-> HF mapping (names.py) and the model-description sources (arch.py).

Pure tensor checks (no Megatron model) plus two checks against the REAL checkpoints of the
workspace: the key rules reproduce exactly the keys Megatron wrote (tensor keys and the
``_extra_state`` object keys, for a non-homogeneous and a homogeneous model).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from megatron_latentmoe.convert import ConversionError, ModelArch
from megatron_latentmoe.convert.arch import (
    ARCH_STATE_KEY,
    arch_common_state,
    arch_from_config_file,
    resolve_arch,
)
from megatron_latentmoe.convert.dist_reader import DistCheckpointReader
from megatron_latentmoe.convert.names import (
    check_shape,
    checkpoint_locations,
    current_key,
    extra_state_key,
    hf_dtype_for,
    is_model_key,
    iter_tensor_maps,
    primary_checkpoint_key,
)

from . import _workers


def small_arch(**kw) -> ModelArch:
    values = dict(
        _workers.TEST_ARCH,
        num_attention_heads=6,
        num_query_groups=3,
        kv_channels=8,
        hidden_size=48,
        vocab_size=96,
    )
    values.update(kw)
    return ModelArch(**values)


def hf_tensor_names(a: ModelArch) -> set[str]:
    """Every HF tensor name the mapping gives the model (what an export contains)."""
    return {name for tm in iter_tensor_maps(a) for name in tm.hf_names}


def rows_of(hf: dict[str, torch.Tensor]):
    """``TensorMap.megatron_rows``'s reader over in-memory HF tensors (the importer's reads
    safetensors row ranges the same way)."""

    def get(name, r0, r1, cols):
        t = hf[name][r0:r1]
        return t[:, cols] if t.dim() > 1 else t[cols]  # (a 1-D tensor is asked for all of it)

    return get


def to_megatron(tm, hf: dict[str, torch.Tensor]) -> torch.Tensor:
    """The full Megatron tensor from its HF tensors, as the importer assembles it."""
    return tm.megatron_rows(rows_of(hf), 0, tm.shape[0])


def test_qkv_is_deinterleaved_per_query_group():
    a = small_arch()
    tm = next(
        t for t in iter_tensor_maps(a) if t.megatron.endswith("0.self_attention.linear_qkv.weight")
    )
    ng, hpg, hd, d = 3, 2, 8, 48
    w = torch.randn(tm.shape)
    hf = tm.to_hf(w)
    grouped = w.view(ng, (hpg + 2) * hd, d)  # Megatron: per group [q heads; k; v]
    assert torch.equal(
        hf["model.layers.0.self_attn.q_proj.weight"], grouped[:, : hpg * hd].reshape(-1, d)
    )
    assert torch.equal(
        hf["model.layers.0.self_attn.k_proj.weight"],
        grouped[:, hpg * hd : (hpg + 1) * hd].reshape(-1, d),
    )
    assert torch.equal(
        hf["model.layers.0.self_attn.v_proj.weight"], grouped[:, (hpg + 1) * hd :].reshape(-1, d)
    )
    assert torch.equal(to_megatron(tm, hf), w)


# the layer layouts the mapping distinguishes: dense first layers (none, one, two), shared experts
# or none, the latent norm or none
LAYOUTS = {
    "main": {},
    "all-moe": dict(first_k_dense_replace=0),
    "two-dense": dict(first_k_dense_replace=2),
    "no-latent-norm": dict(latent_moe_use_norm=False),
    "no-shared": dict(moe_shared_expert_intermediate_size=0),
    "two-query-groups": dict(num_query_groups=2),
}


@pytest.mark.parametrize("kw", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_map_round_trips_and_row_slices_match(kw):
    a = small_arch(**kw)
    g = torch.Generator().manual_seed(0)
    for tm in iter_tensor_maps(a):
        w = torch.randn(tm.shape, generator=g)
        hf = tm.to_hf(w)
        assert tuple(hf) == tm.hf_names and all(tuple(hf[n].shape) == s for n, s in tm.hf)
        assert torch.equal(to_megatron(tm, hf), w), tm.megatron

        rows = tm.shape[0]
        for r0, r1 in ((0, rows), (1, rows - 1), (rows // 3, rows // 3 + 5), (rows - 1, rows)):
            cols = slice(2, 7)  # the columns of a 2-D tensor; a 1-D one ignores them
            want = w[r0:r1][(slice(None), cols)] if len(tm.shape) > 1 else w[r0:r1]
            got = tm.megatron_rows(rows_of(hf), r0, r1, cols)
            assert torch.equal(got, want), (tm.megatron, r0, r1)


def test_gated_fc1_is_gate_then_up():
    a = small_arch()
    tm = next(
        t for t in iter_tensor_maps(a) if t.megatron.endswith("local_experts.3.linear_fc1.weight")
    )
    w = torch.randn(tm.shape)
    hf = tm.to_hf(w)
    assert torch.equal(hf["model.layers.1.block_sparse_moe.experts.3.w1.weight"], w[:32])
    assert torch.equal(hf["model.layers.1.block_sparse_moe.experts.3.w3.weight"], w[32:])


def test_hf_names_follow_spec_section_6():
    names = hf_tensor_names(small_arch())
    moe = "model.layers.1.block_sparse_moe."
    for n in (
        "gate.weight",
        "gate.e_score_correction_bias",
        "routed_expert_down_proj.weight",
        "routed_expert_norm.weight",
        "routed_expert_up_proj.weight",
        "experts.7.w1.weight",
        "experts.7.w3.weight",
        "experts.7.w2.weight",
        "shared_experts.gate_proj.weight",
        "shared_experts.up_proj.weight",
        "shared_experts.down_proj.weight",
    ):
        assert moe + n in names, n
    for n in (
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert n in names, n
    assert not any("block_sparse_moe" in n for n in names if n.startswith("model.layers.0."))
    assert "lm_head.weight" not in hf_tensor_names(small_arch(tie_embeddings=True))


# SPEC §6: the K3 names and shapes of one MoE layer (prefix ``model.layers.{i}.block_sparse_moe.``)
# and of a dense layer's MLP, in the sizes d, l, m_e, n, s = N_s * m_e and f (dense width). The
# K3 peers read these same names under the released multimodal checkpoint's ``language_model.``
# prefix: Megatron-Bridge's KimiK3Bridge.mapping_registry and torchtitan's Kimi K3 state-dict
# adapters (PR 4025 / 4281), MXFP4 experts as ``<name>_packed`` / ``<name>_scale``.
K3_MOE_TENSORS = {
    "gate.weight": ("n", "d"),
    "gate.e_score_correction_bias": ("n",),
    "routed_expert_down_proj.weight": ("l", "d"),
    "routed_expert_norm.weight": ("l",),
    "routed_expert_up_proj.weight": ("d", "l"),
    "experts.{j}.w1.weight": ("m_e", "l"),
    "experts.{j}.w3.weight": ("m_e", "l"),
    "experts.{j}.w2.weight": ("l", "m_e"),
    "shared_experts.gate_proj.weight": ("s", "d"),
    "shared_experts.up_proj.weight": ("s", "d"),
    "shared_experts.down_proj.weight": ("d", "s"),
}
K3_DENSE_MLP_TENSORS = {
    "mlp.gate_proj.weight": ("f", "d"),
    "mlp.up_proj.weight": ("f", "d"),
    "mlp.down_proj.weight": ("d", "f"),
}
K3_CONFIG_KEYS = (
    "hidden_act",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "moe_router_activation_func",
    "moe_renormalize",
    "routed_scaling_factor",
    "topk_method",
    "num_expert_group",
    "num_experts",
    "num_experts_per_token",
    "moe_intermediate_size",
    "num_shared_experts",
    "first_k_dense_replace",
    "intermediate_size",
    "rms_norm_eps",
)
"""SPEC §6's config keys, plus the two every K3 reader also takes from the text config
(``intermediate_size``: the dense layers' width; ``rms_norm_eps``: every RMSNorm's, the latent
one included)."""


@pytest.mark.parametrize("kw", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_export_is_exactly_the_k3_table_and_the_hf_models_state(kw):
    """The converter's HF tensors of every MoE / dense layer are exactly the K3 table's (no key
    missing, none extra, the table's shapes), the HF remote code holds exactly the tensors the
    converter writes (names, shapes; the bias fp32), and its config.json carries SPEC §6's keys
    with the values the Megatron description gives them."""
    from megatron_latentmoe.hf import StableLatentMoEConfig, StableLatentMoEForCausalLM

    a = small_arch(**kw)
    n, s = a.num_experts, a.moe_shared_expert_intermediate_size
    size = dict(d=a.hidden_size, l=a.moe_latent_size, m_e=a.moe_ffn_hidden_size, n=n, s=s)
    size["f"] = a.ffn_hidden_size
    exported = {name: shape for tm in iter_tensor_maps(a) for name, shape in tm.hf}
    for i in range(a.num_layers):
        moe_layer = i >= a.first_k_dense_replace
        prefix = f"model.layers.{i}." + ("block_sparse_moe." if moe_layer else "")
        table = K3_MOE_TENSORS if moe_layer else K3_DENSE_MLP_TENSORS
        want = {}
        for name, dims in table.items():
            if ("routed_expert_norm" in name and not a.latent_moe_use_norm) or (
                "shared_experts" in name and not s
            ):
                continue
            for j in range(n) if "{j}" in name else [None]:
                want[prefix + name.format(j=j)] = tuple(size[x] for x in dims)
        got = {k: v for k, v in exported.items() if k.startswith(prefix)}
        if moe_layer:
            assert got == want, i
        else:
            assert {k: got.get(k) for k in want} == want, i
            assert not any("block_sparse_moe" in k for k in got), i

    cfg = StableLatentMoEConfig(**a.to_hf_config_kwargs())
    state = StableLatentMoEForCausalLM(cfg).bfloat16().state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == exported
    fp32 = {k for k, v in state.items() if v.dtype == torch.float32}
    assert fp32 == {k for k in exported if k.endswith("gate.e_score_correction_bias")}
    config = cfg.to_dict()
    assert {k: config.get(k) for k in K3_CONFIG_KEYS} == {
        "hidden_act": "situ",
        "activation_situ_beta": a.activation_situ_beta,
        "activation_situ_linear_beta": a.activation_situ_linear_beta,
        "routed_expert_hidden_size": a.moe_latent_size,
        "latent_moe_use_norm": a.latent_moe_use_norm,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "num_expert_group": 1,
        "num_experts": n,
        "num_experts_per_token": a.moe_router_topk,
        "moe_intermediate_size": a.moe_ffn_hidden_size,
        "num_shared_experts": s // a.moe_ffn_hidden_size,
        "first_k_dense_replace": a.first_k_dense_replace,
        "intermediate_size": a.ffn_hidden_size,
        "rms_norm_eps": a.layernorm_epsilon,
    }


def test_mxfp4_expert_names_are_the_k3_release_layout():
    """An MXFP4 routed expert linear ``...w1.weight`` [out, in] becomes ``...w1.weight_packed``
    uint8 [out, in / 2] and ``...w1.weight_scale`` [out, in / 32]: the names the K3 release uses
    and Megatron-Bridge / torchtitan look up (``<dense name>_packed`` / ``_scale``)."""
    from megatron_latentmoe.convert import mxfp4

    name = "model.layers.1.block_sparse_moe.experts.7.w2.weight"
    assert mxfp4.packed_shapes(name, (64, 96)) == [
        (name + "_packed", (64, 48)),
        (name + "_scale", (64, 3)),
    ]
    packed = mxfp4.pack(name, torch.randn(64, 96))
    assert {k: v.dtype for k, v in packed.items()} == {
        name + "_packed": torch.uint8,
        name + "_scale": torch.uint8,
    }


@pytest.mark.slow
@pytest.mark.parametrize("ckpt,kind", [("ck_single", "main"), ("ck_homog", "homogeneous")])
def test_key_rules_reproduce_megatrons_keys(workspace, ckpt, kind):
    """Tensor keys, global shapes and _extra_state object keys == what Megatron wrote."""
    a = _workers.arch(kind)
    r = DistCheckpointReader(workspace.path(ckpt))
    want_tensors, want_objects = {}, set()
    for tm in iter_tensor_maps(a):
        key, lead, shape = primary_checkpoint_key(tm, a)
        want_tensors[key] = shape
        if extra_state_key(tm, a):
            want_objects.add(extra_state_key(tm, a))
    assert {k: tuple(md.size) for k, md in r.tensors.items()} == want_tensors
    assert set(r.byte_objects) - {"common_state/shard_0_1"} == want_objects


def test_megatron_names_of_each_layer_kind_both_ways():
    """Each canonical Megatron tensor of a dense and of an MoE layer, in model order, with the HF
    tensor(s) it is made of (the slow test above checks these names against Megatron's
    checkpoints), for every layout: dense first layers or none, the latent norm, shared experts."""
    for kw in LAYOUTS.values():
        a = small_arch(**kw)
        maps = list(iter_tensor_maps(a))
        got = [(tm.megatron, tm.hf_names) for tm in maps]
        want = [("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
        for i in range(a.num_layers):
            mg, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
            want += [
                (mg + "input_layernorm.weight", (hf + "input_layernorm.weight",)),
                (
                    mg + "self_attention.linear_qkv.weight",
                    tuple(f"{hf}self_attn.{p}_proj.weight" for p in "qkv"),
                ),
                (mg + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",)),
                (mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)),
            ]
            if i < a.first_k_dense_replace:
                want += [
                    (
                        mg + "mlp.linear_fc1.weight",
                        (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                    ),
                    (mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",)),
                ]
                continue
            moe = hf + "block_sparse_moe."
            want += [
                (mg + "mlp.router.weight", (moe + "gate.weight",)),
                (mg + "mlp.router.expert_bias", (moe + "gate.e_score_correction_bias",)),
            ]
            for j in range(a.num_experts):
                e, h = f"{mg}mlp.experts.local_experts.{j}.", f"{moe}experts.{j}."
                want += [
                    (e + "linear_fc1.weight", (h + "w1.weight", h + "w3.weight")),
                    (e + "linear_fc2.weight", (h + "w2.weight",)),
                ]
            if a.moe_shared_expert_intermediate_size:
                sh = moe + "shared_experts."
                want += [
                    (
                        mg + "mlp.shared_experts.linear_fc1.weight",
                        (sh + "gate_proj.weight", sh + "up_proj.weight"),
                    ),
                    (mg + "mlp.shared_experts.linear_fc2.weight", (sh + "down_proj.weight",)),
                ]
            want.append(
                (mg + "mlp.fc1_latent_proj.weight", (moe + "routed_expert_down_proj.weight",))
            )
            if a.latent_moe_use_norm:
                want.append(
                    (mg + "mlp.routed_expert_norm.weight", (moe + "routed_expert_norm.weight",))
                )
            want.append(
                (mg + "mlp.fc2_latent_proj.weight", (moe + "routed_expert_up_proj.weight",))
            )
        want += [
            ("decoder.final_layernorm.weight", ("model.norm.weight",)),
            ("output_layer.weight", ("lm_head.weight",)),
        ]
        assert got == want, kw
        # and what each map carries besides its names
        for tm in maps:
            name = tm.megatron
            expert = re.search(r"local_experts\.(\d+)\.", name)
            assert tm.expert == (int(expert.group(1)) if expert else None), name
            assert tm.kind == (
                "qkv"
                if name.endswith("linear_qkv.weight")
                else "glu"
                if name.endswith("linear_fc1.weight")
                else "copy"
            ), name
            assert tm.fp32 == name.endswith("router.expert_bias"), name
            assert hf_dtype_for(tm, torch.bfloat16) == (
                torch.float32 if tm.fp32 else torch.bfloat16
            ), name
            assert not tm.zeros, name  # QB: every router has its bias
            assert tm.numel() == sum(math.prod(shape) for _, shape in tm.hf), name
            assert tm.extra_state == name.endswith(
                (
                    "linear_qkv.weight",
                    "linear_proj.weight",
                    "linear_fc1.weight",
                    "linear_fc2.weight",
                )
            ), name


@pytest.mark.parametrize("dense", [1, 0], ids=["per-layer-keys", "stacked-layers"])
def test_primary_checkpoint_and_extra_state_keys(dense):
    """The keys Megatron's local spec writes (the slow test above checks the rule on REAL
    checkpoints): per-layer keys with a dense first layer, one key stacked on a leading layer axis
    [L, ...] when every layer is MoE; routed experts on an expert axis [n, ...]; the fused norms
    under the TE names; an ``_extra_state`` object named by its leading indices and their sizes."""
    a = small_arch(first_k_dense_replace=dense)
    maps = {tm.megatron: tm for tm in iter_tensor_maps(a)}

    def keys(name):
        tm = maps[name]
        return (*primary_checkpoint_key(tm, a), extra_state_key(tm, a))

    L = "decoder.layers."
    fc1 = f"{L}1.mlp.experts.local_experts.2.linear_fc1.weight"
    proj = f"{L}3.self_attention.linear_proj.weight"
    norm = f"{L}0.pre_mlp_layernorm.weight"
    if dense:
        assert keys(fc1) == (
            f"{L}1.mlp.experts.experts.linear_fc1.weight",
            (2,),
            (8, 64, 32),
            f"{L}1.mlp.experts.experts.linear_fc1._extra_state/shard_2_8",
        )
        assert keys(proj) == (
            proj,
            (),
            (48, 48),
            f"{L}3.self_attention.linear_proj._extra_state/shard_0_1",
        )
        assert keys(norm) == (f"{L}0.mlp.linear_fc1.layer_norm_weight", (), (48,), None)
    else:
        assert keys(fc1) == (
            f"{L}mlp.experts.experts.linear_fc1.weight",
            (1, 2),
            (4, 8, 64, 32),
            f"{L}mlp.experts.experts.linear_fc1._extra_state/shard_1.2_4.8",
        )
        assert keys(proj) == (
            f"{L}self_attention.linear_proj.weight",
            (3,),
            (4, 48, 48),
            f"{L}self_attention.linear_proj._extra_state/shard_3_4",
        )
        assert keys(norm) == (f"{L}pre_mlp_layernorm.weight", (0,), (4, 48), None)  # MoE layer
    assert keys(f"{L}2.input_layernorm.weight")[:3] == (
        (f"{L}2.self_attention.linear_qkv.layer_norm_weight", (), (48,))
        if dense
        else (f"{L}self_attention.linear_qkv.layer_norm_weight", (2,), (4, 48))
    )
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert keys(name) == (name, (), (96, 48), None)


def test_checkpoint_locations_cover_every_layout():
    """Where the reader looks for a tensor, in order: the per-layer key, the stacked-layers key,
    then (routed experts) the ``singleton_local_shards`` per-expert keys, and (gated fc1) their
    ``_w`` / ``_v`` halves."""
    maps = {tm.megatron: tm for tm in iter_tensor_maps(small_arch())}

    def locations(name):
        return [loc.parts for loc in checkpoint_locations(maps[name])]

    L, E = "decoder.layers.", "mlp.experts.experts."
    assert locations(f"{L}1.mlp.experts.local_experts.2.linear_fc1.weight") == [
        (((f"{L}1.{E}linear_fc1.weight"), (2,)),),
        (((f"{L}{E}linear_fc1.weight"), (1, 2)),),
        (((f"{L}1.{E}2.linear_fc1.weight"), ()),),
        (((f"{L}{E}2.linear_fc1.weight"), (1,)),),
        ((f"{L}1.{E}2.linear_fc1.weight_w", ()), (f"{L}1.{E}2.linear_fc1.weight_v", ())),
        ((f"{L}{E}2.linear_fc1.weight_w", (1,)), (f"{L}{E}2.linear_fc1.weight_v", (1,))),
    ]
    assert locations(f"{L}3.mlp.experts.local_experts.7.linear_fc2.weight") == [
        (((f"{L}3.{E}linear_fc2.weight"), (7,)),),
        (((f"{L}{E}linear_fc2.weight"), (3, 7)),),
        (((f"{L}3.{E}7.linear_fc2.weight"), ()),),
        (((f"{L}{E}7.linear_fc2.weight"), (3,)),),
    ]
    assert locations(f"{L}0.mlp.linear_fc1.weight") == [
        ((f"{L}0.mlp.linear_fc1.weight", ()),),
        ((f"{L}mlp.linear_fc1.weight", (0,)),),
        ((f"{L}0.mlp.linear_fc1.weight_w", ()), (f"{L}0.mlp.linear_fc1.weight_v", ())),
        ((f"{L}mlp.linear_fc1.weight_w", (0,)), (f"{L}mlp.linear_fc1.weight_v", (0,))),
    ]
    norm = "self_attention.linear_qkv.layer_norm_weight"  # input_layernorm, under its TE name
    assert locations(f"{L}2.input_layernorm.weight") == [
        ((f"{L}2.{norm}", ()),),
        ((f"{L}{norm}", (2,)),),
    ]
    assert locations("embedding.word_embeddings.weight") == [
        (("embedding.word_embeddings.weight", ()),)
    ]
    assert checkpoint_locations(maps["output_layer.weight"])[0].keys == ("output_layer.weight",)


def test_model_keys_old_norm_names_and_shape_errors():
    for key in (
        "embedding.word_embeddings.weight",
        "decoder.layers.1.mlp.router.weight",
        "output_layer.weight",
        "mtp.layers.0.enorm.weight",
    ):
        assert is_model_key(key), key
    for key in (
        "optimizer.state.exp_avg.decoder.layers.1.mlp.router.weight",
        "decoder.layers.1.mlp.linear_fc1._extra_state/shard_0_1",
        "decoder.layers.1.mlp.linear_fc1._extra_state",
        "decoder.layers.1.mlp.router.state/shard_0_1",  # a ShardedObject's key
        "decoder.layers.1.mlp.router.qb_mean_input",
        "rng_state",
    ):
        assert not is_model_key(key), key
    # checkpoints written before the latent norm was renamed still read
    assert current_key("decoder.layers.1.mlp.latent_norm.weight") == (
        "decoder.layers.1.mlp.routed_expert_norm.weight"
    )
    assert current_key("decoder.layers.mlp.latent_norm.weight") == (
        "decoder.layers.mlp.routed_expert_norm.weight"
    )
    assert current_key("decoder.layers.1.mlp.router.weight") == "decoder.layers.1.mlp.router.weight"
    tm = next(iter_tensor_maps(small_arch()))
    with pytest.raises(ConversionError) as info:
        tm.to_hf(torch.zeros(96, 47))
    assert str(info.value) == (
        "tensor 'embedding.word_embeddings.weight' shape=(96, 47) is not allowed: (96, 48), what "
        "the model config implies"
    )
    with pytest.raises(ConversionError, match=r"^a\.safetensors: tensor 'x' shape=\(2, 1\) is not"):
        check_shape("x", (2, 1), (1, 2), "a.safetensors")
    check_shape("x", [1, 2], (1, 2))  # a list is the same shape


# ------------------------------------------------------------------------------------ arch sources
def test_arch_round_trips_through_hf_config_and_megatron_args():
    for kind in ("main", "homogeneous"):
        a = _workers.arch(kind)
        assert (
            ModelArch.from_hf_config(dict(model_type="stable_latentmoe", **a.to_hf_config_kwargs()))
            == a
        )
        assert ModelArch.from_megatron_args(a.megatron_args_namespace()) == a
        assert ModelArch.from_dict(a.to_dict()) == a


def test_expert_bias_map_follows_the_balancer():
    """QB and the sign update store router.expert_bias; a router with neither (an aux loss alone,
    ``none``) has none, and its HF bias is written as zeros (``zeros`` maps)."""

    def zeros(**kw):
        maps = [t for t in iter_tensor_maps(small_arch(**kw)) if t.megatron.endswith("expert_bias")]
        assert len(maps) == 3  # the MoE layers 1-3
        return {t.zeros for t in maps}

    assert zeros() == {False}  # quantile_histogram
    assert zeros(moe_router_load_balancing_type="aux_loss") == {True}
    assert zeros(moe_router_load_balancing_type="none") == {True}
    sign = dict(moe_router_load_balancing_type="none", moe_router_enable_expert_bias=True)
    assert zeros(**sign) == {False}
    assert ModelArch.from_megatron_args(small_arch(**sign).megatron_args_namespace()) == small_arch(
        **sign
    )
    with pytest.raises(ConversionError, match="moe_router_enable_expert_bias=True"):
        small_arch(moe_router_enable_expert_bias=True)  # with QB


def test_megatron_args_without_our_fields_are_refused():
    ns = _workers.arch().megatron_args_namespace()
    del ns.hidden_act
    with pytest.raises(ConversionError, match=r"\['hidden_act'\].*--megatron-config"):
        ModelArch.from_megatron_args(ns)
    ns = _workers.arch().megatron_args_namespace()
    ns.qk_layernorm = True
    with pytest.raises(ConversionError, match="qk_layernorm=True"):
        ModelArch.from_megatron_args(ns)


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("moe_shared_expert_gate", True, "False (the HF model's shared experts have no gate)"),
        (
            "moe_router_force_load_balancing",
            True,
            "False (benchmark-only random routing; the HF model routes by the router's scores)",
        ),
        (
            "moe_router_force_biased",
            0.5,
            "None (benchmark-only biased random routing; the HF model routes by the router's "
            "scores)",
        ),
    ],
)
def test_megatron_options_the_hf_model_lacks_are_refused_by_name(name, value, allowed):
    """A shared-expert gate was refused only later, as three unexpected gate_weight tensors; a
    run routed at random was exported as if routed by its scores."""
    ns = _workers.arch().megatron_args_namespace()
    setattr(ns, name, value)
    with pytest.raises(ConversionError) as err:
        ModelArch.from_megatron_args(ns)
    assert str(err.value) == f"checkpoint args: {name}={value!r} is not allowed: {allowed}"


def test_an_activation_the_hf_model_lacks_is_refused_by_name(tmp_path):
    """Megatron's GLU clamp / offset, which a hidden_act=swiglu run trains with, and a config
    file's activation_func other than silu: the HF model computes silu(gate) * up (or
    SiTU-GLU) alone, and each was exported as that model, silently. The args' hidden_act is
    the activation a run of ours trained (--swiglu is always set, other activations refused)."""
    swiglu = dict(_workers.TEST_ARCH, hidden_act="swiglu")
    for name, value, allowed in (
        ("glu_linear_offset", 1.0, "0.0 (the HF model's SwiGLU adds no offset to its up branch)"),
        ("activation_func_clamp_value", 7.0, "None (the HF model's SwiGLU clamps neither branch)"),
    ):
        ns = ModelArch(**swiglu).megatron_args_namespace()
        assert ModelArch.from_megatron_args(ns).hidden_act == "swiglu"
        setattr(ns, name, value)
        with pytest.raises(ConversionError) as err:
            ModelArch.from_megatron_args(ns)
        assert str(err.value) == f"checkpoint args: {name}={value!r} is not allowed: {allowed}"
    path = tmp_path / "c.json"
    for act in ("silu", "gelu"):
        path.write_text(json.dumps(dict(_workers.MEGATRON_CFG, activation_func=act)))
        if act == "silu":
            assert arch_from_config_file(path) == _workers.arch()
            continue
        with pytest.raises(ConversionError) as err:
            arch_from_config_file(path)
        assert str(err.value) == (
            f"config file {str(path)!r}: activation_func='gelu' is not allowed: F.silu, the "
            "default: hidden_act chooses the activation ('situ' or 'swiglu')"
        )


def test_dense_first_layers_given_by_moe_layer_freq(tmp_path):
    """Megatron's own way to make the first k layers dense, ``--moe-layer-freq
    "([0]*k+[1]*rest)"`` (first_k_dense_replace left at 0), builds the same model as
    ``first_k_dense_replace=k``: the converter reads it as that model, from the training args and
    from a config file. Patterns the HF model cannot express stay refused."""
    a = _workers.arch()  # layer 0 dense, layers 1-3 MoE
    ns = a.megatron_args_namespace()
    ns.first_k_dense_replace, ns.moe_layer_freq = 0, [0, 1, 1, 1]
    assert ModelArch.from_megatron_args(ns) == a
    cfg = {k: v for k, v in _workers.MEGATRON_CFG.items() if k != "first_k_dense_replace"}
    (tmp_path / "c.json").write_text(json.dumps(dict(cfg, moe_layer_freq=[0, 1, 1, 1])))
    assert arch_from_config_file(tmp_path / "c.json") == a
    ns.moe_layer_freq = [0, 0, 1, 1]
    assert ModelArch.from_megatron_args(ns) == ModelArch(
        **dict(_workers.TEST_ARCH, first_k_dense_replace=2)
    )
    for freq, k in (([1, 0, 1, 1], 0), ([0, 1, 0, 1], 0), (2, 0), ([0, 0, 1, 1], 1), ([0] * 4, 0)):
        ns.moe_layer_freq, ns.first_k_dense_replace = freq, k
        with pytest.raises(ConversionError, match=r"moe_layer_freq=.* is not allowed"):
            ModelArch.from_megatron_args(ns)


def test_megatron_config_file(tmp_path):
    a = _workers.arch()
    cfg = _workers.MEGATRON_CFG
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    assert arch_from_config_file(tmp_path / "c.json") == a
    (tmp_path / "c.yaml").write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in cfg.items()))
    assert arch_from_config_file(tmp_path / "c.yaml") == a
    for bad, match in (
        (dict(cfg, hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(cfg, colour="blue"), r"unknown field\(s\) \['colour'\]"),
        ({k: v for k, v in cfg.items() if k != "vocab_size"}, "missing 'vocab_size'"),
        (
            dict(cfg, moe_shared_expert_intermediate_size=48),
            "moe_shared_expert_intermediate_size=48",
        ),
    ):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ConversionError, match=match):
            arch_from_config_file(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConversionError, match="not valid JSON"):
        arch_from_config_file(tmp_path / "broken.json")


NO_DESCRIPTION = (
    "ck: the checkpoint carries no model description (no 'args' saved by megatron.training, no "
    "'stable_latentmoe_config'); pass --megatron-config FILE (JSON/YAML of Megatron config fields "
    "+ vocab_size/max_sequence_length, or an HF config.json)"
)


def test_resolve_arch_first_match_wins_and_names_the_source(tmp_path):
    """A config file, else the converter's own common-state key, else megatron.training's args;
    nothing: one error saying what to pass. Each source's refusal names it."""
    main, homog = _workers.arch(), _workers.arch("homogeneous")
    both = {ARCH_STATE_KEY: homog.to_dict(), "args": main.megatron_args_namespace()}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="stable_latentmoe", **main.to_hf_config_kwargs())))
    assert resolve_arch({ARCH_STATE_KEY: homog.to_dict()}, str(path), checkpoint="ck") == (
        main,
        f"config file {path}",
    )
    assert resolve_arch(both, checkpoint="ck") == (
        homog,
        "checkpoint common state (stable_latentmoe_config)",
    )
    assert resolve_arch({"args": main.megatron_args_namespace()}) == (
        main,
        "checkpoint common state (megatron.training args)",
    )
    for state in (None, {}, {"args": None}, {"optimizer": {}}):
        with pytest.raises(ConversionError) as info:
            resolve_arch(state, checkpoint="ck")
        assert str(info.value) == NO_DESCRIPTION, state
    with pytest.raises(ConversionError) as info:
        resolve_arch({})
    assert str(info.value) == "checkpoint" + NO_DESCRIPTION.removeprefix("ck")
    # each reader names its source by default
    with pytest.raises(ConversionError, match=r"^stable_latentmoe_config: unknown field\(s\)"):
        ModelArch.from_dict(dict(main.to_dict(), colour="blue"))
    hf = dict(model_type="llama", **main.to_hf_config_kwargs())
    with pytest.raises(ConversionError, match=r"^config\.json: model_type='llama' is not allowed"):
        ModelArch.from_hf_config(hf)
    ns = main.megatron_args_namespace()
    ns.qk_layernorm = True
    with pytest.raises(
        ConversionError, match=r"^checkpoint args: qk_layernorm=True is not allowed"
    ):
        ModelArch.from_megatron_args(ns)
    refusals = (
        (
            {ARCH_STATE_KEY: dict(main.to_dict(), colour="blue")},
            r"^ck: stable_latentmoe_config: unknown field\(s\) \['colour'\]; known: "
            r"\['activation_situ_beta', ",
        ),
        (
            {ARCH_STATE_KEY: {k: v for k, v in main.to_dict().items() if k != "hidden_size"}},
            r"^ck: stable_latentmoe_config: .*missing 1 required .*'hidden_size'$",
        ),
        (
            {ARCH_STATE_KEY: dict(main.to_dict(), hidden_size=0)},
            r"^ck: stable_latentmoe_config: hidden_size=0 is not allowed: a positive integer$",
        ),
    )
    for state, match in refusals:
        with pytest.raises(ConversionError, match=match):
            resolve_arch(state, checkpoint="ck")
    # what arch_common_state adds to a checkpoint is read back
    assert resolve_arch(arch_common_state(homog)) == (
        homog,
        "checkpoint common state (stable_latentmoe_config)",
    )
    # an old name in a stored description still reads
    old = dict(homog.to_dict())
    old["routed_scaling_factor"] = old.pop("moe_router_topk_scaling_factor")
    assert resolve_arch({ARCH_STATE_KEY: old})[0] == homog


def test_config_file_refusals(tmp_path):
    def refusal(name, text):
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(ConversionError) as info:
            arch_from_config_file(path)
        return str(info.value).replace(str(tmp_path), "T")

    assert refusal("none.json", None) == "config file 'T/none.json' does not exist or is not a file"
    (tmp_path / "dir.json").mkdir()
    assert refusal("dir.json", None) == "config file 'T/dir.json' does not exist or is not a file"
    assert refusal("list.json", "[1, 2]") == (
        "config file 'T/list.json': expected a mapping at top level, got list"
    )
    assert refusal("bad.yaml", "a: [1").startswith("config file 'T/bad.yaml' is not valid YAML: ")
    assert refusal("bad.json", "{not json").startswith(
        "config file 'T/bad.json' is not valid JSON: Expecting property name"
    )
    hf = dict(model_type="stable_latentmoe", **_workers.arch().to_hf_config_kwargs())
    assert refusal("llama.json", json.dumps(dict(hf, model_type="llama"))) == (
        "config file 'T/llama.json': model_type='llama' is not allowed: 'stable_latentmoe'"
    )
    assert refusal("topk.json", json.dumps(dict(hf, topk_method="greedy"))) == (
        "config file 'T/topk.json': topk_method='greedy' is not allowed: 'noaux_tc' (the only "
        "routing Megatron's model implements)"
    )
    cfg = {k: v for k, v in _workers.MEGATRON_CFG.items() if k != "max_sequence_length"}
    assert refusal("no_len.json", json.dumps(cfg)) == (
        "config file 'T/no_len.json': missing 'max_sequence_length' (a build_gpt_model argument)"
    )
    # a head_dim other than hidden_size / num_attention_heads is read; without one, that quotient
    narrow = ModelArch(**dict(_workers.TEST_ARCH, kv_channels=8))
    assert (
        ModelArch.from_hf_config(
            dict(model_type="stable_latentmoe", **narrow.to_hf_config_kwargs())
        )
        == narrow
    )
    del hf["head_dim"]
    assert ModelArch.from_hf_config(hf) == _workers.arch()


# Megatron settings the HF model does not implement: (field, a refused value, what is allowed)
MEGATRON_ONLY_VALUES = (
    ("qk_layernorm", True, "False (the HF model has no q/k norms)"),
    ("add_bias_linear", True, "False (bias-free linears)"),
    ("add_qkv_bias", True, "False"),
    ("normalization", "LayerNorm", "'RMSNorm' (SPEC §1)"),
    ("rotary_interleaved", True, "False (rotate-half RoPE)"),
    ("rotary_percent", 0.5, "1.0"),
    ("position_embedding_type", "learned_absolute", "'rope'"),
    ("apply_residual_connection_post_layernorm", True, "False"),
    ("layernorm_zero_centered_gamma", True, "False (plain RMSNorm weights, SPEC §1)"),
    ("moe_router_score_function", "softmax", "'sigmoid' (SPEC §3)"),
    ("moe_router_num_groups", 2, "None or 1 (no group-limited routing, SPEC §3)"),
    ("multi_latent_attention", True, "False (GQA attention only)"),
    ("gated_linear_unit", False, "True (SiTU-GLU and SwiGLU, hidden_act, are gated)"),
)


def test_megatron_side_refusals_and_fallbacks():
    cfg = _workers.MEGATRON_CFG

    def refusal(**change):
        with pytest.raises(ConversionError) as info:
            ModelArch.from_megatron_config(dict(cfg, **change), cfg)
        return str(info.value)

    for key, value, allowed in MEGATRON_ONLY_VALUES:
        assert refusal(**{key: value}) == (
            f"Megatron config: {key}={value!r} is not allowed: {allowed}"
        )
    for value in (None, 0):  # 0 is refused like None, with the same words
        assert refusal(num_moe_experts=value) == (
            f"Megatron config: num_moe_experts={value} is not allowed: a positive integer (a "
            "Stable LatentMoE model)"
        )
        # QB as a drop-in for a Megatron MoE (its softmax router refused too): named for the
        # latent, the cause (it was named for the router, and then for the latent once fixed)
        for drop_in in ({}, dict(moe_router_score_function="softmax")):
            assert refusal(moe_latent_size=value, **drop_in) == (
                f"Megatron config: moe_latent_size={value} is not allowed: a positive integer "
                "(the HF model is the Stable LatentMoE block, its routed experts in a latent of "
                "this width); unset, the MoE layers are Megatron's MoELayer (QB as a drop-in), "
                "which the HF model does not implement"
            )
    # an int moe_layer_freq is Megatron's "layer i is MoE when i % freq == 0": 4 on 4 layers
    # makes only layer 0 MoE
    assert refusal(moe_layer_freq=4, first_k_dense_replace=0) == (
        "Megatron config: moe_layer_freq=4 is not allowed: 1 or [0] * k + [1] * (4 - k) "
        "(num_layers=4): only the first layers may be dense, as in the HF model"
    )
    assert refusal(moe_layer_freq=[0, 1, 0, 1], first_k_dense_replace=0) == (
        "Megatron config: moe_layer_freq=[0, 1, 0, 1] is not allowed: 1 or [0] * k + [1] * "
        "(4 - k) (num_layers=4): only the first layers may be dense, as in the HF model"
    )
    assert refusal(moe_layer_freq=[0, 0, 1, 1]) == (
        "Megatron config: moe_layer_freq=[0, 0, 1, 1] is not allowed: 1 or [0, 1, 1, 1] "
        "(first_k_dense_replace=1): only the first layers may be dense, as in the HF model"
    )
    assert refusal(kv_channels=15) == (
        "Megatron config: kv_channels=15 is not allowed: an even head dim (RoPE)"
    )
    # QB wins a list of balancers (aux losses beside it); otherwise the first
    a = _workers.arch()
    ns = a.megatron_args_namespace()
    ns.moe_router_load_balancing_type = ["aux_loss", "quantile_histogram"]
    assert ModelArch.from_megatron_args(ns) == a
    ns.moe_router_load_balancing_type = ["aux_loss", "seq_aux_loss"]
    assert ModelArch.from_megatron_args(ns) == _workers.arch("no_bias")
    # megatron.training's args: vocab_size / seq_length when the padded / position ones are absent
    ns = a.megatron_args_namespace()
    ns.vocab_size, ns.seq_length = ns.padded_vocab_size, ns.max_position_embeddings
    del ns.padded_vocab_size, ns.max_position_embeddings
    assert ModelArch.from_megatron_args(ns) == a
    del ns.untie_embeddings_and_output_weights  # Megatron's default: tied
    assert ModelArch.from_megatron_args(ns) == ModelArch(
        **dict(_workers.TEST_ARCH, tie_embeddings=True)
    )
    ns = a.megatron_args_namespace()
    ns.group_query_attention = False  # num_query_groups is then ignored: one group per head
    assert ModelArch.from_megatron_args(ns).num_query_groups == a.num_attention_heads
    # the args an import stores say the one value of each
    ns = a.megatron_args_namespace()
    assert {k: getattr(ns, k) for k, *_ in MEGATRON_ONLY_VALUES} == dict(
        qk_layernorm=False,
        add_bias_linear=False,
        add_qkv_bias=False,
        normalization="RMSNorm",
        rotary_interleaved=False,
        rotary_percent=1.0,
        position_embedding_type="rope",
        apply_residual_connection_post_layernorm=False,
        layernorm_zero_centered_gamma=False,
        moe_router_score_function="sigmoid",
        moe_router_num_groups=1,
        multi_latent_attention=False,
        gated_linear_unit=True,
    )
    for freq in (1, None):  # every layer MoE unless first_k_dense_replace says otherwise
        ns = a.megatron_args_namespace()
        ns.moe_layer_freq = freq
        assert ModelArch.from_megatron_args(ns) == a


def test_megatron_values_the_converter_passes_on(tmp_path):
    """The args an import stores say GQA only when the groups differ from the heads; the builder
    keywords carry the RoPE base; an aux-loss model verifies without its aux loss; a ``.yml``
    file is YAML."""
    cfg = _workers.MEGATRON_CFG
    assert small_arch().megatron_args_namespace().group_query_attention is True  # 3 groups
    assert small_arch(num_query_groups=6).megatron_args_namespace().group_query_attention is False
    assert small_arch(rotary_base=5e5).builder_kwargs() == dict(
        vocab_size=96, max_sequence_length=256, rotary_base=5e5,
        share_embeddings_and_output_weights=False,
    )  # fmt: skip
    aux = _workers.arch("no_bias")
    assert aux.moe_router_load_balancing_type == "aux_loss"
    assert aux.to_megatron_config().moe_router_load_balancing_type == "none"
    assert _workers.arch().to_megatron_config().moe_router_load_balancing_type == (
        "quantile_histogram"
    )
    (tmp_path / "c.yml").write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in cfg.items()))
    assert arch_from_config_file(tmp_path / "c.yml") == _workers.arch()


def test_attention_shapes_when_heads_times_head_dim_is_not_hidden_size():
    """K3's attention is wider than d (64 heads x 128 > 7168): o_proj is [d, heads * head_dim],
    q/k/v follow the head dim, not d / heads (every other test model has heads x hd == d)."""
    a = small_arch(kv_channels=10)  # 6 heads x 10 = 60, d = 48, 3 query groups
    shapes = {name: shape for tm in iter_tensor_maps(a) for name, shape in tm.hf}
    attn = "model.layers.0.self_attn."
    assert {k.removeprefix(attn): v for k, v in shapes.items() if k.startswith(attn)} == {
        "q_proj.weight": (60, 48),
        "k_proj.weight": (30, 48),
        "v_proj.weight": (30, 48),
        "o_proj.weight": (48, 60),
    }
