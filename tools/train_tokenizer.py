#!/usr/bin/env python
"""Rebuild the embedded default corpus and train its tokenizer (how the shipped assets were made).

The assets in ``megatron_latentmoe/data/assets/`` were produced by exactly this script::

    # 1. the corpus, from Debian's ``sword-text-web`` package (World English Bible, public domain)
    apt-get download sword-text-web            # sword-text-web_426.0-1_all.deb
    python tools/train_tokenizer.py --rebuild-corpus sword-text-web_426.0-1_all.deb

    # 2. the tokenizer alone, from the shipped corpus (what a plain run does)
    python tools/train_tokenizer.py

Both steps are deterministic: the same ``.deb`` gives a byte-identical ``default_corpus.jsonl.gz``,
and the same corpus and ``tokenizers`` version give a byte-identical ``tokenizer.json``.
``--check`` retrains into a temporary directory and compares with the shipped files.

Exit status: 0 on success (``--check``: the files match), 1 when ``--check`` finds a difference,
2 on bad input (``--corpus`` missing or not JSONL with a string under "text" on every line: the
message names the flag, the file, the line and the key; a ``--rebuild-corpus`` that is not the
package or is damaged; with ``--rebuild-corpus``, a ``--corpus`` that cannot be written;
``--check`` without a tokenizer in ``--output-dir``; a corpus too small for the vocabulary),
130 on Ctrl-C and 143 on SIGTERM (no tokenizer written). Nothing is written on bad input: the
corpus is written to a temporary file and renamed, the tokenizer is trained into a temporary
folder and moved into ``--output-dir`` at the end.

The ``.deb`` is read with the standard library alone (``ar`` + ``tar.xz`` + the SWORD zText
format), so no ``dpkg`` or ``libsword`` is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import html
import io
import json
import lzma
import os
import re
import shutil
import signal
import struct
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_latentmoe.cli_errors import one_line_errors  # noqa: E402
from megatron_latentmoe.data import DEFAULT_CORPUS_PATH, DEFAULT_TOKENIZER_DIR  # noqa: E402
from megatron_latentmoe.data.corpus import EOD_TOKEN, PAD_TOKEN  # noqa: E402
from megatron_latentmoe.data.errors import PreprocessError  # noqa: E402
from megatron_latentmoe.data.jsonl import iter_jsonl_texts  # noqa: E402
from megatron_latentmoe.data.signals import StopOnSignals  # noqa: E402

VOCAB_SIZE = 4096  # including the special tokens
SPECIAL_TOKENS = [EOD_TOKEN, PAD_TOKEN]  # ids 0 and 1

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

SWORD_MODULE = "engWEB2015eb"
SWORD_DIR_IN_DEB = f"usr/share/sword/modules/texts/ztext/{SWORD_MODULE}/"

# ---------------------------------------------------------------------------------------------
# Corpus: SWORD zText module -> documents (one per chapter, plus the preface and glossary)
# ---------------------------------------------------------------------------------------------


class InputError(Exception):
    """Bad input: the message names the flag, the value and what is allowed (exit status 2)."""


def _read_deb_members(deb_path: Path) -> dict[str, bytes]:
    """Return {path: bytes} of the SWORD module files inside a Debian package."""
    data = deb_path.read_bytes()
    if data[:8] != b"!<arch>\n":
        raise InputError(f"--rebuild-corpus: {deb_path}: not a Debian package (no ar header)")
    off, payload = 8, None
    while off + 60 <= len(data):
        name = data[off : off + 16].decode().strip().rstrip("/")
        size = int(data[off + 48 : off + 58])
        if name.startswith("data.tar"):
            payload = (name, data[off + 60 : off + 60 + size])
            break
        off += 60 + size + (size % 2)
    if payload is None:
        raise InputError(f"--rebuild-corpus: {deb_path}: no data.tar member")
    name, blob = payload
    if name.endswith(".zst"):  # xz and gz: tarfile detects and reads them itself
        raise InputError(
            f"--rebuild-corpus: {deb_path}: zstd-compressed package; unpack it with dpkg -x and "
            "pass the folder"
        )
    out = {}
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for m in tar.getmembers():
            path = m.name.lstrip("./")
            if path.startswith(SWORD_DIR_IN_DEB) and m.isfile():
                out[path[len(SWORD_DIR_IN_DEB) :]] = tar.extractfile(m).read()
    if not out:
        raise InputError(f"--rebuild-corpus: {deb_path}: no {SWORD_DIR_IN_DEB} in this package")
    return out


def _module_files(source: Path) -> dict[str, bytes]:
    if not source.exists():
        raise InputError(f"--rebuild-corpus: {source} not found (a .deb or a folder is expected)")
    if source.is_file():
        return _read_deb_members(source)
    hits = sorted(source.rglob("ot.bzs"))
    if not hits:
        raise InputError(
            f"--rebuild-corpus: {source}: no SWORD zText module (ot.bzs) below this folder"
        )
    folder = hits[0].parent
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _ztext_entries(files: dict[str, bytes], testament: str) -> Iterator[str]:
    """Yield the OSIS markup of every index entry of one testament, in order.

    zText: ``.bzs`` = blocks (offset u32, size u32, uncompressed size u32), ``.bzz`` = zlib blocks,
    ``.bzv`` = entries (block u32, offset in block u32, size u16).
    """
    bzs, bzv, bzz = (files[f"{testament}.{ext}"] for ext in ("bzs", "bzv", "bzz"))
    blocks = [struct.unpack_from("<III", bzs, i) for i in range(0, len(bzs), 12)]
    cached: tuple[int, bytes] = (-1, b"")
    for i in range(0, len(bzv), 10):
        block, start, size = struct.unpack_from("<IIH", bzv, i)
        if not size:
            continue
        if cached[0] != block:
            off, csize, _ = blocks[block]
            cached = (block, zlib.decompress(bzz[off : off + csize]))
        yield cached[1][start : start + size].decode("utf-8")


_W_TAG = re.compile(r"</?w\b[^<>]*>")
_NOTE = re.compile(r"<note\b[^>]*>.*?</note>", re.S)
_Q_TAG = re.compile(r"</?q\b[^<>]*>")
_TAG = re.compile(r"<(/?)([A-Za-z]+)\b([^<>]*?)(/?)>")
_ATTR = re.compile(r'(\w+)="([^"]*)"')
_OPENERS = "“‘\"'("


def _gap(m: re.Match) -> str:
    """A removed footnote or quote tag sometimes stood where a space belongs
    ("God<note/>created")."""
    s, e = m.string, m.end()
    before = s[m.start() - 1] if m.start() else " "
    after = s[e] if e < len(s) else " "
    if not before.isspace() and (after.isalnum() or after in _OPENERS) and before not in _OPENERS:
        return " "
    return ""


def _clean(text: str) -> str:
    text = html.unescape(text).replace("\u00a0", " ")
    text = re.sub(r"<d\s", " ", text)  # one stray "<d " in the source
    lines = [re.sub(r"[ \t]+", " ", line).strip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def osis_to_documents(markup: str) -> list[dict[str, str]]:
    """Turn the module's OSIS markup into plain-text documents.

    One document per chapter (headed "Book N"), plus the preface and the glossary. Footnotes,
    Strong's numbers and all markup are removed; paragraphs become blank lines, poetry lines
    become lines. Book title pages (a few words) are put on top of the book's first chapter.
    """
    markup = _W_TAG.sub("", markup)
    markup = _NOTE.sub(_gap, markup)
    markup = _Q_TAG.sub(_gap, markup)

    docs: list[dict[str, str]] = []
    cur: list[str] = []
    state = {"id": "front", "head": None, "book": None}
    title_page: dict[str, str] = {}  # a short heading-less text waiting for the next chapter

    def keep_title_page() -> None:
        """A title page that no chapter followed is a document of its own."""
        if title_page:
            docs.append(title_page.copy())
            title_page.clear()

    def flush() -> None:
        text = _clean("".join(cur))
        cur.clear()
        # drop the one web-site pointer of the preface
        text = "\n\n".join(p for p in text.split("\n\n") if "web site" not in p.lower())
        if not text:
            return
        if state["head"] is None and len(text) < 200:
            # a book's title page ("The Book of / Joshua"): put it on top of the first chapter
            keep_title_page()
            title_page.update(id=state["id"], text=text)
            return
        title = " ".join(title_page.get("text", "").split())
        parts = [p for p in (title, state["head"], text) if p]
        docs.append({"id": state["id"], "text": "\n\n".join(parts)})
        title_page.clear()

    pos = 0
    for m in _TAG.finditer(markup):
        cur.append(markup[pos : m.start()])
        pos = m.end()
        close, name, attrs, _ = m.groups()
        a = dict(_ATTR.findall(attrs))
        if name == "chapter" and "sID" in a:
            flush()
            osis = a.get("osisID", a["sID"])
            book = state["book"] or osis.split(".")[0]
            state.update(id=osis, head=f"{book} {a.get('n', osis.split('.')[-1])}")
        elif name == "div" and "sID" in a and a.get("type") in ("book", "front", "glossary"):
            flush()
            state.update(id=a.get("osisID") or a.get("type"), head=None)
            if a.get("type") == "book":
                state["book"] = None
        elif name == "milestone" and a.get("type") == "x-usfm-toc2":
            state["book"] = a.get("n")
        elif name == "div" and a.get("type") == "x-p":
            cur.append("\n\n")
        elif name == "lb":
            cur.append("\n\n" if a.get("type") == "x-p" else "\n")
        elif name == "l" and "sID" in a:
            cur.append("\n")
        elif name in ("lg", "title", "speaker"):
            cur.append("\n\n")
        elif name == "item" and not close:
            cur.append("\n")
    cur.append(markup[pos:])
    flush()
    keep_title_page()
    return docs


_DAMAGED = (
    OSError,
    EOFError,
    LookupError,
    ValueError,
    struct.error,
    zlib.error,
    lzma.LZMAError,
    tarfile.TarError,
)
"""What reading a damaged package or module raised, a traceback each (measured on hand-made
ones): a .deb cut short, EOFError from its data.tar.xz; a garbled ar header, UnicodeDecodeError;
a garbled zText file, zlib.error, struct.error or an IndexError (an entry past its blocks); a
module file missing, KeyError; tarfile's ReadError; an unreadable file, OSError."""


