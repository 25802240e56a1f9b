# Copyright 2026 The megatron-latentmoe authors. Licensed under the Apache License, Version 2.0.
"""Stable LatentMoE causal LM for Hugging Face ``transformers`` (model_type ``"stable_latentmoe"``).

This file is copied next to the weights of every exported checkpoint and loaded with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``; it imports only torch,
transformers and ``configuration_stable_latentmoe``. It is also the project's pure-PyTorch
reference of the block (re-exported by ``megatron_latentmoe.reference``), so it is written to be
numerically faithful to Megatron-Core's ``GPTModel`` built with the project's specs:

* token embedding (no scaling, no padding row) -> pre-norm decoder layers -> final RMSNorm ->
  ``lm_head`` (untied unless ``tie_word_embeddings``);
* RMSNorm: fp32 math (fp64 stays fp64), weight applied in fp32, cast back to the input dtype;
* attention: Megatron's ``SelfAttention`` with GQA, no biases, causal, softmax scale
  1/sqrt(head_dim), RoPE over the full head dim, non-interleaved (rotate-half) convention;
* dense layers (the first ``first_k_dense_replace``): gated MLP ``mlp.{gate,up,down}_proj``;
* MoE layers: the Stable LatentMoE block (SPEC §1) under ``block_sparse_moe``:

      s = sigmoid(x W_r^T)  (fp32)        S = TopK(s + e_score_correction_bias)
      p_j = s_j / (sum_{S} s + 1e-20) * routed_scaling_factor       (raw scores; bias never in p)
      z = routed_expert_down_proj(x)      u = sum_{j in S} p_j * E_j(z)     (latent combine)
      y = routed_expert_up_proj(routed_expert_norm(u)) + shared_experts(x)

  with E_j(z) = w2(act(w1 z, w3 z)) and act = SiTU-GLU (SPEC §2) or SwiGLU.

transformers conventions supported (attention weights, run-time attention switch, gradient
checkpointing, packed batches, custom 4D masks, static cache, ``torch.compile``): see
``StableLatentMoEPreTrainedModel``.

MXFP4 routed experts (``convert export --expert-dtype mxfp4``: compressed-tensors
``mxfp4-pack-quantized``, see "MXFP4 checkpoints" below) load dequantized to the compute dtype.

Getting the routing out of a block: ``block(x, return_routing=True)`` returns ``(y, MoERouting)``;
or set ``block.record_routing = True`` (``StableLatentMoEModel.set_record_routing(True)`` for all
layers) and read ``block.last_routing`` after a forward. The model's ``output_router_logits=True``
(or ``config.output_router_logits``) returns, as transformers' MoE models do, ``router_logits``: one
[B * S, n] fp32 tensor of router logits per MoE layer, with gradients.
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial

# typing, not collections.abc: this remote-code file imports only the modules that
# tests/unit/test_hf_modeling.py allows
from typing import Callable, NamedTuple  # noqa: UP035

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from .configuration_stable_latentmoe import StableLatentMoEConfig

logger = logging.get_logger(__name__)

ROUTER_PROB_EPS = 1e-20
"""Guard in the renormalisation denominator (Megatron-Core ``topk_routing_with_score_function``)."""


# ====================================================================================== functional
def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the "fp32 math": fp32 for fp32 / bf16 / fp16 inputs; fp64 stays fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    """SiTU-GLU (SPEC §2): ``[beta*tanh(g/beta) * sigmoid(g)] * [linear_beta*tanh(u/linear_beta)]``.

    Computed in fp32 (fp64 for fp64 inputs), returned in ``gate.dtype``. |out| < beta*linear_beta.
    """
    cd = compute_dtype(gate.dtype)
    g, u = gate.to(cd), up.to(cd)
    out = (
        (beta * torch.tanh(g / beta))
        * torch.sigmoid(g)
        * (linear_beta * torch.tanh(u / linear_beta))
    )
    return out.to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``silu(g) * u``, with the same fp32-math / cast-back convention as ``situ_glu``."""
    cd = compute_dtype(gate.dtype)
    return (F.silu(gate.to(cd)) * up.to(cd)).to(gate.dtype)


