"""The checkpoint ``--load`` resumes from, and whether this run can load it: this module's one
job (the entry point, :mod:`.pretrain`, calls it; :mod:`.file_checks` asks it what a resume
after a full disk would load).

Which checkpoint: the trackers repaired after a kill (:func:`repair_checkpoint_tracker`; for
the global non-persistent checkpoints, their cut folders removed too,
:func:`repair_non_persistent_checkpoints`), the folder Megatron will load
(:func:`resumed_by_args`, the one place that says which: a ``release`` one, ``--ckpt-step``'s, a
newer global non-persistent one) and its format (:func:`checkpoint_format`), that folder's saved
args (:func:`saved_args`; with ``--use-checkpoint-args`` the model flags come from them,
:func:`load_checkpoint_args`).

What is wrong with it, found before any rank loads it: megatron-core 0.19.2 meets each of these
in the middle of its load, on every rank, as a Python traceback (``FileNotFoundError`` for a
tracker naming a folder that is not there; torch DCP's ``CheckpointException`` around an
``EOFError`` or an ``UnpicklingError`` for a shard file or ``.metadata`` cut short; a
``JSONDecodeError`` for a cut ``metadata.json``: :func:`load_refusal`; a format this run's
``--ckpt-format`` does not load: :func:`format_refusal`; another model shape:
:func:`shape_refusal`), or not at all: a Hugging Face export given to ``--load`` trains from
random weights after one warning line, a legacy ``torch`` checkpoint of another parallel layout
trains nothing and exits 0 (:func:`legacy_layout_refusal`). :func:`load_refusal` reads only the
tracker, ``metadata.json``, torch DCP's ``.metadata`` and the shard files' sizes (no tensor), so
the flag check can afford it. A loaded data offset that this run's datasets cannot serve is known
once Megatron builds them, after the model: :mod:`.data_left`.

A layout Megatron does reshard: what it loads and what starts over (:func:`plan_layout_change`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import NamedTuple

from megatron_latentmoe.checkpoint_layout import (
    RELEASE,
    TRACKER_FILE,
    iteration_dir_name,
    iteration_of_dir_name,
    tracked_checkpoint_dir,
)
from megatron_latentmoe.training.console import PROG, print0

AUTO_FORMAT = "auto"
"""The ``ckpt_format`` of a run with ``--auto-detect-ckpt-format``: each folder's own."""


def load_format(args) -> str:
    """The checkpoint format ``--load`` reads: ``--ckpt-format``, or each folder's own with
    ``--auto-detect-ckpt-format`` (:data:`AUTO_FORMAT`)."""
    return AUTO_FORMAT if getattr(args, "auto_detect_ckpt_format", False) else args.ckpt_format


def _complete_checkpoint(path: str, ckpt_format: str) -> bool:
    """A checkpoint folder a run can load: Megatron's distributed checkpoint (``torch_dist``)
    writes ``metadata.json`` after everything else (torch DCP's ``.metadata`` just before it);
    ``torch_dcp`` and ``fsdp_dtensor`` are torch DCP's ``save`` alone, ``.metadata`` last and no
    ``metadata.json`` (with one, Megatron's ``_get_checkpoint_format`` takes it for torch_dist),
    and not a ``torch_dist`` save cut before its ``metadata.json`` (:func:`_cut_torch_dist`).
    :data:`AUTO_FORMAT`: each folder by its own format, as Megatron tells them apart
    (:func:`checkpoint_format`; one with none of their files is not complete). ``torch_dist``:
    a legacy ``torch`` folder by its own rule too: megatron-core 0.19.2's ``load_checkpoint``
    detects each folder's format for a torch_dist run (``_get_checkpoint_format``) and loads a
    legacy one (:func:`format_refusal`); by the torch_dist rule alone a tracker cut next to one
    was not repaired and Megatron's load of it printed "ERROR: Invalid metadata file" and exited
    0, having trained nothing, and ``--ckpt-step`` of one was refused."""
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
    ``.metadata`` cannot be read is not judged here (:func:`load_refusal` says so for a load)."""
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
    ``--ckpt-format torch_dcp`` start-up checks' calls (:func:`loaded_arg`, :func:`load_refusal`,
    :func:`ckpt_step_refusal`, :func:`format_refusal`, the repair, :func:`resumed_by_args`) took
    20.3 s (201 readings), 3.4 s now (50); one more repair 5.8 s, 0.001 s now."""
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
        and _complete_checkpoint(os.path.join(load_dir, entry), ckpt_format)
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
    """A folder that looks complete (:func:`_complete_checkpoint`) but lacks a file its format
    needs: a ``torch_dist`` or ``torch_dcp`` one a shard file its ``.metadata`` names, or has one
    shorter (:func:`_shard_problem`); a legacy ``torch`` one a rank file of the layout its saved
    args give (:func:`_rank_file_problem`). What a kill leaves of a checkpoint whose deletion it
    cut (megatron-core 0.19.2's ``--save-retain-interval`` and non-persistent cleanups remove a
    folder with ``shutil.rmtree``, in the file system's order), or of a legacy save. One whose
    ``.metadata`` or rank files cannot be read is not judged here (:func:`load_refusal` or
    Megatron's load says so)."""
    found = checkpoint_format(path)
    try:
        if found == "torch":
            return _rank_file_problem(Path(path)) is not None
        if found in ("torch_dist", "torch_dcp"):
            return _shard_problem(Path(path)) is not None
    except Exception:  # noqa: BLE001 - an unreadable .metadata or rank file: the load's
        return False
    return False


