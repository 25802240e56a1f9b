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


def test_mean_router_input_fixed_point_words():
    """The mean router input rides the integer all-reduce as each rank's summed input,
    x = round(clamp(sum, +-15 per token) * 2**12), in two words per feature: x mod 2**16, then
    floor(x / 2**16). Summed over ranks the reader gets the mean over every token, weighted by
    the ranks' token counts (never a division by 0); over MAX_RANKS ranks at the clamp and the
    most tokens a step may hold, both words stay inside int32."""
    from megatron_latentmoe.balancing import INT32_MAX, MAX_RANKS
    from megatron_latentmoe.moe.balance_step import (
        _FIXED_CLAMP,
        _FIXED_SCALE,
        _from_fixed,
        _to_fixed,
    )

    assert (_FIXED_SCALE, _FIXED_CLAMP) == (4096.0, 15.0)
    words = _to_fixed(torch.tensor([1.0, -20.0, 20.0, 0.3, -0.3]), torch.tensor(1))
    assert words.dtype == torch.int32
    # x = [4096, -61440 (clamped), 61440 (clamped), 1229, -1229]
    assert words.tolist() == [4096, 4096, 61440, 1229, 64307] + [0, -1, 0, 0, -1]
    # two ranks: 3 tokens summing to (3, 1.5, 1e4) and 1 token (-1, 0.5, -15): weighted by 3 and 1
    rank_a = _to_fixed(torch.tensor([3.0, 1.5, 1e4]), torch.tensor(3))
    rank_b = _to_fixed(torch.tensor([-1.0, 0.5, -15.0]), torch.tensor(1))
    mean = _from_fixed(rank_a + rank_b, torch.tensor(4))
    assert mean.dtype == torch.float32 and mean.tolist() == [0.5, 0.5, (45 - 15) / 4]
    assert _from_fixed(torch.zeros(4, dtype=torch.int32), torch.tensor(0)).tolist() == [0.0, 0.0]
    # MAX_RANKS ranks, INT32_MAX tokens in all, every input at +15 or -15: exact, inside int32
    tokens = INT32_MAX // MAX_RANKS
    for sign in (1.0, -1.0):
        rank = _to_fixed(torch.tensor([sign * _FIXED_CLAMP * tokens]), torch.tensor(tokens))
        total = rank.to(torch.int64) * MAX_RANKS  # the all-reduce's sum, before any wrap
        assert total.abs().max() <= INT32_MAX, total
        mean = _from_fixed(total.to(torch.int32), torch.tensor(tokens * MAX_RANKS))
        assert mean.tolist() == [sign * _FIXED_CLAMP]


def test_routers_of_different_token_groups_are_refused():
    """The step end sums every router's counts in ONE all-reduce: over the one token group they
    share; two routers whose token groups differ are refused, naming the count."""
    from types import SimpleNamespace

    from megatron_latentmoe.moe.balance_step import _token_group

    shared = object()
    assert _token_group([SimpleNamespace(token_group=shared)] * 2) is shared
    routers = [SimpleNamespace(token_group=object()) for _ in range(2)]
    with pytest.raises(ValueError, match="hold 2 different token-parallel groups"):
        _token_group(routers)
