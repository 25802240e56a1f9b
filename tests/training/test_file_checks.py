"""``training.file_checks`` and the ``megatron_latentmoe.files`` checks it builds on: the folders a
run writes (``--save``, ``--data-cache-path``), checked before any rank starts, and a save that
fills ``--save``'s disk; one line each, naming the folder. (The checkpoint ``--load`` names:
``tests/unit/test_resume_units.py``.)"""

from __future__ import annotations

import os

import pytest

from megatron_latentmoe.checkpoint_layout import TRACKER_FILE, iteration_dir_name

from . import dcp_checkpoint, mounted_tmpfs


def test_a_folder_a_run_cannot_write_is_refused(tmp_path):
    """megatron-core failed on these at its first write (the checkpoint after the first
    --save-interval iterations; the dataset index cache) with a NotADirectoryError traceback."""
    from megatron_latentmoe.files import folder_refusal

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert folder_refusal("--save", None) is None
    assert folder_refusal("--save", str(tmp_path / "new" / "deeper")) is None  # created later
    assert folder_refusal("--save", str(a_file / "save")) == (
        f"--save {a_file / 'save'}: {a_file} is not a folder; give a folder this run can create "
        "or write in"
    )
    assert folder_refusal("--data-cache-path", str(a_file)) == (
        f"--data-cache-path {a_file}: {a_file} is not a folder; give a folder this run can "
        "create or write in"
    )
    too_long = str(tmp_path / ("x" * 300) / "save")  # was Path.exists's OSError traceback
    assert folder_refusal("--save", too_long) == (
        f"--save {too_long}: the file system refuses the name (File name too long); give a "
        "folder this run can create or write in"
    )


def test_a_read_only_file_system_is_refused_before_the_run(tmp_path):
    """Named as a read-only file system (before: "is not writable", which as root reads as a
    permission problem that root does not have). A real read-only tmpfs mount."""
    from megatron_latentmoe.files import folder_refusal

    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        assert folder_refusal("--save", str(ro / "ckpt")) == (
            f"--save {ro / 'ckpt'}: {ro} is on a read-only file system; give a folder this run "
            "can create or write in"
        )
    assert folder_refusal("--save", str(tmp_path / "ro" / "ckpt")) is None  # unmounted: writable


def test_a_full_disk_is_told_and_the_unfinished_save_removed(tmp_path):
    """The line a save that ran out of space ends with (rank 0; the end-to-end run on a real
    full tmpfs is tests/training/test_disk_full.py): the unfinished folder is removed, the
    one a resume loads is named; a complete folder the tracker does not name yet is kept."""
    import errno

    from megatron_latentmoe.training.file_checks import disk_failure, disk_failure_error

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    other = OSError(errno.EIO, os.strerror(errno.EIO))
    assert disk_failure(full, str(tmp_path)) == errno.ENOSPC
    assert disk_failure(other, str(tmp_path)) is None
    from torch.distributed.checkpoint import CheckpointException

    chained = RuntimeError("Worker failure")
    chained.__context__ = full
    assert disk_failure(chained, str(tmp_path)) == errno.ENOSPC
    failed = CheckpointException("write", {1: (chained, None)})
    assert disk_failure(failed, str(tmp_path)) == errno.ENOSPC
    assert disk_failure(CheckpointException("write", {1: (other, None)}), str(tmp_path)) is None

    dcp_checkpoint(tmp_path, 1)
    unfinished = tmp_path / iteration_dir_name(2)
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"cut")
    line = disk_failure_error(str(tmp_path), 2, "torch_dist", errno.ENOSPC)
    assert not unfinished.exists()
    assert line.startswith(
        f"--save {tmp_path}: the disk filled up while saving the checkpoint of iteration 2 ("
    ), line
    assert " free of " in line and f", the unfinished {unfinished} removed); " in line, line
    assert line.endswith(
        f"a resume (--load {tmp_path}) loads iteration 1 ({tmp_path / 'iter_0000001'}, 0.0 MB). "
        "Free space there or give --save a folder on a larger disk"
    ), line

    # saved, but the tracker not written: a resume loads it (the tracker is repaired), kept
    dcp_checkpoint(tmp_path, 3)
    (tmp_path / TRACKER_FILE).write_text("")
    line = disk_failure_error(str(tmp_path), 3, "torch_dist", errno.ENOSPC)
    assert (tmp_path / "iter_0000003").is_dir() and "removed" not in line
    assert f"a resume (--load {tmp_path}) loads iteration 3 " in line, line

    # nothing complete: from scratch
    empty = tmp_path / "empty"
    (empty / "iter_0000005").mkdir(parents=True)
    line = disk_failure_error(str(empty), 5, "torch_dist", errno.ENOSPC)
    assert not (empty / "iter_0000005").exists()
    assert "there is no complete checkpoint there: a resume starts from scratch." in line, line


