"""Embedded default data: corpus, tokenizer (HF + Megatron), JSONL -> .bin/.idx, GPTDataset on
CPU."""

import gzip
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import types
import typing
import warnings
from pathlib import Path

import numpy
import pytest

from megatron_latentmoe.data import ASSETS_DIR, DEFAULT_CORPUS_PATH, DEFAULT_TOKENIZER_DIR
from megatron_latentmoe.data.corpus import (
    default_corpus_sequences,
    iter_corpus_texts,
    prepare_default_dataset,
)
from megatron_latentmoe.data.errors import PreprocessError
from megatron_latentmoe.data.hf_tokenizer import load_tokenizer
from megatron_latentmoe.data.indexed import preprocess_jsonl
from megatron_latentmoe.data.signals import StopOnSignals

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "tools" / "preprocess_data.py"
OFFLINE_ENV = dict(
    os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
)

SAMPLES = [
    "In the beginning, God created the heavens and the earth.",
    "Unicode: café, naïve, “quotes” — and 中文 too.\n\nTwo paragraphs\tand  spaces ",
    "",  # empty: skipped
    "A short one.",
    "   ",  # whitespace only: skipped
    "The last document <|endoftext|> has the EOD text inside it.",
]


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_TOKENIZER_DIR))


def _mcore_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.datasets.indexed_dataset  # noqa: F401
        import megatron.core.tokenizers  # noqa: F401


def _write_jsonl(path, objs, raw_tail=""):
    with open(path, "w", encoding="utf-8") as f:
        for o in objs:
            f.write(json.dumps(o, ensure_ascii=False) + "\n")
        f.write(raw_tail)
    return path


def _load_tool(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_tool_{name}", REPO / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _expected_ids(tok, texts, eod=True):
    return [tok(t).input_ids + ([tok.eos_token_id] if eod else []) for t in texts if t.strip()]


# ------------------------------------------------------------------------------------------------
# corpus + tokenizer assets
# ------------------------------------------------------------------------------------------------


def test_corpus_asset_is_real_text_of_useful_size():
    size = DEFAULT_CORPUS_PATH.stat().st_size
    assert 1_000_000 <= size <= 4_000_000
    rows = [json.loads(line) for line in gzip.open(DEFAULT_CORPUS_PATH, "rt", encoding="utf-8")]
    assert len(rows) > 1000
    assert all(set(r) == {"id", "text"} and r["text"].strip() for r in rows)
    assert sum(len(r["text"]) for r in rows) >= 1_000_000
    text = "\n".join(r["text"] for r in rows)
    for leftover in ("<w", "</", "strong:", "<note", "osisID", "&amp;", "\u00a0"):
        assert leftover not in text, leftover
    assert "In the beginning, God created the heavens and the earth." in text
    assert (ASSETS_DIR / "SOURCES.md").read_text().count("public domain") >= 1


def test_tokenizer_loads_offline_with_transformers_and_round_trips(hf_tok):
    tok = hf_tok
    assert len(tok) == 4096
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id, tok.pad_token, tok.pad_token_id) == (
        "<|endoftext|>",
        0,
        0,
        "<|pad|>",
        1,
    )
    texts = [s for s in SAMPLES if s] + list(iter_corpus_texts())[:50]
    for t in texts:
        ids = tok(t).input_ids
        assert 0 not in ids or "<|endoftext|>" in t  # nothing added by the tokenizer itself
        assert tok.decode(ids) == t
    # same ids as the raw `tokenizers` file (what the HF export carries)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json"))
    assert raw.encode(SAMPLES[1]).ids == tok(SAMPLES[1]).input_ids
    # compresses the corpus (byte-level would be 1 token per byte)
    sample = "".join(texts[-50:])
    assert len(tok(sample).input_ids) < len(sample.encode()) / 3


def test_megatron_builds_the_tokenizer_from_the_flags(hf_tok):
    """--tokenizer-type HuggingFaceTokenizer --tokenizer-model <assets/tokenizer>, via Megatron's
    parser."""
    _mcore_quiet()
    import typing_extensions

    if not hasattr(typing, "override"):  # megatron.training uses typing.override (3.12)
        typing.override = typing_extensions.override
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
        from megatron.training.arguments import parse_args

    argv = sys.argv
    sys.argv = [
        "pretrain",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(DEFAULT_TOKENIZER_DIR),
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "64",
        "--micro-batch-size",
        "1",
    ]
    try:
        args = parse_args()
    finally:
        sys.argv = argv
    args.rank = 0
    tok = build_tokenizer(args)
    assert (tok.vocab_size, args.padded_vocab_size, tok.eod, tok.pad) == (4096, 4096, 0, 1)
    for s in SAMPLES[:2]:
        assert tok.tokenize(s) == hf_tok(s).input_ids
        assert tok.detokenize(tok.tokenize(s)) == s


@pytest.mark.skipif(
    not __import__("tokenizers").__version__.startswith("0.23."),
    reason="the shipped tokenizer was trained with tokenizers 0.23; "
    "other versions may order merges differently",
)
def test_shipped_tokenizer_is_reproducible(capsys):
    assert _load_tool("train_tokenizer").main(["--check"]) == 0, capsys.readouterr().out


def _train_tokenizer_cli(*args, **env):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "train_tokenizer.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(OFFLINE_ENV, **env),
    )


@pytest.mark.parametrize(
    "lines, message",
    [
        (None, "--corpus: input file not found: {corpus}"),
        (
            ['{"text": "ok"}', "", '{"body": "no text key"}'],
            "--corpus: {corpus}:3: missing JSON key 'text' (keys present: 'body')",
        ),
        (['{"text": "ok"}', '{"text": "broken'], "--corpus: {corpus}:2: malformed JSON ("),
        (["not json at all"], "--corpus: {corpus}:1: malformed JSON (Expecting value at column 1)"),
        (['{"text": 5}'], "--corpus: {corpus}:1: JSON key 'text' holds number, expected a string"),
        (['["a list"]'], "--corpus: {corpus}:1: expected a JSON object, got array"),
        (['{"text": ""}', "   "], "--corpus: {corpus}: no non-empty documents under 'text'"),
        (
            ['{"text": "hello world"}'],
            "--corpus={corpus!r} is too small: it yields 258 tokens, the vocabulary needs",
        ),
    ],
)
def test_train_tokenizer_bad_corpus_is_one_line_exit_2(tmp_path, lines, message):
    """The corpus lines are checked by preprocess_data.py's own line parser
    (``jsonl.document_texts``), with its messages."""
    corpus = tmp_path / "in.jsonl"
    if lines is not None:
        corpus.write_text("\n".join(lines) + "\n")
    r = _train_tokenizer_cli("--corpus", corpus, "--output-dir", tmp_path / "tok")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: " + message.format(corpus=str(corpus))), r.stderr
    assert r.stderr.count("\n") == 1 and r.stdout == ""
    # nothing written: no --output-dir, no temporary folder left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == (["in.jsonl"] if lines else [])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--vocab-size", "8000"], "unrecognized arguments: --vocab-size 8000"),
        (["--corpus"], "argument --corpus: expected one argument"),
    ],
)
def test_train_tokenizer_bad_flag_is_one_line_exit_2(tmp_path, flags, message):
    """A misspelt or incomplete flag is argparse's error line alone (it printed the usage first),
    as in tools/preprocess_data.py; nothing written."""
    r = _train_tokenizer_cli("--output-dir", tmp_path / "tok", *flags)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"train_tokenizer.py: error: {message} (all flags: --help)\n"
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "source, message",
    [
        ("missing.deb", "{s} not found (a .deb or a folder is expected)"),
        ("notes.txt", "{s}: not a Debian package (no ar header)"),
        ("folder", "{s}: no SWORD zText module (ot.bzs) below this folder"),
    ],
)
def test_train_tokenizer_bad_rebuild_corpus_is_one_line_exit_2(tmp_path, source, message):
    """--rebuild-corpus with no .deb or SWORD folder there: exit 2 and "error: --rebuild-corpus:
    ..." (it was SystemExit's bare message, exit 1, against the docstring's 2 on bad input);
    the --corpus it would rewrite is left alone."""
    (tmp_path / "notes.txt").write_text("not a package")
    (tmp_path / "folder").mkdir()
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [{"text": "kept"}])
    s = tmp_path / source
    r = _train_tokenizer_cli("--rebuild-corpus", s, "--corpus", corpus, "--output-dir", s / "tok")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "error: --rebuild-corpus: " + message.format(s=s) + "\n"
    assert corpus.read_text() == '{"text": "kept"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "folder", "notes.txt"]


def test_train_tokenizer_check_needs_a_tokenizer_in_output_dir(tmp_path):
    missing, empty = tmp_path / "nothere", tmp_path / "empty"
    empty.mkdir()
    for folder, what in ((missing, "does not exist"), (empty, "has no tokenizer.json")):
        r = _train_tokenizer_cli("--check", "--output-dir", folder)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert r.stderr.startswith(
            f"error: --output-dir={str(folder)!r} {what} (--check compares a retrained tokenizer "
            "with the tokenizer.json, tokenizer_config.json, special_tokens_map.json in "
            "--output-dir)"
        ), r.stderr
        assert r.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    assert not any(empty.iterdir())


def test_train_tokenizer_writes_a_new_nested_output_dir(tmp_path):
    out = tmp_path / "a" / "b"
    r = _train_tokenizer_cli("--corpus", DEFAULT_CORPUS_PATH, "--output-dir", out)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temporary folder left


def test_train_tokenizer_is_deterministic(tmp_path):
    """The same corpus gives byte-identical tokenizer files whatever the number of threads the
    BPE trainer runs (1 vs 2), with any tokenizers version (test_shipped_tokenizer_is_reproducible
    runs only with the version that made the shipped files). The trainer has no seed: BPE merges
    are chosen by count, ties by order."""
    files = ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    for threads in ("1", "2"):
        r = _train_tokenizer_cli(
            "--corpus",
            DEFAULT_CORPUS_PATH,
            "--output-dir",
            tmp_path / threads,
            RAYON_NUM_THREADS=threads,
            TOKENIZERS_PARALLELISM="true",
        )
        assert r.returncode == 0, r.stderr
        assert sorted(p.name for p in (tmp_path / threads).iterdir()) == files
    for f in files:
        assert (tmp_path / "1" / f).read_bytes() == (tmp_path / "2" / f).read_bytes(), f


# ------------------------------------------------------------------------------------------------
# JSONL -> .bin/.idx
# ------------------------------------------------------------------------------------------------


