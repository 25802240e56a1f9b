"""The pretraining entry point under torchrun on 2 CPU ranks: it trains, balances, checkpoints.

* EP2 (the main job's layout), 40 iterations: the loss goes down; Quantile Balancing brings
  MaxVio down; per-layer global loads add up to tokens x top-k; a torch_dist checkpoint is
  written with a non-zero, mean-free QB bias; it loads and the next iteration's loss is
  bit-identical to the uninterrupted run's.
* ``--bf16``: the step end runs with fp32 router buffers; loads and bias as in fp32.
* PP2, and PP2 with 2 virtual stages per rank (interleaved 1F1B; Megatron's default overlapped
  p2p): the balance metrics of every stage and chunk reach the logging rank (last stage).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from megatron_latentmoe.training.balance_summary import summarize, summary_lines

from . import (
    REF_ARGS,
    REF_ITERS,
    checkpoint_tensors,
    copy_checkpoints,
    iter_dir,
    read_jsonl,
    reference_run,
    run_entry,
    scratch_dir,
)

pytestmark = pytest.mark.slow

MOE_LAYERS = [2, 3, 4]  # tiny.sh: 4 layers, --first-k-dense-replace 1
TOPK = 2
TOKENS_PER_STEP = 8 * 128  # test global batch x sequence length


def _mean(values):
    values = list(values)
    return sum(values) / len(values)


def test_ep2_loss_goes_down():
    ref = reference_run()
    its = sorted(ref.records)
    assert its == list(range(1, REF_ITERS + 1)), its
    losses = [ref.records[i]["loss"] for i in its]
    assert all(math.isfinite(x) for x in losses)
    first, last = _mean(losses[:5]), _mean(losses[-5:])
    print(f"loss first 5 {first:.4f} -> last 5 {last:.4f} ({ref.seconds:.0f} s)")
    assert last < first - 0.5, (first, last)
    # stdout carries the per-iteration balance line on the logging rank
    assert ref.output.count("[balance] iteration") == REF_ITERS
    # and at the end the summary that tools/plot_balance.py --summary prints from the JSONL
    lines = summary_lines(summarize([ref.records[i] for i in its]))
    assert f"[pretrain_stable_latentmoe] summary: {lines[0]}" in ref.output, ref.output[-3000:]
    assert all(line in ref.output for line in lines[1:]), (lines, ref.output[-3000:])
    # the tests' --disable-jit-fuser reaches SiTU-GLU (no compile in these runs)
    assert "--disable-jit-fuser: no torch.compile for SiTU-GLU on CPU" in ref.output


def test_ep2_quantile_balancing_reduces_maxvio():
    ref = reference_run()
    vio = [ref.records[i]["maxvio_mean"] for i in sorted(ref.records)]
    # Early on the router moves faster than a one-step-lagged bias can follow (MaxVio peaks
    # around iterations 5-25 on this toy model); QB then holds the loads together.
    first, last = _mean(vio[:10]), _mean(vio[-10:])
    print(f"MaxVio mean over layers: first 10 {first:.3f} -> last 10 {last:.3f}")
    assert last < first, (first, last)
    for record in ref.records.values():
        layers = {entry["layer"]: entry for entry in record["layers"]}
        assert sorted(layers) == MOE_LAYERS
        for entry in layers.values():
            # global loads: every token of the global batch routed to top-k experts exactly once
            assert sum(entry["loads"]) == TOKENS_PER_STEP * TOPK, entry
            assert entry["num_tokens"] == TOKENS_PER_STEP
            assert (
                min(entry["loads"]) == entry["min_load"]
                and max(entry["loads"]) == entry["max_load"]
            )


def test_ep2_checkpoint_written_with_qb_bias():
    ref = reference_run()
    assert (ref.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(REF_ITERS)
    final = iter_dir(ref.ckpt, REF_ITERS)
    assert (final / "metadata.json").is_file()
    biases = checkpoint_tensors(final, "router.expert_bias")
    assert len(biases) == len(MOE_LAYERS), sorted(biases)
    for name, bias in biases.items():
        assert bias.shape == (8,), name
        assert bias.abs().max() > 0, f"{name}: QB bias never updated"
        assert abs(float(bias.mean())) < 1e-5, f"{name}: QB bias not mean-centred"


def test_ep2_checkpoint_loads_and_training_continues():
    """Load the checkpoint of iteration 30 and train one more iteration (same schedule). The
    resumed run also passes ``--moe-qb-calibrate-batches``, as a launch script that calibrates
    would: a run that resumes keeps its checkpoint's bias, so iteration 31 is still
    bit-identical."""
    ref = reference_run()
    ckpt = copy_checkpoints(ref.ckpt, scratch_dir() / "resume_plus_one", upto=30)
    jsonl = scratch_dir() / "resume_plus_one.jsonl"
    run = run_entry(
        REF_ARGS
        + [
            "--load",
            str(ckpt),
            "--save",
            str(ckpt),
            "--exit-interval",
            "31",
            "--balance-log-file",
            str(jsonl),
            "--moe-qb-calibrate-batches",
            "4",
        ]
    ).check()
    assert "successfully loaded checkpoint" in run.output and "at iteration 30" in run.output
    assert "[QB calibration]" not in run.output
    records = read_jsonl(jsonl)
    assert sorted(records) == [31], sorted(records)
    assert records[31]["loss"] == ref.records[31]["loss"]  # same state, same batch: bit-identical
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "31"
    assert (iter_dir(ckpt, 31) / "metadata.json").is_file()


def test_bf16_run_balances_with_fp32_router_buffers():
    """``--bf16``, the full-scale example's precision: Megatron's ``Float16Module`` casts the
    whole model, buffers included, and QB's router buffers stay fp32, so the step end runs (a
    bf16 run failed at its first step end: the fp32 router weight times a bf16 mean input).
    Every iteration's loads count every token, iteration 1 (the reference run's weights and
    batch) has the fp32 run's loss within bf16's rounding, and the checkpoint holds an fp32,
    non-zero, mean-free bias."""
    ref = reference_run()
    ckpt, jsonl = scratch_dir() / "bf16_ckpt", scratch_dir() / "bf16.jsonl"
    run_entry(
        ["--bf16", "--train-iters", "3", "--save", str(ckpt), "--save-interval", "3"]
        + ["--balance-log-file", str(jsonl)]
    ).check()
    records = read_jsonl(jsonl)
    assert sorted(records) == [1, 2, 3], sorted(records)
    for record in records.values():
        assert math.isfinite(record["loss"])
        assert all(sum(entry["loads"]) == TOKENS_PER_STEP * TOPK for entry in record["layers"])
    print(f"iteration 1 loss: bf16 {records[1]['loss']:.4f}, fp32 {ref.records[1]['loss']:.4f}")
    assert abs(records[1]["loss"] - ref.records[1]["loss"]) < 0.02
    biases = checkpoint_tensors(iter_dir(ckpt, 3), "router.expert_bias")
    assert len(biases) == len(MOE_LAYERS), sorted(biases)
    for name, bias in biases.items():
        assert bias.dtype == torch.float32, (name, bias.dtype)
        assert bias.abs().max() > 0 and abs(float(bias.mean())) < 1e-5, (name, bias)


@functools.cache
def _pp2_run(virtual_stages, rescore_iters=0, calibrate_batches=0, rescore_solves=1):
    jsonl = scratch_dir() / (
        f"pp2-vpp{virtual_stages}-rescore{rescore_iters}x{rescore_solves}"
        f"-calibrate{calibrate_batches}.jsonl"
    )
    vpp = (
        ["--num-layers-per-virtual-pipeline-stage", str(4 // 2 // virtual_stages)]
        if virtual_stages
        else []
    )
    rescore = ["--moe-qb-rescore-iters", str(rescore_iters)] if rescore_iters else []
    if rescore_solves != 1:
        rescore += ["--moe-qb-rescore-solves", str(rescore_solves)]
    calibrate = ["--moe-qb-calibrate-batches", str(calibrate_batches)] if calibrate_batches else []
    run = run_entry(
        [
            "--pipeline-model-parallel-size",
            "2",
            "--expert-model-parallel-size",
            "1",
            "--train-iters",
            "6",
            "--balance-log-file",
            str(jsonl),
            *vpp,
            *rescore,
            *calibrate,
        ]
    ).check()
    return run, read_jsonl(jsonl)


@pytest.mark.parametrize("virtual_stages", [None, 2], ids=["pp2", "pp2-vpp2"])
def test_pp2_metrics_of_every_stage_reach_the_logging_rank(virtual_stages):
    run, records = _pp2_run(virtual_stages)
    assert sorted(records) == list(range(1, 7))
    for record in records.values():
        # PP2: layer 2 lives on stage 0, layers 3-4 on stage 1 (the logging rank's);
        # VPP2: stage 0 holds layers 1 and 3, stage 1 layers 2 and 4
        assert [entry["layer"] for entry in record["layers"]] == MOE_LAYERS
        assert all(sum(entry["loads"]) == TOKENS_PER_STEP * TOPK for entry in record["layers"])
        assert math.isfinite(record["loss"]) and record["loss_tokens"] == TOKENS_PER_STEP
    assert records[6]["loss"] < records[1]["loss"]
    print(
        f"PP2 x VPP{virtual_stages or 1}: loss {records[1]['loss']:.4f} -> "
        f"{records[6]['loss']:.4f} ({run.seconds:.0f} s)"
    )


def test_qb_rescoring_replays_every_virtual_stage():
    """QB rescoring through the interleaved pipeline schedule (PP2 x VPP2: each rank holds two
    model chunks, each reading its own data iterator, which the rescoring pass replays): the
    logged first step is the plain run's, and the rescored solves change the routing after it."""
    _, plain = _pp2_run(2)
    run, rescored = _pp2_run(2, rescore_iters=6)
    assert sorted(rescored) == list(range(1, 7))
    assert rescored[1]["loss"] == plain[1]["loss"]
    loads = {i: [[e["loads"] for e in r[i]["layers"]] for r in (rescored, plain)] for i in (1, 3)}
    assert loads[1][0] == loads[1][1]
    assert loads[3][0] != loads[3][1]
    for record in rescored.values():
        assert all(sum(entry["loads"]) == TOKENS_PER_STEP * TOPK for entry in record["layers"])
    print(f"PP2 x VPP2 rescoring: loss {rescored[6]['loss']:.4f} vs plain {plain[6]['loss']:.4f}")


