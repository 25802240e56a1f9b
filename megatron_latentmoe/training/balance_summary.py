"""The balance JSONL's reader and its first-vs-last-window summary, in plain Python (no torch):
the summary a training run prints at its end and ``tools/plot_balance.py --summary``'s.

Records are what :class:`~megatron_latentmoe.training.balance_logging.BalanceLogger` writes, one
per iteration (``iteration``, ``loss``, ``maxvio_mean``, ``maxvio_max``, ``num_dead``,
``tokens_per_s``, ...).
"""

from __future__ import annotations

import json
import math

SUMMARY_WINDOW = 20
"""Iterations in the first and in the last window (fewer when a run has under twice as many)."""


def read_records(path: str) -> list[dict]:
    """One record per iteration, in order (later lines win; a line cut by a kill is skipped).
    A ValueError names the line whose iteration is not an integer (not the logger's file)."""
    by_iteration: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "iteration" in record:
                iteration = record["iteration"]
                if isinstance(iteration, bool) or not isinstance(iteration, int):
                    raise ValueError(
                        f"line {number}: iteration {json.dumps(iteration)} is not an integer"
                    )
                by_iteration[iteration] = record
    return [by_iteration[i] for i in sorted(by_iteration)]


def finite(values) -> list:
    """The values that are finite numbers (a record's missing or NaN fields left out)."""
    return [v for v in values if v is not None and isinstance(v, (int, float)) and math.isfinite(v)]


def _avg(values) -> float:
    values = finite(values)
    return sum(values) / len(values) if values else float("nan")


def summarize(records: list[dict], window: int = SUMMARY_WINDOW) -> dict:
    """First-vs-last-window loss, MaxVio and throughput."""
    rows = [r for r in records if finite([r.get("loss")])]
    if not rows:
        return {}
    w = max(1, min(window, len(rows) // 2 or 1))
    first, last = rows[:w], rows[-w:]
    return {
        "iterations": (rows[0]["iteration"], rows[-1]["iteration"]),
        "window": w,
        "loss_first": _avg(r["loss"] for r in first),
        "loss_last": _avg(r["loss"] for r in last),
        "maxvio_first": _avg(r.get("maxvio_mean") for r in first),
        "maxvio_last": _avg(r.get("maxvio_mean") for r in last),
        "maxvio_max_last": _avg(r.get("maxvio_max") for r in last),
        "dead_iterations": sum(1 for r in rows if (r.get("num_dead") or 0) > 0),
        "maxvio_worst": max(finite(r.get("maxvio_mean") for r in rows), default=float("nan")),
        "tokens_per_s_last": _avg(r.get("tokens_per_s") for r in last),
    }


def summary_lines(s: dict) -> list[str]:
    if not s:
        return ["no iterations with a loss in the file"]
    a, b = s["iterations"]
    w = s["window"]
    verdict = "went DOWN" if s["loss_last"] < s["loss_first"] else "did NOT go down"
    return [
        f"iterations {a}-{b} (windows of {w}):",
        f"  lm loss   {s['loss_first']:.4f} (first {w}) -> {s['loss_last']:.4f} (last {w})  "
        f"[{verdict}]",
        f"  MaxVio    mean over layers {s['maxvio_first']:.3f} -> {s['maxvio_last']:.3f}"
        f"  (max over layers, last {w}: {s['maxvio_max_last']:.3f}; worst iteration "
        f"{s['maxvio_worst']:.3f})",
        f"  dead experts in {s['dead_iterations']} iteration(s)",
        f"  tokens/s  {s['tokens_per_s_last']:,.0f} (last {w})",
    ]
