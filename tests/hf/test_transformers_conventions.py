"""The exported model behaves like a first-class transformers model (issue #13).

Modelled on what transformers checks for its own MoE decoders (ModelTesterMixin /
GenerationTesterMixin / CausalLMModelTest): attention outputs, generate dict outputs for every
decoding strategy, gradient checkpointing, padding-free batches, run-time attention switching,
custom 4D masks, static cache and compile. Every check compares numbers against an independent
computation (naive softmax attention, the unpacked run, the run without checkpointing, ...).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DataCollatorWithFlattening  # noqa: E402
from transformers.cache_utils import DynamicCache, StaticCache  # noqa: E402

from megatron_latentmoe.hf import (  # noqa: E402
    AUTO_MAP,
    REMOTE_CODE_FILES,
    StableLatentMoEForCausalLM,
    copy_remote_code,
)
from megatron_latentmoe.hf import modeling_stable_latentmoe as modeling  # noqa: E402
from tests.unit.test_hf_modeling import randomize_, tiny_config  # noqa: E402

pytestmark = pytest.mark.timeout(300)

HF_DIR = Path(modeling.__file__).parent


def make_model(
    impl: str = "sdpa", dtype=torch.float64, seed: int = 0, **overrides
) -> StableLatentMoEForCausalLM:
    """Tiny model with large random weights and a non-zero QB bias (the bias changes routing)."""
    cfg = tiny_config(**overrides)
    cfg._attn_implementation = impl
    torch.manual_seed(seed)
    model = StableLatentMoEForCausalLM(cfg).to(dtype).eval()
    randomize_(model, std=0.3, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for block in model.model.moe_blocks().values():
        block.gate.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.num_experts, generator=gen))
    return model


def naive_attention_probs(model, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """[B, H, S, S] causal softmax attention of one layer, from its input hidden states (fp64)."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    p = f"model.layers.{layer_idx}."
    bsz, seq, _ = hidden.shape
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = hidden.double()
    h = (
        x
        / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        * sd[p + "input_layernorm.weight"]
    )
    q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(bsz, seq, heads, hd)
    k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(bsz, seq, kv, hd)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]

    def rope(t):
        t1, t2 = t[..., : hd // 2], t[..., hd // 2 :]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)

    q, k = rope(q), rope(k)
    k = k.repeat_interleave(heads // kv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


# ============================================================================ attention outputs
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_output_attentions_are_the_softmax_weights(impl, caplog):
    model = make_model(impl)
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (2, 7))
    logging.Logger.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING), torch.no_grad():
        out = model(ids, output_attentions=True, output_hidden_states=True, use_cache=False)
        plain = model(ids, use_cache=False)
        tup = model(
            ids,
            output_attentions=True,
            output_hidden_states=True,
            use_cache=False,
            return_dict=False,
        )
        base = model.model(ids, output_attentions=True, use_cache=False)
    fallback = [r for r in caplog.records if "returns no attention weights" in r.getMessage()]
    assert len(fallback) == (1 if impl == "sdpa" else 0)  # SDPA: one clear warning, then eager
    assert plain.attentions is None
    assert len(out.attentions) == cfg.num_hidden_layers
    for i, weights in enumerate(out.attentions):
        assert (
            weights.shape == (2, cfg.num_attention_heads, 7, 7) and weights.dtype == torch.float64
        )
        torch.testing.assert_close(
            weights, naive_attention_probs(model, out.hidden_states[i], i), rtol=1e-10, atol=1e-12
        )
    torch.testing.assert_close(out.logits, plain.logits, rtol=1e-10, atol=1e-10)
    # the tuple form carries them too, after the logits and the hidden states
    assert torch.equal(tup[0], out.logits) and all(
        torch.equal(a, b) for a, b in zip(tup[-1], out.attentions, strict=True)
    )
    assert all(torch.equal(a, b) for a, b in zip(base.attentions, out.attentions, strict=True))


