"""Per-iteration load-balance (and loss / throughput) logging for Megatron's training loop.

:func:`make_finalize_model_grads_func` runs :class:`BalanceLogger` right after the step-end
balance update (once per step, every rank), for every balancing type (``aux_loss``, sign update,
Megatron's ``quantile_balancing``, QB, ...); it gathers:

* per MoE layer: MaxVio, min / max expert load, fraction of experts under half the mean load,
  dead experts (load 0) (``router.last_balance``: global over the token-parallel ranks, padding
  excluded, the tokens the QB histogram observes) and, every
  ``loads_interval`` steps, the per-expert loads (global: one small integer all-reduce);
* the step's loss (token mean over the global batch: the ``[sum, count]`` pairs the forward step
  hands in, summed over data-parallel ranks) and tokens/s (global batch tokens / step-to-step
  wall time).

Pipeline stages hold different layers: every stage writes its rows into one ``[layers + 1, C]``
float64 tensor (row ``layer_number - 1``; the last row holds the loss, filled by the last stage)
and one SUM all-reduce over the pipeline group brings all of them to every stage, so the logging
rank (Megatron's: the last rank, which owns the TensorBoard writer) sees every layer.

Outputs on the logging rank: a ``[balance]`` line on stdout every ``log_interval`` steps (and
at the first step of the process, as Megatron's iteration line), scalars under ``balance/`` and
``throughput/`` every ``tensorboard_log_interval`` steps to TensorBoard (``--tensorboard-dir``) and
W&B (``--wandb-project``), under the same names with the iteration as step, as Megatron mirrors
its own MoE metrics, and one JSONL record per step (``tools/plot_balance.py`` reads it).
A resumed run appends; records of iterations re-run after a restart appear twice (readers keep
the last).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads

from megatron_latentmoe.moe.balance_step import balance_routers, update_balance

# One layer row of the gathered tensor: a "present" flag, these metrics (``router.last_balance``
# fields, and the keys of the layer's record) and then the optional per-expert loads.
_METRICS = (
    ("max_vio", float),
    ("min_load", int),
    ("max_load", int),
    ("frac_under_half", float),
    ("num_dead", int),
    ("num_tokens", int),
)
_FIXED_COLUMNS = 1 + len(_METRICS)
_TB_KEYS = ("maxvio_mean", "maxvio_max", "min_load", "max_load", "frac_under_half", "num_dead")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class BalanceLogger:
    """Collects the step's balance metrics and loss on every rank; writes on the logging rank.

    Args:
        num_layers: total transformer layers of the model (all pipeline stages).
        num_experts: routed experts per MoE layer.
        tokens_per_step: global batch tokens (global batch size x sequence length), or a
            callable returning those of the step being finalised (a batch-size schedule).
        iteration_fn: returns the iteration number of the step being finalised (1-based, the
            number Megatron prints for it).
        log_interval: stdout interval; tensorboard_log_interval: TensorBoard interval.
        loads_interval: per-expert loads go into the JSONL every this many steps.
        jsonl_path: the JSONL file (None: no file).
        writer_fn: returns the TensorBoard writer or None (Megatron creates it on the last rank).
        wandb_writer_fn: returns Megatron's W&B writer (the ``wandb`` module) or None.
        per_layer_tensorboard: also write per-layer MaxVio (``--moe-per-layer-logging``).
        is_logging_rank: defaults to "global rank == world size - 1" (Megatron's logging rank).
        dp_group / pp_group: callables returning the data-parallel (with CP) and pipeline groups.
        is_last_stage: callable, True on the last pipeline stage.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_experts: int,
        tokens_per_step: int | Callable[[], int],
        iteration_fn: Callable[[], int],
        log_interval: int = 1,
        tensorboard_log_interval: int = 1,
        loads_interval: int = 1,
        jsonl_path: str | None = None,
        writer_fn: Callable[[], object] = lambda: None,
        wandb_writer_fn: Callable[[], object] = lambda: None,
        per_layer_tensorboard: bool = False,
        is_logging_rank: bool | None = None,
        dp_group: Callable[[], dist.ProcessGroup | None] = lambda: None,
        pp_group: Callable[[], dist.ProcessGroup | None] = lambda: None,
        is_last_stage: Callable[[], bool] = lambda: True,
    ) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.tokens_per_step = tokens_per_step
        self.iteration_fn = iteration_fn
        self.log_interval = max(1, int(log_interval))
        self.tensorboard_log_interval = max(1, int(tensorboard_log_interval))
        self.loads_interval = max(1, int(loads_interval))
        self.jsonl_path = jsonl_path
        self.writer_fn = writer_fn
        self.wandb_writer_fn = wandb_writer_fn
        self.per_layer_tensorboard = per_layer_tensorboard
        if is_logging_rank is None:
            is_logging_rank = (
                not dist.is_initialized()
            ) or dist.get_rank() == dist.get_world_size() - 1
        self.is_logging_rank = is_logging_rank
        self._dp_group = dp_group
        self._pp_group = pp_group
        self._is_last_stage = is_last_stage
        self._loss = None  # float64 [sum, count] of this step's training micro-batches
        self._last_step_end: float | None = None
        self._first_forward: float | None = None
        self._excluded_s = 0.0  # time between step ends spent outside training (checkpoints, eval)
        self._printed_first = False
        self._jsonl_opened = False
        self.history: list[dict] = []  # records of this process (logging rank), for summaries
        self.hold_records = False
        """True: a step end keeps its record for :meth:`flush` (a pass Megatron's rerun state
        machine may run again: training/rerun_balance.py)."""
        self._held: dict | None = None

    # ------------------------------------------------------------------ fed by the forward step
    def mark_forward(self) -> None:
        """Called by the forward step: remembers when the first step of this process started."""
        if self._first_forward is None:
            self._first_forward = time.time()

    def add_loss(self, report: torch.Tensor) -> None:
        """Add one training micro-batch's ``[loss sum, token count]`` (detached)."""
        report = report.detach().to(torch.float64).view(-1)[:2]
        self._loss = (
            report.clone() if self._loss is None else self._loss + report.to(self._loss.device)
        )

    def excluded(self, fn: Callable) -> Callable:
        """``fn`` wrapped so that its run time (a checkpoint save, an evaluation) does not count
        in the next step's throughput."""

        def wrapper(*args, **kwargs):
            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._excluded_s += time.time() - start

        return wrapper

    # ------------------------------------------------------------------ step end
    @torch.no_grad()
    def on_step_end(self, model_chunks, routers=None) -> dict | None:
        """Gather this step's metrics (collective over DP and PP groups) and write them."""
        now = time.time()
        start = self._last_step_end if self._last_step_end is not None else self._first_forward
        step_time = (now - start - self._excluded_s) if start is not None else float("nan")
        self._last_step_end, self._excluded_s = now, 0.0
        iteration = int(self.iteration_fn())
        with_loads = iteration % self.loads_interval == 0 or iteration == 1
        routers = balance_routers(model_chunks) if routers is None else routers

        columns = _FIXED_COLUMNS + (self.num_experts if with_loads else 0)
        device = routers[0].step_loads_E.device if routers else _device_of(model_chunks)
        table = torch.zeros(self.num_layers + 1, columns, dtype=torch.float64, device=device)
        loads = [r.last_loads_E for r in routers] if with_loads else None
        for i, router in enumerate(routers):
            layer = getattr(router, "layer_number", None)
            metrics = getattr(router, "last_balance", None)
            if layer is None or metrics is None or not 1 <= layer <= self.num_layers:
                continue
            row = table[layer - 1]
            row[0] = 1
            for column, (key, _) in enumerate(_METRICS, 1):
                row[column] = getattr(metrics, key)
            if loads is not None and loads[i] is not None:
                row[_FIXED_COLUMNS:] = loads[i].to(device=device, dtype=torch.float64)

        if self._is_last_stage():
            loss = self._loss if self._loss is not None else torch.zeros(2, dtype=torch.float64)
            loss = loss.to(device)
            group = self._dp_group()
            if dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(loss, group=group)
            table[-1, 1:3] = loss
        self._loss = None
        group = self._pp_group()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(table, group=group)

        if not self.is_logging_rank:
            return None
        record = self._record(iteration, table.cpu(), with_loads, step_time)
        if self.hold_records:
            self._held = record
        else:
            self._write(record)
        return record

    def flush(self) -> None:
        """Write the record a step end held (:attr:`hold_records`), if any."""
        record, self._held = self._held, None
        if record is not None:
            self._write(record)

    def step_state(self) -> tuple:
        """What a step's passes change here, for :meth:`restore_step_state`."""
        return self._last_step_end, self._excluded_s, self._loss

    def restore_step_state(self, state: tuple) -> None:
        """Back to :meth:`step_state`'s: the step's time counts from the previous step end, its
        loss is the next pass's alone, and the held record of the pass run again is dropped."""
        self._last_step_end, self._excluded_s, self._loss = state
        self._held = None

    def _record(
        self, iteration: int, table: torch.Tensor, with_loads: bool, step_time: float
    ) -> dict:
        layers = []
        for index in range(self.num_layers):
            row = table[index]
            if row[0] <= 0:
                continue
            entry = {"layer": index + 1}
            entry.update((key, cast(row[c])) for c, (key, cast) in enumerate(_METRICS, 1))
            if with_loads:
                entry["loads"] = [int(x) for x in row[_FIXED_COLUMNS:].tolist()]
            layers.append(entry)
        loss_sum, loss_count = float(table[-1, 1]), float(table[-1, 2])
        loss = loss_sum / loss_count if loss_count > 0 else float("nan")
        vios = [entry["max_vio"] for entry in layers]
        tokens = self.tokens_per_step() if callable(self.tokens_per_step) else self.tokens_per_step
        tokens_per_s = tokens / step_time if step_time and step_time > 0 else float("nan")
        record = {
            "iteration": iteration,
            "loss": loss,
            "loss_tokens": int(loss_count),
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_s,
            "maxvio_mean": _mean(vios),
            "maxvio_max": max(vios) if vios else float("nan"),
            "min_load": min((e["min_load"] for e in layers), default=None),
            "max_load": max((e["max_load"] for e in layers), default=None),
            "frac_under_half": _mean([e["frac_under_half"] for e in layers]),
            "num_dead": sum(e["num_dead"] for e in layers) if layers else None,
            "num_experts": self.num_experts,
            "layers": layers,
        }
        return record

    def _write(self, record: dict) -> None:
        self.history.append({k: v for k, v in record.items() if k != "layers"})
        iteration = record["iteration"]
        if iteration % self.log_interval == 0 or not self._printed_first:
            self._printed_first = True
            print(format_record(record), flush=True)
        if iteration % self.tensorboard_log_interval == 0:
            writer, wandb_writer = self.writer_fn(), self.wandb_writer_fn()
            scalars = _scalars(record, self.per_layer_tensorboard)
            if writer is not None:
                for name, value in scalars.items():
                    writer.add_scalar(name, value, iteration)
            if wandb_writer is not None:
                wandb_writer.log(scalars, iteration)
        if self.jsonl_path:
            line = json.dumps(record, allow_nan=True) + "\n"
            if not self._jsonl_opened:  # a run killed mid-record left a cut last line
                self._jsonl_opened = True
                line = _line_break_after_cut_line(self.jsonl_path) + line
            try:
                with open(self.jsonl_path, "a", encoding="utf-8") as f:
                    f.write(line)
            except OSError as err:
                # a full disk's ENOSPC comes from the buffered file's close, without a file name:
                # name the file for the run's one line (pretrain._main)
                if err.filename is None:
                    err.filename = self.jsonl_path
                raise


