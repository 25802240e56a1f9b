"""``examples/slurm_multinode.sbatch`` runs end to end on one machine.

Slurm itself is not here, so ``srun`` and ``scontrol`` are stand-ins on PATH: ``srun`` drops its
own options and runs the command it was given once (one node), ``scontrol show hostnames``
prints ``localhost``. Everything else is the script as a cluster runs it: its environment, its
torchrun with the c10d rendezvous on the first node, the args file plus extra flags, the
entry point training 3 iterations on 2 processes (CPU, gloo).
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess

import pytest

from . import PYTHON, REPO, TEST_BATCH, data_cache, environment, scratch_dir

pytestmark = pytest.mark.slow

SRUN = """#!/usr/bin/env bash
touch "$(dirname "$0")/srun_ran"
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
echo localhost
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbatch(
    *flags: str, gpus_per_node: int | str = 2, args_file: str | None = None
) -> tuple[subprocess.CompletedProcess, bool]:
    """Run the script under the stand-ins; returns the process and whether ``srun`` ran."""
    bin_dir = scratch_dir() / "fake_slurm_bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    (bin_dir / "srun_ran").unlink(missing_ok=True)
    env = environment()
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NNODES="1",
        SLURM_JOB_ID="4242",
        GPUS_PER_NODE=str(gpus_per_node),
        PYTHON=PYTHON,
        MASTER_PORT=str(_free_port()),
        REPO=str(REPO),
    )
    proc = subprocess.run(
        [
            "bash",
            str(REPO / "examples" / "slurm_multinode.sbatch"),
            args_file or str(REPO / "examples" / "args" / "tiny.sh"),
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    return proc, (bin_dir / "srun_ran").exists()


def test_sbatch_script_trains_through_its_torchrun_rendezvous():
    proc, srun_ran = _sbatch(
        "--train-iters",
        "3",
        *TEST_BATCH,
        "--data-cache-path",
        data_cache(),
    )
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert srun_ran
    assert "[slurm] 1 nodes x 2 GPUs" in proc.stdout
    assert proc.stdout.count("[balance] iteration") == 3, proc.stdout[-3000:]
    assert "expert_model_parallel_size ...................... 2" in proc.stdout  # tiny.sh's EP2
    # the flag check before srun prints nothing: the argument table and notes come once, from
    # rank 0 (they came twice)
    assert proc.stdout.count("end of arguments") == 1, proc.stdout[-3000:]
    assert proc.stdout.count("tokenizer: the shipped one") == 1, proc.stdout[-3000:]


@pytest.mark.parametrize(
    "flags, gpus_per_node, named",
    [
        (("--hidden-act", "situu"), 2, "--hidden-act"),
        # tiny.sh is EP2: the check counts SLURM_NNODES x GPUS_PER_NODE processes (here 1),
        # not the one process that checks.
        ((), 1, "WORLD_SIZE=1"),
        # checked by the script itself, before any Python starts
        ((), "abc", "GPUS_PER_NODE=abc is not allowed: a positive integer"),
        ((), 0, "GPUS_PER_NODE=0 is not allowed"),
    ],
)
def test_sbatch_script_refuses_bad_flags_once_before_any_rank_starts(flags, gpus_per_node, named):
    proc, srun_ran = _sbatch(*flags, gpus_per_node=gpus_per_node)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert not srun_ran
    errors = [line for line in proc.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1 and named in errors[0], proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout


def test_launchers_refuse_a_bad_process_count_or_args_file_in_one_line(tmp_path):
    """NPROC / GPUS_PER_NODE that is not a positive integer, an args file that is missing or
    defines no ARGS: one line naming it, exit 2, no rank started (it was a Python traceback from
    the flag check's WORLD_SIZE, or bash's 'ARGS: unbound variable')."""
    no_args = tmp_path / "no_args.sh"
    no_args.write_text("FLAGS=(--train-iters 3)\n")
    tiny = str(REPO / "examples" / "args" / "tiny.sh")
    torchrun = str(REPO / "examples" / "run_torchrun.sh")
    cases = [
        ({"NPROC": "abc"}, tiny, "NPROC=abc is not allowed: a positive integer"),
        ({"NPROC": "0"}, tiny, "NPROC=0 is not allowed: a positive integer"),
        ({}, str(no_args), f"ARGS_FILE={no_args} defines no ARGS array"),
        ({}, str(tmp_path / "missing.sh"), "usage:"),
    ]
    for env, args_file, named in cases:
        proc = subprocess.run(
            ["bash", torchrun, args_file],
            capture_output=True,
            text=True,
            env={**environment(), "PYTHON": PYTHON, **env},
            timeout=60,
        )
        assert (proc.returncode, proc.stdout) == (2, ""), (env, proc.stderr)
        assert proc.stderr.count("\n") == 1 and named in proc.stderr, (env, proc.stderr)
    for args_file, named in (
        (str(no_args), f"ARGS_FILE={no_args} defines no ARGS array"),
        (str(tmp_path / "missing.sh"), "usage: sbatch"),
    ):
        proc, srun_ran = _sbatch(args_file=args_file)
        assert (proc.returncode, srun_ran) == (2, False), proc.stdout
        assert proc.stdout.count("\n") == 1 and named in proc.stdout, proc.stdout
