"""JSONL -> Megatron indexed dataset (``.bin``/``.idx``), written with megatron-core's own builder.

``preprocess_jsonl`` reads a JSONL file (optionally ``.gz``), one JSON object per line, tokenizes
the string under each of ``json_keys`` with a Hugging Face tokenizer (the shipped one by default),
optionally appends the tokenizer's EOS token as Megatron's end-of-document (EOD) token, and writes
each key's documents with ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` - the
format Megatron's ``GPTDataset`` (``--data-path``) reads.

Token ids are exactly ``tokenizer(text).input_ids`` (+ ``[eos_token_id]``), which is what
Megatron's ``--tokenizer-type HuggingFaceTokenizer`` produces for the same text.

Output names: with one key the dataset is ``<prefix>.bin`` / ``<prefix>.idx`` (``--data-path
<prefix>``); with several keys each key gets ``<prefix>_<key>.bin`` / ``.idx``.

Writes are atomic: everything goes to temporary names beside the target and is renamed only when
all input was read without error; every old ``.idx`` is removed before any ``.bin`` is replaced and
the new ``.idx`` files are renamed last (``_commit``), so an interrupted run never leaves a
readable half dataset, nor one key's new dataset beside another's old one (a ``kill -9`` may
leave ``*.tmp<pid>`` files, which nothing reads); Ctrl-C and SIGTERM wait until the renames are
done (``_signals_held``).
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import io
import json
import multiprocessing
import os
import shutil
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy

from megatron_latentmoe.files import WRITABLE_FOLDER, folder_problem

from . import DEFAULT_TOKENIZER_DIR

PathLike = str | os.PathLike

# Lines handed to a worker (or tokenized in one batch call) at a time.
_BATCH_LINES = 256


class PreprocessError(Exception):
    """Bad input or tokenizer: the message says what and where (file:line)."""


class NoEosError(PreprocessError):
    """``append_eod`` with a tokenizer that has no eos token: callers that cannot turn
    ``append_eod`` off (the shipped corpus's dataset) say what the user can do instead."""


@dataclass
class PreprocessSummary:
    """What a preprocessing run wrote."""

    output_prefixes: list[str]
    documents: int  # JSON objects read (non-blank lines)
    tokens: int  # tokens written, EODs included, all keys together
    skipped_empty: int  # (document, key) pairs whose text was empty or whitespace: not written
    seconds: float
    dtype: str = ""
    per_key_tokens: dict = field(default_factory=dict)

    def __str__(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else float("inf")
        lines = [
            f"documents: {self.documents:,}  tokens: {self.tokens:,}  skipped empty: "
            f"{self.skipped_empty:,}  time: {self.seconds:.2f} s  ({rate:,.0f} tokens/s)"
        ]
        for p in self.output_prefixes:
            lines.append(f"  wrote {p}.bin / {p}.idx ({self.dtype})  ->  --data-path {p}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------- Tokenizer


_HF_FOLDER = "the tokenizer is the Hugging Face folder given by --tokenizer-model"
TOKENIZER_FLAGS_NOT_HONOURED: dict[str, tuple[str, str]] = {
    "--vocab-file": ("vocab_file", _HF_FOLDER),
    "--merge-file": ("merge_file", _HF_FOLDER),
    "--tokenizer-metadata": ("metadata_path", _HF_FOLDER),
    "--tokenizer-special-tokens": (
        "special_tokens",
        "it adds tokens to the vocabulary; add them to the tokenizer folder instead "
        "(add_special_tokens, save_pretrained)",
    ),
    "--tokenizer-hf-no-use-fast": (
        "tokenizer_hf_no_use_fast",
        "the folder's fast tokenizer is used",
    ),
    "--tokenizer-hf-no-include-special-tokens": (
        "tokenizer_hf_no_include_special_tokens",
        "tokenizer(text).input_ids is written, special tokens included",
    ),
}
"""Megatron's flags that change the ids of its ``HuggingFaceTokenizer`` and that the preprocessing
here cannot honour (:func:`load_tokenizer` loads the ``--tokenizer-model`` folder as it is): each
flag's args attribute, and why. tools/preprocess_data.py refuses them; so does a training run on
the shipped corpus, which it tokenizes with the run's tokenizer (:mod:`.corpus`)."""


def load_tokenizer(tokenizer: PathLike | Any | None = None, trust_remote_code: bool = False):
    """A Hugging Face tokenizer from a folder (the shipped one when ``None``) or an object as is.

    ``trust_remote_code``: let a tokenizer whose ``tokenizer_config.json`` names its own Python
    class (``auto_map``) run that code, as Megatron's ``--trust-remote-code``; without it such a
    tokenizer is refused (never the interactive prompt of ``transformers``)."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if tokenizer is None:
        tokenizer = DEFAULT_TOKENIZER_DIR
    path = os.fspath(tokenizer)
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is in the [hf] extra
        raise PreprocessError(
            "preprocessing needs `transformers` (pip install 'megatron-latentmoe[hf]')"
        ) from e
    if not os.path.isdir(path):
        # A hub name works only if it is already in the local HF cache: nothing is downloaded here.
        try:
            tok = AutoTokenizer.from_pretrained(
                path, local_files_only=True, trust_remote_code=trust_remote_code
            )
        except Exception as e:
            _refuse_remote_code(path, e, trust_remote_code)
            raise PreprocessError(
                f"tokenizer not found: {path!r} is not a folder (nor a cached HF name): {e}"
            ) from e
    else:
        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as e:
            _refuse_remote_code(path, e, trust_remote_code)
            raise PreprocessError(f"cannot load the tokenizer in {path}: {e}") from e
    # Documents are longer than any model context; silence "sequence length is longer than"
    # warnings.
    tok.model_max_length = 1 << 62
    return tok


def _refuse_remote_code(path: str, error: Exception, trust_remote_code: bool) -> None:
    if not trust_remote_code and "trust_remote_code" in str(error):
        raise PreprocessError(
            f"the tokenizer {path!r} runs its own Python code (auto_map in its "
            "tokenizer_config.json): allow it with --trust-remote-code (trust_remote_code=True)"
        ) from None


def _eod_id(tok) -> int:
    eod = getattr(tok, "eos_token_id", None)
    if eod is None:
        raise NoEosError(
            "the tokenizer has no eos_token, so no EOD can be appended: turn it off with "
            "--no-append-eod (append_eod=False)"
        )
    return int(eod)


# ------------------------------------------------------ Workers: parse + tokenize a batch of lines

_W: dict = {}


def _worker_init(
    tokenizer, json_keys, append_eod, input_name, subprocess_worker=False, trust_remote_code=False
) -> None:
    if subprocess_worker:  # N processes x Rust threads would oversubscribe the cores
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        tok = load_tokenizer(tokenizer, trust_remote_code)
    except Exception as e:
        if not subprocess_worker:
            raise
        # A raising pool initializer makes the pool start a new worker, forever: the run would
        # hang. Kept for the first batch to report (_encode_batch). The main process loaded the
        # same tokenizer, so this is rare (a tokenizer's own code that fails in a child process).
        why = e if isinstance(e, PreprocessError) else f"{type(e).__name__}: {e}"
        _W["error"] = f"in a worker process: {why}"
        return
    _W.update(
        tok=tok,
        keys=tuple(json_keys),
        eod=_eod_id(tok) if append_eod else None,
        name=input_name,
    )


# JSON's names of the types json.loads returns ("null", not Python's "NoneType").
_JSON_TYPES = {
    type(None): "null",
    bool: "boolean",
    int: "number",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
}


def document_texts(raw: bytes, lineno: int, name: str, keys: Sequence[str]) -> list[str] | None:
    """The strings under ``keys`` of one JSONL line (None for a blank line; a byte-order mark
    before the first line and CRLF line ends are read as in a plain UTF-8 file); a bad line raises
    :class:`PreprocessError` naming ``name:lineno`` and what is wrong (UTF-8, JSON, not an
    object, a missing key, a value that is not a string)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PreprocessError(f"{name}:{lineno}: not valid UTF-8 ({e})") from None
    if lineno == 1:  # a UTF-8 byte-order mark (Windows editors write one) starts no JSON
        line = line.removeprefix("\ufeff")
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise PreprocessError(
            f"{name}:{lineno}: malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
        ) from None
    except RecursionError:  # json's decoder recurses once per nested array/object
        raise PreprocessError(
            f"{name}:{lineno}: JSON nested too deeply to read (deeper than Python's recursion "
            f"limit {sys.getrecursionlimit()})"
        ) from None
    if not isinstance(obj, dict):
        raise PreprocessError(
            f"{name}:{lineno}: expected a JSON object, got {_JSON_TYPES[type(obj)]}"
        )
    out = []
    for k in keys:
        if k not in obj:
            present = ", ".join(repr(x) for x in list(obj)[:10]) or "none"
            raise PreprocessError(
                f"{name}:{lineno}: missing JSON key {k!r} (keys present: {present})"
            )
        if not isinstance(obj[k], str):
            raise PreprocessError(
                f"{name}:{lineno}: JSON key {k!r} holds {_JSON_TYPES[type(obj[k])]}, "
                "expected a string"
            )
        try:  # JSON's \ud800-\udfff escapes decode to lone surrogates: no text to tokenize
            obj[k].encode("utf-8")
        except UnicodeEncodeError as e:
            raise PreprocessError(
                f"{name}:{lineno}: JSON key {k!r} holds a lone surrogate "
                f"{obj[k][e.start]!r} at character {e.start}, expected valid Unicode text"
            ) from None
        out.append(obj[k])
    return out


def iter_jsonl_texts(path: PathLike, key: str = "text") -> Iterator[str]:
    """The string under ``key`` of every non-blank line of a JSONL(.gz) file, each line checked
    as ``preprocess_jsonl`` checks it (:class:`PreprocessError` naming the file and line)."""
    name = str(path)
    if not os.path.isfile(path):
        raise PreprocessError(f"input file not found: {name}")
    with open(path, "rb") as raw:
        for first, lines in _batches(raw, name.endswith(".gz"), name):
            for offset, line in enumerate(lines):
                texts = document_texts(line, first + offset, name, (key,))
                if texts is not None:
                    yield texts[0]


def _encode_batch(batch: tuple[int, list[bytes]]):
    """-> (n_documents, {key: (lengths, flat ids)}, n_skipped) or ("error", message)."""
    if "error" in _W:
        return ("error", _W["error"])
    first_line, raw_lines = batch
    keys, name = _W["keys"], _W["name"]
    texts = {k: [] for k in keys}
    n_docs = 0
    for offset, raw in enumerate(raw_lines):
        try:
            doc = document_texts(raw, first_line + offset, name, keys)
        except PreprocessError as e:
            return ("error", str(e))
        if doc is None:
            continue
        for k, v in zip(keys, doc, strict=True):
            texts[k].append(v)
        n_docs += 1

    out = {}
    skipped = 0
    eod = _W["eod"]
    for k in keys:
        kept = [t for t in texts[k] if t.strip()]
        skipped += len(texts[k]) - len(kept)
        ids_list = _W["tok"](kept, add_special_tokens=True)["input_ids"] if kept else []
        if eod is not None:
            ids_list = [ids + [eod] for ids in ids_list]
        lengths = [len(ids) for ids in ids_list]
        flat = numpy.fromiter(
            (i for ids in ids_list for i in ids), dtype=numpy.int64, count=sum(lengths)
        )
        out[k] = (lengths, flat)
    return (n_docs, out, skipped)


def _bounded_imap(pool, batches, max_pending: int):
    """Ordered ``pool.imap`` that reads ahead only ``max_pending`` batches (``imap`` would queue
    the whole input in memory)."""
    pending: collections.deque = collections.deque()
    for b in batches:
        pending.append(pool.apply_async(_encode_batch, (b,)))
        if len(pending) >= max_pending:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# ------------------------------------------------------------------------------------------- Input


def _batches(raw: io.BufferedReader, gz: bool, name: str) -> Iterator[tuple[int, list[bytes]]]:
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
    lineno, batch, first = 0, [], 1
    try:
        for line in stream:
            lineno += 1
            batch.append(line)
            if len(batch) >= _BATCH_LINES:
                yield first, batch
                batch, first = [], lineno + 1
    except (OSError, EOFError) as e:  # corrupt / truncated .gz
        raise PreprocessError(f"{name}: cannot read the input after line {lineno}: {e}") from e
    if batch:
        yield first, batch


def check_output_prefix(output_prefix: str) -> None:
    """Refuse an output prefix that names a folder (``out/``): the builder's FileNotFoundError
    traceback here, ``out.bin`` beside the folder after a path normalisation elsewhere."""
    if not os.path.basename(output_prefix):
        raise PreprocessError(
            f"output_prefix={output_prefix!r} names a folder, not a file-name prefix: give e.g. "
            f"{os.path.join(output_prefix, 'my_corpus')!r} (writes my_corpus.bin / my_corpus.idx)"
        )


def _check_output_names(output_prefix: str, keys: Sequence[str]) -> None:
    """:func:`check_output_prefix`, and with several keys refuse a key that would put a path
    separator into its file name ``<prefix>_<key>.bin`` (a FileNotFoundError traceback from the
    builder)."""
    check_output_prefix(output_prefix)
    if len(keys) > 1:
        for k in keys:
            sep = next((s for s in (os.sep, os.altsep) if s and s in k), None)
            if sep is not None:
                raise PreprocessError(
                    f"json_keys: {k!r} holds {sep!r}, but with several keys each key is part of "
                    f"a file name ({output_prefix}_<key>.bin): tokenize that key on its own "
                    "(one key writes <output_prefix>.bin) or rename it in the JSONL"
                )


def _output_prefixes(output_prefix: str, keys: Sequence[str]) -> list[str]:
    if len(keys) == 1:
        return [output_prefix]
    return [f"{output_prefix}_{k}" for k in keys]


_TMP_TAG = ".tmp"
"""A write's temporaries: ``<prefix>.bin.tmp<pid>`` and ``<prefix>.idx.tmp<pid>``."""


def stopped_write_leftover(prefix: str) -> str | None:
    """Where ``<prefix>.idx`` is missing, a file that shows a write of the dataset stopped before
    it finished (:func:`preprocess_jsonl` renames the ``.idx`` into place last, :func:`_commit`):
    ``<prefix>.bin``, else one of its temporaries (a ``kill -9`` leaves them); None if neither."""
    if os.path.isfile(prefix + ".bin"):
        return prefix + ".bin"
    folder, name = os.path.split(prefix)
    try:
        names = sorted(os.listdir(folder or "."))
    except OSError:
        return None
    for ext in (".bin", ".idx"):
        for n in names:
            tail = n.removeprefix(name + ext + _TMP_TAG)
            if tail != n and tail.isdigit():
                return os.path.join(folder, n)
    return None


def _drop_stale_index_cache(prefix: str) -> None:
    """Remove Megatron's sample-index cache of a replaced dataset.

    Without ``--data-cache-path`` Megatron caches its GPT/blended sample indices in
    ``<prefix>/cache/``, keyed by the dataset's path and config but not its contents: after the
    ``.bin``/``.idx`` change those indices would be silently wrong.
    """
    cache = os.path.join(prefix, "cache")
    if os.path.isdir(cache):
        shutil.rmtree(cache, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(prefix)  # only if now empty


# ------------------------------------------------------------------------------- Reading a dataset

INDEX_MAGIC = b"MMIDIDX\x00\x00"
_INDEX_HEADER = struct.Struct("<QBQQ")  # after the magic: version, dtype code, sequences, documents
_INDEX_HEADER_SIZE = len(INDEX_MAGIC) + _INDEX_HEADER.size  # 34
_REBUILD = "copy it again, or rebuild the pair with tools/preprocess_data.py"


def read_index_header(prefix: str) -> tuple[int, int, int, int]:
    """``(version, dtype code, sequences, documents)`` from the header of ``prefix.idx``;
    :class:`PreprocessError` ``"<prefix>.idx is not a Megatron index file"`` when it does not
    start with Megatron's magic and a whole header."""
    with open(prefix + ".idx", "rb") as f:
        head = f.read(_INDEX_HEADER_SIZE)
    if len(head) < _INDEX_HEADER_SIZE or not head.startswith(INDEX_MAGIC):
        raise PreprocessError(f"{prefix}.idx is not a Megatron index file")
    return _INDEX_HEADER.unpack_from(head, len(INDEX_MAGIC))


def check_indexed_dataset(prefix: str) -> int:
    """The sequences of the Megatron indexed dataset ``prefix`` (``.idx`` + ``.bin``), after
    checking what megatron-core 0.19.2 reads of it: the header (version 1, a known token
    dtype), the ``.idx`` exactly as long as the arrays its header announces (and the sequence
    modes that Megatron's writer adds for a multimodal dataset, which a GPT dataset does not
    read: a file longer than that is no file Megatron's writer wrote), its arrays consistent
    with each other (no negative sequence length; each sequence pointer where the lengths before
    it end; document indices running from 0 to the sequence count, never decreasing) and the
    ``.bin`` exactly as long as its last sequence ends. What they catch (a ``.bin`` or ``.idx``
    cut short, another format, a pair from two different writes, a damaged array) otherwise
    fails inside Megatron's dataset building or a batch read with a numpy traceback, or - a
    zeroed length, two pointers swapped - trains on the wrong tokens without an error.

    The arrays are read memory-mapped and compared vectorised (:func:`_check_index_arrays`),
    12 bytes a sequence on every rank that checks. Measured on 2 CPU cores, warm page cache:
    0.2 ms for the shipped corpus's dataset (1,404 sequences; the header and end reads alone
    took 0.04 ms), 0.3 s for 10 million sequences (a 120 MB ``.idx``).
    :class:`PreprocessError` names the file, what is wrong and what to do."""
    from megatron.core.datasets.indexed_dataset import DType

    idx, bin_ = prefix + ".idx", prefix + ".bin"
    version, code, sequences, documents = read_index_header(prefix)
    if version != 1:
        raise PreprocessError(
            f"{idx}: index format version {version}; megatron-core 0.19.2 reads version 1 only "
            f"({_REBUILD})"
        )
    if code not in {d.value for d in DType}:
        raise PreprocessError(
            f"{idx}: token dtype code {code} is none of megatron-core's DType codes "
            f"{sorted(d.value for d in DType)}: the file is corrupt ({_REBUILD})"
        )
    lengths_at = _INDEX_HEADER_SIZE
    pointers_at = lengths_at + 4 * sequences
    documents_at = pointers_at + 8 * sequences
    needed = documents_at + 8 * documents
    size, counts = (
        os.path.getsize(idx),
        f"its header ({sequences} sequences, {documents} documents)",
    )
    if size < needed:
        raise PreprocessError(
            f"{idx} is cut short: {size} bytes, where {counts} needs {needed} ({_REBUILD})"
        )
    if size not in (needed, needed + sequences):
        raise PreprocessError(
            f"{idx} is longer than {counts} says: {size} bytes, where its arrays end at byte "
            f"{needed} ({needed + sequences} with Megatron's multimodal sequence modes); its "
            f"header or its end is from another write ({_REBUILD})"
        )
    if sequences == 0:
        raise PreprocessError(f"{idx} holds no sequence: an empty dataset, nothing to train on")

    def array(offset: int, dtype, count: int) -> numpy.ndarray:
        return numpy.memmap(idx, dtype=dtype, mode="r", offset=offset, shape=(count,))

    document_indices = array(documents_at, numpy.int64, documents) if documents else None
    if document_indices is None or [document_indices[0], document_indices[-1]] != [0, sequences]:
        raise PreprocessError(
            f"{idx} is corrupt: its document indices do not run from 0 to its {sequences} "
            f"sequences ({_REBUILD})"
        )
    expected = _check_index_arrays(
        idx,
        array(lengths_at, numpy.int32, sequences),
        array(pointers_at, numpy.int64, sequences),
        document_indices,
        DType.size(code),
    )
    size = os.path.getsize(bin_)
    if size != expected:
        what = "is cut short" if size < expected else "does not belong to its .idx"
        raise PreprocessError(
            f"{bin_} {what}: {size} bytes, where {idx} ends its last sequence at byte "
            f"{expected} ({_REBUILD})"
        )
    return sequences


_CHUNK = 1 << 22
"""Sequences :func:`_check_index_arrays` compares at a time: 4 Mi, some 100 MB of temporaries."""


def _check_index_arrays(idx: str, lengths, pointers, document_indices, itemsize: int) -> int:
    """Where the last sequence of ``idx`` ends in its ``.bin`` (bytes), once its lengths are
    non-negative, each pointer is where the lengths before it end (as megatron-core's
    ``_IndexWriter`` computes them: the exclusive cumulative sum of ``lengths * itemsize``) and
    its document indices never decrease; else :class:`PreprocessError` naming the first bad
    entry. Vectorised over chunks of :data:`_CHUNK` entries (int64 sums: no overflow)."""
    end = 0
    for start in range(0, len(lengths), _CHUNK):
        chunk = numpy.asarray(lengths[start : start + _CHUNK], dtype=numpy.int64)
        negative = numpy.flatnonzero(chunk < 0)
        if negative.size:
            i = start + int(negative[0])
            raise PreprocessError(
                f"{idx} is corrupt: sequence {i} has the length {int(lengths[i])}, less than 0 "
                f"({_REBUILD})"
            )
        ends = end + numpy.cumsum(chunk * itemsize)
        wrong = numpy.flatnonzero(pointers[start : start + _CHUNK] != ends - chunk * itemsize)
        if wrong.size:
            i = start + int(wrong[0])
            at = int(ends[wrong[0]] - chunk[wrong[0]] * itemsize)
            before = (
                f"sequence {i - 1} ({int(lengths[i - 1])} tokens from byte "
                f"{int(pointers[i - 1])}) ends at byte {at}"
                if i
                else "the first starts at byte 0"
            )
            raise PreprocessError(
                f"{idx} is corrupt: sequence {i} starts at byte {int(pointers[i])} of the .bin, "
                f"but {before}: its sequence lengths and pointers disagree ({_REBUILD})"
            )
        end = int(ends[-1])
    for start in range(0, len(document_indices) - 1, _CHUNK):
        chunk = document_indices[start : start + _CHUNK + 1]
        down = numpy.flatnonzero(numpy.diff(chunk) < 0)
        if down.size:
            i = start + int(down[0]) + 1
            raise PreprocessError(
                f"{idx} is corrupt: its document indices decrease at entry {i} (sequence "
                f"{int(document_indices[i - 1])}, then {int(document_indices[i])}) ({_REBUILD})"
            )
    return end


HEAD_BYTES = 1 << 20
"""How much of a ``.bin`` :func:`max_token_id_in_head` reads: 1 MiB, 512 Ki tokens of uint16,
whatever the file's size (read and reduced in 0.1-0.3 ms, 3 ms from a cold page cache)."""


def max_token_id_in_head(prefix: str, nbytes: int = HEAD_BYTES) -> int:
    """The largest token id in the first ``nbytes`` of ``prefix.bin`` (the whole tokens there;
    the whole file when it is smaller), read as the dtype its ``.idx`` header names; -1 when
    there is no token there. A dataset made with another tokenizer shows ids beyond this run's
    vocabulary at once; an id deeper in the file is found in the batch that reads it
    (``training.forward_step.get_batch``). Call after :func:`check_indexed_dataset` (a known
    dtype)."""
    from megatron.core.datasets.indexed_dataset import DType

    dtype = numpy.dtype(DType.dtype_from_code(read_index_header(prefix)[1]))
    with open(prefix + ".bin", "rb") as f:
        ids = numpy.frombuffer(f.read(nbytes - nbytes % dtype.itemsize), dtype=dtype)
    return int(ids.max()) if ids.size else -1


@dataclass(frozen=True)
class Vocabulary:
    """The token ids a run's data may hold: ``0 .. size - 1``, ``size`` being the vocabulary of
    the run's tokenizer (Megatron's ``tokenizer.vocab_size``, what it pads the embedding from).

    Ids from ``size`` up to the embedding's ``padded`` rows are refused too: no id of this
    tokenizer reaches them, so a dataset holding one was made with another tokenizer. Below
    ``padded`` they would train the padding rows without an error; from ``padded`` on the
    embedding raises ``IndexError: index out of range in self`` on every rank that reads one."""

    size: int
    padded: int
    tokenizer: str  # e.g. "HuggingFaceTokenizer /path/to/tokenizer"
    remake: str  # how to remake a dataset with this tokenizer

    def refusal(self, where: str, largest: int) -> str | None:
        """One line when ``largest`` (the largest id ``where`` holds) is not an id of this
        vocabulary; None when it is."""
        if largest < self.size:
            return None
        padding = (
            f"; the embedding's rows {self.size}..{self.padded - 1} are padding"
            if self.padded > self.size
            else ""
        )
        return (
            f"{where} holds token id {largest}, but this run's tokenizer ({self.tokenizer}) has "
            f"{self.size} ids (allowed: 0..{self.size - 1}{padding}): the dataset was made with "
            f"another tokenizer. {self.remake}"
        )


# -------------------------------------------------------------------------------------- Main entry


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM held off while the output is renamed into place, then delivered: the
    KeyboardInterrupt of Ctrl-C (or of tools/preprocess_data.py's SIGTERM handler) raised there
    stopped the commit halfway - an old ``.idx`` dropped and the new ``.bin`` not yet moved (the
    old dataset gone, the new one not there), or one key's dataset new and the next one's
    broken. Each one that comes meanwhile is recorded by a handler that only records it, and
    raised again (``signal.raise_signal``) once the caller's handlers are back: to them it
    arrives just after a finished commit.

    Not ``pthread_sigmask``: it blocks a signal in the calling thread only; the kernel hands a
    signal sent to the process to another thread (a run has several, e.g. torch's), whose C
    handler flags it for the main thread's Python handler all the same (measured: Ctrl-C still
    stopped the commit so). Python sets and runs handlers in the main thread only: called from
    another thread the commit is not interrupted by them, and nothing is held. A handler set
    outside Python (``getsignal`` None) cannot be put back, so it is left in place."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    stops = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not None]
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in stops}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(held):  # each once, in the order they came
            signal.raise_signal(s)


class StopOnSignals:
    """Ctrl-C and SIGTERM (schedulers send it) for a command that writes a dataset with
    :func:`preprocess_jsonl`: inside ``with``, either raises ``KeyboardInterrupt`` (its temporaries
    are then removed, nothing is written) until the dataset starts going into place; from then
    on (:meth:`on_commit`) they are recorded only, the run being complete. Give the command's
    ``preprocess_jsonl`` :meth:`interrupted` and :meth:`on_commit`; on a ``KeyboardInterrupt``
    print :data:`INTERRUPTED` and exit :meth:`exit_status` (130 on Ctrl-C, 143 on SIGTERM); after
    a complete run, :meth:`late_note` (None: no signal came). The caller's handlers are back after
    the ``with`` (a ``main()`` called in-process)."""

    INTERRUPTED = "interrupted: nothing written (temporary files removed)"
    STOPS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.committing = False
        self._previous: dict = {}

    def _stop(self, signum, frame) -> None:
        self.signals.append(signum)  # preprocess_jsonl's backstop if Python swallows the raise
        if not self.committing:  # else the dataset is going into place: stopping would lose it
            raise KeyboardInterrupt

    def interrupted(self) -> bool:
        return bool(self.signals)

    def on_commit(self) -> None:
        self.committing = True

    def exit_status(self) -> int:
        return 128 + (self.signals[0] if self.signals else signal.SIGINT)

    def late_note(self) -> str | None:
        """The note for stderr when a signal came after ``preprocess_jsonl``'s last check (held
        off until the commit's end): the dataset is complete."""
        if not self.signals:
            return None
        return (
            f"note: {signal.Signals(self.signals[0]).name} arrived as the dataset was renamed "
            "into place: it is complete"
        )

    def __enter__(self) -> StopOnSignals:
        self._previous = {s: signal.signal(s, self._stop) for s in self.STOPS}
        return self

    def __exit__(self, *exc) -> None:  # None: a handler not set from Python; the default then
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _commit(prefixes: list[str], tmp: dict[str, tuple[str, str]]) -> None:
    """Rename each prefix's new ``.bin`` / ``.idx`` (``tmp[prefix]``) into place over an older
    dataset, so that a kill or an ``OSError`` between any two steps leaves every prefix either
    readable - all of them the old datasets, or all the readable ones new - or without its
    ``.idx`` (refused by name: no Megatron indexed dataset there, rerun the preprocessing).
    Every old ``.idx`` goes first, each with Megatron's sample-index cache of its dataset
    (:func:`_drop_stale_index_cache`), then every new ``.bin``, then every new ``.idx`` (the
    marker of a whole dataset). One prefix after another, a kill between two keys' commits left
    one key's new dataset beside another's old one, and one right after an ``.idx`` went in left
    the new dataset with the old dataset's sample indices, which Megatron reads as they are."""
    for p in prefixes:
        with contextlib.suppress(FileNotFoundError):
            os.remove(p + ".idx")
        _drop_stale_index_cache(p)
    for p in prefixes:
        os.replace(tmp[p][0], p + ".bin")
    for p in prefixes:
        os.replace(tmp[p][1], p + ".idx")


def preprocess_jsonl(
    input: PathLike,
    output_prefix: PathLike,
    tokenizer: PathLike | Any | None = None,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int = 1,
    progress: bool | None = None,
    log_interval: int = 1000,
    trust_remote_code: bool = False,
    interrupted: Callable[[], bool] | None = None,
    on_commit: Callable[[], None] | None = None,
) -> PreprocessSummary:
    """Tokenize a JSONL(.gz) file into Megatron indexed dataset(s). See the module docstring.

    Args:
        input: the JSONL file, one object per line (``.gz`` is read as gzip). Blank lines are
        skipped.
        output_prefix: path prefix of the output (folders are created).
        tokenizer: HF tokenizer folder or object; ``None`` = the shipped default tokenizer.
        json_keys: keys whose string values are tokenized; one dataset per key.
        append_eod: append the tokenizer's EOS id to every document (Megatron's EOD).
        workers: processes that parse and tokenize (1 = in this process).
        progress: tqdm progress bar on stderr; ``None`` shows it only on a terminal;
        ``HF_HUB_DISABLE_PROGRESS_BARS=1`` turns it off (:mod:`megatron_latentmoe.progress`).
        log_interval: where no bar is drawn (a log file, a pipe), Megatron's
        ``tools/preprocess_data.py`` line ``Processed N documents (D docs/s, M MB/s).`` goes to
        stderr each time another ``log_interval`` documents are read (counted in batches of
        256 lines; MB/s of the input file); 0: never.
        trust_remote_code: let the tokenizer run its own code (:func:`load_tokenizer`).
        interrupted: asked after each batch and before the output is renamed into place; True
        stops the run as Ctrl-C does (``KeyboardInterrupt``, nothing written). The backstop for
        a signal handler's ``KeyboardInterrupt`` that Python printed and ignored because it was
        raised in a callback (once under load: importlib's ``_get_module_lock.<locals>.cb``,
        after which tools/preprocess_data.py wrote the whole dataset despite its SIGTERM).
        on_commit: called as the output starts being renamed into place (:func:`_signals_held`:
        SIGINT and SIGTERM wait until the renames are done): from then on the run is complete, and
        a signal handler that raises to stop it would only make its caller lose the result
        (tools/preprocess_data.py's stops raising).

    Raises:
        PreprocessError: missing input, malformed JSON (with line number), missing key, no
        documents.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    t0 = time.time()
    input_path = Path(input)
    if not input_path.exists():
        raise PreprocessError(f"input file not found: {input_path}")
    if not input_path.is_file():
        raise PreprocessError(f"input is not a file: {input_path}")
    if isinstance(json_keys, str):  # list("text") would be the keys 't', 'e', 'x', 't'
        raise PreprocessError(
            f"json_keys={json_keys!r}: expected a list of keys, e.g. [{json_keys!r}]"
        )
    keys = list(json_keys)
    if not keys or len(set(keys)) != len(keys):
        raise PreprocessError(f"json_keys must be distinct and not empty: {keys}")
    _check_output_names(os.fspath(output_prefix), keys)
    if workers < 1:
        raise PreprocessError(f"workers must be >= 1, got {workers}")
    if isinstance(log_interval, bool) or not isinstance(log_interval, int) or log_interval < 0:
        raise PreprocessError(f"log_interval must be an integer >= 0, got {log_interval!r}")

    tok = load_tokenizer(tokenizer, trust_remote_code)
    if append_eod:
        _eod_id(tok)
    dtype = DType.optimal_dtype(len(tok))
    tok_arg = tokenizer if isinstance(tokenizer, (str, os.PathLike)) or tokenizer is None else tok

    prefixes = _output_prefixes(os.fspath(output_prefix), keys)
    out_dir = Path(prefixes[0]).parent
    why = folder_problem(out_dir)  # the tool's and the entry point's words for it
    if why is not None:
        raise PreprocessError(
            f"output_prefix={os.fspath(output_prefix)!r}: {why}; {WRITABLE_FOLDER}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"{_TMP_TAG}{os.getpid()}"
    tmp = {p: (p + ".bin" + tag, p + ".idx" + tag) for p in prefixes}
    builders = {}
    pool = None
    committed = False
    n_docs = n_skipped = 0
    per_key = {k: 0 for k in keys}

    def stop_if_interrupted():
        if interrupted is not None and interrupted():
            raise KeyboardInterrupt

    try:
        for k, p in zip(keys, prefixes, strict=True):
            builders[k] = IndexedDatasetBuilder(tmp[p][0], dtype=dtype)

        if workers == 1:
            _worker_init(tok, keys, append_eod, str(input_path))
            encode = lambda batches: map(_encode_batch, batches)  # noqa: E731
        else:
            ctx = multiprocessing.get_context("spawn")
            pool = ctx.Pool(
                workers,
                initializer=_worker_init,
                initargs=(tok_arg, keys, append_eod, str(input_path), True, trust_remote_code),
            )
            encode = lambda batches: _bounded_imap(pool, batches, 2 * workers)  # noqa: E731

        from tqdm.auto import tqdm

        from megatron_latentmoe.progress import tqdm_disable

        size = input_path.stat().st_size
        disable = tqdm_disable(progress)
        with (
            open(input_path, "rb") as raw,
            tqdm(
                total=size,
                unit="B",
                unit_scale=True,
                desc=f"tokenizing {input_path.name}",
                disable=disable,
            ) as bar,
        ):
            done = 0
            log_every = log_interval if bar.disable else 0
            next_log, t_read = log_every, time.time()
            for result in encode(_batches(raw, input_path.suffix == ".gz", str(input_path))):
                if result[0] == "error":
                    raise PreprocessError(result[1])
                docs, per_key_out, skipped = result
                n_docs += docs
                n_skipped += skipped
                for k, (lengths, flat) in per_key_out.items():
                    start = 0
                    for n in lengths:  # one JSON object = one Megatron document of one sequence
                        builders[k].add_document(flat[start : start + n], [n])
                        start += n
                    per_key[k] += int(flat.size)
                pos = raw.tell()
                bar.update(pos - done)
                done = pos
                if log_every and n_docs >= next_log:
                    elapsed = max(time.time() - t_read, 1e-9)
                    print(
                        f"Processed {n_docs} documents ({n_docs / elapsed:.1f} docs/s, "
                        f"{pos / elapsed / 2**20:.2f} MB/s).",
                        file=sys.stderr,
                        flush=True,
                    )
                    next_log = (n_docs // log_every + 1) * log_every
                stop_if_interrupted()
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        for k in keys:
            if not builders[k].sequence_lengths:
                raise PreprocessError(
                    f"{input_path}: no non-empty documents for key {k!r} ({n_docs} JSON objects "
                    "read)"
                )
        for k, p in zip(keys, prefixes, strict=True):
            builders[k].finalize(tmp[p][1])
        with _signals_held():
            stop_if_interrupted()
            if on_commit is not None:
                on_commit()
            _commit(prefixes, tmp)
            committed = True
    finally:
        _W.clear()
        if pool is not None:
            pool.terminate()
            pool.join()
        for b in builders.values():
            with contextlib.suppress(Exception):
                b.data_file.close()
        if not committed:  # an error is on its way: a removal that fails (a file system
            for pair in tmp.values():  # turned read-only, EROFS) must not replace it
                for f in pair:
                    with contextlib.suppress(OSError):
                        os.remove(f)

    return PreprocessSummary(
        output_prefixes=prefixes,
        documents=n_docs,
        tokens=sum(per_key.values()),
        skipped_empty=n_skipped,
        seconds=time.time() - t0,
        dtype=numpy.dtype(dtype).name,
        per_key_tokens=per_key,
    )
