"""The checkpoint folders a kill (or a full or read-only disk) left cut, repaired at start-up:
this module's one job (the entry point, :mod:`.pretrain`, calls it before Megatron loads or
saves; :mod:`.resume` asks it which checkpoints are complete, :mod:`.file_checks` what a resume
after a full disk would load).

The trackers: ``--load``'s (:func:`repair_checkpoint_tracker`), its global non-persistent
checkpoints', their cut folders removed too (:func:`repair_non_persistent_checkpoints`), and
``--save``'s, its unfinished ``iter_*`` folders removed (:func:`repair_save_folder`; a ``release``
tracker there that Megatron's save fails on: :func:`save_tracker_refusal`). What they judge a
folder by: its format as Megatron tells it (:func:`checkpoint_format`), whether it is complete
(:func:`complete_checkpoint`) and whether a file its format needs is gone (a deletion a kill
cut: :func:`_deleted_in_part`), read from its files' names and sizes, torch DCP's ``.metadata``
and a legacy checkpoint's saved args (no tensor).
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import NamedTuple

from megatron_latentmoe.checkpoint_layout import (
    RELEASE,
    TRACKER_FILE,
    iteration_dir_name,
    iteration_of_dir_name,
)
from megatron_latentmoe.training.console import PROG

AUTO_FORMAT = "auto"
"""The ``ckpt_format`` of a run with ``--auto-detect-ckpt-format``: each folder's own."""


def complete_checkpoint(path: str, ckpt_format: str) -> bool:
    """A checkpoint folder a run can load: Megatron's distributed checkpoint (``torch_dist``)
    writes ``metadata.json`` after everything else (torch DCP's ``.metadata`` just before it);
    ``torch_dcp`` and ``fsdp_dtensor`` are torch DCP's ``save`` alone, ``.metadata`` last and no
    ``metadata.json`` (with one, Megatron's ``_get_checkpoint_format`` takes it for torch_dist),
    and not a ``torch_dist`` save cut before its ``metadata.json`` (:func:`_cut_torch_dist`).
    :data:`AUTO_FORMAT`: each folder by its own format, as Megatron tells them apart
    (:func:`checkpoint_format`; one with none of their files is not complete). ``torch_dist``:
    a legacy ``torch`` folder by its own rule too: megatron-core 0.19.2's ``load_checkpoint``
    detects each folder's format for a torch_dist run (``_get_checkpoint_format``) and loads a
    legacy one (:func:`.resume.format_refusal`); by the torch_dist rule alone a tracker cut next to
    one was not repaired and Megatron's load of it printed "ERROR: Invalid metadata file" and exited
    0, having trained nothing, and ``--ckpt-step`` of one was refused.

    A folder removed while it is read is not complete: rank 0 removes the unfinished ones at
    start-up (:func:`repair_save_folder`) while the other ranks look at ``--load``'s (its
    ``os.listdir`` raised FileNotFoundError on rank 1 of a 2-rank resume after a kill mid-save)."""
    try:
        return _complete_checkpoint(path, ckpt_format)
    except FileNotFoundError:
        return False


def _complete_checkpoint(path: str, ckpt_format: str) -> bool:
    found = checkpoint_format(path)
    if ckpt_format == AUTO_FORMAT:
        ckpt_format = found or "torch_dcp"
    elif ckpt_format == "torch_dist" and found == "torch":
        ckpt_format = "torch"
    if ckpt_format == "torch_dist":
        return os.path.isfile(os.path.join(path, "metadata.json")) and os.path.isfile(
            os.path.join(path, ".metadata")
        )
    if ckpt_format in ("torch_dcp", "fsdp_dtensor"):
        return os.path.isfile(os.path.join(path, ".metadata")) and not _cut_torch_dist(path)
    return os.path.isdir(path) and any(os.scandir(path))


COMMON_STATE = "common_state/"
"""The start of the torch DCP key that megatron-core 0.19.2's ``dist_checkpointing.save`` gives
every ``torch_dist`` checkpoint's common state (a ``ShardedObject``: ``common_state/shard_0_1``);
a ``torch_dcp`` save (``torch.distributed.checkpoint.save`` of Megatron's state dict) has none."""


