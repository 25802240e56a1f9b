"""The converter's verification, checkpoint reader, summary and command line, number by number.

Fast tests (no Megatron world, no workspace): ``verify.py``'s comparison, verdict and report on
given logits / fake models, ``dist_reader.py`` on small DCP checkpoints saved here,
``summary.py``'s figures, and ``cli.py``'s plumbing with the conversions replaced by recorders.
Slow tests (the session's workspace of real checkpoints): the real ``verify`` on an export with
two experts swapped must FAIL; the reader gives every layout's shards back as the single-rank
checkpoint's tensors.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_latentmoe.convert import ConversionError, ModelArch, cli, summary, verify
from megatron_latentmoe.convert.dist_reader import (
    COMMON_STATE_KEY,
    DistCheckpointReader,
    open_checkpoint,
)
from megatron_latentmoe.convert.names import Location, TensorMap, checkpoint_locations

from . import _workers
from .conftest import LAYOUTS_2, LAYOUTS_4

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_report(max_d=5e-6, same=True, **kw) -> verify.VerifyReport:
    return verify.VerifyReport(
        max_d,
        1e-6,
        1.0,
        "real text",
        (2, 64),
        32,
        same,
        **dict(
            dict(
                min_margin=1e-2,
                first_mismatch=None if same else 3,
                megatron_margin_at_mismatch=None if same else 1e-7,
                hf_margin_at_mismatch=None if same else 2e-7,
            ),
            **kw,
        ),
    )


# ------------------------------------------------------------------------------ verdict, report
def test_verdict_at_the_tolerance_and_beyond():
    assert make_report(max_d=1e-4).passed  # the tolerance itself is allowed
    assert not make_report(max_d=1.0001e-4).passed
    assert make_report(max_d=3e-3, atol=3e-3).passed and not make_report(max_d=3e-3).passed
    for bad in (float("inf"), float("nan")):
        assert not make_report(max_d=bad).passed
        assert not make_report(max_d=bad, atol=float("inf")).passed
    assert not make_report(max_d=0.0, same=False).passed
    assert make_report().to_dict()["passed"] is True
    assert make_report(same=False).to_dict()["passed"] is False


def test_report_text():
    assert make_report(max_d=1e-4, seconds=1.26, precision="HF weights rounded").format() == (
        "verify (real text, batch [2, 64]):\n"
        "  HF weights rounded\n"
        "  logits max |delta| = 1.000e-04 (tolerance 1.0e-04)   mean |delta| = 1.000e-06   "
        "cosine = 1.000000000\n"
        "  greedy generation of 32 tokens: identical (smallest top-1/top-2 logit margin "
        "1.000e-02)\n"
        "  result: PASS   (1.3 s)"
    )
    assert make_report(same=False).format().splitlines()[2:] == [
        "  greedy generation of 32 tokens: DIFFERS at step 3 (top1-top2 margin: Megatron "
        "1.000e-07, HF 2.000e-07)",
        "  result: FAIL   (0.0 s)",
    ]


def test_compare_logits_max_mean_and_cosine_of_the_absolute_delta():
    a = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    b = torch.tensor([[0.0, 1.5], [2.0, 5.0]])  # deltas 0, -0.5, 0, -2: the largest is negative
    cos = (1.5 + 4 + 15) / math.sqrt((1 + 4 + 9) * (2.25 + 4 + 25))
    assert verify.compare_logits(a, b) == (2.0, 0.625, pytest.approx(cos, abs=1e-15))
    assert verify.compare_logits(b, a)[:2] == (2.0, 0.625)


def test_margin_is_the_smallest_top1_minus_top2_over_the_batch():
    logits = torch.tensor([[1.0, 5.0, 3.0], [0.0, -1.0, 0.5]])
    assert verify._margin(logits) == 0.5
    assert verify._margin(logits[:1]) == 2.0


class FakeMegatron:
    """``model(tokens, position_ids, None)`` -> logits [b, s, V] peaked at (3 * token + 1) % V,
    the peak's margin 1 / (row + 1) / (position + 1)."""

    V = 11

    def __init__(self):
        self.position_ids = []

    def __call__(self, tokens, position_ids, mask):
        assert mask is None
        self.position_ids.append(position_ids.clone())
        b, s = tokens.shape
        peak = (3 * tokens + 1) % self.V
        v = torch.arange(self.V)
        scale = 1.0 / (torch.arange(b)[:, None, None] + 1.0) / (torch.arange(s)[None, :, None] + 1)
        return -scale * (v - peak[..., None]).abs().to(torch.float64)


def test_megatron_greedy_re_forwards_the_whole_sequence():
    model = FakeMegatron()
    tokens = torch.tensor([[6, 1, 2], [3, 4, 0]])
    new, margins = verify.megatron_greedy(model, tokens, 3)
    assert new.tolist() == [[7, 0, 1], [1, 4, 2]]  # t -> (3 t + 1) % 11
    assert margins == pytest.approx([1 / 2 / 3, 1 / 2 / 4, 1 / 2 / 5], abs=1e-7)  # row 1, last
    assert [p.tolist() for p in model.position_ids] == [[list(range(s))] * 2 for s in (3, 4, 5)]
    assert verify.megatron_logits(model, tokens).dtype == torch.float32


def test_hf_greedy_equals_full_re_forward_argmax():
    """``generate`` (KV cache) gives the tokens of argmax over a full forward each step, and the
    margins of its scores are those of the full forwards' last logits."""
    from megatron_latentmoe.hf import StableLatentMoEForCausalLM
    from tests.unit.test_hf_modeling import randomize_, tiny_config

    torch.manual_seed(0)
    model = StableLatentMoEForCausalLM(tiny_config()).float().eval()
    randomize_(model, std=0.3, seed=3)
    tokens = torch.tensor([[5, 17, 3, 40], [2, 2, 9, 60]])
    new, margins = verify.hf_greedy(model, tokens, 4)
    seq, ref = tokens, []
    with torch.no_grad():
        for _ in range(4):
            last = model(seq).logits[:, -1].float()
            ref.append(verify._margin(last))
            seq = torch.cat([seq, last.argmax(-1, keepdim=True)], 1)
    assert new.tolist() == seq[:, 4:].tolist()
    assert margins == pytest.approx(ref, abs=1e-5)
    assert min(ref) > 1e-3  # not decided by a near-tie
    # the model's own eos neither stops the generation nor is held back: Megatron's greedy
    # re-forward knows no eos, so HF must not either
    eos = int(seq[0, 5])
    model.generation_config.eos_token_id = model.config.eos_token_id = eos
    again, _ = verify.hf_greedy(model, tokens, 4)
    assert again.tolist() == seq[:, 4:].tolist() and eos in again[0].tolist()


class FakeHF:
    def __init__(self, logits):
        self.logits = logits

    def __call__(self, tokens):
        return type("Out", (), {"logits": self.logits})()