def test_a_disk_turned_read_only_under_a_save_is_told_and_the_unfinished_save_left(tmp_path):
    """The line a save that got EROFS ends with (rank 0; the end-to-end runs on a real ext4 the
    kernel turns read-only are tests/training/test_disk_full.py): the error's EROFS, or the
    disk's when the error lost it (megatron-core's DCP writer keeps only ``<class 'OSError'>``);
    the unfinished folder is left (nothing can be removed there), the one a resume loads named."""
    import errno

    from torch.distributed.checkpoint import CheckpointException

    from megatron_latentmoe.training.file_checks import disk_failure, disk_failure_error

    erofs = OSError(errno.EROFS, os.strerror(errno.EROFS))
    assert disk_failure(CheckpointException("write", {0: (erofs, None)}), str(tmp_path)) == (
        errno.EROFS
    )
    lost = RuntimeError("Worker failure: An error is caught while starting worker 0, error: ...")
    assert disk_failure(lost, str(tmp_path)) is None  # a writable disk: not the disk's failure
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing

    dcp_checkpoint(tmp_path, 1)
    unfinished = tmp_path / iteration_dir_name(2)
    unfinished.mkdir()
    line = disk_failure_error(str(tmp_path), 2, "torch_dist", errno.EROFS)
    assert unfinished.is_dir()
    assert line == (
        f"--save {tmp_path}: the file system turned read-only while saving the checkpoint of "
        f"iteration 2 (the unfinished {unfinished} is left there: it cannot be removed); a "
        f"resume (--load {tmp_path}) loads iteration 1 ({tmp_path / 'iter_0000001'}, 0.0 MB); "
        "once the disk is checked (the kernel log says why), remount it read-write or give "
        "--save a folder on another disk"
    )


