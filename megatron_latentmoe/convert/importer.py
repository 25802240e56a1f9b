"""Hugging Face model directory -> one layout-free Megatron ``torch_dist`` checkpoint.

Output (a ``megatron.training`` save root)::

    OUTPUT/latest_checkpointed_iteration.txt      "release" (or the --iteration number)
    OUTPUT/release/                               (or iter_XXXXXXX/)
        .metadata  __0_0.distcp  metadata.json

Loading it with ``megatron.training``: ``--load OUTPUT --ckpt-format torch_dist`` plus the model
flags of the same architecture (the checkpoint's ``args`` are checked against them; or use
``--use-checkpoint-args``), at ANY TP / PP / EP / ETP / DP layout. A ``release`` checkpoint
starts at iteration 0 with a fresh optimizer and RNG, so no extra flags are needed; with
``--iteration N`` add ``--finetune`` (or ``--no-load-optim --no-load-rng``) because the
checkpoint holds no optimizer / RNG state. Runs built with the Transformer Engine spec find every
tensor under the same keys; they need ``--dist-ckpt-strictness log_all`` (or ``ignore_all``)
because TE modules ask for ``_extra_state`` objects that a converted checkpoint cannot contain.

Keys and global shapes are Megatron's, which do not depend on the layout; each tensor is written
as one whole chunk (each routed expert its own chunk of the stacked expert tensor), as a one-rank
run saves it, and Megatron's loader reshards on load: a rank reads the chunks that overlap its
shard. (Cutting the chunks per layout saved only that a TP/ETP rank reads 1/TP of a dense tensor
instead of all of it, once, at load; tested: the same import loads exactly into TP2+SP, EP2,
PP2 and TP2xEP2 runs.) Tensors are read from the safetensors files with ``pread`` (no mmap) and
written one at a time: peak memory is about one tensor.

MXFP4 routed experts (``export --expert-dtype mxfp4``, ``convert/mxfp4.py``) are read back
dequantized (exact) into the dtype of the other tensors, or ``dtype``.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from megatron_latentmoe.checkpoint_layout import TRACKER_FILE, iteration_dir_name, tracker_text
from megatron_latentmoe.fields import not_allowed

from . import mxfp4
from .arch import ARCH_STATE_KEY, ModelArch, arch_from_config_file
from .dist_reader import COMMON_STATE_KEY
from .errors import ConversionError
from .export import INDEX_FILE, ST_DTYPE_NAMES, cast_checked, checked_bias, parse_dtype
from .names import (
    check_shape,
    extra_state_key,
    iter_tensor_maps,
    primary_checkpoint_key,
)
from .options import DEFAULT_VERIFY_TOKENS
from .summary import (
    ConversionSummary,
    Progress,
    Timer,
    atomic_output_dir,
    check_not_an_input,
    check_output_dir,
)
from .verify import check_verify_length, verify_text_ids

# ------------------------------------------------------------------------------ HF reading


_ST_DTYPES = {name: dt for dt, name in ST_DTYPE_NAMES.items() if dt.is_floating_point}


def _header_entry(path: Path, name: str, info) -> tuple[tuple[int, ...], tuple[int, int]]:
    """(shape, data offsets) of a safetensors header entry; ConversionError if it is malformed."""

    def ints(value) -> bool:
        return isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
        )

    if (
        not isinstance(info, dict)
        or not isinstance(info.get("dtype"), str)
        or not ints(info.get("shape"))
        or not ints(info.get("data_offsets"))
        or len(info["data_offsets"]) != 2
        or info["data_offsets"][0] > info["data_offsets"][1]
    ):
        raise ConversionError(
            f"{str(path)!r}: tensor {name!r} has a malformed header entry {info!r}: allowed: "
            '{"dtype": ..., "shape": [sizes >= 0], "data_offsets": [begin, end]} with '
            "0 <= begin <= end (corrupt file)"
        )
    return tuple(info["shape"]), tuple(info["data_offsets"])


class SafetensorsFile:
    """Reads row ranges of the tensors of one .safetensors file with ``pread`` (no mmap: the
    resident memory stays the rows asked for, not the pages of the whole file)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
            size = os.fstat(self.fd).st_size
            (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            if n > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(os.pread(self.fd, n, 8))
            if not isinstance(header, dict):
                raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
        except (OSError, ValueError, struct.error) as e:
            raise ConversionError(f"safetensors file {str(path)!r} cannot be read: {e}") from None
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.entries = {}
        for name, info in header.items():
            shape, (begin, end) = _header_entry(path, name, info)
            dt = _ST_DTYPES.get(info.get("dtype"))
            if info.get("dtype") == "U8" and name.endswith((mxfp4.PACKED, mxfp4.SCALE)):
                dt = torch.uint8  # MXFP4 routed experts (checked against config.json by the reader)
            if dt is None:
                raise ConversionError(
                    f"{str(path)!r}: tensor {name!r} has dtype {info.get('dtype')}: "
                    "not a supported float type (F32, BF16, F16, F64)"
                )
            if end - begin != math.prod(shape) * dt.itemsize or self.base + end > size:
                raise ConversionError(
                    f"{str(path)!r}: tensor {name!r} has inconsistent offsets "
                    "(truncated or corrupt file)"
                )
            self.entries[name] = (dt, shape, self.base + begin)

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        dt, shape, offset = self.entries[name]
        row = dt.itemsize * math.prod(shape[1:])
        nbytes = (r1 - r0) * row
        raw = torch.empty(nbytes, dtype=torch.uint8)  # no zero-fill, unlike bytearray
        view, done = memoryview(raw.numpy()), 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + r0 * row + done)
            if got <= 0:
                raise ConversionError(
                    f"{str(self.path)!r}: unexpected end of file reading {name!r}"
                )
            done += got
        t = raw.view(dt)
        return t.view((r1 - r0, *shape[1:]))

    def close(self) -> None:
        os.close(self.fd)