def _fake_verify(monkeypatch, tmp_path, gh, mh, delta=0.0):
    """``verify_export`` with the models replaced: Megatron by :class:`FakeMegatron`, HF by its
    logits plus ``delta`` and the greedy result ``(gh, mh)``. Returns the report and the calls
    of the replaced functions."""
    mg = FakeMegatron()
    tokens = torch.tensor([[1, 2], [4, 0]])
    lm = verify.megatron_logits(FakeMegatron(), tokens)
    hf = FakeHF(lm + delta)
    # 64 + 3 positions: the prompt (the default 64 tokens) and the 3 greedy ones, the limit
    arch = type("Arch", (), {"vocab_size": FakeMegatron.V, "max_position_embeddings": 67})()
    reader = type("Reader", (), {"path": tmp_path / "ck"})()
    calls = []

    def fake(name, result):
        def f(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result

        monkeypatch.setattr(verify, name, f)

    fake("open_checkpoint", (reader, arch, "", {}))
    fake("check_same_vocabulary", None)
    fake("check_hf_files", None)
    fake("verify_text_ids", None)  # sample_tokens' own check: never called apart
    fake("hf_expert_weight_qat", "none")
    fake("load_megatron_model", mg)
    fake("load_hf_model", hf)
    fake("match_stored_precision", "")
    fake("sample_tokens", (tokens, "fake"))
    fake("hf_greedy", (gh, mh))
    clock = iter([10.0, 12.5])
    monkeypatch.setattr(verify.time, "perf_counter", lambda: next(clock))
    (tmp_path / "config.json").write_text("{}")
    report = verify.verify_export(tmp_path / "ck", tmp_path, new_tokens=3, atol=0.5, text="t")
    assert calls == [
        ("open_checkpoint", (tmp_path / "ck", None), {}),
        ("check_same_vocabulary", (arch, tmp_path, reader.path), {}),
        ("check_hf_files", (tmp_path,), {}),
        # the tokens before the models are loaded, the tokenizer once
        ("sample_tokens", (tmp_path, FakeMegatron.V, 2, 64, "t"), {}),
        ("hf_expert_weight_qat", (tmp_path,), {}),
        ("load_megatron_model", (reader.path, arch, "none"), {}),
        ("load_hf_model", (tmp_path,), {}),
        ("match_stored_precision", (mg, hf, arch, reader, tmp_path), {"mxfp4_experts": False}),
        ("hf_greedy", (hf, tokens, 3), {}),
    ]
    assert report.seconds == 2.5
    return report


def test_verify_export_reports_the_first_differing_step(monkeypatch, tmp_path):
    same = torch.tensor([[7, 0, 1], [1, 4, 2]])
    r = _fake_verify(monkeypatch, tmp_path, same, [0.3, 0.2, 0.1])
    assert (r.passed, r.greedy_identical, r.first_mismatch, r.max_abs_diff) == (True, True, None, 0)
    assert r.min_margin == 1 / 2 / 4 and r.hf_tokens == r.megatron_tokens == same.tolist()
    assert (r.tokens_source, r.batch_shape, r.new_tokens, r.atol) == ("fake", (2, 2), 3, 0.5)
    # row 1 differs at step 2 (row 0 agrees): the step, and both models' margins there
    r = _fake_verify(monkeypatch, tmp_path, torch.tensor([[7, 0, 1], [1, 4, 3]]), [0.3, 0.2, 0.1])
    assert (r.passed, r.greedy_identical, r.first_mismatch) == (False, False, 2)
    assert (r.megatron_margin_at_mismatch, r.hf_margin_at_mismatch) == (1 / 2 / 4, 0.1)
    assert r.megatron_tokens == same.tolist() and r.hf_tokens == [[7, 0, 1], [1, 4, 3]]
    r = _fake_verify(monkeypatch, tmp_path, torch.tensor([[7, 9, 1], [1, 4, 3]]), [0.3])
    assert (r.first_mismatch, r.megatron_margin_at_mismatch) == (1, pytest.approx(1 / 6, abs=1e-7))
    assert math.isnan(r.hf_margin_at_mismatch)  # HF gave no score for that step
    # identical tokens but one logit beyond the tolerance: FAIL on the logits alone
    delta = torch.zeros(2, 2, FakeMegatron.V)
    delta[1, 0, 3] = 0.75
    r = _fake_verify(monkeypatch, tmp_path, same, [0.3, 0.2, 0.1], delta=delta)
    assert (r.greedy_identical, r.passed) == (True, False)
    assert (r.max_abs_diff, r.mean_abs_diff) == (0.75, 0.75 / 44)


# -------------------------------------------------------------------------------- verify options
def test_verify_option_refusals_and_the_smallest_allowed_values():
    ok = dict(atol=1, new_tokens=1, batch=1, seq_len=1, text="x")
    verify.check_verify_options(**ok)
    verify.check_verify_options(**dict(ok, text=None))

    def refusal(**change):
        with pytest.raises(ConversionError) as info:
            verify.check_verify_options(**dict(ok, **change))
        return str(info.value)

    for name, flag in (
        ("new_tokens", "--verify-tokens"),
        ("batch", "--verify-batch"),
        ("seq_len", "--verify-seq-len"),
    ):
        for value in (0, True, 2.0):
            assert refusal(**{name: value}) == (
                f"{name} ({flag})={value!r} is not allowed: an integer >= 1"
            )
    for value in (0, -1e-4, float("inf"), "1e-4"):
        assert refusal(atol=value) == (
            f"atol (--verify-atol)={value!r} is not allowed: a positive finite number"
        )
    for value in ("", " \n"):
        assert refusal(text=value) == (
            f"text (--verify-text)={value!r} is not allowed: a non-empty text (default: the corpus)"
        )
    # the library entry point checks them too, and the HF directory, before opening anything
    with pytest.raises(ConversionError, match=r"^batch \(--verify-batch\)=0 is not allowed"):
        verify.verify_export("no-ck", "no-hf", batch=0)
    with pytest.raises(ConversionError, match="^HF directory 'no-hf' has no config.json"):
        verify.verify_export("no-ck", "no-hf")


def test_each_side_is_rounded_to_the_dtype_the_other_side_stores(tmp_path):
    """``match_stored_precision`` on a tiny model's real files, with fp32 parameters standing in
    for both models: an fp32 checkpoint and its bf16 export round the Megatron weights to bf16,
    a bf16 checkpoint and an fp32 HF directory the HF weights; the other side and the fp32
    expert bias are left as they are; fp32 on both sides rounds nothing. ``load_hf_model`` gives
    the bf16 export in fp32 (transformers' default would be the config's bf16)."""
    from megatron_latentmoe.convert import export_checkpoint, import_checkpoint
    from megatron_latentmoe.convert.names import iter_tensor_maps
    from tests.convert.test_export_units import TINY, write_hf_dir

    arch = ModelArch(**TINY)
    write_hf_dir(tmp_path / "hf", arch)
    import_checkpoint(tmp_path / "hf", tmp_path / "mg", progress=False)
    import_checkpoint(tmp_path / "hf", tmp_path / "mg_bf16", dtype="bf16", progress=False)
    export_checkpoint(
        tmp_path / "mg", tmp_path / "hf_bf16", dtype="bf16", tokenizer_dir=None, progress=False
    )
    maps = list(iter_tensor_maps(arch))
    bias = [tm for tm in maps if tm.fp32]
    assert len(bias) == 1
    g = torch.Generator().manual_seed(0)

    def match(mg_dir, hf_dir):
        shapes = [
            {tm.megatron: tm.shape for tm in maps},
            {name: shape for tm in maps for name, shape in tm.hf},
        ]
        params = [
            {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in side.items()}
            for side in shapes
        ]
        before = [{n: p.detach().clone() for n, p in side.items()} for side in params]
        mg, hf = (SimpleNamespace(named_parameters=side.items) for side in params)
        text = verify.match_stored_precision(
            mg, hf, arch, DistCheckpointReader(mg_dir), hf_dir, mxfp4_experts=False
        )
        return text, params, before

    fixed = {bias[0].megatron, *bias[0].hf_names}
    for mg_dir, hf_dir, rounded_side, text in (
        ("mg", "hf_bf16", 0, "Megatron weights rounded to bfloat16 (as the HF files store them)"),
        (
            "mg_bf16",
            "hf",
            1,
            "HF weights rounded to bfloat16 (as the Megatron checkpoint stores them)",
        ),
        ("mg", "hf", None, ""),
    ):
        got, params, before = match(tmp_path / mg_dir, tmp_path / hf_dir)
        assert got == text
        for side in (0, 1):
            for name, p in params[side].items():
                want = before[side][name]
                if side == rounded_side and name not in fixed:
                    want = want.bfloat16().float()
                    assert not torch.equal(want, before[side][name]), name  # it did round
                assert torch.equal(p.detach(), want), (mg_dir, hf_dir, side, name)
    model = verify.load_hf_model(tmp_path / "hf_bf16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_expert_qat_follows_the_exports_quantization_config(tmp_path):
    from megatron_latentmoe.convert import mxfp4

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8}))
    assert verify.hf_expert_weight_qat(tmp_path) == "none"
    cfg = {"quantization_config": mxfp4.quantization_config()}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert verify.hf_expert_weight_qat(tmp_path) == "mxfp4"


