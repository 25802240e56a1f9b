#!/usr/bin/env python
"""Plot expert load balance from the balance JSONL written during pretraining.

    python tools/plot_balance.py RUN/balance.jsonl --out RUN/expert_load.png [--window N]
        [--summary]

The JSONL (``--balance-log-file``; by default ``<--save>/balance.jsonl``) has one record per
iteration, for every balancing type (QB, aux losses, sign update, Megatron's QB, none): loss,
tokens/s, MaxVio, min / max load, experts under half the mean load and dead experts (load 0) over
the MoE layers and, per layer, the same numbers and the global per-expert loads.
The picture has three panels:

1. expert-load heatmaps, layers x experts, as load / mean load (1.0 = perfectly balanced): the
   first recorded iteration beside the average over the last ``--window`` iterations;
2. MaxVio per iteration: mean and max over layers (each layer thin), log scale; on a second axis
   the fraction of experts under half the mean load and the dead experts (all layers);
3. the training loss.

``--summary`` prints the first-vs-last-window loss and MaxVio (what the main job reports).
A resumed run appends to the same JSONL: the last record of an iteration wins.
Needs matplotlib only for the picture (``--summary`` alone needs nothing beyond Python).

Exit status: 0 on success, 1 when the JSONL cannot be read or has no records, 2 on a bad option
(neither --out nor --summary; ``--window`` below 1; ``--out`` a folder, in a folder that does not
exist, or of a format matplotlib cannot write), before the JSONL is read. The picture is written
to a temporary file beside ``--out`` and renamed into place: a failed run leaves no half-written
picture.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_latentmoe.training.balance_summary import (  # noqa: E402  (plain Python, no torch)
    SUMMARY_WINDOW,
    finite,
    read_records,
    summarize,
    summary_lines,
)

_MAX_LAYER_TICKS = 24  # layer labels on a heatmap's axis (more overlap at the picture's size)


def _layers(record: dict):
    """The record's per-layer entries that name their layer (a hand-edited or foreign line may
    miss a field: it is left out of the picture, as a missing top-level number is)."""
    layers = record.get("layers")
    for layer in layers if isinstance(layers, list) else ():
        if isinstance(layer, dict) and type(layer.get("layer")) is int:
            yield layer


def _number(record: dict, key: str, missing: float = math.nan) -> float:
    """The record's ``key``, or ``missing`` where it is absent or not a finite number (a
    hand-edited or foreign line: a text there was a TypeError traceback while plotting)."""
    value = record.get(key)
    return float(value) if finite([value]) else missing


def _load_matrix(records: list[dict]):
    """[layers x experts] mean of load / mean-load over ``records`` that carry loads, and the
    layer numbers; None if no record has loads. A layer's loads of another length than its first
    (files of two runs joined) are left out (they were an IndexError traceback)."""
    sums: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    for record in records:
        for layer in _layers(record):
            loads = layer.get("loads")
            if not isinstance(loads, list) or not loads or len(finite(loads)) != len(loads):
                continue
            mean = sum(loads) / len(loads)
            if mean <= 0:
                continue
            rel = [x / mean for x in loads]
            acc = sums.setdefault(layer["layer"], [0.0] * len(rel))
            if len(acc) != len(rel):
                continue
            for i, v in enumerate(rel):
                acc[i] += v
            counts[layer["layer"]] = counts.get(layer["layer"], 0) + 1
    if not sums:
        return None, []
    layers = sorted(sums)
    return [[v / counts[n] for v in sums[n]] for n in layers], layers


def _picture_target(out: str) -> tuple[str, str]:
    """(format, path written) for ``--out``, as ``savefig`` would pick them: the format from the
    extension; with none, matplotlib's default format, appended to the name."""
    import matplotlib

    ext = os.path.splitext(out)[1][1:].lower()
    if ext:
        return ext, out
    fmt = matplotlib.rcParams["savefig.format"]
    return fmt, out.rstrip(".") + "." + fmt


def check_out(out: str) -> str | None:
    """Why ``--out`` cannot be written (a one-line message naming it), or None if it can."""
    flag = f"--out={out!r}"
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return f"{flag} needs matplotlib, which is not installed (pip install matplotlib)"
    fmt, path = _picture_target(out)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(out) or os.path.isdir(path):
        return f"{flag} is a directory (a picture file such as RUN/expert_load.png is expected)"
    if not os.path.isdir(folder):
        return f"{flag}: directory {folder!r} does not exist (an existing folder is expected)"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{flag}: directory {folder!r} is not writable"
    supported = FigureCanvasBase.get_supported_filetypes()
    if fmt not in supported:
        return (
            f"{flag}: picture format {fmt!r} is not allowed: one of {', '.join(sorted(supported))}"
        )
    return None