class HFCheckpointReader:
    """Slices of the tensors of an HF safetensors checkpoint (index or single file)."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise ConversionError(f"HF model directory {str(self.dir)!r} does not exist")
        cfg = self.dir / "config.json"
        if not cfg.is_file():
            raise ConversionError(f"HF model directory {str(self.dir)!r} has no config.json")
        self.arch = arch_from_config_file(cfg)
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(f, str) for k, f in weight_map.items()
                ):
                    raise ValueError("'weight_map' is not a mapping of tensor name -> file name")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConversionError(
                    f"{str(index)!r} is not a valid safetensors index: {e}"
                ) from None
        elif (self.dir / "model.safetensors").is_file():
            weight_map = None
        else:
            raise ConversionError(
                f"HF model directory {str(self.dir)!r} has neither {INDEX_FILE} "
                "nor model.safetensors"
            )
        self._files: dict[str, SafetensorsFile] = {}
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self.names: dict[str, str] = {}
        for f in files:
            path = self.dir / f
            if not path.is_file():
                raise ConversionError(
                    f"safetensors file {str(path)!r} (named by the index) is missing"
                )
            self._files[f] = SafetensorsFile(path)
            for k in self._files[f].entries:
                self.names[k] = f
        if weight_map:
            lost = sorted(k for k, f in weight_map.items() if self.names.get(k) != f)
            if lost:
                raise ConversionError(
                    f"{str(index)!r} names tensor(s) not found in their files: {lost[:5]}"
                )
        self.bytes_read = 0
        self.mxfp4 = self._mxfp4_pairs(json.loads(cfg.read_text()).get("quantization_config"))

    def _mxfp4_pairs(self, quantization_config) -> dict[str, tuple[str, str]]:
        """{dense routed-expert weight name: (packed, scale) names} of an MXFP4 export, else {}."""
        uint8 = sorted(k for k in self.names if self._raw_dtype(k) == torch.uint8)
        if not mxfp4.is_mxfp4(quantization_config):
            if uint8:
                raise ConversionError(
                    f"{str(self.dir)!r}: uint8 tensor(s) {uint8[:3]} but "
                    "config.json has no MXFP4 quantization_config"
                )
            return {}
        pairs = {}
        for name in uint8:
            if name.endswith("." + mxfp4.PACKED):
                dense = name.removesuffix(mxfp4.PACKED) + "weight"
                pairs[dense] = mxfp4.names(dense)
        orphans = sorted(set(uint8) - {n for pair in pairs.values() for n in pair})
        orphans += sorted(scale for _, scale in pairs.values() if scale not in self.names)
        if orphans:
            raise ConversionError(
                f"{str(self.dir)!r}: MXFP4 tensors without their pair: {orphans[:3]}"
            )
        dense_dtypes = {self._raw_dtype(k) for k in self.names if k not in uint8}
        self._dense_dtype = min(dense_dtypes - {torch.float32}, key=str, default=torch.float32)
        return pairs

    def _raw_dtype(self, name: str) -> torch.dtype:
        return self._files[self.names[name]].entries[name][0]

    def tensor_names(self) -> set[str]:
        """The dense tensor names this directory provides (an MXFP4 pair counts as its weight)."""
        packed = {n for pair in self.mxfp4.values() for n in pair}
        return (set(self.names) - packed) | set(self.mxfp4)

    def dtype(self, name: str) -> torch.dtype:
        return self._dense_dtype if name in self.mxfp4 else self._raw_dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.mxfp4:
            rows, half = self.shape(self.mxfp4[name][0])
            return rows, 2 * half
        return self._files[self.names[name]].entries[name][1]

    def get(self, name: str, r0: int, r1: int, cols: slice = slice(None)) -> torch.Tensor:
        if name in self.mxfp4:
            pair = {n: self.get(n, r0, r1) for n in self.mxfp4[name]}
            try:
                t = mxfp4.unpack(name, pair, self._dense_dtype)
            except ValueError as e:
                raise ConversionError(f"{str(self.dir)!r}: {name!r}: {e}") from None
            return t[:, cols]
        t = self._files[self.names[name]].read_rows(name, r0, r1)
        self.bytes_read += t.numel() * t.element_size()
        return t[:, cols] if t.dim() > 1 else t

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def check(self, arch: ModelArch) -> int:
        """Every expected HF tensor present with the right shape and nothing else (lm_head
        of a tied model is ignored). Returns the number of Megatron tensors."""
        expected, problems, count = set(), [], 0
        present = self.tensor_names()
        for tm in iter_tensor_maps(arch):
            count += 1
            for name, shape in tm.hf:
                expected.add(name)
                if name not in present:
                    problems.append(f"missing tensor {name!r}")
                    continue
                try:
                    check_shape(name, self.shape(name), shape, source=str(self.dir))
                except ConversionError as e:
                    problems.append(str(e))
        ignored = {"lm_head.weight"} if arch.tie_embeddings else set()
        unexpected = sorted(present - expected - ignored)
        if unexpected:
            problems.append(
                f"unexpected tensor(s) not described by config.json ({len(unexpected)}): "
                f"{unexpected[:8]}"
            )
        if problems:
            raise ConversionError(
                f"HF checkpoint {str(self.dir)!r} does not match its config.json:\n  "
                + "\n  ".join(problems[:12])
                + (f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else "")
            )
        return count


# ------------------------------------------------------------------------------ DCP writing


DATA_FILE = "__0_0.distcp"
"""The data file: the name DCP's ``FileSystemWriter`` gives the one file of rank 0."""