def test_cli_writes_exactly_the_tokenizer_ids_plus_eod(tmp_path, hf_tok):
    src = _write_jsonl(
        tmp_path / "in.jsonl", [{"text": s, "meta": i} for i, s in enumerate(SAMPLES)], "\n\n"
    )
    prefix = tmp_path / "out" / "mine"
    r = subprocess.run(
        [
            sys.executable,
            str(CLI),
            "--input",
            str(src),
            "--output-prefix",
            str(prefix),
            "--json-keys",
            "text",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=OFFLINE_ENV,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        "documents: 6" in r.stdout
        and "skipped empty: 2" in r.stdout
        and f"--data-path {prefix}" in r.stdout
    )
    # the line to train with names the tokenizer folder the default wrote with
    assert (
        f"  tokenizer: --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
        f"{DEFAULT_TOKENIZER_DIR}\n"
    ) in r.stdout
    _mcore_quiet()
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    want = _expected_ids(hf_tok, SAMPLES)
    assert len(ds) == len(want) == 4
    assert [ds[i].tolist() for i in range(len(ds))] == want
    assert ds[0].dtype == numpy.uint16
    assert ds.document_indices.tolist() == list(range(len(want) + 1))  # one document per JSON line
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["mine.bin", "mine.idx"]


def test_bin_and_idx_match_an_independent_reading(tmp_path, hf_tok):
    """The .bin read as raw uint16 and the .idx read by hand (Megatron's MMIDIDX version 1:
    header, int32 sequence lengths, int64 byte pointers, int64 document indices) against a
    re-tokenisation of the JSONL: one sequence per non-blank text, exactly one EOD at the end of
    each (plus one per "<|endoftext|>" written in the text, also at its end, as Megatron's tool
    does), across batches of 256 lines."""
    samples = [*SAMPLES, "ends with the EOD text <|endoftext|>"]
    lines = [json.dumps({"text": s}) for s in samples] * 50 + ["", "  "]  # 352 lines, 2 batches
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    texts = [s for s in samples * 50 if s.strip()]
    summary = preprocess_jsonl(src, tmp_path / "ds", progress=False)
    want = [hf_tok(t).input_ids + [0] for t in texts]
    idx = (tmp_path / "ds.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, dtype_code, n_seq, n_doc = struct.unpack_from("<QBQQ", idx, 9)
    assert (version, dtype_code, n_seq, n_doc) == (1, 8, len(texts), len(texts) + 1)  # 8: uint16
    lengths = numpy.frombuffer(idx, numpy.int32, n_seq, 34)
    pointers = numpy.frombuffer(idx, numpy.int64, n_seq, 34 + 4 * n_seq)
    documents = numpy.frombuffer(idx, numpy.int64, n_doc, 34 + 12 * n_seq)
    assert len(idx) == 34 + 12 * n_seq + 8 * n_doc
    assert lengths.tolist() == [len(w) for w in want]
    assert pointers.tolist() == [2 * sum(map(len, want[:i])) for i in range(len(want))]
    assert documents.tolist() == list(range(len(texts) + 1))
    tokens = numpy.fromfile(tmp_path / "ds.bin", numpy.uint16)
    assert tokens.tolist() == [i for w in want for i in w]
    for seq, text in zip(numpy.split(tokens, numpy.cumsum(lengths)[:-1]), texts, strict=True):
        assert seq[-1] == 0 and (seq == 0).sum() == 1 + text.count("<|endoftext|>")
    assert (summary.documents, summary.skipped_empty, summary.tokens) == (
        len(samples) * 50,
        100,
        tokens.size,
    )


def _corrupt_copies(tmp_path) -> tuple[str, dict[str, str]]:
    """A good dataset of 3 sequences (3 of SAMPLES' texts + EOD, uint16), and copies with one
    thing wrong each, by name: {name: prefix}."""
    import shutil

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": SAMPLES[i]}) for i in (0, 1, 3)) + "\n")
    good = str(tmp_path / "good")
    preprocess_jsonl(src, good, progress=False)
    idx, size = Path(good + ".idx").read_bytes(), Path(good + ".bin").stat().st_size
    cases = {
        "bin_cut": (idx, size - 2),
        "bin_long": (idx, size + 2),
        "idx_cut": (idx[:-1], size),
        "idx_long": (idx + bytes(5), size),  # header and arrays right, 5 bytes after them
        "idx_version": (idx[:9] + struct.pack("<Q", 2) + idx[17:], size),
        "idx_dtype": (idx[:17] + bytes([99]) + idx[18:], size),
        "idx_magic": (b"NOTMEGA!!" + idx[9:], size),
        "documents": (idx[:-8] + struct.pack("<q", 2), size),  # last document index 2, not 3
        "empty": (idx[:18] + struct.pack("<QQq", 0, 1, 0), 0),  # Megatron's builder: no text
    }
    out = {}
    for name, (index, bin_size) in cases.items():
        prefix = str(tmp_path / name)
        Path(prefix + ".idx").write_bytes(index)
        shutil.copy(good + ".bin", prefix + ".bin")
        os.truncate(prefix + ".bin", bin_size)
        out[name] = prefix
    return good, out


def test_check_indexed_dataset_names_what_megatron_would_fail_on_later(tmp_path):
    """A .bin or .idx cut short, another format version or dtype, a pair from two writes, an .idx
    longer than its header's arrays or an empty dataset: one sentence naming the file (megatron-core
    failed on each in the middle of training with a numpy / assert traceback, or trained on a .bin
    longer than its .idx says; an .idx with bytes no header count covers it read without them:
    no file its writer writes, its header or its end from another write)."""
    from megatron_latentmoe.data.index_file import check_indexed_dataset

    good, bad = _corrupt_copies(tmp_path)
    assert check_indexed_dataset(good) == 3
    n = Path(good + ".bin").stat().st_size
    redo = "copy it again, or rebuild the pair with tools/preprocess_data.py"
    whole = 34 + 12 * 3 + 8 * 4  # header, 3 sequences, 4 document indices

    def expected(name: str, p: str) -> str:
        return {
            "bin_cut": f"{p}.bin is cut short: {n - 2} bytes, where {p}.idx ends its last "
            f"sequence at byte {n} ({redo})",
            "bin_long": f"{p}.bin does not belong to its .idx: {n + 2} bytes, where {p}.idx ends "
            f"its last sequence at byte {n} ({redo})",
            "idx_cut": f"{p}.idx is cut short: {whole - 1} bytes, where its header (3 sequences, "
            f"4 documents) needs {whole} ({redo})",
            "idx_long": f"{p}.idx is longer than its header (3 sequences, 4 documents) says: "
            f"{whole + 5} bytes, where its arrays end at byte {whole} ({whole + 3} with "
            f"Megatron's multimodal sequence modes); its header or its end is from another write "
            f"({redo})",
            "idx_version": f"{p}.idx: index format version 2; megatron-core 0.19.2 reads version "
            f"1 only ({redo})",
            "idx_dtype": f"{p}.idx: token dtype code 99 is none of megatron-core's DType codes "
            f"[1, 2, 3, 4, 5, 6, 7, 8]: the file is corrupt ({redo})",
            "idx_magic": f"{p}.idx is not a Megatron index file",
            "documents": f"{p}.idx is corrupt: its document indices do not run from 0 to its 3 "
            f"sequences ({redo})",
            "empty": f"{p}.idx holds no sequence: an empty dataset, nothing to train on",
        }[name]

    assert len(bad) == 9
    for name, prefix in bad.items():
        with pytest.raises(PreprocessError) as err:
            check_indexed_dataset(prefix)
        assert str(err.value) == expected(name, prefix), name
    # Megatron's writer adds a sequence mode a byte for a multimodal dataset: a GPT dataset reads
    # the rest of that .idx as any other
    Path(bad["idx_long"] + ".idx").write_bytes(Path(good + ".idx").read_bytes() + bytes(3))
    assert check_indexed_dataset(bad["idx_long"]) == 3


def test_an_idx_cut_inside_its_header_is_not_an_index_file(tmp_path):
    """An .idx with Megatron's magic but cut before its header ends (a copy stopped at once) is
    the one sentence, not struct's "unpack_from requires a buffer of at least 34 bytes"."""
    from megatron_latentmoe.data.index_file import INDEX_MAGIC, check_indexed_dataset

    prefix = str(tmp_path / "cut")
    Path(prefix + ".bin").write_bytes(b"")
    for size in (len(INDEX_MAGIC), 33):
        Path(prefix + ".idx").write_bytes((INDEX_MAGIC + bytes(34))[:size])
        with pytest.raises(PreprocessError) as err:
            check_indexed_dataset(prefix)
        assert str(err.value) == f"{prefix}.idx is not a Megatron index file"


def _damaged_index(tmp_path, name: str, lengths, pointers, documents) -> str:
    """A copy of the dataset ``tmp_path/good`` whose .idx arrays are the ones given."""
    import shutil

    good = str(tmp_path / "good")
    head = Path(good + ".idx").read_bytes()[:34]
    prefix = str(tmp_path / name)
    Path(prefix + ".idx").write_bytes(
        head
        + numpy.asarray(lengths, numpy.int32).tobytes()
        + numpy.asarray(pointers, numpy.int64).tobytes()
        + numpy.asarray(documents, numpy.int64).tobytes()
    )
    shutil.copy(good + ".bin", prefix + ".bin")
    return prefix


@pytest.mark.parametrize("chunk", [1 << 22, 4])
def test_check_indexed_dataset_names_a_damaged_array(tmp_path, monkeypatch, chunk):
    """A damaged .idx whose header and ends are right passed the check and reached Megatron
    (measured, GPTDataset of 16 tokens built and read whole): a length made larger or a pointer
    made huge failed in its dataset building (``ValueError: offset must be non-negative and no
    greater than buffer length``), a negative length in the batch (``IndexError: The shape of
    the mask [484] ...``), a zeroed length or two swapped pointers trained on the wrong tokens
    without an error, decreasing document indices were read as they are. Now each is one
    sentence naming the .idx, the first bad entry and what to do - also where it lies past the
    first chunk of the vectorised check (``chunk`` 4 of 10 sequences)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_latentmoe.data import index_file
    from megatron_latentmoe.data.index_file import check_indexed_dataset

    monkeypatch.setattr(index_file, "_CHUNK", chunk)
    builder = IndexedDatasetBuilder(str(tmp_path / "good.bin"), dtype=numpy.uint16)
    for n in range(1, 11):
        builder.add_document(numpy.arange(n, dtype=numpy.uint16), [n])
    builder.finalize(str(tmp_path / "good.idx"))
    assert check_indexed_dataset(str(tmp_path / "good")) == 10
    lengths = numpy.arange(1, 11)
    pointers = 2 * numpy.concatenate([[0], numpy.cumsum(lengths[:-1])])  # 0 2 6 12 20 30 ...
    documents = numpy.arange(11)
    redo = "copy it again, or rebuild the pair with tools/preprocess_data.py"

    def damaged(name, lengths=lengths, pointers=pointers, documents=documents):
        prefix = _damaged_index(tmp_path, name, lengths, pointers, documents)
        with pytest.raises(PreprocessError) as err:
            check_indexed_dataset(prefix)
        return str(err.value).replace(prefix + ".idx is corrupt: ", "")

    longer, zero, negative = lengths.copy(), lengths.copy(), lengths.copy()
    longer[5], zero[5], negative[6] = 1006, 0, -3
    swapped, huge, first = pointers.copy(), pointers.copy(), pointers.copy()
    swapped[[6, 7]] = swapped[[7, 6]]
    huge[7], first[0] = 1 << 40, 2
    down = documents.copy()
    down[6] = 2
    assert damaged("longer", lengths=longer) == (
        f"sequence 6 starts at byte 42 of the .bin, but sequence 5 (1006 tokens from byte 30) "
        f"ends at byte 2042: its sequence lengths and pointers disagree ({redo})"
    )
    assert damaged("zero", lengths=zero).startswith(
        "sequence 6 starts at byte 42 of the .bin, but sequence 5 (0 tokens from byte 30) ends "
        "at byte 30: "
    )
    assert damaged("negative", lengths=negative) == (
        f"sequence 6 has the length -3, less than 0 ({redo})"
    )
    assert damaged("swapped", pointers=swapped).startswith(
        "sequence 6 starts at byte 56 of the .bin, but sequence 5 (6 tokens from byte 30) ends "
        "at byte 42: "
    )
    assert damaged("huge", pointers=huge).startswith(
        f"sequence 7 starts at byte {1 << 40} of the .bin, but sequence 6 (7 tokens from byte "
        "42) ends at byte 56: "
    )
    assert damaged("first", pointers=first) == (
        "sequence 0 starts at byte 2 of the .bin, but the first starts at byte 0: its sequence "
        f"lengths and pointers disagree ({redo})"
    )
    assert damaged("down", documents=down) == (
        f"its document indices decrease at entry 6 (sequence 5, then 2) ({redo})"
    )
    down[6], down[4] = 6, 1  # between two chunks of 4: entries 3 and 4
    assert damaged("down_at_chunk", documents=down) == (
        f"its document indices decrease at entry 4 (sequence 3, then 1) ({redo})"
    )
    assert damaged("from_1", documents=numpy.concatenate([[1], documents[1:]])) == (
        f"its document indices do not run from 0 to its 10 sequences ({redo})"
    )


def test_a_bad_data_path_is_refused_by_the_flag_check_naming_its_flag(tmp_path):
    """``--data-path`` (each prefix of a blend) and ``--train-data-path`` are checked before any
    rank starts: the flag, the prefix, then what is wrong."""
    from types import SimpleNamespace

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.training.data_args import check_data_paths

    good, bad = _corrupt_copies(tmp_path)
    paths = dict(data_path=None, train_data_path=None, valid_data_path=None, test_data_path=None)
    args = dict(paths, data_args_path=None, per_split_data_args_path=None)
    check_data_paths(SimpleNamespace(**dict(args, data_path=["0.5", good, "0.5", good])))
    for flag, value in (
        ("data_path", ["0.5", good, "0.5", bad["bin_cut"]]),
        ("train_data_path", [bad["bin_cut"]]),
    ):
        with pytest.raises(FlagError) as err:
            check_data_paths(SimpleNamespace(**dict(args, **{flag: value})))
        assert str(err.value).startswith(
            f"--{flag.replace('_', '-')} {bad['bin_cut']}: {bad['bin_cut']}.bin is cut short: "
        ), str(err.value)
    # a damaged array inside a .idx whose header and ends are right: refused by name too
    lengths = numpy.frombuffer(Path(good + ".idx").read_bytes()[34 : 34 + 12], numpy.int32)
    pointers = numpy.frombuffer(Path(good + ".idx").read_bytes()[46 : 46 + 24], numpy.int64)
    damaged = _damaged_index(tmp_path, "swapped", lengths, pointers[[1, 0, 2]], numpy.arange(4))
    with pytest.raises(FlagError) as err:
        check_data_paths(SimpleNamespace(**dict(args, data_path=[damaged])))
    assert str(err.value).startswith(
        f"--data-path {damaged}: {damaged}.idx is corrupt: sequence 0 starts at byte "
    ), str(err.value)


@pytest.mark.parametrize("dtype", [numpy.uint16, numpy.int32])
def test_the_flag_check_reads_the_largest_id_of_a_bins_head_only(tmp_path, dtype):
    """``max_token_id_in_head``: the largest id in the first N bytes of the ``.bin`` (whole
    tokens of the dtype its ``.idx`` names), the whole file when it is shorter; an id past the
    head is left to the batches (``forward_step.get_batch``)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_latentmoe.data.index_file import HEAD_BYTES, max_token_id_in_head

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    builder.add_document(numpy.array([5, 70, 9, 11], dtype=dtype), [4])
    builder.add_document(numpy.array([3, 9000], dtype=dtype), [2])
    builder.finalize(prefix + ".idx")
    size = numpy.dtype(dtype).itemsize
    assert max_token_id_in_head(prefix) == 9000  # the file is shorter than HEAD_BYTES
    assert HEAD_BYTES == 1 << 20
    assert max_token_id_in_head(prefix, nbytes=4 * size) == 70  # the first document
    assert max_token_id_in_head(prefix, nbytes=2 * size + 1) == 70  # whole tokens only
    assert max_token_id_in_head(prefix, nbytes=size) == 5
    assert max_token_id_in_head(prefix, nbytes=size - 1) == -1  # no whole token: no id


def test_workers_write_the_same_bytes_as_one_process(tmp_path):
    """--workers 2 (batches of 256 lines tokenized out of order in 2 processes) writes .bin/.idx
    byte-identical to --workers 1, for each of two keys: 1000 corpus documents = 4 batches, as
    many as the 2 * workers read ahead, so results are also taken while more are pending."""
    texts = list(iter_corpus_texts())[:1000]
    objs = [{"text": t, "title": t[: 7 + i % 30]} for i, t in enumerate(texts)]
    src = _write_jsonl(tmp_path / "in.jsonl", objs)
    files = {}
    for workers in (1, 2):
        s = preprocess_jsonl(
            src,
            tmp_path / f"w{workers}",
            json_keys=["text", "title"],
            workers=workers,
            progress=False,
        )
        assert s.documents == 1000
        files[workers] = [
            Path(p + ext).read_bytes() for p in s.output_prefixes for ext in (".bin", ".idx")
        ]
    assert files[2] == files[1]


def test_an_error_with_batches_in_flight_lets_the_workers_exit_not_killed(tmp_path, monkeypatch):
    """A run that stops on an error while --workers 2 tokenize (here the writer's first
    document fails, 4 batches in flight): each worker finishes its batch and exits 0, nothing
    written. ``multiprocessing.Pool.terminate()`` killed them (exit -15): one killed while it
    wrote its result kept the result queue's lock, and the pool's join then waited for that lock
    forever (a fresh clone's test run hung so, in the full-disk test below)."""
    import errno
    import multiprocessing

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in iter_corpus_texts()][:2000])
    workers = []

    def fail(self, *args, **kwargs):
        workers.extend(multiprocessing.active_children())
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(IndexedDatasetBuilder, "add_document", fail)
    with pytest.raises(OSError, match="Input/output error"):
        preprocess_jsonl(src, tmp_path / "ds", workers=2, progress=False)
    assert [p.exitcode for p in workers] == [0, 0]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["in.jsonl"]


