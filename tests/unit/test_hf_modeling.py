"""HF modeling / configuration of Stable LatentMoE, which is also the project's pure-PyTorch
reference.

* the vectorised block equals a naive per-token loop written here (fp64): routing with a
  selection-only bias, renormalisation over raw scores, scaling factor, latent norm on/off, shared
  experts on/off, SiTU-GLU and SwiGLU;
* the whole model equals a naive fp64 forward written here (GQA grouping, rotate-half RoPE, causal
  softmax, pre-norm residuals, dense first layer);
* save_pretrained + the two remote-code files -> AutoModelForCausalLM(trust_remote_code=True) gives
  identical logits; greedy generate() with and without the KV cache, and left-padded batches;
* e_score_correction_bias stays fp32 (bit-exact) through .to(bf16), save and bf16 load;
* config validation errors.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from megatron_latentmoe import hf as hf_pkg  # noqa: E402
from megatron_latentmoe import reference  # noqa: E402
from megatron_latentmoe.hf import (  # noqa: E402
    REMOTE_CODE_FILES,
    StableLatentMoEBlock,
    StableLatentMoEConfig,
    StableLatentMoEForCausalLM,
    copy_remote_code,
)
from megatron_latentmoe.hf import modeling_stable_latentmoe as modeling  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def tiny_config(**overrides) -> StableLatentMoEConfig:
    values = dict(
        vocab_size=61,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        routed_expert_hidden_size=8,
        num_experts=6,
        num_experts_per_token=2,
        moe_intermediate_size=12,
        num_shared_experts=2,
        first_k_dense_replace=1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    values.update(overrides)
    return StableLatentMoEConfig(**values)


def randomize_(module: torch.nn.Module, std: float = 0.3, seed: int = 0) -> None:
    """Large random weights (and non-unit norm gains) so that every term of the math matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(std * noise)


# ==================================================================================== naive maths
def naive_situ(g, u, b1, b2):
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


