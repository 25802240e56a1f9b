"""``--save`` on a disk that fills up during a save: a real tmpfs with room for one checkpoint of
the tiny model (22.0 MB, measured) and not two.

Before, the save of iteration 2 ended every rank with torch DCP's ``CheckpointException``
traceback (``RuntimeError: Worker failure: An error is caught while starting worker 0, error:
<class 'OSError'>``) and left the unfinished ``iter_0000002`` on the full disk. Now rank 0 says so
in one line (exit 2 on every rank), having removed the unfinished folder, and names the
checkpoint a resume loads; the resume loads it and trains on with the same loss. The start-up
estimate of one checkpoint's size (the warning when less is free) is checked against the real one.
"""

from __future__ import annotations

import re
import shutil

import pytest

from megatron_latentmoe.training.file_checks import checkpoint_bytes, save_space_warning
from megatron_latentmoe.training.resume import saved_args

from . import LAUNCH, error_lines, iter_dir, mounted_ext4, mounted_tmpfs, read_jsonl, run_entry

pytestmark = pytest.mark.slow

TMPFS_SIZE = "34m"  # one checkpoint (22.0 MB) fits, a second does not
# file_checks.checkpoint_bytes counts tensor bytes alone: the tiny model's checkpoint is 3.9 % more
ESTIMATE_MARGIN = 0.10


def _full_disk_line(ckpt) -> str:
    """The line (a regex) of a run whose save of iteration 2 filled the tmpfs."""
    return (
        rf"pretrain_stable_latentmoe: error: --save {ckpt}: the disk filled up while saving "
        r"the checkpoint of iteration 2 \(\d+\.\d MB free of \d+\.\d MB, the unfinished "
        rf"{iter_dir(ckpt, 2)} removed\); a resume \(--load {ckpt}\) loads iteration 1 "
        rf"\({iter_dir(ckpt, 1)}, 22\.0 MB\)\. Free space there or give --save a folder on "
        r"a larger disk"
    )


def _check_torchrun_summary(output: str, peer_may_stop: bool = False) -> None:
    """Plain torchrun's table: every rank left with 2, or torchrun ended it (SIGTERM) as it does
    every rank once one has failed; its root cause is a rank that left with 2, or the rank that
    said the line (its error file, stamped first) and that torchrun's SIGTERM ended on its way
    out, another rank having exited first. ``peer_may_stop``: rank 0 alone failed, and another
    rank may see it gone before torchrun's SIGTERM reaches it: its line says so, exit 1."""
    exits = re.findall(r"^\s+exitcode\s+: (\S+)", output, re.M)
    assert set(exits) <= {"2", "-15"} | ({"1"} if peer_may_stop else set()), output[-3000:]
    root = output[output.index("Root Cause (first observed failure):") :]
    said = "  traceback : pretrain_stable_latentmoe: error: " in root
    assert exits[-1] == "2" or said, output[-3000:]


