#!/usr/bin/env python
"""The balance race: every balancer a Megatron user has, against QB, in real Megatron training.

    python benchmarks/bench_training_balance.py [--iters 300] [--args-file FILE] [--methods ...]
                                                [--seeds S ...]

Trains the same model (default: the K3-shaped sparse tiny config, 128 routed experts top-4, EP2
over 2 processes) once per method through the project's entry point
(``examples/run_torchrun.sh``) with the same seed, data order, layout and iterations, reads each
run's balance JSONL (global-batch loads per layer, padding excluded; ``--balance-log-file``) and
writes ``benchmarks/results/training_balance.json`` and ``training_balance.png`` (MaxVio per
iteration, log scale, one line per method; loss per iteration; the table), then prints the table.
Another ``--args-file`` writes them to ``benchmarks/results/<its name>/`` unless ``--out`` says.

Per method: mean MaxVio (mean over layers) over iterations 1-50 and 51-end, the worst single
iteration (overall, and after iteration 50: past the LR warm-up's collapse), iterations with a
dead expert (load 0 in some layer), final loss (mean of the last 20 iterations), tokens/s relative
to ``none``: from the race runs (median over iterations after the first 5, runs minutes apart)
and side by side (``bench_step_balancers.py``: every method's model trains in the same two
processes, one step each in turn, so machine noise hits all alike; ``--side-by-side-steps``;
not for a method that rescores only the first iterations: its steps cost a rescoring row's, then
the same method's without rescoring).
``--seeds`` trains each method once per seed (``--seed S``; data order and initialisation change)
and reports the mean over the seeds, the worst iteration of all runs and the final loss's spread,
so a gap between methods can be read against the noise of one run (the plotted curves: means too).

A run whose JSONL already holds every iteration, trained with the same flags (the args file's
written out, the method's, iterations, seed: ``<run>.cmd.json`` beside it), is not re-run
(``--fresh`` re-runs all), so a killed race resumes where it stopped. Timing is the benchmark's
output, never a test assertion.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.results_io import RESULTS, folder_refusal, write_json, write_png  # noqa: E402
from megatron_latentmoe.training.balance_summary import read_records  # noqa: E402

# (name, flags). Every method routes with sigmoid scores; the aux-loss variants use Megatron's
# usual coefficient 1e-2, and seq_aux_loss also 1: the control of QB + seq_aux_loss (the same aux
# loss, no QB). The sign update (DeepSeek-V3, aux-loss-free): Megatron's default rate 1e-3 and a
# 10x faster one. QB + seq_aux_loss: the coefficient that closed most of QB's loss gap here
# (1e-4 / 1e-3 / 1e-2 / 3e-2 / 1e-1 / 3e-1 / 1: final loss 4.749 / 4.731 / 4.704 / 4.711 /
# 4.695 / 4.664 / 4.663, QB alone 4.716; one run each; global_aux_loss 3e-1 beside QB: 4.680).
# QB + absorb: c = 0.3 (the scan's best alone) and 1 (with the warm-up rescored, 3 seeds: 4.629
# each, c = 0.3 before the 2026-12-07 re-run; at d 512 c = 1 destabilises training:
# BALANCE_RACE.md).
QB = ["--moe-router-load-balancing-type", "quantile_histogram"]
CENTERED = ["--moe-qb-binning", "centered"]
QB_SEQ_AUX = QB + ["seq_aux_loss", "--moe-aux-loss-coeff", "0", "1"] + CENTERED
QB_ABSORB = QB + CENTERED + ["--moe-qb-absorb-coeff", "1"]
# QB rescoring (training/qb_rescore.py) at every iteration of any race: the bias solved from the
# updated model's scores of the step's batch; and only over iterations 1-50, the warm-up where
# the spike is (the recommended use: after it a step costs what QB's does)
RESCORE = ["--moe-qb-rescore-iters", "1000000000"]
RESCORE_WARMUP = ["--moe-qb-rescore-iters", "50"]
# QB calibration (training/qb_calibrate.py): iteration 1's bias solved on the run's last 16
# global batches at the initial weights
CALIBRATE = ["--moe-qb-calibrate-batches", "16"]
# S QB solves per rescored step (--moe-qb-rescore-solves S; opt-in: S integer all-reduces a step)
SOLVES_2 = ["--moe-qb-rescore-solves", "2"]
SOLVES_4 = ["--moe-qb-rescore-solves", "4"]
# run only when listed: a 10x faster sign update, and the rows of the d 512 and 4x-batch races
ON_REQUEST = (
    "sign 1e-2",
    "QB centered + rescore 1-50 x 4 solves + calibrate (ours)",
    "QB centered + seq_aux_loss + rescore x 2 solves + calibrate (ours)",
    "QB centered + seq_aux_loss + rescore x 4 solves + calibrate (ours)",
    "QB centered + seq_aux_loss + rescore 1-50 x 4 solves + calibrate (ours)",
    "QB centered + absorb 1 + rescore 1-50 x 4 solves + calibrate (ours)",
)
METHODS = {
    "none": ["--moe-router-load-balancing-type", "none"],
    "QB centered (ours)": QB + CENTERED,
    "QB uniform (ours)": QB + ["--moe-qb-binning", "uniform"],
    "QB centered + seq_aux_loss (ours)": QB_SEQ_AUX,
    "QB centered + absorb 0.3 (ours)": QB + CENTERED + ["--moe-qb-absorb-coeff", "0.3"],
    "QB centered + absorb 1 (ours)": QB_ABSORB,
    "QB centered + rescore (ours)": QB + CENTERED + RESCORE,
    "QB centered + seq_aux_loss + rescore (ours)": QB_SEQ_AUX + RESCORE,
    "QB centered + seq_aux_loss + rescore 1-50 (ours)": QB_SEQ_AUX + RESCORE_WARMUP,
    "QB centered + absorb 1 + rescore 1-50 (ours)": QB_ABSORB + RESCORE_WARMUP,
    "QB centered + absorb 1 + rescore 1-50 + calibrate (ours)": QB_ABSORB
    + RESCORE_WARMUP
    + CALIBRATE,
    # the recommended flags (README): the d 128 recipe without its absorption loss
    "QB centered + rescore 1-50 + calibrate (ours)": QB + CENTERED + RESCORE_WARMUP + CALIBRATE,
    "QB centered + seq_aux_loss + rescore + calibrate (ours)": QB_SEQ_AUX + RESCORE + CALIBRATE,
    "QB centered + rescore 1-50 x 4 solves + calibrate (ours)": QB
    + CENTERED
    + RESCORE_WARMUP
    + SOLVES_4
    + CALIBRATE,
    # every step rescored with 2 or 4 solves: at 4x the batch (k3_sparse_tiny_gbs64.sh) they keep
    # every iteration <= 1.0
    "QB centered + seq_aux_loss + rescore x 2 solves + calibrate (ours)": QB_SEQ_AUX
    + RESCORE
    + SOLVES_2
    + CALIBRATE,
    "QB centered + seq_aux_loss + rescore x 4 solves + calibrate (ours)": QB_SEQ_AUX
    + RESCORE
    + SOLVES_4
    + CALIBRATE,
    # the same two recipes rescoring only the warm-up: the lag returns after the window
    "QB centered + seq_aux_loss + rescore 1-50 x 4 solves + calibrate (ours)": QB_SEQ_AUX
    + RESCORE_WARMUP
    + SOLVES_4
    + CALIBRATE,
    "QB centered + absorb 1 + rescore 1-50 x 4 solves + calibrate (ours)": QB_ABSORB
    + RESCORE_WARMUP
    + SOLVES_4
    + CALIBRATE,
    "aux_loss": ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2"],
    "sign 1e-3": [
        "--moe-router-load-balancing-type",
        "none",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "1e-3",
    ],
    "megatron quantile_balancing": ["--moe-router-load-balancing-type", "quantile_balancing"],
    "seq_aux_loss": [
        "--moe-router-load-balancing-type",
        "seq_aux_loss",
        "--moe-aux-loss-coeff",
        "1e-2",
    ],
    "seq_aux_loss 1": [
        "--moe-router-load-balancing-type",
        "seq_aux_loss",
        "--moe-aux-loss-coeff",
        "1",
    ],
    "global_aux_loss": [
        "--moe-router-load-balancing-type",
        "global_aux_loss",
        "--moe-aux-loss-coeff",
        "1e-2",
    ],
    "sign 1e-2": [
        "--moe-router-load-balancing-type",
        "none",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "1e-2",
    ],
}
EARLY = 50  # iterations 1-EARLY vs EARLY+1-end
FINAL = 20  # final loss: mean of the last FINAL iterations
WARM = 5  # tokens/s: median over iterations after the first WARM


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def race_command(flags, args, jsonl, seed=None):
    """The entry point's command line for one run of the race."""
    return [
        "bash",
        os.path.join(REPO, "examples", "run_torchrun.sh"),
        args.args_file,
        "--train-iters",
        str(args.iters),
        "--log-interval",
        "50",
        "--eval-iters",
        "0",
        "--balance-log-file",
        jsonl,
        "--balance-log-loads-interval",
        "1000000",
        *flags,
        *([] if seed is None else ["--seed", str(seed)]),
    ]