def test_qb_rescore_solves_reach_every_virtual_stage():
    """``--moe-qb-rescore-solves 2`` through the entry point and the interleaved pipeline schedule:
    the first step is still the plain run's, and the extra solve changes the routing of the
    iterations after it in every MoE layer, against one solve per rescored step."""
    _, plain = _pp2_run(2)
    _, one = _pp2_run(2, rescore_iters=6)
    _, two = _pp2_run(2, rescore_iters=6, rescore_solves=2)
    assert sorted(two) == list(range(1, 7))
    assert two[1]["loss"] == plain[1]["loss"]
    assert [e["loads"] for e in two[1]["layers"]] == [e["loads"] for e in one[1]["layers"]]
    for layer in range(len(MOE_LAYERS)):
        assert two[2]["layers"][layer]["loads"] != one[2]["layers"][layer]["loads"], layer
    for record in two.values():
        assert all(sum(entry["loads"]) == TOKENS_PER_STEP * TOPK for entry in record["layers"])


def test_qb_calibration_through_every_virtual_stage():
    """QB calibration (``--moe-qb-calibrate-batches``) through the interleaved pipeline schedule
    (PP2 x VPP2: the MoE layers 2, 3, 4 sit on both ranks and three model chunks): every MoE layer
    is calibrated on the run's last 3 global batches, and iteration 1 -- the same batch and
    weights as the plain run's -- is routed more evenly (8 experts: 256 tokens each at balance,
    so the noise is ~0.2)."""
    _, plain = _pp2_run(2)
    run, calibrated = _pp2_run(2, calibrate_batches=3)
    lines = [line for line in run.output.splitlines() if line.startswith("[QB calibration] layer")]
    assert sorted(int(line.split()[3].rstrip(":")) for line in lines) == MOE_LAYERS, lines
    assert "samples from 24" in run.output  # (6 - 3) iterations x 8 sequences
    vio = {name: r[1]["maxvio_mean"] for name, r in (("plain", plain), ("calibrated", calibrated))}
    print(f"PP2 x VPP2 iteration 1 MaxVio: {vio}")
    assert vio["calibrated"] < 0.6 * vio["plain"], vio  # measured 0.23 against 0.44
    for record in calibrated.values():
        assert all(sum(entry["loads"]) == TOKENS_PER_STEP * TOPK for entry in record["layers"])
