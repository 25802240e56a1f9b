"""The embedded default corpus and tokenizer, and its Megatron indexed dataset.

The package ships, in ``megatron_latentmoe/data/assets/``:

* ``default_corpus.jsonl.gz``: about 4.9 M characters of English text, one JSON object per line
  (``{"id": ..., "text": ...}``), derived from the public-domain World English Bible (see
  ``assets/SOURCES.md``). Nothing is downloaded at run time.
* ``tokenizer/``: a byte-level BPE tokenizer trained on that corpus (4096 tokens in all;
  ``<|endoftext|>`` = id 0 is EOS/EOD and BOS, ``<|pad|>`` = id 1 is padding), loadable with
  ``transformers.AutoTokenizer.from_pretrained`` and with Megatron's
  ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model <dir>``.

``prepare_default_dataset(output_dir)`` tokenizes the corpus into Megatron's ``.bin``/``.idx``
(once; later calls reuse it while corpus, tokenizer, format and the versions of the libraries
that tokenize are unchanged) and returns the path prefix to give Megatron as ``--data-path``; the
dataset a tokenizer folder made before its files changed is removed then. ``tokenizer=DIR``
tokenizes it with another Hugging Face tokenizer (a run's ``--tokenizer-model``), into a dataset
of its own name (:func:`default_dataset_name`). From the shell::

    python -m megatron_latentmoe.data.corpus --output-prefix DIR/name
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from . import DEFAULT_CORPUS_PATH, DEFAULT_TOKENIZER_DIR

DEFAULT_DATASET_NAME = "default_corpus"
EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

# Bump when the way the default dataset is written changes: cached datasets are then rebuilt.
_FORMAT_VERSION = 1


def default_tokenizer_dir() -> str:
    """The shipped tokenizer's folder (``--tokenizer-model`` for Megatron, a path for HF)."""
    return str(DEFAULT_TOKENIZER_DIR)


def default_cache_dir() -> Path:
    """Where the default dataset goes when the caller names no folder.

    ``$MEGATRON_LATENTMOE_CACHE`` if set, else ``$XDG_CACHE_HOME/megatron_latentmoe`` (or
    ``~/.cache/megatron_latentmoe``), plus ``/data``.
    """
    root = os.environ.get("MEGATRON_LATENTMOE_CACHE")
    if not root:
        root = os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "megatron_latentmoe"
        )
    return Path(root) / "data"


DEFAULT_CACHE_ORIGIN = (
    "the shipped corpus's cache folder ($MEGATRON_LATENTMOE_CACHE/data, else "
    "$XDG_CACHE_HOME or ~/.cache /megatron_latentmoe/data; --data-cache-path names another)"
)
"""How a message names :func:`default_cache_dir`'s folder."""


def iter_corpus_texts(path: str | Path = DEFAULT_CORPUS_PATH, key: str = "text") -> Iterator[str]:
    """Yield the documents' texts of a JSONL(.gz) corpus (the shipped one by default), each line
    checked as the preprocessor checks it (``jsonl.iter_jsonl_texts``)."""
    from .jsonl import iter_jsonl_texts  # lazy: keeps `import corpus` light

    yield from iter_jsonl_texts(path, key)


def default_corpus_sequences() -> int:
    """Sequences in the shipped corpus's dataset: one per document with text, as
    :func:`prepare_default_dataset` writes it (counted without tokenizing)."""
    return sum(1 for text in iter_corpus_texts() if text.strip())


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
"""Model weights beside a tokenizer (``--tokenizer-model`` is often a whole HF model folder): not
the tokenizer, and gigabytes to read at every start, so not hashed."""


def _tokenizer_files(tokenizer: Path) -> list[Path]:
    """The files that make a tokenizer, sorted: a folder's files (no subfolders, no weights), or
    the file itself."""
    if tokenizer.is_file():
        return [tokenizer]
    return sorted(
        q for q in tokenizer.iterdir() if q.is_file() and not q.name.endswith(_WEIGHT_SUFFIXES)
    )


def _hash_files(paths: list[Path], *extra: bytes) -> str:
    h = hashlib.sha256(b"".join(extra))
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