def test_output_attentions_with_cache_padding_and_config_default():
    model = make_model("eager")
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    with torch.no_grad():
        first = model(ids, attention_mask=mask, use_cache=True, output_attentions=True)
        cache = modeling._cache_of(first)
        step = model(
            ids[:, :1],
            attention_mask=torch.cat([mask, mask[:, :1]], 1),
            cache=cache,
            use_cache=True,
            output_attentions=True,
        )
    for weights in step.attentions:
        assert weights.shape == (2, cfg.num_attention_heads, 1, 7)
        assert torch.equal(
            weights[0, :, :, :2], torch.zeros_like(weights[0, :, :, :2])
        )  # pads get nothing
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))
    for weights in first.attentions:  # real queries never look at the padding
        assert torch.equal(weights[0, :, 2:, :2], torch.zeros_like(weights[0, :, 2:, :2]))
    model.config.output_attentions = True
    with torch.no_grad():
        assert len(model(ids, use_cache=False).attentions) == cfg.num_hidden_layers


# ============================================================================ generate outputs
GEN = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=0)
STRATEGIES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, top_k=0, temperature=1.0),
    "beam": dict(do_sample=False, num_beams=3),
    "greedy_static_cache": dict(do_sample=False, cache_implementation="static"),
    "greedy_no_cache": dict(do_sample=False, use_cache=False),
}


def _generate(model, ids, seed=0, **kwargs):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(ids, **GEN, **kwargs)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_generate_returns_attentions_and_the_same_tokens(strategy, impl):
    model = make_model(impl)
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (2, 5))
    kw = STRATEGIES[strategy]
    plain = _generate(model, ids, **kw)
    out = _generate(
        model,
        ids,
        return_dict_in_generate=True,
        output_attentions=True,
        output_hidden_states=True,
        output_scores=True,
        **kw,
    )
    assert torch.equal(out.sequences, plain)
    assert len(out.attentions) == len(out.hidden_states) == GEN["max_new_tokens"]
    rows = 2 * kw.get("num_beams", 1)
    for step, per_layer in enumerate(out.attentions):
        assert len(per_layer) == cfg.num_hidden_layers
        no_cache = kw.get("use_cache") is False
        q_len = 5 + step if (step == 0 or no_cache) else 1
        for weights in per_layer:
            assert weights.shape[:3] == (rows, cfg.num_attention_heads, q_len)
            kv = weights.shape[-1]  # the static cache's keys are preallocated
            assert kv == (5 + step if kw.get("cache_implementation") != "static" else kv)
            torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))
    # the first step's weights are those of a plain forward of the prompt
    if rows == 2:
        with torch.no_grad():
            ref = model(ids, output_attentions=True, use_cache=False).attentions
        for got, want in zip(out.attentions[0], ref, strict=True):
            torch.testing.assert_close(got[..., : want.shape[-1]], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_assisted_decoding_with_attentions(impl):
    model = make_model(impl)
    assistant = make_model(impl, seed=3, num_hidden_layers=2)
    ids = torch.randint(3, model.config.vocab_size, (1, 5))
    plain = _generate(model, ids, do_sample=False)
    assisted = _generate(model, ids, do_sample=False, assistant_model=assistant)
    out = _generate(
        model,
        ids,
        do_sample=False,
        assistant_model=assistant,
        return_dict_in_generate=True,
        output_attentions=True,
        output_hidden_states=True,
    )
    assert torch.equal(assisted, plain) and torch.equal(out.sequences, plain)
    assert len(out.attentions) == GEN["max_new_tokens"]
    for step, per_layer in enumerate(out.attentions):
        for weights in per_layer:
            assert weights.shape[:3] == (1, model.config.num_attention_heads, 5 if step == 0 else 1)
            assert weights.shape[-1] == 5 + step
            torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))


# ============================================================================ run-time attention
def test_set_attn_implementation_at_run_time(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    model = make_model("sdpa")
    ids = torch.randint(3, model.config.vocab_size, (2, 6))
    logging.Logger.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING), torch.no_grad():
        sdpa_logits = model(ids).logits
    # without output_attentions SDPA runs as SDPA: no fallback to eager
    assert not [r for r in caplog.records if "returns no attention weights" in r.getMessage()]
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    assert model.model.layers[0].self_attn.config._attn_implementation == "eager"
    logging.Logger.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING), torch.no_grad():
        out = model(ids, output_attentions=True)
    assert not [r for r in caplog.records if "returns no attention weights" in r.getMessage()]
    assert out.attentions is not None
    torch.testing.assert_close(out.logits, sdpa_logits, rtol=1e-10, atol=1e-10)
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    for unsupported in ("flash_attention_2", "flex_attention"):
        with pytest.raises((ValueError, ImportError)):
            model.set_attn_implementation(unsupported)
    # the shipped remote code (loaded from the checkpoint folder) switches as well
    model.save_pretrained(tmp_path)
    copy_remote_code(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, trust_remote_code=True, dtype=torch.float64
    )
    assert (
        type(loaded) is not StableLatentMoEForCausalLM
        and loaded.config._attn_implementation == "sdpa"
    )
    loaded.set_attn_implementation("eager")
    assert loaded.config._attn_implementation == "eager"
    eager = AutoModelForCausalLM.from_pretrained(
        tmp_path, trust_remote_code=True, attn_implementation="eager"
    )
    assert eager.config._attn_implementation == "eager"


