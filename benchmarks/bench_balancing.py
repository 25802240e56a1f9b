#!/usr/bin/env python
"""Quantile Balancing side by side (SPEC §4): histogram QB vs exact QB vs Megatron-Core's QB vs
sign.

A drifting synthetic sigmoid router feeds every method the SAME batches. Each step's global batch
is several micro-batches, each drawn from ONE token cluster (heterogeneous micro-batches, stable
global mix). A method routes step t's batch with the bias it computed from steps < t, so the
reported MaxVio is that of the NEXT batch (never a batch routed with a bias computed from itself).

Methods
  ours B=...        megatron_latentmoe.balancing.QuantileHistogram: one int32 histogram per step
                    over all micro-batches (global-batch quantile), linear interpolation in the bin.
  centred B=...     CenteredQuantileHistogram: same traffic, bins centred on each expert's bias.
  exact             exact global-batch QB (all margins gathered, Q-th smallest per expert).
  megatron-core     megatron.core.transformer.moe.moe_utils.qb_dual_update per micro-batch, the
                    per-micro-batch quantiles averaged (ema=0, re-centred) as in its
                    finalize_model_grads. It selects on logits with ``scores - beta`` and asserts
                    m·k % n == 0; here it gets the SAME sigmoid scores with beta = -b (identical
                    selection) and micro-batches sized so that m_mb·k % n == 0.
  sign              DeepSeek-V3 b += gamma·sign(mean load - load), gamma = 1e-3.

Reported per method: MaxVio of the next batch per step (curve), mean over the last 20 steps,
mean |new bias - exact global quantile| on the same batch (estimator accuracy, before centring),
router time (all per-micro-batch routing work + the step-end update) relative to a plain biased
top-k, and the size of the per-layer per-step collective buffer. A second section iterates the
update on ONE fixed batch (larger q, no sampling noise) to isolate the estimator's resolution; a
third (control) repeats the drift run with one cluster, where all micro-batches are alike.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.results_io import RESULTS, folder_refusal, write_json, write_png  # noqa: E402
from megatron_latentmoe.balancing import (  # noqa: E402
    HEADER_FIELDS,
    CenteredQuantileHistogram,
    QuantileHistogram,
    cutoff_route,
)
from megatron_latentmoe.balancing_reference import (  # noqa: E402
    exact_quantiles,
    max_violation,
    sign_update_bias,
    topk_loads,
)


def load_megatron_qb():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.transformer.moe.moe_utils import qb_dual_update
        return qb_dual_update
    except Exception as exc:  # pragma: no cover - reported in the output
        print(f"[megatron-core QB skipped: {type(exc).__name__}: {exc}]")
        return None


# ----------------------------------------------------------------------------- synthetic router
class DriftingRouter:
    """Sigmoid router over clustered tokens; weights and per-expert popularity drift each step."""

    def __init__(self, n, d, clusters, seed, drift, sep=0.7, gain=1.5, popularity=0.5):
        self.g = torch.Generator().manual_seed(seed)
        self.n, self.d, self.clusters, self.drift, self.gain = n, d, clusters, drift, gain
        self.w = torch.randn(d, n, generator=self.g) / math.sqrt(d)
        self.mu = sep * torch.randn(clusters, d, generator=self.g)
        self.pop = popularity * torch.randn(n, generator=self.g)

    def step(self, m_mb, n_mb):
        """One global batch: n_mb micro-batches, each from one cluster (each cluster equally
        often)."""
        order = torch.randperm(n_mb, generator=self.g) % self.clusters
        mbs = []
        for c in order.tolist():
            x = self.mu[c] + torch.randn(m_mb, self.d, generator=self.g)
            mbs.append(torch.sigmoid(self.gain * x @ self.w + self.pop - 2.0))
        eps = self.drift
        self.w = self.w * math.sqrt(1 - eps**2) + eps * torch.randn(
            self.d, self.n, generator=self.g
        ) / math.sqrt(self.d)
        self.pop = self.pop + eps * torch.randn(self.n, generator=self.g)
        return mbs


# ----------------------------------------------------------------------------- methods
class Method:
    """A balancing method: per-micro-batch routing work (timed) and a step-end update (timed)."""

    def __init__(self, name, n, k, bytes_per_step, family):
        self.name, self.n, self.k, self.family = name, n, k, family
        self.bytes_per_step = bytes_per_step
        self.bias = torch.zeros(n)
        self.seconds = 0.0
        self.curve, self.est_err = [], []
        self.raw = None  # last un-centred update, for the accuracy metric

    def route_micro_batch(self, s):
        raise NotImplementedError

    def step_end(self):
        raise NotImplementedError

    def run_step(self, mbs):
        t0 = (
            time.process_time()
        )  # CPU time of this (single-threaded) process: robust to a busy machine
        for s in mbs:
            self.route_micro_batch(s)
        new = self.step_end()
        self.seconds += time.process_time() - t0
        self.bias = new


class Plain(Method):
    def route_micro_batch(self, s):
        (s + self.bias).topk(self.k, dim=1)

    def step_end(self):
        return self.bias


class Hist(Method):
    def __init__(self, name, n, k, cls, num_bins):
        super().__init__(name, n, k, (n * num_bins + len(HEADER_FIELDS)) * 4, "hist")
        self.hist = cls(n, k, num_bins)
        self.num_bins = num_bins

    def route_micro_batch(self, s):
        _, alpha = cutoff_route(s, self.bias, self.k)  # the router's own top-(k+1)
        self.hist.observe(s, self.bias, alpha_M=alpha)

    def step_end(self):
        buf = self.hist.pack()  # what the step-end all-reduce would carry (single rank here)
        self.hist.unpack_(buf)
        self.raw = self.hist.raw_quantiles(self.bias)
        self.hist.reset()
        return self.raw - self.raw.mean()


class Exact(Method):
    def __init__(self, name, n, k, m_step):
        super().__init__(name, n, k, m_step * n * 4, "exact")
        self.r = []

    def route_micro_batch(self, s):
        _, alpha = cutoff_route(s, self.bias, self.k)
        self.r.append(alpha[:, None] - s)  # margins that would have to be gathered

    def step_end(self):
        r = torch.cat(self.r)
        self.r = []
        big_q = -(-r.shape[0] * self.k // self.n)
        self.raw = r.topk(big_q, dim=0, largest=False).values[big_q - 1]
        return self.raw - self.raw.mean()


class MegatronQB(Method):
    def __init__(self, name, n, k, qb_dual_update):
        super().__init__(name, n, k, n * 4, "megatron")
        self.fn, self.acc, self.count = qb_dual_update, torch.zeros(n), 0

    def route_micro_batch(self, s):
        _, beta_local = self.fn(
            s, self.k, -self.bias, update_beta=True
        )  # selection on s - beta = s + b
        self.acc += beta_local
        self.count += 1

    def step_end(self):
        beta = self.acc / max(self.count, 1)  # ema = 0 (Megatron-Core default), then re-centred
        self.acc, self.count = torch.zeros(self.n), 0
        self.raw = -beta
        beta = beta - beta.mean()
        return -beta


class Sign(Method):
    def __init__(self, name, n, k, rate):
        super().__init__(name, n, k, n * 4, "sign")
        self.rate, self.loads = rate, torch.zeros(n, dtype=torch.int64)

    def route_micro_batch(self, s):
        idx = (s + self.bias).topk(self.k, dim=1).indices
        self.loads += torch.bincount(idx.reshape(-1), minlength=self.n)

    def step_end(self):
        new = sign_update_bias(self.loads, self.bias, self.rate)
        self.loads = torch.zeros(self.n, dtype=torch.int64)
        return new


# ----------------------------------------------------------------------------- runs
def build_methods(args, m_step, with_sign=True, with_megatron=True):
    n, k = args.experts, args.topk
    ms = []
    for b in args.bins:
        ms.append(Hist(f"ours B={b}", n, k, QuantileHistogram, b))
    if not args.no_centred:
        for b in args.bins:
            ms.append(Hist(f"centred B={b}", n, k, CenteredQuantileHistogram, b))
    ms.append(Exact("exact global QB", n, k, m_step))
    qb = load_megatron_qb() if with_megatron else None
    if qb is not None:
        ms.append(MegatronQB("megatron-core QB", n, k, qb))
    if with_sign:
        ms.append(Sign(f"sign (gamma={args.sign_rate:g})", n, k, args.sign_rate))
    return ms


def drift_run(args):
    n, k = args.experts, args.topk
    m_step = args.micro_batch * args.micro_batches
    router = DriftingRouter(n, args.hidden, args.clusters, args.seed, args.drift)
    methods = build_methods(args, m_step)
    plain = Plain("plain biased top-k", n, k, 0, "plain")
    for t in range(args.steps):
        mbs = router.step(args.micro_batch, args.micro_batches)
        batch = torch.cat(mbs)
        plain.bias = methods[0].bias  # a realistic bias for the reference timing
        plain.run_step(mbs)
        for meth in methods:
            meth.curve.append(max_violation(topk_loads(batch, meth.bias, k)))
            bias_in_force = meth.bias
            meth.run_step(mbs)
            if meth.family in ("hist", "megatron") and t % args.err_every == 0:
                ref = exact_quantiles(batch, bias_in_force, k)
                meth.est_err.append((meth.raw - ref).abs().mean().item())
        if args.verbose:
            print(f"step {t:3d} " + " ".join(f"{m.curve[-1]:7.3f}" for m in methods), flush=True)
    return methods, plain, m_step


def stationary_run(args):
    """Iterate the update on one fixed batch: no sampling noise, so resolution limits are
    visible."""
    n, k = args.experts, args.topk
    router = DriftingRouter(n, args.hidden, args.clusters, args.seed + 1, 0.0)
    mbs = router.step(args.stationary_micro_batch, args.micro_batches)
    batch = torch.cat(mbs)
    out = {}
    for meth in build_methods(args, batch.shape[0], with_sign=False):
        for _ in range(args.stationary_iters):
            meth.curve.append(max_violation(topk_loads(batch, meth.bias, k)))
            meth.run_step(mbs)
        meth.curve.append(max_violation(topk_loads(batch, meth.bias, k)))
        out[meth.name] = meth.curve
    return out, batch.shape[0]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--experts", type=int, default=896, help="n (default: %(default)s)")
    p.add_argument("--topk", type=int, default=16, help="k (default: %(default)s)")
    p.add_argument(
        "--steps", type=int, default=50, help="training steps simulated (default: %(default)s)"
    )
    p.add_argument(
        "--micro-batches", type=int, default=8, help="micro-batches per step (default: %(default)s)"
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=504,
        help="tokens per micro-batch; m_mb*k %% n == 0 (default: %(default)s)",
    )
    bins = [250, 1000, 4000]
    p.add_argument(
        "--bins",
        type=int,
        nargs="+",
        default=bins,
        help=f"histogram sizes B (default: {' '.join(map(str, bins))})",
    )
    p.add_argument("--no-centred", action="store_true", help="skip the centred-bin variant")
    p.add_argument(
        "--sign-rate",
        type=float,
        default=1e-3,
        help="gamma of the sign update (default: %(default)s)",
    )
    p.add_argument("--clusters", type=int, default=4, help="token clusters (default: %(default)s)")
    p.add_argument(
        "--hidden", type=int, default=64, help="router input width (default: %(default)s)"
    )
    p.add_argument(
        "--drift", type=float, default=0.01, help="router drift per step (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="the router's seed (default: %(default)s)")
    p.add_argument(
        "--err-every",
        type=int,
        default=5,
        help="accuracy vs exact every N steps (default: %(default)s)",
    )
    p.add_argument(
        "--stationary-iters",
        type=int,
        default=12,
        help="fixed-batch iterations, 0: skip (default: %(default)s)",
    )
    p.add_argument(
        "--stationary-micro-batch",
        type=int,
        default=1008,
        help="tokens per micro-batch there (default: %(default)s)",
    )
    p.add_argument(
        "--control-steps",
        type=int,
        default=20,
        help="steps of the homogeneous control (1 cluster: every micro-batch alike), 0: skip "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)"
    )
    p.add_argument(
        "--out",
        default=RESULTS,
        help="output folder of bench_balancing.json and .png (default: benchmarks/results)",
    )
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    least = dict(experts=2, topk=1, steps=1, micro_batches=1, micro_batch=1, clusters=1)
    least.update(hidden=1, err_every=1, stationary_iters=0, control_steps=0, threads=1)
    least.update(stationary_micro_batch=1)
    for name, low in least.items():
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: an integer >= {low}")
    refusal = folder_refusal(args.out, "bench_balancing.json and .png")
    if refusal:
        p.error(refusal)
    if args.topk >= args.experts:
        p.error(f"--topk {args.topk}: an integer below --experts {args.experts} (QB's top-(k+1))")
    if min(args.bins) < 2:
        p.error(f"--bins {' '.join(map(str, args.bins))}: each an integer >= 2")
    if not 0.0 <= args.drift <= 1.0:  # the weights keep sqrt(1 - drift^2) of themselves
        p.error(f"--drift {args.drift:g}: a number in [0, 1]")
    if not 0.0 <= args.sign_rate < math.inf:
        p.error(f"--sign-rate {args.sign_rate:g}: a finite number >= 0")
    # megatron-core's qb_dual_update asserts m_mb*k % n == 0 (before timing, not in the run)
    sizes = [("micro_batch", args.micro_batch)]
    if args.stationary_iters > 0:
        sizes.append(("stationary_micro_batch", args.stationary_micro_batch))
    for name, m_mb in sizes:
        if (m_mb * args.topk) % args.experts:
            p.error(
                f"--{name.replace('_', '-')} {m_mb}: a multiple of --experts / gcd(--experts, "
                f"--topk) = {args.experts // math.gcd(args.experts, args.topk)} "
                f"(megatron-core QB needs m_mb*k % n == 0)"
            )
    return args


def summary_rows(methods, plain, stationary, steps):
    """One JSON row per method: mean MaxVio of the last min(20, steps) next batches, mean
    estimator error, router time over the plain top-k's (above 1: slower than plain), bytes."""
    last = min(20, steps)
    rows = []
    for meth in methods:
        rows.append(
            {
                "method": meth.name,
                "maxvio_next_mean_last20": sum(meth.curve[-last:]) / last,
                "maxvio_next_curve": meth.curve,
                "mean_abs_bias_err_vs_exact": (sum(meth.est_err) / len(meth.est_err))
                if meth.est_err
                else None,
                "router_time_ratio": meth.seconds / plain.seconds,
                "bytes_per_step_per_layer": meth.bytes_per_step,
                "stationary_final_maxvio": stationary.get(meth.name, [None])[-1],
            }
        )
    return rows


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()

    methods, plain, m_step = drift_run(args)
    stationary, m_stat = stationary_run(args) if args.stationary_iters > 0 else ({}, 0)
    control = {}
    if args.control_steps > 0:  # same router with ONE cluster: micro-batches are alike
        cargs = argparse.Namespace(
            **{
                **vars(args),
                "clusters": 1,
                "steps": args.control_steps,
                "bins": [1000],
                "no_centred": True,
                "verbose": False,
            }
        )
        cmeth, _, _ = drift_run(cargs)
        tail = max(1, args.control_steps // 2)
        control = {m.name: sum(m.curve[-tail:]) / tail for m in cmeth}

    n, k = args.experts, args.topk
    q = m_step * k / n
    rows = summary_rows(methods, plain, stationary, args.steps)
    notes = [
        "MaxVio = (max load - mean load)/mean load of step t's GLOBAL batch routed with the bias "
        "computed from steps < t.",
        "megatron-core QB = qb_dual_update per micro-batch on the same sigmoid scores with beta = "
        "-b (selection on s - beta == s + b), quantiles averaged over micro-batches (ema 0) and "
        f"re-centred; micro-batches sized so m_mb*k % n == 0 ({args.micro_batch}*{k} % {n} == 0), "
        "as it asserts.",
        "bytes = size of the per-layer per-step collective buffer (ring all-reduce moves ~2x on "
        f"the wire): ours/centred one int32 SUM all-reduce of n*B + {len(HEADER_FIELDS)} words; "
        "exact = all fp32 margins m*n gathered; megatron-core one fp32 [n] AVG all-reduce; sign "
        "one [n] load all-reduce.",
        "router time = all per-micro-batch routing work + step-end update, relative to a plain "
        "biased top-k on the same micro-batches; process CPU time, 1 thread, indicative only (a "
        "GPU differs).",
        "mean |bias err| = mean over experts of |update - exact global Q-th smallest r| before "
        f"centring, same batch and bias, every {args.err_every} steps (megatron-core targets "
        "r_(Q+1) per micro-batch, then averages).",
    ]
    result = {
        "config": {
            "experts": n,
            "topk": k,
            "steps": args.steps,
            "micro_batches": args.micro_batches,
            "micro_batch_tokens": args.micro_batch,
            "tokens_per_step": m_step,
            "target_load_q": q,
            "clusters": args.clusters,
            "hidden": args.hidden,
            "drift": args.drift,
            "seed": args.seed,
            "sign_rate": args.sign_rate,
            "threads": args.threads,
            "torch": torch.__version__,
            "stationary_tokens": m_stat,
            "stationary_iters": args.stationary_iters,
        },
        "methods": rows,
        "stationary_curves": stationary,
        "homogeneous_control_maxvio_next_mean_last_half": control,
        "notes": notes,
        "wall_seconds": None,
    }

    hdr = (
        f"{'method':24s} {'MaxVio next (last20)':>20s} {'|b-exact|':>10s} {'fixed-batch':>11s} "
        f"{'time x':>7s} {'bytes/step/layer':>17s}"
    )
    print(
        f"\nn={n} k={k}  {args.micro_batches} micro-batches x {args.micro_batch} tokens = {m_step} "
        f"tokens/step (q={q:.1f}), {args.steps} steps, drifting router, {args.clusters} clusters"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        err = (
            "-"
            if r["mean_abs_bias_err_vs_exact"] is None
            else f"{r['mean_abs_bias_err_vs_exact']:.2e}"
        )
        st = "-" if r["stationary_final_maxvio"] is None else f"{r['stationary_final_maxvio']:.4f}"
        print(
            f"{r['method']:24s} {r['maxvio_next_mean_last20']:20.4f} {err:>10s} {st:>11s} "
            f"{r['router_time_ratio']:7.2f} {r['bytes_per_step_per_layer']:17,d}"
        )
    if stationary:
        print(
            f"fixed-batch = MaxVio on one fixed batch of {m_stat} tokens (q={m_stat * k / n:.0f}) "
            f"after {args.stationary_iters} updates"
        )
    if control:
        print(
            f"homogeneous control ({args.control_steps} steps, 1 cluster, mean MaxVio next over "
            f"the last {max(1, args.control_steps // 2)}): "
            + ", ".join(f"{k_}: {v:.4f}" for k_, v in control.items())
        )
    for line in notes:
        print("note:", line)

    result["wall_seconds"] = round(time.time() - t_start, 1)
    write_json(os.path.join(args.out, "bench_balancing.json"), result, indent=1)
    plot(result, os.path.join(args.out, "bench_balancing.png"))
    print(f"wrote {args.out}/bench_balancing.json and .png in {result['wall_seconds']} s")


def plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        print("[matplotlib missing: no PNG]")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    c = result["config"]

    def style(name):
        """(colour, linestyle, width): blues = ours, greens = centred, darker = more bins."""
        shades = {"250": 0.45, "1000": 0.7, "4000": 0.95}
        if name.startswith(("ours", "centred")):
            cmap = plt.get_cmap("Blues" if name.startswith("ours") else "Greens")
            b = name.split("=")[-1]
            return (
                cmap(shades.get(b, 0.7)),
                ("-" if name.startswith("ours") else "--"),
                (2.0 if b == "1000" else 1.0),
            )
        if name.startswith("exact"):
            return "black", ":", 2.0
        if name.startswith("megatron"):
            return "tab:red", "-.", 1.8
        return "tab:orange", "-", 1.8

    for r in result["methods"]:
        col, ls, lw = style(r["method"])
        axes[0].plot(r["maxvio_next_curve"], color=col, ls=ls, lw=lw, label=r["method"])
    axes[0].set_yscale("log")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("MaxVio of the next global batch")
    axes[0].set_title(
        f"drifting router, n={c['experts']} k={c['topk']}, {c['tokens_per_step']} tok/step"
    )
    axes[0].legend(fontsize=7)
    for name, curve in result["stationary_curves"].items():
        col, ls, lw = style(name)
        axes[1].plot(curve, color=col, ls=ls, lw=lw, label=name)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("update on the same batch")
    axes[1].set_ylabel("MaxVio (same fixed batch)")
    axes[1].set_title(f"fixed batch of {c['stationary_tokens']} tokens: estimator resolution")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    write_png(fig, path)
    plt.close(fig)


if __name__ == "__main__":
    main()
