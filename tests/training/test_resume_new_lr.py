"""A checkpoint resumed with another ``--lr`` / ``--min-lr`` keeps its Adam moments.

Saved at iteration 2 with tiny.sh's ``--lr 1e-3 --min-lr 1e-4`` (1 rank, EP1, 4 iterations),
resumed with ``--lr 5e-4 --min-lr 5e-5``: without ``--override-opt_param-scheduler`` the entry
point refuses in one line naming it (megatron-core 0.19.2 failed the load with a ValueError /
KeyError traceback); with it the checkpoint loads: re-saved right after the load (Megatron's
``--ckpt-convert-save``) every tensor, the Adam moments included, equals the saved one exactly,
and iteration 3 logs the new values' cosine schedule at the checkpoint's step. For the plain
optimizer and the distributed one (fully reshardable format), and for the latter with a layout
change too (saved at EP2 on 2 ranks, resumed at EP1). With ``--use-checkpoint-opt_param-scheduler``
in place of the override the run takes the checkpoint's values (its ``--decoupled-lr`` too) and
trains on as the saving run did.
"""

from __future__ import annotations

import functools
import math
import re

import pytest

from . import checkpoint_tensors, error_lines, iter_dir, logged_loss, run_entry, scratch_dir

pytestmark = pytest.mark.slow

ITERS = 4
ONE_RANK = ["--expert-model-parallel-size", "1", "--train-iters", str(ITERS)]
NEW_LR = ["--lr", "5e-4", "--min-lr", "5e-5"]
OPTIMIZERS = {
    "plain": [],
    "distributed": ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"],
}


def _logged_lr(output: str, iteration: int) -> float:
    found = re.search(rf"iteration\s+{iteration}/.*?learning rate: ([0-9.eE+-]+)", output)
    assert found, output[-3000:]
    return float(found.group(1))


