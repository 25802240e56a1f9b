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
    logger.excluded(save_checkpoint)()
    logger.excluded(save_checkpoint)()  # a save and an evaluation between two steps: both out
    assert step(2.0)["step_time_s"] == pytest.approx(2.0)


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


def test_each_balance_tag_gets_the_steps_number_and_an_unmeasured_step_writes_none(
    monkeypatch, tmp_path
):
    """The six ``balance/`` tags and ``throughput/tokens_per_s`` by name, each with its number over
    the layers (mean MaxVio, max MaxVio, least / most loaded expert, mean fraction under half the
    mean, dead experts summed); a step that measured none of them (no MoE layer, no step time)
    writes no scalar, not a 0 / NaN / None (TensorBoard's add_scalar takes no None). The JSONL
    layer entry keeps its keys in order with integer counts (``4``, not ``4.0``)."""
    clock = FakeClock()
    monkeypatch.setattr(balance_logging.time, "time", clock.time)
    tb, path, iteration = FakeWriter(), tmp_path / "balance.jsonl", {"n": 1}
    logger = balance_logging.BalanceLogger(
        num_layers=2,
        num_experts=4,
        tokens_per_step=30,
        iteration_fn=lambda: iteration["n"],
        log_interval=1000,
        jsonl_path=str(path),
        writer_fn=lambda: tb,
        is_logging_rank=True,
    )
    logger.on_step_end([], routers=[])  # no MoE layer, no forward marked: nothing measured
    assert tb.scalars == {}
    iteration["n"] = 2
    clock.now += 3.0
    routers = [FakeRouter(1, 1.5, [0, 1, 9, 10]), FakeRouter(2, 0.5, [2, 3, 3, 4])]
    logger.on_step_end([], routers=routers)
    assert tb.scalars == {
        "balance/maxvio_mean": [(2, 1.0)],
        "balance/maxvio_max": [(2, 1.5)],
        "balance/min_load": [(2, 0)],
        "balance/max_load": [(2, 10)],
        "balance/frac_under_half": [(2, 0.25)],
        "balance/num_dead": [(2, 1)],
        "throughput/tokens_per_s": [(2, 10.0)],
    }
    assert (
        path.read_text()
        .splitlines()[1]
        .endswith(
            '"layers": [{"layer": 1, "max_vio": 1.5, "min_load": 0, "max_load": 10, '
            '"frac_under_half": 0.5, "num_dead": 1, "num_tokens": 10, "loads": [0, 1, 9, 10]}, '
            '{"layer": 2, "max_vio": 0.5, "min_load": 2, "max_load": 4, "frac_under_half": 0.0, '
            '"num_dead": 0, "num_tokens": 6, "loads": [2, 3, 3, 4]}]}'
        )
    )


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

    def resumed_run_step():
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

    path.write_text('{"iteration": 1, "loss": 9.0}\n{"iteration": 2, "loss": 8.0}\n{"itera')
    resumed_run_step()
    assert [(r["iteration"], r["loss"]) for r in read_records(str(path))] == [(1, 9.0), (2, 3.5)]
    assert path.read_text().splitlines()[2] == '{"itera'
    for start in ("", '{"iteration": 1, "loss": 9.0}\n'):  # an empty file; whole lines
        path.write_text(start)
        resumed_run_step()
        assert len(path.read_text().splitlines()) == start.count("\n") + 1