def test_a_worker_killed_mid_run_is_one_error_not_a_hang(tmp_path, monkeypatch):
    """A worker killed while the run goes on (the kernel's out-of-memory killer, a signal to it
    alone): one PreprocessError naming the workers, nothing written. ``multiprocessing.Pool``
    started another worker and waited forever for the killed one's batch (or, had it no batch,
    wrote the dataset as if nothing happened). A hang here fails the session in 120 s with every
    thread's stack (faulthandler) rather than silently."""
    import faulthandler
    import multiprocessing

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    texts = [t for t in iter_corpus_texts()][:3000]  # 12 batches of 256 lines, 4 in flight
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    add, killed = IndexedDatasetBuilder.add_document, []

    def kill_a_worker_first(self, *args, **kwargs):
        if not killed:
            worker = multiprocessing.active_children()[0]
            os.kill(worker.pid, signal.SIGKILL)
            worker.join()
            killed.append(worker.exitcode)
        add(self, *args, **kwargs)

    monkeypatch.setattr(IndexedDatasetBuilder, "add_document", kill_a_worker_first)
    faulthandler.dump_traceback_later(120, exit=True, file=sys.__stderr__)
    try:
        with pytest.raises(PreprocessError) as e:
            preprocess_jsonl(src, tmp_path / "ds", workers=2, progress=False)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert killed == [-signal.SIGKILL]
    assert str(e.value) == (
        "workers=2: a worker process died before its batch was done (killed by a signal, e.g. "
        "out of memory); rerun, with fewer workers if memory is short"
    )
    assert sorted(f.name for f in tmp_path.iterdir()) == ["in.jsonl"]


def _megatron_tokenizer_parser():
    """megatron.training's tokenizer flags, as Megatron-LM's tools/preprocess_data.py adds them."""
    import argparse

    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import _add_tokenizer_args

    return _add_tokenizer_args(argparse.ArgumentParser())


def _megatron_tokenizer(*flags):
    """The tokenizer Megatron-LM's tools/preprocess_data.py builds from these flags: its parser,
    its fixed values, megatron-core's build_tokenizer."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    args = _megatron_tokenizer_parser().parse_args(list(flags))
    args.rank, args.make_vocab_size_divisible_by = 1, 128
    args.tensor_model_parallel_size, args.vocab_extra_ids = 1, 0
    return build_tokenizer(args)


def _megatron_preprocess(texts, tokenizer_dir, eod, prefix) -> str:
    """The .bin/.idx Megatron-LM's tools/preprocess_data.py (core_v0.19) writes for these texts
    with --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR [--append-eod]: its
    tokenizer's tokenize(text) per document as one sequence, + its eod, in a megatron-core builder
    of DType.optimal_dtype(its vocab_size); returns the prefix. (Megatron's tool is not in the
    wheel: this redoes its steps with megatron-core.)"""
    _mcore_quiet()
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tok = _megatron_tokenizer(
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_dir)
    )
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(tok.vocab_size))
    for t in texts:
        ids = tok.tokenize(t) + ([tok.eod] if eod else [])
        builder.add_document(ids, [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.mark.parametrize("eod", [True, False])
def test_output_is_byte_identical_to_megatron_preprocess_data(tmp_path, eod):
    """.bin/.idx equal, byte for byte, what Megatron-LM's tools/preprocess_data.py writes for the
    same JSONL with the shipped tokenizer (:func:`_megatron_preprocess`). Blank texts are left out
    of the input: Megatron writes "" as a document of no sequence and tokenizes "   ", this tool
    skips both."""
    texts = [s for s in SAMPLES if s.strip()] + list(iter_corpus_texts())[:300]
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    ours = preprocess_jsonl(src, tmp_path / "ours", append_eod=eod, progress=False)
    assert ours.skipped_empty == 0 and ours.documents == len(texts)
    ref = _megatron_preprocess(texts, DEFAULT_TOKENIZER_DIR, eod, tmp_path / "megatron")
    for ext in (".bin", ".idx"):
        assert (tmp_path / ("ours" + ext)).read_bytes() == Path(ref + ext).read_bytes(), ext


@pytest.fixture(scope="module")
def big_bos_tokenizer(tmp_path_factory):
    """A Hugging Face word-level tokenizer of 70,003 ids ("w0" .. "w69999" are ids 3 ..): more
    than uint16 holds, and its post-processor puts the BOS <s> (id 0) before every text, as
    Llama's does; </s> (id 1) is its EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2} | {f"w{i}": i + 3 for i in range(70_000)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    folder = tmp_path_factory.mktemp("big_bos_tokenizer")
    PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(folder)
    return folder


def test_a_big_vocabulary_that_adds_a_bos_is_written_as_megatron_writes_it(
    tmp_path, big_bos_tokenizer
):
    """A tokenizer of more than 65,500 ids whose encoding starts with a BOS: the ids above 65,535
    are kept (Megatron's int32 .bin, not uint16, which would wrap them) and each document starts
    with the BOS, as Megatron's tokenizer(text).input_ids has it; byte-identical to Megatron's
    tool. (The shipped tokenizer adds no BOS and fits uint16: it tests neither.)"""
    _mcore_quiet()
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = [
        " ".join(f"w{(7919 * i + 997 * j) % 70_000}" for j in range(1 + i % 9)) for i in range(300)
    ]
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    ours = preprocess_jsonl(src, tmp_path / "ours", tokenizer=big_bos_tokenizer, progress=False)
    assert (ours.documents, ours.dtype) == (300, "int32")
    ds = IndexedDataset(str(tmp_path / "ours"))
    assert ds[1].tolist() == [0, 7919 + 3, 7919 + 997 + 3, 1]  # <s> w7919 w8916 </s>
    assert max(int(ds[i].max()) for i in range(len(ds))) > 65_535
    ref = _megatron_preprocess(texts, big_bos_tokenizer, True, tmp_path / "megatron")
    for ext in (".bin", ".idx"):
        assert (tmp_path / ("ours" + ext)).read_bytes() == Path(ref + ext).read_bytes(), ext


def test_library_options_gz_keys_no_eod(tmp_path, hf_tok):
    _mcore_quiet()
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    objs = [{"title": f"T{i}", "body": s or "x"} for i, s in enumerate(SAMPLES)]
    src = tmp_path / "in.jsonl.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(o) + "\n" for o in objs)
    s = preprocess_jsonl(
        src, tmp_path / "p", json_keys=["title", "body"], append_eod=False, progress=False
    )
    assert s.output_prefixes == [str(tmp_path / "p_title"), str(tmp_path / "p_body")]
    assert s.documents == len(objs)
    for key, prefix in zip(["title", "body"], s.output_prefixes, strict=True):
        ds = IndexedDataset(prefix)
        want = _expected_ids(hf_tok, [o[key] for o in objs], eod=False)
        assert [ds[i].tolist() for i in range(len(ds))] == want
    assert s.tokens == sum(s.per_key_tokens.values())


def test_skipped_empty_counts_the_blank_texts_of_every_key(tmp_path, hf_tok):
    """With several keys, skipped_empty counts each (document, key) pair whose text is blank,
    across keys (was only the last key's count per batch), and each key's dataset holds only its
    non-blank texts."""
    objs = [{"a": "x y", "b": ""}, {"a": " ", "b": "z"}, {"a": "", "b": "\t"}, {"a": "w", "b": "v"}]
    src = _write_jsonl(tmp_path / "in.jsonl", objs)
    s = preprocess_jsonl(src, tmp_path / "p", json_keys=["a", "b"], progress=False)
    assert (s.documents, s.skipped_empty) == (4, 4)
    want = {k: _expected_ids(hf_tok, [o[k] for o in objs]) for k in ("a", "b")}
    assert s.per_key_tokens == {k: sum(map(len, w)) for k, w in want.items()}
    assert s.tokens == s.per_key_tokens["a"] + s.per_key_tokens["b"]


def test_added_tokens_count_for_the_dtype_as_in_megatron(tmp_path):
    """The .bin dtype comes from len(tokenizer), added tokens included, as Megatron's
    HuggingFaceTokenizer.vocab_size: 65,499 base ids + 1 added token = 65,500 ids is int32 in
    Megatron's DType.optimal_dtype (uint16 holds < 65,500), not the uint16 of vocab_size."""
    _mcore_quiet()
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"</s>": 0, "<unk>": 1} | {f"w{i}": i + 2 for i in range(65_497)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>")
    tok.add_tokens(["added"])
    assert (tok.vocab_size, len(tok)) == (65_499, 65_500)
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "w5 added w65496"}])
    s = preprocess_jsonl(src, tmp_path / "o", tokenizer=tok, progress=False)
    assert s.dtype == "int32"
    idx = (tmp_path / "o.idx").read_bytes()
    assert struct.unpack_from("<B", idx, 17) == (4,)  # Megatron's DType code 4: int32
    ds = IndexedDataset(str(tmp_path / "o"))  # held: its items are views of its mmap
    assert ds[0].tolist() == [7, 65_499, 65_498, 0]


def test_a_rerun_drops_megatrons_stale_sample_index_cache(tmp_path):
    """Megatron caches its sample indices in <prefix>/cache/ (no --data-cache-path), keyed by
    path, not contents: rewriting the dataset removes that cache and the then empty <prefix>/
    folder, and leaves a <prefix>/ folder that holds anything else."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a b"}])
    (tmp_path / "ds" / "cache" / "GPTDataset_indices").mkdir(parents=True)
    (tmp_path / "ds" / "cache" / "GPTDataset_indices" / "x.npy").write_bytes(b"stale")
    preprocess_jsonl(src, tmp_path / "ds", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx", "in.jsonl"]
    (tmp_path / "ds" / "cache").mkdir(parents=True)
    (tmp_path / "ds" / "notes.txt").write_text("mine")
    preprocess_jsonl(src, tmp_path / "ds", progress=False)
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["notes.txt"]


def test_a_tokenizer_with_a_short_model_max_length_reads_long_documents_silently(tmp_path, capfd):
    """A document is longer than any model's context: a tokenizer folder that sets
    model_max_length (4 here) gives its ids without transformers' "Token indices sequence length
    is longer than the specified maximum sequence length" warning."""
    shipped = load_tokenizer()
    shipped.model_max_length = 4
    shipped.save_pretrained(tmp_path / "tok")
    capfd.readouterr()
    tok = load_tokenizer(tmp_path / "tok")
    assert len(tok("one two three four five six seven eight").input_ids) > 4
    assert "longer than the specified maximum" not in capfd.readouterr().err


def test_a_hub_name_is_looked_up_in_the_local_cache_only(monkeypatch):
    """A tokenizer name that is no folder is loaded from the local HF cache only: nothing is
    downloaded."""
    import transformers

    calls = []

    def not_cached(path, **kwargs):
        calls.append((path, kwargs))
        raise OSError("not in the cache")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", not_cached)
    with pytest.raises(PreprocessError, match="^tokenizer not found: 'org/name' is not a folder"):
        load_tokenizer("org/name")
    assert calls == [("org/name", dict(local_files_only=True, trust_remote_code=False))]


def test_a_trusted_tokenizer_that_fails_is_not_told_to_trust_it(tmp_path, monkeypatch):
    """With trust_remote_code=True a loading error that mentions trust_remote_code is the plain
    "cannot load" error, not the advice to pass --trust-remote-code that was already given."""
    import transformers

    def fail(path, **kwargs):
        raise ValueError(f"trust_remote_code={kwargs['trust_remote_code']}: remote code failed")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    (tmp_path / "tokenizer_config.json").write_text("{}")  # a tokenizer folder
    with pytest.raises(PreprocessError) as e:
        load_tokenizer(tmp_path, trust_remote_code=True)
    assert str(e.value) == (
        f"cannot load the tokenizer in {tmp_path}: trust_remote_code=True: remote code failed"
    )
    with pytest.raises(PreprocessError) as e:
        load_tokenizer(tmp_path, trust_remote_code=False)
    assert str(e.value).startswith(f"the tokenizer {str(tmp_path)!r} runs its own Python code")