def test_verify_length_counts_the_prompt_and_the_greedy_tokens():
    """--verify-seq-len + --verify-tokens up to max_position_embeddings: the greedy tokens
    continue the prompt (a prompt at the limit compared them beyond it, silently)."""
    arch = _workers.arch()
    assert arch.max_position_embeddings == 256
    verify.check_verify_length(arch, 224, 32)
    verify.check_verify_length(arch, 255, 1)
    for seq_len, new_tokens in ((225, 32), (256, 1), (1, 256)):
        with pytest.raises(ConversionError) as info:
            verify.check_verify_length(arch, seq_len, new_tokens)
        assert str(info.value) == (
            f"--verify-seq-len {seq_len} + --verify-tokens {new_tokens} = "
            f"{seq_len + new_tokens} tokens is not allowed: at most 256, the model's "
            "max_position_embeddings (max_sequence_length): the greedy tokens continue the prompt"
        )


def test_hf_directory_and_vocabulary_checks(tmp_path):
    with pytest.raises(ConversionError) as info:
        verify.check_hf_dir(tmp_path)
    assert str(info.value) == (
        f"HF directory {str(tmp_path)!r} has no config.json (not an HF model directory)"
    )
    arch = _workers.arch()
    from megatron_latentmoe.hf import StableLatentMoEConfig

    StableLatentMoEConfig(**arch.to_hf_config_kwargs()).save_pretrained(tmp_path)
    verify.check_hf_dir(tmp_path)
    verify.check_same_vocabulary(arch, tmp_path, "ck")
    other = ModelArch(**dict(_workers.TEST_ARCH, vocab_size=4224))
    with pytest.raises(ConversionError) as info:
        verify.check_same_vocabulary(other, tmp_path, "ck")
    assert str(info.value) == (
        f"{tmp_path / 'config.json'}: vocab_size=4096 is not allowed: 4224, the vocab_size of "
        "the checkpoint 'ck' (the HF directory is not its export: logits over two vocabularies "
        "cannot be compared)"
    )


def test_verify_tokens_real_text_or_seeded_random_ids(tmp_path, monkeypatch):
    """The export's tokenizer on the corpus' first long texts; ids beyond the vocabulary or no
    tokenizer: seeded random ids, and the source says why."""
    from transformers import AutoTokenizer

    from megatron_latentmoe.data.corpus import default_tokenizer_dir, iter_corpus_texts

    tok_dir = default_tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    long_texts = [t for t in iter_corpus_texts() if len(t) >= 8 * 16][:3]
    assert verify._corpus_texts(3, 16) == long_texts
    # texts of at least 8 characters a token: 3016 = 8 * 377 is long enough, 3003 is not
    assert [len(t) for t in verify._corpus_texts(5, 377)] == [8709, 3930, 3297, 3037, 3016]
    expected = [tok(t, add_special_tokens=False)["input_ids"][:16] for t in long_texts]
    tokens, source = verify.sample_tokens(tok_dir, 4096, batch=3, seq_len=16)
    assert (tokens.tolist(), source) == (expected, "real text, exported tokenizer")
    top = int(tokens.max())
    assert verify.sample_tokens(tok_dir, top + 1, batch=3, seq_len=16)[1] == source
    tokens, source = verify.sample_tokens(tok_dir, top, batch=3, seq_len=16)
    assert source == f"random ids (tokenizer ids up to {top} exceed vocab_size={top})"
    g = torch.Generator().manual_seed(0)
    assert torch.equal(tokens, torch.randint(0, top, (3, 16), generator=g))
    text = "one two three four five six seven eight nine ten eleven twelve"
    tokens, source = verify.sample_tokens(tok_dir, 4096, batch=2, seq_len=5, text=text)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tokens.tolist() == [ids[:5]] * 2
    tokens, _ = verify.sample_tokens(tok_dir, 4096, batch=1, seq_len=len(ids), text=text)
    assert tokens.tolist() == [ids]  # exactly seq_len tokens suffice
    # the text's ids beyond the vocabulary: refused (random ids replaced the text asked for);
    # only the prompt's count (the 5 first: ids up to 1351, the 12th is 2520)
    assert (max(ids[:5]), max(ids)) == (1351, 2520)
    tokens, source = verify.sample_tokens(tok_dir, 1352, batch=1, seq_len=5, text=text)
    assert (tokens.tolist(), source) == ([ids[:5]], "real text, exported tokenizer")
    with pytest.raises(ConversionError) as info:
        verify.sample_tokens(tok_dir, 1351, batch=1, seq_len=5, text=text)
    assert str(info.value) == (
        f"--verify-text {text[:40] + '...'!r} gives token id 1351 under the tokenizer of "
        f"{str(tok_dir)!r}, outside the model's vocab_size=1351; allowed: a text whose first 5 "
        "tokens (--verify-seq-len) are ids below 1351, or no --verify-text"
    )
    with pytest.raises(
        ConversionError, match=f"gives {len(ids)} tokens .* at least {len(ids) + 1}"
    ):
        verify.sample_tokens(tok_dir, 4096, batch=1, seq_len=len(ids) + 1, text=text)
    for t, shown in ((text[:40], repr(text[:40])), (text[:41], repr(text[:40] + "..."))):
        with pytest.raises(ConversionError) as info:
            verify.sample_tokens(tok_dir, 4096, seq_len=1000, text=t)
        assert str(info.value) == (
            f"--verify-text {shown} gives {len(tok(t, add_special_tokens=False)['input_ids'])} "
            f"tokens under the tokenizer of {str(tok_dir)!r}; allowed: a text of at least 1000 "
            "tokens (--verify-seq-len)"
        )
    with pytest.raises(ConversionError) as info:
        verify.sample_tokens(tmp_path, 4096, seq_len=5, text=text)
    assert str(info.value) == (
        f"--verify-text {text[:40] + '...'!r}: no tokenizer loads from {str(tmp_path)!r} "
        "(ValueError); allowed: a text of at least 5 tokens (--verify-seq-len) under a tokenizer "
        "that loads, or no --verify-text"
    )
    # no tokenizer (an export with --tokenizer none): the report's one line says so, not
    # transformers' five lines on slow tokenizers and sentencepiece
    tokens, source = verify.sample_tokens(tmp_path, 50, batch=1, seq_len=4)
    assert source == (
        f"random ids (no tokenizer in {str(tmp_path)!r}: no tokenizer.json nor "
        "tokenizer_config.json)"
    )
    assert tokens.shape == (1, 4)
    # corpus texts that give fewer than seq_len tokens: random ids, not a shorter prompt
    monkeypatch.setattr(verify, "_corpus_texts", lambda batch, seq_len: ["hi"] * batch)
    tokens, source = verify.sample_tokens(tok_dir, 4096, batch=2, seq_len=16)
    assert (tokens.shape, source) == (
        (2, 16),
        "random ids (no usable tokenizer/text (ValueError: text too short))",
    )


# --------------------------------------------------------------------- a wrong export must FAIL
@pytest.mark.slow
def test_verify_fails_an_export_with_two_experts_swapped(workspace, tmp_path):
    """The real ``verify`` (both models, real text) of an export whose layer-3 experts 2 and 5
    have their down projections swapped, a mapping bug: FAIL, exit status 3, the report says
    why (the same command passes on the correct export: test_convert)."""
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(workspace.path("hf_main"), hf)
    weight_map = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    a, b = (f"model.layers.3.block_sparse_moe.experts.{e}.w2.weight" for e in (2, 5))
    tensors = {f: load_file(str(hf / f)) for f in {weight_map[a], weight_map[b]}}
    ta, tb = tensors[weight_map[a]][a], tensors[weight_map[b]][b]
    tensors[weight_map[a]][a], tensors[weight_map[b]][b] = tb, ta
    for f, t in tensors.items():
        save_file(t, str(hf / f), metadata={"format": "pt"})
    report_path = tmp_path / "verify.json"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_latentmoe.convert", "verify"]
        + ["--checkpoint", workspace.path("ck_single"), "--hf", str(hf)]
        + ["--verify-tokens", "8", "--summary-json", str(report_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == cli.EXIT_VERIFY_FAILED, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.endswith("error: verification failed (see above)\n")
    report = json.loads(report_path.read_text())["verify"]
    assert report["passed"] is False and "  result: FAIL" in proc.stdout
    assert report["max_abs_diff"] > 100 * report["atol"] == 1e-2


# ------------------------------------------------------------------------ checkpoint reader (DCP)
def save_dcp(path, tensors: dict, metadata_json=None) -> DistCheckpointReader:
    """A one-process ``torch_dist``-style DCP checkpoint of ``tensors`` (and objects, stored
    whole as Megatron stores its common state), opened."""
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False)
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(path)), planner=planner, no_dist=True)
    if metadata_json is not None:
        (path / "metadata.json").write_text(json.dumps(metadata_json))
    return DistCheckpointReader(path)


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "decoder.final_layernorm.weight": torch.randn(6, generator=g),
        "decoder.layers.mlp.linear_fc1.weight": torch.randn(2, 3, 4, generator=g).bfloat16(),
        "decoder.layers.fp8": torch.randn(3, 5, generator=g).to(torch.float8_e4m3fn),
        "embedding.word_embeddings.weight": torch.randn(5, 4, generator=g),
        "optimizer.state.exp_avg": torch.randn(2, generator=g),
        "optimizer.step": torch.tensor(3.0),
    }
    path = tmp_path_factory.mktemp("dcp") / "ck"
    save_dcp(path, tensors, {"sharded_backend": "torch_dist"})
    return path, tensors


