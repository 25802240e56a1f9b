"""The folders a run writes in: this module's one job (what ``--load`` resumes from is
:mod:`.resume`'s; the checks every writer of the package shares, a run's included, are
:mod:`megatron_latentmoe.files`').

``--save`` and ``--data-cache-path`` (``files.folder_refusal``): megatron-core 0.19.2 fails on a
folder it cannot create or write only when it first writes there (the first checkpoint, after
the iterations before it; the dataset index cache), with a traceback. Checked before any rank
starts; so is ``--save``'s free space (:func:`save_space_warning`, a warning).

``--save`` filling its disk during a save (:func:`disk_failure`, :func:`disk_failure_error`): a
torch DCP ``CheckpointException`` traceback on every rank and the unfinished ``iter_*`` folder
left behind; Megatron's save calls :func:`stop_if_save_disk_failed`, which makes it one line
(a check made after the start). So is a disk the kernel turns read-only (EROFS: ext4's
``errors=remount-ro`` after a disk error) during a save (that traceback on every rank) or between
saves (rank 0's creation of the ``iter_*`` folder failed: a line naming neither the save nor the
checkpoint a resume loads). A disk that fills up under another write of the run (the balance JSONL,
TensorBoard's event files, Megatron's dataset index cache) was a traceback on the rank that
wrote; ``pretrain._main`` makes it one line per such rank (``files.write_disk_failure_error`` of
:func:`written_folders`).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from megatron_latentmoe.checkpoint_layout import iteration_dir_name, tracked_checkpoint_dir
from megatron_latentmoe.files import REMOUNT, megabytes, nearest_existing, os_error
from megatron_latentmoe.training.checkpoint_repair import repair_checkpoint_tracker
from megatron_latentmoe.training.console import error, rank


def checkpoint_bytes(args) -> int | None:
    """A lower bound of the bytes one checkpoint of this run takes: its tensors' bytes (the
    model's, from the converter's tensor list ``convert.names.iter_tensor_maps``, in
    ``--params-dtype``, the QB biases in fp32; Adam's two moments and, for bf16/fp16 weights, the
    fp32 main weights, unless ``--no-save-optim``). Not counted: the files' per-tensor overhead,
    torch DCP's ``.metadata``, the RNG and scheduler state: the tiny model's checkpoints are
    3.9 % (fp32), 4.3 % (--bf16) and 5.5 % (--no-save-optim) larger (measured: 22.02, 25.78
    and 7.45 MB). None for a model the converter does not describe (e.g. ``--qk-layernorm``:
    Megatron trains it, the HF model has no such tensors)."""
    import torch

    from megatron_latentmoe.convert.arch import ModelArch
    from megatron_latentmoe.convert.errors import ConversionError
    from megatron_latentmoe.convert.names import iter_tensor_maps

    try:
        arch = ModelArch.from_megatron_args(args, source="this run's flags")
    except ConversionError:
        return None
    params_dtype = getattr(args, "params_dtype", torch.float32)
    weights = [t for t in iter_tensor_maps(arch) if not t.zeros]
    trained = sum(t.numel() for t in weights if not t.fp32)
    total = 4 * sum(t.numel() for t in weights if t.fp32) + trained * params_dtype.itemsize
    if not getattr(args, "no_save_optim", False) and getattr(args, "optimizer", "") == "adam":
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            total += trained * getattr(args, name, torch.float32).itemsize
        if params_dtype != torch.float32:
            total += trained * getattr(args, "main_params_dtype", torch.float32).itemsize
    return total


def save_space_warning(args) -> str | None:
    """One line when the free space under ``--save`` is less than one checkpoint of this run
    (:func:`checkpoint_bytes`): the first save would fill the disk, after the iterations before
    it. A warning, not a refusal: space may be freed meanwhile, and the size is a lower bound."""
    if not args.save:
        return None
    need = checkpoint_bytes(args)
    free = shutil.disk_usage(nearest_existing(args.save)).free
    if need is None or free >= need:
        return None
    return (
        f"--save {args.save}: {megabytes(free)} free there, less than one checkpoint of this "
        f"run (at least {megabytes(need)}: its weights and optimizer state): the first save "
        "will likely fill the disk"
    )


def disk_failure(err: BaseException, save_dir: str) -> int | None:
    """Why a failed checkpoint save (``err``) failed for ``save_dir``'s disk: ``errno.ENOSPC``,
    it ran out of space (an ENOSPC in the error, or no block left there for this process:
    ``statvfs``'s ``f_bavail``); ``errno.EROFS``, the kernel turned its file system read-only
    (an EROFS in the error, or a file created there gets one); None: another failure. A full
    disk wins where both are seen.

    The disk is asked, not only the error: megatron-core 0.19.2's DCP writer logs a worker's
    error and keeps only its type (``RuntimeError: Worker failure: An error is caught while
    starting worker 0, error: <class 'OSError'>``), the rank that got torch's zip writer's error
    instead (``unexpected pos 704 vs 598``) holds no ENOSPC at all, and ranks other than the
    coordinator get ``CheckpointException`` with no failures (measured on a full tmpfs and an
    ext4 turned read-only). ``statvfs`` cannot see a read-only turn (ext4's ``emergency_ro``
    keeps ``ST_RDONLY`` off, ``os.access`` allows writing: measured), a new file can: an
    unnamed one (``O_TMPFILE``), nothing left behind."""
    if os_error(err, errno.ENOSPC) is not None:
        return errno.ENOSPC
    try:
        if os.statvfs(save_dir).f_bavail == 0:
            return errno.ENOSPC
    except OSError:
        pass
    if os_error(err, errno.EROFS) is not None:
        return errno.EROFS
    try:
        tempfile.TemporaryFile(dir=save_dir).close()
    except OSError as probe:
        return errno.EROFS if probe.errno == errno.EROFS else None
    return None


def _tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def disk_failure_error(save_dir: str, iteration: int, ckpt_format: str, code: int) -> str:
    """The one line for a save of ``iteration`` into ``save_dir`` that failed for its disk
    (``code``: :func:`disk_failure`'s), naming the checkpoint a resume loads.

    A full disk: the unfinished ``iter_*`` folder is removed first (rank 0 only; every rank's
    writes have ended: Megatron's DCP save reports a failure only after a barrier and the gather
    of every rank's write results, and the files only rank 0 writes, ``metadata.json`` and the
    tracker, come after that, while the other ranks wait in a barrier). The folder is kept where
    a resume would load it (the tracker names it, or it is complete: a tracker cut by the full
    disk is repaired at the resume). A disk turned read-only: nothing can be removed there (a
    removal gets EROFS too), so the line says the unfinished folder is left."""
    root = Path(save_dir)
    unfinished = root / iteration_dir_name(iteration)
    resume = repair_checkpoint_tracker(save_dir, ckpt_format, write=False)
    try:
        named = tracked_checkpoint_dir(root)
    except ValueError:  # a tracker the full disk cut: names nothing
        named = None
    left = unfinished.is_dir() and resume != iteration and named != unfinished
    if resume is None:
        then = "there is no complete checkpoint there: a resume starts from scratch"
    else:
        last = root / iteration_dir_name(resume)
        then = (
            f"a resume (--load {save_dir}) loads iteration {resume} ({last}, "
            f"{megabytes(_tree_size(last))})"
        )
    if code == errno.EROFS:
        kept = f" (the unfinished {unfinished} is left there: it cannot be removed)" if left else ""
        return (
            f"--save {save_dir}: the file system turned read-only while saving the checkpoint of "
            f"iteration {iteration}{kept}; {then}; {REMOUNT} or give --save a folder "
            "on another disk"
        )
    removed = ""
    if left:
        shutil.rmtree(unfinished, ignore_errors=True)
        removed = f", the unfinished {unfinished} removed"
    usage = shutil.disk_usage(save_dir)
    return (
        f"--save {save_dir}: the disk filled up while saving the checkpoint of iteration "
        f"{iteration} ({megabytes(usage.free)} free of {megabytes(usage.total)}{removed}); "
        f"{then}. Free space there or give --save a folder on a larger disk"
    )


class SaveDiskFailure(Exception):
    """A checkpoint save failed for its disk (full, or turned read-only); rank 0 has said so."""


def stop_if_save_disk_failed(args, err: BaseException, iteration: int) -> None:
    """Megatron's save of ``iteration`` failed with ``err``: where ``--save``'s disk is full or
    turned read-only (:func:`disk_failure`), end the run (exit 2) with one line instead of every
    rank's traceback; otherwise return (``err`` is re-raised).

    torch DCP's ``CheckpointException`` reaches every rank at once (its failure is broadcast):
    the ranks agree first (one all-reduce of :func:`disk_failure`, before anything is
    removed: the free space it reads is what rank 0's removal changes; measured, rank 1 then saw
    room and raised its traceback), rank 0 removes the unfinished folder and prints the line
    (:func:`disk_failure_error`), and a barrier keeps the others from exiting first
    (torchrun would SIGTERM rank 0 midway). Any other error is this rank's alone (rank 0's
    creation of the ``iter_*`` folder, the first write of a save: EROFS on a disk that turned
    read-only between saves, measured; its ``metadata.json`` or tracker; the others in
    Megatron's DCP save or barrier, where a collective of ours would mismatch): rank 0 says it
    without one and exits; torchrun ends the others."""
    import torch
    from torch.distributed.checkpoint import CheckpointException

    code = disk_failure(err, args.save)
    every_rank = isinstance(err, CheckpointException) and torch.distributed.is_initialized()
    if every_rank:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        seen = [int(code == errno.ENOSPC), int(code == errno.EROFS)]
        flags = torch.tensor(seen, device=device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        full, read_only = flags.tolist()
        code = errno.ENOSPC if full else errno.EROFS if read_only else None
    if code is None or not (every_rank or rank() == 0):
        return
    if rank() == 0:
        line = disk_failure_error(args.save, iteration, args.ckpt_format, code)
        error(line)
    if every_rank:
        torch.distributed.barrier()
    raise SaveDiskFailure from None


def written_folders(args, jsonl_path: str | None) -> list[tuple[str, str]]:
    """``(flag, folder)`` of what a run writes besides its checkpoints' saves: the balance JSONL
    (``jsonl_path``, ``--balance-log-file`` resolved; listed before ``--save``, its default
    folder), TensorBoard's event files, Megatron's dataset index cache (the ``.npy``
    files it writes when it builds the datasets: ``--data-cache-path``, else megatron-core
    0.19.2's ``<prefix>/cache`` of each ``--data-path`` prefix), and ``--save``."""
    pairs = (
        [("--balance-log-file", os.path.dirname(os.path.abspath(jsonl_path)))] if jsonl_path else []
    )
    pairs.append(("--tensorboard-dir", getattr(args, "tensorboard_dir", None)))
    cache = getattr(args, "data_cache_path", None)
    if cache:
        pairs.append(("--data-cache-path", cache))
    else:
        from megatron_latentmoe.training.data_args import data_prefixes

        prefixes = data_prefixes(getattr(args, "data_path", None))
        pairs += [("--data-cache-path", os.path.join(p, "cache")) for p in prefixes]
    pairs.append(("--save", getattr(args, "save", None)))
    return [(flag, os.path.abspath(folder)) for flag, folder in pairs if folder]