def get_glu_activation(
    config: StableLatentMoEConfig,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``act(gate, up)`` selected by ``config.hidden_act`` ("situ" or "silu")."""
    if config.hidden_act == "situ":
        return partial(
            situ_glu,
            beta=float(config.activation_situ_beta),
            linear_beta=float(config.activation_situ_linear_beta),
        )
    if config.hidden_act == "silu":
        return swiglu
    raise ValueError(f"hidden_act={config.hidden_act!r} is not allowed; expected 'situ' or 'silu'")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim; fp32 math, cast back to
    ``x.dtype``."""
    cd = compute_dtype(x.dtype)
    h = x.to(cd)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        h = h * weight.to(cd)
    return h.to(x.dtype)


class MoERouting(NamedTuple):
    """Routing of T tokens over n experts, top-k (all [T, ...], tokens flattened in input order).

    topk_indices: [T, k] int64, selected experts, by descending biased score ``s + b``.
    topk_probs:   [T, k] fp32 (fp64 for fp64 inputs), mixing weights p: raw scores of the selected
                  experts, renormalised (if ``moe_renormalize`` and k > 1), times
                  ``routed_scaling_factor``. The bias never enters p.
    scores:       [T, n] raw sigmoid scores s (same dtype as ``topk_probs``).
    router_logits: [T, n] the logits ``x W_r^T`` the scores came from (fp32 math; what
                  ``output_router_logits=True`` returns per MoE layer), None if not given.
    """

    topk_indices: torch.Tensor
    topk_probs: torch.Tensor
    scores: torch.Tensor
    router_logits: torch.Tensor | None = None

    def routing_map(self) -> torch.Tensor:
        """[T, n] bool, True where token t is routed to expert e (Megatron's ``routing_map``)."""
        out = torch.zeros_like(self.scores, dtype=torch.bool)
        return out.scatter_(1, self.topk_indices, True)

    def dense_probs(self) -> torch.Tensor:
        """[T, n] probabilities, zero outside the selection (Megatron's ``probs``)."""
        return torch.zeros_like(self.scores).scatter_(1, self.topk_indices, self.topk_probs)


def noaux_tc_routing(
    logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> MoERouting:
    """Sigmoid routing with a selection-only bias (SPEC §3, formula 13), on [T, n] router logits.

    Computed in ``compute_dtype(logits.dtype)``. Matches Megatron-Core's sigmoid path of
    ``topk_routing_with_score_function`` with ``expert_bias``: topk of (scores + bias), probs =
    gathered raw scores / (sum + 1e-20) when k > 1, times the scaling factor.
    """
    cd = compute_dtype(logits.dtype)
    scores = torch.sigmoid(logits.to(cd))
    scores_for_choice = (
        scores if e_score_correction_bias is None else scores + e_score_correction_bias.to(cd)
    )
    _, topk_indices = torch.topk(scores_for_choice, k=top_k, dim=-1)
    topk_probs = scores.gather(-1, topk_indices)
    if renormalize and top_k > 1:
        topk_probs = topk_probs / (topk_probs.sum(dim=-1, keepdim=True) + ROUTER_PROB_EPS)
    topk_probs = topk_probs * routed_scaling_factor
    return MoERouting(topk_indices, topk_probs, scores, logits)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (non-interleaved RoPE, as Megatron's
    ``_rotate_half``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin of shape [B, S, head_dim] for integer ``position_ids`` [B, S], cast to ``dtype``.

    fp32 math as Megatron (fp64 when ``dtype`` is fp64): inv_freq = 1 / theta^(arange(0, d, 2) / d),
    freqs = pos * inv_freq, emb = cat(freqs, freqs)."""
    cd = compute_dtype(dtype)
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=cd, device=position_ids.device) / head_dim)
    )
    freqs = position_ids.to(cd)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``t * cos + rotate_half(t) * sin`` for q, k of shape [B, H, S, D] (cos/sin [B, S, D])."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, KV, S, D] -> [B, KV * n_rep, S, D]; query head h uses kv head h // n_rep (Megatron
    GQA)."""
    if n_rep == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


def packed_document_ids(
    seq_len: int,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """[B, seq_len] index of the document of each token in a padding-free (packed) batch.

    ``cu_seq_lens`` (cumulative document lengths ``[0, n_0, n_0 + n_1, ..., seq_len]`` of a batch
    of one row, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` passes them as
    ``cu_seq_lens_q``) wins; otherwise a document starts wherever ``position_ids`` [B, S] does not
    go up by exactly 1 (they restart per document, as ``DataCollatorWithFlattening`` writes them).
    All zeros for an ordinary sequence; None without either. Tensor ops only (no host sync).
    """
    if cu_seq_lens is not None:
        ends = cu_seq_lens.reshape(-1)[1:]
        tokens = torch.arange(seq_len, device=ends.device, dtype=ends.dtype)
        return torch.searchsorted(ends, tokens, right=True)[None]
    if position_ids is None:
        return None
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def build_attention_mask(
    query_positions: torch.Tensor,
    kv_length: int,
    padding_mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask [B or 1, 1, S, kv_length], True = may attend.

    ``query_positions`` [S]: cache positions of the queries (past length + arange(S)); key j is
    visible to query i iff j <= query_positions[i] and ``padding_mask[b, j]`` (2D, 1 = real token)
    and, for a packed batch without past tokens, ``document_ids[b, j] == document_ids[b, i]``.
    Rows with nothing visible (queries at padding positions) are opened completely so that the
    softmax stays finite; their outputs are never read by real tokens.
    """
    kv_pos = torch.arange(kv_length, device=query_positions.device)
    allowed = (kv_pos[None, :] <= query_positions[:, None])[None, None]  # [1, 1, S, L]
    if padding_mask is not None:
        pm = padding_mask.to(device=query_positions.device, dtype=torch.bool)
        if (
            pm.shape[-1] < kv_length
        ):  # e.g. a preallocated cache: the tail is already causally masked
            pm = F.pad(pm, (0, kv_length - pm.shape[-1]), value=True)
        allowed = allowed & pm[:, None, None, :kv_length]
    if document_ids is not None:
        doc_k = document_ids
        if doc_k.shape[-1] < kv_length:  # a preallocated cache's tail: causally masked anyway
            doc_k = F.pad(doc_k, (0, kv_length - doc_k.shape[-1]), value=-1)
        allowed = allowed & (document_ids[:, None, :, None] == doc_k[:, None, None, :kv_length])
    return allowed | ~allowed.any(dim=-1, keepdim=True)


def _check_custom_attention_mask(
    mask: torch.Tensor, batch: int, heads: int, q_len: int, past_len: int
) -> None:
    """Refuse, in one line, an ``attention_mask`` that is neither a 2D padding mask nor a 4D
    mask [batch or 1, heads or 1, q_len, >= past_len + q_len] of bools or floats. Shapes and
    dtype only (no host sync)."""
    keys = past_len + q_len
    if not (
        mask.dim() == 4
        and mask.shape[0] in (1, batch)
        and mask.shape[1] in (1, heads)
        and mask.shape[2] == q_len
        and mask.shape[3] >= keys
    ):
        raise ValueError(
            f"StableLatentMoEModel: attention_mask of shape {tuple(mask.shape)} is not allowed; "
            f"expected a 2D padding mask or a 4D mask of shape ({batch} or 1, {heads} or 1, "
            f"{q_len}, >= {keys}) = (batch, heads, queries, past + current keys or more)"
        )
    if not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise ValueError(
            f"StableLatentMoEModel: a 4D attention_mask of dtype {mask.dtype} is not allowed; "
            "expected torch.bool (True = attend) or a float dtype (additive: 0 = attend, "
            "negative = not)"
        )


def fit_custom_attention_mask(mask: torch.Tensor, kv_length: int) -> torch.Tensor:
    """A custom boolean 4D mask [B or 1, 1 or H, S, W] (True = may attend) fitted to
    ``kv_length`` keys: columns past ``kv_length`` are dropped, missing ones (a static cache's
    unwritten slots) are not attended. Rows with nothing visible are opened completely, as in
    ``build_attention_mask``."""
    if mask.shape[-1] >= kv_length:
        mask = mask[..., :kv_length]
    else:
        mask = F.pad(mask, (0, kv_length - mask.shape[-1]), value=False)
    return mask | ~mask.any(dim=-1, keepdim=True)


# ========================================================================================= modules
class StableLatentMoERMSNorm(nn.Module):
    """RMSNorm with fp32 math (see ``rms_norm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class StableLatentMoEMLP(nn.Module):
    """Gated MLP ``down_proj(act(gate_proj x, up_proj x))``: the dense FFN and the shared
    experts."""

    def __init__(self, config: StableLatentMoEConfig, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = get_glu_activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x), self.up_proj(x)))


class StableLatentMoEExpert(nn.Module):
    """One routed expert on the latent width (Kimi names): ``w2(act(w1 z, w3 z))``; w1 gate, w3
    up."""

    def __init__(self, config: StableLatentMoEConfig, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = get_glu_activation(config)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(z), self.w3(z)))


class StableLatentMoEGate(nn.Module):
    """Router: ``weight`` [n, d] on the full-width input and the selection-only bias
    ``e_score_correction_bias`` [n] (a persistent fp32 buffer: it stays fp32 through
    ``.to(bf16)`` / ``.half()``; only an fp64 cast changes its dtype)."""

    def __init__(self, config: StableLatentMoEConfig):
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.num_experts = config.num_experts
        self.renormalize = config.moe_renormalize
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer(
            "e_score_correction_bias",
            torch.zeros(config.num_experts, dtype=torch.float32),
            persistent=True,
        )
        nn.init.normal_(self.weight, mean=0.0, std=config.initializer_range)

    def router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, n] logits ``x W^T`` computed in fp32 (fp64 for fp64), also under ``torch.autocast``
        (mixed-precision fine-tuning), which would otherwise run this linear in bf16 / fp16."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        cd = compute_dtype(x.dtype)
        try:
            no_autocast = torch.autocast(device_type=x.device.type, enabled=False)
        except RuntimeError:  # a device type without autocast (e.g. meta): nothing to turn off
            return F.linear(x.to(cd), self.weight.to(cd))
        with no_autocast:
            return F.linear(x.to(cd), self.weight.to(cd))

    def forward(self, hidden_states: torch.Tensor) -> MoERouting:
        return noaux_tc_routing(
            self.router_logits(hidden_states),
            self.e_score_correction_bias,
            self.top_k,
            renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def _apply(self, fn, recurse: bool = True):
        # Keep the bias in fp32 under half-precision casts: restore it from the fp32 original
        # (a bf16 round trip would lose bits), moved to wherever ``fn`` put the converted copy.
        bias = self._buffers.get("e_score_correction_bias")
        out = super()._apply(fn, recurse)
        new = self._buffers.get("e_score_correction_bias")
        if (
            bias is not None
            and new is not None
            and bias.dtype in (torch.float32, torch.float64)
            and new.dtype in (torch.float16, torch.bfloat16)
        ):
            src = new if "meta" in (bias.device.type, new.device.type) else bias
            self._buffers["e_score_correction_bias"] = src.to(
                device=new.device, dtype=torch.float32
            )
        return out

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}, "
            f"routed_scaling_factor={self.routed_scaling_factor}"
        )


class StableLatentMoEBlock(nn.Module):
    """The Stable LatentMoE block (SPEC §1, formula 11) — HF name ``block_sparse_moe``.

    Submodules (checkpoint names): ``gate`` (``weight`` [n, d], ``e_score_correction_bias`` [n]),
    ``routed_expert_down_proj`` [l, d], ``experts.{j}.{w1,w3}`` [m_e, l] / ``w2`` [l, m_e],
    ``routed_expert_norm`` [l] (only if ``latent_moe_use_norm``), ``routed_expert_up_proj`` [d, l],
    ``shared_experts.{gate,up,down}_proj`` (only if ``num_shared_experts > 0``).

    ``forward(x, return_routing=False)`` takes [..., d] and returns y of the same shape, or
    ``(y, MoERouting)`` with the routing of the flattened tokens. If ``record_routing`` is True the
    routing (detached) is also kept in ``last_routing``.
    """

    def __init__(self, config: StableLatentMoEConfig):
        super().__init__()
        d, lat, m_e = (
            config.hidden_size,
            config.routed_expert_hidden_size,
            config.moe_intermediate_size,
        )
        self.hidden_size = d
        self.latent_size = lat
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.gate = StableLatentMoEGate(config)
        self.routed_expert_down_proj = nn.Linear(d, lat, bias=False)
        self.experts = nn.ModuleList(
            [StableLatentMoEExpert(config, lat, m_e) for _ in range(config.num_experts)]
        )
        self.routed_expert_norm = (
            StableLatentMoERMSNorm(lat, eps=config.rms_norm_eps)
            if config.latent_moe_use_norm
            else None
        )
        self.routed_expert_up_proj = nn.Linear(lat, d, bias=False)
        shared = config.get_shared_expert_intermediate_size()
        self.shared_experts = StableLatentMoEMLP(config, d, shared) if shared > 0 else None
        self.record_routing = False
        self.last_routing: MoERouting | None = None

    @torch.compiler.disable
    def moe_infer(
        self, z: torch.Tensor, topk_indices: torch.Tensor, topk_probs: torch.Tensor
    ) -> torch.Tensor:
        """``u_t = sum_i p_{t,i} * E_{idx_{t,i}}(z_t)`` for latent tokens z [T, l].

        Tokens are grouped by expert with one stable sort; each expert runs once on its token
        group (a loop over experts, never over tokens) and the weighted outputs are scattered
        back with ``index_add_``. The sum is accumulated in fp32 (fp64 for fp64) and cast to
        ``z.dtype``. The group bounds come to the host (one sync per MoE layer: they are found
        in the sorted expert ids, where ``torch.bincount`` on CUDA would read the ids' min and
        max on the host first), so under ``torch.compile`` this method runs eagerly (one graph
        break) instead of being traced and recompiled for every new routing.
        """
        num_tokens, k = topk_indices.shape
        acc_dtype = compute_dtype(z.dtype)
        out = torch.zeros((num_tokens, z.shape[-1]), dtype=acc_dtype, device=z.device)
        if num_tokens == 0:
            return out.to(z.dtype)
        flat_experts = topk_indices.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_ids = order // k
        probs = topk_probs.reshape(-1)[order].to(acc_dtype)
        experts = torch.arange(self.num_experts + 1, device=flat_experts.device)
        bounds = torch.searchsorted(flat_experts[order], experts).tolist()
        for expert_id in range(self.num_experts):
            if bounds[expert_id] == bounds[expert_id + 1]:
                continue
            rows = slice(bounds[expert_id], bounds[expert_id + 1])
            tok = token_ids[rows]
            expert_out = self.experts[expert_id](z[tok])
            out.index_add_(0, tok, expert_out.to(acc_dtype) * probs[rows, None])
        return out.to(z.dtype)

    def forward(self, hidden_states: torch.Tensor, return_routing: bool = False):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        routing = self.gate(x)  # router on the FULL width
        z = self.routed_expert_down_proj(x)  # d -> l, once per token
        u = self.moe_infer(z, routing.topk_indices, routing.topk_probs)  # combine in latent space
        if self.routed_expert_norm is not None:
            u = self.routed_expert_norm(u)
        y = self.routed_expert_up_proj(u)  # l -> d, once per token
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)  # shared experts see the full-width x
        y = y.reshape(shape)
        if self.record_routing:
            self.last_routing = MoERouting(*(None if t is None else t.detach() for t in routing))
        return (y, routing) if return_routing else y


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit softmax attention for q [B, H, S, D], k / v [B, KV, L, D] and a boolean mask
    [B or 1, 1 or H, S, L] (True = attend). Softmax in fp32 (fp64 for fp64).

    Returns (output [B, S, H, D], attention weights [B, H, S, L] in ``query.dtype``), the
    signature of transformers' attention interface."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    probs = torch.softmax(scores.to(compute_dtype(scores.dtype)), dim=-1).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