# ============================================================================ padding-free
DOC_LENGTHS = (5, 3, 8, 1)


def _docs(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, cfg.vocab_size, (n,), generator=gen) for n in DOC_LENGTHS]


def packed_vs_unpacked_max_diff(model, how: str) -> float:
    """Max |logit difference| between the documents run one by one and packed into one row."""
    docs = _docs(model.config)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=(how == "cu_seq_lens"))
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    # everything the collator gives: input_ids, labels, position_ids (+ cu_seq_lens_q/k, ...)
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        flat = model(batch["input_ids"], position_ids=batch["position_ids"][0], use_cache=False)
        alone = torch.cat([model(d[None], use_cache=False).logits[0] for d in docs])
    assert torch.equal(flat.logits[0], packed)  # 1D position_ids work the same
    assert packed.shape == alone.shape
    return (packed - alone).abs().max().item()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
def test_packed_batch_equals_the_documents_unpacked(impl, how):
    model = make_model(impl, dtype=torch.float32)
    diff = packed_vs_unpacked_max_diff(model, how)
    print(f"packed vs unpacked ({impl}, {how}): max |logit diff| = {diff:.3e}")
    assert diff <= 1e-5
    # and the packing matters: without boundaries the later documents see the earlier ones
    docs = _docs(model.config)
    with torch.no_grad():
        leaky = model(torch.cat(docs)[None], use_cache=False).logits[0]
        alone = torch.cat([model(d[None], use_cache=False).logits[0] for d in docs])
    assert (leaky[DOC_LENGTHS[0] :] - alone[DOC_LENGTHS[0] :]).abs().max() > 1e-2


def test_packed_document_ids_from_both_sources_agree():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    cu = torch.tensor([0, 3, 5, 6, 10], dtype=torch.int32)
    expected = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3, 3, 3]])
    assert torch.equal(modeling.packed_document_ids(10, pos), expected)
    assert torch.equal(modeling.packed_document_ids(10, None, cu).long(), expected)
    assert torch.equal(
        modeling.packed_document_ids(4, torch.arange(7, 11)[None]),
        torch.zeros(1, 4, dtype=torch.long),
    )


def test_custom_4d_mask_packs_documents():
    """A block-diagonal 4D mask (bool or additive) + restarting position_ids == separate runs."""
    model = make_model("sdpa", dtype=torch.float32)
    docs = _docs(model.config)
    total = sum(DOC_LENGTHS)
    doc_of = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(DOC_LENGTHS))
    allowed = (doc_of[:, None] == doc_of[None, :]) & torch.ones(
        total, total, dtype=torch.bool
    ).tril()
    pos = torch.cat([torch.arange(n) for n in DOC_LENGTHS])[None]
    additive = torch.zeros(1, 1, total, total).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        alone = torch.cat([model(d[None], use_cache=False).logits[0] for d in docs])
        for mask in (allowed[None, None], additive):
            got = model(
                torch.cat(docs)[None], attention_mask=mask, position_ids=pos, use_cache=False
            ).logits[0]
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_custom_4d_mask_with_fully_masked_padding_rows(impl):
    """A left-padded causal 4D mask masks the pad queries' whole rows: they are opened (kept
    finite) and the real tokens get the 2D-mask logits (fp64, 1e-10)."""
    model = make_model(impl)
    ids = torch.randint(3, model.config.vocab_size, (2, 6))
    pad = torch.ones_like(ids, dtype=torch.bool)
    pad[0, :2] = False
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & pad[:, None, None, :]
    allowed = allowed & pad[:, None, :, None]  # rows of the pad queries: nothing visible
    with torch.no_grad():
        want = model(ids, attention_mask=pad.long(), use_cache=False).logits
        got = model(ids, attention_mask=allowed, use_cache=False).logits
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got[0, 2:], want[0, 2:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-10)