def test_a_full_disk_during_a_save_is_one_line_and_the_resume_loads_the_last_checkpoint(
    tmp_path,
):
    with mounted_tmpfs(tmp_path / "disk", f"size={TMPFS_SIZE}") as disk:
        ckpt, jsonl = disk / "ckpt", tmp_path / "balance.jsonl"
        run = run_entry(
            ["--train-iters", "3", "--save-interval", "1", "--save", str(ckpt)]
            + ["--balance-log-file", str(jsonl)]
        )
        assert "successfully saved checkpoint from iteration       1" in run.output, run.output[
            -3000:
        ]  # the disk held the first checkpoint
        errors = [line for line in error_lines(run.output) if "error: --save" in line]
        assert len(errors) == 1, run.output[-6000:]
        assert re.fullmatch(_full_disk_line(ckpt), errors[0]), errors[0]
        _check_torchrun_summary(run.output)
        assert "[rank0]:" not in run.output and "[rank1]:" not in run.output  # no traceback
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "iter_0000001",
            "latest_checkpointed_iteration.txt",
        ]

        assert "WARNING: --save" not in run.output  # 34 MB free at the start: room for one

        # the start-up estimate of one checkpoint, against the real one: a lower bound, within
        # ESTIMATE_MARGIN; with what is free now, a run would be warned
        saved = saved_args(str(iter_dir(ckpt, 1)))
        estimate = checkpoint_bytes(saved)
        real = sum(f.stat().st_size for f in iter_dir(ckpt, 1).iterdir())
        assert estimate <= real <= estimate * (1 + ESTIMATE_MARGIN), (estimate, real)
        free = shutil.disk_usage(ckpt).free
        assert save_space_warning(saved) == (
            f"--save {ckpt}: {free / 1e6:.1f} MB free there, less than one checkpoint of this "
            f"run (at least {estimate / 1e6:.1f} MB: its weights and optimizer state): the first "
            "save will likely fill the disk"
        )

        # a model the converter does not describe (Megatron trains it): no estimate, no warning
        saved.qk_layernorm = True
        assert checkpoint_bytes(saved) is None and save_space_warning(saved) is None

        # the resume, into the same full disk: warned at the start, loads iteration 1, trains
        # iteration 2 as the first run did, and its save (--exit-interval) fills the disk again
        resumed_jsonl = tmp_path / "resumed.jsonl"
        resumed = run_entry(
            ["--train-iters", "3", "--exit-interval", "2", "--save-interval", "1000"]
            + ["--load", str(ckpt), "--save", str(ckpt), "--balance-log-file", str(resumed_jsonl)]
        )
    assert f"[pretrain_stable_latentmoe] WARNING: --save {ckpt}: " in resumed.output
    assert (
        f"error: --save {ckpt}: the disk filled up while saving the checkpoint of iteration 2"
    ) in resumed.output, resumed.output[-3000:]
    assert "successfully loaded checkpoint" in resumed.output
    assert "at iteration 1" in resumed.output
    assert sorted(read_jsonl(resumed_jsonl)) == [2]
    assert read_jsonl(resumed_jsonl)[2]["loss"] == read_jsonl(jsonl)[2]["loss"]


def test_a_full_disk_under_the_balance_jsonl_is_one_line(tmp_path):
    """``--balance-log-file`` on a tmpfs of one page (4 KiB: two of the tiny model's records,
    measured): its write's ``OSError: [Errno 28] No space left on device`` (no file name) was a
    traceback on the logging rank (the last); now that rank says it in one line naming the file
    and the flag, and exits 2. Rank 0, in a collective with it, says that in one line
    (tests/training/test_peer_stop.py), unless torchrun's SIGTERM ends it first."""
    with mounted_tmpfs(tmp_path / "disk", "size=4k") as disk:
        jsonl = disk / "balance.jsonl"
        run = run_entry(["--train-iters", "12", "--balance-log-file", str(jsonl)])
    errors = error_lines(run.output)
    assert errors[0] == (
        f"pretrain_stable_latentmoe: error: the disk filled up writing {jsonl} (0.0 MB free); "
        "free space there or give --balance-log-file a file on a larger disk"
    ), run.output[-6000:]
    assert len(errors) <= 2 and all(": rank 0: another rank of" in e for e in errors[1:]), errors
    assert "[rank0]:" not in run.output and "[rank1]:" not in run.output  # no rank's traceback
    assert "2" in re.findall(r"^\s+exitcode\s+: (\S+)", run.output, re.M), run.output[-3000:]


def test_a_full_disk_under_tensorboard_is_one_line_without_a_thread_traceback(tmp_path):
    """``--tensorboard-dir`` on a tmpfs of one page: the writer's thread failed on its write and
    Python printed that as a thread traceback ("Exception in thread Thread-1: ... OSError"),
    interleaved with the line the training thread gives for the same error when the writer
    raises it there (``compat.tensorboard``); now that line alone, exit 2."""
    with mounted_tmpfs(tmp_path / "disk", "size=4k") as disk:
        run = run_entry(
            ["--train-iters", "3", "--tensorboard-dir", str(disk / "tb")], launcher=LAUNCH
        )
    assert "Traceback" not in run.output and "Exception in thread" not in run.output, run.output[
        -6000:
    ]
    errors = error_lines(run.output)
    assert errors[0] == (
        f"pretrain_stable_latentmoe: error: the disk filled up writing in --tensorboard-dir "
        f"{disk / 'tb'} (0.0 MB free); free space there or give --tensorboard-dir a folder on a "
        "larger disk"
    ), run.output[-6000:]
    assert len(errors) <= 2 and all(": rank 0: another rank of" in e for e in errors[1:]), errors
    assert run.returncode == 2, run.output[-3000:]


