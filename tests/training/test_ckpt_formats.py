"""Checkpoint formats on load: ``--auto-detect-ckpt-format`` with another ``--ckpt-format``,
without it (refused), and the checkpoints the layout-change plan of the entry point reads
(legacy ``torch``, non-persistent); a ``release`` checkpoint on ``--load``: what it restores.

One rank, EP1, 4 iterations with a ``torch_dist`` checkpoint at 2 and 4 (the uninterrupted run).
"""

from __future__ import annotations

import functools
import re
import shutil

import pytest

from megatron_latentmoe.checkpoint_layout import RELEASE, TRACKER_FILE

from . import LAUNCH, copy_checkpoints, iter_dir, read_jsonl, run_entry, scratch_dir

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


def test_a_distributed_checkpoint_without_auto_detect_is_refused_with_the_ways_out():
    """``--ckpt-format torch`` without ``--auto-detect-ckpt-format`` resuming from the torch_dist
    checkpoint of 4: megatron-core 0.19.2 failed on every rank with "RuntimeError: Detected load
    from a distributed checkpoint, but neither --use-dist-ckpt nor --auto-detect-ckpt-format is
    set." Now one line at start-up (the other formats: tests/unit/test_pretrain_units.py)."""
    whole, _ = whole_run()
    refused = run_entry(
        EP1 + ["--train-iters", "6", "--ckpt-format", "torch", "--load", str(whole)], nproc=1
    )
    assert refused.returncode != 0
    assert (
        f"pretrain_stable_latentmoe: error: --load {whole}: {iter_dir(whole, 4)} is a torch_dist "
        "checkpoint, which megatron-core 0.19.2 fails to load with --ckpt-format torch; resume "
        "from it with --ckpt-format torch_dist, or add --auto-detect-ckpt-format"
    ) in refused.output, refused.output[-3000:]
    assert "Detected load from a distributed checkpoint" not in refused.output


def test_a_legacy_checkpoint_of_another_layout_is_refused_with_the_way_out():
    """A legacy ``torch`` checkpoint saved with EP1, resumed with EP2: megatron-core 0.19.2
    printed "could not load the checkpoint" on each rank and exited 0, having trained nothing.
    Now one line at start-up names the layout and the way out, and that way out works: resumed
    in the saved layout with ``--ckpt-format torch_dist --auto-detect-ckpt-format``, the run
    logs the uninterrupted run's losses and saves a torch_dist checkpoint (which reshards)."""
    _, ref = whole_run()
    base = scratch_dir() / "formats_legacy"
    legacy = base / "legacy"
    run_entry(
        ARGS + ["--exit-interval", "2", "--ckpt-format", "torch", "--save", str(legacy)],
        nproc=1,
    ).check()
    assert [p.name for p in iter_dir(legacy, 2).iterdir()] == ["mp_rank_00"]

    refused = run_entry(
        ["--train-iters", "4", "--ckpt-format", "torch", "--load", str(legacy)], nproc=2
    )
    assert refused.returncode != 0
    assert (
        f"pretrain_stable_latentmoe: error: --load {legacy}: {iter_dir(legacy, 2)} is a legacy "
        "torch checkpoint of another parallel layout: --expert-model-parallel-size 1 (this run: 2)"
        in refused.output
    ), refused.output[-3000:]
    assert "--ckpt-format torch_dist --auto-detect-ckpt-format" in refused.output
    assert "could not load" not in refused.output  # (torchrun still prints its own traceback)

    converted, jsonl = base / "converted", base / "converted.jsonl"
    run = run_entry(
        ARGS
        + ["--ckpt-format", "torch_dist", "--auto-detect-ckpt-format", "--load", str(legacy)]
        + ["--save", str(converted), "--balance-log-file", str(jsonl)],
        nproc=1,
    ).check()
    assert "at iteration 2" in run.output
    got = read_jsonl(jsonl)
    assert [got[i]["loss"] for i in (3, 4)] == [ref[i]["loss"] for i in (3, 4)]
    assert (iter_dir(converted, 4) / "metadata.json").is_file()


