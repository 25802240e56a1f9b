"""A rank whose collective fails because another rank's process went away: gloo's errors for it
recognised (``compat.gloo_peer``), the entry point's one line for it (``console``), and
nothing else taken for one. The messages are torch 2.13's, copied from 2-rank torchrun runs on CPU
(one rank exited with its own error; one was killed by SIGKILL); one is made here by real gloo.
The whole runs are tests/training/test_peer_stop.py's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_latentmoe.compat.gloo_peer import gloo_peer_lost, gloo_startup_peer_lost
from megatron_latentmoe.training import console

PAIR = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:{}]"
CRASHING = (
    "This is typically caused by a remote worker crashing. Check the logs of the remote worker "
    "before reporting an error. GLHF! 🏖️"
)
HANGING = (
    "This is typically caused by a remote worker hanging or bugs in the application. Check the "
    "logs of the remote worker before reporting an error. GLHF! 🏖️"
)


@pytest.mark.parametrize(
    "message, observed",
    [
        (  # the other rank exited (its own one-line error, exit 2)
            f"{PAIR.format(553)} Connection closed by peer [127.0.0.1]:62631. {CRASHING}",
            "Connection closed by peer [127.0.0.1]:62631",
        ),
        (  # the other rank was killed by SIGKILL
            f"{PAIR.format(537)} Read error [127.0.0.1]:25795: Connection reset by peer. {HANGING}",
            "Read error [127.0.0.1]:25795: Connection reset by peer",
        ),
        (  # gloo's write side of the same (strerror of EPIPE)
            f"{PAIR.format(602)} writev [10.0.0.2]:4431: Broken pipe. {HANGING}",
            "writev [10.0.0.2]:4431: Broken pipe",
        ),
    ],
)
def test_gloo_errors_for_a_peer_process_gone_are_recognised(message, observed):
    import torch

    assert gloo_peer_lost(RuntimeError(message)) == observed
    assert gloo_peer_lost(torch.distributed.DistBackendError(message)) == observed


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("Connection closed by peer [127.0.0.1]:29500. (not gloo's pair)"),
        RuntimeError(f"{PAIR.format(400)} Read timeout [127.0.0.1]:6000. {HANGING}"),  # a hang
        RuntimeError(f"{PAIR.format(512)} Socket closed [127.0.0.1]:6000"),
        RuntimeError(f"{PAIR.format(537)} Read error [127.0.0.1]:6000: Bad address. {HANGING}"),
        ValueError(f"{PAIR.format(553)} Connection closed by peer [127.0.0.1]:1. {CRASHING}"),
    ],
)
def test_other_errors_are_not_a_peer_gone(err, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert gloo_peer_lost(err) is None
    assert console.peer_stopped_error(err) is None


def test_the_line_names_this_rank_what_gloo_saw_and_where_the_cause_is(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    err = RuntimeError(f"{PAIR.format(553)} Connection closed by peer [127.0.0.1]:9. {CRASHING}")
    assert console.peer_stopped_error(err) == (
        "rank 3: another rank of this run stopped (gloo: Connection closed by peer "
        "[127.0.0.1]:9); its own error is above, or the launcher's summary names it if it was "
        "killed"
    )


REAL_GLOO = """
import os, sys, torch, torch.distributed as dist
from megatron_latentmoe.compat.gloo_peer import gloo_peer_lost
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
dist.barrier()
if rank == 1:
    os._exit(2)  # as a rank does after its one-line error: no goodbye to the others
try:
    dist.all_reduce(torch.ones(4))
except RuntimeError as err:
    print(gloo_peer_lost(err))
"""


def _two_ranks(script: str, tmp_path) -> tuple[list[subprocess.Popen], list[str]]:
    """``script`` run as ranks 0 and 1 of a gloo world (argv: rank, rendezvous file): the
    processes and their outputs."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), str(tmp_path / "rendezvous")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    return procs, [p.communicate(timeout=120)[0] for p in procs]


def test_a_real_gloo_collective_with_a_peer_gone_is_recognised(tmp_path):
    procs, out = _two_ranks(REAL_GLOO, tmp_path)
    assert procs[1].returncode == 2, out[1]
    # which of the two depends on what was in flight when the socket went (both seen here)
    assert out[0].startswith(("Connection closed by peer [", "Read error [")), out[0]


END_OF_RUN = """
import os, sys, torch.distributed as dist
from megatron_latentmoe.training.pretrain import _end_world
rank = int(sys.argv[1])
os.environ["RANK"] = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
dist.barrier()
if rank == 1:
    os._exit(9)  # killed after training's last collective, before the run's last barrier
print("exit", _end_world())
"""


def test_a_rank_gone_before_the_runs_last_barrier_costs_the_other_one_line(tmp_path):
    """The entry point's last barrier (after ``pretrain``): a rank killed just before it was a
    gloo traceback on the others (measured in a 2-rank torchrun run); now their one line, exit 1."""
    procs, out = _two_ranks(END_OF_RUN, tmp_path)
    assert procs[1].returncode == 9, out[1]
    assert "Traceback" not in out[0], out[0]
    line, code = out[0].strip().splitlines()[-2:]
    assert line.startswith(
        "pretrain_stable_latentmoe: error: rank 0: another rank of this run stopped (gloo: "
    ), out[0]
    assert code == "exit 1", out[0]


