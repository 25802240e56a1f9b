"""Reading JSONL(.gz) documents: the lines in batches, and each line's texts checked
(:class:`~.errors.PreprocessError` naming ``file:line`` and what is wrong)."""

from __future__ import annotations

import gzip
import io
import json
import os
import sys
from collections.abc import Iterator, Sequence

from .errors import PreprocessError

# Lines handed to a worker (or tokenized in one batch call) at a time.
_BATCH_LINES = 256


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


def iter_jsonl_texts(path: str | os.PathLike, key: str = "text") -> Iterator[str]:
    """The string under ``key`` of every non-blank line of a JSONL(.gz) file, each line checked
    as ``preprocess_jsonl`` checks it (:class:`PreprocessError` naming the file and line)."""
    name = str(path)
    if not os.path.isfile(path):
        raise PreprocessError(f"input file not found: {name}")
    with open(path, "rb") as raw:
        for first, lines in line_batches(raw, name.endswith(".gz"), name):
            for offset, line in enumerate(lines):
                texts = document_texts(line, first + offset, name, (key,))
                if texts is not None:
                    yield texts[0]


def line_batches(raw: io.BufferedReader, gz: bool, name: str) -> Iterator[tuple[int, list[bytes]]]:
    """The lines of ``raw`` (gunzipped when ``gz``) in batches of :data:`_BATCH_LINES`, each as
    ``(its first line's number, its lines)``; a corrupt or truncated ``.gz`` raises
    :class:`PreprocessError` naming ``name`` and the last line read."""
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