class StableLatentMoEAttention(nn.Module):
    """Causal GQA self-attention with RoPE (Megatron ``SelfAttention`` math), no biases.

    The kernel comes from transformers' attention interface for ``config._attn_implementation``
    ("sdpa" or "eager", switchable at run time with ``model.set_attn_implementation``). SDPA
    computes no weights: a forward with ``output_attentions=True`` runs this module on the eager
    path instead (warning once), so attention weights are always returned when asked for.
    """

    def __init__(self, config: StableLatentMoEConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = float(config.attention_dropout)  # validated in [0, 1)
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        mask_builder: Callable[[int], torch.Tensor] | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        bsz, q_len, _ = hidden_states.shape

        def heads(proj: nn.Linear, n: int) -> torch.Tensor:  # [B, S, n * D] -> [B, n, S, D]
            return proj(hidden_states).view(bsz, q_len, n, self.head_dim).transpose(1, 2)

        q = heads(self.q_proj, self.num_heads)
        k = heads(self.k_proj, self.num_key_value_heads)
        v = heads(self.v_proj, self.num_key_value_heads)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if (
            attention_mask is not None
            and attention_mask.shape[-1] != k.shape[-2]
            and mask_builder is not None
        ):
            attention_mask = mask_builder(k.shape[-2])
        implementation = self.config._attn_implementation
        if output_attentions and implementation != "eager":
            logger.warning_once(
                f"StableLatentMoE: attn_implementation={implementation!r} returns no attention "
                "weights; forwards with output_attentions=True run the eager path instead. Call "
                "model.set_attn_implementation('eager') to make that the default."
            )
            implementation = "eager"
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            implementation, eager_attention_forward
        )
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
        )
        out = self.o_proj(out.reshape(bsz, q_len, self.num_heads * self.head_dim))
        return out, (weights if output_attentions else None)


class StableLatentMoEDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm layer: x + attn(norm(x)), then h + ffn(norm(h)); ffn = ``mlp`` (dense) or
    ``block_sparse_moe`` (layer_idx >= first_k_dense_replace). Returns (hidden states, attention
    weights or None, router logits [T, n] or None: an MoE layer's, if ``output_router_logits``).
    Recomputed in the backward under ``gradient_checkpointing_enable()``."""

    def __init__(self, config: StableLatentMoEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = config.is_moe_layer(layer_idx)
        self.input_layernorm = StableLatentMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = StableLatentMoEAttention(config, layer_idx)
        self.post_attention_layernorm = StableLatentMoERMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )
        if self.is_moe:
            self.block_sparse_moe = StableLatentMoEBlock(config)
        else:
            self.mlp = StableLatentMoEMLP(config, config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        mask_builder: Callable[[int], torch.Tensor] | None = None,
        output_attentions: bool = False,
        output_router_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        residual = hidden_states
        h, weights = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            mask_builder=mask_builder,
            output_attentions=output_attentions,
        )
        hidden_states = residual + h
        residual = hidden_states
        h = self.post_attention_layernorm(hidden_states)
        router_logits = None
        if not self.is_moe:
            h = self.mlp(h)
        elif output_router_logits:
            h, routing = self.block_sparse_moe(h, return_routing=True)
            router_logits = routing.router_logits
        else:
            h = self.block_sparse_moe(h)
        return residual + h, weights, router_logits


# ============================================================================= MXFP4 checkpoints
# Routed experts stored as compressed-tensors "mxfp4-pack-quantized" (OCP MX v1.0): per expert
# linear ``weight_packed`` uint8 [out, in/2] (two E2M1 codes per byte, element 2i in the low
# nibble, bit 3 = sign) and ``weight_scale`` uint8 [out, in/32] (E8M0: 2**(byte - 127) per block of
# 32 along ``in``). Without compressed-tensors installed, transformers cannot build its quantizer
# for such a config.json, so ``from_pretrained`` drops the quantization config and a conversion
# registered for this model type dequantizes each pair into the dense ``weight`` (exact in fp32
# and bf16). Pass ``quantization_config=...`` to use compressed-tensors' own loader instead.
MXFP4_FORMAT = "mxfp4-pack-quantized"
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(``weight_packed`` [out, in/2], ``weight_scale`` [out, in/32]) -> [out, in] in ``dtype``."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    values = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)[codes]
    blocks = values.unflatten(-1, (scale.shape[-1], -1))
    return (blocks * torch.exp2(scale.float() - 127.0).unsqueeze(-1)).flatten(-2).to(dtype)


def _is_mxfp4_experts(quantization_config) -> bool:
    config = quantization_config
    if config is not None and not isinstance(config, dict) and hasattr(config, "to_dict"):
        config = config.to_dict()
    return bool(config) and config.get("format") == MXFP4_FORMAT


def _register_mxfp4_loading():
    """Make loading this model type turn each MXFP4 pair into its dense ``weight`` (a transformers
    weight conversion). Returns (the conversion op class, a function that unregisters it): it
    is registered for one load only, as a registered conversion is also reverted by
    ``save_pretrained``, which must write the dense weights."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import ConversionOps, WeightConverter

    class DequantizeMXFP4(ConversionOps):
        def convert(
            self,
            input_dict,
            source_patterns=None,
            target_patterns=None,
            full_layer_name=None,
            **kwargs,
        ):
            # transformers casts every checkpoint tensor to the load dtype first: the uint8 bytes
            # come back as exact small integers (0..255 are exact even in bf16)
            t = {k: (v[0] if isinstance(v, list) else v) for k, v in input_dict.items()}
            t = {k: v.to(torch.uint8) for k, v in t.items()}
            dtype = kwargs["model"].get_parameter(full_layer_name).dtype
            return {full_layer_name: dequantize_mxfp4(t["weight_packed"], t["weight_scale"], dtype)}

    model_type = StableLatentMoEConfig.model_type
    previous = conversion_mapping.get_checkpoint_conversion_mapping(model_type)
    converter = WeightConverter(["weight_packed", "weight_scale"], "weight", [DequantizeMXFP4()])
    register = conversion_mapping.register_checkpoint_conversion_mapping
    register(model_type, [converter], overwrite=True)

    def unregister():
        if previous is not None:
            register(model_type, previous, overwrite=True)
        else:  # transformers has no public "unregister"
            conversion_mapping._checkpoint_conversion_mapping_cache.pop(model_type, None)
            conversion_mapping.USER_REGISTERED_MAPPINGS.discard(model_type)

    return DequantizeMXFP4, unregister


# ================================================================================ HF model classes
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


def _cache_field(output_cls) -> str:
    """Name of the cache field of a transformers ModelOutput class (``cache`` in recent 5.x,
    ``past_key_values`` before)."""
    names = {f.name for f in dataclasses.fields(output_cls)}
    return "cache" if "cache" in names else "past_key_values"


def _output_with_cache(output_cls, cache, **fields):
    """Build a ModelOutput with the cache under the field name this transformers version uses."""
    return output_cls(**{_cache_field(output_cls): cache}, **fields)


def _cache_of(output) -> Cache | None:
    """The cache carried by a ModelOutput, whichever field name this transformers version uses."""
    return getattr(output, _cache_field(type(output)), None)


class StableLatentMoEPreTrainedModel(PreTrainedModel):
    """Capability flags, each backed by a test in ``tests/hf/test_transformers_conventions.py``:

    * gradient checkpointing: yes (decoder layers are ``GradientCheckpointingLayer``s; the QB
      bias is a buffer, never trained); eager and SDPA attention, switchable at run time;
    * no FlashAttention / FlexAttention: the masks are boolean tensors built here (causal, padding,
      packed documents, custom 4D), never the 2D masks or BlockMasks those kernels take;
    * ``_can_compile_fullgraph = False``: the expert loop of ``StableLatentMoEBlock.moe_infer``
      sizes its token groups on the host (one sync per MoE layer) and runs eagerly under
      ``torch.compile`` (a graph break, no recompilation per routing); compiling without
      fullgraph works;
    * context parallelism: not declared (never exercised here);
    * static cache and custom 4D masks have no flag in transformers 5.x; they are tested like the
      rest. A 4D mask is boolean, or additive float (0 = attend, any negative value = not; it is
      made boolean, so soft additive biases are not supported; integer masks are refused as
      ambiguous), of shape [B or 1, 1 or H, S, W] with W >= past + S keys: wider masks are cut to
      the keys, and with a static cache the slots past W are not attended (transformers' own
      models take exactly the keys' width); other shapes are refused in one line.
    """

    config_class = StableLatentMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["StableLatentMoEDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = False
    _supports_attention_backend = False
    _supports_context_parallel = False
    # The selection bias stays fp32 when the model is loaded in bf16/fp16 (SPEC §6: fp32 QB bias).
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``PreTrainedModel.from_pretrained``; MXFP4 routed experts load dequantized (see "MXFP4
        checkpoints") unless a ``quantization_config`` is passed. The other arguments mean what
        they mean there: config overrides (``num_hidden_layers=2``, ``output_router_logits=True``),
        ``attn_implementation``, ``output_loading_info``, ``config`` as an object or a path."""
        config = kwargs.get("config")
        if kwargs.get("quantization_config") is None and not isinstance(config, PretrainedConfig):
            source = pretrained_model_name_or_path if config is None else config  # None or a path
            hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
            probe = cls.config_class.from_pretrained(source, **hub)
            if _is_mxfp4_experts(getattr(probe, "quantization_config", None)):
                # the config with the overrides among kwargs, as transformers' AutoModel loads it
                rest = {k: v for k, v in kwargs.items() if k not in (*_HUB_KWARGS, "config")}
                own = {k: rest.pop(k) for k in ("dtype", "torch_dtype") if k in rest}
                config, unused = cls.config_class.from_pretrained(
                    source, return_unused_kwargs=True, **hub, **rest
                )
                kwargs = {**hub, **unused, **own, "config": config}
        if kwargs.get("quantization_config") is not None or not _is_mxfp4_experts(
            getattr(config, "quantization_config", None)
        ):
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        dense = copy.deepcopy(config)  # keeps what to_dict() drops (e.g. attn_implementation)
        del dense.quantization_config
        kwargs["config"] = dense
        dequantize, unregister = _register_mxfp4_loading()
        try:
            loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        finally:
            unregister()
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, output_loading_info)
        model._weight_conversions = [  # nothing to revert: the loaded model is dense
            c
            for c in getattr(model, "_weight_conversions", None) or []
            if not any(isinstance(op, dequantize) for op in getattr(c, "operations", ()))
        ]
        return loaded

    def _init_weights(self, module: nn.Module) -> None:
        # torch.nn.init is looked up at call time so transformers can guard it during loading.
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, StableLatentMoERMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, StableLatentMoEGate):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            nn.init.zeros_(module.e_score_correction_bias)


class StableLatentMoEModel(StableLatentMoEPreTrainedModel):
    """Embedding + decoder layers + final norm. Returns ``MoeModelOutputWithPast``
    (``router_logits``: one [B * S, n] fp32 tensor per MoE layer, with ``output_router_logits``)."""

    def __init__(self, config: StableLatentMoEConfig):
        super().__init__(config)
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [StableLatentMoEDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = StableLatentMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    # -------------------------------------------------------------------- routing introspection
    def moe_blocks(self) -> dict[int, StableLatentMoEBlock]:
        """{layer index: block} for the MoE layers."""
        return {i: layer.block_sparse_moe for i, layer in enumerate(self.layers) if layer.is_moe}

    def set_record_routing(self, enabled: bool = True) -> None:
        """Make every MoE block keep its last routing in ``block.last_routing``."""
        for block in self.moe_blocks().values():
            block.record_routing = enabled
            block.last_routing = None

    def recorded_routing(self) -> dict[int, MoERouting | None]:
        """{layer index: MoERouting of the last forward} (after ``set_record_routing(True)``)."""
        return {i: block.last_routing for i, block in self.moe_blocks().items()}

    # -------------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: Cache | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ):
        """Padding-free packed batches: without ``attention_mask`` and without past tokens, the
        documents are told apart by ``cu_seq_lens_q`` or by ``position_ids`` restarting (see
        ``packed_document_ids``); each token then attends only within its own document."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("StableLatentMoEModel: pass exactly one of input_ids or inputs_embeds")
        if cache is None:
            cache = past_key_values
        if cache is not None and not isinstance(cache, Cache):
            raise ValueError(
                "StableLatentMoEModel: the cache must be a transformers Cache (e.g. "
                f"DynamicCache); got {type(cache).__name__}"
            )
        use_cache = self.config.use_cache if use_cache is None else use_cache
        output_attentions = (
            self.config.output_attentions if output_attentions is None else output_attentions
        )
        output_hidden_states = (
            self.config.output_hidden_states
            if output_hidden_states is None
            else output_hidden_states
        )
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and use_cache:
            logger.warning_once(
                "StableLatentMoE: use_cache=True is incompatible with gradient checkpointing; "
                "setting use_cache=False."
            )
            use_cache, cache = False, None

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        bsz, q_len = inputs_embeds.shape[:2]
        device = inputs_embeds.device
        if use_cache and cache is None:
            try:
                cache = DynamicCache(config=self.config)
            except TypeError:  # older DynamicCache signatures
                cache = DynamicCache()
        past_len = cache.get_seq_length() if cache is not None else 0
        query_positions = torch.arange(past_len, past_len + q_len, device=device)
        positions_given = position_ids is not None
        if position_ids is None:
            position_ids = query_positions[None].expand(bsz, -1)
        elif position_ids.dim() == 1:
            position_ids = position_ids[None].expand(bsz, -1)
        document_ids = None
        if attention_mask is None and past_len == 0:
            document_ids = packed_document_ids(
                q_len, position_ids if positions_given else None, cu_seq_lens_q
            )

        if attention_mask is not None and attention_mask.dim() != 2:
            _check_custom_attention_mask(
                attention_mask, bsz, self.config.num_attention_heads, q_len, past_len
            )
            mask = attention_mask
            if not mask.dtype == torch.bool:
                # additive float mask: 0 = attend, negative = not (finfo.min, -inf, or the -1e4 /
                # -1e9 of other conventions, which a finfo.min / 2 threshold would let through)
                mask = mask >= 0
            mask_builder = partial(fit_custom_attention_mask, mask)
        else:
            padding_mask = attention_mask
            if padding_mask is not None and bool(padding_mask.all()):
                padding_mask = None
            mask_builder = partial(
                build_attention_mask,
                query_positions,
                padding_mask=padding_mask,
                document_ids=document_ids,
            )
        mask = mask_builder(past_len + q_len)

        position_embeddings = rope_cos_sin(
            position_ids, self.config.head_dim, float(self.config.rope_theta), inputs_embeds.dtype
        )
        hidden_states = inputs_embeds
        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        all_router_logits = () if output_router_logits else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            hidden_states, weights, router_logits = layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=mask,
                cache=cache,
                mask_builder=mask_builder,
                output_attentions=output_attentions,
                output_router_logits=output_router_logits,
            )
            if output_attentions:
                all_attentions += (weights,)
            if router_logits is not None:
                all_router_logits += (router_logits,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)

        out = _output_with_cache(
            MoeModelOutputWithPast,
            cache if use_cache else None,
            last_hidden_state=hidden_states,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            router_logits=all_router_logits,
        )
        return out if return_dict else out.to_tuple()


class StableLatentMoEForCausalLM(StableLatentMoEPreTrainedModel, GenerationMixin):
    """``model`` + ``lm_head`` (untied unless ``config.tie_word_embeddings``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: StableLatentMoEConfig):
        super().__init__(config)
        self.model = StableLatentMoEModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ):
        return_dict = self.config.return_dict if return_dict is None else return_dict
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
            output_router_logits=output_router_logits,
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(outputs.last_hidden_state[:, keep])  # 0 keeps every position

        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )

        out = _output_with_cache(
            MoeCausalLMOutputWithPast,
            _cache_of(outputs),
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )
        return out if return_dict else out.to_tuple()


# As transformers does for the classes it loads with trust_remote_code: save_pretrained (and so
# Trainer.save_model, or a PEFT merge_and_unload() model's) writes this file and the configuration
# one next to config.json, whose auto_map names them: every saved folder loads with Auto* classes.
StableLatentMoEModel.register_for_auto_class("AutoModel")
StableLatentMoEForCausalLM.register_for_auto_class("AutoModelForCausalLM")


__all__ = [
    "MoERouting",
    "StableLatentMoEAttention",
    "StableLatentMoEBlock",
    "StableLatentMoEDecoderLayer",
    "StableLatentMoEExpert",
    "StableLatentMoEForCausalLM",
    "StableLatentMoEGate",
    "StableLatentMoEMLP",
    "StableLatentMoEModel",
    "StableLatentMoEPreTrainedModel",
    "StableLatentMoERMSNorm",
    "apply_rotary_pos_emb",
    "build_attention_mask",
    "compute_dtype",
    "dequantize_mxfp4",
    "eager_attention_forward",
    "get_glu_activation",
    "noaux_tc_routing",
    "packed_document_ids",
    "repeat_kv",
    "rms_norm",
    "rope_cos_sin",
    "rotate_half",
    "situ_glu",
    "swiglu",
]