def test_a_newer_non_persistent_checkpoint_of_another_layout_is_planned_for():
    """``--non-persistent-ckpt-type global``: Megatron resumes from the non-persistent
    checkpoint (``LOAD/non_persistent``) where it is as new as the persistent one or newer.
    Here it is the only one (iteration 2 of the EP1 run; Megatron's global non-persistent save
    is its torch_dist save into that folder), resumed with EP2: the entry point read only the
    persistent checkpoints, found none, planned no layout change, and Megatron loaded the EP1
    optimizer and RNG state into EP2. Now the layout change is planned and announced, and
    iteration 3 logs the EP1 run's loss to RESHARD_RTOL (same weights and QB biases)."""
    import shutil

    whole, ref = whole_run()
    ckpt = scratch_dir() / "formats_non_persistent"
    shutil.copytree(iter_dir(whole, 2), iter_dir(ckpt / "non_persistent", 2))
    (ckpt / "non_persistent" / "latest_checkpointed_iteration.txt").write_text("2")
    jsonl = scratch_dir() / "formats_non_persistent.jsonl"
    run = run_entry(
        ["--train-iters", "4", "--log-interval", "1", "--exit-interval", "3"]
        + ["--non-persistent-ckpt-type", "global", "--load", str(ckpt)]
        + ["--balance-log-file", str(jsonl)],
        nproc=2,
    )
    assert run.returncode == 0, run.output[-3000:]
    assert "Loading from a non-persistent checkpoint (non-persistent iter 2)" in run.output
    assert "WARNING: checkpoint layout" in run.output and "at iteration 2" in run.output
    got = read_jsonl(jsonl)
    assert sorted(got) == [3], sorted(got)
    assert abs(got[3]["loss"] / ref[3]["loss"] - 1) < 1e-5


def test_a_release_checkpoint_on_load_continues_the_data_and_says_so():
    """The checkpoint of 2 made a release one (folder and tracker ``release``) on ``--load``:
    megatron-core 0.19.2 restores the model (weights and QB bias) and, without --finetune, the
    data offset of its args: iteration 1 logs 24 consumed samples and the uninterrupted run's
    iteration-3 loss and per-expert loads (same weights, bias and batch), with one warning
    saying so. With --finetune: 8 consumed samples, another batch, no warning."""
    whole, ref = whole_run()
    base = scratch_dir() / "formats_release"
    base.mkdir()
    shutil.copytree(iter_dir(whole, 2), base / RELEASE)
    (base / TRACKER_FILE).write_text(RELEASE)
    runs = {}
    for name, extra in (("continues", []), ("finetune", ["--finetune"])):
        jsonl = scratch_dir() / f"formats_release_{name}.jsonl"
        run = run_entry(
            EP1
            + ["--train-iters", "1", "--load", str(base), "--balance-log-file", str(jsonl)]
            + extra,
            nproc=1,
        ).check()
        assert "loading release distributed checkpoint" in run.output
        runs[name] = run, read_jsonl(jsonl)[1]
    run, first = runs["continues"]
    assert run.output.count("WARNING: --load") == 1, run.output[-3000:]
    assert "continues the data after the 16 training samples" in run.output
    assert re.search(r"iteration\s+1/\s+1 \| consumed samples:\s+24 \|", run.output)
    assert first["loss"] == ref[3]["loss"]
    assert [e["loads"] for e in first["layers"]] == [e["loads"] for e in ref[3]["layers"]]
    run, first = runs["finetune"]
    assert "WARNING: --load" not in run.output
    assert re.search(r"iteration\s+1/\s+1 \| consumed samples:\s+8 \|", run.output)
    assert first["loss"] != ref[3]["loss"]


def test_a_release_whose_consumed_samples_pass_this_runs_data_is_refused_in_one_line():
    """The checkpoint of 4 (32 consumed samples) made a release on ``--load``, this run's
    training data 3 documents of the corpus (``--split 2,0,998``: under 32 samples, in whole
    epochs): megatron-core 0.19.2 continued the data after the 32 and asserted "no samples left
    to consume" on the rank, a traceback after building the model. Now one line naming the
    counts and --finetune, exit 2; with --finetune the run trains from sample 0."""
    whole, _ = whole_run()
    base = scratch_dir() / "formats_release_past_data"
    base.mkdir()
    shutil.copytree(iter_dir(whole, 4), base / RELEASE)
    (base / TRACKER_FILE).write_text(RELEASE)
    args = EP1 + ["--train-iters", "1", "--split", "2,0,998", "--load", str(base)]
    refused = run_entry(args, nproc=1, launcher=LAUNCH)
    assert refused.returncode == 2, refused.output[-3000:]
    assert re.search(
        rf"pretrain_stable_latentmoe: error: --load {base}: a release checkpoint without "
        r"--finetune continues the training data after the 32 samples its run consumed, and this "
        r"run reads 8 more, but this run's training data holds \d+ samples .* pass --finetune to "
        r"start the data from sample 0 ",
        refused.output,
    ), refused.output[-3000:]
    assert refused.output.count("error:") == 1 and "Traceback" not in refused.output
    run = run_entry(args + ["--finetune"], nproc=1).check()
    assert re.search(r"iteration\s+1/\s+1 \| consumed samples:\s+8 \|", run.output)