def test_a_full_disk_outside_a_save_is_one_line_naming_the_file_and_its_flag(tmp_path, monkeypatch):
    """``write_disk_failure_error``: an ENOSPC a run's write ran into (the balance JSONL,
    TensorBoard, Megatron's dataset cache) names the file (or, where the error names none, the
    run's folder whose disk is full), what is free there and the flag that moves it; anything
    else: None."""
    import errno
    import shutil
    from types import SimpleNamespace

    from megatron_latentmoe.files import write_disk_failure_error
    from megatron_latentmoe.training import file_checks

    runs = tmp_path / "runs"
    runs.mkdir()
    args = SimpleNamespace(
        save=str(tmp_path / "ckpt"),
        tensorboard_dir=str(runs / "tb"),
        data_cache_path=None,
        data_path=["0.5", str(tmp_path / "data" / "a"), "0.5", "/b"],
    )
    folders = file_checks.written_folders(args, str(tmp_path / "ckpt" / "balance.jsonl"))
    assert folders == [
        ("--balance-log-file", str(tmp_path / "ckpt")),
        ("--tensorboard-dir", str(runs / "tb")),
        ("--data-cache-path", str(tmp_path / "data" / "a" / "cache")),
        ("--data-cache-path", "/b/cache"),
        ("--save", str(tmp_path / "ckpt")),
    ]
    free = f"{shutil.disk_usage(tmp_path).free / 1e6:.1f} MB"

    def enospc(filename=None):
        return OSError(errno.ENOSPC, "No space left on device", filename)

    jsonl = str(tmp_path / "ckpt" / "balance.jsonl")
    assert write_disk_failure_error(enospc(jsonl), folders) == (
        f"the disk filled up writing {jsonl} ({free} free); free space there or give "
        "--balance-log-file a file on a larger disk"
    )
    npy = str(tmp_path / "data" / "a" / "cache" / "GPTDataset_indices" / "x-document_index.npy")
    wrapped = RuntimeError("dataset build failed")
    wrapped.__cause__ = enospc(npy)
    assert write_disk_failure_error(wrapped, folders) == (
        f"the disk filled up writing {npy} ({free} free); free space there or give "
        "--data-cache-path a folder on a larger disk"
    )
    assert write_disk_failure_error(enospc("/elsewhere/f"), folders).endswith("; free space there")
    sibling = str(tmp_path / "ckpt-old" / "f")  # next to --save's folder, not in it
    assert write_disk_failure_error(enospc(sibling), folders).endswith("; free space there")
    copy = OSError(errno.ENOSPC, "No space left on device", "/src/f", None, jsonl)
    assert write_disk_failure_error(copy, folders).startswith(f"the disk filled up writing {jsonl}")
    nested = [("--tensorboard-dir", str(runs)), ("--data-cache-path", str(runs / "cache"))]
    assert write_disk_failure_error(enospc(str(runs / "cache" / "x.npy")), nested).endswith(
        "give --data-cache-path a folder on a larger disk"  # the innermost folder's flag
    )
    loop = RuntimeError("outer")
    loop.__cause__ = RuntimeError("inner")
    loop.__cause__.__context__ = loop  # a chain that comes back on itself: no RecursionError
    assert write_disk_failure_error(loop, folders) is None
    # TensorBoard's writer thread: no file name; the folder on a full disk is named
    real = shutil.disk_usage

    def usage(path):
        full = str(path).startswith(str(runs))
        return real(path)._replace(free=0) if full else real(path)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    assert write_disk_failure_error(enospc(), folders) == (
        f"the disk filled up writing in --tensorboard-dir {runs / 'tb'} (0.0 MB free); free "
        "space there or give --tensorboard-dir a folder on a larger disk"
    )
    assert write_disk_failure_error(enospc(), folders[2:]) == (
        "the disk filled up writing a file of the run (the error names none); free space on "
        "the disks the run writes to"
    )
    assert write_disk_failure_error(OSError(errno.EACCES, "denied", jsonl), folders) is None
    assert write_disk_failure_error(ValueError("x"), folders) is None


def test_a_file_system_turned_read_only_is_one_line_naming_the_file_or_its_flag(
    tmp_path, monkeypatch
):
    """EROFS out of a write (ext4 ``errors=remount-ro`` after a disk error: a traceback before;
    the real one under tools/preprocess_data.py: tests/unit/test_data.py): the file the error
    names, with the flag that moves it, or the caller's folder it knows was ``written``;
    ``statvfs`` cannot tell which folder (ext4's ``emergency_ro`` keeps ``ST_RDONLY`` off), so
    a nameless one of a run is no folder's. A full disk wins where the error holds both."""
    import errno
    import shutil

    from megatron_latentmoe.files import write_disk_failure_error

    jsonl = str(tmp_path / "ckpt" / "balance.jsonl")
    folders = [("--balance-log-file", str(tmp_path / "ckpt")), ("--save", str(tmp_path))]

    def erofs(filename=None):
        return OSError(errno.EROFS, "Read-only file system", filename)

    wrapped = RuntimeError("event file flush failed")
    wrapped.__context__ = erofs(jsonl)
    assert write_disk_failure_error(wrapped, folders) == (
        f"the file system turned read-only writing {jsonl}; once the disk is checked (the kernel "
        "log says why), remount it read-write or give --balance-log-file a file on another disk"
    )
    assert write_disk_failure_error(erofs(), folders[1:], written=True) == (
        f"the file system turned read-only writing in --save {tmp_path}; once the disk is "
        "checked (the kernel log says why), remount it read-write or give --save a folder on "
        "another disk"
    )
    nameless = (
        "the file system turned read-only writing a file of the run (the error names none); "
        "once the disk is checked (the kernel log says why), remount it read-write"
    )
    assert write_disk_failure_error(erofs(), folders) == nameless
    full = shutil.disk_usage(tmp_path)._replace(free=0)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: full)
    assert write_disk_failure_error(erofs(), folders) == nameless  # a full disk is no clue
    both = erofs(jsonl)
    both.__context__ = OSError(errno.ENOSPC, "No space left on device", jsonl)
    assert write_disk_failure_error(both, folders).startswith(f"the disk filled up writing {jsonl}")


