"""The data-left check (:mod:`megatron_latentmoe.training.data_left`): a loaded checkpoint's data
offset that this run's datasets cannot serve, refused in one line."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from megatron_latentmoe.training import data_left


def _data_args(**flags):
    """Megatron's args after its load of a release of iteration 16 (global batch 8), this run
    --train-iters 1, --eval-iters 0: what :func:`data_left.data_left_refusal` reads."""
    args = SimpleNamespace(
        load="/ckpt",
        iteration=0,
        consumed_train_samples=128,
        consumed_valid_samples=128,
        train_iters=1,
        global_batch_size=8,
        phase_transition_iterations=None,
        skip_train=False,
        full_validation=False,
        eval_iters=0,
        eval_interval=4,
        start_eval_at_iter=None,
        exit_interval=None,
    )
    vars(args).update(flags)
    return args


RELEASE_WAYS = (
    "pass --finetune to start the data from sample 0 (a larger --train-iters or --train-samples "
    "sizes the data for that many samples alone)"
)


def test_a_release_whose_consumed_samples_pass_the_training_data_is_refused():
    """Measured (CPU, tiny.sh; end to end: tests/training/test_ckpt_formats.py): megatron-core
    0.19.2 asserted "no samples left to consume: 128, 99" where the release's 128 consumed
    samples reach past this run's 99 (sized for its 8, in whole epochs), and stopped with a
    StopIteration where the samples it reads after them do (128 + 160 > 198); 64 + 32 <= 99
    trained."""
    assert data_left.data_left_refusal(_data_args(), 99, None) == (
        "--load /ckpt: a release checkpoint without --finetune continues the training data after "
        "the 128 samples its run consumed, and this run reads 8 more, but this run's training "
        "data holds 99 samples (sized for this run's samples in whole epochs of the data): "
        "megatron-core 0.19.2 fails on every rank with 'no samples left to consume' at start or "
        f"with a StopIteration; {RELEASE_WAYS}"
    )
    assert "reads 160 more, but this run's training data holds 198 samples" in (
        data_left.data_left_refusal(_data_args(train_iters=20), 198, None)
    )
    fits = _data_args(consumed_train_samples=64, consumed_valid_samples=0, train_iters=4)
    assert data_left.data_left_refusal(fits, 99, None) is None  # 96 of 99: trained (measured)
    fits.train_iters = 5  # 64 + 40: the last sample read is the 104th
    assert data_left.data_left_refusal(fits, 104, 1) is None
    assert data_left.data_left_refusal(fits, 103, None)
    # --skip-train: Megatron builds no training loader and starts the validation one at 0
    assert data_left.data_left_refusal(_data_args(skip_train=True), 99, 1) is None
    # --exit-interval 2 of --train-iters 20: the run stops at 2, 16 samples read, not 160
    stops = _data_args(train_iters=20, exit_interval=2)
    assert data_left.data_left_refusal(stops, 144, None) is None
    assert "reads 16 more" in data_left.data_left_refusal(stops, 143, None)


def test_a_plain_resume_past_this_runs_training_data_is_refused():
    """Measured: the checkpoint of iteration 16 (128 samples) resumed with --train-iters 8 (and
    --override-opt_param-scheduler) asserted "no samples left to consume: 128, 99"; a normal
    resume's offset and what it reads add up to this run's samples, which its data holds."""
    args = _data_args(iteration=16, train_iters=8, consumed_valid_samples=0)
    assert data_left.data_left_refusal(args, 99, None) == (
        "--load /ckpt: the checkpoint of iteration 16 continues the training data after the 128 "
        "samples its run consumed, and this run reads 0 more, but this run's training data holds "
        "99 samples (sized for this run's samples in whole epochs of the data): megatron-core "
        "0.19.2 fails on every rank with 'no samples left to consume' at start or with a "
        "StopIteration; resume with a --train-iters above 16 and the data the checkpoint's run "
        "trained on, or pass --finetune to load its model alone and start the data over"
    )
    resumed = _data_args(iteration=16, train_iters=20, consumed_valid_samples=0)
    assert data_left.data_left_refusal(resumed, 160, None) is None  # 128 + 32: sized for 160
    # a resume that reads nothing more still needs its offset inside the data: Megatron's
    # sampler asserts offset < length ("no samples left to consume: 128, 128")
    ended = _data_args(iteration=16, train_iters=16, consumed_valid_samples=0)
    assert "reads 0 more, but this run's training data holds 128 samples" in (
        data_left.data_left_refusal(ended, 128, None)
    )
    assert data_left.data_left_refusal(ended, 129, None) is None


def test_a_release_whose_evaluated_samples_pass_the_validation_data_is_refused():
    """Measured: a release whose run evaluated 128 samples, loaded where the validation data
    holds 113 (sized for this run's evaluations; --eval-iters 0 too): "no samples left to
    consume: 128, 113" on every rank. --full-validation starts it at 0; no validation data: no
    check."""
    args = _data_args(consumed_train_samples=64)
    assert data_left.data_left_refusal(args, 99, 113) == (
        "--load /ckpt: a release checkpoint without --finetune continues the validation data "
        "after the 128 samples its run evaluated, but this run's validation data holds 113 "
        "samples (sized for this run's evaluations in whole epochs of the data, --eval-iters 0 "
        "included): megatron-core 0.19.2 fails on every rank at start with 'no samples left to "
        f"consume'; {RELEASE_WAYS}"
    )
    assert data_left.data_left_refusal(args, 99, 129) is None
    assert "validation data holds 128 samples" in data_left.data_left_refusal(args, 99, 128)
    assert data_left.data_left_refusal(args, 99, None) is None
    assert data_left.data_left_refusal(_data_args(full_validation=True), 9999, 113) is None


def test_the_datasets_provider_refuses_datasets_that_cannot_serve_the_offset(monkeypatch):
    """:func:`data_left.checks_data_left` over Megatron's provider: the datasets it builds pass
    where the offset fits, :class:`data_left.DataLeftError` where not (their lengths, a validation
    list not judged); Megatron's ``is_distributed`` kept (every rank builds its own)."""

    def provider(num_samples, vp_stage=None):
        return [0] * num_samples[0], [0] * num_samples[1], None

    provider.is_distributed = True
    args = _data_args(consumed_valid_samples=0)
    monkeypatch.setitem(sys.modules, "megatron.training", SimpleNamespace(get_args=lambda: args))
    checked = data_left.checks_data_left(provider)
    assert checked.is_distributed is True
    assert checked([136, 1, 0]) == ([0] * 136, [0], None)  # 128 + 8 samples: fits
    with pytest.raises(data_left.DataLeftError, match="training data holds 135 samples"):
        checked([135, 1, 0])
    # --multiple-validation-sets: a list of validation datasets, not one of 1 sample
    args.consumed_valid_samples = 128
    listed = data_left.checks_data_left(lambda n: ([0] * n[0], [[0] * n[1]], None))
    assert listed([136, 1, 0]) == ([0] * 136, [[0]], None)


def test_a_phase_is_checked_for_its_validation_data_not_its_training_offset():
    """--phase-transition-iterations: Megatron's training loader starts at this phase's own
    samples ((iteration - last transition) x global batch, sized for the phase), whatever the
    checkpoint's run consumed in all; its validation loader continues the checkpoint's
    evaluated samples as any resume's, and asserts "no samples left to consume" alike."""
    phase = _data_args(iteration=16, train_iters=32, phase_transition_iterations=[16, 24])
    assert data_left.data_left_refusal(phase, 64, 200) is None  # training: the phase's 64 of 64
    assert "validation data holds 113 samples" in data_left.data_left_refusal(phase, 64, 113)
    # the transition at the loaded iteration is behind it (Megatron checks its transitions
    # after each step): the run exits at 24, evaluating 2 x 16 at 20 and 24, 128 + 32 of 160
    phase.eval_iters = 2
    assert data_left.data_left_refusal(phase, 64, 160) is None
    assert "evaluates 32 more (2 evaluations" in data_left.data_left_refusal(phase, 64, 159)


def test_cyclic_and_external_data_loaders_are_not_checked():
    """--dataloader-type cyclic: megatron-core 0.19.2's MegatronPretrainingRandomSampler wraps
    around the data in epochs (no "no samples left" assert, no StopIteration); external: the
    user's own loaders. The same offsets a single loader cannot serve pass."""
    for kind, refused in (("single", True), ("cyclic", False), ("external", False)):
        args = _data_args(dataloader_type=kind)
        assert (data_left.data_left_refusal(args, 99, 100) is not None) is refused, kind


def test_validation_data_that_runs_out_in_the_middle_of_an_evaluation_is_refused():
    """The validation data holds the evaluated samples' offset, not this run's evaluations after
    it: Megatron evaluates --eval-iters x global batch at each multiple of --eval-interval after
    the loaded iteration (from --start-eval-at-iter) and once after the loop, unless it exits
    first (--exit-interval, a phase transition); the evaluation reaching the data's end stops."""
    # a release whose run evaluated 128 samples, this run: 8 iterations, 2 x 8 samples at 4, 8
    # and after the loop (3 x 16 = 48): 176 of its 200 fit, 175 do not
    args = _data_args(train_iters=8, consumed_train_samples=0, eval_iters=2)
    assert data_left.data_left_refusal(args, 999, 176) is None
    assert data_left.data_left_refusal(args, 999, 175) == (
        "--load /ckpt: a release checkpoint without --finetune continues the validation data "
        "after the 128 samples its run evaluated, and this run evaluates 48 more (3 evaluations "
        "of --eval-iters 2 x 8 samples), but this run's validation data holds 175 samples (sized "
        "for this run's evaluations in whole epochs of the data): megatron-core 0.19.2 fails on "
        "every rank with a StopIteration in the evaluation that reaches its end; "
        f"{RELEASE_WAYS}"
    )
    # --eval-global-batch-size 4 (Megatron's evaluation batch): 3 x 2 x 4 = 24 of 152
    halved = _data_args(train_iters=8, consumed_train_samples=0, eval_iters=2)
    halved.eval_global_batch_size = 4
    assert data_left.data_left_refusal(halved, 999, 152) is None
    assert "evaluates 24 more (3 evaluations of --eval-iters 2 x 4 samples)" in (
        data_left.data_left_refusal(halved, 999, 151)
    )
    # a resume of iteration 4: the evaluations at 8 and after the loop
    resumed = _data_args(iteration=4, train_iters=8, consumed_train_samples=0, eval_iters=2)
    assert data_left.data_left_refusal(resumed, 999, 160) is None
    assert "evaluates 32 more (2 evaluations" in data_left.data_left_refusal(resumed, 999, 159)
    # --start-eval-at-iter 8: the one at 8 and after the loop
    args.start_eval_at_iter = 8
    assert data_left.data_left_refusal(args, 999, 160) is None
    assert "evaluates 32 more (2 evaluations" in data_left.data_left_refusal(args, 999, 159)
    # --exit-interval 4: the one at 4, then the run exits (no final evaluation): 16
    exits = _data_args(train_iters=8, consumed_train_samples=0, eval_iters=2, exit_interval=4)
    assert data_left.data_left_refusal(exits, 999, 144) is None
    assert "evaluates 16 more (1 evaluation of" in data_left.data_left_refusal(exits, 999, 143)
    # --exit-interval 8 = --train-iters: it exits at 8 too, with no final evaluation: 32
    exits.exit_interval = 8
    assert data_left.data_left_refusal(exits, 999, 160) is None
    assert "evaluates 32 more (2 evaluations" in data_left.data_left_refusal(exits, 999, 159)
    # --eval-iters 0 or --full-validation: nothing read past the offset
    assert data_left.data_left_refusal(_data_args(train_iters=8, eval_iters=0), 999, 129) is None
    full = _data_args(train_iters=8, eval_iters=2, full_validation=True)
    assert data_left.data_left_refusal(full, 999, 129) is None