def _cut_torch_dist(path: str) -> bool:
    """A folder with torch DCP's ``.metadata`` and no ``metadata.json`` whose ``.metadata`` is a
    ``torch_dist`` save's (:data:`COMMON_STATE`): that save was cut (a kill, a full or read-only
    disk) after torch DCP's part and before Megatron's ``metadata.json``, or its deletion was.
    By its files' names alone it is a complete ``torch_dcp`` checkpoint: a repair of ``--save``
    kept it, and a later save of that iteration mixed its shard files with its own. One whose
    ``.metadata`` cannot be read is not judged here (:func:`.resume.load_refusal` says so for a
    load)."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return False
    try:
        return _dcp_metadata(Path(path)).torch_dist
    except Exception:  # noqa: BLE001 - a .metadata that is not torch DCP's, or cut
        return False


class _DcpMetadata(NamedTuple):
    """What the checks read from torch DCP's ``.metadata`` (:func:`_dcp_metadata`)."""

    torch_dist: bool
    """It holds Megatron's common state (:data:`COMMON_STATE`): a ``torch_dist`` save's."""
    shard_ends: tuple[tuple[str, int], ...]
    """Each shard file it names (relative to the folder, sorted) and the byte its data ends at."""


def _dcp_metadata(path: Path) -> _DcpMetadata:
    """:class:`_DcpMetadata` of torch DCP's ``.metadata`` in ``path``; raises what reading it
    raises. Read once per process for each version of the file (its path, inode, size and
    mtime): the start-up checks each ask for every ``iter_*`` folder (each a
    :func:`repair_checkpoint_tracker`), and unpickling one takes tens of milliseconds (70 ms
    for 2,000 tensors). Measured on 50 torch_dcp folders of 2,000 tensors each (2 cores): the
    ``--ckpt-format torch_dcp`` start-up checks' calls (:func:`.resume.loaded_arg`,
    :func:`.resume.load_refusal`, :func:`.resume.ckpt_step_refusal`, :func:`.resume.format_refusal`,
    the repair, :func:`.resume.resumed_by_args`) took 20.3 s (201 readings), 3.4 s now (50); one
    more repair 5.8 s, 0.001 s now."""
    stat = (path / ".metadata").stat()
    return _read_dcp_metadata(str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1024)
