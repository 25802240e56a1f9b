"""QB calibration's solver and trigger (``training/qb_calibrate.py``); the passes through
Megatron's schedule on every layout are ``tests/parallel/test_qb_calibrate.py``'s, a whole run
``tests/training/test_pretrain.py``'s."""

from __future__ import annotations

import torch

from megatron_latentmoe.balancing import CenteredQuantileHistogram, cutoff_route
from megatron_latentmoe.training.qb_calibrate import (
    QB_CALIBRATION_ITERS,
    QBCalibration,
    calibrate_bias,
)

N, K, TOKENS = 16, 2, 4096


def _scores(seed: int) -> torch.Tensor:
    """Sigmoid scores of a router that prefers a few experts (a fixed offset per expert)."""
    offset_E = torch.linspace(-1.0, 1.0, N) ** 3
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(TOKENS, N, generator=g) * 0.5 + offset_E)


def _max_vio(scores_ME, bias_E, valid_M=None) -> float:
    idx_MK, _ = cutoff_route(scores_ME, bias_E, K)
    if valid_M is not None:
        idx_MK = idx_MK[valid_M]
    loads = torch.bincount(idx_MK.reshape(-1), minlength=N).double()
    return ((loads.max() - loads.mean()) / loads.mean()).item()


def test_calibrated_bias_balances_the_pool_and_a_batch_outside_it():
    pool = [(_scores(seed), None) for seed in (1, 2)]
    zero = torch.zeros(N)
    hist = CenteredQuantileHistogram(N, K, num_bins=1000)
    bias, history = calibrate_bias(hist, zero, pool)
    assert len(history) == QB_CALIBRATION_ITERS + 1
    assert history[0] == _max_vio(torch.cat([s for s, _ in pool]), zero)  # recount, bias 0
    pooled = _max_vio(torch.cat([s for s, _ in pool]), bias)
    assert pooled == min(history)  # the iterate kept is the best one, recounted
    outside = _scores(3)
    print(
        f"MaxVio pool {history[0]:.3f} -> {pooled:.3f}; outside "
        f"{_max_vio(outside, zero):.3f} -> {_max_vio(outside, bias):.3f}"
    )
    assert history[0] > 1.0 and pooled < 0.05
    assert _max_vio(outside, zero) > 1.0 and _max_vio(outside, bias) < 0.15
    assert abs(bias.mean().item()) < 1e-6  # QB's bias stays mean-free


def test_padding_is_not_counted():
    scores = _scores(1)
    valid_M = torch.ones(TOKENS, dtype=torch.bool)
    valid_M[::3] = False
    # the padded tokens all prefer expert 0: counted, they would drive its bias down
    padded = scores.clone()
    padded[~valid_M, 0] = 1.0
    hist = CenteredQuantileHistogram(N, K, num_bins=1000)
    got, history = calibrate_bias(hist, torch.zeros(N), [(padded, valid_M)])
    want, _ = calibrate_bias(hist, torch.zeros(N), [(scores[valid_M], None)])
    assert torch.equal(got, want)
    assert history[0] == _max_vio(padded, torch.zeros(N), valid_M)


def test_only_a_run_that_starts_at_iteration_0_calibrates_once():
    def train_step(
        forward_step_func, data_iterator, model, config, forward_backward_func, iteration=None
    ):
        return iteration

    def calls(start: int) -> list[int]:
        cal = QBCalibration(
            2,
            train_iters=10,
            global_batch_size=8,
            seq_length=4,
            micro_batch_size=1,
            num_microbatches=lambda: 1,
        )
        seen = []
        cal.calibrate = lambda call: seen.append(call["iteration"])
        step = cal.wrap_train_step(train_step)
        assert [step(None, None, None, None, None, iteration=i) for i in (start, start + 1)] == [
            start,
            start + 1,
        ]
        return seen

    assert calls(0) == [0]  # a fresh run (or --finetune): once, before its first step
    assert calls(5) == []  # resumed: the checkpoint's bias


def test_wrappers_refuse_a_train_step_without_megatrons_argument_names():
    """Both train-step wrappers read Megatron's argument names from each call: a step taking
    other names is refused when wrapped (it used to fail with KeyError after its first step)."""
    import pytest

    from megatron_latentmoe.training.qb_rescore import QBRescore

    def natural(model, optimizer, data_iterator, iteration):
        return None

    def megatron_like(
        forward_step_func,
        data_iterator,
        model,
        optimizer,
        scheduler,
        config,
        forward_backward_func,
        iteration=0,
    ):
        return None

    shape = dict(seq_length=8, micro_batch_size=1)
    wrappers = {
        "QBRescore": QBRescore(2, lambda *a, **k: None, **shape).wrap_train_step,
        "QBCalibration": QBCalibration(
            2, train_iters=10, global_batch_size=2, log=lambda line: None, **shape
        ).wrap_train_step,
    }
    for who, wrap in wrappers.items():
        with pytest.raises(TypeError, match=f"{who}.wrap_train_step: .*missing forward_step_func"):
            wrap(natural)
        assert callable(wrap(megatron_like))
