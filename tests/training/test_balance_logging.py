"""BalanceLogger's throughput (training/balance_logging.py): a step is timed from the end of the
previous one, minus what ran between steps outside training (a checkpoint save, an evaluation),
so the step after a save reports the same tokens/s as its neighbours. Fake clock, one process."""

from __future__ import annotations

import pytest

from megatron_latentmoe.training import balance_logging


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now


def test_time_outside_training_is_not_counted(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(balance_logging.time, "time", clock.time)
    iteration = {"n": 0}
    logger = balance_logging.BalanceLogger(
        num_layers=1,
        num_experts=2,
        tokens_per_step=1000,
        iteration_fn=lambda: iteration["n"],
        log_interval=1000,
        is_logging_rank=True,
    )

    def step(seconds):
        iteration["n"] += 1
        logger.mark_forward()
        clock.now += seconds
        return logger.on_step_end([], routers=[])

    def save_checkpoint():
        clock.now += 30.0  # a slow save between two steps

    assert step(2.0)["tokens_per_s"] == pytest.approx(500.0)  # timed from the first forward
    assert step(2.0)["tokens_per_s"] == pytest.approx(500.0)
    logger.excluded(save_checkpoint)()
    after_save = step(2.0)
    assert after_save["step_time_s"] == pytest.approx(2.0)
    assert after_save["tokens_per_s"] == pytest.approx(500.0)
    clock.now += 3.0  # not excluded (data loading, optimizer step): it counts
    assert step(1.0)["step_time_s"] == pytest.approx(4.0)
