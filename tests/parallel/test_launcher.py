"""The test harness itself (``launcher.run_distributed``): a rank that raises fails the call with
its traceback, and a rank left hanging in a collective is killed with its Python stack in the
message (where a rare hang waited: the harness's only clue to one seen once in a full run)."""

from __future__ import annotations

import pytest

from .launcher import DistributedTestError, run_distributed

pytestmark = pytest.mark.slow


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 gives up")
    return rank


def _both_wait_for_each_other(rank, world_size):
    import torch
    import torch.distributed as dist

    dist.recv(torch.zeros(1), src=1 - rank)  # neither sends: a deadlock, as a mismatched collective


def test_a_raising_rank_fails_the_call_with_its_traceback():
    with pytest.raises(DistributedTestError) as err:
        run_distributed(_rank1_raises, 2)
    message = str(err.value)
    assert "rank 1: raised" in message and "ValueError: rank 1 gives up" in message, message
    assert "rank 0:" not in message, message  # rank 0 returned


def test_hung_ranks_are_killed_with_their_stacks():
    with pytest.raises(DistributedTestError) as err:
        run_distributed(_both_wait_for_each_other, 2, timeout=12.0)
    message = str(err.value)
    for rank in (0, 1):
        part = message[message.index(f"rank {rank}: killed") :]
        part = part[: part.index("rank 1: killed")] if rank == 0 else part
        assert 'test_launcher.py", line' in part, message
        assert "in _both_wait_for_each_other" in part, message
