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
done (:func:`~.signals.signals_held`).

Reading the JSONL is :mod:`.jsonl`'s, loading the tokenizer :mod:`.hf_tokenizer`'s, and reading
and checking a written pair :mod:`.index_file`'s.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy

from megatron_latentmoe.files import WRITABLE_FOLDER, folder_problem

from .errors import PreprocessError
from .hf_tokenizer import eod_id, load_tokenizer
from .index_file import TMP_TAG
from .jsonl import document_texts, line_batches
from .signals import signals_held

PathLike = str | os.PathLike


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


# ------------------------------------------------------ Workers: parse + tokenize a batch of lines

_W: dict = {}
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """Linux: this worker is killed when the process that started it dies (``PR_SET_PDEATHSIG``):
    a main process killed by SIGKILL (``kill -9``, the out-of-memory killer) left its workers
    waiting for their next batch forever, each holding a tokenizer. Elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl
        os._exit(1)


def _worker_init(
    tokenizer, json_keys, append_eod, input_name, subprocess_worker=False, trust_remote_code=False
) -> None:
    if subprocess_worker:  # N processes x Rust threads would oversubscribe the cores
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        # Ctrl-C in a terminal reaches the whole process group: the main process stops the run
        # and lets each worker finish its batch and exit (each worker printed a KeyboardInterrupt
        # traceback; one killed while writing its result left the result queue's lock held)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _die_with_parent()
    try:
        tok = load_tokenizer(tokenizer, trust_remote_code)
    except Exception as e:
        if not subprocess_worker:
            raise
        # A raising initializer breaks the executor with "A process in the process pool was
        # terminated abruptly", not why (multiprocessing.Pool restarted such a worker forever).
        # Kept for the first batch to report (_encode_batch). The main process loaded the same
        # tokenizer, so this is rare (a tokenizer's own code that fails in a child process).
        why = e if isinstance(e, PreprocessError) else f"{type(e).__name__}: {e}"
        _W["error"] = f"in a worker process: {why}"
        return
    _W.update(
        tok=tok,
        keys=tuple(json_keys),
        eod=eod_id(tok) if append_eod else None,
        name=input_name,
    )


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


def _bounded_map(pool: ProcessPoolExecutor, batches, workers: int, before_error: Callable):
    """Ordered map over ``pool`` that reads ahead only ``2 * workers`` batches (``pool.map``
    would submit the whole input at once). A worker that died (killed: out of memory, a signal
    to it alone) is a :class:`PreprocessError`, after ``before_error()`` (which raises if the
    run was being stopped anyway)."""
    pending: collections.deque = collections.deque()
    try:
        for b in batches:
            pending.append(pool.submit(_encode_batch, b))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        before_error()
        raise PreprocessError(
            f"workers={workers}: a worker process died before its batch was done "
            "(killed by a signal, e.g. out of memory); rerun, with fewer workers if memory is "
            "short"
        ) from None


def output_names_problem(output_prefix: str, keys: Sequence[str]) -> tuple[str, str] | None:
    """What keeps ``output_prefix`` and ``keys`` from naming the output files, or None: (the
    argument at fault, ``"output_prefix"`` or ``"json_keys"``; why, to follow its value).
    :func:`preprocess_jsonl` names the argument (a :class:`PreprocessError`); the command-line
    tools name the flag, --output-prefix / --json-keys (a usage error, exit 2).

    A prefix that names a folder (``out/``) was the builder's FileNotFoundError traceback here
    (``out.bin`` beside the folder after a path normalisation elsewhere), as was a key holding a
    path separator among several keys (each key is then part of a file name); a key given twice
    would write the same files twice."""
    if not os.path.basename(output_prefix):
        example = os.path.join(output_prefix, "my_corpus")
        return "output_prefix", (
            f"names a folder, not a file-name prefix: give e.g. {example!r} "
            "(writes my_corpus.bin / my_corpus.idx)"
        )
    if not keys:
        return "json_keys", "give at least one key"
    twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if twice is not None:
        return "json_keys", f"each key once: {twice!r} is given twice"
    if len(keys) > 1:
        for k in keys:
            sep = next((s for s in (os.sep, os.altsep) if s and s in k), None)
            if sep is not None:
                return "json_keys", (
                    f"{k!r} holds {sep!r}, but with several keys each key is part of a file "
                    f"name ({output_prefix}_<key>.bin): tokenize that key on its own (one key "
                    f"writes {output_prefix}.bin) or rename it in the JSONL"
                )
    return None


def output_names_refusal(output_prefix: str, keys: Sequence[str]) -> str | None:
    """:func:`output_names_problem` as the tools say it: one line naming the flag,
    --output-prefix or --json-keys, and its value as typed; None if the names are good."""
    problem = output_names_problem(output_prefix, keys)
    if problem is None:
        return None
    argument, why = problem
    value = output_prefix if argument == "output_prefix" else " ".join(keys)
    return f"--{argument.replace('_', '-')} {value}: {why}"


def _output_prefixes(output_prefix: str, keys: Sequence[str]) -> list[str]:
    if len(keys) == 1:
        return [output_prefix]
    return [f"{output_prefix}_{k}" for k in keys]


def drop_stale_index_cache(prefix: str) -> None:
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


def _commit(prefixes: list[str], tmp: dict[str, tuple[str, str]]) -> None:
    """Rename each prefix's new ``.bin`` / ``.idx`` (``tmp[prefix]``) into place over an older
    dataset, so that a kill or an ``OSError`` between any two steps leaves every prefix either
    readable - all of them the old datasets, or all the readable ones new - or without its
    ``.idx`` (refused by name: no Megatron indexed dataset there, rerun the preprocessing).
    Every old ``.idx`` goes first, each with Megatron's sample-index cache of its dataset
    (:func:`drop_stale_index_cache`), then every new ``.bin``, then every new ``.idx`` (the
    marker of a whole dataset). One prefix after another, a kill between two keys' commits left
    one key's new dataset beside another's old one, and one right after an ``.idx`` went in left
    the new dataset with the old dataset's sample indices, which Megatron reads as they are."""
    for p in prefixes:
        with contextlib.suppress(FileNotFoundError):
            os.remove(p + ".idx")
        drop_stale_index_cache(p)
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
        trust_remote_code: let the tokenizer run its own code
        (:func:`~.hf_tokenizer.load_tokenizer`).
        interrupted: asked after each batch and before the output is renamed into place; True
        stops the run as Ctrl-C does (``KeyboardInterrupt``, nothing written). The backstop for
        a signal handler's ``KeyboardInterrupt`` that Python printed and ignored because it was
        raised in a callback (once under load: importlib's ``_get_module_lock.<locals>.cb``,
        after which tools/preprocess_data.py wrote the whole dataset despite its SIGTERM).
        on_commit: called as the output starts being renamed into place
        (:func:`~.signals.signals_held`: SIGINT and SIGTERM wait until the renames are done): from
        then on the run is complete, and a signal handler that raises to stop it would only make
        its caller lose the result (tools/preprocess_data.py's stops raising).

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
    problem = output_names_problem(os.fspath(output_prefix), keys)
    if problem is not None:
        argument, why = problem
        value = os.fspath(output_prefix) if argument == "output_prefix" else keys
        raise PreprocessError(f"{argument}={value!r}: {why}")
    if workers < 1:
        raise PreprocessError(f"workers must be >= 1, got {workers}")
    if isinstance(log_interval, bool) or not isinstance(log_interval, int) or log_interval < 0:
        raise PreprocessError(f"log_interval must be an integer >= 0, got {log_interval!r}")

    tok = load_tokenizer(tokenizer, trust_remote_code)
    if append_eod:
        eod_id(tok)
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
    tag = f"{TMP_TAG}{os.getpid()}"
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
            pool = ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
                initargs=(tok_arg, keys, append_eod, str(input_path), True, trust_remote_code),
            )
            encode = lambda batches: _bounded_map(  # noqa: E731
                pool, batches, workers, stop_if_interrupted
            )

        from tqdm.auto import tqdm

        from megatron_latentmoe.progress import tqdm_disable

        size = input_path.stat().st_size
        disable = tqdm_disable(progress)
        with contextlib.ExitStack() as closing:
            # the bar is made with Ctrl-C / SIGTERM held: their KeyboardInterrupt inside tqdm's
            # __init__ left a half-made bar whose __del__ printed "Exception ignored in ...
            # AttributeError: 'tqdm_asyncio' object has no attribute 'pos'" and its traceback (a
            # SIGTERM test's flake); the signal then comes once the bar is whole, and the bar is
            # closed on its way out (else its last line came after the command's own, at exit)
            with signals_held():
                bar = closing.enter_context(
                    tqdm(
                        total=size,
                        unit="B",
                        unit_scale=True,
                        desc=f"tokenizing {input_path.name}",
                        disable=disable,
                    )
                )
            raw = closing.enter_context(open(input_path, "rb"))
            done = 0
            log_every = log_interval if bar.disable else 0
            next_log, t_read = log_every, time.time()
            for result in encode(line_batches(raw, input_path.suffix == ".gz", str(input_path))):
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
            pool.shutdown()
            pool = None
        for k in keys:
            if not builders[k].sequence_lengths:
                raise PreprocessError(
                    f"{input_path}: no non-empty documents for key {k!r} ({n_docs} JSON objects "
                    "read)"
                )
        for k, p in zip(keys, prefixes, strict=True):
            builders[k].finalize(tmp[p][1])
        with signals_held():
            stop_if_interrupted()
            if on_commit is not None:
                on_commit()
            _commit(prefixes, tmp)
            committed = True
    finally:
        _W.clear()
        if pool is not None:  # the workers finish their batch and exit: not terminated (a
            # multiprocessing.Pool's terminate() killed one while it wrote its result, holding
            # the result queue's lock, and its join() then waited for that lock forever)
            pool.shutdown(cancel_futures=True)
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