@pytest.mark.parametrize(
    "lines, match",
    [
        (['{"text": "ok"}', '{"text": "broken', '{"text": "ok"}'], r"in\.jsonl:2: malformed JSON"),
        (
            ['{"text": "ok"}', "", '{"body": "no text key"}'],
            r"in\.jsonl:3: missing JSON key 'text' \(keys present: 'body'\)",
        ),
        (  # the first 10 keys of the line are named
            [json.dumps({f"k{i}": "v" for i in range(12)})],
            r"in\.jsonl:1: missing JSON key 'text' \(keys present: "
            + ", ".join(f"'k{i}'" for i in range(10))
            + r"\)$",
        ),
        (['{"text": 5}'], r"in\.jsonl:1: JSON key 'text' holds number, expected a string$"),
        # scraped data often has "text": null: JSON's name, not Python's NoneType
        (['{"text": null}'], r"in\.jsonl:1: JSON key 'text' holds null, expected a string$"),
        (['{"text": ["a"]}'], r"in\.jsonl:1: JSON key 'text' holds array, expected a string$"),
        (['{"text": true}'], r"in\.jsonl:1: JSON key 'text' holds boolean, expected a string$"),
        (["{}"], r"in\.jsonl:1: missing JSON key 'text' \(keys present: none\)$"),
        # nesting beyond the recursion limit was a RecursionError traceback
        (
            ['{"text": "ok"}', '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"],
            r"in\.jsonl:2: JSON nested too deeply to read \(deeper than Python's recursion limit "
            r"\d+\)$",
        ),
        (['["a list"]'], r"in\.jsonl:1: expected a JSON object, got array$"),
        (['"a string"'], r"in\.jsonl:1: expected a JSON object, got string$"),
        # valid JSON, but a lone UTF-16 surrogate is no Unicode text (cut emoji in scraped data):
        # the tokenizer raised TypeError, a traceback
        (
            ['{"text": "ok"}', '{"text": "cut \\ud83d emoji"}'],
            r"in\.jsonl:2: JSON key 'text' holds a lone surrogate '\\ud83d' at character 4",
        ),
        (['{"text": ""}', "   "], r"no non-empty documents"),
        # "\udcff" is written as the byte 0xff (surrogateescape): no UTF-8
        (
            ['{"text": "ok"}', '{"text": "caf\udcff"}'],
            r"in\.jsonl:2: not valid UTF-8 \('utf-8' codec can't decode byte 0xff in position 13: "
            r"invalid start byte\)$",
        ),
        ([], r"in\.jsonl: no non-empty documents for key 'text' \(0 JSON objects read\)$"),
        # a byte-order mark is read before the first line only: inside the file it is no JSON
        (['{"text": "ok"}', '\ufeff{"text": "ok"}'], r"in\.jsonl:2: malformed JSON \(Unexpected"),
    ],
)
def test_bad_input_is_named_with_line_and_key(tmp_path, lines, match):
    src = tmp_path / "in.jsonl"
    src.write_bytes("".join(line + "\n" for line in lines).encode("utf-8", "surrogateescape"))
    with pytest.raises(PreprocessError, match=match):
        preprocess_jsonl(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing written


def test_a_bad_line_past_the_first_batch_is_named_by_its_own_number(tmp_path):
    """Lines are read in batches of ``jsonl._BATCH_LINES`` (256): a bad line in a later batch,
    the first of its batch included, is named by its number in the file, as the reader and the
    tokenizer trainer's corpus reader see it."""
    from megatron_latentmoe.data import jsonl

    assert jsonl._BATCH_LINES == 256
    for bad in (257, 600):
        lines = [json.dumps({"text": f"doc {i}"}) for i in range(1, 601)]
        lines[bad - 1] = '{"text": 5}'
        src = tmp_path / "in.jsonl"
        src.write_text("".join(line + "\n" for line in lines))
        with pytest.raises(PreprocessError) as e:
            list(jsonl.iter_jsonl_texts(src))
        assert str(e.value) == f"{src}:{bad}: JSON key 'text' holds number, expected a string"


@pytest.mark.parametrize("variant", ["crlf", "bom", "bom+crlf"])
def test_crlf_and_a_bom_read_as_the_plain_file(tmp_path, variant):
    """CRLF line ends (Windows) and a UTF-8 byte-order mark before the first line (Notepad,
    PowerShell) give the .bin/.idx of the plain LF file, byte for byte; a BOM was "in.jsonl:1:
    malformed JSON (Unexpected UTF-8 BOM ...)". The tokenizer trainer reads the same texts."""
    texts = [s for s in SAMPLES if s.strip()]
    plain = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    src = tmp_path / "in.jsonl"
    data = plain.replace("\n", "\r\n") if "crlf" in variant else plain
    src.write_bytes(("\ufeff" if "bom" in variant else "").encode() + data.encode())
    ref = _write_jsonl(tmp_path / "ref.jsonl", [{"text": t} for t in texts])
    for path, prefix in ((src, "got"), (ref, "want")):
        assert preprocess_jsonl(path, tmp_path / prefix, progress=False).documents == len(texts)
    for ext in (".bin", ".idx"):
        assert (tmp_path / ("got" + ext)).read_bytes() == (tmp_path / ("want" + ext)).read_bytes()
    assert _load_tool("train_tokenizer").read_corpus_texts(src) == texts


def test_corrupt_gz_input_is_named(tmp_path):
    """A .gz that is no gzip, or is cut short, is one error naming the file and the last line
    read (not an OSError/EOFError traceback); nothing written."""
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(b'{"text": "not compressed"}\n')
    with pytest.raises(PreprocessError) as e:
        preprocess_jsonl(src, tmp_path / "out", progress=False)
    assert (
        str(e.value) == f"{src}: cannot read the input after line 0: Not a gzipped file (b'{{\"')"
    )
    whole = gzip.compress(b"".join(b'{"text": "line %d"}\n' % i for i in range(2000)))
    src.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(PreprocessError) as e:
        preprocess_jsonl(src, tmp_path / "out", progress=False)
    assert re.fullmatch(
        rf"{re.escape(str(src))}: cannot read the input after line \d+: Compressed file ended "
        "before the end-of-stream marker was reached",
        str(e.value),
    ), str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl.gz"]


def test_missing_input_and_tokenizer(tmp_path):
    with pytest.raises(PreprocessError, match="input file not found"):
        preprocess_jsonl(tmp_path / "nope.jsonl", tmp_path / "out")
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    with pytest.raises(PreprocessError, match="tokenizer not found"):
        preprocess_jsonl(src, tmp_path / "out", tokenizer=str(tmp_path / "no_tokenizer_here"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input="{d}"), "input is not a file: {d}"),
        (dict(json_keys=[]), "json_keys=[]: give at least one key"),
        # a string was split into its characters: "missing JSON key 'b'" for json_keys="body"
        (dict(json_keys="body"), "json_keys='body': expected a list of keys, e.g. ['body']"),
        (
            dict(json_keys=["text", "text"]),
            "json_keys=['text', 'text']: each key once: 'text' is given twice",
        ),
        (dict(workers=0), "workers must be >= 1, got 0"),
        (dict(log_interval=-1), "log_interval must be an integer >= 0, got -1"),
        (dict(log_interval=True), "log_interval must be an integer >= 0, got True"),
        (dict(log_interval=2.5), "log_interval must be an integer >= 0, got 2.5"),
        (
            dict(tokenizer="{d}/empty"),
            "cannot load the tokenizer in {d}/empty: no tokenizer.json nor tokenizer_config.json "
            "there (Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` "
            "library serialization file, (2) ",
        ),
        (
            dict(tokenizer=types.SimpleNamespace(eos_token_id=None)),
            "the tokenizer has no eos_token, so no EOD can be appended: turn it off with "
            "--no-append-eod (append_eod=False)",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, kwargs, message):
    """Each argument check of preprocess_jsonl: its own one-line message naming the argument and
    the value (a folder as input, or a folder holding no tokenizer, was a traceback without it)."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    (tmp_path / "empty").mkdir()
    kwargs = {k: v.format(d=tmp_path) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(PreprocessError) as e:
        preprocess_jsonl(**{"input": src, "output_prefix": tmp_path / "o", **kwargs})
    assert str(e.value).startswith(message.format(d=tmp_path)), str(e.value)
    assert "\n" not in str(e.value)  # the empty folder's ran over five lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "in.jsonl"]


def test_unwritable_output_prefix_is_named(tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    blocker = tmp_path / "file"
    blocker.write_text("a file where the output folder should go")
    with pytest.raises(PreprocessError) as e:
        preprocess_jsonl(src, blocker / "sub" / "out")
    assert str(e.value) == (
        f"output_prefix={str(blocker / 'sub' / 'out')!r}: {blocker} is not a folder; give a "
        "folder this run can create or write in"
    )


@pytest.mark.parametrize(
    "prefix, keys, message",
    [
        (
            "out/",
            ["text"],
            "--output-prefix {d}/out/: names a folder, not a file-name prefix: give e.g. "
            "'{d}/out/my_corpus' (writes my_corpus.bin / my_corpus.idx)",
        ),
        (
            "out",
            ["text", "meta/title"],
            "--json-keys text meta/title: 'meta/title' holds '/', but with several keys each key "
            "is part of a file name ({d}/out_<key>.bin): tokenize that key on its own (one key "
            "writes {d}/out.bin) or rename it in the JSONL",
        ),
        ("out", ["text", "text"], "--json-keys text text: each key once: 'text' is given twice"),
    ],
)
def test_output_names_that_are_no_file_names_are_refused(tmp_path, capsys, prefix, keys, message):
    """An --output-prefix ending in a separator, or a key holding one among several --json-keys,
    made the builder's open() a FileNotFoundError traceback; then (as a key given twice) one line
    naming the library's argument, exit 1. Now a usage error as the tool's docstring has it: one
    line naming the flag, exit 2, nothing written."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a b", "meta/title": "c"}])
    argv = ["--input", str(src), "--output-prefix", f"{tmp_path}/{prefix}", "--json-keys", *keys]
    with pytest.raises(SystemExit) as e:
        _load_tool("preprocess_data").main(argv)
    assert e.value.code == 2
    expected = "preprocess_data.py: error: " + message.format(d=tmp_path) + "\n"
    assert capsys.readouterr().err == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize(
    "prefix, keys, message",
    [
        (
            "out/",
            ["text"],
            "output_prefix='{d}/out/': names a folder, not a file-name prefix: give e.g. "
            "'{d}/out/my_corpus' (writes my_corpus.bin / my_corpus.idx)",
        ),
        (
            "out",
            ["text", "meta/title"],
            "json_keys=['text', 'meta/title']: 'meta/title' holds '/', but with several keys each "
            "key is part of a file name ({d}/out_<key>.bin): tokenize that key on its own (one "
            "key writes {d}/out.bin) or rename it in the JSONL",
        ),
    ],
)
def test_output_names_that_are_no_file_names_name_the_argument(tmp_path, prefix, keys, message):
    """preprocess_jsonl's caller (the default-dataset builder, a script) gets the same refusal
    naming its argument; nothing written."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a b", "meta/title": "c"}])
    with pytest.raises(PreprocessError) as e:
        preprocess_jsonl(src, f"{tmp_path}/{prefix}", json_keys=keys)
    assert str(e.value) == message.format(d=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_read_only_output_folder_is_named(tmp_path, monkeypatch):
    """A folder the process cannot write in (faked: the tests run as root, who may write
    anywhere) is refused before any tokenizing, naming the prefix and the folder; nothing is
    created."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(PreprocessError) as e:
        preprocess_jsonl(src, tmp_path / "ro" / "out")
    assert str(e.value) == f"output_prefix={str(tmp_path / 'ro' / 'out')!r}: " + (
        f"{tmp_path} is not writable; give a folder this run can create or write in"
    )
    assert not (tmp_path / "ro").exists()


def test_an_output_on_a_read_only_file_system_is_named_as_the_tools_name_it(tmp_path, capsys):
    """A real read-only tmpfs: ``preprocess_jsonl`` said "'...' is not writable" (or "cannot
    create ... (Read-only file system)") where tools/preprocess_data.py and the entry point say
    "is on a read-only file system"; the corpus CLI (``prepare_default_dataset``) was an
    ``OSError`` traceback from its lock file. Now all in ``files.folder_problem``'s words."""
    from megatron_latentmoe.data import corpus
    from tests.training import mounted_tmpfs

    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        advice = (
            f"{ro} is on a read-only file system; give a folder this run can create or write in"
        )
        for prefix in (ro / "out", ro / "sub" / "out"):
            with pytest.raises(PreprocessError) as e:
                preprocess_jsonl(src, prefix)
            assert str(e.value) == f"output_prefix={str(prefix)!r}: {advice}"
        with pytest.raises(SystemExit) as e:  # before anything is tokenized, as the tools
            corpus.main(["--output-prefix", str(ro / "ds")])
        assert e.value.code == 2
        assert capsys.readouterr().err == (
            f"python -m megatron_latentmoe.data.corpus: error: --output-prefix {ro}: {advice}\n"
        )


@pytest.mark.parametrize(
    "size, docs, workers",
    [
        ("64k", 400, 1),  # the .bin's writes fill a 64 KiB disk that holds an older dataset
        ("64k", 400, 2),  # the same, the tokenizing in worker processes
        ("8k", 100, 1),  # the .bin (972 bytes) takes the last 4 KiB page: the .idx's write fails
    ],
)
def test_cli_on_a_full_disk_is_one_line_exit_2_and_leaves_nothing(
    tmp_path, capsys, size, docs, workers
):
    """A real 8 KiB / 64 KiB tmpfs that fills up: the builder's write raised a bare ``OSError:
    [Errno 28] No space left on device`` traceback (exit 1). Now one line naming --output-prefix
    and the space left there (the temporaries are removed: measured 0.0 / 0.1 MB), exit 2; the
    disk holds what it held before, an older dataset at the prefix unchanged."""
    import shutil

    from tests.training import mounted_tmpfs

    words = " ".join(f"word{i}" for i in range(60))
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": f"{i} {words}"} for i in range(docs)])
    old = _write_jsonl(tmp_path / "old.jsonl", [{"text": "an older dataset"}])
    tool = _load_tool("preprocess_data")
    with mounted_tmpfs(tmp_path / "disk", f"size={size}") as disk:
        prefix = disk / "sub" / "out"
        if size == "8k":
            (disk / "filler").write_bytes(b"\0" * 4096)
        else:  # a .bin and a .idx: a 4 KiB page each
            assert tool.main(["--input", str(old), "--output-prefix", str(prefix)]) == 0
        before = {p.name: p.read_bytes() for p in disk.rglob("*") if p.is_file()}
        free = shutil.disk_usage(disk).free
        capsys.readouterr()
        argv = ["--input", str(src), "--output-prefix", str(prefix), "--workers", str(workers)]
        assert tool.main(argv) == 2
        assert capsys.readouterr() == (
            "",
            f"preprocess_data.py: error: the disk filled up writing in --output-prefix {prefix} "
            f"({free / 1e6:.1f} MB free); free space there or give --output-prefix a path on a "
            "larger disk\n",
        )
        assert {p.name: p.read_bytes() for p in disk.rglob("*") if p.is_file()} == before
        assert shutil.disk_usage(disk).free == free