def _left_padded_causal(pad: torch.Tensor, past: int = 0) -> torch.Tensor:
    """[B, 1, S, past + S] boolean causal mask hiding the keys where ``pad`` [B, past + S] is
    False; the pad queries' rows are left fully masked."""
    total = pad.shape[1]
    causal = torch.ones(total, total, dtype=torch.bool).tril()[past:]
    return causal[None, None] & pad[:, None, None, :] & pad[:, None, past:, None]


def test_custom_4d_mask_wider_than_the_keys_is_cut_to_them():
    """A 4D mask with columns past the keys: they are dropped, the same in eager and SDPA (fp64,
    1e-10), and the real tokens get the 2D-mask logits. A pad query that sees only the extra
    columns is opened after the cut (else its NaN row poisons the later layers)."""
    ids = torch.randint(3, 61, (2, 6), generator=torch.Generator().manual_seed(3))
    pad = torch.ones_like(ids, dtype=torch.bool)
    pad[0, :2] = False
    wide = torch.cat([_left_padded_causal(pad), torch.ones(2, 1, 6, 3, dtype=torch.bool)], -1)
    logits = {}
    for impl in ("eager", "sdpa"):
        model = make_model(impl)
        with torch.no_grad():
            logits[impl] = model(ids, attention_mask=wide, use_cache=False).logits
            want = model(ids, attention_mask=pad.long(), use_cache=False).logits
        assert bool(torch.isfinite(logits[impl]).all())
        torch.testing.assert_close(logits[impl][0, 2:], want[0, 2:], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(logits[impl][1], want[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(logits["eager"], logits["sdpa"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_static_cache_with_exact_width_4d_masks_equals_the_dynamic_cache(impl):
    """4D masks as wide as the past + current tokens, narrower than the static cache's slots:
    the unwritten slots are not attended, so a left-padded prompt and two decoding steps give the
    real tokens the DynamicCache logits, which are the 2D-mask ones (fp64, 1e-10)."""
    model = make_model(impl)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=gen)
    pad = torch.ones_like(ids, dtype=torch.bool)
    pad[0, :2] = False
    # (new tokens, their mask over the past + new ones)
    steps = [(slice(0, 5), _left_padded_causal(pad[:, :5]))]
    steps += [(slice(n, n + 1), _left_padded_causal(pad[:, : n + 1], past=n)) for n in (5, 6)]
    runs = {}
    with torch.no_grad():
        for name, cache in (
            ("static", StaticCache(config=model.config, max_cache_len=16)),
            ("dynamic", DynamicCache(config=model.config)),
        ):
            step_logits = [model(ids[:, s], attention_mask=m, cache=cache).logits for s, m in steps]
            runs[name] = torch.cat(step_logits, 1)
        want = model(ids, attention_mask=pad.long(), use_cache=False).logits
    for got in (runs["static"], runs["dynamic"]):  # the pad queries' logits are never read
        torch.testing.assert_close(got[0, 2:], want[0, 2:], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("shape", "dtype", "expected"),
    [
        # narrower than the past + new keys
        ((2, 1, 3, 6), torch.bool, r"shape \(2, 1, 3, 6\) .* \(2 or 1, 4 or 1, 3, >= 7\)"),
        ((2, 1, 2, 9), torch.bool, r"shape \(2, 1, 2, 9\) "),  # query length
        ((3, 1, 3, 7), torch.bool, r"shape \(3, 1, 3, 7\) "),  # batch
        ((2, 2, 3, 7), torch.bool, r"shape \(2, 2, 3, 7\) "),  # heads
        ((2, 3, 7), torch.bool, r"shape \(2, 3, 7\) .* a 2D padding mask or a 4D mask"),
        ((2, 1, 3), torch.bool, r"shape \(2, 1, 3\) "),  # 3D, its dims as a 4D mask's first
        ((2, 1, 3, 7), torch.long, r"dtype torch.int64 .* torch.bool .* float"),
    ],
)
def test_attention_mask_of_a_wrong_shape_or_dtype_is_refused_in_one_line(shape, dtype, expected):
    """With 4 cached tokens and 3 new ones (batch 2, 4 heads) a mask must be 2D or
    [2 or 1, 4 or 1, 3, >= 7], boolean or float (an integer 0/1 mask is ambiguous)."""
    model = make_model("eager")
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :4], cache=cache)
        with pytest.raises(ValueError, match=expected) as err:
            model(ids[:, 4:], attention_mask=torch.ones(shape, dtype=dtype), cache=cache)
    assert "\n" not in str(err.value) and "attention_mask" in str(err.value)
    assert cache.get_seq_length() == 4  # refused before any layer wrote to the cache


# ============================================================================ static cache, compile
def test_static_cache_forward_equals_full_forward():
    model = make_model("sdpa")
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        first = model(ids[:, :5], cache=cache, use_cache=True).logits
        rest = [model(ids[:, i : i + 1], cache=cache, use_cache=True).logits for i in range(5, 9)]
    torch.testing.assert_close(torch.cat([first, *rest], 1), full, rtol=1e-10, atol=1e-10)


def test_static_cache_with_left_padding_equals_each_sequence_alone():
    """The 2D padding mask is shorter than the preallocated keys: padded to their length, the
    prompt and one decoding step give each row's logits run alone (fp64, 1e-10)."""
    model = make_model("sdpa")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=gen)
    nxt = torch.randint(3, model.config.vocab_size, (2, 1), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    cache = StaticCache(config=model.config, max_cache_len=16)  # > twice the 6 + 1 tokens
    with torch.no_grad():
        prompt = model(ids, attention_mask=mask, cache=cache, use_cache=True).logits
        step = model(nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1), cache=cache)
        for row, start in ((0, 2), (1, 0)):
            alone = model(torch.cat([ids[row : row + 1, start:], nxt[row : row + 1]], 1)).logits
            torch.testing.assert_close(prompt[row, start:], alone[0, :-1], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(step.logits[row, -1], alone[0, -1], rtol=1e-10, atol=1e-10)


def test_greedy_generate_of_a_left_padded_batch_equals_each_prompt_alone():
    """What the README tells a user batching prompts of different lengths (a tokenizer loaded
    with ``padding_side="left"``): greedy ``generate`` of the left-padded batch gives each
    prompt's own continuation, token for token (fp64; with the padding unmasked it does not)."""
    model = make_model("sdpa")
    gen = torch.Generator().manual_seed(7)
    long, short = (torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in (7, 4))
    pad = model.config.eos_token_id
    ids = torch.stack([long, torch.cat([torch.full((3,), pad), short])])
    mask = (torch.arange(7) >= torch.tensor([[0], [3]])).long()
    greedy = dict(do_sample=False, max_new_tokens=6, pad_token_id=pad)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **greedy)[:, 7:]
        alone = [model.generate(p[None], **greedy)[0, len(p) :] for p in (long, short)]
    assert batch.tolist() == [a.tolist() for a in alone]


@contextlib.contextmanager
def _no_torch_function_modes():
    """Run without the torch-function modes an earlier in-process Megatron test left entered
    (compat's ``CudaToCpuDeviceMode`` stays on for the rest of the pytest process); dynamo
    mis-traces factory calls through it. An HF user's process has no such mode."""
    popped = []
    while torch._C._len_torch_function_stack():
        popped.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


def test_torch_compile_matches_eager_without_recompiling_per_routing():
    """torch.compile (not fullgraph) works; the expert loop runs eagerly (one graph break), so new
    routings of same-shaped inputs reuse the graphs (traced, the loop's host-side group sizes
    would add graphs for every new routing); fullgraph is honestly refused."""
    with _no_torch_function_modes():
        _check_torch_compile()


def _check_torch_compile():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = make_model("sdpa", dtype=torch.float32)
    compiled = torch.compile(model, backend="eager")
    graphs = []
    try:
        with torch.no_grad():
            for seed in range(4):
                gen = torch.Generator().manual_seed(seed)
                ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=gen)
                got = compiled(ids, use_cache=False).logits
                graphs.append(counters["stats"]["unique_graphs"])
                want = model(ids, use_cache=False).logits
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert graphs[3] == graphs[1], graphs  # calls 3 and 4 (new routings) compiled nothing
            assert model._can_compile_fullgraph is False
            torch._dynamo.reset()  # else the cached graphs above would be reused
            with pytest.raises(Exception, match="(?i)graph break|compiler.disable|unsupported"):
                torch.compile(model, backend="eager", fullgraph=True)(ids, use_cache=False)
    finally:
        torch._dynamo.reset()