def _bits(t: torch.Tensor) -> list:
    return t.view(torch.uint8).tolist() if t.element_size() == 1 else t.view(torch.int16).tolist()


def test_reader_regions_dtypes_and_bytes(small_ckpt):
    path, tensors = small_ckpt
    r = DistCheckpointReader(path)
    assert r.model_keys() == [
        "decoder.final_layernorm.weight",
        "decoder.layers.mlp.linear_fc1.weight",
        "decoder.layers.fp8",
        "embedding.word_embeddings.weight",
    ]
    fc1 = tensors["decoder.layers.mlp.linear_fc1.weight"]
    assert r.shape("decoder.layers.mlp.linear_fc1.weight") == (2, 3, 4)
    assert r.dtype("decoder.layers.fp8") == torch.float8_e4m3fn
    layer1, row, whole, fp8, row2 = r.read_regions(
        [
            ("decoder.layers.mlp.linear_fc1.weight", (1,)),
            ("decoder.layers.mlp.linear_fc1.weight", (0, 2)),  # the same key twice
            ("decoder.layers.mlp.linear_fc1.weight", ()),
            ("decoder.layers.fp8", (2,)),
            ("embedding.word_embeddings.weight", [4]),
        ]
    )
    assert layer1.dtype == torch.bfloat16 and _bits(layer1) == _bits(fc1[1])
    assert _bits(row) == _bits(fc1[0, 2]) and _bits(whole) == _bits(fc1)
    assert fp8.dtype == torch.float8_e4m3fn and _bits(fp8) == _bits(
        tensors["decoder.layers.fp8"][2]
    )
    assert torch.equal(row2, tensors["embedding.word_embeddings.weight"][4])
    assert r.bytes_read == 12 * 2 + 4 * 2 + 24 * 2 + 5 + 4 * 4
    assert r.read_regions([]) == [] and r.bytes_read == 101
    assert torch.equal(
        r.read("decoder.final_layernorm.weight"), tensors["decoder.final_layernorm.weight"]
    )


def test_reader_refuses_regions_outside_the_tensor(small_ckpt):
    r = DistCheckpointReader(small_ckpt[0])
    key = "decoder.layers.mlp.linear_fc1.weight"

    def refusal(key, lead):
        with pytest.raises(ConversionError) as info:
            r.read(key, lead)
        return str(info.value)

    assert refusal(key, (2,)) == (
        f"tensor {key!r} of shape (2, 3, 4): index 2 out of range on axis 0"
    )
    assert refusal(key, (-1,)) == (
        f"tensor {key!r} of shape (2, 3, 4): index -1 out of range on axis 0"
    )
    assert refusal(key, (1, 3)) == (
        f"tensor {key!r} of shape (2, 3, 4): index 3 out of range on axis 1"
    )
    assert refusal(key, (0, 0, 0)) == (
        f"tensor {key!r} of shape (2, 3, 4) has no axis after (0, 0, 0)"
    )
    assert refusal("nope", ()) == f"checkpoint {str(small_ckpt[0])!r} has no tensor 'nope'"
    assert refusal("optimizer.step", (0,)) == (
        "tensor 'optimizer.step' of shape () has no axis after (0,)"
    )
    assert r.read("optimizer.step").tolist() == 3.0  # a scalar reads whole
    assert r.read(key, (1, 2)).shape == (4,)  # the last indices that exist
    assert r.bytes_read == 8 + 4


def test_reader_locations_concatenate_their_parts(small_ckpt):
    path, tensors = small_ckpt
    r = DistCheckpointReader(path)
    fc1 = tensors["decoder.layers.mlp.linear_fc1.weight"]
    two = Location((("decoder.layers.mlp.linear_fc1.weight", (1,)),) * 2)
    one = Location((("embedding.word_embeddings.weight", ()),))
    assert r.location_shape(two) == (6, 4) and r.location_shape(one) == (5, 4)
    a, b = r.read_locations([one, two])
    assert torch.equal(a, tensors["embedding.word_embeddings.weight"])
    assert _bits(b) == _bits(torch.cat([fc1[1], fc1[1]]))


def test_reader_locates_a_tensor_where_all_its_parts_are(tmp_path):
    """The first of the tensor's possible locations whose keys are ALL in the checkpoint."""
    tm = TensorMap("decoder.layers.1.mlp.linear_fc1.weight", (4, 2), (), (), kind="glu")
    w, v = (f"decoder.layers.1.mlp.linear_fc1.weight_{half}" for half in "wv")
    halves = Location(((w, ()), (v, ())))
    assert halves in checkpoint_locations(tm)
    assert save_dcp(tmp_path / "a", {w: torch.ones(2, 2)}).locate(tm) is None
    assert save_dcp(tmp_path / "b", {w: torch.ones(2, 2), v: torch.ones(2, 2)}).locate(tm) == halves
    stacked = "decoder.layers.mlp.linear_fc1.weight"
    r = save_dcp(tmp_path / "c", {w: torch.ones(2, 2), stacked: torch.ones(2, 4, 2)})
    assert r.locate(tm) == Location(((stacked, (1,)),))


def test_reader_shows_an_old_norm_name_under_todays(tmp_path):
    from megatron_latentmoe.moe.checkpoint_names import LEGACY_NORM_NAME, NORM_NAME

    old, new = (f"decoder.layers.1.mlp.{name}.weight" for name in (LEGACY_NORM_NAME, NORM_NAME))
    r = save_dcp(tmp_path, {old: torch.arange(3.0)})
    assert r.model_keys() == [new] and r.shape(new) == (3,)
    assert r.read(new).tolist() == [0.0, 1.0, 2.0]


def test_reader_common_state_and_backend(tmp_path):
    t = {"decoder.final_layernorm.weight": torch.ones(2)}
    assert save_dcp(tmp_path / "a", t).common_state() == {}
    r = save_dcp(tmp_path / "b", t)
    torch.save({"iteration": 7}, r.path / "common.pt")
    assert r.common_state() == {"iteration": 7}
    with pytest.raises(ConversionError) as info:
        save_dcp(tmp_path / "c", t, {"sharded_backend": "zarr"})
    assert str(info.value) == (
        f"checkpoint {str(tmp_path / 'c')!r} was saved with sharded_backend='zarr'; only "
        "'torch_dist' is supported"
    )
    assert save_dcp(tmp_path / "d", t, {"other": 1}).path == tmp_path / "d"


def test_reader_resolves_the_checkpoint_directory(tmp_path):
    def refusal(path):
        with pytest.raises(ConversionError) as info:
            DistCheckpointReader(path)
        return str(info.value)

    assert refusal(tmp_path / "nope") == f"checkpoint {str(tmp_path / 'nope')!r} does not exist"
    (tmp_path / "file").write_text("")
    assert refusal(tmp_path / "file") == f"checkpoint {str(tmp_path / 'file')!r} is not a directory"
    root = tmp_path / "root"
    root.mkdir()
    (root / "latest_checkpointed_iteration.txt").write_text("release")
    (root / "release").mkdir()
    assert refusal(root) == (
        f"checkpoint {str(root)!r}: the tracker names 'release' but "
        f"{str(root / 'release' / '.metadata')!r} does not exist"
    )
    shutil.rmtree(root / "release")
    save_dcp(root / "release", {"decoder.final_layernorm.weight": torch.ones(2)})
    assert DistCheckpointReader(root).path == root / "release"