def test_the_record_recounts_each_layer_from_its_routing_map(monkeypatch, tmp_path, capsys):
    """Each MoE layer's record is its router's metrics (recounted here from a top-2 routing map
    over 4 experts), with the per-expert loads at iteration 1 and every ``loads_interval``; the
    step's numbers over the layers; the loss as the token-weighted mean of the step's
    micro-batches; a ``[balance]`` line at the first step and every ``log_interval``."""
    import json
    import math
    from types import SimpleNamespace

    from megatron_latentmoe.moe.balance_step import BalanceMetrics

    clock = FakeClock()
    monkeypatch.setattr(balance_logging.time, "time", clock.time)
    maps = {  # tokens x experts
        2: [[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 0], [1, 0, 0, 1]],  # loads 4 2 1 1, mean 2
        4: [[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 0], [0, 1, 1, 0]],  # loads 2 3 3 0
    }
    routers = []
    for layer, routing_map in maps.items():
        loads = torch.tensor(routing_map).sum(0)
        metrics = BalanceMetrics.from_loads(loads, len(routing_map))
        routers.append(
            SimpleNamespace(layer_number=layer, last_balance=metrics, last_loads_E=loads)
        )
    routers[0].step_loads_E = routers[0].last_loads_E
    skipped = dict(last_balance=routers[0].last_balance, last_loads_E=torch.ones(4))
    routers.append(SimpleNamespace(layer_number=5, **skipped))  # not a layer of the model
    routers.append(SimpleNamespace(layer_number=None, **skipped))
    routers.append(SimpleNamespace(layer_number=1, last_balance=None, last_loads_E=None))
    iteration = {"n": 0}
    path = tmp_path / "balance.jsonl"
    logger = balance_logging.BalanceLogger(
        num_layers=4,
        num_experts=4,
        tokens_per_step=64,
        iteration_fn=lambda: iteration["n"],
        log_interval=2,
        loads_interval=3,
        jsonl_path=str(path),
        is_logging_rank=True,
    )
    for n in (1, 2, 3):
        iteration["n"] = n
        logger.mark_forward()
        if n != 2:
            logger.add_loss(torch.tensor([10.0, 4.0]))  # two micro-batches: 12 / 6 tokens
            logger.add_loss(torch.tensor([2.0, 2.0], dtype=torch.bfloat16))
        clock.now += 2.0
        logger.on_step_end([], routers=routers)
    layer_2 = dict(layer=2, max_vio=1.0, min_load=1, max_load=4, frac_under_half=0.0)
    layer_2.update(num_dead=0, num_tokens=4, loads=[4, 2, 1, 1])
    layer_4 = dict(layer=4, max_vio=0.5, min_load=0, max_load=3, frac_under_half=0.25)
    layer_4.update(num_dead=1, num_tokens=4, loads=[2, 3, 3, 0])
    want = dict(iteration=1, loss=2.0, loss_tokens=6, step_time_s=2.0, tokens_per_s=32.0)
    want.update(maxvio_mean=0.75, maxvio_max=1.0, min_load=0, max_load=4, frac_under_half=0.125)
    want.update(num_dead=1, num_experts=4, layers=[layer_2, layer_4])
    first, second, third = [json.loads(line) for line in path.read_text().splitlines()]
    assert first == want
    assert third == dict(want, iteration=3)
    assert math.isnan(second.pop("loss")) and second.pop("loss_tokens") == 0  # no training loss
    no_loads = [{k: v for k, v in e.items() if k != "loads"} for e in want["layers"]]
    rest = {k: v for k, v in want.items() if k not in ("loss", "loss_tokens")}
    assert second == dict(rest, iteration=2, layers=no_loads)
    assert [r["iteration"] for r in logger.history] == [1, 2, 3]
    assert "layers" not in logger.history[0]
    assert capsys.readouterr().out.splitlines() == [
        " [balance] iteration       1 | lm loss (this iteration) 2.0000 | tokens/s 32 | MaxVio "
        "mean 0.750 max 1.000 | load min/max 0/4 | under-half 0.125 | dead 1",
        " [balance] iteration       2 | lm loss (this iteration) n/a | tokens/s 32 | MaxVio mean "
        "0.750 max 1.000 | load min/max 0/4 | under-half 0.125 | dead 1",
    ]


def test_balance_log_file_flag_resolves_to_a_path():
    from types import SimpleNamespace

    path = balance_logging.default_jsonl_path
    assert path(SimpleNamespace(balance_log_file="/runs/b.jsonl", save="/ck")) == "/runs/b.jsonl"
    assert path(SimpleNamespace(balance_log_file="None", save="/ck")) is None
    assert path(SimpleNamespace(balance_log_file=None, save="/ck")) == "/ck/balance.jsonl"
    assert path(SimpleNamespace(balance_log_file=None, save=None)) is None
    assert path(SimpleNamespace()) is None


@pytest.mark.parametrize("deferring", [False, True])
def test_grad_finalisation_is_followed_by_the_step_end(monkeypatch, deferring):
    """Megatron's grad finalisation, then the balance update and its log; a rescored step (QB
    rescoring deferring) arms the drift correction instead and leaves the step end for later."""
    from types import SimpleNamespace

    events = []
    monkeypatch.setattr(
        balance_logging, "finalize_model_grads", lambda *a, **k: events.append(("grads", a, k))
    )
    monkeypatch.setattr(balance_logging, "update_balance", lambda *a: events.append(("update", *a)))
    logger = SimpleNamespace(on_step_end=lambda model: events.append(("log", model)))
    rescore = SimpleNamespace(
        deferring=deferring, before_optimizer_step=lambda m: events.append(("arm", m))
    )
    finalize = balance_logging.make_finalize_model_grads_func(logger, rescore)
    finalize(["chunk"], num_tokens=7, pg_collection="groups", force_all_reduce=True)
    grads = (
        "grads",
        (["chunk"],),
        dict(num_tokens=7, pg_collection="groups", force_all_reduce=True),
    )
    if deferring:
        assert events == [grads, ("arm", ["chunk"])]
    else:
        assert events == [grads, ("update", ["chunk"], True), ("log", ["chunk"])]
    events.clear()
    balance_logging.make_finalize_model_grads_func(None)(["chunk"])  # no logger, no rescoring
    grads = (
        "grads",
        (["chunk"],),
        dict(num_tokens=None, pg_collection=None, force_all_reduce=False),
    )
    assert events == [grads, ("update", ["chunk"], True)]