# ============================================================================ flags
def test_capability_flags_are_the_tested_ones():
    cls = modeling.StableLatentMoEPreTrainedModel
    assert cls.supports_gradient_checkpointing is True
    assert cls._supports_sdpa is True
    assert cls._supports_flash_attn is False and cls._supports_flex_attn is False
    assert cls._can_compile_fullgraph is False
    assert cls._supports_attention_backend is False and cls._supports_context_parallel is False
    assert StableLatentMoEForCausalLM._can_set_attn_implementation() is True
    # device_map="auto" never splits a decoder layer (its residual adds need one device)
    assert cls._no_split_modules == [modeling.StableLatentMoEDecoderLayer.__name__]
    assert cls._keep_in_fp32_modules_strict == ["e_score_correction_bias"]


# ============================================================================ training
def _loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(use_reentrant):
    model = make_model("sdpa").train()
    ids = torch.randint(3, model.config.vocab_size, (2, 8))
    block = model.model.layers[1].block_sparse_moe
    calls = []
    block.register_forward_pre_hook(lambda *_: calls.append(1))
    loss_ref, grads_ref = _loss_and_grads(model, input_ids=ids, labels=ids, use_cache=False)
    assert len(calls) == 1
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": use_reentrant}
    )
    assert model.is_gradient_checkpointing and all(
        layer.gradient_checkpointing for layer in model.model.layers
    )
    calls.clear()
    loss, grads = _loss_and_grads(
        model, input_ids=ids, labels=ids
    )  # use_cache defaults to True: turned off
    assert len(calls) == 2  # the MoE block ran again in the backward
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-12)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-9, atol=1e-12, msg=name)
    # router and experts are trained; the QB bias is a buffer with no gradient
    assert not any("e_score_correction_bias" in n for n, _ in model.named_parameters())
    assert not block.gate.e_score_correction_bias.requires_grad
    assert grads["model.layers.1.block_sparse_moe.gate.weight"].abs().sum() > 0
    used = block.gate(model.model.embed_tokens(ids)).topk_indices.unique()  # any experts will do
    assert any(
        grads[f"model.layers.1.block_sparse_moe.experts.{int(e)}.w1.weight"].abs().sum() > 0
        for e in used
    )
    model.gradient_checkpointing_disable()
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_dropout_applies_in_training_only(impl):
    """attention_dropout=0 (the default): train mode gives the eval logits; 0.5: train mode
    differs, eval mode gives the dropout-free logits."""
    model = make_model(impl)
    ids = torch.randint(3, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        torch.manual_seed(0)
        trained = make_model(impl).train()(ids, use_cache=False).logits
        torch.testing.assert_close(trained, ref, rtol=1e-12, atol=1e-12)
        dropping = make_model(impl, attention_dropout=0.5)
        torch.testing.assert_close(dropping(ids, use_cache=False).logits, ref, rtol=0, atol=0)
        torch.manual_seed(0)
        assert (dropping.train()(ids, use_cache=False).logits - ref).abs().max() > 1e-2


def test_checkpointing_drops_the_cache_only_when_gradients_are_recorded():
    """Training with gradient checkpointing returns no cache (recomputation cannot refill it) and
    leaves a cache passed in as it was; without checkpointing, or under no_grad in train mode, or
    in eval mode, there is one."""
    model = make_model("sdpa").train()
    ids = torch.randint(3, model.config.vocab_size, (2, 5))
    assert modeling._cache_of(model(ids, use_cache=True)).get_seq_length() == 5
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert modeling._cache_of(model(ids, use_cache=True)) is None
    given = DynamicCache()
    with torch.no_grad():
        model(ids[:, :3], cache=given, use_cache=True)
        plain = model(ids, use_cache=False).logits
    out = model(ids, cache=given, use_cache=True)  # the cache passed in is set aside: unused
    assert modeling._cache_of(out) is None and given.get_seq_length() == 3
    torch.testing.assert_close(out.logits, plain, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        assert modeling._cache_of(model(ids, use_cache=True)).get_seq_length() == 5
    model.eval()
    assert modeling._cache_of(model(ids, use_cache=True)).get_seq_length() == 5
    model.gradient_checkpointing_disable()


def test_fine_tuning_on_the_embedded_corpus_with_checkpointing_and_packing():
    """A plain loop (``Trainer`` needs ``accelerate``, not a dependency): 40 AdamW steps on packed
    batches of the shipped corpus with gradient checkpointing; the held-out loss goes down, the
    router and experts move, the exported QB bias does not."""
    from transformers import AutoTokenizer

    from megatron_latentmoe.data.corpus import default_tokenizer_dir, iter_corpus_texts

    tok = AutoTokenizer.from_pretrained(default_tokenizer_dir())
    texts = []
    for text in iter_corpus_texts():
        texts.append(tok(text, truncation=True, max_length=48)["input_ids"])
        if len(texts) == 72:
            break
    cfg = tiny_config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        routed_expert_hidden_size=16,
        num_experts=8,
        moe_intermediate_size=16,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = StableLatentMoEForCausalLM(cfg)
    gate = model.model.layers[1].block_sparse_moe.gate
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, cfg.num_experts))
    bias0 = gate.e_score_correction_bias.clone()
    router0 = gate.weight.detach().clone()
    expert0 = torch.cat(
        [
            p.detach().flatten().clone()
            for p in model.model.layers[1].block_sparse_moe.experts.parameters()
        ]
    )
    collate = DataCollatorWithFlattening()
    held_out = collate([{"input_ids": t} for t in texts[64:]])
    train = [collate([{"input_ids": t} for t in texts[i : i + 4]]) for i in range(0, 64, 4)]

    def held_out_loss():
        model.eval()
        with torch.no_grad():
            return model(**held_out, use_cache=False).loss.item()

    before = held_out_loss()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(40):
        loss = model(**train[step % len(train)]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    after = held_out_loss()
    print(f"fine-tuning held-out loss: {before:.4f} -> {after:.4f} (drop {before - after:.4f})")
    assert after < before - 0.5
    assert (
        torch.equal(gate.e_score_correction_bias, bias0)
        and gate.e_score_correction_bias.dtype == torch.float32
    )
    assert (gate.weight.detach() - router0).abs().max() > 1e-3
    expert1 = torch.cat(
        [p.detach().flatten() for p in model.model.layers[1].block_sparse_moe.experts.parameters()]
    )
    assert (expert1 - expert0).abs().max() > 1e-3


# ============================================================================ vocabulary / loss
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_resize_token_embeddings_keeps_the_old_logits_and_round_trips(tmp_path, tie):
    """``resize_token_embeddings`` (e.g. after adding special tokens): the old tokens' logits are
    unchanged, the loss runs over the new vocabulary (a new id as label), tying is kept, and
    save_pretrained + from_pretrained (remote code) gives the resized model back."""
    from transformers import AutoModelForCausalLM

    model = make_model("sdpa", tie_word_embeddings=tie)
    old, new = model.config.vocab_size, model.config.vocab_size + 9
    ids = torch.randint(3, old, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
        model.resize_token_embeddings(new, mean_resizing=False)
        resized = torch.cat([ids, torch.full((2, 1), new - 1)], dim=1)  # a new token id
        out = model(resized, labels=resized, use_cache=False)
    assert model.config.vocab_size == new and out.logits.shape == (2, 7, new)
    assert model.get_output_embeddings().weight.shape == (new, model.config.hidden_size)
    torch.testing.assert_close(out.logits[:, :6, :old], before, rtol=1e-12, atol=1e-12)
    expected = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, new).float(), resized[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=0)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied is tie
    model.save_pretrained(tmp_path)
    copy_remote_code(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, trust_remote_code=True, dtype=torch.float64
    )
    assert loaded.config.vocab_size == new
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) is tie
    saved, back = model.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys()
    assert all(torch.equal(saved[k].to(back[k].dtype), back[k]) for k in saved)
    with torch.no_grad():  # the same weights; fp64 GEMMs may sum in another order (alignment)
        logits = loaded.eval()(resized, use_cache=False).logits
    torch.testing.assert_close(logits, out.logits, rtol=1e-12, atol=1e-12)