def test_reader_names_at_most_five_missing_data_files(tmp_path):
    tensors = {f"decoder.t{i}": torch.full((2,), float(i)) for i in range(7)}
    dcp.save(
        tensors,
        storage_writer=dcp.FileSystemWriter(str(tmp_path), single_file_per_rank=False),
        no_dist=True,
    )
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".distcp"))
    assert len(files) == 7
    os.remove(tmp_path / files[0])
    with pytest.raises(ConversionError) as info:
        DistCheckpointReader(tmp_path)
    assert str(info.value) == (
        f"checkpoint {str(tmp_path)!r} is incomplete: data file(s) {files[:1]} are missing"
    )
    for f in files[1:5]:
        os.remove(tmp_path / f)
    with pytest.raises(ConversionError) as info:
        DistCheckpointReader(tmp_path)
    assert str(info.value).endswith(f"data file(s) {files[:5]} are missing")
    os.remove(tmp_path / files[5])
    with pytest.raises(ConversionError) as info:
        DistCheckpointReader(tmp_path)
    assert str(info.value).endswith(f"data file(s) {files[:5]} ... are missing")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [*LAYOUTS_2, *LAYOUTS_4])
def test_reader_reassembles_every_layouts_shards(workspace, layout):
    """The same weights saved under TP / SP / EP / PP shards read back as the single-rank
    checkpoint's global tensors, bit for bit, whole and one leading index at a time."""
    single = DistCheckpointReader(workspace.path("ck_single"))
    r, arch, _, _ = open_checkpoint(workspace.path(f"ck_{layout}"))
    assert arch == _workers.arch() and r.model_keys() == single.model_keys()
    keys = single.model_keys()
    for key, a, b in zip(
        keys,
        single.read_regions([(k, ()) for k in keys]),
        r.read_regions([(k, ()) for k in keys]),
        strict=True,
    ):
        assert a.dtype == b.dtype and torch.equal(a, b), key
    stacked = [k for k in keys if len(single.shape(k)) == 3]
    assert stacked
    for key in stacked:
        last = single.shape(key)[0] - 1
        assert torch.equal(r.read(key, (last,)), single.read(key)[last]), key


class Unsafe:
    """Not on torch's ``weights_only`` allow-list."""


def test_reader_common_state_is_unpickled_safely(tmp_path):
    """The common state stored in the DCP (megatron-core >= 0.15) or in a legacy common.pt,
    unpickled with ``weights_only``: anything else is refused, and tolerated only when
    ``--megatron-config`` describes the model."""
    t = {"decoder.final_layernorm.weight": torch.ones(2)}
    r = save_dcp(tmp_path / "a", dict(t, **{COMMON_STATE_KEY: [{"iteration": 7}]}))
    assert r.common_state() == {"iteration": 7}  # Megatron's one-element list
    r = save_dcp(tmp_path / "b", dict(t, **{COMMON_STATE_KEY: {"x": Unsafe()}}))
    torch.save({"x": Unsafe()}, tmp_path / "a" / "common.pt")
    for path in ("a", "b"):
        with pytest.raises(ConversionError) as info:
            open_checkpoint(tmp_path / path)
        message = str(info.value)
        assert message.startswith(
            f"checkpoint {str(tmp_path / path)!r}: the common state (args, iteration) cannot be "
            "unpickled safely (UnpicklingError: "
        ) and message.endswith("; pass --megatron-config"), message
    cfg = tmp_path / "megatron.json"
    cfg.write_text(json.dumps(_workers.MEGATRON_CFG))
    reader, arch, _, common = open_checkpoint(tmp_path / "b", str(cfg))
    assert (reader.path, arch, common) == (tmp_path / "b", _workers.arch(), {})


def test_reader_unreadable_metadata_is_a_clear_error(tmp_path):
    """A '.metadata' that is not DCP's pickle (corrupt, or empty after a crash): one error naming
    the checkpoint and the cause, not a traceback."""
    save_dcp(tmp_path, {"decoder.a": torch.ones(2)})
    for data, cause in (
        (b"\x80\x04garbage", "UnpicklingError: pickle data was truncated"),
        (b"", "EOFError: Ran out of input"),
    ):
        (tmp_path / ".metadata").write_bytes(data)
        with pytest.raises(ConversionError) as info:
            DistCheckpointReader(tmp_path)
        assert (
            str(info.value) == f"checkpoint {str(tmp_path)!r}: '.metadata' cannot be read ({cause})"
        )


def test_reader_truncated_data_is_a_clear_error(tmp_path):
    r = save_dcp(tmp_path / "ck", {"decoder.a": torch.arange(1000.0)})
    data = tmp_path / "ck" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(ConversionError) as info:
        r.read("decoder.a")
    message = str(info.value)
    assert message.startswith(f"checkpoint {str(r.path)!r}: reading failed (") and message.endswith(
        "); the files may be truncated or corrupt"
    ), message


def test_reader_data_file_removed_after_opening(tmp_path):
    r = save_dcp(tmp_path, {"decoder.a": torch.ones(2), COMMON_STATE_KEY: [{"iteration": 7}]})
    (tmp_path / "__0_0.distcp").unlink()
    for read in (r.common_state, lambda: r.read("decoder.a")):
        with pytest.raises(ConversionError) as info:
            read()
        assert str(info.value) == (
            f"checkpoint {str(tmp_path)!r}: data file missing: [Errno 2] No such file or "
            f"directory: {str(tmp_path / '__0_0.distcp')!r}"
        )


# -------------------------------------------------------------------------------- command line
class Recorder:
    """Stands in for a conversion or ``verify_export`` (``real``): records its call, returns
    ``result``. ``defaults``: the keyword defaults of ``real``."""

    def __init__(self, real, result):
        self.result, self.calls = result, []
        self.defaults = {
            name: p.default
            for name, p in inspect.signature(real).parameters.items()
            if p.kind is p.KEYWORD_ONLY
        }

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


@pytest.fixture
def recorders(monkeypatch):
    from megatron_latentmoe.convert import export, importer

    out = {}
    for module, name, result in (
        (export, "export_checkpoint", summary.ConversionSummary("export", "a", "b", seconds=2.0)),
        (importer, "import_checkpoint", summary.ConversionSummary("import", "c", "d", seconds=1.0)),
        (verify, "verify_export", make_report()),
    ):
        out[name] = Recorder(getattr(module, name), result)
        monkeypatch.setattr(module, name, out[name])
    return out


def test_cli_refuses_a_summary_json_that_is_a_directory(recorders, tmp_path, capsys):
    """Before the conversion, not after it (``os.replace`` onto a directory: a traceback, and the
    temporary file left beside it)."""
    reports = tmp_path / "reports"
    reports.mkdir()
    argv = ["export", "--checkpoint", "ck", "--output", "hf", "--summary-json", str(reports)]
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        f"error: --summary-json={str(reports)!r} is not allowed: a file path, not a directory\n"
    )
    assert recorders["export_checkpoint"].calls == []
    assert os.listdir(tmp_path) == ["reports"] and os.listdir(reports) == []