def run_record(cmd) -> list[str]:
    """What decides a run's numbers: its command with the args file's flags written out (an
    edited args file, other flags, iterations or seed make another run), without the log path."""
    head, tail = cmd[:3], cmd[3:]
    return args_file_flags(head[2]) + [w for w in tail if not w.endswith(".jsonl")]


def record_path(jsonl: str) -> str:
    return jsonl[: -len(".jsonl")] + ".cmd.json"


def reusable(jsonl: str, record: list[str], iters: int) -> str | None:
    """Why the finished run at ``jsonl`` cannot stand in for this one; None when it can."""
    if not os.path.exists(jsonl) or len(read_records(jsonl)) < iters:
        return "not run to the end"
    try:
        with open(record_path(jsonl)) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return "no record of the flags that trained it"
    if saved != record:
        return "trained with other flags"
    return None


def run_method(name, flags, args, jsonl, seed=None):
    """Train once with ``flags``; returns the wall time (s). Raises with the log tail on failure.
    On success the run's flags go to ``<run>.cmd.json`` beside its JSONL (what ``reusable``
    compares); a failed or killed run leaves none."""
    log = jsonl[: -len(".jsonl")] + ".log"
    for stale in (jsonl, record_path(jsonl)):
        if os.path.exists(stale):
            os.remove(stale)
    cmd = race_command(flags, args, jsonl, seed)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    start = time.time()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    wall = time.time() - start
    if proc.returncode != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{name}: exit {proc.returncode}; log {log}:\n{tail}")
    save_record(jsonl, cmd)
    return wall