def plot(records: list[dict], out: str, window: int, title: str | None = None) -> str:
    """Draw the picture into ``out`` (through a temporary file and a rename); returns the path
    written (``out``, plus matplotlib's default extension if it has none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_loads = [r for r in records if any(layer.get("loads") for layer in _layers(r))]
    first_m, layers = _load_matrix(with_loads[:1])
    w = max(1, min(window, len(with_loads)))
    last_m, last_layers = _load_matrix(with_loads[-w:])

    fig = plt.figure(figsize=(13, 8.5), constrained_layout=True)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.0, 1.0])
    cmap = plt.get_cmap("RdBu_r")
    for col, (matrix, rows, label) in enumerate(
        (
            (first_m, layers, f"iteration {with_loads[0]['iteration']}" if with_loads else ""),
            (
                last_m,
                last_layers,
                f"mean of iterations {with_loads[-w]['iteration']}-{with_loads[-1]['iteration']}"
                if with_loads
                else "",
            ),
        )
    ):
        ax = fig.add_subplot(grid[0, col])
        if matrix is None:
            ax.text(0.5, 0.5, "no per-expert loads recorded", ha="center", va="center")
            ax.set_axis_off()
            continue
        im = ax.imshow(
            matrix, aspect="auto", cmap=cmap, vmin=0.0, vmax=2.0, interpolation="nearest"
        )
        step = -(-len(rows) // _MAX_LAYER_TICKS)  # every layer up to 24, then every step-th
        ax.set_yticks(range(0, len(rows), step))
        ax.set_yticklabels([str(row) for row in rows[::step]])
        ax.set_ylabel("layer")
        ax.set_xlabel("expert")
        ax.set_title(f"expert load / mean load — {label}")
        n = len(matrix[0])
        if n <= 32:
            ax.set_xticks(range(n))
        fig.colorbar(im, ax=ax, shrink=0.85, label="load / mean (1 = balanced)")

    its = [r["iteration"] for r in records]
    ax = fig.add_subplot(grid[1, 0])
    per_layer: dict[int, list] = {}
    for r in records:
        for layer in _layers(r):
            if finite([layer.get("max_vio")]):
                per_layer.setdefault(layer["layer"], []).append((r["iteration"], layer["max_vio"]))
    for _layer, points in sorted(per_layer.items()):
        ax.plot([p[0] for p in points], [max(p[1], 1e-3) for p in points], lw=0.6, alpha=0.35)
    ax.plot(
        its,
        [max(_number(r, "maxvio_mean", 0.0), 1e-3) for r in records],
        color="k",
        lw=1.6,
        label="mean over layers",
    )
    ax.plot(
        its,
        [max(_number(r, "maxvio_max", 0.0), 1e-3) for r in records],
        color="tab:red",
        lw=1.0,
        label="max over layers",
    )
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("MaxVio = (max load - mean) / mean")
    ax.set_title("load balance per iteration (thin: each MoE layer)")
    ax.grid(True, which="both", alpha=0.3)
    twin = ax.twinx()
    twin.plot(
        its,
        [_number(r, "frac_under_half") for r in records],
        color="tab:green",
        lw=0.8,
        ls="--",
        label="experts under half the mean (fraction)",
    )
    n_slots = max(1, len(per_layer)) * max(1.0, _number(records[0], "num_experts", 1.0))
    twin.plot(
        its,
        [_number(r, "num_dead", 0.0) / n_slots for r in records],
        color="tab:purple",
        lw=0.8,
        ls=":",
        label="dead experts (fraction of all layers' experts)",
    )
    twin.set_ylim(0, 1)
    twin.set_ylabel("fraction of experts")
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8)

    ax = fig.add_subplot(grid[1, 1])
    ax.plot(its, [_number(r, "loss") for r in records], color="tab:blue", lw=1.0)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("training loss")
    ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fmt, path = _picture_target(out)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            fig.savefig(f, dpi=110, format=fmt)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
    return path


def _error(message: str) -> int:
    print(f"plot_balance.py: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "jsonl", help="balance JSONL of a run (--balance-log-file / <save>/balance.jsonl)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="picture to write, e.g. RUN/expert_load.png (a format matplotlib writes; default: "
        "none)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=SUMMARY_WINDOW,
        help=f"iterations in the last window, an integer >= 1 (default {SUMMARY_WINDOW})",
    )
    p.add_argument(
        "--title", default=None, help="the picture's title (default: the JSONL's path, the run)"
    )
    p.add_argument("--summary", action="store_true", help="print the first-vs-last-window summary")
    args = p.parse_args(argv)
    if not args.summary and not args.out:  # a usage error: was exit 1 after reading the JSONL
        return _error("nothing to do: give --out PICTURE and/or --summary")
    if args.window < 1:
        return _error(f"--window={args.window} is not allowed: an integer >= 1")
    if args.out:
        problem = check_out(args.out)
        if problem:
            return _error(problem)
    try:
        records = read_records(args.jsonl)
    except OSError as err:
        print(f"plot_balance.py: error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # not UTF-8 (a picture, a checkpoint), or a non-integer iteration
        print(f"plot_balance.py: error: {args.jsonl}: not a balance JSONL ({err})", file=sys.stderr)
        return 1
    if not records:
        print(f"plot_balance.py: error: no records in {args.jsonl}", file=sys.stderr)
        return 1
    if args.summary:
        print("\n".join(summary_lines(summarize(records, args.window))))
    if args.out:
        written = plot(records, args.out, args.window, args.title or args.jsonl)
        print(f"expert-load picture: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
