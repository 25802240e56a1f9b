"""Checkpoint formats on load: ``--auto-detect-ckpt-format`` with another ``--ckpt-format``, and
the checkpoints the layout-change plan of the entry point reads (legacy ``torch``,
non-persistent).

One rank, EP1, 4 iterations with a ``torch_dist`` checkpoint at 2 and 4 (the uninterrupted run).
"""

from __future__ import annotations

import functools

import pytest

from . import copy_checkpoints, iter_dir, read_jsonl, run_entry, scratch_dir

pytestmark = pytest.mark.slow

EP1 = ["--expert-model-parallel-size", "1", "--log-interval", "1"]
ARGS = EP1 + ["--train-iters", "4", "--save-interval", "2"]


@functools.cache
def whole_run():
    """The uninterrupted run: (checkpoint folder, {iteration: balance record})."""
    base = scratch_dir() / "formats_whole"
    run_entry(
        ARGS + ["--save", str(base / "ckpt"), "--balance-log-file", str(base / "whole.jsonl")],
        nproc=1,
    ).check()
    return base / "ckpt", read_jsonl(base / "whole.jsonl")


def test_auto_detect_loads_a_distributed_checkpoint_and_saves_in_the_requested_format():
    """``--ckpt-format torch --auto-detect-ckpt-format`` resuming from the torch_dist checkpoint
    of 2: megatron-core 0.19.2 alone failed the load with ``KeyError: 'model'`` (it built the
    state dict to load into as a legacy one). Now iterations 3-4 log the uninterrupted run's
    losses to the bit, and the checkpoint of 4 is written in the legacy format asked for."""
    whole, ref = whole_run()
    ckpt = copy_checkpoints(whole, scratch_dir() / "formats_auto", upto=2)
    jsonl = scratch_dir() / "formats_auto.jsonl"
    run = run_entry(
        ARGS
        + ["--ckpt-format", "torch", "--auto-detect-ckpt-format"]
        + ["--load", str(ckpt), "--save", str(ckpt), "--balance-log-file", str(jsonl)],
        nproc=1,
    )
    assert run.returncode == 0, run.output[-3000:]
    assert "loading distributed checkpoint" in run.output and "at iteration 2" in run.output
    got = read_jsonl(jsonl)
    assert sorted(got) == [3, 4], sorted(got)
    assert [got[i]["loss"] for i in (3, 4)] == [ref[i]["loss"] for i in (3, 4)]
    assert "in torch format" in run.output
    assert [p.name for p in iter_dir(ckpt, 4).iterdir()] == ["mp_rank_00"]