@pytest.mark.parametrize("command", ["export", "import"])
def test_cli_refuses_verify_options_without_verify(recorders, command, capsys):
    """A forgotten ``--verify``: its options would be ignored and nothing compared."""
    src = ["--checkpoint", "ck"] if command == "export" else ["--hf", "hf"]
    for flags, shown in (
        (["--verify-text", "Hello"], "--verify-text='Hello'"),
        (["--verify-tokens", "3"], "--verify-tokens=3"),
        (["--verify-atol", "0.5"], "--verify-atol=0.5"),
        (["--verify-seq-len", "5"], "--verify-seq-len=5"),
        (["--verify-batch", "3"], "--verify-batch=3"),
        # the default's own value is refused too: it was given, so --verify was forgotten
        (["--verify-batch", str(cli.VERIFY_DEFAULTS["--verify-batch"])], "--verify-batch=2"),
    ):
        assert cli.main([command, *src, "--output", "out", *flags]) == cli.EXIT_BAD_INPUT
        assert capsys.readouterr().err == f"error: {shown} is not allowed: only with --verify\n"
    assert all(r.calls == [] for r in recorders.values())


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["export", "--checkpoint", "ck", "--output", "o", "--expert-dtype", "fp8"],
            "python -m megatron_latentmoe.convert export: error: argument --expert-dtype: invalid "
            "choice: 'fp8' (choose from 'auto', 'mxfp4')",
        ),
        (
            ["import", "--hf", "hf", "--output", "o", "--dtype", "fp64"],
            "python -m megatron_latentmoe.convert import: error: argument --dtype: invalid "
            "choice: 'fp64' (choose from 'auto', 'bf16', 'fp32', 'fp16')",
        ),
    ],
)
def test_cli_refuses_a_dtype_outside_the_choices(recorders, capsys, argv, message):
    """A dtype that is not one of the choices: exit 2, the last line names the option, the
    value and the allowed ones; nothing converted."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err.splitlines()[-1] == message
    assert all(r.calls == [] for r in recorders.values())


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def as_json(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


def test_cli_exit_statuses_are_the_documented_ones():
    doc = " ".join(cli.__doc__.split())
    for status, meaning in (
        (cli.EXIT_BAD_INPUT, "bad input"),
        (cli.EXIT_VERIFY_FAILED, "verification outside tolerance"),
        (cli.EXIT_INTERRUPTED, "/ 143 interrupted by Ctrl-C / SIGTERM"),
    ):
        assert f", {status} {meaning}" in doc, (status, doc)


def test_cli_export_hands_every_flag_to_the_conversion(recorders, capsys):
    export = recorders["export_checkpoint"]
    code, out, err = run_cli(["export", "--load", "ck", "--output", "hf"], capsys)
    assert (code, out, err) == (0, export.result.format() + "\n", "")
    assert export.calls == [(("ck", "hf"), export.defaults)]  # the library's defaults
    assert recorders["verify_export"].calls == []
    argv = ["export", "--checkpoint", "ck", "--output", "hf", "--megatron-config", "m.json"]
    argv += ["--dtype", "bf16", "--expert-dtype", "mxfp4", "--max-shard-size", "2GB"]
    argv += ["--tokenizer", "none", "--read-batch-mb", "1", "--overwrite", "--no-progress"]
    assert run_cli(argv, capsys)[0] == 0
    assert export.calls[1] == (
        ("ck", "hf"),
        dict(
            config_file="m.json",
            dtype="bf16",
            max_shard_size="2GB",
            tokenizer_dir=None,
            overwrite=True,
            progress=False,
            read_batch_bytes=1 << 20,
            expert_dtype="mxfp4",
            verify_seq_len=None,
            verify_tokens=32,
            verify_text=None,
        ),
    )
    argv = ["export", "--checkpoint", "ck", "--output", "hf", "--tokenizer", "tok"]
    assert run_cli(argv, capsys)[0] == 0 and export.calls[2][1]["tokenizer_dir"] == "tok"
    assert run_cli(argv + ["--read-batch-mb", "0"], capsys) == (
        cli.EXIT_BAD_INPUT,
        "",
        "error: --read-batch-mb=0 is not allowed: an integer >= 1\n",
    )
    assert len(export.calls) == 3


def test_cli_verify_after_a_conversion_and_the_summary_json(recorders, tmp_path, capsys):
    """``--verify`` compares the Megatron side (the checkpoint, or the import's output) with the
    HF side under the verify flags; ``--summary-json`` holds the summary and the report."""
    export, check = recorders["export_checkpoint"], recorders["verify_export"]
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    js = tmp_path / "s.json"
    argv = ["export", "--checkpoint", "ck", "--output", "out", "--megatron-config", "m.json"]
    argv += ["--verify", "--summary-json", str(js), "--verify-atol", "0.5", "--verify-text", "t"]
    argv += ["--verify-tokens", "4", "--verify-seq-len", "5", "--verify-batch", "6"]
    assert run_cli(argv, capsys) == (
        0,
        f"{export.result.format()}\n{check.result.format()}\n",
        "",
    )
    flags = dict(atol=0.5, new_tokens=4, batch=6, seq_len=5, text="t")
    assert check.calls == [(("ck", "out"), dict(config_file="m.json", **flags))]
    # refused by the conversion before its output if too long / too short
    conversion = export.calls[0][1]
    assert [conversion[f"verify_{k}"] for k in ("seq_len", "tokens", "text")] == [5, 4, "t"]
    assert json.loads(js.read_text()) == {
        "summary": as_json(export.result.to_dict()),
        "verify": as_json(check.result.to_dict()),
    }
    assert sorted(os.listdir(tmp_path)) == ["hf", "s.json"]  # no temporary file left
    # import: the Megatron side is the output, described by itself (no --megatron-config)
    argv = ["import", "--input", str(hf), "--output", "mg", "--verify", "--tp", "2", "--etp", "1"]
    code, out, err = run_cli(argv + ["--iteration", "7", "--dtype", "fp32", "--overwrite"], capsys)
    assert (code, err) == (
        0,
        "note: --tp --etp ignored: import writes one layout-free checkpoint that Megatron "
        "reshards on load at any layout\n",
    )
    assert check.calls[1] == (("mg", str(hf)), check.defaults)
    assert recorders["import_checkpoint"].calls == [
        (
            (str(hf), "mg"),
            dict(
                dtype="fp32",
                iteration=7,
                overwrite=True,
                progress=None,
                verify_seq_len=64,
                verify_tokens=32,
                verify_text=None,
            ),
        )
    ]
    # the verify command: the report alone in the JSON; a FAIL exits 3
    check.result = make_report(same=False)
    argv = ["verify", "--load", "ck", "--hf", str(hf), "--megatron-config", "m.json"]
    assert run_cli(argv + ["--summary-json", str(js)], capsys) == (
        cli.EXIT_VERIFY_FAILED,
        check.result.format() + "\n",
        "error: verification failed (see above)\n",
    )
    assert check.calls[2] == (("ck", str(hf)), dict(check.defaults, config_file="m.json"))
    assert json.loads(js.read_text()) == {"verify": as_json(check.result.to_dict())}


def test_cli_summary_json_on_a_full_disk_is_one_line(recorders, tmp_path, capsys, monkeypatch):
    """A --summary-json write that fails (a full disk, faked: the JSON's write raises ENOSPC)
    removes its temporary file and is one line naming the flag, exit 2: it was an OSError
    traceback that left ``s.json.tmpPID`` behind. Another OSError is one line too."""
    import errno

    from megatron_latentmoe import files

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli.json, "dump", full)
    monkeypatch.setattr(files, "free_bytes", lambda path: 0)
    js = tmp_path / "s.json"
    argv = ["export", "--checkpoint", "ck", "--output", "out", "--summary-json", str(js)]
    summary_text = recorders["export_checkpoint"].result.format() + "\n"
    assert run_cli(argv, capsys) == (
        cli.EXIT_BAD_INPUT,
        summary_text,
        f"error: the disk filled up writing in --summary-json {js} (0.0 MB free); free space "
        "there or give --summary-json a path on a larger disk\n",
    )
    assert os.listdir(tmp_path) == []

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(cli.json, "dump", denied)
    assert run_cli(argv, capsys) == (
        cli.EXIT_BAD_INPUT,
        summary_text,
        f"error: --summary-json {str(js)!r}: cannot be written (Permission denied)\n",
    )
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", ["export", "import"])
def test_cli_summary_json_of_a_conversion_without_verify(recorders, tmp_path, command, capsys):
    """Without ``--verify``, ``--summary-json`` holds the conversion's summary alone."""
    src = ["--checkpoint", "ck"] if command == "export" else ["--hf", str(tmp_path)]
    (tmp_path / "config.json").write_text("{}")
    js = tmp_path / "s.json"
    conversion = recorders[f"{command}_checkpoint"]
    argv = [command, *src, "--output", "out", "--summary-json", str(js)]
    assert run_cli(argv, capsys) == (0, conversion.result.format() + "\n", "")
    assert json.loads(js.read_text()) == {"summary": as_json(conversion.result.to_dict())}
    assert recorders["verify_export"].calls == []
    assert sorted(os.listdir(tmp_path)) == ["config.json", "s.json"]


def test_cli_bad_input_and_interruption(recorders, tmp_path, capsys, monkeypatch):
    """Exit 2 with one ``error:`` line for bad input, checked before any work where it can be;
    130 for Ctrl-C."""
    export, check = recorders["export_checkpoint"], recorders["verify_export"]
    export.result = ConversionError("checkpoint 'ck' does not exist")
    argv = ["export", "--checkpoint", "ck", "--output", "out"]
    assert run_cli(argv, capsys) == (
        cli.EXIT_BAD_INPUT,
        "",
        "error: checkpoint 'ck' does not exist\n",
    )
    export.result = KeyboardInterrupt()
    assert run_cli(argv, capsys) == (
        cli.EXIT_INTERRUPTED,
        "",
        "interrupted (Ctrl-C): nothing written, --output 'out' not created (no partial output "
        "left)\n",
    )
    assert len(export.calls) == 2
    no_hf = (
        f"error: HF directory {str(tmp_path)!r} has no config.json (not an HF model directory)\n"
    )
    for argv in (
        ["import", "--hf", str(tmp_path), "--output", "o"],
        ["verify", "--checkpoint", "ck", "--hf", str(tmp_path)],
    ):
        assert run_cli(argv, capsys) == (cli.EXIT_BAD_INPUT, "", no_hf)
    argv = ["export", "--checkpoint", "ck", "--output", "o", "--verify", "--verify-batch", "0"]
    assert run_cli(argv, capsys) == (
        cli.EXIT_BAD_INPUT,
        "",
        "error: batch (--verify-batch)=0 is not allowed: an integer >= 1\n",
    )
    (tmp_path / "config.json").write_text("{}")
    # the verify command checks its options without --verify
    argv = ["verify", "--checkpoint", "ck", "--hf", str(tmp_path), "--verify-seq-len", "0"]
    assert run_cli(argv, capsys) == (
        cli.EXIT_BAD_INPUT,
        "",
        "error: seq_len (--verify-seq-len)=0 is not allowed: an integer >= 1\n",
    )
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False)
    argv = ["verify", "--checkpoint", "ck", "--hf", str(tmp_path), "--summary-json", "s.json"]
    assert run_cli(argv, capsys) == (
        cli.EXIT_BAD_INPUT,
        "",
        f"error: --summary-json 's.json': directory {os.getcwd()!r} does not exist or is not "
        "writable\n",
    )
    assert check.calls == [] and recorders["import_checkpoint"].calls == []
    assert len(export.calls) == 2


def test_dtype_names_are_the_torch_dtypes():
    from megatron_latentmoe.convert import export, options

    names = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    assert {name: export.parse_dtype(name) for name in options.DTYPE_CHOICES} == names
    for name in options.DTYPE_TORCH_NAMES.values():
        assert export.parse_dtype(name) is getattr(torch, name)


# ------------------------------------------------------------------------- summary, output dir
def test_conversion_summary_figures_and_text(monkeypatch):
    s = summary.ConversionSummary("export", "ck", "hf", tensors=3, files=2, config_source="args")
    assert math.isnan(s.mb_per_s)  # no time measured yet
    s.bytes_written, s.largest_tensor_bytes = 5_000_000, 3 << 29
    clock = iter([10.0, 12.5])
    monkeypatch.setattr(summary.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(summary, "peak_rss_bytes", lambda: 1 << 31)
    timer, bar = summary.Timer(), summary.Progress(100, "export", enabled=False)
    bar.max_growth = 1 << 28
    assert s.finish(timer, bar, 4_000_000, 0.125, shards=2) is s
    assert (s.seconds, s.bytes_read, s.mb_per_s) == (2.5, 4_000_000, 2.0)
    assert (s.peak_rss_bytes, s.max_rss_growth_bytes) == (1 << 31, 1 << 28)
    assert s.extra == {"shards": 2, "stream_seconds": 0.125, "stream_mb_per_s": 40.0}
    assert s.format() == (
        "export: ck -> hf\n"
        "  model config from: args\n"
        "  tensors: 3   files: 2\n"
        "  read: 4.0 MB   written: 5.0 MB\n"
        "  time: 2.50 s   throughput: 2.0 MB/s (written)\n"
        "  peak RSS: 2.000 GiB   RSS growth during conversion: 0.250 GiB   largest tensor: "
        "1.500 GiB\n"
        "  shards: 2\n"
        "  stream_seconds: 0.125\n"
        "  stream_mb_per_s: 40.0"
    )
    assert s.to_dict() == dict(
        direction="export",
        source="ck",
        output="hf",
        tensors=3,
        bytes_read=4_000_000,
        bytes_written=5_000_000,
        seconds=2.5,
        files=2,
        peak_rss_bytes=1 << 31,
        max_rss_growth_bytes=1 << 28,
        largest_tensor_bytes=3 << 29,
        config_source="args",
        extra={"shards": 2, "stream_seconds": 0.125, "stream_mb_per_s": 40.0},
        mb_per_s=2.0,
    )
    monkeypatch.setattr(summary.time, "perf_counter", lambda: 0.0)
    s.finish(summary.Timer(), bar, 0, 0.0)  # a stream too short to time: no ZeroDivisionError
    assert s.extra["stream_mb_per_s"] == 5e9 and math.isnan(s.mb_per_s)


def test_rss_figures(monkeypatch):
    """``ru_maxrss`` is KiB on Linux (bytes on macOS); without psutil the RSS reads 0; the RSS
    growth is sampled at the 1st, 17th, 33rd, ... update and at ``close``."""
    monkeypatch.setattr(summary.sys, "platform", "linux")
    monkeypatch.setattr(summary.resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=3))
    assert summary.peak_rss_bytes() == 3 * 1024
    monkeypatch.setattr(summary.sys, "platform", "darwin")  # bytes there
    assert summary.peak_rss_bytes() == 3
    monkeypatch.setitem(sys.modules, "psutil", None)  # no psutil: no RSS figure, not an error
    assert summary.current_rss_bytes() == 0
    rss = iter([100, 150, 130, 90, 120])
    monkeypatch.setattr(summary, "current_rss_bytes", lambda: next(rss))
    bar = summary.Progress(100, "export", enabled=False)  # 100
    bar.update(1)  # 150: +50
    assert bar.max_growth == 50
    for _ in range(15):
        bar.update(1)  # not sampled
    bar.update(1)  # 17th: 130
    for _ in range(16):
        bar.update(1)
    assert bar.max_growth == 50  # 33rd: 90
    bar.close()  # 120
    assert bar.max_growth == 50
    rss = iter([100, 100, 180])
    bar = summary.Progress(100, "export", enabled=False)
    bar.update(1)
    bar.close()
    assert bar.max_growth == 80


def test_output_directory_refusals(tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert summary.check_output_dir(out, False) == out  # to be created
    out.mkdir()
    assert summary.check_output_dir(out, False) == out  # empty
    (out / "f").write_text("")
    assert summary.check_output_dir(out, True) == out

    def refusal(path, overwrite=False):
        with pytest.raises(ConversionError) as info:
            summary.check_output_dir(path, overwrite)
        return str(info.value)

    assert refusal(out) == (
        f"output directory {str(out)!r} exists and is not empty; pass --overwrite to replace it"
    )
    assert refusal(out / "f", True) == f"output {str(out / 'f')!r} exists and is not a directory"
    assert refusal(tmp_path / "no" / "out") == (
        f"the parent directory of the output, {str(tmp_path / 'no')!r}, does not exist"
    )
    # a file where a folder of the output's path should be: said, not "does not exist"
    assert refusal(out / "f" / "x") == (
        f"the parent directory of the output, {str(out / 'f')!r}, is a file, not a directory"
    )
    assert refusal(out / "f" / "sub" / "x") == (
        f"the parent directory of the output, {str(out / 'f' / 'sub')!r}, cannot be created: "
        f"{str(out / 'f')!r} on its path is a file, not a directory"
    )
    monkeypatch.setattr(summary.os, "access", lambda path, mode: False)
    assert refusal(tmp_path / "new") == (
        f"the parent directory of the output, {str(tmp_path)!r}, is not writable"
    )


def test_an_output_is_never_an_input_or_above_it(tmp_path):
    run = tmp_path / "run"
    for out in (run, tmp_path, run / ".." / "run"):
        with pytest.raises(ConversionError) as info:
            summary.check_not_an_input(out, "--hf", run)
        assert str(info.value) == (
            f"--output {str(out)!r} would replace the input --hf {str(run)!r} (it is that "
            "directory or contains it); allowed: an output directory outside the input"
        )
    summary.check_not_an_input(run / "hf", "--hf", run)  # inside the input
    summary.check_not_an_input(tmp_path / "run2", "--hf", run)  # beside it


def test_atomic_output_replaces_the_old_output_or_leaves_it(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    for error in (ValueError("bad"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with summary.atomic_output_dir(out, overwrite=True) as tmp:
                assert tmp.parent == tmp_path and tmp.name.startswith(".out.partial-")
                (tmp / "new.txt").write_text("new")
                raise error
        assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["old.txt"]
    assert capsys.readouterr().err == ""  # the caller says it (the CLI's one line)
    rename = Path.rename  # the new output cannot take the old one's place: the old one stays

    def failing_rename(self, target):
        if self.name.startswith(".out.partial-"):
            raise OSError("no space left")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="no space left"):
        with summary.atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "new.txt").write_text("new")
    assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["old.txt"]

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def interrupted_rename(self, target):  # Ctrl-C between the two renames: it waits
        rename(self, target)
        if self.name == "out":
            os.kill(os.getpid(), signal.SIGINT)
            # until a thread's C-level handler has taken it (it writes the wakeup fd): the signal
            # lands between the renames however the threads are scheduled (else, on a busy
            # machine, after them, and the restored handler raised only after the block)
            assert select.select([wake_r], [], [], 60)[0], "SIGINT not delivered in 60 s"
            os.read(wake_r, 16)

    monkeypatch.setattr(Path, "rename", interrupted_rename)
    # another thread that lets the signal through (torch's pool, pytest-xdist's I/O thread): the
    # kernel may hand it the signal, and Python still raises in the main thread
    idle = threading.Event()
    other = threading.Thread(target=idle.wait)
    other.start()
    wakeup = signal.set_wakeup_fd(wake_w)
    # Ctrl-C raises here, as in a user's process (an xdist worker may have SIGINT ignored)
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with summary.atomic_output_dir(out, overwrite=True) as tmp:
                (tmp / "new.txt").write_text("new")
    finally:
        signal.signal(signal.SIGINT, sigint)
        signal.set_wakeup_fd(wakeup)
        os.close(wake_r)
        os.close(wake_w)
        idle.set()
        other.join()
    assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["new.txt"]
    monkeypatch.undo()
    with summary.atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "final.txt").write_text("final")
    assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["final.txt"]
    assert capsys.readouterr().err == ""


def test_atomic_output_puts_back_the_default_sigterm_handler(tmp_path):
    """Under a default SIGTERM (a library caller's), the output's writing raises SystemExit(143)
    on SIGTERM, and the default is back after it, written or failed: a handler left behind
    turned the caller's later SIGTERM into an exception. (Left behind by an earlier test of the
    same process, it passed test_sigterm_while_writing_leaves_no_partial_output as the caller's.)"""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        for error in (None, ValueError("bad")):
            with pytest.raises(ValueError) if error else contextlib.nullcontext():
                with summary.atomic_output_dir(tmp_path / "out", overwrite=True):
                    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
                    if error:
                        raise error
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_leftovers_of_a_killed_conversion_are_removed_by_the_next_one(tmp_path, capsys):
    """SIGKILL leaves the temporary directory (nothing can clean it): the next conversion into
    the same --output removes it, naming it and its size in one note (it was left without a word,
    a full-size hidden copy per kill). Leftovers whose process may still write them (another
    host's, a running process's, an older version's without the owner in the name, an .old-*
    while the output is missing) are named in one note and kept."""
    out = tmp_path / "out"
    child = (
        "import sys, time\n"
        "from megatron_latentmoe.convert.summary import atomic_output_dir\n"
        "with atomic_output_dir(sys.argv[1], overwrite=False) as tmp:\n"
        "    (tmp / 'model-00001.safetensors').write_bytes(b'x' * 1000)\n"
        "    print(tmp.name, flush=True)\n"
        "    time.sleep(60)\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen(
        [sys.executable, "-c", child, str(out)], stdout=subprocess.PIPE, env=env
    )
    killed = tmp_path / proc.stdout.readline().decode().strip()
    proc.kill()
    proc.wait()
    proc.stdout.close()
    assert killed.name.endswith(f"-{proc.pid}-" + killed.name[-8:]), killed.name
    assert os.listdir(tmp_path) == [killed.name]  # what SIGKILL leaves
    host = killed.name[len(".out.partial-") :].rsplit("-", 2)[0]
    own = tmp_path / f".out.partial-{host}-{os.getpid()}-00000000"  # its PID reused: this one
    own.mkdir()
    with summary.atomic_output_dir(out, overwrite=False) as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert capsys.readouterr().err == (
        f"note: removed what a killed conversion into --output {str(out)!r} left: "
        f"{', '.join(repr(str(p)) for p in sorted([killed, own]))} (0.0 MB)\n"
    )

    kept = [
        tmp_path / f".out.partial-otherhost-{proc.pid}-11111111",  # another machine's
        tmp_path / f".out.partial-{host}-{os.getppid()}-22222222",  # a running process's
        tmp_path / ".out.partial-33333333",  # an older version's: no owner in the name
    ]
    dead_old = tmp_path / f".out.old-{host}-{proc.pid}-44444444"  # --output is back: garbage
    for path in (*kept, dead_old):
        path.mkdir()
        (path / "f").write_bytes(b"y" * 250_000)
    with summary.atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "config.json").write_text("{}")
    names = ", ".join(repr(str(p)) for p in sorted(kept))
    assert capsys.readouterr().err == (
        f"note: removed what a killed conversion into --output {str(out)!r} left: "
        f"{str(dead_old)!r} (0.2 MB)\n"
        f"note: {names} (0.8 MB) beside --output {str(out)!r} not removed: a conversion that "
        "may still run (here, on another machine, or of an older version) is writing it, or it "
        "holds the output being replaced; remove it once none does\n"
    )
    assert sorted(os.listdir(tmp_path)) == sorted(["out", *(p.name for p in kept)])
    shutil.rmtree(out)  # killed between the renames: the .old-* is the previous output, kept
    dead_old.mkdir()
    summary.clear_stale_leftovers(out)
    assert dead_old.is_dir() and str(dead_old) in capsys.readouterr().err


def test_a_leftover_being_written_here_or_by_another_users_pid_is_kept(
    tmp_path, capsys, monkeypatch
):
    """Kept, and named in the note: the temporary directory this process is writing (another
    conversion into the same --output, a thread's, checks the leftovers while it is written),
    and one whose PID runs as another user (``os.kill`` says EPERM). Its size counts files,
    not what a symlink in it points to."""
    out = tmp_path / "out"
    with summary.atomic_output_dir(out, overwrite=False) as tmp:
        summary.clear_stale_leftovers(out)
        assert tmp.is_dir()
        (tmp / "config.json").write_text("{}")
    assert (out / "config.json").is_file() and os.listdir(tmp_path) == ["out"]
    assert f"note: {str(tmp)!r} (0.0 MB) beside --output" in capsys.readouterr().err
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"z" * 250_000)
    other_user = tmp_path / f".out.partial-{summary._host()}-1-55555555"
    other_user.mkdir()
    (other_user / "link").symlink_to(target)

    def kill(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(summary.os, "kill", kill)
    summary.clear_stale_leftovers(out)
    assert other_user.is_dir() and target.is_file()
    assert capsys.readouterr().err.startswith(f"note: {str(other_user)!r} (0.0 MB) beside")
