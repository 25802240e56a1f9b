"""Megatron's rerun state machine (``--rerun-mode validate_results``) on CPU, re-runs forced by its
error injection: a re-run iteration reproduces its first pass, and the run ends where the run
without re-runs ends (training/rerun_balance.py)."""

from __future__ import annotations

import json
import re

import pytest

from . import LAUNCH, checkpoint_tensors, iter_dir, run_entry, scratch_dir

pytestmark = pytest.mark.slow

ITERS = 5
# one process, no expert parallelism; the spiky-loss check (not fatal: a re-run, then on)
RUN = [
    "--expert-model-parallel-size", "1",
    "--train-iters", str(ITERS),
    "--no-check-for-nan-in-loss-and-grad",
    "--check-for-spiky-loss",
]  # fmt: skip
INJECT = ["--error-injection-rate", "1", "--error-injection-type", "transient_error"]
# Megatron's verdict on an injected transient error names the re-run's and the first pass's loss
VERDICT = re.compile(r"iteration #\d+: First rerun: .*? \(([-0-9.e+naif]+) != ([-0-9.e+naif]+)\)")
STEP_KEYS = ("iteration", "loss", "loss_tokens", "maxvio_mean", "maxvio_max", "layers")


def _run(name: str, mode: list[str]) -> tuple[list[dict], dict, str]:
    base = scratch_dir() / name
    ckpt, jsonl = base / "ckpt", base / "balance.jsonl"
    extra = [*RUN, *mode, "--save", str(ckpt), "--save-interval", str(ITERS)]
    run = run_entry([*extra, "--balance-log-file", str(jsonl)], nproc=1).check()
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return records, checkpoint_tensors(iter_dir(ckpt, ITERS), "expert_bias"), run.output


@pytest.mark.parametrize(
    "balancing",
    [
        [],
        ["--moe-qb-rescore-iters", "3"],
        ["--moe-router-load-balancing-type", "none", "--moe-router-enable-expert-bias"],
    ],
    ids=["qb", "qb-rescore", "sign-update"],
)
def test_a_rerun_iteration_reproduces_its_first_pass(balancing):
    """QB, QB inside its rescoring window (the step end runs after ``train_step``) and
    Megatron's own sign update (its bias update in ``finalize_model_grads``)."""
    name = "-".join(balancing)
    records, bias, output = _run(
        f"rerun{name}", ["--rerun-mode", "validate_results", *INJECT, *balancing]
    )
    plain_records, plain_bias, _ = _run(f"plain{name}", ["--rerun-mode", "disabled", *balancing])
    verdicts = VERDICT.findall(output)
    # Megatron validates from the 2nd iteration on; every one is re-run (injection rate 1)
    assert len(verdicts) == ITERS - 1, output[-3000:]
    # the re-run's loss is the first pass's, bit for bit (a re-run routed with the bias solved
    # from its own first pass: 4266.8745 != 4266.9990)
    assert all(rerun == first for rerun, first in verdicts), verdicts
    # one balance record per iteration, each the run's without re-runs (loss, per-layer loads)
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    steps = [{k: r[k] for k in STEP_KEYS} for r in records]
    assert steps == [{k: r[k] for k in STEP_KEYS} for r in plain_records]
    assert bias and bias.keys() == plain_bias.keys()
    for key, value in bias.items():
        assert value.abs().sum() > 0, key
        assert value.equal(plain_bias[key]), (key, value, plain_bias[key])


def test_a_reproducible_rejection_checkpoints_the_state_before_the_iteration():
    """A rejected loss the re-run reproduces (injected: 'correct_result'; the NaN check, fatal):
    Megatron saves a checkpoint to re-run the iteration elsewhere and exits with 16. That
    checkpoint holds the routing state the iteration started from (before: the bias two step
    ends on), and no balance record of the iteration."""
    base = scratch_dir() / "rerun-checkpoint"
    ckpt, jsonl = base / "ckpt", base / "balance.jsonl"
    inject = ["--error-injection-rate", "1", "--error-injection-type", "correct_result"]
    extra = ["--expert-model-parallel-size", "1", "--train-iters", str(ITERS)]
    extra += ["--rerun-mode", "validate_results", *inject, "--save", str(ckpt)]
    flags = [*extra, "--save-interval", "100", "--balance-log-file", str(jsonl)]
    run = run_entry(flags, nproc=1, launcher=LAUNCH)
    assert run.returncode == 16, run.output[-3000:]
    assert "unexpected result is reproducible within the tolerance" in run.output
    assert [json.loads(line)["iteration"] for line in jsonl.read_text().splitlines()] == [1]
    _, plain_bias, _ = _run_plain_one_iteration()
    bias = checkpoint_tensors(iter_dir(ckpt, 1), "expert_bias")
    assert bias and bias.keys() == plain_bias.keys()
    for key, value in bias.items():
        assert value.equal(plain_bias[key]), (key, value, plain_bias[key])


def _run_plain_one_iteration():
    base = scratch_dir() / "plain-one"
    ckpt, jsonl = base / "ckpt", base / "balance.jsonl"
    extra = ["--expert-model-parallel-size", "1", "--train-iters", "1", "--rerun-mode", "disabled"]
    extra += ["--save", str(ckpt), "--save-interval", "1", "--balance-log-file", str(jsonl)]
    run = run_entry(extra, nproc=1).check()
    return jsonl, checkpoint_tensors(iter_dir(ckpt, 1), "expert_bias"), run.output