def test_save_pretrained_writes_the_remote_code_its_config_names(tmp_path):
    """A model built from this package saves as one loaded with ``trust_remote_code`` does:
    ``save_pretrained`` (and so ``Trainer.save_model`` and a PEFT ``merge_and_unload()`` model's)
    writes the two remote-code files that config.json's ``auto_map`` names, so the folder loads
    with ``AutoModelForCausalLM`` / ``AutoModel`` as it is (before, it held config.json, whose
    ``auto_map`` named files it did not have: from_pretrained failed with an OSError)."""
    from transformers import AutoModel, AutoModelForCausalLM

    model = make_model("sdpa", dtype=torch.float32)
    ids = torch.randint(
        3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(6)
    )
    model.save_pretrained(tmp_path / "lm")
    model.model.save_pretrained(tmp_path / "base")
    with torch.no_grad():
        expected = {"lm": model(ids).logits, "base": model.model(ids).last_hidden_state}
    for sub, auto in (("lm", AutoModelForCausalLM), ("base", AutoModel)):
        folder = tmp_path / sub
        for name in REMOTE_CODE_FILES:
            assert (folder / name).read_bytes() == (HF_DIR / name).read_bytes(), name
        assert json.loads((folder / "config.json").read_text())["auto_map"] == AUTO_MAP
        loaded = auto.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
        assert type(loaded).__module__ != modeling.__name__  # the copied code, not this package
        with torch.no_grad():
            out = loaded(ids)
        assert torch.equal(out[0], expected[sub])