def test_a_full_disk_whose_error_lost_the_enospc_is_told_by_the_disk(tmp_path):
    """megatron-core's DCP writer keeps only the error's type: a save's error without ENOSPC on
    a disk with no block left (``statvfs``'s ``f_bavail``; a real full tmpfs) is a full disk."""
    import errno

    from megatron_latentmoe.training.file_checks import disk_failure

    lost = RuntimeError("Worker failure: An error is caught while starting worker 0, error: ...")
    with mounted_tmpfs(tmp_path / "full", "size=64k") as full:
        with pytest.raises(OSError) as filled, open(full / "fill", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        assert filled.value.errno == errno.ENOSPC and os.statvfs(full).f_bavail == 0
        assert disk_failure(lost, str(full)) == errno.ENOSPC


def test_the_ranks_agree_on_a_save_disk_failure_a_full_disk_first(tmp_path, monkeypatch):
    """A ``CheckpointException`` reaches every rank: they agree (one MAX all-reduce) and a full
    disk wins over a read-only one seen elsewhere; rank 0 says it, every rank waits in the
    barrier. Another error is this rank's alone: a rank other than 0 leaves it (re-raised)."""
    import errno
    from types import SimpleNamespace

    import torch
    from torch.distributed.checkpoint import CheckpointException

    from megatron_latentmoe.training import file_checks

    lines, calls = [], []
    monkeypatch.setattr(file_checks, "error", lines.append)
    monkeypatch.setattr(file_checks, "disk_failure", lambda err, save: errno.EROFS)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    # this rank saw a read-only disk, another rank a full one
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda flags, op: flags.fill_(1))
    monkeypatch.setattr(torch.distributed, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setenv("RANK", "0")
    args = SimpleNamespace(save=str(tmp_path), ckpt_format="torch_dist")
    with pytest.raises(file_checks.SaveDiskFailure):
        file_checks.stop_if_save_disk_failed(args, CheckpointException("write", {}), 2)
    assert len(lines) == 1 and calls == ["barrier"]
    assert lines[0].startswith(
        f"--save {tmp_path}: the disk filled up while saving the checkpoint of iteration 2 ("
    ), lines

    monkeypatch.setenv("RANK", "1")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert file_checks.stop_if_save_disk_failed(args, full, 2) is None
    assert len(lines) == 1 and calls == ["barrier"]


def test_a_checkpoint_of_bf16_weights_counts_adams_fp32_main_weights():
    """:func:`checkpoint_bytes` with Adam: fp32 weights save two fp32 moments per trained
    weight (in their ``--exp-avg(-sq)-dtype``); bf16 weights also fp32 main weights (three);
    ``--no-save-optim`` the weights alone."""
    import torch

    from megatron_latentmoe.convert import ModelArch
    from megatron_latentmoe.training.file_checks import checkpoint_bytes
    from tests.convert._workers import TEST_ARCH

    args = ModelArch(**TEST_ARCH).megatron_args_namespace()
    args.optimizer = "adam"
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):
        for no_save_optim in (False, True):
            args.params_dtype, args.no_save_optim = dtype, no_save_optim
            sizes[dtype, no_save_optim] = checkpoint_bytes(args)
    trained = (sizes[torch.float32, True] - sizes[torch.bfloat16, True]) // 2  # 4 - 2 bytes each
    assert trained > 0
    assert sizes[torch.float32, False] - sizes[torch.float32, True] == 8 * trained
    assert sizes[torch.bfloat16, False] - sizes[torch.bfloat16, True] == 12 * trained
    # --exp-avg-dtype / --exp-avg-sq-dtype bf16: the moments in 2 bytes each
    args.params_dtype, args.no_save_optim = torch.float32, False
    args.exp_avg_dtype = args.exp_avg_sq_dtype = torch.bfloat16
    assert checkpoint_bytes(args) - sizes[torch.float32, True] == 4 * trained