def _read_dcp_metadata(path: str, inode: int, size: int, mtime_ns: int) -> _DcpMetadata:
    """:func:`_dcp_metadata`'s reading (the file's version is the cache's key)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(path).read_metadata()
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    torch_dist = any(key.startswith(COMMON_STATE) for key in metadata.state_dict_metadata)
    return _DcpMetadata(torch_dist, tuple(sorted(ends.items())))


def repair_checkpoint_tracker(
    load_dir: str, ckpt_format: str = "torch_dist", *, write: bool = True
) -> int | None:
    """Make ``latest_checkpointed_iteration.txt`` name the newest COMPLETE checkpoint.

    Megatron writes the tracker only after every rank finished a save, so a kill during a save
    leaves it at the previous checkpoint (what we want). A kill while the tracker itself is
    written can leave it empty or cut; then (or if it names a folder that is not complete) the
    newest complete ``iter_*`` folder is written there, atomically. Returns the iteration the
    tracker names afterwards, or None if there is nothing to resume from. ``write=False`` only
    answers that question.
    """
    if not load_dir or not os.path.isdir(load_dir):
        return None
    tracker = os.path.join(load_dir, TRACKER_FILE)
    named = None
    if os.path.isfile(tracker):
        try:
            text = open(tracker).read().strip()
        except (OSError, UnicodeDecodeError):  # unreadable or not text: repaired below
            text = ""
        if text == RELEASE:
            return None
        if text.isdecimal():  # isdigit() takes "²", which int() refuses
            named = int(text)
    complete = sorted(
        iteration
        for entry in os.listdir(load_dir)
        if (iteration := iteration_of_dir_name(entry)) is not None
        and complete_checkpoint(os.path.join(load_dir, entry), ckpt_format)
    )
    if named is not None and named in complete:
        return named  # a damaged one: load_refusal's
    # the newest complete one at or before the tracker's iteration, else the newest
    order = sorted(complete, key=lambda i: (named is None or i <= named, i), reverse=True)
    best = next(
        (i for i in order if not _deleted_in_part(os.path.join(load_dir, iteration_dir_name(i)))),
        None,
    )
    if best is None:
        return None
    if not write:
        return best
    tmp = f"{tracker}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(best))
    os.replace(tmp, tracker)
    print(
        f"[{PROG}] {tracker} named {named if named is not None else 'nothing readable'}; "
        f"resuming from the newest complete checkpoint, iteration {best}",
        flush=True,
    )
    return best


def _deleted_in_part(path: str) -> bool:
    """A folder that looks complete (:func:`complete_checkpoint`) but lacks a file its format
    needs: a ``torch_dist`` or ``torch_dcp`` one a shard file its ``.metadata`` names, or has one
    shorter (:func:`shard_problem`); a legacy ``torch`` one a rank file of the layout its saved
    args give (:func:`_rank_file_problem`). What a kill leaves of a checkpoint whose deletion it
    cut (megatron-core 0.19.2's ``--save-retain-interval`` and non-persistent cleanups remove a
    folder with ``shutil.rmtree``, in the file system's order), or of a legacy save. One whose
    ``.metadata`` or rank files cannot be read is not judged here (:func:`.resume.load_refusal` or
    Megatron's load says so)."""
    found = checkpoint_format(path)
    try:
        if found == "torch":
            return _rank_file_problem(Path(path)) is not None
        if found in ("torch_dist", "torch_dcp"):
            return shard_problem(Path(path)) is not None
    except Exception:  # noqa: BLE001 - an unreadable .metadata or rank file: the load's
        return False
    return False


def shard_problem(path: Path) -> str | None:
    """The first shard file that torch DCP's ``.metadata`` in ``path`` names and that is missing
    or shorter than it says; raises what reading ``.metadata`` raises (:func:`_dcp_metadata`)."""
    for name, end in _dcp_metadata(path).shard_ends:
        shard = path / name
        if not shard.is_file():
            return f"shard file {shard} is missing"
        if shard.stat().st_size < end:
            return (
                f"shard file {shard} is cut short: {shard.stat().st_size} bytes, where .metadata "
                f"has data up to byte {end}"
            )
    return None


RANK_FILE = "model_optim_rng.pt"
"""A legacy ``torch`` checkpoint's file of one (tensor, pipeline, expert) rank, in its
``mp_rank_*`` folder (megatron-core 0.19.2's ``get_checkpoint_name``)."""


def rank_files(path: Path) -> list[Path]:
    """The :data:`RANK_FILE` of each rank folder of the legacy ``torch`` checkpoint in ``path``,
    sorted (rank 0's first)."""
    return sorted(path.glob(f"mp_rank_*/{RANK_FILE}"))


def rank_file_args(file: Path):
    """The run's arguments saved in a legacy rank file (memory-mapped: its tensors are not
    read); raises what reading it raises."""
    import torch

    return torch.load(file, map_location="cpu", weights_only=False, mmap=True)["args"]


def _rank_file_problem(path: Path) -> str | None:
    """The first file of the legacy ``torch`` checkpoint in ``path`` that is not there: the
    :data:`RANK_FILE` of each rank of the layout its saved args give (``mp_rank_TT``, with
    ``_PPP`` for more than one pipeline stage and ``_EEE`` for more than one expert rank, as
    megatron-core 0.19.2's ``get_checkpoint_name`` names them), and the ``distrib_optim.pt``
    beside it where its run saved the distributed optimizer's state. The args come from the
    first rank file that can be read (memory-mapped: its tensors are not read); raises what
    reading it raises where none can."""
    files = rank_files(path)
    if not files:
        return f"no rank file (mp_rank_*/{RANK_FILE}) in {path}"
    error: Exception | None = None
    for file in files:
        try:
            saved = rank_file_args(file)
            break
        except Exception as e:  # noqa: BLE001 - cut or corrupt: the next one may be whole
            error = e
    else:
        raise error
    tp, pp, ep = (
        getattr(saved, f"{name}_model_parallel_size", None) or 1
        for name in ("tensor", "pipeline", "expert")
    )
    needed = [RANK_FILE]
    if getattr(saved, "use_distributed_optimizer", False) and not getattr(
        saved, "no_save_optim", False
    ):
        needed.append("distrib_optim.pt")
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                folder = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                folder += f"_{e:03d}" if ep > 1 else ""
                for name in needed:
                    if not (path / folder / name).is_file():
                        return f"rank file {path / folder / name} is missing"
    return None


def repair_save_folder(args) -> None:
    """``--save`` made safe for Megatron's saves (rank 0, at start-up, after ``--load``'s repair
    :func:`repair_checkpoint_tracker`):

    - its tracker, where ``--save`` is not ``--load``, repaired as ``--load``'s, a checkpoint of
      any format complete (:data:`AUTO_FORMAT`: this run does not load it; a later ``--load``
      of that folder judges its format, :func:`.resume.format_refusal`); one that still names
      nothing readable (no complete checkpoint there) is removed. megatron-core 0.19.2's save with
      ``--save-retain-interval`` reads it as an iteration number, and a tracker a kill cut failed
      its first save with "ValueError: invalid literal for int() with base 10: ''" on every rank;
      with ``--load`` that folder, Megatron's load printed "ERROR: Invalid metadata file" and exited
      0, having trained nothing;
    - its unfinished ``iter_*`` folders (complete in no format, :data:`AUTO_FORMAT`: no torch
      DCP ``.metadata``, a ``torch_dist`` one without ``metadata.json``, no legacy rank file;
      what a save that met a full or read-only disk, or a kill, left), but the one the tracker
      names, are removed: Megatron saves into an
      existing folder as it is, so its save of that iteration mixed the old files with its own.
    """
    save = getattr(args, "save", None)
    if not save or not os.path.isdir(save):
        return
    tracker = os.path.join(save, TRACKER_FILE)
    if args.load is None or os.path.normpath(args.load) != os.path.normpath(save):
        repair_checkpoint_tracker(save, AUTO_FORMAT)
    text = tracker_text(save)
    if os.path.isfile(tracker) and not (text == RELEASE or (text or "").isdecimal()):
        os.remove(tracker)
        print(
            f"[{PROG}] {tracker} named nothing readable, and no checkpoint in --save {save} is "
            "complete: removed it",
            flush=True,
        )
    named = int(text) if text and text.isdecimal() else None
    unfinished = sorted(
        entry
        for entry in os.listdir(save)
        if (iteration := iteration_of_dir_name(entry)) is not None
        and iteration != named
        and os.path.isdir(os.path.join(save, entry))
        and not complete_checkpoint(os.path.join(save, entry), AUTO_FORMAT)
    )
    for entry in unfinished:
        shutil.rmtree(os.path.join(save, entry))
    if unfinished:
        print(
            f"[{PROG}] removed the unfinished checkpoint folder(s) {', '.join(unfinished)} in "
            f"--save {save} (a save cut by a kill or a full or read-only disk): a save of that "
            "iteration would have mixed their files with its own",
            flush=True,
        )


def save_tracker_refusal(args) -> str | None:
    """One line when ``--save-retain-interval`` meets a ``release`` tracker in ``--save`` (a
    release checkpoint saved or resumed there): megatron-core 0.19.2's first save reads the
    tracker as an iteration number and fails on every rank with "ValueError: invalid literal for
    int() with base 10: 'release'", after the iterations before it."""
    retain, save = getattr(args, "save_retain_interval", None), getattr(args, "save", None)
    if not retain or not save or tracker_text(save) != RELEASE:
        return None
    return (
        f"--save-retain-interval {retain} with --save {save}, whose {TRACKER_FILE} says "
        "release: megatron-core 0.19.2's first save would fail reading it as an iteration "
        "number; give --save another folder, or leave --save-retain-interval out"
    )


def repair_non_persistent_checkpoints(args) -> None:
    """``--load``'s global non-persistent checkpoints (:func:`non_persistent_dir`) made loadable
    after a kill, where Megatron reads them (there is a tracker): the folders cut by a kill and
    newer than the newest complete one are removed, the tracker is repaired as ``--load``'s
    (:func:`repair_checkpoint_tracker`), and where no folder is complete it is removed, so that
    Megatron loads the persistent checkpoint (or starts from scratch), as it does without one.
    Complete folders, the folder's other entries and cut folders older than a complete one (which
    Megatron's next non-persistent save deletes itself) are left.

    megatron-core 0.19.2 deletes every non-persistent folder but the newest by name before each
    non-persistent save (``cleanup_old_non_persistent_checkpoint``). A kill during a save leaves
    its folder cut and the tracker at the previous one; the next run's first non-persistent save
    then deleted that complete folder and kept the cut one. Killed again during that save, the
    tracker named a folder that was gone: the next run failed in Megatron's load on every rank
    with "CheckpointingException: Checkpoint directory None does not exist", and with the
    tracker removed it started over from the persistent checkpoint, the non-persistent progress
    lost. With the cut folder removed first, that save keeps the complete one, and the run after
    the second kill loads it and logs the unkilled run's losses to the bit (measured: CPU, one
    rank, saves every 2 iterations, both kills during the save of iteration 6)."""
    folder = non_persistent_dir(args)
    tracker = folder and os.path.join(folder, TRACKER_FILE)
    if not tracker or not os.path.isfile(tracker):
        return
    named = tracker_text(folder)
    if named == RELEASE:  # Megatron refuses it: "Non-persistent checkpoint can't be a release"
        return
    ckpt_format = args.ckpt_format  # Megatron saves them in it, --auto-detect-ckpt-format or not
    is_complete = {
        iteration: complete_checkpoint(os.path.join(folder, entry), ckpt_format)
        for entry in os.listdir(folder)
        if (iteration := iteration_of_dir_name(entry)) is not None
        and os.path.isdir(os.path.join(folder, entry))
    }
    newest = max((i for i, ok in is_complete.items() if ok), default=None)
    cut = sorted(i for i, ok in is_complete.items() if not ok and newest is not None and i > newest)
    for iteration in cut:
        shutil.rmtree(os.path.join(folder, iteration_dir_name(iteration)))
    if cut:
        print(
            f"[{PROG}] removed the non-persistent checkpoint(s) of iteration(s) "
            f"{', '.join(map(str, cut))} in {folder}, cut by a kill during their save: Megatron's "
            f"next non-persistent save would have deleted the complete one of iteration {newest} "
            f"and kept the newer cut one",
            flush=True,
        )
    if repair_checkpoint_tracker(folder, ckpt_format) is None:
        os.remove(tracker)
        print(
            f"[{PROG}] {tracker} named {named or 'nothing readable'}, and no non-persistent "
            f"checkpoint in {folder} is complete: removed it; the run loads the persistent "
            f"checkpoint in --load {args.load}, if there is one",
            flush=True,
        )


def checkpoint_format(path: str | None) -> str | None:
    """The format of the checkpoint folder ``path`` as megatron-core 0.19.2's
    ``_get_checkpoint_format`` tells it on load (``metadata.json``: ``torch_dist``; ``mp_rank_0*``
    entries: a legacy ``torch`` one; torch DCP's ``.metadata``: ``torch_dcp``); None: not a
    folder, or none of these."""
    if not path or not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return "torch_dist"
    names = os.listdir(path)
    if any(name.startswith("mp_rank_0") for name in names):
        return "torch"
    return "torch_dcp" if ".metadata" in names else None


def non_persistent_dir(args, load_dir: str | None = None) -> str | None:
    """The folder of the run's global non-persistent checkpoints (``--non-persistent-ckpt-type
    global``: ``--non-persistent-global-ckpt-dir``, else ``non_persistent`` in ``load_dir``,
    default ``--load``, as Megatron's ``_load_base_checkpoint`` looks for them, for the load and
    for ``--use-checkpoint-args``); None for any other type."""
    load_dir = load_dir or args.load
    if getattr(args, "non_persistent_ckpt_type", None) != "global" or not load_dir:
        return None
    if args.non_persistent_global_ckpt_dir:
        return args.non_persistent_global_ckpt_dir
    from megatron.training.checkpointing import _NON_PERSISTENT_CKPT_SUBDIR

    return os.path.join(load_dir, _NON_PERSISTENT_CKPT_SUBDIR)


def tracker_text(load_dir: str) -> str | None:
    """What ``load_dir``'s tracker holds, stripped (None: no tracker, or unreadable)."""
    try:
        return Path(load_dir, TRACKER_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
