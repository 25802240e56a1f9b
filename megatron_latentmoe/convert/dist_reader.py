"""Stream tensors out of a Megatron ``torch_dist`` checkpoint saved with ANY parallel layout.

A ``torch_dist`` checkpoint is a PyTorch Distributed Checkpoint (DCP) directory: ``.metadata``
(for every key: the global shape, dtype and the list of saved chunks with their offsets),
``__{rank}_{i}.distcp`` data files, Megatron's ``metadata.json`` and the common (non-tensor) state,
stored either as the ``common_state`` bytes object inside the DCP (megatron-core >= 0.15) or in
a legacy ``common.pt``. Whatever TP / EP / ETP / PP / DP layout wrote it, the metadata describes
each GLOBAL tensor, so reading needs neither the model nor the original process layout.

:class:`DistCheckpointReader` reads one region at a time: the global tensor of a key, one entry
of a stacked key (one layer of a homogeneous model, one routed expert).
It asks DCP's own ``FileSystemReader`` for exactly the saved chunks that overlap the region, so the
memory used is the region plus the overlapping saved chunks (at most a rank's local shard of
one tensor), never the checkpoint.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_latentmoe.checkpoint_layout import TRACKER_FILE, tracked_checkpoint_dir

from .arch import ModelArch, resolve_arch
from .errors import ConversionError
from .names import Location, TensorMap, checkpoint_locations, current_key, is_model_key

COMMON_STATE_KEY = "common_state/shard_0_1"


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The directory holding ``.metadata``: ``path`` itself, or for a ``megatron.training`` save
    root, the checkpoint its tracker names (``checkpoint_layout.tracked_checkpoint_dir``)."""
    p = Path(path)
    if not p.exists():
        raise ConversionError(f"checkpoint {str(p)!r} does not exist")
    if not p.is_dir():
        raise ConversionError(f"checkpoint {str(p)!r} is not a directory")
    if (p / ".metadata").is_file():
        return p
    q = tracked_checkpoint_dir(p, ConversionError)
    if q is None:
        raise ConversionError(
            f"checkpoint {str(p)!r} is not a torch_dist checkpoint: no '.metadata' file (and no "
            f"{TRACKER_FILE} naming an iteration directory)"
        )
    if not (q / ".metadata").is_file():
        raise ConversionError(
            f"checkpoint {str(p)!r}: the tracker names {q.name!r} but "
            f"{str(q / '.metadata')!r} does not exist"
        )
    return q


