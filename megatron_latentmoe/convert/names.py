"""THE Megatron <-> Hugging Face name and layout mapping of a Stable LatentMoE GPT.

Three name spaces meet here:

* **canonical Megatron names**: the names of ``build_gpt_model(config).state_dict()`` for the
  local spec on ONE process (TP = EP = PP = 1):
  ``decoder.layers.{i}.self_attention.linear_qkv.weight``,
  ``decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight`` (j global), ... Every
  tensor here is a full (global) tensor.
* **checkpoint keys**: the ``ShardedTensor`` keys of a ``torch_dist`` checkpoint. They are
  independent of TP / EP / PP / DP (sharding only adds chunks), but depend on

  - homogeneous vs not: when every layer has the same structure (``first_k_dense_replace=0``)
    Megatron stacks the layers on a leading axis (key ``decoder.layers.<rest>``, shape [L, ...]);
    otherwise each layer has its own key ``decoder.layers.{i}.<rest>``;
  - routed experts are stacked on an expert axis (``mlp.experts.experts.linear_fc1.weight``,
    [n, 2 m_e, l]) -- ``singleton_local_shards`` checkpoints use ``experts.experts.{j}.`` keys and
    store gated fc1 halves as ``..._w`` / ``..._v``;
  - the layer kind, for the norms: both of our specs save them under the Transformer Engine
    spec's names (the local one maps them, ``specs.py``): ``input_layernorm.weight`` as
    ``self_attention.linear_qkv.layer_norm_weight``, a dense layer's ``pre_mlp_layernorm.weight``
    as ``mlp.linear_fc1.layer_norm_weight``, while an MoE layer's stays ``pre_mlp_layernorm.weight``
    (a separate norm in TE too). ``TensorMap.checkpoint_name`` holds the renamed ones.
* **HF names** (SPEC §6): Llama-style attention and norms, ``mlp.{gate,up,down}_proj`` for dense
  layers, ``block_sparse_moe.*`` (Kimi names) for MoE layers.

Layout transforms are all row (dim-0) re-orderings, described by ``Segment`` lists:

* ``linear_qkv`` [(nh + 2 ng) * hd, d] is interleaved PER QUERY GROUP: for g in groups,
  [q heads of g (nh/ng * hd rows); k_g (hd); v_g (hd)] -> ``q_proj``, ``k_proj``, ``v_proj``;
* gated fc1 (dense MLP, shared experts, each routed expert) is [gate; up] stacked ->
  ``gate_proj``/``up_proj`` (``w1``/``w3`` for routed experts);
* everything else is a copy. ``e_score_correction_bias`` (Megatron ``router.expert_bias``) is
  always fp32. A router trained without an expert bias (an aux loss alone, or ``none``) has no
  such tensor; its map is marked ``zeros`` and the HF bias is 0 (the same top-k).

``iter_tensor_maps(arch)`` yields one ``TensorMap`` per canonical Megatron tensor, in model order;
tests and all converter directions use it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from megatron_latentmoe.fields import not_allowed
from megatron_latentmoe.moe.checkpoint_names import LEGACY_NORM_NAME, NORM_NAME

from .arch import ModelArch
from .errors import ConversionError


def current_key(key: str) -> str:
    """A checkpoint key under today's names (old checkpoints say ``mlp.latent_norm.``)."""
    return key.replace(f"mlp.{LEGACY_NORM_NAME}.", f"mlp.{NORM_NAME}.")


# ------------------------------------------------------------------------------------ data types


@dataclass(frozen=True)
class Segment:
    """Rows [mg_start, mg_start + rows) of the Megatron tensor are rows
    [hf_start, hf_start + rows) of HF tensor ``hf``."""

    hf: str
    hf_start: int
    rows: int
    mg_start: int