def test_one_process_logs_and_other_ranks_only_gather(monkeypatch, tmp_path, capsys):
    """In one process this rank is Megatron's logging rank; a rank that is not writes nothing.
    The loss pairs add up in float64; a model without MoE layers logs no layer; the tokens/s
    scalar is left out while there is no step time; per-layer scalars only when asked."""
    import math

    clock = FakeClock()
    monkeypatch.setattr(balance_logging.time, "time", clock.time)
    path, tb = tmp_path / "balance.jsonl", FakeWriter()
    iteration = {"n": 1}
    kwargs = dict(num_layers=2, num_experts=2, tokens_per_step=8, jsonl_path=str(path))
    kwargs.update(iteration_fn=lambda: iteration["n"], writer_fn=lambda: tb)
    kwargs.update(log_interval=0, tensorboard_log_interval=0, loads_interval=0)  # 0 counts as 1
    quiet = balance_logging.BalanceLogger(**kwargs, is_logging_rank=False)
    assert quiet.on_step_end([torch.nn.Linear(2, 2)]) is None and not path.exists()
    logger = balance_logging.BalanceLogger(**kwargs)
    assert logger.is_logging_rank is True
    logger.add_loss(torch.tensor([1e8, 1.0]))
    logger.add_loss(torch.tensor([1.0, 1.0]))  # float32 would drop it: 1e8 + 1 == 1e8
    record = logger.on_step_end([torch.nn.Linear(2, 2)])  # no MoE layer; no forward marked
    assert record["loss"] == 50000000.5 and record["loss_tokens"] == 2
    assert record["layers"] == [] and record["num_dead"] is None and record["min_load"] is None
    assert math.isnan(record["tokens_per_s"])
    iteration["n"] = 2
    clock.now += 2.0
    logger.on_step_end([], routers=[FakeRouter(2, 0.5, [3, 5])])
    assert tb.scalars["throughput/tokens_per_s"] == [(2, 4.0)]
    assert tb.scalars["balance/maxvio_mean"] == [(2, 0.5)]
    assert sorted(tb.scalars) == [f"balance/{key}" for key in sorted(balance_logging._TB_KEYS)] + [
        "throughput/tokens_per_s"
    ]
    assert (
        len(path.read_text().splitlines()) == 2 and len(capsys.readouterr().out.splitlines()) == 2
    )
    first = balance_logging.BalanceLogger(**dict(kwargs, jsonl_path=None))
    for _ in range(2):  # two micro-batches: the step is timed from the first one's forward
        first.mark_forward()
        clock.now += 1.0
    assert first.excluded(lambda x: x + 1)(2) == 3  # the wrapped call's result
    assert first.on_step_end([], routers=[])["step_time_s"] == 2.0
    first.add_loss(torch.tensor([3.0, 1.0]))  # one loss token
    assert first.on_step_end([], routers=[])["loss"] == 3.0
    defaults = balance_logging.BalanceLogger(
        num_layers=2, num_experts=2, tokens_per_step=8, iteration_fn=lambda: 1
    )
    assert (defaults.log_interval, defaults.tensorboard_log_interval) == (1, 1)
    assert (defaults.loads_interval, defaults.per_layer_tensorboard) == (1, False)


def test_the_stdout_line_says_n_a_for_what_a_step_did_not_measure():
    """A model without an MoE layer (or a step without tokens) has no load figures: each reads
    n/a, as the loss and MaxVio do, not None."""
    format_record = balance_logging.format_record
    record = dict(
        iteration=7,
        loss=2.5,
        tokens_per_s=1234.6,
        maxvio_mean=0.25,
        maxvio_max=0.5,
        min_load=3,
        max_load=40,
        frac_under_half=0.125,
        num_dead=1,
    )
    assert format_record(record) == (
        " [balance] iteration       7 | lm loss (this iteration) 2.5000 | tokens/s 1,235 | "
        "MaxVio mean 0.250 max 0.500 | load min/max 3/40 | under-half 0.125 | dead 1"
    )
    balanced = dict(record, loss=0.0, **dict.fromkeys(list(record)[3:], 0))
    assert format_record(balanced) == (  # zeros keep their format: a perfectly balanced step
        " [balance] iteration       7 | lm loss (this iteration) 0.0000 | tokens/s 1,235 | "
        "MaxVio mean 0.000 max 0.000 | load min/max 0/0 | under-half 0.000 | dead 0"
    )
    empty = dict(record, loss=float("nan"), **dict.fromkeys(list(record)[3:]))
    assert format_record(empty) == (
        " [balance] iteration       7 | lm loss (this iteration) n/a | tokens/s 1,235 | "
        "MaxVio mean n/a max n/a | load min/max n/a/n/a | under-half n/a | dead n/a"
    )