def _write_data(directory: Path, items: list[WriteItem], resolvers: dict) -> list[WriteResult]:
    """Write ``items`` into ``DATA_FILE`` one at a time, each computed when it is written by its
    resolver (``resolvers[(key, offsets)]()``), as DCP's ``FileSystemWriter.write_data``
    does with ``single_file_per_rank`` (each tensor ``torch.save``d at its offset, each bytes
    object raw; ``torch.save`` writes a tensor's whole storage, and each resolver's owns all of
    its own: rows read into their own buffer, or a cast's, a concatenation's or MXFP4's new
    tensor), and free each once written: ``write_data`` keeps every tensor written to a file
    in a dict until the file is closed (the last chunk of each checkpoint key: all but the
    routed experts), so the import's memory grew with the checkpoint (measured: +0.30 GiB over
    a 1.2 GiB checkpoint of 40 layers). Returns the ``WriteResult``s for ``writer.finish``."""
    results = []
    with open(directory / DATA_FILE, "wb") as f:
        for item in items:
            data = resolvers.pop((item.index.fqn, tuple(item.index.offset or ())))()
            offset = f.tell()
            if item.type == WriteItemType.BYTE_IO:
                f.write(data.getbuffer())
            else:
                torch.save(data, f)
            length = f.tell() - offset
            results.append(WriteResult(item.index, length, _StorageInfo(DATA_FILE, offset, length)))
            del data  # before the next tensor is read
    return results