def _cosine_lr(max_lr: float, min_lr: float, iteration: int) -> float:
    """The LR Megatron logs at ``iteration`` (the next step's: set after ``iteration`` steps, in
    samples of the tests' global batch 8), tiny.sh's cosine decay over the run after a 5 %
    warm-up."""
    samples, decay = 8 * iteration, 8 * ITERS
    warmup = 0.05 * decay
    if samples <= warmup:
        return max_lr * samples / warmup
    ratio = (samples - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def _tensors(folder):
    return {k: v for k, v in checkpoint_tensors(folder).items() if "rng_state" not in k}


@functools.cache
def _saved(kind: str):
    """The checkpoint folder (one checkpoint an iteration) of a 4-iteration run with tiny.sh's
    LR (``kind``: the optimizer) and that run's output, for this module's tests."""
    ckpt = scratch_dir() / f"new_lr_{kind}" / "ckpt"
    args = ONE_RANK + OPTIMIZERS[kind]
    saving = run_entry(args + ["--save", str(ckpt), "--save-interval", "1"], nproc=1).check()
    assert _logged_lr(saving.output, 3) == pytest.approx(_cosine_lr(1e-3, 1e-4, 3), rel=1e-6)
    return ckpt, saving.output


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_another_lr_loads_the_adam_moments_with_override(kind):
    ckpt, _ = _saved(kind)
    base = ckpt.parent
    args = ONE_RANK + OPTIMIZERS[kind]
    resume = args + NEW_LR + ["--load", str(ckpt), "--ckpt-step", "2"]

    refused = run_entry(resume, nproc=1)
    assert refused.returncode != 0  # torchrun: 1 (the rank: 2)
    lines = error_lines(refused.output)
    assert len(lines) == 1 and lines[0].endswith(
        f"--load {ckpt}: the checkpoint's optimizer was saved with --lr 0.001 (this run: 0.0005), "
        "--min-lr 0.0001 (this run: 5e-05): add --override-opt_param-scheduler to train on with "
        "this run's learning rates and schedule, or --use-checkpoint-opt_param-scheduler to "
        "train on with the checkpoint's, the Adam moments kept; or give the checkpoint's values, "
        "or add --no-load-optim to train on with this run's (the Adam moments and the "
        "learning-rate schedule start anew, the iteration number goes on)"
    ), lines

    resume.append("--override-opt_param-scheduler")
    converted = base / "converted"
    run_entry(
        resume + ["--ckpt-convert-format", "torch_dist", "--ckpt-convert-save", str(converted)],
        nproc=1,
    ).check()
    saved, loaded = _tensors(iter_dir(ckpt, 2)), _tensors(iter_dir(converted / "torch_dist", 2))
    moments = [k for k in saved if "exp_avg" in k]
    assert any("exp_avg_sq" in k for k in moments) and len(moments) > 10, sorted(saved)[:20]
    assert sorted(loaded) == sorted(saved)
    assert not [k for k in saved if not loaded[k].equal(saved[k])]

    step = run_entry(resume, nproc=1).check()
    assert "at iteration 2" in step.output
    assert _logged_lr(step.output, 3) == pytest.approx(_cosine_lr(5e-4, 5e-5, 3), rel=1e-6)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_another_lr_with_the_checkpoints_schedule_trains_on_as_the_saving_run(kind):
    """--use-checkpoint-opt_param-scheduler with other LRs, --decoupled-lr given in this run
    only included: the run takes the checkpoint's values (one warning naming them; refused
    before, naming only --override-opt_param-scheduler), so its param groups are the saving
    run's: resumed at iteration 2 it logs the saving run's learning rates at iterations 3 and 4
    (the checkpoint's cosine schedule, where this run's --lr would log 1.226116e-04 at 3) and
    loss at 3, and its checkpoint of iteration 3 -- weights, QB biases, Adam moments -- equals
    the saving run's exactly. Another --weight-decay (0.1, tiny.sh's 0.01) too: iteration 3
    steps with the checkpoint's (compat.core's scheduler shim; megatron-core 0.19.2 stepped
    with this run's there, and the checkpoint's from iteration 4)."""
    ckpt, saving = _saved(kind)
    kept = ckpt.parent / "kept"
    resume = ONE_RANK + OPTIMIZERS[kind] + NEW_LR + ["--decoupled-lr", "2e-3"]
    resume += ["--weight-decay", "0.1"]
    resume += ["--load", str(ckpt), "--ckpt-step", "2", "--use-checkpoint-opt_param-scheduler"]
    run = run_entry(resume + ["--save", str(kept), "--save-interval", "3"], nproc=1).check()
    assert (
        "WARNING: --use-checkpoint-opt_param-scheduler: this run's learning rates and weight "
        "decay are not used, the checkpoint's schedule goes on with its own: --lr 0.001 (this "
        "run: 0.0005), --min-lr 0.0001 (this run: 5e-05), --decoupled-lr None (this run: 0.002), "
        "--weight-decay 0.01 (this run: 0.1)\n"
    ) in run.output
    assert "at iteration 2" in run.output
    for i in (3, 4):
        assert _logged_lr(run.output, i) == _logged_lr(saving, i)
    assert _logged_lr(run.output, 3) == pytest.approx(_cosine_lr(1e-3, 1e-4, 3), rel=1e-6)
    assert logged_loss(run.output, 3) == logged_loss(saving, 3)
    saved, resaved = _tensors(iter_dir(ckpt, 3)), _tensors(iter_dir(kept, 3))
    assert len([k for k in saved if "exp_avg" in k]) > 10 and sorted(resaved) == sorted(saved)
    assert not [k for k in saved if not resaved[k].equal(saved[k])]


def test_another_lr_with_a_layout_change_reshards_the_adam_moments():
    """Both at once: saved at EP2 on 2 ranks, resumed at EP1 on 1 rank with the new values and
    --override-opt_param-scheduler, the distributed optimizer fully reshardable in both runs
    (the one layout change that keeps the moments: ``resume.plan_layout_change``). The load
    goes through the entry point's layout-change load (the optimizer loaded, the schedule not
    stepped again) and the LR rewrite together; measured: every tensor re-saved equal, the
    iteration-3 LR the new cosine's (1.226116e-04), as at EP1 -> EP1 and with TP2+SP."""
    base = scratch_dir() / "new_lr_layout"
    ckpt = base / "ckpt"
    args = OPTIMIZERS["distributed"] + ["--train-iters", str(ITERS)]
    run_entry(args + ["--save", str(ckpt), "--save-interval", "2"], nproc=2).check()
    resume = args + ONE_RANK + NEW_LR
    resume += ["--load", str(ckpt), "--ckpt-step", "2", "--override-opt_param-scheduler"]
    converted = base / "converted"
    loading = run_entry(
        resume + ["--ckpt-convert-format", "torch_dist", "--ckpt-convert-save", str(converted)],
        nproc=1,
    ).check()
    assert "loaded the resharded model, QB bias and optimizer state at iteration 2" in (
        loading.output
    )
    saved, loaded = _tensors(iter_dir(ckpt, 2)), _tensors(iter_dir(converted / "torch_dist", 2))
    assert len([k for k in saved if "exp_avg" in k]) > 10 and sorted(loaded) == sorted(saved)
    assert not [k for k in saved if not loaded[k].equal(saved[k])]

    step = run_entry(resume, nproc=1).check()
    assert _logged_lr(step.output, 3) == pytest.approx(_cosine_lr(5e-4, 5e-5, 3), rel=1e-6)