def _line_break_after_cut_line(path: str) -> str:
    """A line break if ``path`` ends inside a line (a record cut by a kill: the next record starts
    a line of its own), else the empty string."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return ""
            f.seek(-1, os.SEEK_END)
            return "" if f.read(1) == b"\n" else "\n"
    except FileNotFoundError:
        return ""


def _scalars(record: dict, per_layer: bool) -> dict[str, float]:
    """The TensorBoard / W&B scalars of a step record (NaN and missing values left out). The
    per-layer tags ``balance/maxvio_layer_<N>`` number layers as the JSONL's ``layer`` and the
    console do: Megatron's ``layer_number``, from 1. Megatron's own per-layer tags
    (``moe/<name>_layer_<i>``, ``--moe-per-layer-logging``) count from 0: i = N - 1. Kept so: one
    number per layer across this package's outputs, the one Megatron's modules carry."""
    scalars = {
        f"balance/{key}": record[key]
        for key in _TB_KEYS
        if record[key] is not None
        and not (isinstance(record[key], float) and math.isnan(record[key]))
    }
    if not math.isnan(record["tokens_per_s"]):
        scalars["throughput/tokens_per_s"] = record["tokens_per_s"]
    if per_layer:
        for entry in record["layers"]:
            scalars[f"balance/maxvio_layer_{entry['layer']}"] = entry["max_vio"]
    return scalars


def format_record(record: dict) -> str:
    """The one-line stdout summary of a step."""

    def num(value, fmt):
        return (
            "n/a"
            if value is None or (isinstance(value, float) and math.isnan(value))
            else format(value, fmt)
        )

    return (
        f" [balance] iteration {record['iteration']:>7d} | lm loss (this iteration) "
        f"{num(record['loss'], '.4f')} | tokens/s {num(record['tokens_per_s'], ',.0f')} | "
        f"MaxVio mean {num(record['maxvio_mean'], '.3f')} max {num(record['maxvio_max'], '.3f')} "
        f"| load min/max {num(record['min_load'], 'd')}/{num(record['max_load'], 'd')} | "
        f"under-half {num(record['frac_under_half'], '.3f')} | dead {num(record['num_dead'], 'd')}"
    )


def _device_of(model_chunks) -> torch.device:
    for chunk in model_chunks:
        for p in chunk.parameters():
            return p.device
    return torch.device("cpu")


def balance_step_end(model, balance_logger: BalanceLogger | None, drift_correction: bool = True):
    """The step-end balance update (one integer all-reduce, QB solve) and its log line."""
    update_balance(model, drift_correction)
    if balance_logger is not None:
        balance_logger.on_step_end(model)


def make_finalize_model_grads_func(balance_logger: BalanceLogger | None, rescore=None):
    """A ``config.finalize_model_grads_func``: Megatron's grad finalisation, then the step end
    (unless a QB rescoring step defers it behind the optimizer step: ``qb_rescore.py``)."""

    def finalize_model_grads_and_log_balance(
        model, num_tokens=None, pg_collection=None, force_all_reduce=False
    ):
        finalize_model_grads(
            model,
            num_tokens=num_tokens,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
        if rescore is not None and rescore.deferring:
            rescore.before_optimizer_step(model)
        else:
            balance_step_end(model, balance_logger)

    return finalize_model_grads_and_log_balance


def default_jsonl_path(args) -> str | None:
    """``--balance-log-file`` resolved: explicit path, 'none', or <save>/balance.jsonl."""
    value = getattr(args, "balance_log_file", None)
    if value is not None:
        return None if value.lower() == "none" else value
    if getattr(args, "save", None):
        return os.path.join(args.save, "balance.jsonl")
    return None