@pytest.mark.parametrize(
    "message, observed",
    [
        (  # the peer had published its address and was gone before this rank connected
            "Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport"
            "/tcp/pair.cc:152] timed out connecting: SO_ERROR: Connection refused, "
            "remote=[127.0.0.1]:48031$0",
            "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:48031",
        ),
        (  # gone before publishing it: torchrun's TCPStore waited the group's timeout for it
            "wait timeout after 600000ms, keys: /default_pg/0//3//cpu//0/1",
            "wait timeout after 600000ms",
        ),
        (  # a connection under way reset
            f"{PAIR.format(537)} Read error [127.0.0.1]:25795: Connection reset by peer. {HANGING}",
            "Read error [127.0.0.1]:25795: Connection reset by peer",
        ),
    ],
)
def test_start_up_errors_for_a_peer_process_gone_are_recognised(message, observed):
    import torch

    assert gloo_startup_peer_lost(RuntimeError(message)) == observed
    assert gloo_startup_peer_lost(torch.distributed.DistStoreError(message)) == observed


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError("Gloo connectFullMesh failed with [pair.cc:152] no device: eth9"),
        RuntimeError("Wait timeout"),  # FileStore's: not what torchrun's ranks use
        RuntimeError("initialise the (gloo) default process group first"),
        ValueError("wait timeout after 600000ms, keys: /default_pg/0//3//cpu//0/1"),
    ],
)
def test_other_start_up_errors_are_not_a_peer_gone(err, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert gloo_startup_peer_lost(err) is None
    assert console.startup_peer_error(err) is None


START_UP = """
import os, sys, torch.distributed as dist
from datetime import timedelta
from types import SimpleNamespace
from megatron_latentmoe.training.pretrain import _started_cpu_world
rank = int(sys.argv[1])
os.environ["RANK"] = sys.argv[1]
port = open(sys.argv[2]).read()
dist.init_process_group(
    "gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=2,
    timeout=timedelta(seconds=3),
)
if rank == 1:
    os._exit(9)  # killed before Megatron's parallel groups
args = SimpleNamespace(
    rank=0, world_size=2, distributed_timeout_minutes=0.05, tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1, expert_model_parallel_size=1, expert_tensor_parallel_size=None,
    context_parallel_size=1, seed=1234, data_parallel_random_init=False,
    virtual_pipeline_model_parallel_size=None, num_distributed_optimizer_instances=1,
    use_tp_pp_dp_mapping=False, use_gloo_process_groups=True,
)
print("started", _started_cpu_world(args))
"""


def test_a_rank_gone_while_the_process_groups_are_built_costs_the_other_one_line(tmp_path):
    """Rank 1 gone after the default group, before Megatron's parallel groups (torchrun's kind of
    store, a TCPStore): rank 0 waited the groups' timeout for it, then printed a store traceback
    (measured, the ``DistStoreError`` above); now its one line and False (the entry exits 1)."""
    import socket

    with socket.socket() as sock:  # a free port for rank 0's TCPStore
        sock.bind(("127.0.0.1", 0))
        (tmp_path / "rendezvous").write_text(str(sock.getsockname()[1]))
    procs, out = _two_ranks(START_UP, tmp_path)  # the rendezvous file: the port
    assert procs[1].returncode == 9, out[1]
    assert "Traceback" not in out[0], out[0]
    line, result = out[0].strip().splitlines()[-2:]
    assert line == (
        "pretrain_stable_latentmoe: error: rank 0: another rank of this run stopped while the "
        "process groups were built, or never joined them (wait timeout after 3000ms); its own "
        "error is above, or the launcher's summary names it if it was killed"
    ), out[0]
    assert result == "started False", out[0]


SAVE_BARRIER = """
import errno, os, sys, torch.distributed as dist
from types import SimpleNamespace
from torch.distributed.checkpoint import CheckpointException
from megatron_latentmoe.training.file_checks import stop_if_save_disk_failed
from megatron_latentmoe.training.pretrain import _said_peer_stopped
rank = int(sys.argv[1])
os.environ["RANK"] = sys.argv[1]
os.environ["TORCHELASTIC_ERROR_FILE"] = f"{sys.argv[2]}.{rank}.json"
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
if rank == 1:
    dist.barrier = lambda: os._exit(9)  # killed after the ranks agreed, before their barrier
args = SimpleNamespace(save=os.path.dirname(sys.argv[2]), ckpt_format="torch_dist")
full = CheckpointException("save", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})
try:
    stop_if_save_disk_failed(args, full, 3)
except RuntimeError as err:  # as pretrain's _main handles it
    print("peer stopped:", _said_peer_stopped(err))
"""


def test_a_rank_gone_in_the_barrier_after_a_full_save_disk_leaves_rank_0s_line_to_torchrun(
    tmp_path,
):
    """Rank 0 said the save's full disk (its error file), then rank 1 went away in the ranks'
    barrier after it (``file_checks.stop_if_save_disk_failed``): rank 0's peer-stopped line is
    printed, and its error file keeps the full disk (the peer-stopped line replaced it before)."""
    procs, out = _two_ranks(SAVE_BARRIER, tmp_path)
    assert procs[1].returncode == 9, out[1]
    lines = out[0].strip().splitlines()
    assert lines[-3].startswith(f"pretrain_stable_latentmoe: error: --save {tmp_path}: the disk ")
    assert lines[-2].startswith(
        "pretrain_stable_latentmoe: error: rank 0: another rank of this run stopped (gloo: "
    ), out[0]
    assert lines[-1] == "peer stopped: True", out[0]
    message = json.loads((tmp_path / "rendezvous.0.json").read_text())["message"]
    assert message == {"message": lines[-3], "extraInfo": message["extraInfo"]}, message
    assert list(message["extraInfo"]) == ["timestamp"], message  # not marked after a peer