def naive_act(cfg, g, u):
    if cfg.hidden_act == "situ":
        return naive_situ(g, u, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    return g * torch.sigmoid(g) * u


def naive_norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def naive_mlp(cfg, sd, prefix, x):
    g = x @ sd[prefix + "gate_proj.weight"].T
    u = x @ sd[prefix + "up_proj.weight"].T
    return naive_act(cfg, g, u) @ sd[prefix + "down_proj.weight"].T


def naive_block(cfg, sd, prefix, x):
    """Per-token loop over [T, d] tokens; returns (y [T, d], selected experts, probs)."""
    n, k = cfg.num_experts, cfg.num_experts_per_token
    bias = sd[prefix + "gate.e_score_correction_bias"].double()
    ys, sels, probs = [], [], []
    for t in range(x.shape[0]):
        xt = x[t]
        s = torch.sigmoid(sd[prefix + "gate.weight"] @ xt)
        biased = (s + bias).tolist()
        sel = sorted(range(n), key=lambda j: -biased[j])[:k]
        p = torch.stack([s[j] for j in sel])
        if cfg.moe_renormalize and k > 1:
            p = p / p.sum()
        p = p * cfg.routed_scaling_factor
        z = sd[prefix + "routed_expert_down_proj.weight"] @ xt
        u = torch.zeros_like(z)
        for pj, j in zip(p, sel, strict=True):
            e = f"{prefix}experts.{j}."
            h = naive_act(cfg, sd[e + "w1.weight"] @ z, sd[e + "w3.weight"] @ z)
            u = u + pj * (sd[e + "w2.weight"] @ h)
        if cfg.latent_moe_use_norm:
            u = naive_norm(u, sd[prefix + "routed_expert_norm.weight"], cfg.rms_norm_eps)
        y = sd[prefix + "routed_expert_up_proj.weight"] @ u
        if cfg.num_shared_experts:
            y = y + naive_mlp(cfg, sd, prefix + "shared_experts.", xt[None])[0]
        ys.append(y)
        sels.append(sel)
        probs.append(p)
    return torch.stack(ys), torch.tensor(sels), torch.stack(probs)


def naive_causal_lm(model, ids):
    """Independent fp64 forward of the whole model from its state dict (no cache, no padding)."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    bsz, seq = ids.shape
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = sd["model.embed_tokens.weight"][ids]
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None]  # [S, hd/2]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]

    def rope(t):  # [B, S, h, hd], rotate-half convention
        t1, t2 = t[..., : hd // 2], t[..., hd // 2 :]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)

    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = naive_norm(x, sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = rope((h @ sd[p + "self_attn.q_proj.weight"].T).view(bsz, seq, heads, hd))
        k = rope((h @ sd[p + "self_attn.k_proj.weight"].T).view(bsz, seq, kv_heads, hd))
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(bsz, seq, kv_heads, hd)
        out = torch.zeros(bsz, seq, heads, hd, dtype=torch.float64)
        for head in range(heads):
            g = head // (heads // kv_heads)
            sc = q[:, :, head] @ k[:, :, g].transpose(-1, -2) / math.sqrt(hd)
            sc = sc.masked_fill(future, float("-inf"))
            out[:, :, head] = torch.softmax(sc, dim=-1) @ v[:, :, g]
        x = x + out.reshape(bsz, seq, heads * hd) @ sd[p + "self_attn.o_proj.weight"].T
        h = naive_norm(x, sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        if i >= cfg.first_k_dense_replace:
            y = naive_block(cfg, sd, p + "block_sparse_moe.", h.reshape(-1, cfg.hidden_size))[0]
            y = y.view_as(h)
        else:
            y = naive_mlp(cfg, sd, p + "mlp.", h)
        x = x + y
    x = naive_norm(x, sd["model.norm.weight"], cfg.rms_norm_eps)
    return x @ sd["lm_head.weight"].T


# ========================================================================================= block
BLOCK_CASES = [
    dict(),
    dict(latent_moe_use_norm=False),
    dict(num_shared_experts=0),
    dict(routed_scaling_factor=2.5, num_experts_per_token=3),
    dict(hidden_act="silu", num_shared_experts=1),
    dict(moe_renormalize=False),
    dict(num_experts_per_token=1, latent_moe_use_norm=False, num_shared_experts=0),
    dict(activation_situ_beta=2.0, activation_situ_linear_beta=7.0),
]


@pytest.mark.parametrize(
    "overrides", BLOCK_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "k3"
)
def test_block_matches_naive_per_token_loop(overrides):
    cfg = tiny_config(**overrides)
    torch.manual_seed(0)
    block = StableLatentMoEBlock(cfg).double()
    randomize_(block)
    gen = torch.Generator().manual_seed(1)
    bias = 0.3 * torch.randn(cfg.num_experts, generator=gen, dtype=torch.float64)
    block.gate.e_score_correction_bias.copy_(bias)
    x = torch.randn(3, 5, cfg.hidden_size, generator=gen, dtype=torch.float64)

    y, routing = block(x, return_routing=True)
    sd = {k: v.double() for k, v in block.state_dict().items()}
    y_ref, sel_ref, p_ref = naive_block(cfg, sd, "", x.reshape(-1, cfg.hidden_size))

    assert y.shape == x.shape and y.dtype == torch.float64
    torch.testing.assert_close(y.reshape(-1, cfg.hidden_size), y_ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(routing.topk_indices, sel_ref)  # same experts, same (biased-score) order
    torch.testing.assert_close(routing.topk_probs, p_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        routing.scores, torch.sigmoid(x.reshape(-1, cfg.hidden_size) @ sd["gate.weight"].T)
    )
    # the plain forward returns the same tensor
    torch.testing.assert_close(block(x), y, rtol=0, atol=0)
    # the bias changes the selection for some token (so the case above exercises it)
    unbiased = torch.topk(routing.scores, cfg.num_experts_per_token, dim=-1).indices
    assert not torch.equal(unbiased, routing.topk_indices)


def test_bias_only_affects_selection_and_probs_use_raw_scores():
    cfg = tiny_config(num_experts_per_token=2, routed_scaling_factor=1.7)
    torch.manual_seed(0)
    block = StableLatentMoEBlock(cfg).double()
    randomize_(block)
    x = torch.randn(20, cfg.hidden_size, dtype=torch.float64)
    block.gate.e_score_correction_bias.zero_()
    block.gate.e_score_correction_bias[4] = 10.0  # forces expert 4 into every selection
    y, r = block(x, return_routing=True)
    assert bool((r.topk_indices[:, 0] == 4).all())
    s = r.scores
    sel = s.gather(1, r.topk_indices)
    expected = sel / sel.sum(-1, keepdim=True) * 1.7
    torch.testing.assert_close(r.topk_probs, expected, rtol=1e-12, atol=1e-14)
    assert bool((r.topk_probs.sum(-1) - 1.7).abs().max() < 1e-12)
    # probs are NOT the biased scores and the expert-4 weight is not ~1
    assert bool((r.topk_probs[:, 0] < 1.7 * 0.99).all())
    # dense views
    assert r.routing_map().sum().item() == 20 * 2 and bool(r.routing_map()[:, 4].all())
    torch.testing.assert_close(r.dense_probs().sum(-1), torch.full((20,), 1.7, dtype=torch.float64))
    # no gradient reaches the bias (it is a buffer); the router weight gets one through p
    x.requires_grad_(True)
    block(x).sum().backward()
    assert not block.gate.e_score_correction_bias.requires_grad
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


def test_block_record_routing_and_bf16():
    cfg = tiny_config()
    torch.manual_seed(0)
    block = StableLatentMoEBlock(cfg)
    randomize_(block)
    block.record_routing = True
    x = torch.randn(2, 7, cfg.hidden_size)
    y32 = block(x)
    assert block.last_routing is not None and block.last_routing.topk_indices.shape == (14, 2)
    assert block.last_routing.topk_probs.dtype == torch.float32
    block16 = block.to(torch.bfloat16)
    y16, r16 = block16(x.bfloat16(), return_routing=True)
    assert y16.dtype == torch.bfloat16 and r16.topk_probs.dtype == torch.float32
    assert block16.gate.e_score_correction_bias.dtype == torch.float32
    rel = (y16.float() - y32).norm() / y32.norm()
    assert rel < 5e-2


def test_recorded_routing_is_detached_from_the_graph():
    """``last_routing`` keeps no autograd graph alive between training steps; the routing that
    ``return_routing=True`` returns still carries the gradients of p and the router logits."""
    cfg = tiny_config()
    torch.manual_seed(0)
    block = StableLatentMoEBlock(cfg)
    block.record_routing = True
    x = torch.randn(5, cfg.hidden_size, requires_grad=True)
    _, routing = block(x, return_routing=True)
    assert routing.topk_probs.requires_grad and routing.router_logits.requires_grad
    kept = block.last_routing
    grads = {name: getattr(kept, name).requires_grad for name in kept._fields}
    assert grads == dict.fromkeys(kept._fields, False)
    assert torch.equal(kept.topk_probs, routing.topk_probs.detach())


def test_rms_norm_formula_and_precision():
    gen = torch.Generator().manual_seed(3)
    x = 3.0 * torch.randn(4, 16, generator=gen, dtype=torch.float64)
    w = 1.0 + 0.2 * torch.randn(16, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(
        modeling.rms_norm(x, w, 1e-5), naive_norm(x, w, 1e-5), rtol=1e-14, atol=0
    )
    torch.testing.assert_close(
        modeling.rms_norm(x, None, 0.5), naive_norm(x, 1.0, 0.5), rtol=1e-14, atol=0
    )
    # bf16 in -> fp32 math (weight applied in fp32) -> bf16 out (one rounding)
    xb, wb = x.bfloat16(), w.bfloat16()
    out = modeling.rms_norm(xb, wb, 1e-5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, naive_norm(xb.float(), wb.float(), 1e-5).bfloat16())


def test_situ_glu_formula_and_precision():
    g = torch.linspace(-60, 60, 241, dtype=torch.float64)
    u = torch.linspace(80, -80, 241, dtype=torch.float64)
    out = modeling.situ_glu(g, u, 4.0, 25.0)
    torch.testing.assert_close(out, naive_situ(g, u, 4.0, 25.0), rtol=1e-14, atol=1e-14)
    assert bool((out.abs() < 100).all())
    # bf16 in -> fp32 math -> bf16 out (one rounding)
    gb, ub = g.bfloat16(), u.bfloat16()
    out_b = modeling.situ_glu(gb, ub)
    assert out_b.dtype == torch.bfloat16
    assert torch.equal(out_b, naive_situ(gb.float(), ub.float(), 4.0, 25.0).bfloat16())
    # near zero it is SwiGLU to first order
    small = torch.linspace(-1e-3, 1e-3, 11, dtype=torch.float64)
    torch.testing.assert_close(
        modeling.situ_glu(small, small), modeling.swiglu(small, small), rtol=1e-5, atol=1e-12
    )


def test_reference_reexports_the_modeling_code():
    assert reference.StableLatentMoEBlock is modeling.StableLatentMoEBlock
    assert reference.situ_glu is modeling.situ_glu
    assert reference.StableLatentMoEConfig is StableLatentMoEConfig
    assert hf_pkg.StableLatentMoEForCausalLM is modeling.StableLatentMoEForCausalLM


def test_a_star_import_of_reference_gives_the_config_and_all_of_the_modeling_code():
    namespace = {}
    exec("from megatron_latentmoe.reference import *", namespace)
    assert namespace["StableLatentMoEConfig"] is StableLatentMoEConfig
    assert all(namespace[name] is getattr(modeling, name) for name in modeling.__all__)


def test_remote_code_files_import_only_torch_transformers_and_each_other():
    allowed_top = {"torch", "transformers"}
    allowed_top |= {"__future__", "copy", "dataclasses", "functools", "typing"}  # stdlib
    for name in REMOTE_CODE_FILES:
        tree = ast.parse((Path(hf_pkg.__file__).parent / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: only the sibling configuration module
                    assert node.module == "configuration_stable_latentmoe", (name, node.module)
                    continue
                tops = {node.module.split(".")[0]}
            else:
                continue
            assert tops <= allowed_top, (name, tops)


# ========================================================================================= model
def test_checkpoint_names_and_shapes():
    cfg = tiny_config()
    model = StableLatentMoEForCausalLM(cfg)
    sd = model.state_dict()
    d, lat, m_e, n = 16, 8, 12, 6
    hd = cfg.head_dim
    assert sd["model.layers.0.mlp.gate_proj.weight"].shape == (40, d)
    assert not any(k.startswith("model.layers.0.block_sparse_moe") for k in sd)
    p = "model.layers.1.block_sparse_moe."
    expected = {
        p + "gate.weight": (n, d),
        p + "gate.e_score_correction_bias": (n,),
        p + "routed_expert_down_proj.weight": (lat, d),
        p + "routed_expert_norm.weight": (lat,),
        p + "routed_expert_up_proj.weight": (d, lat),
        p + "experts.5.w1.weight": (m_e, lat),
        p + "experts.5.w3.weight": (m_e, lat),
        p + "experts.5.w2.weight": (lat, m_e),
        p + "shared_experts.gate_proj.weight": (2 * m_e, d),
        p + "shared_experts.up_proj.weight": (2 * m_e, d),
        p + "shared_experts.down_proj.weight": (d, 2 * m_e),
        "model.layers.1.self_attn.q_proj.weight": (4 * hd, d),
        "model.layers.1.self_attn.k_proj.weight": (2 * hd, d),
        "model.layers.1.self_attn.v_proj.weight": (2 * hd, d),
        "model.layers.1.self_attn.o_proj.weight": (d, 4 * hd),
        "model.layers.1.input_layernorm.weight": (d,),
        "model.layers.1.post_attention_layernorm.weight": (d,),
        "model.embed_tokens.weight": (61, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (61, d),
    }
    for key, shape in expected.items():
        assert tuple(sd[key].shape) == shape, key
    assert sd[p + "gate.e_score_correction_bias"].dtype == torch.float32
    assert bool((sd[p + "gate.e_score_correction_bias"] == 0).all())
    assert not any("bias" in k and "e_score_correction_bias" not in k for k in sd)
    assert not any("rotary" in k or "inv_freq" in k for k in sd)
    # norm off / no shared experts -> no such weights
    sd2 = StableLatentMoEForCausalLM(
        tiny_config(latent_moe_use_norm=False, num_shared_experts=0)
    ).state_dict()
    assert not any("routed_expert_norm" in k or "shared_experts" in k for k in sd2)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"head_dim": 6, "num_key_value_heads": 1, "rms_norm_eps": 0.1}],
    ids=["gqa", "head_dim=6,mqa,eps=0.1"],
)
def test_model_matches_naive_fp64_forward(overrides):
    cfg = tiny_config(**overrides)
    torch.manual_seed(0)
    model = StableLatentMoEForCausalLM(cfg).double().eval()
    randomize_(model, std=0.25)
    model.model.layers[2].block_sparse_moe.gate.e_score_correction_bias.copy_(
        0.2 * torch.randn(cfg.num_experts, dtype=torch.float64)
    )
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    ref = naive_causal_lm(model, ids)
    for impl in ("sdpa", "eager"):
        model.config._attn_implementation = impl
        out = model(ids, use_cache=False)
        torch.testing.assert_close(out.logits, ref, rtol=1e-10, atol=1e-10)


def test_kv_cache_forward_hidden_states_and_tuple_output():
    cfg = tiny_config()
    torch.manual_seed(0)
    model = StableLatentMoEForCausalLM(cfg).eval()
    randomize_(model, std=0.2)
    ids = torch.randint(3, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        full = model(ids, use_cache=False, output_hidden_states=True)
        assert len(full.hidden_states) == cfg.num_hidden_layers + 1
        first = model(ids[:, :6], use_cache=True)
        cache = modeling._cache_of(first)
        assert isinstance(cache, transformers.cache_utils.Cache) and cache.get_seq_length() == 6
        step = model(ids[:, 6:], cache=cache, use_cache=True)
        tup = model(ids, use_cache=False, return_dict=False)
        labels_loss = model(ids, labels=ids, use_cache=False).loss
        causal = torch.ones(10, 10, dtype=torch.bool).tril()[None, None].expand(2, 1, 10, 10)
        bool_4d = model(ids, attention_mask=causal, use_cache=False).logits
        additive = torch.zeros(2, 1, 10, 10).masked_fill(~causal, torch.finfo(torch.float32).min)
        float_4d = model(ids, attention_mask=additive, use_cache=False).logits
    torch.testing.assert_close(bool_4d, full.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(float_4d, full.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(first.logits, full.logits[:, :6], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.logits, full.logits[:, 6:], rtol=1e-5, atol=1e-5)
    assert isinstance(tup, tuple) and torch.equal(tup[0], full.logits)
    expected_loss = torch.nn.functional.cross_entropy(
        full.logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(labels_loss, expected_loss)


@pytest.fixture(scope="module")
def fp64_model():
    """Tiny fp64 model with large random weights and a QB bias that changes the routing."""
    cfg = tiny_config()
    torch.manual_seed(0)
    model = StableLatentMoEForCausalLM(cfg).double().eval()
    randomize_(model, std=0.3)
    gen = torch.Generator().manual_seed(1)
    for block in model.model.moe_blocks().values():
        block.gate.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.num_experts, generator=gen))
    return model


@pytest.mark.parametrize("blocked", [-math.inf, -1.7976931348623157e308, -1e9, -1e4])
def test_additive_4d_mask_blocks_every_negative_value(fp64_model, blocked):
    """A float 4D mask is additive: 0 = attend, negative = not. The -1e4 / -1e9 of other
    conventions mask as finfo.min does (before, anything above finfo.min / 2 let the future in)."""
    model = fp64_model
    ids = _token_ids(model.config.vocab_size, (2, 6), seed=8)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(2, 1, 6, 6)
    additive = torch.zeros(2, 1, 6, 6, dtype=torch.float64).masked_fill(~causal, blocked)
    with torch.no_grad():
        by_bool = model(ids, attention_mask=causal, use_cache=False).logits
        by_float = model(ids, attention_mask=additive, use_cache=False).logits
        plain = model(ids, use_cache=False).logits
    torch.testing.assert_close(by_bool, plain, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(by_float, by_bool, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_left_padded_batch_equals_each_sequence_alone(fp64_model, impl):
    """A left-padded batch (no position_ids, and with generate()'s position_ids from the mask)
    gives each sequence's logits run alone (fp64, 1e-10), and so does one cached step after it."""
    model = fp64_model
    previous = model.config._attn_implementation
    model.config._attn_implementation = impl
    try:
        _check_left_padding(model)
    finally:
        model.config._attn_implementation = previous


def _check_left_padding(model):
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=gen)
    nxt = torch.randint(3, model.config.vocab_size, (2, 1), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    padded = ids.clone()
    padded[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = [model(ids[:1, 3:], use_cache=False).logits, model(ids[1:], use_cache=False).logits]
        alone_next = [
            model(torch.cat([ids[:1, 3:], nxt[:1]], 1), use_cache=False).logits[:, -1],
            model(torch.cat([ids[1:], nxt[1:]], 1), use_cache=False).logits[:, -1],
        ]
        for pos in (None, positions):
            out = model(padded, attention_mask=mask, position_ids=pos, use_cache=True)
            torch.testing.assert_close(out.logits[:1, 3:], alone[0], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(out.logits[1:], alone[1], rtol=1e-10, atol=1e-10)
            step = model(
                nxt,
                attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1),
                position_ids=None if pos is None else pos[:, -1:] + 1,
                cache=modeling._cache_of(out),
                use_cache=True,
            ).logits[:, -1]
            torch.testing.assert_close(step[:1], alone_next[0], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(step[1:], alone_next[1], rtol=1e-10, atol=1e-10)


def _token_ids(vocab_size: int, shape: tuple, seed: int) -> torch.Tensor:
    """Random ids above the special tokens (0-2), reproducible by ``seed``."""
    return torch.randint(3, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_token_by_token_decoding_with_a_dynamic_cache_equals_the_full_forward(fp64_model):
    model = fp64_model
    ids = _token_ids(model.config.vocab_size, (2, 6), seed=3)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        for with_positions in (False, True):  # no mask either way: positions alone, no packing
            cache = transformers.cache_utils.DynamicCache()
            steps = []
            for i in range(6):
                pos = torch.tensor([[i]]) if with_positions else None
                out = model(ids[:, i : i + 1], position_ids=pos, past_key_values=cache)
                assert modeling._cache_of(out) is cache and cache.get_seq_length() == i + 1
                steps.append(out.logits)
            torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
        # the base model takes the cache as past_key_values too
        base_full = model.model(ids, use_cache=False).last_hidden_state
        cache = modeling._cache_of(model.model(ids[:, :4], use_cache=True))
        rest = model.model(ids[:, 4:], past_key_values=cache).last_hidden_state
    torch.testing.assert_close(rest, base_full[:, 4:], rtol=1e-10, atol=1e-10)


def test_loss_is_the_shifted_cross_entropy_without_the_ignored_labels(fp64_model):
    model = fp64_model
    vocab = model.config.vocab_size
    ids = _token_ids(vocab, (2, 8), seed=4)
    labels = ids.clone()
    labels[0, :3] = -100  # e.g. a prompt
    labels[1, 5] = -100
    with torch.no_grad():
        out = model(ids, labels=labels, use_cache=False)
    logp = torch.log_softmax(out.logits[:, :-1], dim=-1)  # position t predicts label t + 1
    target = labels[:, 1:]
    valid = target != -100
    nll = -logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    expected = nll[valid].sum() / valid.sum()
    assert int(valid.sum()) == 2 * 7 - 2 - 1
    # transformers' ForCausalLMLoss computes in fp32 whatever the logits' dtype
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-6, atol=0)


def test_logits_to_keep(fp64_model):
    model = fp64_model
    ids = _token_ids(model.config.vocab_size, (2, 6), seed=5)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        last3 = model(ids, use_cache=False, logits_to_keep=3).logits
        picked = model(ids, use_cache=False, logits_to_keep=torch.tensor([0, 4])).logits
        every = model(ids, use_cache=False, logits_to_keep=0).logits
    assert last3.shape == (2, 3, model.config.vocab_size)
    # lm_head on fewer rows: the same numbers up to the matmul's rounding
    torch.testing.assert_close(last3, full[:, -3:], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(picked, full[:, [0, 4]], rtol=1e-12, atol=1e-12)
    assert torch.equal(every, full)


def test_hidden_states_are_the_layer_inputs_then_the_normed_output(fp64_model):
    """``output_hidden_states``: the embeddings, each later layer's input, and last the final
    norm's output, which lm_head turns into the logits."""
    model = fp64_model
    cfg = model.config
    ids = _token_ids(cfg.vocab_size, (2, 5), seed=6)
    seen = []
    hooks = [
        layer.register_forward_hook(lambda mod, args, out: seen.append(out[0]))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            out = model(ids, use_cache=False, output_hidden_states=True)
            tup = model(ids, use_cache=False, output_hidden_states=True, return_dict=False)
    finally:
        for hook in hooks:
            hook.remove()
    hs = out.hidden_states
    assert len(hs) == cfg.num_hidden_layers + 1
    assert torch.equal(hs[0], model.model.embed_tokens(ids))
    for i in range(1, cfg.num_hidden_layers):
        assert torch.equal(hs[i], seen[i - 1]), i
    assert torch.equal(hs[-1], model.model.norm(seen[cfg.num_hidden_layers - 1]))
    assert torch.equal(model.lm_head(hs[-1]), out.logits)
    assert torch.equal(tup[0], out.logits) and len(tup[1]) == len(hs)
    assert all(torch.equal(a, b) for a, b in zip(tup[1], hs, strict=True))
    with torch.no_grad():
        assert model(ids, use_cache=False).hidden_states is None  # only when asked for
        base = model.model(ids, use_cache=False, return_dict=False)
        assert isinstance(base, tuple) and torch.equal(base[0], hs[-1])
        model.config.output_hidden_states = True  # the config's default applies when not given
        try:
            assert len(model(ids, use_cache=False).hidden_states) == cfg.num_hidden_layers + 1
        finally:
            model.config.output_hidden_states = False


def test_inputs_embeds_and_input_errors(fp64_model):
    model = fp64_model
    ids = _token_ids(model.config.vocab_size, (1, 4), seed=7)
    with torch.no_grad():
        by_ids = model(ids, use_cache=False).logits
        by_embeds = model(inputs_embeds=model.model.embed_tokens(ids), use_cache=False).logits
    assert torch.equal(by_embeds, by_ids)
    one_of = "StableLatentMoEModel: pass exactly one of input_ids or inputs_embeds"
    with pytest.raises(ValueError, match=one_of):
        model(ids, inputs_embeds=model.model.embed_tokens(ids))
    with pytest.raises(ValueError, match=one_of):
        model()
    with pytest.raises(ValueError, match="must be a transformers Cache .*; got tuple"):
        model(ids, past_key_values=((torch.zeros(1),),))


def test_record_routing_on_the_model():
    cfg = tiny_config()
    model = StableLatentMoEForCausalLM(cfg).eval()
    model.model.set_record_routing(True)
    model(torch.randint(0, cfg.vocab_size, (2, 5)), use_cache=False)
    rec = model.model.recorded_routing()
    assert sorted(rec) == [1, 2]
    assert all(r.topk_indices.shape == (10, 2) for r in rec.values())
    model.model.set_record_routing(False)  # stops recording and drops the routing kept
    model(torch.randint(0, cfg.vocab_size, (2, 5)), use_cache=False)
    assert model.model.recorded_routing() == {1: None, 2: None}


def _save_with_code(model, path: Path) -> None:
    model.save_pretrained(path)
    copy_remote_code(path)


def test_save_pretrained_remote_code_roundtrip(tmp_path):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    cfg = tiny_config()
    torch.manual_seed(0)
    model = StableLatentMoEForCausalLM(cfg).eval()
    randomize_(model, std=0.2)
    model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.copy_(
        torch.randn(cfg.num_experts)
    )
    _save_with_code(model, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= set(REMOTE_CODE_FILES) | {
        "config.json",
        "model.safetensors",
    }
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["model_type"] == "stable_latentmoe"
    assert config_json["auto_map"] == hf_pkg.AUTO_MAP

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(loaded).__name__ == "StableLatentMoEForCausalLM"
    assert type(loaded) is not StableLatentMoEForCausalLM  # really the copied remote code
    ids = torch.randint(3, cfg.vocab_size, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    sd_a, sd_b = model.state_dict(), loaded.state_dict()
    assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)

    loaded_cfg = AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
    assert loaded_cfg.num_experts == cfg.num_experts and loaded_cfg.hidden_act == "situ"
    base = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(base).__name__ == "StableLatentMoEModel"


def test_generate_greedy_with_and_without_cache_and_left_padding():
    cfg = tiny_config()
    torch.manual_seed(0)
    model = StableLatentMoEForCausalLM(cfg).eval()
    randomize_(model, std=0.3)
    ids = torch.randint(3, cfg.vocab_size, (2, 6))
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        with_cache = model.generate(ids, use_cache=True, **kw)
        without_cache = model.generate(ids, use_cache=False, **kw)
        static_cache = model.generate(ids, cache_implementation="static", **kw)
    assert with_cache.shape == (2, 14)
    assert torch.equal(with_cache, without_cache)
    assert torch.equal(with_cache, static_cache)

    # left-padded batch == each prompt alone
    short = torch.randint(3, cfg.vocab_size, (1, 3))
    batch = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)
    batch = torch.cat([batch, ids[:1]], dim=0)
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    with torch.no_grad():
        padded = model.generate(batch, attention_mask=mask, **kw)
        alone_short = model.generate(short, **kw)
        alone_long = model.generate(ids[:1], **kw)
    assert torch.equal(padded[0, 3:], alone_short[0])
    assert torch.equal(padded[1], alone_long[0])


def test_e_score_correction_bias_stays_fp32_through_bf16_save_and_load(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config()
    torch.manual_seed(0)
    model = StableLatentMoEForCausalLM(cfg)
    bias = torch.tensor([0.1234567, -1e-4 + 3e-9, 0.3333333, 2.0000002, -0.7777777, 1e-7])
    assert not torch.equal(bias.bfloat16().float(), bias)  # not representable in bf16
    key = "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"
    model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.copy_(bias)
    model = model.to(torch.bfloat16)
    gate = model.model.layers[1].block_sparse_moe.gate
    assert gate.weight.dtype == torch.bfloat16
    assert gate.e_score_correction_bias.dtype == torch.float32 and torch.equal(
        gate.e_score_correction_bias, bias
    )

    _save_with_code(model, tmp_path)
    stored = safetensors_torch.load_file(tmp_path / "model.safetensors")
    assert stored[key].dtype == torch.float32 and torch.equal(stored[key], bias)
    assert (
        stored["model.layers.1.block_sparse_moe.routed_expert_up_proj.weight"].dtype
        == torch.bfloat16
    )

    # an fp64 detour does not lose it either
    assert torch.equal(
        model.double().bfloat16().model.layers[1].block_sparse_moe.gate.e_score_correction_bias,
        bias,
    )
    for kwargs in ({"dtype": torch.bfloat16}, {}, {"dtype": torch.float32}):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, **kwargs)
        b = loaded.state_dict()[key]
        assert b.dtype == torch.float32 and torch.equal(b, bias), kwargs
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, trust_remote_code=True, dtype=torch.bfloat16
    )
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        out = loaded(torch.randint(3, cfg.vocab_size, (1, 4))).logits
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out.float()).all())


def test_tied_word_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(tie_word_embeddings=True)
    model = StableLatentMoEForCausalLM(cfg).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    _save_with_code(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(3, cfg.vocab_size, (1, 5))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    untied = StableLatentMoEForCausalLM(tiny_config())
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def test_weights_missing_from_a_checkpoint_get_the_documented_init(tmp_path):
    """``_init_weights`` on load: linears, embeddings and the router ~ N(0, initializer_range),
    norm gains 1, QB bias 0 (fp32); the weights that are there load unchanged."""
    cfg = tiny_config(initializer_range=0.5)
    torch.manual_seed(0)
    model = StableLatentMoEForCausalLM(cfg)
    randomize_(model)
    p = "model.layers.1.block_sparse_moe."
    model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.fill_(0.7)
    model.save_pretrained(tmp_path)
    stored = safetensors_torch.load_file(tmp_path / "model.safetensors")
    normal = ["lm_head.weight", "model.embed_tokens.weight", p + "gate.weight"]
    normal.append("model.layers.0.self_attn.q_proj.weight")
    ones = ["model.norm.weight", p + "routed_expert_norm.weight"]
    ones.append("model.layers.2.post_attention_layernorm.weight")
    for key in [*normal, *ones, p + "gate.e_score_correction_bias"]:
        del stored[key]
    safetensors_torch.save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    torch.manual_seed(1)
    loaded = StableLatentMoEForCausalLM.from_pretrained(tmp_path).state_dict()
    for key in normal:
        w = loaded[key]
        assert abs(w.mean().item()) < 0.1 and 0.4 < w.std().item() < 0.6, key
    for key in ones:
        assert torch.equal(loaded[key], torch.ones_like(loaded[key])), key
    bias = loaded[p + "gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.zeros(cfg.num_experts))
    assert all(torch.equal(loaded[k], v) for k, v in stored.items())


# ======================================================================================== config
def test_config_defaults_are_the_k3_values():
    c = StableLatentMoEConfig()
    assert (c.hidden_size, c.routed_expert_hidden_size, c.moe_intermediate_size) == (
        7168,
        3584,
        3072,
    )
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (896, 16, 2)
    assert (c.num_hidden_layers, c.first_k_dense_replace, c.vocab_size, c.rms_norm_eps) == (
        93,
        1,
        163840,
        1e-5,
    )
    assert (c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta) == (
        "situ",
        4.0,
        25.0,
    )
    assert (c.moe_router_activation_func, c.moe_renormalize, c.topk_method, c.num_expert_group) == (
        "sigmoid",
        True,
        "noaux_tc",
        1,
    )
    assert c.latent_moe_use_norm is True and c.routed_scaling_factor == 1.0
    assert c.tie_word_embeddings is False and c.head_dim == 7168 // 64
    assert c.get_shared_expert_intermediate_size() == 6144
    assert c.auto_map == hf_pkg.AUTO_MAP
    # the keys outside fields.FIELDS (test_fields.py pins the others' defaults)
    assert (c.initializer_range, c.use_cache, c.attention_dropout) == (0.02, True, 0.0)
    assert c.output_router_logits is False


@pytest.mark.parametrize(
    "key,value,allowed",
    [
        ("hidden_act", "gelu", "situ"),
        ("num_experts_per_token", 7, "num_experts=6"),
        ("num_expert_group", 2, "1"),
        ("moe_router_activation_func", "softmax", "sigmoid"),
        ("topk_method", "greedy", "noaux_tc"),
        ("num_key_value_heads", 3, "divisor"),
        ("activation_situ_beta", 0.0, "positive"),
        ("routed_scaling_factor", -1.0, "positive"),
        ("num_shared_experts", -1, ">= 0"),
        ("latent_moe_use_norm", "yes", "bool"),
        ("attention_dropout", 1.5, "[0, 1)"),
        ("attention_dropout", 1.0, "[0, 1)"),
        ("attention_dropout", -0.1, "[0, 1)"),
        ("vocab_size", 0, "a positive integer"),
        ("hidden_size", 16.0, "a positive integer"),
        ("hidden_size", "16", "a positive integer"),
        ("intermediate_size", -40, "a positive integer"),
        ("num_hidden_layers", 0, "a positive integer"),
        ("num_attention_heads", 0, "a positive integer"),
        ("num_attention_heads", "4", "a positive integer"),
        ("num_key_value_heads", 0, "a positive integer"),
        ("head_dim", 0, "a positive integer"),
        ("head_dim", 7, "an even integer"),
        ("routed_expert_hidden_size", 8.0, "a positive integer"),
        ("num_experts", 0, "a positive integer"),
        ("num_experts_per_token", True, "a positive integer"),
        ("moe_intermediate_size", 0, "a positive integer"),
        ("rope_theta", 0.0, "a positive finite number"),
        ("rms_norm_eps", True, "a positive finite number"),
        ("activation_situ_linear_beta", "25", "a positive finite number"),
        # inf was taken: eps inf zeroes every norm's output, a scaling factor inf gives NaN logits
        ("rms_norm_eps", float("inf"), "a positive finite number"),
        ("routed_scaling_factor", float("inf"), "a positive finite number"),
        # torch's normal_ refused these at model construction, a traceback naming no key
        ("initializer_range", -0.02, "a finite number >= 0"),
        ("initializer_range", "0.02", "a finite number >= 0"),
        ("initializer_range", float("inf"), "a finite number >= 0"),  # torch filled inf weights
        ("max_position_embeddings", 0, "a positive integer"),
        # a truthy string was taken as True
        ("use_cache", "no", "a bool"),
        ("tie_word_embeddings", "yes", "a bool"),
        ("first_k_dense_replace", -1, ">= 0"),
        ("first_k_dense_replace", 1.0, ">= 0"),
        ("moe_renormalize", 1, "a bool"),
        ("output_router_logits", "true", "a bool"),
        ("attention_dropout", False, "[0, 1)"),
        ("attention_dropout", "0.1", "[0, 1)"),
        ("rope_parameters", "linear", "a dict or None"),
        ("rope_scaling", ["linear", 4.0], "a dict or None"),
    ],
)
def test_config_validation_errors(key, value, allowed):
    with pytest.raises(ValueError) as err:
        tiny_config(**{key: value})
    msg = str(err.value)
    assert key in msg and repr(value) in msg and allowed in msg


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
        # not numbers: float() raised its own error, naming no key
        {"rope_parameters": {"rope_type": "default", "rope_theta": "x"}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": [10000.0]}},
    ],
)
def test_config_refuses_rope_settings_the_model_would_ignore(overrides):
    """transformers 5 keeps RoPE settings in ``rope_parameters`` (``rope_scaling`` is converted
    into it); the model uses plain RoPE with ``rope_theta``, so anything else must be an error,
    not a silently different model."""
    with pytest.raises(ValueError) as err:
        tiny_config(**overrides)
    assert str(err.value).startswith("StableLatentMoEConfig: rope_parameters={")


def test_config_accepts_default_rope_parameters():
    c = tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert c.rope_theta == 10000.0


def test_config_edge_values_and_an_own_auto_map():
    """The edges of the ranges are allowed: initializer_range 0 (an all-zero init of the
    projections), attention_dropout 0. Each config's default auto_map is its own copy: editing
    one leaves the next config's default alone."""
    model = StableLatentMoEForCausalLM(tiny_config(initializer_range=0.0, attention_dropout=0.0))
    assert not model.lm_head.weight.any() and not model.model.embed_tokens.weight.any()
    c = tiny_config()
    c.auto_map["AutoConfig"] = "mine.Config"
    assert tiny_config().auto_map == hf_pkg.AUTO_MAP
    assert hf_pkg.AUTO_MAP["AutoConfig"] == "configuration_stable_latentmoe.StableLatentMoEConfig"


def test_config_derived_sizes():
    """head_dim = hidden_size // num_attention_heads unless given; GQA defaults to MHA; the one
    shared-expert MLP is N_s * m_e wide; layers from first_k_dense_replace on are MoE."""
    assert tiny_config().head_dim == 16 // 4
    assert tiny_config(num_attention_heads=1, num_key_value_heads=1).head_dim == 16
    c = tiny_config(head_dim=6)
    assert c.head_dim == 6
    sd = StableLatentMoEForCausalLM(c).state_dict()
    assert tuple(sd["model.layers.0.self_attn.q_proj.weight"].shape) == (4 * 6, 16)
    assert tuple(sd["model.layers.0.self_attn.k_proj.weight"].shape) == (2 * 6, 16)
    assert tiny_config(num_key_value_heads=None).num_key_value_heads == 4
    assert tiny_config(num_experts_per_token=6).num_experts_per_token == 6  # k = n is allowed
    assert tiny_config(num_shared_experts=3).get_shared_expert_intermediate_size() == 36
    assert tiny_config(num_shared_experts=0).get_shared_expert_intermediate_size() == 0
    assert [tiny_config(first_k_dense_replace=2).is_moe_layer(i) for i in range(3)] == [
        False,
        False,
        True,
    ]


def test_config_round_trip_keeps_every_field(tmp_path):
    """to_dict -> from_dict and save_pretrained -> from_pretrained give the same config: the
    keys listed below set off tiny_config's values, the special token ids, a caller's
    auto_map."""
    auto_map = {"AutoConfig": "elsewhere.Config"}
    c = tiny_config(
        head_dim=6,
        max_position_embeddings=48,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.05,
        use_cache=False,
        tie_word_embeddings=True,
        hidden_act="silu",
        activation_situ_beta=3.0,
        activation_situ_linear_beta=20.0,
        latent_moe_use_norm=False,
        moe_renormalize=False,
        routed_scaling_factor=2.5,
        num_experts_per_token=3,
        num_shared_experts=1,
        first_k_dense_replace=2,
        attention_dropout=0.25,
        output_router_logits=True,
        auto_map=auto_map,
    )
    d = c.to_dict()
    assert (d["bos_token_id"], d["eos_token_id"], d["pad_token_id"]) == (1, 2, 0)
    assert d["auto_map"] == auto_map and d["model_type"] == "stable_latentmoe"
    assert StableLatentMoEConfig.from_dict(d).to_dict() == d
    c.save_pretrained(tmp_path)
    assert StableLatentMoEConfig.from_pretrained(tmp_path).to_dict() == d
    defaults = tiny_config().to_dict()
    assert {k for k in d if d[k] != defaults[k]} == {
        "head_dim",
        "max_position_embeddings",
        "rope_theta",
        "rms_norm_eps",
        "initializer_range",
        "use_cache",
        "tie_word_embeddings",
        "hidden_act",
        "activation_situ_beta",
        "activation_situ_linear_beta",
        "latent_moe_use_norm",
        "moe_renormalize",
        "routed_scaling_factor",
        "num_experts_per_token",
        "num_shared_experts",
        "first_k_dense_replace",
        "attention_dropout",
        "output_router_logits",
        "auto_map",
    }