def test_loss_divides_by_num_items_in_batch_for_gradient_accumulation():
    """``Trainer`` with gradient accumulation passes ``num_items_in_batch`` (the label count of
    all micro-batches) to a model whose forward takes ``**kwargs``, and then does not divide the
    loss by the accumulation steps itself: the loss must be the summed token NLL / that count."""
    model = make_model("sdpa")
    ids = torch.randint(
        3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4)
    )
    labels = ids.clone()
    labels[0, :2] = -100
    with torch.no_grad():
        out = model(ids, labels=labels, use_cache=False)
        summed = model(ids, labels=labels, use_cache=False, num_items_in_batch=torch.tensor(24))
    logp = torch.log_softmax(out.logits[:, :-1].double(), dim=-1)
    target = labels[:, 1:]
    valid = target != -100
    nll = -logp.gather(-1, target.clamp(min=0)[..., None])[..., 0][valid].sum()
    assert int(valid.sum()) == 9
    torch.testing.assert_close(out.loss.double(), nll / 9, rtol=1e-6, atol=0)
    torch.testing.assert_close(summed.loss.double(), nll / 24, rtol=1e-6, atol=0)


# ============================================================================ router outputs
def test_output_router_logits_are_each_moe_layers_fp32_router_logits():
    """``output_router_logits=True`` (as in transformers' DeepSeek-V3 / Qwen3-MoE): one
    [B * S, n] fp32 tensor per MoE layer (none for the dense first layer), the router's logits
    ``x W_r^T`` for the hidden states that layer's block sees, with gradients to the router (for a
    user's own auxiliary loss). Off by default, on by ``config.output_router_logits``; last in the
    tuple form; the logits of the LM are unchanged."""
    model = make_model("sdpa", dtype=torch.float32)
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    blocks = model.model.moe_blocks()
    seen = {}
    for i, block in blocks.items():
        block.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0]))
    model.model.set_record_routing(True)
    out = model(ids, output_router_logits=True, use_cache=False)
    assert sorted(blocks) == [1, 2] and len(out.router_logits) == 2
    for (i, block), logits in zip(blocks.items(), out.router_logits, strict=True):
        assert logits.shape == (2 * 7, cfg.num_experts) and logits.dtype == torch.float32
        x = seen[i].detach().reshape(-1, cfg.hidden_size).double()
        expected = x @ block.gate.weight.detach().double().T
        torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.sigmoid(logits.detach()), block.last_routing.scores)
    out.router_logits[0].square().mean().backward()  # e.g. a z-loss on the first MoE layer
    assert blocks[1].gate.weight.grad.abs().sum() > 0 and blocks[2].gate.weight.grad is None
    model.model.set_record_routing(False)
    with torch.no_grad():
        plain = model(ids, use_cache=False)
        tup = model(ids, use_cache=False, output_router_logits=True, return_dict=False)
        model.config.output_router_logits = True
        try:
            by_config = model(ids, use_cache=False).router_logits
        finally:
            model.config.output_router_logits = False
    assert plain.router_logits is None
    assert torch.equal(plain.logits, out.logits.detach())
    assert torch.equal(tup[0], plain.logits) and len(tup) == 2 and len(tup[-1]) == 2
    assert all(torch.equal(a, b) for a, b in zip(tup[-1], out.router_logits, strict=True))
    assert len(by_config) == 2 and torch.equal(by_config[0], out.router_logits[0])