def save_record(jsonl: str, cmd) -> None:
    write_json(record_path(jsonl), run_record(cmd), indent=0)


def args_file_flags(args_file):
    """The ``ARGS`` array an ``examples/args`` file defines, as a list of words."""
    return subprocess.run(
        ["bash", "-c", f'source "{args_file}"; printf "%s\\n" "${{ARGS[@]}}"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()


def model_shape(args_file):
    """(experts, top-k, sequence length, global batch) of the args file the race trains."""
    out = args_file_flags(args_file)

    def flag(name):
        return int(out[len(out) - 1 - out[::-1].index(name) + 1])  # the last occurrence wins

    return (
        flag("--num-experts"),
        flag("--moe-router-topk"),
        flag("--seq-length"),
        flag("--global-batch-size"),
    )


def corpus_tokens():
    """The shipped corpus (the race's data) as one int64 token array."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_latentmoe.data.corpus import prepare_default_dataset

    dataset = IndexedDataset(prepare_default_dataset())
    return np.concatenate([dataset[i] for i in range(len(dataset))]).astype(np.int64)


def token_floor(experts, topk, seq_length, global_batch, batches=300, seed=0):
    """The MaxVio no balancer could go below if routing were a function of the token alone.

    Every copy of a token would then pick the same k experts, so a token with a share f of the
    batch puts at least f·m tokens on each of them, against a mean load of m·k/n: MaxVio >=
    f·n/k - 1. Estimated on global batches of the race's shape cut at random from the embedded
    corpus (the race's data): mean and max over ``batches`` batches, and the token that sets it.
    An estimate, not a floor: the copies of a token differ by their context, and a bias learnt
    from other batches splits them (``bench_balance_floor.py`` measures what a bias can reach).
    """
    import numpy as np

    from megatron_latentmoe.data.corpus import default_tokenizer_dir

    tokens = corpus_tokens()
    rng = np.random.default_rng(seed)
    floors, top = [], {}
    for _ in range(batches):
        starts = rng.integers(0, len(tokens) - seq_length, global_batch)
        counts = np.bincount(np.concatenate([tokens[s : s + seq_length] for s in starts]))
        floors.append(max(0.0, counts.max() / (seq_length * global_batch) * experts / topk - 1))
        top[int(counts.argmax())] = top.get(int(counts.argmax()), 0) + 1
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(os.path.join(default_tokenizer_dir(), "tokenizer.json"))
    return {
        "mean": float(np.mean(floors)),
        "max": float(np.max(floors)),
        "experts_over_topk": experts / topk,
        "most_frequent_token": vocab.decode([max(top, key=top.get)]),
    }


def summarize(name, records):
    its = [r["iteration"] for r in records]
    vio = [r["maxvio_mean"] for r in records]
    early = [v for i, v in zip(its, vio, strict=True) if i <= EARLY]
    late = [v for i, v in zip(its, vio, strict=True) if i > EARLY]
    worst = max(range(len(vio)), key=lambda i: vio[i])
    tps = [
        r["tokens_per_s"]
        for r in records
        if r["iteration"] > WARM and math.isfinite(r["tokens_per_s"])
    ]
    return {
        "method": name,
        "iterations": len(records),
        "maxvio_1_50": statistics.fmean(early),
        "maxvio_51_end": statistics.fmean(late) if late else None,
        "maxvio_worst": vio[worst],
        "maxvio_worst_iteration": its[worst],
        "maxvio_worst_51_end": max(late) if late else None,
        "iterations_with_dead_expert": sum(1 for r in records if (r.get("num_dead") or 0) > 0),
        "final_loss": statistics.fmean(r["loss"] for r in records[-FINAL:]),
        "tokens_per_s": statistics.median(tps) if tps else None,
        "curve_maxvio": vio,
        "curve_maxvio_max": [r["maxvio_max"] for r in records],
        "curve_loss": [r["loss"] for r in records],
        "curve_dead": [r.get("num_dead") for r in records],
        "curve_under_half": [r.get("frac_under_half") for r in records],
    }


def combine(runs):
    """One row from a method's runs over several seeds: means (every curve too, iteration by
    iteration), the worst iteration of all runs, the final loss's spread."""
    if len(runs) == 1:
        return runs[0]
    row = dict(runs[0])
    for key in ("maxvio_1_50", "maxvio_51_end", "iterations_with_dead_expert", "tokens_per_s"):
        row[key] = _of_all(statistics.fmean, [r[key] for r in runs])
    for key in (k for k in row if k.startswith("curve_")):
        row[key] = [_of_all(statistics.fmean, v) for v in zip(*(r[key] for r in runs), strict=True)]
    row["maxvio_worst_51_end"] = _of_all(max, [r["maxvio_worst_51_end"] for r in runs])
    worst = max(runs, key=lambda r: r["maxvio_worst"])
    row["maxvio_worst"], row["maxvio_worst_iteration"] = (
        worst["maxvio_worst"],
        worst["maxvio_worst_iteration"],
    )
    row["final_loss_runs"] = [r["final_loss"] for r in runs]
    row["final_loss"] = statistics.fmean(row["final_loss_runs"])
    row["final_loss_sd"] = statistics.stdev(row["final_loss_runs"])
    return row


def _of_all(reduce, values):
    """``reduce(values)``, or None (JSON null, "-" in the table) where a run lacks the figure."""
    return None if None in values else reduce(values)


def _cell(value, width):
    """``value`` to 3 decimals right-aligned in ``width``, or "-" there when it is None."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.3f}"


def table_rows(results):
    width = max([34] + [len(r["method"]) for r in results])  # the method column fits every name
    rows = [
        f"{'method':<{width}} {'MaxVio 1-50':>11} {'51-end':>8} {'worst (it)':>13} "
        f"{'worst 51-':>9} {'dead its':>8} {'final loss':>10} {'tok/s: runs':>11} "
        f"{'side by side':>12}"
    ]
    for r in results:
        rows.append(
            f"{r['method']:<{width}} {r['maxvio_1_50']:>11.3f} "
            f"{_cell(r['maxvio_51_end'], 8)} "
            f"{r['maxvio_worst']:>7.3f} ({r['maxvio_worst_iteration']:>3d}) "
            f"{_cell(r['maxvio_worst_51_end'], 9)} "
            f"{r['iterations_with_dead_expert']:>8.0f} {r['final_loss']:>10.4f} "
            f"{_cell(r['tokens_per_s_rel'], 11)} "
            f"{_cell(r.get('tokens_per_s_rel_side_by_side'), 12)}"
            + (f"  final loss sd {r['final_loss_sd']:.4f}" if "final_loss_sd" in r else "")
        )
    return rows


def _running_mean(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def loss_axis_top(methods, above_final=1.5):
    """Top of the loss panel: ``above_final`` above the highest final loss (the first
    iterations start near ln(vocab) = 8.3 and would flatten every curve's tail), or the highest
    loss when that is lower."""
    highest = max(max(r["curve_loss"]) for r in methods)
    return min(highest, max(r["final_loss"] for r in methods) + above_final)


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(14, 10), constrained_layout=True)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.25, 0.8])
    ax_vio, ax_loss = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    tab20 = plt.get_cmap("tab20").colors  # one distinct colour per method: dark shades first
    colors = tab20[0::2] + tab20[1::2]
    for i, r in enumerate(result["methods"]):
        ours = "ours" in r["method"]
        style = dict(
            color=colors[i % len(colors)],
            lw=2.0 if ours else 1.0,
            ls="-" if ours else "--",
            alpha=1.0 if ours else 0.8,
        )
        its = range(1, len(r["curve_maxvio"]) + 1)
        ax_vio.plot(its, [max(v, 1e-3) for v in r["curve_maxvio"]], label=r["method"], **style)
        ax_loss.plot(its, _running_mean(r["curve_loss"], FINAL), label=r["method"], **style)
    ax_vio.set_yscale("log")
    ax_vio.set_xlabel("iteration")
    ax_vio.set_ylabel("MaxVio of the global batch (mean over MoE layers)")
    ax_vio.set_title("load balance per iteration")
    ax_vio.grid(True, which="both", alpha=0.3)
    ax_vio.legend(fontsize=8)
    ax_loss.set_xlabel("iteration")
    ax_loss.set_ylabel(f"lm loss (running mean over {FINAL} iterations)")
    ax_loss.set_ylim(top=loss_axis_top(result["methods"]))
    ax_loss.set_title("training loss")
    ax_loss.grid(True, alpha=0.3)
    ax_loss.legend(fontsize=8)
    ax_tab = fig.add_subplot(grid[1, :])
    ax_tab.set_axis_off()
    ax_tab.text(
        0.0,
        1.0,
        "\n".join(table_rows(result["methods"])),
        family="monospace",
        fontsize=8,
        va="top",
    )
    ax_tab.set_title(result["title"], loc="left", fontsize=10)
    write_png(fig, path)
    plt.close(fig)


def rescore_window(flags) -> int:
    """The iterations a method rescores (``--moe-qb-rescore-iters``; 0: none)."""
    return (
        int(flags[flags.index("--moe-qb-rescore-iters") + 1])
        if "--moe-qb-rescore-iters" in flags
        else 0
    )


def side_by_side_tokens_per_s(args, methods):
    """``bench_step_balancers.py``'s results for ``methods`` (resumable like the runs)."""
    path = os.path.join(args.workdir, "step_balancers.json")
    wanted = dict(
        methods=methods,
        steps=args.side_by_side_steps,
        args_file=os.path.abspath(args.args_file),
    )
    if os.path.exists(path) and not args.fresh:
        with open(path) as f:
            done = json.load(f)
        if {k: done["args"].get(k) for k in wanted} == wanted:
            return done["results"]
    print(f"[race] side by side: {args.side_by_side_steps} rounds ...", flush=True)
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "bench_step_balancers.py")]
    cmd += ["--args-file", wanted["args_file"], "--steps", str(args.side_by_side_steps)]
    cmd += ["--out", path, "--methods", *methods]
    subprocess.run(cmd, cwd=REPO, check=True)
    with open(path) as f:
        return json.load(f)["results"]


def race_workdir(args_file):
    """The race's default workdir for ``args_file``: a run's JSONL is named by method and seed
    only, so each model gets its own folder (the d 128 race's runs are not the d 512 race's)."""
    stem = os.path.splitext(os.path.basename(args_file))[0]
    return os.path.join(REPO, "runs", "training_balance", stem)


DEFAULT_ARGS_FILE = os.path.join(REPO, "examples", "args", "k3_sparse_tiny.sh")


def add_model_and_method_args(p):
    """``--args-file`` and ``--methods``, shared with ``bench_step_balancers.py``."""
    p.add_argument(
        "--args-file",
        default=DEFAULT_ARGS_FILE,
        help="the model's flags, a bash file as in examples/args (default: "
        f"{os.path.relpath(DEFAULT_ARGS_FILE, REPO)})",
    )
    p.add_argument(
        "--methods",
        nargs="*",
        default=[m for m in METHODS if m not in ON_REQUEST],
        choices=list(METHODS),
        metavar="M",
        help="methods to run, each name quoted as one argument (default: every method but those "
        f"run on request: {'; '.join(ON_REQUEST)})",
    )


def check_model_and_method_args(p, args) -> None:
    """Refuse (one line, exit 2) what :func:`add_model_and_method_args` parsed but cannot run;
    ``args.args_file`` becomes absolute."""
    if not os.path.isfile(args.args_file):
        p.error(f"--args-file {args.args_file}: no such file (an examples/args/*.sh file)")
    args.args_file = os.path.abspath(args.args_file)
    if not args.methods:
        p.error(f"--methods: give at least one of {list(METHODS)}")


def results_dir(args_file: str) -> str:
    """Where a benchmark writes by default: benchmarks/results for the race's model, a folder
    named after any other args file (so that its results never replace the race's)."""
    if os.path.abspath(args_file) == DEFAULT_ARGS_FILE:
        return RESULTS
    return os.path.join(RESULTS, os.path.splitext(os.path.basename(args_file))[0])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_method_args(p)
    p.add_argument(
        "--iters", type=int, default=300, help="training iterations per run (default: %(default)s)"
    )
    p.add_argument(
        "--workdir",
        help="runs and their JSONL, reused when complete and trained with the same flags (default: "
        "runs/training_balance/<args file's name>: one model's runs never stand in for another's)",
    )
    p.add_argument(
        "--out",
        help="folder of training_balance.json / .png (default: benchmarks/results for "
        "k3_sparse_tiny.sh, benchmarks/results/<args file's name> for any other)",
    )
    p.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        metavar="S",
        help="train each method once per seed and report the mean (default: one run, the args "
        "file's seed)",
    )
    p.add_argument(
        "--side-by-side-steps",
        type=int,
        default=60,
        metavar="N",
        help="rounds of bench_step_balancers.py for the side-by-side tokens/s, 0: skip (default: "
        "%(default)s)",
    )
    p.add_argument("--fresh", action="store_true", help="re-run methods that already finished")
    args = p.parse_args(argv)
    check_model_and_method_args(p, args)
    if args.side_by_side_steps < 0:
        p.error(f"--side-by-side-steps {args.side_by_side_steps}: an integer >= 0 (0: skip)")
    if args.iters <= EARLY:
        p.error(
            f"--iters {args.iters}: must be > {EARLY} "
            f"(the windows are 1-{EARLY} and {EARLY + 1}-end)"
        )
    refusal = args.out and folder_refusal(args.out, "training_balance.json and .png")
    if refusal:
        p.error(refusal)
    args.workdir = args.workdir or race_workdir(args.args_file)
    args.out = args.out or results_dir(args.args_file)
    os.makedirs(args.workdir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)

    results, walls = [], {}
    for name in args.methods:
        runs = []
        for seed in args.seeds or [None]:
            run = name if seed is None else f"{name} seed {seed}"
            jsonl = os.path.join(args.workdir, _slug(run) + ".jsonl")
            record = run_record(race_command(METHODS[name], args, jsonl, seed))
            why = "--fresh" if args.fresh else reusable(jsonl, record, args.iters)
            if why is None:
                print(f"[race] {run}: reusing {jsonl}", flush=True)
            else:
                print(f"[race] {run}: training {args.iters} iterations ({why}) ...", flush=True)
                walls[run] = run_method(run, METHODS[name], args, jsonl, seed)
                print(f"[race] {run}: {walls[run]:.0f} s", flush=True)
            records = read_records(jsonl)
            runs.append(summarize(name, records))
        results.append(combine(runs))
    # relative to `none`'s runs: None (JSON null) when `none` did not run or a figure is missing
    base = next((r["tokens_per_s"] for r in results if r["method"] == "none"), None)
    for r in results:
        known = base and r["tokens_per_s"] is not None
        r["tokens_per_s_rel"] = r["tokens_per_s"] / base if known else None
    side_by_side = None
    if args.side_by_side_steps and "none" in args.methods:
        # not a method that rescores only part of the race: its per-step median would mix
        # rescored and plain steps (its steps cost the rescoring rows' inside the window, the
        # same method's without rescoring after it)
        steady = [m for m in args.methods if not 0 < rescore_window(METHODS[m]) < args.iters]
        side_by_side = side_by_side_tokens_per_s(args, steady)
    for r in results:
        if side_by_side and r["method"] in side_by_side:
            row = side_by_side[r["method"]]
            r["tokens_per_s_rel_side_by_side"] = row["ratio_vs_none_paired"]
            # a side-by-side JSON written before the interval existed (a resumed race) has none
            r["tokens_per_s_rel_side_by_side_ci95"] = row.get("ratio_vs_none_paired_ci95")
            r["router_share_side_by_side"] = row["router_s_median"] / row["step_s_median"]
    title = (
        f"{os.path.basename(args.args_file)}, EP2 on 2 CPU processes, {args.iters} iterations, "
        + (
            "same seed and data order"
            if not args.seeds
            else f"mean over seeds {', '.join(map(str, args.seeds))}"
        )
        + "; MaxVio = (max load - mean) / mean of the global batch"
    )
    floor = token_floor(*model_shape(args.args_file))
    result = {
        "title": title,
        "token_floor": floor,
        "args_file": os.path.relpath(args.args_file, REPO),
        "iters": args.iters,
        "seeds": args.seeds,
        "run_wall_s": walls,
        "methods": results,
    }
    json_path = os.path.join(args.out, "training_balance.json")
    # strict JSON: a missing figure is null
    write_json(json_path, result, indent=1, allow_nan=False)
    try:
        plot(result, os.path.join(args.out, "training_balance.png"))
    except ImportError:
        print("[race] matplotlib missing: no PNG")
    print(title)
    print("\n".join(table_rows(results)))
    print(
        f"if every copy of a token took the same experts (n/k = {floor['experts_over_topk']:.0f}): "
        f"MaxVio >= {floor['mean']:.2f} on a mean batch, {floor['max']:.2f} on the worst "
        f"(most frequent token {floor['most_frequent_token']!r}); not a floor: "
        "benchmarks/bench_balance_floor.py measures one"
    )
    print(f"wrote {json_path} and training_balance.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
