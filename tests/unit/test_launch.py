"""``megatron_latentmoe.training.launch``: torchrun whose failed run ends in one line (the first
failed rank and its exit code) and that exit code, instead of a traceback."""

import subprocess
import sys

import pytest

from tests.training import REPO, environment

pytestmark = pytest.mark.timeout(120)

RANK_SCRIPT = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
if rank == 1:
    print("rank 1: error: the one line a refusal prints", flush=True)
    if sys.argv[1] == "signal":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(sys.argv[1]))
time.sleep(60)  # rank 0 is stopped by torchrun when rank 1 fails
"""


@pytest.mark.parametrize(
    "how, code, line",
    [
        ("2", 2, "[launch] rank 1 exited with code 2 (its output is above)"),
        ("signal", 137, "[launch] rank 1 was killed by signal 9 (its output is above)"),
        ("0", 0, None),
    ],
)
def test_a_failed_rank_ends_the_launch_in_one_line(tmp_path, how, code, line):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT if how != "0" else "pass\n")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_latentmoe.training.launch", "--standalone"]
        + ["--nproc-per-node", "2", str(script), how],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=environment(),
        timeout=100,
    )
    assert proc.returncode == code, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout and "ChildFailedError" not in proc.stdout
    if line is not None:
        assert proc.stdout.splitlines()[-1] == line, proc.stdout[-3000:]
        assert "rank 1: error: the one line a refusal prints" in proc.stdout
