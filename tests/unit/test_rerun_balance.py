"""training/rerun_balance.py: the step-end state saved and restored through Megatron's rerun state
machine hooks, the balance record of a pass held until ``train_step`` returns (the end-to-end
run: tests/training/test_rerun.py)."""

from __future__ import annotations

import json

import pytest
import torch
from megatron.core import rerun_state_machine as rsm

from megatron_latentmoe.training.balance_logging import BalanceLogger
from megatron_latentmoe.training.rerun_balance import RerunBalance


def _logger(path) -> BalanceLogger:
    return BalanceLogger(
        num_layers=1,
        num_experts=2,
        tokens_per_step=4,
        iteration_fn=lambda: 7,
        jsonl_path=str(path),
        is_logging_rank=True,
    )


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("deferred", [False, True], ids=["step-end-per-pass", "rescoring"])
def test_a_pass_run_again_leaves_one_record_with_the_last_pass_loss(
    monkeypatch, tmp_path, deferred
):
    """A re-run's restore drops the first pass's held record and loss; the record written after
    train_step is the last pass's, also where QB's rescoring defers the step end behind the
    passes (``deferred``). Megatron's own hooks still get their state."""
    path = tmp_path / "balance.jsonl"
    logger = _logger(path)
    megatron_calls = []
    machine = rsm.RerunStateMachine(
        state_save_func=lambda: {"rng": "saved"},
        state_restore_func=megatron_calls.append,
        mode=rsm.RerunMode.VALIDATE_RESULTS,
    )
    monkeypatch.setattr(rsm, "get_rerun_state_machine", lambda: machine)

    def train_step(
        forward_step_func, data_iterator, model, config, forward_backward_func, iteration
    ):
        saved = machine.state_save_func()  # the machine: at the start of the iteration
        for loss in (5.0, 3.0):  # the first pass, then the re-run
            logger.add_loss(torch.tensor([loss, 1.0]))
            if not deferred:
                logger.on_step_end(model)
            if loss == 5.0:
                machine.state_restore_func(saved)  # the machine: before the re-run
        if deferred:
            logger.on_step_end(model)
        assert _records(path) == []  # held
        return "out"

    step = RerunBalance(logger).wrap_train_step(train_step)
    assert step(None, None, [], None, None, 6) == "out"
    assert [r["loss"] for r in _records(path)] == [3.0]
    assert megatron_calls == [{"rng": "saved"}]
    assert not logger.hold_records


def test_with_the_machine_disabled_nothing_is_hooked_nor_held(monkeypatch, tmp_path):
    path = tmp_path / "balance.jsonl"
    logger = _logger(path)
    machine = rsm.RerunStateMachine(mode=rsm.RerunMode.DISABLED)
    monkeypatch.setattr(rsm, "get_rerun_state_machine", lambda: machine)

    def train_step(
        forward_step_func, data_iterator, model, config, forward_backward_func, iteration
    ):
        logger.on_step_end(model)
        assert len(_records(path)) == 1  # written at the step end, as before
        return "out"

    assert RerunBalance(logger).wrap_train_step(train_step)(None, None, [], None, None, 0) == "out"
    assert machine.state_save_func is None and machine.state_restore_func is None