def test_cli_on_a_file_system_turned_read_only_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """A real ext4 that the kernel turns read-only mid-run (``errors=remount-ro`` after a disk
    error, faked by ext4's ``trigger_fs_error`` after the first document): the builder's write
    raised ``OSError: [Errno 30] Read-only file system``, then the removal of the temporaries
    another one in its place, a traceback (exit 1). Now one line naming --output-prefix, exit 2
    (the temporaries stay: nothing can be removed there until the disk is remounted)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from tests.training import mounted_ext4

    words = " ".join(f"word{i}" for i in range(60))
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": f"{i} {words}"} for i in range(400)])
    with mounted_ext4(tmp_path / "disk") as turn_read_only:
        add, added = IndexedDatasetBuilder.add_document, []

        def add_then_fail(self, *a, **kw):
            add(self, *a, **kw)
            if not added:
                turn_read_only()
            added.append(1)

        monkeypatch.setattr(IndexedDatasetBuilder, "add_document", add_then_fail)
        prefix = tmp_path / "disk" / "sub" / "out"
        argv = ["--input", str(src), "--output-prefix", str(prefix)]
        assert _load_tool("preprocess_data").main(argv) == 2
        assert capsys.readouterr() == (
            "",
            f"preprocess_data.py: error: the file system turned read-only writing in "
            f"--output-prefix {prefix}; once the disk is checked (the kernel log says why), "
            "remount it read-write or give --output-prefix a path on another disk\n",
        )


def test_cli_error_exit_and_message(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": oops}\n')
    cli = _load_tool("preprocess_data")
    assert cli.main(["--input", str(src), "--output-prefix", str(tmp_path / "o")]) == 1
    assert f"error: {src}:3: malformed JSON" in capsys.readouterr().err
    assert (
        cli.main(
            ["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "o")]
        )
        == 1
    )
    assert "error: input file not found" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


# Megatron-LM core_v0.19 tools/preprocess_data.py's own flags (its tokenizer flags are
# megatron.training's, read from the installed wheel below).
MEGATRON_PREPROCESS_FLAGS = (
    "--input --json-keys --split-sentences --keep-newlines --append-eod --lang --output-prefix "
    "--workers --find-optimal-num-workers --workers-to-check --max-documents --partitions "
    "--log-interval --keep-sequential-samples"
).split()


def test_cli_knows_every_flag_of_megatron_preprocess_data():
    """Each flag of Megatron's tool is one of ours: honoured, accepted as ignored, or refused by
    name (none is argparse's "unrecognized arguments")."""
    tokenizer_flags = {f for a in _megatron_tokenizer_parser()._actions for f in a.option_strings}
    ours = {
        f for a in _load_tool("preprocess_data").build_parser()._actions for f in a.option_strings
    }
    assert "--tokenizer-type" in tokenizer_flags and "--trust-remote-code" in tokenizer_flags
    assert (tokenizer_flags | set(MEGATRON_PREPROCESS_FLAGS)) - ours == set()


def test_cli_runs_a_megatron_command_line(tmp_path, capsys):
    """Megatron's flags that mean the same here are honoured, and those Megatron's tool ignores in
    such a run (HuggingFaceTokenizer, one partition, no sentence splitting) are accepted and named
    in one note: the output is byte-identical to the plain command's."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": s} for s in SAMPLES])
    cli = _load_tool("preprocess_data")
    plain = ["--input", str(src), "--output-prefix", str(tmp_path / "plain")]
    assert cli.main(plain) == 0
    assert "note:" not in capsys.readouterr().err
    megatron = [
        *("--input", str(src), "--output-prefix", str(tmp_path / "meg"), "--json-keys", "text"),
        *("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"),
        *(str(DEFAULT_TOKENIZER_DIR), "--append-eod", "--workers", "1", "--partitions", "1"),
        *("--log-interval", "100", "--lang", "english", "--keep-newlines"),
        *("--keep-sequential-samples", "--vocab-size", "4096", "--vocab-extra-ids", "0"),
    ]
    assert cli.main(megatron) == 0
    err = capsys.readouterr().err
    assert (
        "note: ignored, as Megatron-LM's preprocess_data.py ignores them with "
        "HuggingFaceTokenizer, one partition and no sentence splitting: --partitions 1, "
        "--keep-newlines, --lang english, --keep-sequential-samples, --vocab-size 4096, "
        "--vocab-extra-ids 0\n"
    ) in err
    for ext in (".bin", ".idx"):
        assert (tmp_path / ("meg" + ext)).read_bytes() == (tmp_path / ("plain" + ext)).read_bytes()


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--split-sentences", "--keep-newlines"],
            "--split-sentences: not supported; this tool does not split documents into sentences "
            "(NLTK); without the flag each JSON document is written as one sequence",
        ),
        (
            ["--partitions", "4", "--keep-sequential-samples"],
            "--partitions 4: not supported; this tool reads the input in one pass (tokenizing in "
            "parallel with --workers N): use --partitions 1 or drop the flag",
        ),
        (
            ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"],
            "--tokenizer-type GPT2BPETokenizer: not supported; this tool tokenizes with a Hugging "
            "Face tokenizer: --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR",
        ),
        (
            ["--find-optimal-num-workers", "--workers-to-check", "2", "4"],
            "--find-optimal-num-workers: not supported; this tool has no worker-count search; "
            "set --workers N",
        ),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer", "--merge-file", "merges.txt"],
            "--merge-file merges.txt: not supported; the tokenizer is the Hugging Face folder "
            "given by --tokenizer-model",
        ),
        (
            ["--tokenizer-special-tokens", "<a>", "<b>"],
            "--tokenizer-special-tokens <a> <b>: not supported; it adds tokens to the vocabulary; "
            "add them to the tokenizer folder instead (add_special_tokens, save_pretrained)",
        ),
        (["--no-such-flag", "3"], "unrecognized arguments: --no-such-flag 3 (all flags: --help)"),
    ],
)
def test_cli_refuses_a_megatron_flag_in_one_line(tmp_path, capsys, flags, message):
    """A Megatron flag whose meaning this tool cannot honour: exit 2 and one line naming the flag,
    its value and what to do instead (no usage text, no traceback); nothing written."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    cli = _load_tool("preprocess_data")
    with pytest.raises(SystemExit) as e:
        cli.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), *flags])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"preprocess_data.py: error: {message}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def _remote_code_tokenizer(folder: Path, methods: str) -> Path:
    """The shipped tokenizer copied to ``folder`` as one that names its own class (auto_map, as
    Kimi's tokenizers do): ``RemoteTokenizer(PreTrainedTokenizerFast)`` with ``methods``."""
    import shutil

    shutil.copytree(DEFAULT_TOKENIZER_DIR, folder)
    (folder / "remote_tok.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class RemoteTokenizer(PreTrainedTokenizerFast):\n" + methods
    )
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(
        tokenizer_class="RemoteTokenizer",
        auto_map={"AutoTokenizer": [None, "remote_tok.RemoteTokenizer"]},
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_cli_trust_remote_code_runs_the_tokenizers_own_code(tmp_path, capsys, hf_tok):
    """A tokenizer folder naming its own class (auto_map, as Kimi's tokenizers do) is refused in
    one line without --trust-remote-code (not transformers' interactive prompt), and with it that
    class tokenizes, in the worker processes too: here it adds 2 to every id."""
    folder = _remote_code_tokenizer(
        tmp_path / "tok",
        "    def __call__(self, *args, **kwargs):\n"
        "        out = super().__call__(*args, **kwargs)\n"
        "        out['input_ids'] = [[i + 2 for i in ids] for ids in out['input_ids']]\n"
        "        return out\n",
    )
    texts = [s for s in SAMPLES if s.strip()] * 100  # 2 batches, one per worker
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    prefix = tmp_path / "out"
    argv = ["--input", str(src), "--output-prefix", str(prefix), "--tokenizer-model", str(folder)]

    assert _load_tool("preprocess_data").main(argv) == 1
    assert capsys.readouterr().err == (
        f"error: the tokenizer {str(folder)!r} runs its own Python code (auto_map in its "
        "tokenizer_config.json): allow it with --trust-remote-code (trust_remote_code=True)\n"
    )
    r = subprocess.run(
        [sys.executable, str(CLI), *argv, "--trust-remote-code", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(OFFLINE_ENV, HF_MODULES_CACHE=str(tmp_path / "modules")),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    _mcore_quiet()
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    want = [[i + 2 for i in hf_tok(t).input_ids] + [hf_tok.eos_token_id] for t in texts]
    assert [ds[i].tolist() for i in range(len(ds))] == want


def test_a_tokenizer_that_fails_in_the_workers_is_an_error_not_a_hang(tmp_path):
    """A tokenizer whose own code loads in the main process but raises in a worker process: the
    run stops with one line naming it (a raising pool initializer used to make the pool restart
    its workers forever), nothing written."""
    folder = _remote_code_tokenizer(
        tmp_path / "tok",
        "    def __init__(self, *args, **kwargs):\n"
        "        import multiprocessing\n\n"
        "        if multiprocessing.parent_process() is not None:\n"
        "            raise RuntimeError('no GPU in this process')\n"
        "        super().__init__(*args, **kwargs)\n",
    )
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": s} for s in SAMPLES if s.strip()])
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "out")]
    argv += ["--tokenizer-model", str(folder), "--trust-remote-code", "--workers", "2"]
    r = subprocess.run(
        [sys.executable, str(CLI), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(OFFLINE_ENV, HF_MODULES_CACHE=str(tmp_path / "modules")),
    )
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1] == (
        f"error: in a worker process: cannot load the tokenizer in {folder}: no GPU in this process"
    )
    assert not list(tmp_path.glob("out*"))


def test_failed_rerun_keeps_the_previous_dataset(tmp_path):
    good = _write_jsonl(tmp_path / "good.jsonl", [{"text": s} for s in SAMPLES])
    prefix = tmp_path / "ds"
    preprocess_jsonl(good, prefix, progress=False)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("ds.*")}
    bad = _write_jsonl(
        tmp_path / "bad.jsonl", [{"text": "new"}] * 600, "{not json}\n"
    )  # fails in batch 3
    with pytest.raises(PreprocessError, match=r"bad\.jsonl:601:"):
        preprocess_jsonl(bad, prefix, progress=False)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("ds*")} == before


def test_a_rerun_never_pairs_an_old_idx_with_a_new_bin(tmp_path, monkeypatch):
    """Replacing a dataset, the old .idx is removed before the new .bin is moved in and the new
    .idx is moved in last: after each rename <prefix>.idx is absent or the one of the .bin
    beside it, so a run killed between two renames leaves no dataset Megatron would read with
    the old offsets."""
    prefix = tmp_path / "ds"

    def files():
        paths = (Path(f"{prefix}.bin"), Path(f"{prefix}.idx"))
        return tuple(p.read_bytes() if p.exists() else None for p in paths)

    preprocess_jsonl(
        _write_jsonl(tmp_path / "old.jsonl", [{"text": "old"}]), prefix, progress=False
    )
    old = files()
    renames = []
    replace = os.replace

    def spy(src, dst):
        replace(src, dst)
        renames.append((Path(dst).name, files()))

    monkeypatch.setattr(os, "replace", spy)
    preprocess_jsonl(
        _write_jsonl(tmp_path / "new.jsonl", [{"text": s} for s in SAMPLES]), prefix, progress=False
    )
    new = files()
    assert old[0] != new[0] and old[1] != new[1]
    assert renames == [("ds.bin", (new[0], None)), ("ds.idx", new)]


class _Killed(BaseException):
    """A ``kill -9`` in the middle of the commit: nothing after it runs (but ``finally``)."""


@pytest.mark.parametrize("fails", ["OSError", "kill"])
@pytest.mark.parametrize("at", [1, 2, 3, 4])
def test_a_commit_stopped_between_renames_leaves_no_mix_of_old_and_new(
    tmp_path, monkeypatch, at, fails
):
    """Two keys' datasets replaced, the commit stopped at its ``at``-th rename (an ``OSError``
    from it, or a kill just after it): every prefix Megatron can read is of one write (the old
    ones, or the new ones, never one of each), a new one has no sample-index cache of the old
    (Megatron reads one as it is), and the others lack their .idx, which the flag check refuses
    by name. A rerun writes both; a new .bin beside an old .idx is refused naming both."""
    from types import SimpleNamespace

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.data.index_file import check_indexed_dataset
    from megatron_latentmoe.training.data_args import check_data_paths

    other = ("train_data_path", "valid_data_path", "test_data_path", "data_args_path")
    no_paths = dict.fromkeys((*other, "per_split_data_args_path"))

    keys, prefix = ["a", "b"], tmp_path / "ds"
    prefixes = [f"{prefix}_{k}" for k in keys]
    old = _write_jsonl(tmp_path / "old.jsonl", [{k: "old" for k in keys}])
    new = _write_jsonl(tmp_path / "new.jsonl", [{k: f"new {i}" for k in keys} for i in range(5)])
    preprocess_jsonl(old, prefix, json_keys=keys, progress=False)
    old_idx = Path(prefixes[0] + ".idx").read_bytes()
    len_old_bin = os.path.getsize(prefixes[0] + ".bin")
    for p in prefixes:
        Path(p, "cache").mkdir(parents=True)
    replace, renames = os.replace, []

    def stopped_replace(src, dst):
        renames.append(dst)
        if len(renames) == at and fails == "OSError":
            raise OSError(5, "Input/output error", dst)
        replace(src, dst)
        if len(renames) == at:
            raise _Killed

    monkeypatch.setattr(os, "replace", stopped_replace)
    with pytest.raises(OSError if fails == "OSError" else _Killed):
        preprocess_jsonl(new, prefix, json_keys=keys, progress=False)
    monkeypatch.setattr(os, "replace", replace)
    readable = {}
    for p in prefixes:
        if os.path.exists(p + ".idx"):
            readable[p] = check_indexed_dataset(p)
            assert readable[p] == 1 or not os.path.exists(os.path.join(p, "cache")), p
            continue
        with pytest.raises(FlagError) as err:
            check_data_paths(SimpleNamespace(**dict(no_paths, data_path=[p])))
        assert str(err.value) == (
            f"--data-path {p}: no Megatron indexed dataset there (missing {p}.idx, but {p}.bin "
            "is there): a tools/preprocess_data.py run stopped before it finished leaves that "
            "(it renames the .idx into place last). Rerun it to write the dataset."
        )
    assert set(readable.values()) in ({1}, {5}, set()), readable
    assert len(readable) in (0, 2) or set(readable.values()) == {5}
    preprocess_jsonl(new, prefix, json_keys=keys, progress=False)
    assert [check_indexed_dataset(p) for p in prefixes] == [5, 5]
    # a new .bin beside an old .idx (how a rename one key at a time could have left them)
    Path(prefixes[0] + ".idx").write_bytes(old_idx)
    with pytest.raises(PreprocessError) as err:
        check_indexed_dataset(prefixes[0])
    assert str(err.value).startswith(f"{prefixes[0]}.bin does not belong to its .idx: ")
    assert str(err.value).endswith(
        f"where {prefixes[0]}.idx ends its last sequence at byte {len_old_bin} (copy it again, "
        "or rebuild the pair with tools/preprocess_data.py)"
    )


