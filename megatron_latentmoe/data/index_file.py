"""Reading and checking an existing Megatron indexed dataset (a ``.bin``/``.idx`` pair): its
header, its arrays, the largest token id in its head and whether that fits a run's vocabulary,
and what a stopped write left where its ``.idx`` is missing. Nothing here tokenizes: the entry
point's flag checks import it without ``transformers`` or the preprocessing's worker processes.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy

from .errors import PreprocessError

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


TMP_TAG = ".tmp"
"""A write's temporaries: ``<prefix>.bin.tmp<pid>`` and ``<prefix>.idx.tmp<pid>``."""


def stopped_write_leftover(prefix: str) -> str | None:
    """Where ``<prefix>.idx`` is missing, a file that shows a write of the dataset stopped before
    it finished (:func:`~.indexed.preprocess_jsonl` renames the ``.idx`` into place last, its
    ``_commit``):
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
            tail = n.removeprefix(name + ext + TMP_TAG)
            if tail != n and tail.isdigit():
                return os.path.join(folder, n)
    return None