def _read_module(source: Path) -> str:
    """The OSIS markup of the module in ``source``; InputError naming --rebuild-corpus if it
    cannot be read."""
    try:
        files = _module_files(source)
        return " ".join(e for t in ("ot", "nt") for e in _ztext_entries(files, t))
    except _DAMAGED as e:
        why = " ".join(f"{type(e).__name__}: {e}".split())  # tarfile's are several lines
        raise InputError(
            f"--rebuild-corpus: {source}: damaged or cut short, not readable ({why}); "
            "a sword-text-web .deb or its unpacked folder is expected"
        ) from None


def build_corpus(source: Path, out_path: Path) -> tuple[int, int]:
    markup = _read_module(source)
    docs = osis_to_documents(markup)
    tmp = out_path.with_name(out_path.name + ".tmp")
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        # mtime=0 and no file name in the header: the .gz is byte-identical on every rebuild
        with (
            open(tmp, "wb") as raw,
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz,
        ):
            for d in docs:
                gz.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))
        os.replace(tmp, out_path)
    except OSError as e:
        why = f"{e.strerror}: {e.filename}" if e.filename else e.strerror
        raise InputError(f"--corpus={str(out_path)!r}: cannot write it ({why})") from None
    finally:
        with contextlib.suppress(OSError):  # none written, or under a file named as a folder
            tmp.unlink()
    return len(docs), sum(len(d["text"]) for d in docs)


