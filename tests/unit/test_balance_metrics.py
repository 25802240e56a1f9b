"""BalanceMetrics (moe/balance_step.py): the per-layer balance numbers every log line shows."""

import pytest
import torch

from megatron_latentmoe.moe.balance_step import BalanceMetrics


def test_metrics_of_a_known_load_vector():
    # mean 6: max 10 -> MaxVio (10 - 6) / 6; one expert of four (load 2) is under half the mean
    m = BalanceMetrics.from_loads(torch.tensor([10, 2, 6, 6]), num_tokens=12)
    assert m.max_vio == pytest.approx(4 / 6)
    assert (m.min_load, m.max_load, m.num_tokens) == (2, 10, 12)
    assert m.frac_under_half == pytest.approx(0.25)
    assert m.num_dead == 0
    assert BalanceMetrics.from_loads(torch.tensor([8, 0, 4, 0]), num_tokens=6).num_dead == 2


def test_perfect_balance_and_exactly_half_the_mean():
    m = BalanceMetrics.from_loads(torch.tensor([4, 4, 4, 4]), num_tokens=8)
    assert m.max_vio == 0.0 and m.frac_under_half == 0.0
    # a load of exactly half the mean is not "under half"
    assert BalanceMetrics.from_loads(torch.tensor([2, 6]), num_tokens=4).frac_under_half == 0.0
    assert BalanceMetrics.from_loads(torch.tensor([1, 7]), num_tokens=4).frac_under_half == 0.5


def test_metrics_of_a_step_without_tokens_and_of_a_mean_load_of_one():
    """No token routed (every load 0): the ratios read 0, not a division by zero; a mean load of
    exactly 1 is a real mean (MaxVio (2 - 1) / 1)."""
    m = BalanceMetrics.from_loads(torch.zeros(4, dtype=torch.int64), num_tokens=0)
    assert (m.max_vio, m.frac_under_half, m.num_dead, m.num_tokens) == (0.0, 0.0, 4, 0)
    m = BalanceMetrics.from_loads(torch.tensor([2, 0, 1, 1]), num_tokens=2)
    assert m.max_vio == 1.0 and m.frac_under_half == 0.25 and m.num_dead == 1