class _RegionLoadPlanner(LoadPlanner):
    """Reads requested regions of global tensors (and whole bytes objects) into given buffers."""

    def __init__(self, requests: Sequence[tuple[str, Sequence[int], torch.Tensor]], byte_keys=()):
        self.requests = list(requests)
        self.byte_keys = list(byte_keys)
        self.bytes: dict[str, io.BytesIO] = {}

    def set_up_planner(
        self, state_dict=None, metadata: Metadata | None = None, is_coordinator: bool = False
    ):
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        self._dest: dict[str, torch.Tensor] = {}
        for i, (key, offsets, dest) in enumerate(self.requests):
            md = self.metadata.state_dict_metadata[key]
            fqn = f"{i}:{key}"  # the same key may be requested twice (two regions)
            self._dest[fqn] = dest
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.shape)
            for item in create_read_items_for_chunk_list(key, md, [chunk]):
                items.append(_retag(item, fqn))
        for key in self.byte_keys:
            index = MetadataIndex(key)
            items.append(
                ReadItem(
                    type=LoadItemType.BYTE_IO,
                    dest_index=index,
                    dest_offsets=torch.Size((0,)),
                    storage_index=index,
                    storage_offsets=torch.Size((0,)),
                    lengths=torch.Size((0,)),
                )
            )
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.bytes[read_item.storage_index.fqn] = value

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self._dest[read_item.dest_index.fqn]
        return narrow_tensor_by_index(dest, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def narrow_tensor_by_index(tensor: torch.Tensor, offsets, sizes) -> torch.Tensor:
    """The view ``tensor[offsets[0]:offsets[0]+sizes[0], ...]``."""
    for dim, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
        if off != 0 or size != tensor.shape[dim]:
            tensor = tensor.narrow(dim, off, size)
    return tensor


def _retag(item: ReadItem, fqn: str) -> ReadItem:
    import dataclasses

    dest = MetadataIndex(fqn, item.dest_index.offset, item.dest_index.index)
    return dataclasses.replace(item, dest_index=dest)


class DistCheckpointReader:
    """Random access to the global tensors of a ``torch_dist`` checkpoint (see module docstring).

    ``path`` may be the checkpoint directory itself or a ``megatron.training`` save root (its
    tracker file picks the iteration). Bad input raises :class:`ConversionError` naming the path.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = resolve_checkpoint_dir(path)
        cfg = self.path / "metadata.json"
        if cfg.is_file():
            try:
                meta = json.loads(cfg.read_text())
                if not isinstance(meta, dict):
                    raise ValueError(f"a JSON {type(meta).__name__}, not an object")
                backend = meta.get("sharded_backend")
            except (OSError, ValueError) as e:
                raise ConversionError(f"checkpoint {str(cfg)!r} cannot be parsed: {e}") from None
            if backend not in (None, "torch_dist"):
                raise ConversionError(
                    f"checkpoint {str(self.path)!r} was saved with sharded_backend="
                    f"{backend!r}; only 'torch_dist' is supported"
                )
        self._reader = FileSystemReader(str(self.path))
        try:
            self.metadata: Metadata = self._reader.read_metadata()
        except Exception as e:  # noqa: BLE001 - any unpickling / IO problem
            raise ConversionError(
                f"checkpoint {str(self.path)!r}: '.metadata' cannot be read "
                f"({type(e).__name__}: {e})"
            ) from None
        self._reader.set_up_storage_reader(self.metadata, True)
        stored = self.metadata.state_dict_metadata
        tensors = [k for k, v in stored.items() if isinstance(v, TensorStorageMetadata)]
        self._stored_key = {current_key(k): k for k in tensors}  # old checkpoints: old names
        self.tensors: dict[str, TensorStorageMetadata] = {
            key: stored[k] for key, k in self._stored_key.items()
        }
        self.byte_objects = [k for k, v in stored.items() if isinstance(v, BytesStorageMetadata)]
        self._check_files()
        self.bytes_read = 0

    def _check_files(self) -> None:
        files = {info.relative_path for info in self.metadata.storage_data.values()}
        missing = sorted(f for f in files if not (self.path / f).is_file())
        if missing:
            raise ConversionError(
                f"checkpoint {str(self.path)!r} is incomplete: data file(s) "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''} are missing"
            )

    # ------------------------------------------------------------------ metadata
    def model_keys(self) -> list[str]:
        """Tensor keys of the model (not optimizer states, RNG, ...)."""
        return [k for k in self.tensors if is_model_key(k)]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    # ------------------------------------------------------------------ common state
    def common_state(self) -> dict:
        """The non-tensor state saved with the checkpoint (``args``, ``iteration``, ...)."""
        import megatron.core  # noqa: F401 - registers Megatron's weights_only-safe globals

        legacy = self.path / "common.pt"
        try:
            if legacy.is_file():
                return torch.load(legacy, map_location="cpu", weights_only=True)
            if COMMON_STATE_KEY not in self.metadata.state_dict_metadata:
                return {}
            planner = _RegionLoadPlanner([], byte_keys=[COMMON_STATE_KEY])
            self._run(planner)
            buf = planner.bytes[COMMON_STATE_KEY]
            buf.seek(0)
            loaded = torch.load(buf, map_location="cpu", weights_only=True)
        except ConversionError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ConversionError(
                f"checkpoint {str(self.path)!r}: the common state (args, iteration) cannot be "
                f"unpickled safely ({type(e).__name__}: {e}); pass --megatron-config"
            ) from None
        return loaded[0] if isinstance(loaded, list) else loaded

    # ------------------------------------------------------------------ tensor reads
    def _run(self, planner: _RegionLoadPlanner) -> None:
        planner.set_up_planner(None, self.metadata, True)
        plan = planner.create_local_plan()
        plan = self._reader.prepare_local_plan(plan)
        (plan,) = self._reader.prepare_global_plan([plan])
        try:
            self._reader.read_data(plan, planner).wait()
        except FileNotFoundError as e:
            raise ConversionError(
                f"checkpoint {str(self.path)!r}: data file missing: {e}"
            ) from None
        except ConversionError:
            raise
        except Exception as e:  # noqa: BLE001 - truncated / corrupt data: unpickling errors of any kind
            raise ConversionError(
                f"checkpoint {str(self.path)!r}: reading failed "
                f"({type(e).__name__}: {e}); the files may be truncated or corrupt"
            ) from None

    def read_regions(self, regions: Iterable[tuple[str, Sequence[int]]]) -> list[torch.Tensor]:
        """Read several regions in one pass. Each region: (key, leading indices); the indices fix
        the first axes (layer / expert of stacked keys). Returns the tensors with them removed."""
        requests, outs = [], []
        for key, lead in regions:
            if key not in self.tensors:
                raise ConversionError(f"checkpoint {str(self.path)!r} has no tensor {key!r}")
            md = self.tensors[key]
            size = tuple(md.size)
            lead = tuple(lead)
            if lead and len(lead) >= len(size):  # a scalar too, read whole with no index
                raise ConversionError(f"tensor {key!r} of shape {size} has no axis after {lead}")
            for axis, idx in enumerate(lead):
                if not 0 <= idx < size[axis]:
                    raise ConversionError(
                        f"tensor {key!r} of shape {size}: index {idx} out of range on axis {axis}"
                    )
            rest = size[len(lead) :]
            off = list(lead) + [0] * len(rest)
            dest = torch.empty((1,) * len(lead) + rest, dtype=md.properties.dtype)
            requests.append((self._stored_key[key], off, dest))
            outs.append(dest.view(rest))
            self.bytes_read += dest.numel() * dest.element_size()
        if requests:
            self._run(_RegionLoadPlanner(requests))
        return outs

    def read(self, key: str, lead: Sequence[int] = ()) -> torch.Tensor:
        return self.read_regions([(key, lead)])[0]

    # ------------------------------------------------------------------ canonical tensors
    def locate(self, tm: TensorMap) -> Location | None:
        """The first of ``checkpoint_locations(tm)`` present in this checkpoint, or None."""
        for loc in checkpoint_locations(tm):
            if all(k in self.tensors for k in loc.keys):
                return loc
        return None

    def location_shape(self, loc: Location) -> tuple[int, ...]:
        """The canonical shape stored at ``loc`` (leading indices removed, parts concatenated)."""
        shapes = [self.shape(k)[len(lead) :] for k, lead in loc.parts]
        if len(shapes) == 1:
            return shapes[0]
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def read_locations(self, locs: Sequence[Location]) -> list[torch.Tensor]:
        """Read the canonical tensors at ``locs`` in one pass."""
        regions = [(k, lead) for loc in locs for k, lead in loc.parts]
        flat = iter(self.read_regions(regions))
        out = []
        for loc in locs:
            parts = [next(flat) for _ in loc.parts]
            out.append(parts[0] if len(parts) == 1 else torch.cat(parts, 0))
        return out


def open_checkpoint(
    checkpoint: str | os.PathLike, config_file: str | None = None
) -> tuple[DistCheckpointReader, ModelArch, str, dict]:
    """Open a ``torch_dist`` checkpoint and resolve its architecture: ``(reader, arch, where the
    description came from, the common state)``. An unreadable common state is tolerated (as
    ``{}``) only with ``config_file``."""
    reader = DistCheckpointReader(checkpoint)
    try:
        common = reader.common_state()
    except ConversionError:
        if not config_file:
            raise
        common = {}
    arch, source = resolve_arch(common, config_file, checkpoint=str(reader.path))
    return reader, arch, source, common