@pytest.mark.parametrize("struck", ["between saves", "during a save"])
def test_a_disk_turned_read_only_fails_the_next_save_in_one_line(tmp_path, struck):
    """``--save`` on a real ext4 (``errors=remount-ro``) that the kernel turns read-only after
    the save of iteration 2 (ext4's ``trigger_fs_error``, as after a disk error), so the save of
    iteration 4 fails with EROFS. Between saves: rank 0's creation of ``iter_0000004`` failed,
    and the line said the file system turned read-only writing that folder, not that a save
    failed nor what a resume loads. During a save (the folder made before the error, as after
    rank 0 created it): torch DCP's ``CheckpointException`` traceback on every rank. Now the
    save's own line (the unfinished folder left: a read-only disk cannot remove it), exit 2."""
    jsonl = tmp_path / "balance.jsonl"  # not on the disk: its write would fail first
    with mounted_ext4(tmp_path / "disk", megabytes=64) as turn_read_only:  # two checkpoints fit
        ckpt = tmp_path / "disk" / "ckpt"
        struck_at = []

        def after_the_first_save(line):
            if "successfully saved checkpoint from iteration       2" in line and not struck_at:
                if struck == "during a save":
                    iter_dir(ckpt, 4).mkdir()
                turn_read_only()
                struck_at.append(line)

        run = run_entry(
            ["--train-iters", "6", "--save-interval", "2", "--save", str(ckpt)]
            + ["--balance-log-file", str(jsonl)],
            on_line=after_the_first_save,
        )
        assert struck_at, run.output[-3000:]
        left = sorted(p.name for p in ckpt.iterdir())
    errors = error_lines(run.output)
    kept = f" \\(the unfinished {iter_dir(ckpt, 4)} is left there: it cannot be removed\\)"
    assert re.fullmatch(
        rf"pretrain_stable_latentmoe: error: --save {ckpt}: the file system turned read-only "
        rf"while saving the checkpoint of iteration 4{kept if struck == 'during a save' else ''}; "
        rf"a resume \(--load {ckpt}\) loads iteration 2 \({iter_dir(ckpt, 2)}, 22\.0 MB\); once "
        r"the disk is checked \(the kernel log says why\), remount it read-write or give --save "
        r"a folder on another disk",
        errors[0],
    ), run.output[-6000:]
    # the other rank: nothing, or the line saying another rank stopped (rank 0 alone failed)
    assert len(errors) <= 2 and all(": rank 1: another rank of" in e for e in errors[1:]), errors
    assert "[rank0]:" not in run.output and "[rank1]:" not in run.output  # no traceback
    _check_torchrun_summary(run.output, peer_may_stop=struck == "between saves")
    expected = ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert left == [n for n in expected if struck == "during a save" or n != "iter_0000004"]


def test_async_save_on_a_full_disk_is_the_same_one_line(tmp_path):
    """``--async-save --ckpt-format torch_dist`` on a CPU run (without
    ``--use-persistent-ckpt-worker``: refused without a GPU, ``arguments.py``): megatron-core
    0.19.2's ``validate_args`` turns ``--async-save`` off there ("not supported without
    --use-persistent-ckpt-worker"), so the save is synchronous and its full disk the same line
    as without the flag (measured: no hang, no finalize traceback)."""
    with mounted_tmpfs(tmp_path / "disk", f"size={TMPFS_SIZE}") as disk:
        ckpt = disk / "ckpt"
        run = run_entry(
            ["--train-iters", "3", "--save-interval", "1", "--save", str(ckpt), "--async-save"]
            + ["--ckpt-format", "torch_dist", "--balance-log-file", str(tmp_path / "b.jsonl")]
        )
        left = sorted(p.name for p in ckpt.iterdir())
    assert re.search(r"^\s+async_save \.+ False$", run.output, re.M), run.output[-3000:]
    errors = error_lines(run.output)
    assert len(errors) == 1 and re.fullmatch(_full_disk_line(ckpt), errors[0]), errors
    _check_torchrun_summary(run.output)
    assert "[rank0]:" not in run.output and "[rank1]:" not in run.output  # no traceback
    assert left == ["iter_0000001", "latest_checkpointed_iteration.txt"]