_TOKENIZING_LIBRARIES = ("tokenizers", "transformers")
"""The libraries that turn text into ids (``hf_tokenizer.load_tokenizer``: transformers'
``AutoTokenizer``, its fast tokenizers run by ``tokenizers``; the ``[hf]`` extra): a new version
may give other ids for the same files (a pre-tokenizer or special-token fix), so the record
keeps their versions and a dataset made under others is tokenized again, in place (its name,
which a ``--use-checkpoint-args`` resume finds, stays). That costs 6.3 s once per upgrade
(tokenizing the shipped corpus: one worker, 2 CPU cores, transformers already imported); reading
the versions (installed metadata, no import) 1.2 ms at every start, of a 3.2 ms cache hit.
Libraries only some tokenizers need (``sentencepiece``,
``tiktoken``) are not kept: installing one would tokenize every dataset again."""


def _library_versions() -> dict[str, str | None]:
    """The installed version of each of :data:`_TOKENIZING_LIBRARIES` (None: not installed)."""
    from importlib import metadata

    versions = {}
    for name in _TOKENIZING_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # tokenizing says what to install
            versions[name] = None
    return versions


def _fingerprint(corpus: Path, tokenizer_dir: Path) -> dict:
    return {
        "format": _FORMAT_VERSION,
        "sha256": _hash_files([corpus, *_tokenizer_files(tokenizer_dir)]),
        "libraries": _library_versions(),
    }


def _made_under_other_libraries(stamp: Path, want: dict) -> str:
    """Why a dataset that is there is tokenized again, where only the libraries' versions
    (:data:`_TOKENIZING_LIBRARIES`) tell it from the one wanted: said where it cannot be (a
    read-only cache: a shared one a library upgrade made stale); "" otherwise."""
    try:
        have = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return ""
    if (
        not isinstance(have, dict)
        or have.get("libraries") == want["libraries"]  # its files are what is wrong
        or any(have.get(k) != v for k, v in want.items() if k != "libraries")
    ):
        return ""
    made = have.get("libraries")
    made = made if isinstance(made, dict) else {}  # a record edited by hand: versions unknown
    changed = [
        f"{name} {made.get(name) or 'unknown'} (this run: {version or 'not installed'})"
        for name, version in want["libraries"].items()
        if made.get(name) != version
    ]
    return f" (its {stamp.stem} was tokenized with " + ", ".join(changed) + ": to be made again)"


def default_dataset_name(
    tokenizer: str | Path | None = None, trust_remote_code: bool = False
) -> str:
    """The shipped corpus's dataset name for a tokenizer: ``default_corpus`` for the shipped one
    (``None``, or a folder with the same files), else ``default_corpus_<12 hex digits of the
    sha256 of its files>`` (and of ``trust_remote_code``, where True: a tokenizer's own code,
    run or not, may give other ids; the module an ``auto_map`` names is one of the folder's
    files, but one it takes from another Hub repository, ``repo--module.Class``, is not: its
    version is only known by asking the Hub, at every start; remove ``<name>.json`` to tokenize
    again after it changed). So each tokenizer's dataset has a name of its own in a cache folder
    (none overwrites another's), a tokenizer whose files change gets a new one (tokenized again;
    the old one goes, :func:`_drop_replaced_datasets`), and a run resumed with the same
    tokenizer (``--use-checkpoint-args``) finds the same one. Megatron's other options that
    change its ids are refused with the shipped corpus
    (:data:`~.hf_tokenizer.TOKENIZER_FLAGS_NOT_HONOURED`). Reads the tokenizer's files (no weights)
    and the shipped one's: 0.6 ms measured for another 4096-id tokenizer; none for the shipped
    folder itself."""
    if tokenizer is None:
        return DEFAULT_DATASET_NAME
    path = Path(tokenizer)
    if path.resolve() == DEFAULT_TOKENIZER_DIR.resolve():
        return DEFAULT_DATASET_NAME
    files = _tokenizer_files(path)
    if _hash_files(files) == _hash_files(_tokenizer_files(DEFAULT_TOKENIZER_DIR)):
        return DEFAULT_DATASET_NAME  # a copy of the shipped one: no code of its own
    digest = _hash_files(files, *([b"trust_remote_code"] if trust_remote_code else []))
    return f"{DEFAULT_DATASET_NAME}_{digest[:12]}"