@dataclass(frozen=True)
class TensorMap:
    """One canonical Megatron tensor and the HF tensor(s) it is made of."""

    megatron: str
    shape: tuple[int, ...]
    hf: tuple[tuple[str, tuple[int, ...]], ...]
    segments: tuple[Segment, ...]
    kind: str = "copy"  # "copy" | "glu" | "qkv"
    fp32: bool = False  # always stored in fp32 (the QB / expert bias)
    expert: int | None = None  # a routed expert's index
    extra_state: bool = False  # the Megatron module has an ``_extra_state`` (ShardedObject)
    checkpoint_name: str | None = None  # saved under this name, not ``megatron`` (fused norms)
    zeros: bool = False  # no Megatron tensor (a router without expert bias): the HF one is 0

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.hf)

    def numel(self) -> int:
        return math.prod(self.shape)

    # --------------------------------------------------------------------- conversions
    def to_hf(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Full Megatron tensor -> {HF name: tensor} (views where possible)."""
        check_shape(self.megatron, tuple(tensor.shape), self.shape)
        if self.kind == "copy":
            return {self.hf[0][0]: tensor}
        out = {}
        for name, shape in self.hf:
            parts = sorted((s for s in self.segments if s.hf == name), key=lambda s: s.hf_start)
            pieces = [tensor[s.mg_start : s.mg_start + s.rows] for s in parts]
            out[name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
            assert tuple(out[name].shape) == shape, (name, out[name].shape, shape)
        return out

    def megatron_rows(
        self,
        get: Callable[[str, int, int, slice], torch.Tensor],
        r0: int,
        r1: int,
        cols: slice = slice(None),
    ) -> torch.Tensor:
        """Rows [r0, r1) (and columns ``cols`` of a 2-D tensor) of the Megatron tensor, read
        through ``get(hf_name, hf_row0, hf_row1, cols)``: only the needed HF rows are read."""
        pieces = []
        for s in self.segments:
            a, b = max(r0, s.mg_start), min(r1, s.mg_start + s.rows)
            if a < b:
                h0 = s.hf_start + a - s.mg_start
                pieces.append(
                    get(s.hf, h0, h0 + (b - a), cols if len(self.shape) > 1 else slice(None))
                )
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)


def check_shape(name: str, found: Sequence[int], expected: Sequence[int], source: str = "") -> None:
    if tuple(found) != tuple(expected):
        where = f"{source}: " if source else ""
        raise not_allowed(
            f"{where}tensor {name!r} shape",
            tuple(found),
            f"{tuple(expected)}, what the model config implies",
            ConversionError,
        )


# ------------------------------------------------------------------------------------ builders


def _copy(mg: str, hf: str, shape, **kw) -> TensorMap:
    shape = tuple(shape)
    return TensorMap(mg, shape, ((hf, shape),), (Segment(hf, 0, shape[0], 0),), "copy", **kw)


def _glu(mg: str, gate: str, up: str, inter: int, width: int, **kw) -> TensorMap:
    return TensorMap(
        mg,
        (2 * inter, width),
        ((gate, (inter, width)), (up, (inter, width))),
        (Segment(gate, 0, inter, 0), Segment(up, 0, inter, inter)),
        "glu",
        **kw,
    )


def _qkv(mg: str, prefix: str, arch: ModelArch, **kw) -> TensorMap:
    hd, ng, hpg, d = arch.kv_channels, arch.num_query_groups, arch.heads_per_group, arch.hidden_size
    q, k, v = f"{prefix}q_proj.weight", f"{prefix}k_proj.weight", f"{prefix}v_proj.weight"
    segs, row = [], 0
    for g in range(ng):
        segs.append(Segment(q, g * hpg * hd, hpg * hd, row))
        row += hpg * hd
        segs.append(Segment(k, g * hd, hd, row))
        row += hd
        segs.append(Segment(v, g * hd, hd, row))
        row += hd
    shapes = ((q, (ng * hpg * hd, d)), (k, (ng * hd, d)), (v, (ng * hd, d)))
    return TensorMap(mg, (row, d), shapes, tuple(segs), "qkv", **kw)


def _gated_mlp(mg: str, gate: str, up: str, down: str, inter: int, width: int, **kw):
    """fc1 = [gate; up] and fc2 = down of a gated MLP (dense, shared or routed expert)."""
    yield _glu(mg + "linear_fc1.weight", gate, up, inter, width, extra_state=True, **kw)
    yield _copy(mg + "linear_fc2.weight", down, (width, inter), extra_state=True, **kw)


def iter_layer_maps(arch: ModelArch, i: int) -> Iterator[TensorMap]:
    """The TensorMaps of decoder layer ``i`` (global index), in module order."""
    d, hd = arch.hidden_size, arch.kv_channels
    mg, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
    moe_layer = arch.is_moe_layer(i)
    yield _copy(
        mg + "input_layernorm.weight",
        hf + "input_layernorm.weight",
        (d,),
        checkpoint_name=mg + "self_attention.linear_qkv.layer_norm_weight",
    )
    yield _qkv(mg + "self_attention.linear_qkv.weight", hf + "self_attn.", arch, extra_state=True)
    yield _copy(
        mg + "self_attention.linear_proj.weight",
        hf + "self_attn.o_proj.weight",
        (d, arch.num_attention_heads * hd),
        extra_state=True,
    )
    yield _copy(
        mg + "pre_mlp_layernorm.weight",
        hf + "post_attention_layernorm.weight",
        (d,),
        checkpoint_name=None if moe_layer else mg + "mlp.linear_fc1.layer_norm_weight",
    )
    if not moe_layer:
        dense = (f"{hf}mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
        yield from _gated_mlp(mg + "mlp.", *dense, arch.ffn_hidden_size, d)
        return
    n, lat, m = arch.num_experts, arch.moe_latent_size, arch.moe_ffn_hidden_size
    moe = hf + "block_sparse_moe."
    yield _copy(mg + "mlp.router.weight", moe + "gate.weight", (n, d))
    yield _copy(
        mg + "mlp.router.expert_bias",
        moe + "gate.e_score_correction_bias",
        (n,),
        fp32=True,
        zeros=not arch.has_expert_bias,
    )
    for j in range(n):
        w = (f"{moe}experts.{j}.{p}.weight" for p in ("w1", "w3", "w2"))
        yield from _gated_mlp(f"{mg}mlp.experts.local_experts.{j}.", *w, m, lat, expert=j)
    if arch.moe_shared_expert_intermediate_size:
        shared = (f"{moe}shared_experts.{p}_proj.weight" for p in ("gate", "up", "down"))
        yield from _gated_mlp(
            mg + "mlp.shared_experts.", *shared, arch.moe_shared_expert_intermediate_size, d
        )
    yield _copy(mg + "mlp.fc1_latent_proj.weight", moe + "routed_expert_down_proj.weight", (lat, d))
    if arch.latent_moe_use_norm:
        yield _copy(f"{mg}mlp.{NORM_NAME}.weight", moe + "routed_expert_norm.weight", (lat,))
    yield _copy(mg + "mlp.fc2_latent_proj.weight", moe + "routed_expert_up_proj.weight", (d, lat))


def iter_tensor_maps(arch: ModelArch) -> Iterator[TensorMap]:
    """Every canonical Megatron tensor of the model, in model order (a generator: a full-scale
    model has ~10^5 routed-expert tensors)."""
    d, v = arch.hidden_size, arch.vocab_size
    yield _copy("embedding.word_embeddings.weight", "model.embed_tokens.weight", (v, d))
    for i in range(arch.num_layers):
        yield from iter_layer_maps(arch, i)
    yield _copy("decoder.final_layernorm.weight", "model.norm.weight", (d,))
    if not arch.tie_embeddings:
        # (GPTModel drops the output layer's _extra_state from its sharded state dict)
        yield _copy("output_layer.weight", "lm_head.weight", (v, d))


# ------------------------------------------------------------------------ checkpoint key rules

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")

MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
"""Checkpoint tensor keys starting with these belong to the model (the rest: optimizer, ...)."""
TRAINING_STATE_SUFFIXES = (".router.qb_mean_input",)
"""Model-module buffers that only training reads (QB rescoring's last global mean router input,
``moe/router.py``): never exported, and a checkpoint without them still loads."""


@dataclass(frozen=True)
class Location:
    """Where a canonical tensor lives in a checkpoint: one or more (key, leading indices) parts,
    concatenated along dim 0 (two parts only for singleton ``_w``/``_v`` gated fc1 halves)."""

    parts: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.parts)


def checkpoint_locations(tm: TensorMap) -> list[Location]:
    """Every checkpoint layout a canonical tensor may be stored in: per-layer or stacked keys,
    and the ``singleton_local_shards`` expert keys (see the module docstring)."""
    name = tm.checkpoint_name or tm.megatron
    m = _LAYER_RE.match(name)
    if not m:
        return [Location(((name, ()),))]
    layer, rest = int(m.group(1)), m.group(2)
    rests: list[tuple[str, tuple[int, ...]]] = []
    e = _EXPERT_RE.match(rest)
    if e:
        j, tail = int(e.group(1)), e.group(2)
        rests.append((f"mlp.experts.experts.{tail}", (j,)))
        rests.append((f"mlp.experts.experts.{j}.{tail}", ()))
    else:
        rests.append((rest, ()))
    out = []
    for r, idx in rests:
        out.append(Location(((f"decoder.layers.{layer}.{r}", idx),)))
        out.append(Location(((f"decoder.layers.{r}", (layer, *idx)),)))
    if tm.kind == "glu":  # singleton_local_shards: gated halves stored separately
        for r, idx in rests:
            if not idx:
                for pre, lead in ((f"decoder.layers.{layer}.", ()), ("decoder.layers.", (layer,))):
                    out.append(Location(((f"{pre}{r}_w", lead), (f"{pre}{r}_v", lead))))
    return out


def primary_checkpoint_key(
    tm: TensorMap, arch: ModelArch
) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(key, leading indices, global shape of the key) that Megatron's local spec writes for this
    tensor with ``singleton_local_shards=False`` (what ``megatron.training`` uses)."""
    name = tm.checkpoint_name or tm.megatron
    m = _LAYER_RE.match(name)
    if not m:
        return name, (), tm.shape
    layer, rest = int(m.group(1)), m.group(2)
    lead, lead_shape = (), ()
    e = _EXPERT_RE.match(rest)
    if e:
        rest = f"mlp.experts.experts.{e.group(2)}"
        lead, lead_shape = (int(e.group(1)),), (arch.num_experts,)
    if arch.homogeneous_layers:
        return f"decoder.layers.{rest}", (layer, *lead), (arch.num_layers, *lead_shape, *tm.shape)
    return f"decoder.layers.{layer}.{rest}", lead, (*lead_shape, *tm.shape)


def extra_state_key(tm: TensorMap, arch: ModelArch) -> str | None:
    """The ``ShardedObject`` unique key of the module's ``_extra_state`` (local spec), or None."""
    if not tm.extra_state:
        return None
    key, lead, shape = primary_checkpoint_key(tm, arch)
    module = key.rsplit(".", 1)[0]
    lead_shape = shape[: len(lead)]
    if not lead:
        lead, lead_shape = (0,), (1,)
    return (
        f"{module}._extra_state/shard_{'.'.join(map(str, lead))}_{'.'.join(map(str, lead_shape))}"
    )


def is_model_key(key: str) -> bool:
    return (
        key.startswith(MODEL_KEY_PREFIXES)
        and "/shard_" not in key
        and "._extra_state" not in key
        and not key.endswith(TRAINING_STATE_SUFFIXES)
    )


def hf_dtype_for(tm: TensorMap, dtype: torch.dtype) -> torch.dtype:
    """The dtype an HF tensor of ``tm`` is stored in when exporting in ``dtype``."""
    return torch.float32 if tm.fp32 else dtype