def test_a_key_without_text_in_any_document_is_refused(tmp_path):
    """Among several keys, one that holds no text in any document is refused by name (not an
    empty dataset for Megatron to fail on); nothing written, not even the other key's."""
    objs = [{"text": "a b", "title": ""}, {"text": "c", "title": "  "}]
    src = _write_jsonl(tmp_path / "in.jsonl", objs)
    with pytest.raises(PreprocessError) as e:
        preprocess_jsonl(src, tmp_path / "out", json_keys=["text", "title"], progress=False)
    assert str(e.value) == f"{src}: no non-empty documents for key 'title' (2 JSON objects read)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_one_key_may_hold_a_path_separator(tmp_path):
    """A key holding "/" is refused only among several keys, where it is part of a file name;
    one key writes <prefix>.bin / .idx whatever its name."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"meta/title": "a b"}])
    s = preprocess_jsonl(src, tmp_path / "out", json_keys=["meta/title"], progress=False)
    assert (s.output_prefixes, s.documents) == ([str(tmp_path / "out")], 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.bin", "out.idx"]


def _signal_while_tokenizing(
    tmp_path, name: str, sig: int, command: list[str] | None = None, group: bool = False
) -> tuple[int, str]:
    """Run the CLI on the whole corpus (``command``: another one, given ``--output-prefix``),
    send ``sig`` once its temporary .bin exists (``group``: 0.5 s after it holds tokens, the
    workers busy, to the whole process group, as a terminal's Ctrl-C); returns the exit status
    and stderr."""
    if command is None:
        src = tmp_path / "big.jsonl"
        _write_jsonl(src, [{"text": t} for t in iter_corpus_texts()])
        command = [sys.executable, str(CLI), "--input", str(src)]
    p = subprocess.Popen(
        [*command, "--output-prefix", str(tmp_path / name)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=OFFLINE_ENV,
        start_new_session=group,
    )
    try:
        deadline = time.time() + 120
        while not [f for f in tmp_path.glob(f"{name}.bin.tmp*") if f.stat().st_size or not group]:
            assert p.poll() is None, "finished before the signal"
            assert time.time() < deadline
            time.sleep(0.01)
        time.sleep(0.5 if group else 0)
        os.killpg(p.pid, sig) if group else p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, err


def test_workers_die_with_a_killed_main_process(tmp_path):
    """``kill -9`` of tools/preprocess_data.py --workers 2 while it tokenizes (the out-of-memory
    killer does the same): its worker processes go too, within 10 s (they waited for their next
    batch forever, each holding a tokenizer)."""

    def stats() -> dict[int, tuple[str, int]]:
        """pid: (state, parent pid) of every process."""
        out = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            except OSError:  # gone meanwhile
                continue
            out[int(stat.parent.name)] = (state, int(ppid))
        return out

    def running(pids) -> list[int]:  # a zombie is dead, only not yet reaped
        now = stats()
        return [pid for pid in pids if pid in now and now[pid][0] != "Z"]

    src = _write_jsonl(tmp_path / "big.jsonl", [{"text": t} for t in iter_corpus_texts()])
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "ds"), "--workers", "2"]
    p = subprocess.Popen(
        [sys.executable, str(CLI), *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=OFFLINE_ENV,
    )
    children = []
    try:
        deadline = time.time() + 120
        while not [f for f in tmp_path.glob("ds.bin.tmp*") if f.stat().st_size]:
            assert p.poll() is None and time.time() < deadline
            time.sleep(0.01)
        children = [pid for pid, (_, ppid) in stats().items() if ppid == p.pid]
        assert len(children) >= 2, children  # the workers (and multiprocessing's tracker)
        p.kill()
        p.wait(timeout=60)
        deadline = time.time() + 10
        while running(children) and time.time() < deadline:
            time.sleep(0.05)
        assert running(children) == []
    finally:
        p.kill()
        for pid in running(children):
            os.kill(pid, signal.SIGKILL)


def test_killed_run_leaves_no_dataset(tmp_path):
    """SIGKILL while tokenizing: no <prefix>.bin/.idx appear, only its .bin.tmp<pid>, which the
    flag check names as a stopped preprocess run's (it was the no-dataset line alone); a prefix
    with no such file (nor a temporary of another name's) keeps that line."""
    from types import SimpleNamespace

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.training.data_args import check_data_paths

    _signal_while_tokenizing(tmp_path, "killed", signal.SIGKILL)
    assert not (tmp_path / "killed.bin").exists() and not (tmp_path / "killed.idx").exists()
    (tmp, *_), p = (f for f in tmp_path.iterdir() if f.name != "big.jsonl"), tmp_path / "killed"
    assert re.fullmatch(r"killed\.bin\.tmp\d+", tmp.name), tmp.name
    paths = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
    args = dict.fromkeys((*paths, "data_args_path", "per_split_data_args_path"))
    with pytest.raises(FlagError) as err:
        check_data_paths(SimpleNamespace(**dict(args, valid_data_path=[str(p)])))
    assert str(err.value) == (
        f"--valid-data-path {p}: no Megatron indexed dataset there (missing {p}.bin and {p}.idx, "
        f"but {tmp} is there): a tools/preprocess_data.py run stopped before it finished leaves "
        "that (it renames the .idx into place last). Rerun it to write the dataset."
    )
    with pytest.raises(FlagError) as err:
        check_data_paths(SimpleNamespace(**dict(args, valid_data_path=[str(p)[:-1]])))
    assert str(err.value).startswith(
        f"--valid-data-path {str(p)[:-1]}: no Megatron indexed dataset there (missing "
        f"{str(p)[:-1]}.bin and {str(p)[:-1]}.idx). Give the path prefix of a .bin/.idx pair"
    )


def test_a_stopped_writes_leftover_is_its_bin_or_a_temporary_of_its_name(tmp_path):
    """``stopped_write_leftover``: where the .idx is missing, the .bin, else a ``.bin.tmpPID`` or
    ``.idx.tmpPID`` of that prefix (never one of another name or a non-PID tail); else None."""
    from megatron_latentmoe.data.index_file import stopped_write_leftover

    prefix = str(tmp_path / "ds")
    for name, expected in (
        ("ds.bin.tmpx", None),
        ("ds.bin.tmp", None),
        ("dsx.bin.tmp7", None),
        ("ds.idx.tmp7", "ds.idx.tmp7"),
        ("ds.bin.tmp12", "ds.bin.tmp12"),  # a .bin's before an .idx's
        ("ds.bin", "ds.bin"),
    ):
        (tmp_path / name).write_bytes(b"")
        assert stopped_write_leftover(prefix) == (expected and str(tmp_path / expected)), name


def test_sigterm_removes_the_temporaries_and_exits_143(tmp_path):
    """SIGTERM (what timeout and Slurm send) while tokenizing: no dataset and no temporary file
    stays, and the exit status is 128 + 15, as the converter's."""
    code, err = _signal_while_tokenizing(tmp_path, "termed", signal.SIGTERM)
    assert code == 143, err
    assert "interrupted: nothing written" in err and "Traceback" not in err, err
    assert sorted(f.name for f in tmp_path.iterdir()) == ["big.jsonl"]


def test_ctrl_c_to_the_workers_too_is_one_line_exit_130(tmp_path):
    """Ctrl-C in a terminal reaches the whole process group, --workers 2 included, as they
    tokenize: one line, exit 130, nothing written (each worker printed its own
    KeyboardInterrupt traceback)."""
    src = _write_jsonl(tmp_path / "big.jsonl", [{"text": t} for t in iter_corpus_texts()])
    command = [sys.executable, str(CLI), "--input", str(src), "--workers", "2"]
    code, err = _signal_while_tokenizing(tmp_path, "ds", signal.SIGINT, command, group=True)
    assert (code, err.splitlines()[-1]) == (130, StopOnSignals.INTERRUPTED), err
    assert "Traceback" not in err, err
    assert sorted(f.name for f in tmp_path.iterdir()) == ["big.jsonl"]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_default_dataset_cli_stopped_while_tokenizing_leaves_no_dataset(tmp_path, sig, code):
    """python -m megatron_latentmoe.data.corpus, SIGTERM or Ctrl-C while it tokenizes: one line,
    exit 128 + the signal as tools/preprocess_data.py, and no dataset, record or temporary file
    (SIGTERM killed it with its temporaries left, Ctrl-C printed a traceback)."""
    command = [sys.executable, "-m", "megatron_latentmoe.data.corpus"]
    got, err = _signal_while_tokenizing(tmp_path, "ds", sig, command)
    assert (got, err.splitlines()[-1]) == (code, StopOnSignals.INTERRUPTED), err
    assert "Traceback" not in err, err
    assert sorted(f.name for f in tmp_path.iterdir()) == ["ds.lock"]


def test_a_signal_while_the_progress_bar_is_made_waits_until_it_is_whole(tmp_path, monkeypatch):
    """A SIGTERM whose KeyboardInterrupt came inside tqdm's ``__init__`` (the flake of the test
    above: the signal is sent once the temporary .bin exists, just before the bar is made) left
    a half-made bar whose ``__del__`` printed "Exception ignored in ... AttributeError" and a
    traceback. The bar is now made with the signals held: the stop comes once it is whole, the
    bar is closed on its way out, and nothing is written."""
    import gc

    import tqdm.auto

    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in SAMPLES])

    made, closed = [], []

    class SignalledWhileMade(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            made.append(self)  # held here: closed only by the code under test, not by __del__
            self.disable = False  # as tqdm's __init__ sets it, a bar drawn, before its position
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs at the next bytecodes: here
                pass
            super().__init__(*args, **kwargs)

        def close(self):
            closed.append(self)
            super().close()

    monkeypatch.setattr(tqdm.auto, "tqdm", SignalledWhileMade)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))
    with StopOnSignals() as stop, pytest.raises(KeyboardInterrupt):
        preprocess_jsonl(
            src, tmp_path / "out", interrupted=stop.interrupted, on_commit=stop.on_commit
        )
    # closed on the interrupt's way out, before the command prints its line (a fresh clone's
    # run of the CLI test saw the bar's last line after it, drawn at exit by __del__)
    assert closed == made
    made.clear()
    gc.collect()
    assert (unraisable, stop.signals) == ([], [signal.SIGTERM])
    assert sorted(f.name for f in tmp_path.iterdir()) == ["in.jsonl"]


def _sigterm_swallowed():
    """SIGTERM to this process, the handler's ``KeyboardInterrupt`` raised inside ``__del__``:
    Python prints and ignores it there ("Exception ignored in ..."), as it did once under load in
    importlib's ``_get_module_lock.<locals>.cb`` in the test above, which then exited 0."""

    class Dropped:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs at the next bytecodes: here
                pass

    Dropped()


@pytest.mark.parametrize(
    "where",
    [
        "batch",  # the first of three batches
        "finalize",  # after the last batch, before the rename into place
    ],
)
def test_a_sigterm_whose_interrupt_python_swallowed_still_stops_the_run(
    tmp_path, monkeypatch, capsys, where
):
    """The tool stops at the next batch, or before the rename into place (143, nothing
    written), when its SIGTERM handler's KeyboardInterrupt was swallowed. (During the rename
    the signal waits, and the handler does not raise: the next test.)"""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    import megatron_latentmoe.data.indexed as indexed

    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_type))
    batches = []
    encode, finalize = indexed._encode_batch, IndexedDatasetBuilder.finalize

    def in_batch(batch):
        batches.append(len(batch[1]))  # (first line number, lines)
        if where == "batch" and len(batches) == 1:
            _sigterm_swallowed()
        return encode(batch)

    def in_finalize(self, index):
        if where == "finalize":
            _sigterm_swallowed()
        return finalize(self, index)

    monkeypatch.setattr(indexed, "_encode_batch", in_batch)
    monkeypatch.setattr(IndexedDatasetBuilder, "finalize", in_finalize)
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": f"doc {i}"} for i in range(600)])
    previous = signal.getsignal(signal.SIGTERM)
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "ds"), "--no-progress"]
    assert _load_tool("preprocess_data").main(argv) == 143
    assert swallowed == [KeyboardInterrupt]  # the handler ran, and its raise was lost
    assert signal.getsignal(signal.SIGTERM) is previous
    assert batches == ([256] if where == "batch" else [256, 256, 88])
    assert capsys.readouterr().err == "interrupted: nothing written (temporary files removed)\n"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize(
    "keys, at",
    [
        (["text"], 1),  # the new .bin's rename: the old .idx already dropped
        (["text"], 2),  # the new .idx's rename
        (["a", "b"], 3),  # key b's .bin: key a's dataset in place, b's old .idx dropped
        (["text"], "hand-back"),  # the commit done: as the result goes back to main()
    ],
)
def test_a_signal_during_the_commit_waits_for_the_complete_dataset(
    tmp_path, monkeypatch, capsys, sig, keys, at
):
    """A SIGTERM or Ctrl-C that comes while the new dataset is renamed into place over an older
    one: it stopped the commit halfway (exit 143 / 130, "nothing written"), leaving the old
    ``.bin`` without its ``.idx`` (the old dataset gone, the new one not there) or key a's new
    dataset beside key b's broken one; one after the commit said "nothing written" of a complete
    dataset. Now the commit runs with both held off: they arrive after it, and the run is a
    success (0, the summary) with the note that the signal came too late to stop it."""
    import megatron_latentmoe.data.indexed as indexed
    from megatron_latentmoe.data.index_file import check_indexed_dataset

    tool = _load_tool("preprocess_data")
    old = _write_jsonl(tmp_path / "old.jsonl", [{k: "old" for k in keys}])
    new = _write_jsonl(tmp_path / "new.jsonl", [{k: f"new {i}" for k in keys} for i in range(5)])
    argv = ["--output-prefix", str(tmp_path / "ds"), "--json-keys", *keys, "--no-progress"]
    assert tool.main(["--input", str(old), *argv]) == 0
    capsys.readouterr()
    replace, summary, renames = os.replace, indexed.PreprocessSummary, []

    def signalled_replace(src, dst):
        renames.append(dst)
        if len(renames) == at:
            os.kill(os.getpid(), sig)
        return replace(src, dst)

    def signalled_summary(**kwargs):
        os.kill(os.getpid(), sig)
        return summary(**kwargs)

    monkeypatch.setattr(os, "replace", signalled_replace)
    if at == "hand-back":
        monkeypatch.setattr(indexed, "PreprocessSummary", signalled_summary)
    handlers = signal.getsignal(sig)
    assert tool.main(["--input", str(new), *argv]) == 0
    out, err = capsys.readouterr()
    assert (
        err == f"note: {sig.name} arrived as the dataset was renamed into place: it is complete\n"
    )
    assert out.startswith("documents: 5 "), out
    prefixes = [tmp_path / "ds"] if len(keys) == 1 else [tmp_path / f"ds_{k}" for k in keys]
    assert [check_indexed_dataset(str(p)) for p in prefixes] == [5] * len(keys)
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(
        ["new.jsonl", "old.jsonl", *(p.name + e for p in prefixes for e in (".bin", ".idx"))]
    )
    assert signal.getsignal(sig) is handlers


@pytest.mark.parametrize("at, keys", [(1, ["text"]), (3, ["a", "b"])])
def test_ctrl_c_during_the_library_commit_raises_after_it(tmp_path, monkeypatch, at, keys):
    """``preprocess_jsonl`` called from Python, Ctrl-C (Python's own handler) during the rename
    over an older dataset: the KeyboardInterrupt comes once every key's new dataset is in place
    (it left the old ``.bin`` without its ``.idx``). From another thread, where Python can set
    no handler, the same run writes the dataset and leaves the handlers alone."""
    import threading

    from megatron_latentmoe.data.index_file import check_indexed_dataset

    prefix = tmp_path / "ds"
    preprocess_jsonl(
        _write_jsonl(tmp_path / "old.jsonl", [{k: "old" for k in keys}]), prefix, json_keys=keys
    )
    new = _write_jsonl(tmp_path / "new.jsonl", [{k: f"new {i}" for k in keys} for i in range(5)])
    replace, renames = os.replace, []

    def signalled_replace(src, dst):
        renames.append(dst)
        if len(renames) == at:
            os.kill(os.getpid(), signal.SIGINT)
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", signalled_replace)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            preprocess_jsonl(new, prefix, json_keys=keys)
    finally:
        signal.signal(signal.SIGINT, previous)
    prefixes = [prefix] if len(keys) == 1 else [tmp_path / f"ds_{k}" for k in keys]
    assert [check_indexed_dataset(str(p)) for p in prefixes] == [5] * len(keys)

    monkeypatch.setattr(os, "replace", replace)
    handlers, done = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)], []
    thread = threading.Thread(
        target=lambda: done.append(preprocess_jsonl(new, tmp_path / "t", json_keys=keys[:1]))
    )
    thread.start()
    thread.join()
    assert done and check_indexed_dataset(str(tmp_path / "t")) == 5
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers


