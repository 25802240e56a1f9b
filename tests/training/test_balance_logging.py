"""BalanceLogger's throughput (training/balance_logging.py): a step is timed from the end of the
previous one, minus what ran between steps outside training (a checkpoint save, an evaluation),
so the step after a save reports the same tokens/s as its neighbours. Fake clock, one process."""

from __future__ import annotations

import pytest
import torch

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


class FakeWriter:
    """TensorBoard's ``add_scalar`` and W&B's ``log`` (Megatron's two writers), recorded."""

    def __init__(self):
        self.scalars = {}  # name -> [(step, value)]

    def add_scalar(self, name, value, step):
        self.scalars.setdefault(name, []).append((step, value))

    def log(self, data, step):
        for name, value in data.items():
            self.add_scalar(name, value, step)


class FakeRouter:
    def __init__(self, layer_number, max_vio, loads):
        from types import SimpleNamespace

        self.layer_number = layer_number
        self.last_loads_E = self.step_loads_E = torch.tensor(loads)
        mean = sum(loads) / len(loads)
        self.last_balance = SimpleNamespace(
            max_vio=max_vio,
            min_load=min(loads),
            max_load=max(loads),
            frac_under_half=sum(x < mean / 2 for x in loads) / len(loads),
            num_dead=sum(x == 0 for x in loads),
            num_tokens=sum(loads) // 2,
        )


def test_scalars_go_to_tensorboard_and_wandb_at_the_tensorboard_interval():
    """Megatron mirrors its MoE metrics to W&B (``--wandb-project``) under the TensorBoard names:
    the balance scalars follow, at ``--tensorboard-log-interval`` with the iteration as step, per
    layer (``--moe-per-layer-logging``) and over layers."""
    tb, wandb = FakeWriter(), FakeWriter()
    iteration = {"n": 0}
    logger = balance_logging.BalanceLogger(
        num_layers=3,
        num_experts=4,
        tokens_per_step=100,
        iteration_fn=lambda: iteration["n"],
        log_interval=1000,
        tensorboard_log_interval=2,
        writer_fn=lambda: tb,
        wandb_writer_fn=lambda: wandb,
        per_layer_tensorboard=True,
        is_logging_rank=True,
    )
    routers = [FakeRouter(2, 0.5, [30, 60, 50, 60]), FakeRouter(3, 1.5, [0, 100, 50, 50])]
    for n in (1, 2, 3, 4):
        iteration["n"] = n
        logger.mark_forward()
        logger.on_step_end([], routers=routers)
    assert wandb.scalars.keys() == tb.scalars.keys()
    for name, points in tb.scalars.items():
        assert [step for step, _ in points] == [2, 4], name
        assert wandb.scalars[name] == points, name
    assert tb.scalars["balance/maxvio_mean"] == [(2, 1.0), (4, 1.0)]
    assert tb.scalars["balance/maxvio_max"][0] == (2, 1.5)
    assert tb.scalars["balance/maxvio_layer_2"][0] == (2, 0.5)
    assert tb.scalars["balance/maxvio_layer_3"][0] == (2, 1.5)
    assert tb.scalars["balance/num_dead"][0] == (2, 1)
    assert "balance/maxvio_layer_1" not in tb.scalars  # a dense layer has no router


def test_pretrain_hands_megatron_wandb_writer_to_the_logger(monkeypatch):
    from types import SimpleNamespace

    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()
    import megatron.training

    from megatron_latentmoe.training import pretrain

    sentinel = object()
    monkeypatch.setattr(megatron.training, "get_wandb_writer", lambda: sentinel)
    args = SimpleNamespace(
        num_layers=2,
        num_experts=4,
        global_batch_size=2,
        seq_length=8,
        log_interval=1,
        tensorboard_log_interval=1,
        balance_log_loads_interval=1,
        moe_per_layer_logging=False,
    )
    logger = pretrain._make_balance_logger(args, None)
    assert logger.wandb_writer_fn() is sentinel


def test_a_resumed_run_starts_its_records_on_a_new_line(tmp_path):
    """A run killed while writing a record leaves a cut last line; the resumed run's first record
    goes on a line of its own (glued to the cut line it was unreadable, and the killed run's
    record of that iteration won)."""
    from megatron_latentmoe.training.balance_summary import read_records

    path = tmp_path / "balance.jsonl"
    path.write_text('{"iteration": 1, "loss": 9.0}\n{"iteration": 2, "loss": 8.0}\n{"itera')
    logger = balance_logging.BalanceLogger(
        num_layers=1,
        num_experts=2,
        tokens_per_step=10,
        iteration_fn=lambda: 2,  # resumed from the checkpoint of iteration 1
        log_interval=1000,
        jsonl_path=str(path),
        is_logging_rank=True,
    )
    logger.add_loss(torch.tensor([14.0, 4.0]))
    logger.on_step_end([], routers=[])
    assert [(r["iteration"], r["loss"]) for r in read_records(str(path))] == [(1, 9.0), (2, 3.5)]
    assert path.read_text().splitlines()[2] == '{"itera'