class FakeDist:
    """``torch.distributed`` as rank ``rank`` of two sees it, each group with the other rank: an
    all-reduce adds that rank's tensor (``peers[group]``, none: nothing) and records what this
    rank sent."""

    def __init__(self, peers, rank=1):
        self.peers, self.sent, self.rank = peers, {}, rank

    def is_initialized(self):
        return True

    def get_rank(self):
        return self.rank

    def get_world_size(self, group=None):
        return 2

    def all_reduce(self, tensor, group=None):
        self.sent[group] = tensor.clone()
        if group in self.peers:
            tensor += self.peers[group]


def test_the_logging_rank_gathers_the_loss_over_dp_and_the_layers_over_pp(monkeypatch):
    """PP2 x DP2 from the logging rank (last stage): the first stage's layer rows come with the
    pipeline all-reduce; the loss is the token mean over both data-parallel ranks' pairs (the
    rank's own pair alone: 2.5); dead experts add up over the layers."""
    kwargs = dict(num_layers=2, num_experts=2, tokens_per_step=8, iteration_fn=lambda: 1)
    kwargs.update(dp_group=lambda: "dp", pp_group=lambda: "pp", jsonl_path=None)
    first_stage = FakeDist({})
    monkeypatch.setattr(balance_logging, "dist", first_stage)
    stage_0 = balance_logging.BalanceLogger(
        **kwargs, is_logging_rank=False, is_last_stage=lambda: False
    )
    assert stage_0.on_step_end([], routers=[FakeRouter(1, 0.5, [0, 6])]) is None
    assert list(first_stage.sent) == ["pp"]  # the loss is the last stage's
    other_dp_rank = torch.tensor([6.0, 4.0], dtype=torch.float64)
    last_stage = FakeDist({"dp": other_dp_rank, "pp": first_stage.sent["pp"]})
    monkeypatch.setattr(balance_logging, "dist", last_stage)
    logger = balance_logging.BalanceLogger(**kwargs, is_logging_rank=True)
    logger.add_loss(torch.tensor([10.0, 4.0]))
    record = logger.on_step_end([], routers=[FakeRouter(2, 1.5, [0, 8])])
    assert (record["loss"], record["loss_tokens"]) == (2.0, 8)
    layers = [(e["layer"], e["max_vio"], e["loads"]) for e in record["layers"]]
    assert layers == [(1, 0.5, [0, 6]), (2, 1.5, [0, 8])]
    assert (record["maxvio_mean"], record["num_dead"], record["max_load"]) == (1.0, 2, 8)


@pytest.mark.parametrize("rank, logging", [(1, True), (0, False)])
def test_megatrons_last_rank_is_the_logging_rank(monkeypatch, rank, logging):
    """By default the logger writes on the last rank, where Megatron makes the TensorBoard writer
    (on another rank the writer is None: no scalars at all)."""
    monkeypatch.setattr(balance_logging, "dist", FakeDist({}, rank=rank))
    logger = balance_logging.BalanceLogger(
        num_layers=1, num_experts=2, tokens_per_step=8, iteration_fn=lambda: 1
    )
    assert logger.is_logging_rank is logging


def test_a_full_disk_under_the_jsonl_is_an_oserror_naming_the_file():
    """``/dev/full``: the record's write fails with ENOSPC at the buffered file's close, which
    names no file (measured on a full tmpfs: ``OSError: [Errno 28] No space left on device``);
    the error reaches ``pretrain._main`` as that ``OSError`` with the JSONL's name, for its line."""
    import errno

    logger = balance_logging.BalanceLogger(
        num_layers=1,
        num_experts=2,
        tokens_per_step=10,
        iteration_fn=lambda: 1,
        log_interval=1000,
        jsonl_path="/dev/full",
        is_logging_rank=True,
    )
    logger.add_loss(torch.tensor([14.0, 4.0]))
    with pytest.raises(OSError) as err:
        logger.on_step_end([], routers=[])
    assert type(err.value) is OSError and err.value.errno == errno.ENOSPC
    assert err.value.filename == "/dev/full"