# ------------------------------------------------------------------------------------------------
# default dataset + Megatron GPTDataset on CPU without torch.distributed
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_prefix(tmp_path_factory):
    return prepare_default_dataset(tmp_path_factory.mktemp("default_data"))


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    """Where the shipped corpus's dataset goes without a folder: $MEGATRON_LATENTMOE_CACHE/data,
    else $XDG_CACHE_HOME/megatron_latentmoe/data, else ~/.cache/megatron_latentmoe/data."""
    from megatron_latentmoe.data.corpus import default_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("MEGATRON_LATENTMOE_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine" / "data"
    monkeypatch.setenv("MEGATRON_LATENTMOE_CACHE", "")
    assert default_cache_dir() == tmp_path / "xdg" / "megatron_latentmoe" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "megatron_latentmoe" / "data"


def test_default_dataset_is_cached(default_prefix, hf_tok):
    _mcore_quiet()
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    bin_path = Path(default_prefix + ".bin")
    # in the folder given, as the prefix returned says: the dataset, its record, the lock file
    assert Path(default_prefix).parent.name.startswith("default_data")
    assert sorted(p.name for p in bin_path.parent.iterdir()) == [
        f"default_corpus{ext}" for ext in (".bin", ".idx", ".json", ".lock")
    ]
    mtime = bin_path.stat().st_mtime_ns
    t = time.time()
    assert prepare_default_dataset(bin_path.parent) == default_prefix
    assert time.time() - t < 2 and bin_path.stat().st_mtime_ns == mtime  # reused, not rewritten
    record = json.loads(Path(default_prefix + ".json").read_text())
    ds = IndexedDataset(default_prefix)
    texts = list(iter_corpus_texts())
    assert len(ds) == len(texts) == record["documents"]
    assert default_corpus_sequences() == len(ds)  # counted without tokenizing, as --split checks
    assert int(ds.sequence_lengths.sum()) == record["tokens"]
    assert ds[0].tolist() == hf_tok(texts[0]).input_ids + [0]
    # a record of another transformers version makes it rebuild: the ids are tokenized again
    # (here zeroed, which check_indexed_dataset cannot see), under the same name
    stale = dict(record, libraries=dict(record["libraries"], transformers="4.0.0"))
    Path(default_prefix + ".json").write_text(json.dumps(stale))
    bin_path.write_bytes(bytes(bin_path.stat().st_size))
    assert prepare_default_dataset(bin_path.parent) == default_prefix
    ds = IndexedDataset(default_prefix)  # held: its ids live in its mmap, closed when it goes
    assert ds[0].tolist() == hf_tok(texts[0]).input_ids + [0]
    assert json.loads(Path(default_prefix + ".json").read_text()) == record
    # so does a dataset that lost its .idx, or whose record is not JSON
    for broken in (Path(default_prefix + ".idx").unlink, Path(default_prefix + ".json").write_text):
        broken(*([] if broken.__name__ == "unlink" else ["{not json"]))
        mtime = bin_path.stat().st_mtime_ns
        assert prepare_default_dataset(bin_path.parent) == default_prefix
        assert bin_path.stat().st_mtime_ns != mtime
        assert json.loads(Path(default_prefix + ".json").read_text())["sha256"] == record["sha256"]


@pytest.fixture
def tokenizing_spy(tmp_path, monkeypatch) -> list[dict]:
    """prepare_default_dataset's tokenizing replaced by a spy: it records each call's keyword
    arguments (the list returned) and writes a valid one-document dataset
    (``tmp_path/one.bin`` / ``.idx``, copied) at the prefix it is given."""
    import shutil

    from megatron_latentmoe.data import indexed

    src = _write_jsonl(tmp_path / "one.jsonl", [{"text": SAMPLES[0]}])
    preprocess_jsonl(src, tmp_path / "one", progress=False)
    calls = []

    def spy(input, output_prefix, **kwargs):
        calls.append(kwargs)
        for ext in (".bin", ".idx"):
            shutil.copy(tmp_path / f"one{ext}", output_prefix + ext)
        return types.SimpleNamespace(documents=1, tokens=2)

    monkeypatch.setattr(indexed, "preprocess_jsonl", spy)
    return calls


def test_default_dataset_is_rebuilt_exactly_when_its_record_is_stale(
    tmp_path, monkeypatch, tokenizing_spy
):
    """prepare_default_dataset's reuse rule, the tokenizing replaced by a spy: it rebuilds when
    forced, when the .idx is gone, when the record's format version is another, when the
    version of a library that tokenizes is another (or the record kept none), when a tokenizer
    file changed (other ids for the same corpus), and not when another process built the
    dataset while this one waited for the lock (every rank of a torchrun calls it); a dataset
    that fails ``check_indexed_dataset`` is rebuilt."""
    import contextlib
    import shutil
    from collections.abc import Callable
    from importlib import metadata

    from megatron_latentmoe.data import corpus

    builds = tokenizing_spy
    out = tmp_path / "data"
    record = out / "default_corpus.json"

    def rebuilds(**kwargs) -> int:
        before = len(builds)
        assert corpus.prepare_default_dataset(out, **kwargs) == str(out / "default_corpus")
        return len(builds) - before

    assert (rebuilds(), rebuilds(), rebuilds(force=True)) == (1, 0, 1)
    (out / "default_corpus.idx").unlink()
    assert rebuilds() == 1
    stamp = json.loads(record.read_text())
    assert stamp["format"] == corpus._FORMAT_VERSION
    record.write_text(json.dumps(dict(stamp, format=corpus._FORMAT_VERSION - 1)))
    assert rebuilds() == 1
    # another version of a library that tokenizes (an upgrade may give other ids), one not
    # installed, a record that kept none (written before they were kept): rebuilt, in place
    installed = metadata.version
    now = {n: installed(n) for n in ("tokenizers", "transformers")}
    assert stamp["libraries"] == now

    def versions(changed: dict) -> Callable[[str], str]:
        def version(n: str) -> str:
            if n not in changed:
                return installed(n)
            if changed[n] is None:
                raise metadata.PackageNotFoundError(n)
            return changed[n]

        return version

    for changed in ({"transformers": "99.0"}, {"tokenizers": "99.0"}, {"tokenizers": None}):
        monkeypatch.setattr(metadata, "version", versions(changed))
        assert (rebuilds(), rebuilds()) == (1, 0)
        assert json.loads(record.read_text())["libraries"] == dict(now, **changed)
    monkeypatch.setattr(metadata, "version", installed)
    assert rebuilds() == 1
    record.write_text(json.dumps({k: v for k, v in stamp.items() if k != "libraries"}))
    assert (rebuilds(), rebuilds()) == (1, 0)
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(DEFAULT_TOKENIZER_DIR, tokenizer)
    monkeypatch.setattr(corpus, "DEFAULT_TOKENIZER_DIR", tokenizer)
    assert rebuilds() == 0  # the same files elsewhere
    with open(tokenizer / "tokenizer_config.json", "a") as f:
        f.write("\n")
    assert (rebuilds(), rebuilds(), builds[-1]["tokenizer"]) == (1, 0, tokenizer)
    # a file renamed (same bytes, same order): another tokenizer for HF, so rebuilt
    (tokenizer / "special_tokens_map.json").rename(tokenizer / "special_tokens_map.json.bak")
    assert (rebuilds(), rebuilds()) == (1, 0)

    # a .bin cut short (a copy of the cache folder cut by a full disk): rebuilt
    os.truncate(out / "default_corpus.bin", 1)
    assert (rebuilds(), rebuilds()) == (1, 0)

    @contextlib.contextmanager
    def another_process_builds_it(path):
        shutil.copy(tmp_path / "one.idx", out / "default_corpus.idx")
        yield

    (out / "default_corpus.idx").unlink()
    monkeypatch.setattr(corpus, "_file_lock", another_process_builds_it)
    assert rebuilds() == 0


def test_a_tokenizer_folders_dataset_follows_its_files_and_trust_remote_code(
    tmp_path, tokenizing_spy
):
    """prepare_default_dataset, the tokenizing replaced by a spy: ``trust_remote_code`` (which
    may run a tokenizer's own code, other ids) names a dataset of its own, where the dataset made
    without it was reused; the dataset a tokenizer folder made before its files changed is
    removed when the new one is written (it stayed, one more at each change), but not the one
    made with the other ``trust_remote_code``, nor another tokenizer's, nor one whose lock
    another process holds."""
    import shutil

    from megatron_latentmoe.data import corpus

    def builds() -> list[bool]:
        return [call["trust_remote_code"] for call in tokenizing_spy]

    out, tok = tmp_path / "data", shutil.copytree(DEFAULT_TOKENIZER_DIR, tmp_path / "tok")
    with open(tok / "tokenizer_config.json", "a") as f:
        f.write("\n")  # no longer the shipped tokenizer's files
    shipped = corpus.prepare_default_dataset(out)

    def prepare(trust: bool) -> str:
        return corpus.prepare_default_dataset(out, tokenizer=tok, trust_remote_code=trust)

    plain, trusted = prepare(False), prepare(True)
    assert plain != trusted and (prepare(False), prepare(True)) == (plain, trusted)
    assert builds() == [False, False, True]
    for prefix in (plain, trusted):
        assert re.fullmatch(r"default_corpus_[0-9a-f]{12}", os.path.basename(prefix))
    assert corpus.default_dataset_name(DEFAULT_TOKENIZER_DIR, trust_remote_code=True) == (
        "default_corpus"  # the shipped files run no code of their own
    )

    def files() -> set[str]:
        return {f.name for f in out.iterdir()}

    def dataset(prefix: str) -> set[str]:
        return {os.path.basename(prefix) + ext for ext in (".bin", ".idx", ".json", ".lock")}

    with open(tok / "tokenizer_config.json", "a") as f:
        f.write("\n")
    Path(plain, "cache").mkdir(parents=True)  # Megatron's sample indices of it
    changed = prepare(False)
    assert files() == dataset(shipped) | dataset(trusted) | dataset(changed)
    with open(tok / "tokenizer_config.json", "a") as f:
        f.write("\n")
    with corpus._file_lock(Path(trusted + ".lock")):  # another process holds it
        again = prepare(True)
    assert files() == dataset(shipped) | dataset(trusted) | dataset(changed) | dataset(again)
    assert builds() == [False, False, True, False, True]


def test_a_read_only_cache_made_under_other_libraries_says_so(
    tmp_path, monkeypatch, tokenizing_spy
):
    """A read-only (e.g. shared) cache whose dataset another transformers version made must be
    tokenized again and cannot be: the line says why, with both versions; where its tokenizer's
    files changed, or a dataset made under these versions is missing, the line is the plain
    one."""
    from importlib import metadata

    from megatron_latentmoe.data import corpus

    out = tmp_path / "data"
    corpus.prepare_default_dataset(out)
    record = out / "default_corpus.json"
    stamp = json.loads(record.read_text())
    made = dict(stamp["libraries"], transformers="4.0.0")
    record.write_text(json.dumps(dict(stamp, libraries=made)))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # the tests run as root
    plain = f"output_dir={str(out)!r}: {out} is not writable"
    advice = "; give a folder this run can create or write in"
    now = metadata.version("transformers")
    for record_text, clause in (
        (json.dumps(dict(stamp, libraries=made)), f"transformers 4.0.0 (this run: {now})"),
        (json.dumps({k: v for k, v in stamp.items() if k != "libraries"}), None),
        (json.dumps(dict(stamp, libraries="edited by hand")), None),
        (json.dumps(dict(stamp, libraries=made, sha256="other")), ""),
        ("{not json", ""),
    ):
        record.write_text(record_text)
        if clause is None:  # a record without versions (written before they were kept, or
            # edited by hand): both unknown
            clause = ", ".join(
                f"{n} unknown (this run: {metadata.version(n)})"
                for n in ("tokenizers", "transformers")
            )
        said = f" (its default_corpus was tokenized with {clause}: to be made again)"
        with pytest.raises(PreprocessError) as e:
            corpus.prepare_default_dataset(out)
        assert str(e.value) == plain + (said if clause else "") + advice
    record.write_text(json.dumps(stamp))  # made under these versions, its .bin gone: plain
    os.remove(out / "default_corpus.bin")
    with pytest.raises(PreprocessError) as e:
        corpus.prepare_default_dataset(out)
    assert str(e.value) == plain + advice
    assert len(tokenizing_spy) == 1


def test_default_dataset_fingerprint_does_not_follow_the_listing_order(tmp_path, monkeypatch):
    """The record's sha256 hashes the corpus, then the tokenizer files in sorted name order: a
    folder listed in another order (another file system, a copy) is the same tokenizer, not a
    rebuild."""
    import hashlib

    from megatron_latentmoe.data import corpus

    (tmp_path / "tok").mkdir()
    for name, data in (("b.json", b"2"), ("a.json", b"1"), ("c.txt", b"3")):
        (tmp_path / "tok" / name).write_bytes(data)
    (tmp_path / "tok" / "sub").mkdir()  # folders are not hashed
    (tmp_path / "c.jsonl").write_bytes(b"corpus")
    listing = Path.iterdir
    seen = []
    for order in (sorted, lambda ps: sorted(ps, reverse=True)):
        monkeypatch.setattr(Path, "iterdir", lambda self, o=order: iter(o(listing(self))))
        seen.append(corpus._fingerprint(tmp_path / "c.jsonl", tmp_path / "tok"))
    want = hashlib.sha256(b"c.jsonlcorpusa.json1b.json2c.txt3").hexdigest()
    libraries = corpus._library_versions()
    assert seen == [{"format": corpus._FORMAT_VERSION, "sha256": want, "libraries": libraries}] * 2


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    from tests.training import small_tokenizer

    return small_tokenizer(tmp_path_factory.mktemp("other_tokenizer"))


def test_default_dataset_with_another_tokenizer_holds_its_ids(
    default_prefix, other_tokenizer, tmp_path
):
    """A run's --tokenizer-model OTHER without --data-path: the shipped corpus tokenized with
    OTHER, under a name of its own (``default_corpus_<hash>``) beside the shipped tokenizer's
    dataset, which stays as it was and is still reused; each is reused on the next call. (Was:
    the shipped tokenizer's ids whatever the run's tokenizer, here up to 4095 for OTHER's 600.)"""
    import shutil

    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    from megatron_latentmoe.data.corpus import default_dataset_name

    for ext in (".bin", ".idx", ".json"):  # the shipped tokenizer's dataset, in the same folder
        shutil.copy2(default_prefix + ext, tmp_path / f"default_corpus{ext}")
    shipped = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()}
    prefix = prepare_default_dataset(tmp_path, tokenizer=other_tokenizer)
    name = default_dataset_name(other_tokenizer)
    assert re.fullmatch(r"default_corpus_[0-9a-f]{12}", name) and prefix == str(tmp_path / name)
    tok = AutoTokenizer.from_pretrained(str(other_tokenizer))
    texts = list(iter_corpus_texts())
    ds = IndexedDataset(prefix)
    assert len(ds) == len(texts)
    for i in (0, 1, len(texts) // 2, len(texts) - 1):
        ids = ds[i].tolist()
        assert ids == tok(texts[i]).input_ids + [tok.eos_token_id]
        assert tok.decode(ids[:-1]) == texts[i]
    assert int(numpy.fromfile(prefix + ".bin", dtype=ds.index.dtype).max()) == len(tok) - 1 == 599
    assert json.loads(Path(prefix + ".json").read_text())["tokenizer"] == str(other_tokenizer)
    # the shipped tokenizer's dataset untouched, and both reused as they are
    mtime = Path(prefix + ".bin").stat().st_mtime_ns
    assert prepare_default_dataset(tmp_path) == str(tmp_path / "default_corpus")
    assert prepare_default_dataset(tmp_path, tokenizer=other_tokenizer) == prefix
    assert Path(prefix + ".bin").stat().st_mtime_ns == mtime
    now = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()}
    assert {k: now[k] for k in shipped} == shipped