RANK_FILE = "model_optim_rng.pt"
"""A legacy ``torch`` checkpoint's file of one (tensor, pipeline, expert) rank, in its
``mp_rank_*`` folder (megatron-core 0.19.2's ``get_checkpoint_name``)."""


def _rank_files(path: Path) -> list[Path]:
    """The :data:`RANK_FILE` of each rank folder of the legacy ``torch`` checkpoint in ``path``,
    sorted (rank 0's first)."""
    return sorted(path.glob(f"mp_rank_*/{RANK_FILE}"))


def _rank_file_args(file: Path):
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
    files = _rank_files(path)
    if not files:
        return f"no rank file (mp_rank_*/{RANK_FILE}) in {path}"
    error: Exception | None = None
    for file in files:
        try:
            saved = _rank_file_args(file)
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
      of that folder judges its format, :func:`format_refusal`); one that still names nothing
      readable (no complete checkpoint there) is removed. megatron-core 0.19.2's
      save with ``--save-retain-interval`` reads it as an iteration number, and a tracker a kill
      cut failed its first save with "ValueError: invalid literal for int() with base 10: ''"
      on every rank; with ``--load`` that folder, Megatron's load printed "ERROR: Invalid
      metadata file" and exited 0, having trained nothing;
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
    text = _tracker_text(save)
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
        and not _complete_checkpoint(os.path.join(save, entry), AUTO_FORMAT)
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
    if not retain or not save or _tracker_text(save) != RELEASE:
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
    named = _tracker_text(folder)
    if named == RELEASE:  # Megatron refuses it: "Non-persistent checkpoint can't be a release"
        return
    ckpt_format = args.ckpt_format  # Megatron saves them in it, --auto-detect-ckpt-format or not
    is_complete = {
        iteration: _complete_checkpoint(os.path.join(folder, entry), ckpt_format)
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


def resumed_checkpoint(
    load_dir: str,
    ckpt_format: str = "torch_dist",
    *,
    non_persistent: str | None = None,
    ckpt_step: int | None = None,
) -> str | None:
    """The folder of the checkpoint a run will resume from (None: nothing to load), as
    megatron-core 0.19.2's ``_load_base_checkpoint`` picks it from ``load_dir`` (``--load`` or
    ``--pretrained-checkpoint``): the tracker's (repaired, :func:`repair_checkpoint_tracker`), a
    ``release`` one included (its iteration: 0). ``ckpt_step`` (``--ckpt-step``,
    :func:`ckpt_step`) replaces the tracker's iteration: that iteration's folder, there or not,
    complete or not, with or without a tracker; a ``release`` tracker still loads ``release``.
    ``non_persistent`` (:func:`non_persistent_dir`): the newest global non-persistent checkpoint
    there where its iteration is that iteration or newer."""
    release = _tracker_text(load_dir) == RELEASE
    iteration = ckpt_step or (
        0 if release else repair_checkpoint_tracker(load_dir, ckpt_format, write=False)
    )
    newer = (
        repair_checkpoint_tracker(non_persistent, "torch_dist", write=False)
        if non_persistent
        else None
    )
    if newer is not None and (iteration is None or newer >= iteration):
        return os.path.join(non_persistent, iteration_dir_name(newer))
    if release:
        return os.path.join(load_dir, RELEASE)
    return None if iteration is None else os.path.join(load_dir, iteration_dir_name(iteration))


def _tracker_text(load_dir: str) -> str | None:
    """What ``load_dir``'s tracker holds, stripped (None: no tracker, or unreadable)."""
    try:
        return Path(load_dir, TRACKER_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def ckpt_step(args) -> int | None:
    """``--ckpt-step``: the iteration Megatron loads in place of the tracker's (None: none given;
    0 is none to megatron-core 0.19.2, which tests it for truth)."""
    return getattr(args, "ckpt_step", None) or None


def resumed_by_args(args, load_arg: str | None = None) -> str | None:
    """:func:`resumed_checkpoint` for this run's flags: the folder megatron-core 0.19.2 loads
    (``load_arg``: default :func:`loaded_arg`), None where it loads none; where no folder is
    complete by this run's format, the one the tracker names, which Megatron loads as it is."""
    load_arg = load_arg or loaded_arg(args)
    if load_arg is None:
        return None
    load_dir = getattr(args, load_arg)
    path = resumed_checkpoint(
        load_dir,
        load_format(args),
        non_persistent=non_persistent_dir(args, load_dir),
        ckpt_step=ckpt_step(args),
    )
    if path is None:
        try:
            tracked = tracked_checkpoint_dir(load_dir)
        except ValueError:  # an unreadable tracker: Megatron will report it
            tracked = None
        path = tracked and str(tracked)
    return path


def ckpt_step_refusal(args, load_arg: str = "load") -> str | None:
    """One line when ``--ckpt-step N`` makes Megatron load a folder that is not there or not
    complete (:func:`_complete_checkpoint` by this run's format): megatron-core 0.19.2 failed
    after building the model and optimizer, on every rank, with "FileNotFoundError: [Errno 2]
    No such file or directory: '.../iter_0000005'" (measured: CPU, one rank, tiny.sh, an empty
    --load, --ckpt-step 5)."""
    step, load_dir = ckpt_step(args), getattr(args, load_arg, None)
    path = step and load_dir and resumed_by_args(args, load_arg)
    if not path or path != os.path.join(load_dir, iteration_dir_name(step)):
        return None
    if _complete_checkpoint(path, load_format(args)):
        return None
    what = "is not a complete checkpoint" if os.path.isdir(path) else "is not there"
    complete = sorted(
        i
        for e in (os.listdir(load_dir) if os.path.isdir(load_dir) else ())
        if (i := iteration_of_dir_name(e)) is not None
        and _complete_checkpoint(os.path.join(load_dir, e), load_format(args))
    )
    head = f"--ckpt-step {step}: {path} {what} ({load_flag(load_arg)} {load_dir}); "
    tracked = os.path.isfile(os.path.join(load_dir, TRACKER_FILE))
    if not tracked and not complete:  # without --ckpt-step Megatron finds no checkpoint there
        return head + (
            "no checkpoint is there: leave --ckpt-step out to start from scratch"
            if load_arg == "load"
            else f"no checkpoint is there: give {load_flag(load_arg)} the folder that holds one"
        )
    # no tracker: the start-up repair writes one naming the newest complete checkpoint
    instead = "the tracker's" if tracked else f"the newest complete one ({complete[-1]})"
    return head + (
        "give an iteration whose checkpoint there is complete (complete ones: "
        f"{', '.join(map(str, complete)) or 'none'}), or leave --ckpt-step out to load {instead}"
    )


def ckpt_step_warning(args, load_arg: str = "load") -> str | None:
    """A warning when ``--ckpt-step N`` has no effect: megatron-core 0.19.2's
    ``_load_base_checkpoint`` replaces the tracker's iteration with N but keeps its ``release``
    flag, so a ``release`` tracker loads ``release`` whatever N is, silently (the iteration it
    records is N). None where Megatron loads another folder (a newer non-persistent one)."""
    step, load_dir = ckpt_step(args), getattr(args, load_arg, None)
    path = step and load_dir and resumed_by_args(args, load_arg)
    if not loads_release(path):
        return None
    return (
        f"--ckpt-step {step} is ignored: {load_flag(load_arg)} {load_dir} holds a release "
        f"checkpoint ({TRACKER_FILE}: release), which megatron-core 0.19.2 loads whatever "
        f"--ckpt-step says: {path}"
    )


def loads_release(path: str | None) -> bool:
    """Whether the folder Megatron loads (``path``, :func:`resumed_by_args`) is a ``release``
    checkpoint: megatron-core 0.19.2 restores its model alone (the QB ``router.expert_bias``
    included: model state), from iteration 0, with no optimizer, LR scheduler, RNG or rerun
    state, from ``--load`` as from ``--pretrained-checkpoint``."""
    return bool(path) and os.path.basename(os.path.normpath(path)) == RELEASE


def release_data_warning(args, saved, path: str | None, load_arg: str = "load") -> str | None:
    """A warning when ``--load`` resumes a ``release`` checkpoint (``path``, its args ``saved``)
    without ``--finetune``: megatron-core 0.19.2 then starts the iteration count, optimizer, LR
    schedule and RNG over (:func:`loads_release`) but still takes ``consumed_train_samples`` (and
    the validation and skipped counts) from the checkpoint's args, so the fresh run reads its
    data after the samples the release's own run consumed. Measured (CPU, 1 rank, tiny.sh, global
    batch 8): a release made of iteration 2 logged "consumed samples: 24" at iteration 1, whose
    loss and per-expert loads equal the saving run's iteration 3, the QB bias so loaded;
    ``--finetune``: 8. None for ``--pretrained-checkpoint`` (Megatron sets ``--finetune``), no
    consumed samples, or ``--override-ckpt-iteration`` (the user sets the data offset; Megatron
    refuses it with ``--finetune``)."""
    consumed = getattr(saved, "consumed_train_samples", 0) or 0
    if (
        load_arg != "load"
        or args.finetune
        or getattr(args, "override_ckpt_iteration", None) is not None
        or not loads_release(path)
        or consumed <= 0
    ):
        return None
    return (
        f"--load {args.load} holds a release checkpoint ({TRACKER_FILE}: release): "
        "megatron-core 0.19.2 restores its model weights alone (the QB router bias included) and "
        "starts the iteration count, optimizer, LR schedule (warm-up included) and RNG over, but "
        f"continues the data after the {consumed} training samples the run that saved it "
        "consumed (validation data likewise). Pass --finetune to start the data from sample 0 "
        "too: for a release checkpoint it changes nothing else in megatron-core 0.19.2 but "
        "skipping Megatron's comparison of the checkpoint's model args (this entry point's shape "
        "check still runs)"
    )


def loaded_arg(args) -> str | None:
    """The flag (its dest) whose folder megatron-core 0.19.2's ``load_checkpoint`` loads:
    ``load``, or ``pretrained_checkpoint`` where ``--load`` holds no checkpoint (no tracker
    there, ``checkpoint_exists``; counted after :func:`repair_checkpoint_tracker`, which may
    write one): it then fine-tunes from that one (``args.finetune``: the model alone, from
    iteration 0). None: neither is given."""
    if getattr(args, "pretrained_checkpoint", None) is None:
        return "load" if args.load else None
    if args.load and (
        os.path.isfile(os.path.join(args.load, TRACKER_FILE))
        or repair_checkpoint_tracker(args.load, load_format(args), write=False) is not None
    ):
        return "load"
    return "pretrained_checkpoint"


def load_flag(load_arg: str) -> str:
    """The flag of a dest :func:`loaded_arg` returns."""
    return "--" + load_arg.replace("_", "-")


def saved_args(path: str | None):
    """The arguments of the checkpoint in the folder ``path`` (:func:`resumed_by_args`: the one
    Megatron loads; None: nothing to load, or not readable): a distributed checkpoint's common
    state, a legacy ``torch`` one's rank-0 file (memory-mapped: its tensors are not read)."""
    if path is None:
        return None
    if checkpoint_format(path) == "torch":
        try:
            return _rank_file_args(_rank_files(Path(path))[0])
        except Exception:  # noqa: BLE001 - unreadable: Megatron will report it
            return None
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception:  # noqa: BLE001 - not a distributed checkpoint: Megatron will report it
        return None
    return common.get("args")


def load_checkpoint_args(args) -> set[str]:
    """``--use-checkpoint-args``: the model flags come from the checkpoint, as in Megatron's
    ``parse_and_validate_args`` (this entry point parses and validates on its own, so it calls
    Megatron's ``load_args_from_checkpoint`` here, for ``--pretrained-checkpoint`` and then
    ``--load``). The flags this package adds that the model's config holds (the ``ADDED`` rows
    of ``fields.FIELDS`` with an HF key: ``--hidden-act``, the SiTU betas, ``--moe-latent-norm``,
    ``--first-k-dense-replace``) are taken from the checkpoint too, always, as Megatron takes
    ``--swiglu`` and ``--moe-latent-size``, from the one Megatron reads its flags from: with
    ``--non-persistent-ckpt-type global``, a newer non-persistent one (:func:`saved_args`).
    Raises ``FlagError`` where Megatron asserts.

    Returns the dests whose values the checkpoint changed (a later refusal names them as the
    checkpoint's, not as flags the user typed)."""
    from megatron.training.checkpointing import load_args_from_checkpoint

    from megatron_latentmoe.fields import ADDED
    from megatron_latentmoe.training.arguments import FlagError

    if args.load is None and args.pretrained_checkpoint is None:
        raise FlagError(
            "--use-checkpoint-args reads the model flags from a checkpoint: give it with --load "
            "(or --pretrained-checkpoint)"
        )
    if args.non_persistent_ckpt_type == "local":
        raise FlagError(
            "--use-checkpoint-args with --non-persistent-ckpt-type local: not supported by "
            "megatron-core 0.19.2 (all flags must be known before its local checkpoint manager "
            "starts); give the model flags instead"
        )
    typed = dict(vars(args))
    for load_arg in ("pretrained_checkpoint", "load"):
        if getattr(args, load_arg) is None:
            continue
        load_args_from_checkpoint(args, load_arg=load_arg)
        saved = saved_args(resumed_by_args(args, load_arg))
        for f in ADDED:
            value = getattr(saved, f.name, None) if f.hf else None
            if value is not None:
                print0(f"Setting {f.name} to {value} from checkpoint")
                setattr(args, f.name, value)
    missing = object()
    return {dest for dest, value in vars(args).items() if typed.get(dest, missing) != value}


# ------------------------------------------------------------------------- start-up refusals
HF_IMPORT = "python -m megatron_latentmoe.convert import --hf {path} --output SAVE_ROOT"


def _is_hf_export(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _torch_dist_refusal(path: Path) -> str | None:
    """A complete-looking ``torch_dist`` folder (``metadata.json`` and ``.metadata`` present)
    whose metadata cannot be read, or whose shard files are missing or shorter than
    ``.metadata`` says."""
    try:
        meta = json.loads((path / "metadata.json").read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (OSError, ValueError) as e:
        return f"{path / 'metadata.json'} cannot be read ({e})"
    try:
        return _shard_problem(path)
    except Exception as e:  # noqa: BLE001 - any unpickling / IO problem of a cut or corrupt file
        return f"{path / '.metadata'} cannot be read ({type(e).__name__}: {e})"


def _shard_problem(path: Path) -> str | None:
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


def load_refusal(args, load_arg: str = "load") -> str | None:
    """One line saying what is wrong with the checkpoint ``--load`` resumes from and what to do,
    or None (nothing wrong, or nothing to load: a run given an empty or new folder starts from
    scratch, as Megatron does). Judges the folder :func:`resumed_by_args` names, the one
    Megatron loads (the tracker's after :func:`repair_checkpoint_tracker`, ``--ckpt-step``'s, a
    newer global non-persistent one, a ``release`` one); checks its files where it is a
    ``torch_dist`` one. ``load_arg``: the flag (its dest) whose folder Megatron loads
    (:func:`loaded_arg`; ``--pretrained-checkpoint``: the advice to start from scratch is left
    out, Megatron does not start from scratch without it). A ``--ckpt-step`` folder that is not
    complete: :func:`ckpt_step_refusal`'s."""
    load_dir, flag = getattr(args, load_arg), load_flag(load_arg)
    if not load_dir or not os.path.isdir(load_dir):
        return None
    root = Path(load_dir)
    if _is_hf_export(root) and not (root / TRACKER_FILE).exists():
        return (
            f"{flag} {load_dir} is a Hugging Face export (config.json, *.safetensors), not a "
            f"Megatron checkpoint: Megatron would start from random weights. Import it first "
            f"({HF_IMPORT.format(path=load_dir)}) and give {flag} SAVE_ROOT"
        )
    resumes = flag == "--load"
    path = resumed_by_args(args, load_arg)
    if path is None:
        return None
    tracker, text = root / TRACKER_FILE, _tracker_text(load_dir) or ""
    if not os.path.isdir(path):
        if (
            text.isdecimal()
            and not ckpt_step(args)  # its folder: ckpt_step_refusal's
            and path == str(root / iteration_dir_name(int(text)))
        ):
            return (
                f"{flag} {load_dir}: {tracker} names iteration {int(text)}, but "
                f"{path} is not there and no other complete checkpoint is: give {flag} the "
                "folder that holds it"
                + (f", or delete {tracker} to start from scratch" if resumes else "")
            )
        return None
    if not _complete_checkpoint(path, load_format(args)) or checkpoint_format(path) != (
        "torch_dist"
    ):
        return None
    problem = _torch_dist_refusal(Path(path))
    if problem is None:
        return None
    name, iteration = os.path.basename(path), iteration_of_dir_name(os.path.basename(path))
    folder = os.path.dirname(path)
    if os.path.normpath(folder) != os.path.normpath(load_dir):  # a newer non-persistent one
        return (
            f"{flag} {load_dir}: the non-persistent checkpoint of iteration {iteration} ({path}), "
            f"which Megatron loads as the newest, is damaged: {problem}. Delete {folder} (the run "
            f"then loads the persistent checkpoint in {load_dir})"
        )
    if iteration is None:  # release
        return (
            f"{flag} {load_dir}: the release checkpoint {path} is damaged: {problem}. Write it "
            "again (for an HF model: the import)"
        )
    return (
        f"{flag} {load_dir}: the checkpoint of iteration {iteration} is damaged: {problem}. "
        f"Write {TRACKER_FILE} with an earlier iteration whose folder is whole"
        + (
            f", or delete {name} (the run then resumes from the newest complete one)"
            if resumes
            else ""
        )
    )


def pretrained_refusal(args) -> str | None:
    """One line when Megatron loads ``--pretrained-checkpoint`` (:func:`loaded_arg`) and there
    is no checkpoint there: megatron-core 0.19.2 raised "FileNotFoundError: No checkpoint found
    in load directory or pretrained directory" on every rank, after building the model
    (measured). What is wrong with a checkpoint that is there: :func:`load_refusal` and the
    others, given ``load_arg="pretrained_checkpoint"``."""
    if loaded_arg(args) != "pretrained_checkpoint":
        return None
    path = args.pretrained_checkpoint
    if os.path.isfile(os.path.join(path, TRACKER_FILE)):
        return None
    load = f"--load {args.load} holds none either" if args.load else "no --load is given"
    return (
        f"--pretrained-checkpoint {path}: no checkpoint there ({TRACKER_FILE} is not there) and "
        f"{load}; give it the folder a Megatron save or the HF import wrote (SAVE_ROOT)"
    )


def format_refusal(args, load_arg: str = "load") -> str | None:
    """One line when the checkpoint ``--load`` resumes from (:func:`resumed_by_args`: a newer
    non-persistent one, ``--ckpt-step``'s; where no folder is complete by this run's format, the
    one the tracker names, which Megatron loads as it is) is of a format megatron-core 0.19.2
    fails to load with this run's ``--ckpt-format``, with a traceback on every rank (measured
    with one rank):

    - ``torch_dist`` with ``--ckpt-format torch`` without ``--auto-detect-ckpt-format``:
      "RuntimeError: Detected load from a distributed checkpoint, but neither --use-dist-ckpt
      nor --auto-detect-ckpt-format is set." (with it, the run loads it:
      ``compat.training.load_distributed_checkpoint_as_such``);
    - ``torch_dcp`` with ``--ckpt-format torch`` or ``torch_dist``, with or without
      ``--auto-detect-ckpt-format``: "AttributeError: 'NoneType' object has no attribute
      'items'" (its load builds the state dict to read into only for a torch_dcp run).

    A legacy ``torch`` checkpoint loads with ``--ckpt-format torch_dist`` (measured; Megatron's
    code path is the one with ``--auto-detect-ckpt-format``, whose losses
    tests/training/test_ckpt_formats.py checks). A torch_dcp run (``--use-torch-fsdp2``) is not
    judged: FSDP2 does not start on CPU here, so what it loads is not measured. ``load_arg``: the
    folder's flag (:func:`loaded_arg`)."""
    load_dir = getattr(args, load_arg)
    if not load_dir:
        return None
    path = resumed_by_args(args, load_arg)
    found, run = checkpoint_format(path), args.ckpt_format
    auto = getattr(args, "auto_detect_ckpt_format", False)
    if found == "torch_dist" and run == "torch" and not auto:
        ways = (
            "--ckpt-format torch_dist, or add --auto-detect-ckpt-format (the run then saves in "
            "--ckpt-format torch)"
        )
    elif found == "torch_dcp" and run in ("torch", "torch_dist"):
        ways = (
            "--ckpt-format torch_dcp (Megatron allows it with --use-torch-fsdp2 only); "
            "--auto-detect-ckpt-format does not load it"
        )
    else:
        return None
    flags = f"--ckpt-format {run}" + (" --auto-detect-ckpt-format" if auto else "")
    return (
        f"{load_flag(load_arg)} {load_dir}: {path} is a {found} checkpoint, which megatron-core "
        f"0.19.2 fails to load with {flags}; resume from it with {ways}"
    )


SHAPE_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_latent_size",
    "moe_shared_expert_intermediate_size",
    "first_k_dense_replace",
    "padded_vocab_size",
)
"""The args that set a tensor's shape, as the checkpoint's args and this run's hold them (the
vocabulary: the tokenizer's, padded; every other is named by its flag)."""


def shape_refusal(load_dir: str, args, saved, flag: str = "--load") -> str | None:
    """One line naming the model flags whose values in the checkpoint's args (``saved``; None:
    nothing to load) differ from this run's: megatron-core's load fails on the first tensor
    of another shape with a ``CheckpointException`` traceback (``Global shape mismatch``).
    ``flag``: the one that gave ``load_dir``."""
    if saved is None:
        return None
    from megatron_latentmoe.training.arguments import flag_for_field

    def name(dest: str) -> str:
        return "the padded vocabulary" if dest == "padded_vocab_size" else flag_for_field(dest)

    differ = [
        f"{name(dest)} {getattr(saved, dest)} (this run: {getattr(args, dest)})"
        for dest in SHAPE_ARGS
        if getattr(saved, dest, None) is not None
        and getattr(args, dest, None) is not None
        and getattr(saved, dest) != getattr(args, dest)
    ]
    if not differ:
        return None
    return (
        f"{flag} {load_dir}: the checkpoint is of another model shape: {', '.join(differ)}. Give "
        "the checkpoint's model flags, or --use-checkpoint-args to take them from it"
    )


LAYOUT_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "context_parallel_size",
    "data_parallel_size",
)


def legacy_layout_refusal(args, saved, path: str | None, load_arg: str = "load") -> str | None:
    """One line when the checkpoint ``--load`` resumes from (its folder ``path``, from
    :func:`resumed_by_args`; its args ``saved``) is a legacy ``torch`` one of another tensor /
    pipeline / expert layout: megatron-core 0.19.2 keeps one
    file per (TP, PP, EP) rank of that layout and does not reshard it; it looked for this run's
    rank files, printed "could not load the checkpoint" and exited 0 on every rank, having
    trained nothing (EP1 -> EP2, measured). Its distributed (``torch_dist``) checkpoint does
    reshard: the line says how to get one. ``load_arg``: the folder's flag (:func:`loaded_arg`)."""
    if saved is None or checkpoint_format(path) != "torch":
        return None
    from megatron_latentmoe.training.arguments import flag_for_field

    differ = [
        f"{flag_for_field(f)} {getattr(saved, f)} (this run: {getattr(args, f)})"
        for f in LAYOUT_FIELDS[:4]
        if getattr(saved, f, None) not in (None, getattr(args, f, None))
    ]
    if not differ:
        return None
    flag = f"{load_flag(load_arg)} {getattr(args, load_arg)}"
    return (
        f"{flag}: {path} is a legacy torch checkpoint of another parallel layout: "
        f"{', '.join(differ)}; megatron-core 0.19.2 loads one only in the layout "
        "it was saved with. Resume once in that layout with --ckpt-format torch_dist "
        "--auto-detect-ckpt-format (it then saves a torch_dist checkpoint, which loads into "
        "another layout), or pass that layout"
    )


# --------------------------------------------------------------------------- a layout change
def layout_changed(args, saved) -> bool:
    """The checkpoint (``saved``: its args) was saved with a parallel layout that Megatron does
    not load as it is. A change of the data-parallel size alone it does: the model, the optimizer
    state (plain or distributed) and the RNG state load, and the losses after DP2 -> DP1,
    DP1 -> DP2 (either optimizer) and EP2 x DP4 -> EP2 x DP2 equal the uninterrupted run's to
    fp32 rounding. Not with ``--data-parallel-random-init``: each DP rank has its own RNG state."""
    fields = [
        f
        for f in LAYOUT_FIELDS
        if f != "data_parallel_size" or getattr(args, "data_parallel_random_init", False)
    ]
    return any(getattr(saved, f, None) not in (None, getattr(args, f, None)) for f in fields)


# Both runs need these for megatron-core 0.19.2 to reshard the Adam moments on a layout change.
RESHARDABLE_OPTIM_FLAGS = ("--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable")


def _reshardable_optim(a) -> bool:
    """Megatron saves (and loads) this run's optimizer state in a layout-independent form:
    the distributed optimizer in the ``fully_reshardable`` format."""
    return bool(getattr(a, "use_distributed_optimizer", False)) and bool(
        getattr(a, "dist_ckpt_optim_fully_reshardable", False)
    )


def plan_layout_change(args, saved) -> None:
    """Loading a checkpoint saved with another parallel layout (e.g. EP2 -> TP2+SP, EP2 -> PP2).

    Megatron reshards the weights and QB biases. The Adam moments and the scheduler state are
    loaded too where megatron-core 0.19.2 reshards them: the distributed optimizer in the fully
    reshardable format, at save and now (:data:`RESHARDABLE_OPTIM_FLAGS`). Otherwise (its plain
    optimizer cannot map saved param groups onto another layout: "Could not find parameter
    group with key ...") the moments start over and the LR / weight-decay schedule is stepped to
    the loaded iteration; a warning names the flags that would have kept them.
    """
    from megatron_latentmoe.compat.training import install_layout_change_load

    before = {f: getattr(saved, f, None) for f in LAYOUT_FIELDS}
    now = {f: getattr(args, f, None) for f in LAYOUT_FIELDS}
    keep = _reshardable_optim(saved) and _reshardable_optim(args)

    def on_load(iteration: int, opt_param_scheduler) -> None:
        what = (
            f"checkpoint layout {before} -> this run's {now}: loaded the resharded model, QB bias"
        )
        if keep and not args.no_load_optim:
            print0(f"[{PROG}] {what} and optimizer state at iteration {iteration}")
            return
        if opt_param_scheduler is not None and iteration > 0:
            opt_param_scheduler.step(increment=iteration * args.global_batch_size)
        why = (
            "--no-load-optim"
            if keep
            else (
                "megatron-core 0.19.2 reshards optimizer state only when the checkpoint was saved "
                f"and is loaded with {' '.join(RESHARDABLE_OPTIM_FLAGS)}"
            )
        )
        print0(
            f"[{PROG}] WARNING: {what} at iteration {iteration}; Adam moments start over ({why}); "
            "LR schedule stepped to the loaded iteration."
        )

    install_layout_change_load(args, keep, on_load)
