"""A 2-rank run (torchrun, gloo on CPU) where ONE rank stops: its own one-line error and exit 2,
or SIGKILL (the OOM killer). The other rank, waiting on it in a collective, printed a long gloo
traceback (``RuntimeError: [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer``, or
``Read error ...: Connection reset by peer`` after a kill); now it ends with one line naming
itself, what gloo saw and where the cause is (``console.peer_stopped_error``), exit 1. The
launcher's last line names the rank that stopped first; plain torchrun's table shows its one line
(the error file, ``console.error``)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from . import (
    LAUNCH,
    command,
    error_lines,
    iter_dir,
    kill_during_save,
    kill_tree,
    run_entry,
    start_launcher,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PEER_LINE = (
    r"pretrain_stable_latentmoe: error: rank {rank}: another rank of this run stopped \(gloo: "
    r"(Connection closed by peer|Read error) \[127\.0\.0\.1\]:\d+(: Connection reset by peer)?\); "
    r"its own error is above, or the launcher's summary names it if it was killed"
)


def test_a_rank_that_stops_with_its_error_costs_the_other_one_line():
    # /dev/full: every write fails with ENOSPC; the balance JSONL is the last rank's (rank 1)
    run = run_entry(["--train-iters", "3", "--balance-log-file", "/dev/full"], launcher=LAUNCH)
    assert "Traceback" not in run.output, run.output[-6000:]
    errors = error_lines(run.output)
    assert len(errors) == 2, run.output[-6000:]
    assert errors[0].startswith(
        "pretrain_stable_latentmoe: error: the disk filled up writing /dev/full ("
    ), errors
    assert re.fullmatch(PEER_LINE.format(rank=0), errors[1]), errors[1]
    assert run.output.splitlines()[-1] == "[launch] rank 1 exited with code 2 (its output is above)"
    assert run.returncode == 2


def test_plain_torchrun_shows_the_failed_ranks_one_line_as_the_root_cause():
    """Plain torchrun, the same run: its table showed ``error_file: <N/A>`` and "To enable
    traceback see ..." for rank 1; now its one line (torchrun's error file for it)."""
    run = run_entry(["--train-iters", "3", "--balance-log-file", "/dev/full"])
    root = run.output[run.output.index("Root Cause (first observed failure):") :]
    assert "  rank      : 1 (local_rank: 1)" in root, run.output[-6000:]
    assert (
        "  traceback : pretrain_stable_latentmoe: error: the disk filled up writing /dev/full ("
    ) in root, run.output[-6000:]
    assert run.returncode == 1  # torchrun's


def kill_one_rank(extra: list[str], victim: int, should_kill, monitor_s: float = 0.1):
    """Run ``extra`` under :data:`LAUNCH` and SIGKILL rank ``victim`` alone (its forked helpers
    too) at the first output line ``should_kill(line)`` accepts; returns the output lines and the
    launcher's exit code.

    ``monitor_s``: torchrun's ``--monitor-interval`` (0.1 s, its default): how long after a rank
    dies torchrun SIGTERMs the others, which then die silently. A rank busy writing a checkpoint
    sees the kill later than that (measured: its line ~2 s after the kill, 2 busy cores; none at
    all under the default)."""
    cmd = command(extra, launcher=LAUNCH)
    at = cmd.index(LAUNCH) + 1
    cmd[at:at] = ["--monitor-interval", str(monitor_s)]
    proc = start_launcher(cmd)
    lines, killed, start = [], False, time.time()
    try:
        for line in proc.stdout:
            lines.append(line)
            if not killed and should_kill(line):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        if child.environ().get("RANK") == str(victim):
                            child.send_signal(signal.SIGKILL)
                            killed = True
                    except psutil.NoSuchProcess:  # a short-lived helper process
                        pass
            if time.time() - start > 240:
                break
    finally:
        try:  # its output ends a moment before it does
            proc.wait(60)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
        proc.stdout.close()
    assert killed, "".join(lines)[-6000:]
    return lines, proc.returncode


def test_a_rank_killed_costs_the_other_one_line():
    """Rank 0 SIGKILLed in the third iteration (rank 1 has just logged the second): rank 1, in
    the step's collectives with it, says so in one line; the launcher names the killed rank."""
    lines, returncode = kill_one_rank(
        ["--train-iters", "30"], 0, lambda line: " iteration        2/" in line
    )
    output = "".join(lines)
    assert "Traceback" not in output, output[-6000:]
    errors = error_lines(output)
    assert len(errors) == 1 and re.fullmatch(PEER_LINE.format(rank=1), errors[0]), output[-6000:]
    assert lines[-1] == "[launch] rank 0 was killed by signal 9 (its output is above)\n"
    assert returncode == 128 + 9


def test_a_rank_killed_during_a_torch_dist_save_costs_the_other_one_line(tmp_path):
    """Rank 1 SIGKILLed while the checkpoint of iteration 3 is written (its shard files have
    appeared): rank 0, the save's coordinator, fails in the save's next collective with it.
    torch DCP wraps a rank's errors into ``CheckpointException`` (a ``BaseException``) only in
    its local and central steps; gloo's error from the collectives between them reaches the entry
    point bare, and ``stop_if_save_disk_failed`` (Megatron's save calls it) finds no failed disk in
    it and passes it on: one line, no traceback, the unfinished folder left for the resume's
    repair."""
    ckpt = tmp_path / "ckpt"
    save = ["--train-iters", "6", "--save", str(ckpt), "--save-interval", "3"]
    lines, _ = kill_one_rank(save, 1, kill_during_save(ckpt, 3), monitor_s=20)
    output = "".join(lines)
    assert not (iter_dir(ckpt, 3) / "metadata.json").exists(), "the save finished before the kill"
    assert "Traceback" not in output, output[-6000:]
    errors = error_lines(output)
    assert len(errors) == 1 and re.fullmatch(PEER_LINE.format(rank=0), errors[0]), output[-6000:]


def test_kill_tree_leaves_the_real_exit_code_to_popen():
    """The tests' kill (``run_and_kill``, the kill above, a timed-out ``run_entry``): the killed
    process's Popen reads -9 (SIGKILL), not the 0 it read where psutil reaped it first."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '60'])"]
    )
    time.sleep(1)  # its child started
    kill_tree(proc)
    assert proc.wait(5) == -signal.SIGKILL