@contextlib.contextmanager
def _file_lock(path: Path, wait: bool = True):
    """Serialise concurrent preparations of the same dataset (e.g. every rank of a torchrun).
    Yields whether the lock is held: ``wait=False`` does not wait for another holder (False);
    not POSIX: no lock (atomic renames still keep the dataset whole), False."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _drop_replaced_datasets(out: Path, name: str, record: dict) -> list[str]:
    """Remove from ``out`` the datasets of the shipped corpus that the same tokenizer folder
    (``record["tokenizer"]``, with the same ``trust_remote_code``) made before its files
    changed: its new files gave this dataset a new ``name`` (:func:`default_dataset_name`), so
    nothing finds them any more, and each change of the folder (e.g. a tokenizer retrained in
    place) would leave another. One another process holds the lock of is left (it may be
    making it again, its tokenizer's files put back). Returns the prefixes removed."""
    from .indexed import drop_stale_index_cache

    dropped = []
    for stamp in sorted(out.glob(DEFAULT_DATASET_NAME + "_*.json")):
        other = stamp.name.removesuffix(".json")
        try:
            have = json.loads(stamp.read_text())
        except (OSError, ValueError):
            continue
        same = ("tokenizer", "trust_remote_code")
        if other == name or any(have.get(k, False) != record[k] for k in same):
            continue
        prefix = str(out / other)
        with _file_lock(out / (other + ".lock"), wait=False) as held:
            if not held:
                continue
            for path in (prefix + ".idx", prefix + ".bin", str(stamp)):  # .idx first: no
                with contextlib.suppress(FileNotFoundError):  # readable half
                    os.remove(path)
            drop_stale_index_cache(prefix)
            with contextlib.suppress(FileNotFoundError):
                os.remove(out / (other + ".lock"))
        dropped.append(prefix)
    return dropped


def prepare_default_dataset(
    output_dir: str | Path | None = None,
    name: str | None = None,
    *,
    tokenizer: str | Path | None = None,
    trust_remote_code: bool = False,
    force: bool = False,
    progress: bool = False,
    workers: int = 1,
    interrupted: Callable[[], bool] | None = None,
    on_commit: Callable[[], None] | None = None,
) -> str:
    """Write the embedded corpus as a Megatron indexed dataset and return its path prefix.

    ``tokenizer``: the Hugging Face tokenizer's folder that tokenizes it (the shipped one when
    ``None``; a run's ``--tokenizer-model``, so that the dataset holds ids of the run's own
    tokenizer); ``trust_remote_code`` as in :func:`~.hf_tokenizer.load_tokenizer`. ``name``: the
    dataset's name, by default :func:`default_dataset_name` of the tokenizer. ``interrupted``,
    ``on_commit``: :func:`~.indexed.preprocess_jsonl`'s (a command's
    :class:`~.signals.StopOnSignals`).

    The prefix ``<output_dir>/<name>`` names ``<prefix>.bin`` and ``<prefix>.idx`` (Megatron's
    ``--data-path <prefix>``); a ``<prefix>.json`` beside them records what they were built from.
    If both exist, pass ``index_file.check_indexed_dataset`` and that record matches the shipped
    corpus, the tokenizer and the libraries' versions (:data:`_TOKENIZING_LIBRARIES`), nothing
    is done (a few milliseconds). Safe to call from several processes at once (a file lock
    serialises them) and safe to kill (files are written under temporary names and renamed at
    the end).
    """
    from megatron_latentmoe.files import WRITABLE_FOLDER, folder_problem

    # lazy: keeps `import corpus` light (numpy, Megatron)
    from .errors import PreprocessError
    from .hf_tokenizer import NoEosError
    from .index_file import check_indexed_dataset
    from .indexed import preprocess_jsonl

    out = Path(output_dir) if output_dir is not None else default_cache_dir()
    tokenizer = DEFAULT_TOKENIZER_DIR if tokenizer is None else Path(tokenizer)
    if name is None:
        name = default_dataset_name(tokenizer, trust_remote_code)
    prefix = out / name
    stamp = prefix.with_name(name + ".json")
    want = _fingerprint(DEFAULT_CORPUS_PATH, tokenizer)

    def up_to_date() -> bool:
        if force or not (
            prefix.with_name(name + ".bin").exists() and prefix.with_name(name + ".idx").exists()
        ):
            return False
        try:
            have = json.loads(stamp.read_text())
            check_indexed_dataset(str(prefix))  # e.g. a .bin cut by a copy of the cache
        except (OSError, ValueError, PreprocessError):
            return False
        return all(have.get(k) == v for k, v in want.items())

    if up_to_date():  # read only: a read-only cache that holds it serves
        return str(prefix)
    why = folder_problem(out)  # the lock file's open was an OSError traceback on a read-only one
    if why is not None:
        raise PreprocessError(
            f"output_dir={str(out)!r}: {why}{_made_under_other_libraries(stamp, want)}; "
            + WRITABLE_FOLDER
        )
    out.mkdir(parents=True, exist_ok=True)
    with _file_lock(prefix.with_name(name + ".lock")):
        if up_to_date():  # another process built it while we waited
            return str(prefix)
        with contextlib.suppress(FileNotFoundError):
            stamp.unlink()
        try:
            summary = preprocess_jsonl(
                DEFAULT_CORPUS_PATH,
                str(prefix),
                tokenizer=tokenizer,
                trust_remote_code=trust_remote_code,
                json_keys=("text",),
                append_eod=True,
                workers=workers,
                progress=progress,
                log_interval=0,  # no "Processed N documents" lines in a training run's log
                interrupted=interrupted,
                on_commit=on_commit,
            )
        except NoEosError:  # its advice, append_eod=False, is no option of this dataset's
            raise PreprocessError(
                f"the tokenizer {str(tokenizer)!r} has no eos_token: the shipped corpus is "
                "tokenized with an EOS after each document (Megatron's EOD). Use a tokenizer "
                "with an eos_token, or train on a dataset of your own (--data-path) made by "
                "tools/preprocess_data.py, which takes --no-append-eod"
            ) from None
        record = dict(
            want,
            documents=summary.documents,
            tokens=summary.tokens,
            tokenizer=os.path.abspath(tokenizer),
            trust_remote_code=trust_remote_code,
        )
        tmp = stamp.with_name(stamp.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, stamp)
        _drop_replaced_datasets(out, name, record)
    return str(prefix)


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m megatron_latentmoe.data.corpus",
        description="Write the embedded default corpus as a Megatron indexed dataset (.bin/.idx).",
    )
    p.add_argument(
        "--output-prefix",
        default=None,
        help=f"path prefix of the dataset (default: {default_cache_dir() / DEFAULT_DATASET_NAME})",
    )
    p.add_argument(
        "--force", action="store_true", help="rebuild even if an up-to-date dataset exists"
    )
    p.add_argument("--workers", type=int, default=1)
    from megatron_latentmoe.cli_errors import one_line_errors
    from megatron_latentmoe.files import folder_refusal

    from .errors import PreprocessError
    from .indexed import output_names_refusal
    from .signals import StopOnSignals

    one_line_errors(p)
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"argument --workers: expected an integer >= 1, got {args.workers}")
    out_dir, name = str(default_cache_dir()), DEFAULT_DATASET_NAME
    if args.output_prefix:  # "DIR/" is refused as by tools/preprocess_data.py (not DIR.bin)
        refusal = output_names_refusal(args.output_prefix, ["text"])
        if refusal is not None:
            p.exit(2, f"{p.prog}: error: {refusal}\n")
        out_dir, name = os.path.split(os.path.abspath(args.output_prefix))
    # a folder it cannot write in, named as tools/preprocess_data.py and the entry point name it
    # (exit 2, before the tokenizer loads; it was exit 1 naming prepare_default_dataset's
    # output_dir): as they, even where it holds an up-to-date dataset
    refusal = folder_refusal(
        "--output-prefix" if args.output_prefix else DEFAULT_CACHE_ORIGIN, out_dir
    )
    if refusal is not None:
        p.exit(2, f"{p.prog}: error: {refusal}\n")
    stop = StopOnSignals()
    try:
        with stop:
            prefix = prepare_default_dataset(
                out_dir,
                name,
                force=args.force,
                progress=True,
                workers=args.workers,
                interrupted=stop.interrupted,
                on_commit=stop.on_commit,
            )
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while tokenizing: as preprocess_data.py
        print(stop.INTERRUPTED, file=sys.stderr)
        return stop.exit_status()
    except PreprocessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as err:  # a full disk, or one turned read-only: as preprocess_data.py
        from megatron_latentmoe.files import write_disk_failure_error

        output = os.path.join(out_dir, name)
        line = write_disk_failure_error(err, [("--output-prefix", output)], written=True)
        if line is None:
            raise
        print(f"{p.prog}: error: {line}", file=sys.stderr)
        return 2
    if stop.late_note():
        print(stop.late_note(), file=sys.stderr)
    record = json.loads(Path(prefix + ".json").read_text())
    print(f"default dataset: {record['documents']} documents, {record['tokens']:,} tokens")
    print(f"  --data-path {prefix}")
    print(f"  --tokenizer-type HuggingFaceTokenizer --tokenizer-model {DEFAULT_TOKENIZER_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