def _bytes_of(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save([obj], buf)  # Megatron stores ShardedObject data as a list of the local objects
    buf.seek(0)
    return buf


def _add_bytes(state_md: dict, items: list, resolvers: dict, key: str, obj) -> None:
    """Plan a pickled object (a ``ShardedObject`` of Megatron's, or the common state)."""
    state_md[key] = BytesStorageMetadata()
    items.append(
        WriteItem(MetadataIndex(key), WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(0))
    )
    resolvers[(key, ())] = lambda obj=obj: _bytes_of(obj)


def import_checkpoint(
    hf_dir: str | os.PathLike,
    output: str | os.PathLike,
    *,
    dtype: str = "auto",
    iteration: int | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    verify_seq_len: int | None = None,
    verify_tokens: int = DEFAULT_VERIFY_TOKENS,
    verify_text: str | None = None,
) -> ConversionSummary:
    """Convert an HF Stable LatentMoE directory into a layout-free Megatron ``torch_dist`` save
    root.

    ``dtype``: ``auto`` keeps the HF tensors' dtypes; the expert bias is always fp32.
    ``iteration``: None writes a ``release`` checkpoint. ``progress``: a byte bar on stderr,
    None = on a terminal only (``summary.Progress``). ``verify_seq_len``: the prompt length of a
    ``--verify`` to follow, refused with its ``verify_tokens``
    (:func:`~.verify.check_verify_length`) as soon as config.json is read, before anything is
    written; ``verify_text``: its prompt, refused
    (:func:`~.verify.verify_text_ids`) under the HF directory's tokenizer, too.
    """
    timer = Timer()
    check_output_dir(output, overwrite)
    check_not_an_input(output, "--hf", hf_dir)
    if iteration is not None and (
        isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0
    ):
        raise not_allowed("--iteration", iteration, "an integer >= 0", ConversionError)
    out_dtype = parse_dtype(dtype)
    hf = HFCheckpointReader(hf_dir)
    try:
        if verify_seq_len is not None:
            check_verify_length(hf.arch, verify_seq_len, verify_tokens)
            if verify_text:
                verify_text_ids(hf.dir, verify_text, verify_seq_len, hf.arch.vocab_size)
        return _import(hf, output, timer, out_dtype, dtype, iteration, overwrite, progress)
    finally:
        hf.close()


def _import(
    hf: HFCheckpointReader,
    output,
    timer: Timer,
    out_dtype,
    dtype: str,
    iteration,
    overwrite: bool,
    progress: bool | None,
) -> ConversionSummary:
    arch = hf.arch
    n_maps = hf.check(arch)

    # ---- plan: one write item per tensor (per expert for the stacked experts), metadata per key
    state_md: dict = {}
    items: list[WriteItem] = []
    resolvers: dict = {}
    total, largest = 0, 0

    for tm in iter_tensor_maps(arch):
        dt = torch.float32 if tm.fp32 else (out_dtype or hf.dtype(tm.hf[0][0]))
        nbytes = tm.numel() * dt.itemsize
        largest, total = max(largest, nbytes), total + nbytes
        key, lead, key_shape = primary_checkpoint_key(tm, arch)
        offsets = torch.Size((*lead, *(0,) * len(tm.shape)))
        sizes = torch.Size((1,) * len(lead) + tuple(tm.shape))
        props = TensorProperties(dtype=dt)
        md = state_md.setdefault(key, TensorStorageMetadata(props, torch.Size(key_shape), []))
        md.chunks.append(ChunkStorageMetadata(offsets, sizes))
        items.append(
            WriteItem(
                MetadataIndex(key, offsets),
                WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    ChunkStorageMetadata(offsets, sizes), props, torch.Size(key_shape)
                ),
            )
        )

        def resolve(tm=tm, dt=dt, sizes=sizes):
            t = tm.megatron_rows(hf.get, 0, tm.shape[0])
            t = cast_checked(tm.megatron, checked_bias(tm.hf[0][0], t, tm), dt, dtype)
            t = t.reshape(sizes).contiguous()
            bar.update(t.numel() * t.element_size())
            return t

        resolvers[(key, tuple(offsets))] = resolve
        es = extra_state_key(tm, arch)
        if es is not None:
            _add_bytes(state_md, items, resolvers, es, None)

    common = {
        "args": arch.megatron_args_namespace(),
        "checkpoint_version": 3.0,
        "iteration": 0 if iteration is None else iteration,
        "num_floating_point_operations_so_far": 0,
        "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
        ARCH_STATE_KEY: arch.to_dict(),
    }
    _add_bytes(state_md, items, resolvers, COMMON_STATE_KEY, common)

    summary = ConversionSummary(
        "import",
        str(hf.dir),
        str(output),
        config_source=f"{hf.dir}/config.json",
        largest_tensor_bytes=largest,
    )
    sub = iteration_dir_name(iteration)
    with atomic_output_dir(output, overwrite) as tmp:
        ckpt = tmp / sub
        writer = FileSystemWriter(str(ckpt), sync_files=False)
        writer.set_up_storage_writer(True)
        writer.prepare_local_plan(SavePlan(items))  # creates the directory
        bar = Progress(total, "import", enabled=progress)
        stream = Timer()
        try:
            results = _write_data(ckpt, items, resolvers)
            writer.finish(Metadata(state_dict_metadata=state_md), [results])
        finally:
            bar.close()
        stream_s = stream.elapsed()
        (ckpt / "metadata.json").write_text(
            json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
        )
        (tmp / TRACKER_FILE).write_text(tracker_text(iteration))
        summary.files = sum(1 for _ in ckpt.iterdir())
        summary.bytes_written = sum(p.stat().st_size for p in ckpt.iterdir())
    summary.tensors = sum(1 for k in state_md if isinstance(state_md[k], TensorStorageMetadata))
    return summary.finish(
        timer,
        bar,
        hf.bytes_read,
        stream_s,
        checkpoint_dir=f"{output}/{sub}",
        megatron_tensors=n_maps,
    )
