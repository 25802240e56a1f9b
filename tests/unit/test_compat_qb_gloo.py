"""compat.qb_gloo: Megatron's quantile-balancing bias update with AVG written as SUM / group size
(gloo refused AVG before torch 2.8), checked in one process against Megatron's own function; the
all-reduce of a second data-parallel rank is simulated. On the pinned torch the shim stays off and
tests/parallel/test_balancers_ep2.py runs Megatron's own update on real gloo."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from megatron_latentmoe.compat import qb_gloo, registry

OTHER_RANK = torch.tensor([[1.0, 2.0, 3.0, 8.0], [4.0, 0.0, 0.0, 0.0]])  # its per-router averages
GROUP = object()  # the dp_cp group handed through


class _Router(torch.nn.Module):
    """What the update reads of a router: qb_beta and its per-micro-batch accumulators."""

    def __init__(self, beta, accum, count):
        super().__init__()
        self.register_buffer("qb_beta", torch.tensor(beta))
        self.register_buffer("qb_beta_accum", torch.tensor(accum))
        self.register_buffer("qb_beta_count", torch.tensor(count))


def _model():
    chunk = torch.nn.Module()
    chunk.routers = torch.nn.ModuleList(
        [
            _Router([0.4, -0.4, 0.2, -0.2], [2.0, 4.0, 6.0, 8.0], 2),  # local average [1, 2, 3, 4]
            _Router([0.0] * 4, [0.0] * 4, 0),  # no token routed here yet: average 0, not 0 / 0
            _Router([1.0, 0.0, 0.0, -1.0], [9.0] * 4, 1),  # eval mode: left alone
        ]
    )
    chunk.routers[2].eval()
    return [chunk]


def _update(monkeypatch, update, op):
    """Run ``update`` with a two-rank all-reduce of ``op`` (SUM or AVG); returns the betas."""

    def all_reduce(tensor, op=None, group=None):
        assert (op, group) == (expected_op, GROUP)
        tensor.add_(OTHER_RANK)
        if op == torch.distributed.ReduceOp.AVG:
            tensor.div_(2)

    expected_op = op
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    model = _model()
    update(model, types.SimpleNamespace(moe_router_quantile_balancing_ema=0.75), GROUP)
    return [r.qb_beta.tolist() for r in model[0].routers]


def test_update_is_megatrons_with_sum_over_group_size(monkeypatch):
    ours = _update(monkeypatch, qb_gloo._update_router_qb_beta, torch.distributed.ReduceOp.SUM)
    megatron = importlib.import_module(qb_gloo._MODULE)._update_router_qb_beta
    if registry.is_applied(qb_gloo.GROUP):
        (megatron,) = [v for _, n, v in registry.patched(qb_gloo.GROUP)]
    assert _update(monkeypatch, megatron, torch.distributed.ReduceOp.AVG) == ours
    # DP mean [1, 2, 3, 6]: 0.75 * beta + 0.25 * mean, centred; [2, 0, 0, 0]: likewise
    assert ours[0] == pytest.approx([-0.2, -0.55, 0.15, 0.6])
    assert ours[1] == pytest.approx([0.375, -0.125, -0.125, -0.125])
    assert ours[2] == [1.0, 0.0, 0.0, -1.0]


def test_update_without_routers_communicates_nothing(monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: pytest.fail("reduced"))
    assert qb_gloo._update_router_qb_beta([torch.nn.Linear(2, 2)], None) is None


@pytest.fixture
def qb_gloo_off():
    """The group reverted for this test (re-applied afterwards if it was on before)."""
    was_applied = registry.is_applied(qb_gloo.GROUP)
    registry.revert(qb_gloo.GROUP)
    yield importlib.import_module(qb_gloo._MODULE)
    registry.revert(qb_gloo.GROUP)
    if was_applied:
        registry.apply_group(qb_gloo.GROUP, [qb_gloo._shim])


def test_applied_on_gloo_before_torch_2_8_only(qb_gloo_off, monkeypatch):
    fmg = qb_gloo_off
    megatrons = fmg._update_router_qb_beta
    backend = {"name": "nccl"}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend["name"])
    monkeypatch.setattr(torch, "__version__", "2.7.1")
    for backend["name"] in ("nccl", "mpi"):  # AVG works there: Megatron's function stays
        assert qb_gloo.apply_qb_gloo_compat() is False and fmg._update_router_qb_beta is megatrons
    backend["name"] = "gloo"
    for version in ("2.8.0", "2.13.0+cpu"):  # gloo takes AVG from torch 2.8 on
        monkeypatch.setattr(torch, "__version__", version)
        assert qb_gloo.apply_qb_gloo_compat() is False and fmg._update_router_qb_beta is megatrons
    monkeypatch.setattr(torch, "__version__", "2.7.1")
    assert qb_gloo.apply_qb_gloo_compat() is True
    assert fmg._update_router_qb_beta is qb_gloo._update_router_qb_beta
    backend["name"] = "nccl"  # already applied in this process: stays
    assert qb_gloo.apply_qb_gloo_compat() is True
    registry.revert(qb_gloo.GROUP)
    assert fmg._update_router_qb_beta is megatrons
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert qb_gloo.apply_qb_gloo_compat() is False


def test_refused_on_an_untested_megatron_core(qb_gloo_off, monkeypatch):
    """On gloo with another megatron-core the replacement is refused (Megatron's function may
    have changed), and nothing is patched or counted as applied."""
    import megatron.core

    fmg = qb_gloo_off
    megatrons = fmg._update_router_qb_beta
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(torch, "__version__", "2.7.1")
    monkeypatch.delenv(registry.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(megatron.core, "__version__", "0.19.3")
    with pytest.raises(RuntimeError, match="written for megatron-core 0.19.2, found 0.19.3"):
        qb_gloo.apply_qb_gloo_compat()
    assert fmg._update_router_qb_beta is megatrons and not registry.is_applied(qb_gloo.GROUP)


def _all_reduce_avg(rank, world_size):
    t = torch.tensor([float(rank), 2.0 * rank + 1, 4.0])  # numel != world size on purpose
    try:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.AVG)
    except RuntimeError as err:
        return str(err)
    return t.tolist()


def test_installed_torchs_gloo_averages_or_the_shim_is_on():
    """The torch gate is right for the installed torch: from 2.8 on a two-rank gloo all-reduce
    with AVG returns the mean (Megatron's own update works), before it gloo refuses AVG."""
    from torch.torch_version import TorchVersion

    from tests.parallel.launcher import run_distributed

    got = run_distributed(_all_reduce_avg, 2)
    if TorchVersion(torch.__version__) >= qb_gloo.GLOO_AVG_SINCE:
        assert got == [[0.5, 2.0, 4.0]] * 2
    else:
        assert all("Cannot use ReduceOp.AVG with Gloo" in g for g in got)