# ---------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE, 4096 tokens in all
# ---------------------------------------------------------------------------------------------


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def read_corpus_texts(corpus: Path, key: str = "text") -> list[str]:
    """Every text of the corpus, each line checked as ``tools/preprocess_data.py`` checks it: a
    bad file or line raises InputError naming ``--corpus``, the file, the line and the key."""
    try:
        texts = list(iter_jsonl_texts(corpus, key))
    except PreprocessError as e:
        raise InputError(f"--corpus: {e}") from None
    if not any(t.strip() for t in texts):
        raise InputError(f"--corpus: {corpus}: no non-empty documents under {key!r}")
    return texts


def train_tokenizer(texts: list[str], out_dir: Path, corpus: Path | None = None) -> None:
    """Train on ``texts`` (from ``read_corpus_texts(corpus)``) and write the three tokenizer files
    into ``out_dir``; InputError if the corpus is too small for the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise InputError(
            f"--corpus={str(corpus)!r} is too small: it yields {tok.get_vocab_size()} tokens, "
            f"the vocabulary needs {VOCAB_SIZE} (a larger corpus is expected)"
        )
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))

    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "pad_token": PAD_TOKEN}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (out_dir / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--rebuild-corpus",
        metavar="DEB_OR_DIR",
        type=Path,
        help="sword-text-web .deb (or a folder holding the engWEB2015eb zText module): "
        "rewrite the corpus first",
    )
    p.add_argument(
        "--corpus",
        type=Path,
        default=DEFAULT_CORPUS_PATH,
        help="corpus JSONL(.gz) to train on (default: the shipped corpus, %(default)s)",
    )
    p.add_argument(
        "--output-dir",
        type=Path,
        default=DEFAULT_TOKENIZER_DIR,
        help="where to write the tokenizer (default: the shipped tokenizer's folder, %(default)s, "
        "whose files a run replaces)",
    )
    p.add_argument(
        "--check", action="store_true", help="retrain into a temp dir and compare with --output-dir"
    )
    one_line_errors(p)
    args = p.parse_args(argv)
    stop = StopOnSignals()  # SIGTERM's default exit skipped the cleanup below (measured: a
    try:  # .tokenizer-* folder left beside --output-dir, the package's assets/ by default)
        with stop:
            return _run(args, stop)
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return stop.exit_status()  # 130 on Ctrl-C, 143 on SIGTERM


INTERRUPTED = "interrupted: no tokenizer written (temporary files removed)"


def _run(args: argparse.Namespace, stop: StopOnSignals) -> int:
    out = f"--output-dir={str(args.output_dir)!r}"
    if args.check:
        missing = [f for f in TOKENIZER_FILES if not (args.output_dir / f).is_file()]
        if missing:
            what = "does not exist" if not args.output_dir.is_dir() else f"has no {missing[0]}"
            return _error(
                f"{out} {what} (--check compares a retrained tokenizer with the "
                f"{', '.join(TOKENIZER_FILES)} in --output-dir)"
            )
    elif args.output_dir.exists() and not args.output_dir.is_dir():
        return _error(f"{out} is not a directory (a folder for the tokenizer files is expected)")

    # the corpus after the checks of --output-dir: a bad --output-dir writes nothing
    if args.rebuild_corpus is not None:
        try:
            n, chars = build_corpus(args.rebuild_corpus, args.corpus)
        except InputError as e:
            return _error(str(e))
        print(
            f"corpus: {args.corpus} ({n} documents, {chars:,} characters, "
            f"{args.corpus.stat().st_size:,} bytes)"
        )

    try:
        texts = read_corpus_texts(args.corpus)
    except InputError as e:
        return _error(str(e))

    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                train_tokenizer(texts, Path(tmp), args.corpus)
            except InputError as e:
                return _error(str(e))
            bad = [f for f in TOKENIZER_FILES if _sha(Path(tmp) / f) != _sha(args.output_dir / f)]
        print("tokenizer reproduces the shipped files" if not bad else f"DIFFERS: {bad}")
        return 1 if bad else 0

    # train in a temporary folder beside --output-dir (its nearest existing ancestor): the files
    # are renamed into place on the same file system, and a failed run leaves nothing behind
    anchor = args.output_dir.resolve().parent
    while not anchor.is_dir():
        anchor = anchor.parent
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=anchor))
    except OSError as e:
        return _error(f"{out}: cannot write in {str(anchor)!r} ({e.strerror})")
    try:
        try:
            train_tokenizer(texts, tmp, args.corpus)
        except InputError as e:
            return _error(str(e))
        try:
            args.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return _error(f"{out}: cannot create it ({e.strerror})")
        stop.on_commit()  # a signal from now on waits: the three files go into place together
        for f in tmp.iterdir():
            os.replace(f, args.output_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"tokenizer: {args.output_dir} (vocab {VOCAB_SIZE}, specials {SPECIAL_TOKENS})")
    if stop.interrupted():
        name = signal.Signals(stop.signals[0]).name
        print(
            f"note: {name} arrived as the tokenizer went into place: it is complete",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