def test_default_dataset_name_says_which_tokenizer(other_tokenizer, tmp_path, monkeypatch):
    """``default_corpus`` for the shipped tokenizer, by path or a copy of its files; another
    tokenizer's name follows its files (a changed file: another name, so it is tokenized again),
    not the weights of a model folder beside them, the folder's path nor the libraries'
    versions."""
    import shutil
    from importlib import metadata

    from megatron_latentmoe.data.corpus import default_dataset_name

    assert default_dataset_name() == default_dataset_name(DEFAULT_TOKENIZER_DIR) == "default_corpus"
    assert default_dataset_name(shutil.copytree(DEFAULT_TOKENIZER_DIR, tmp_path / "copy")) == (
        "default_corpus"
    )
    other = default_dataset_name(other_tokenizer)
    moved = shutil.copytree(other_tokenizer, tmp_path / "model")
    (moved / "model.safetensors").write_bytes(b"weights")
    assert default_dataset_name(moved) == other != "default_corpus"
    # nor the versions of transformers/tokenizers (kept in the record: a resume finds the name)
    monkeypatch.setattr(metadata, "version", lambda n: "99.0")
    assert default_dataset_name(moved) == other
    with open(moved / "tokenizer_config.json", "a") as f:
        f.write("\n")
    assert default_dataset_name(moved) not in (other, "default_corpus")


def test_default_dataset_cli_prints_the_absolute_data_path(tmp_path, monkeypatch, capsys):
    """python -m megatron_latentmoe.data.corpus --output-prefix ds: the dataset goes to ./ds.*
    and the flags it prints name it by its absolute path (the tokenizing replaced by a spy)."""
    from megatron_latentmoe.data import corpus, indexed

    calls = []

    def spy(input, output_prefix, **kwargs):
        calls.append((output_prefix, kwargs["workers"]))
        for ext in (".bin", ".idx"):
            Path(output_prefix + ext).write_bytes(b"tokens")
        return types.SimpleNamespace(documents=3, tokens=12345)

    monkeypatch.setattr(indexed, "preprocess_jsonl", spy)
    monkeypatch.chdir(tmp_path)
    assert corpus.main(["--output-prefix", "ds", "--workers", "2"]) == 0
    assert calls == [(str(tmp_path / "ds"), 2)]
    assert capsys.readouterr().out == (
        "default dataset: 3 documents, 12,345 tokens\n"
        f"  --data-path {tmp_path / 'ds'}\n"
        f"  --tokenizer-type HuggingFaceTokenizer --tokenizer-model {DEFAULT_TOKENIZER_DIR}\n"
    )


def test_default_corpus_sequences_skips_blank_documents_as_the_preprocessor_does(monkeypatch):
    """A document whose text is empty or only whitespace is no sequence (``preprocess_jsonl``
    keeps only texts with ``text.strip()``)."""
    from megatron_latentmoe.data import corpus

    monkeypatch.setattr(corpus, "iter_corpus_texts", lambda: iter(["a", "", " \n\t", "b "]))
    assert corpus.default_corpus_sequences() == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--output-prefix", "{d}/ds", "--workers", "0"],
            "python -m megatron_latentmoe.data.corpus: error: argument --workers: expected an "
            "integer >= 1, got 0 (all flags: --help)",
        ),
        (
            ["--bogus"],
            "python -m megatron_latentmoe.data.corpus: error: unrecognized arguments: --bogus "
            "(all flags: --help)",
        ),
        (  # was exit 1 naming prepare_default_dataset's output_dir='{d}/afile'
            ["--output-prefix", "{d}/afile/name"],
            "python -m megatron_latentmoe.data.corpus: error: --output-prefix {d}/afile: "
            "{d}/afile is not a folder; give a folder this run can create or write in",
        ),
        (  # was written as {d}/out.bin beside the folder; then exit 1 naming output_prefix
            ["--output-prefix", "{d}/out/"],
            "python -m megatron_latentmoe.data.corpus: error: --output-prefix {d}/out/: names a "
            "folder, not a file-name prefix: give e.g. '{d}/out/my_corpus' (writes my_corpus.bin "
            "/ my_corpus.idx)",
        ),
    ],
)
def test_default_dataset_cli_bad_flag_is_one_line(tmp_path, capsys, argv, message):
    """python -m megatron_latentmoe.data.corpus: a bad flag, --workers 0, an output folder that
    is a file or a prefix that names a folder is one line (they were the usage text, a
    PreprocessError traceback, a FileExistsError traceback and DIR.bin written beside DIR/);
    nothing written."""
    from megatron_latentmoe.data import corpus

    (tmp_path / "afile").write_text("a file where the folder should go")
    argv = [a.format(d=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as e:
        corpus.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == message.format(d=tmp_path) + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_default_dataset_cli_names_an_unusable_cache_folder(tmp_path, capsys, monkeypatch):
    """Without --output-prefix the folder is the shipped corpus's cache folder, named as the
    entry point names it (it was exit 1 naming prepare_default_dataset's output_dir)."""
    from megatron_latentmoe.data import corpus

    (tmp_path / "afile").write_text("a file where the cache folder should go")
    monkeypatch.setenv("MEGATRON_LATENTMOE_CACHE", str(tmp_path / "afile"))
    with pytest.raises(SystemExit) as e:
        corpus.main([])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"python -m megatron_latentmoe.data.corpus: error: {corpus.DEFAULT_CACHE_ORIGIN} "
        f"{tmp_path}/afile/data: {tmp_path}/afile is not a folder; give a folder this run can "
        "create or write in\n"
    )


def test_default_dataset_cli_on_a_full_disk_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """As tools/preprocess_data.py's (its real full disk: above): the builder's ENOSPC was an
    ``OSError`` traceback (measured on a 64 KiB tmpfs); now one line naming --output-prefix,
    exit 2. Another OSError is raised as before."""
    import errno
    import shutil

    from megatron_latentmoe.data import corpus

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(corpus, "prepare_default_dataset", full)
    prefix = tmp_path / "out" / "c"
    assert corpus.main(["--output-prefix", str(prefix)]) == 2
    free = shutil.disk_usage(tmp_path).free
    assert capsys.readouterr().err == (
        "python -m megatron_latentmoe.data.corpus: error: the disk filled up writing in "
        f"--output-prefix {prefix} ({free / 1e6:.1f} MB free); free space there or give "
        "--output-prefix a path on a larger disk\n"
    )

    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(corpus, "prepare_default_dataset", broken)
    with pytest.raises(OSError, match="Input/output error"):
        corpus.main(["--output-prefix", str(prefix)])


def test_gpt_dataset_builds_from_the_default_dataset_on_cpu(default_prefix, monkeypatch):
    _mcore_quiet()
    import megatron.core.datasets.utils as mcore_data_utils
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    assert not torch.distributed.is_initialized()

    def no_make():
        raise AssertionError("compile_helpers (make) must not be needed")

    monkeypatch.setattr(mcore_data_utils, "compile_helpers", no_make)
    tok = MegatronTokenizer.from_pretrained(
        tokenizer_path=str(DEFAULT_TOKENIZER_DIR), metadata_path={"library": "huggingface"}
    )
    seq = 64
    cfg = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=seq,
        blend=([default_prefix], None),
        split="98,1,1",
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train, valid, test = BlendedMegatronDatasetBuilder(
            GPTDataset, [200, 20, 20], lambda: True, cfg
        ).build()
    assert not [w for w in caught if "pad token" in str(w.message)]  # <|pad|> is distinct from EOD
    assert (
        isinstance(train, GPTDataset) and len(train) >= 200 and len(valid) >= 20 and len(test) >= 20
    )
    s = train[3]
    assert s["tokens"].shape == s["labels"].shape == (seq,)
    assert torch.equal(s["tokens"][1:], s["labels"][:-1])
    assert int(s["tokens"].max()) < 4096 and float(s["loss_mask"].sum()) == seq
    words = tok.detokenize(s["tokens"].tolist()).replace("<|endoftext|>", "\n").split()
    corpus_text = " ".join(iter_corpus_texts())
    assert " ".join(words[1:6]) in corpus_text
    cache = Path(default_prefix) / "cache"  # Megatron's default index cache: <prefix>/cache/
    assert cache.is_dir()
    prepare_default_dataset(Path(default_prefix).parent, force=True)
    assert not cache.exists()  # a rebuilt dataset drops the now stale sample indices


def test_iter_corpus_texts_reads_a_corpus_as_the_preprocessor_does(tmp_path):
    """The shipped corpus's reader checks each line as ``preprocess_jsonl`` does: a BOM is
    skipped, a bad line is one error naming file and line (was a json traceback)."""
    good = tmp_path / "c.jsonl"
    good.write_bytes('\ufeff{"text": "a"}\n\n{"text": "b"}\n'.encode())
    assert list(iter_corpus_texts(good)) == ["a", "b"]
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}], '{"text": null}\n')
    with pytest.raises(PreprocessError) as e:
        list(iter_corpus_texts(bad))
    assert str(e.value) == f"{bad}:2: JSON key 'text' holds null, expected a string"


def test_default_dataset_with_a_tokenizer_without_eos_says_what_a_run_can_do(
    other_tokenizer, tmp_path
):
    """The shipped corpus's dataset ends each document with the tokenizer's EOS; a tokenizer
    without one was refused with ``preprocess_jsonl``'s advice, ``--no-append-eod
    (append_eod=False)``, which neither the training entry point nor the corpus CLI has: the
    refusal names the tokenizer and what a run can do instead; nothing is written."""
    import shutil

    tokenizer = tmp_path / "no_eos"
    shutil.copytree(other_tokenizer, tokenizer)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = tokenizer / name
        if path.exists():
            config = json.loads(path.read_text())
            config.pop("eos_token", None)
            path.write_text(json.dumps(config))
    out = tmp_path / "out"
    with pytest.raises(PreprocessError) as err:
        prepare_default_dataset(out, tokenizer=tokenizer)
    assert str(err.value) == (
        f"the tokenizer {str(tokenizer)!r} has no eos_token: the shipped corpus is tokenized "
        "with an EOS after each document (Megatron's EOD). Use a tokenizer with an eos_token, or "
        "train on a dataset of your own (--data-path) made by tools/preprocess_data.py, which "
        "takes --no-append-eod"
    )
    assert not any(p.suffix in (".bin", ".idx", ".json") for p in out.iterdir())


@pytest.mark.parametrize(
    "flags, shown",
    [
        (["--vocab-file", "vocab.json"], "--vocab-file vocab.json"),
        (["--merge-file", "merges.txt"], "--merge-file merges.txt"),
        (["--tokenizer-metadata", "meta.json"], "--tokenizer-metadata meta.json"),
        (["--tokenizer-special-tokens", "<a>", "<b>"], "--tokenizer-special-tokens <a> <b>"),
        (["--tokenizer-hf-no-use-fast"], "--tokenizer-hf-no-use-fast"),
        (["--tokenizer-hf-no-include-special-tokens"], "--tokenizer-hf-no-include-special-tokens"),
    ],
)
def test_a_tokenizer_flag_the_shipped_corpus_cannot_honour_is_refused(monkeypatch, flags, shown):
    """Without --data-path, a Megatron flag that changes its HuggingFaceTokenizer's ids and that
    the shipped corpus's tokenizing cannot honour is refused in one line, naming it and why (the
    dataset was the folder's ids as they are, under the same cached name, while the run's
    tokenizer gave others)."""
    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()
    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.compat.training import parse_with_our_flags
    from megatron_latentmoe.data.hf_tokenizer import TOKENIZER_FLAGS_NOT_HONOURED
    from megatron_latentmoe.training.arguments import (
        add_stable_latentmoe_args,
        validate_stable_latentmoe_args,
    )
    from tests.training import tiny_args

    monkeypatch.setattr(sys, "argv", ["pretrain", *tiny_args(), *flags])
    args = parse_with_our_flags(add_stable_latentmoe_args)
    with pytest.raises(FlagError) as err:
        validate_stable_latentmoe_args(args, has_cuda=False, have_te=False)
    assert str(err.value) == (
        f"{shown} without --data-path: the shipped corpus is tokenized with the tokenizer folder "
        f"as it is ({TOKENIZER_FLAGS_NOT_HONOURED[flags[0]][1]}); allowed: leave it out, or "
        "--data-path PREFIX of a dataset made with this tokenizer (Megatron's "
        "tools/preprocess_data.py)"
    )
