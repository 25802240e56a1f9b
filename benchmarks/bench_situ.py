"""SiTU-GLU cost vs a naive autograd SiTU and vs SwiGLU: fwd+bwd time and activation bytes kept for
backward, on one packed fc1 output [tokens, 2F] (the tensor Megatron's expert MLP hands the
activation). Prints a table and writes benchmarks/results/bench_situ.json.

    python benchmarks/bench_situ.py [--tokens 4096] [--ffn 3072] [--dtypes bf16 fp32] [--reps 5]

Defaults: 4096 tokens (one 4k-token micro-batch's worth of rows through one expert group) at the
K3 expert intermediate size m_e = 3072.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_latentmoe.ops.situ import (  # noqa: E402
    DEFAULT_SITU_BETA,
    DEFAULT_SITU_LINEAR_BETA,
    situ_glu_packed,
    situ_glu_reference,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def situ_lean(x):
    return situ_glu_packed(x, DEFAULT_SITU_BETA, DEFAULT_SITU_LINEAR_BETA)


def situ_naive(x):
    f = x.shape[-1] // 2
    return situ_glu_reference(x[..., :f], x[..., f:], DEFAULT_SITU_BETA, DEFAULT_SITU_LINEAR_BETA)


def swiglu(x):
    f = x.shape[-1] // 2
    return F.silu(x[..., :f]) * x[..., f:]


VARIANTS = [
    ("situ_glu (lean autograd.Function)", situ_lean),
    ("SiTU naive autograd (fp32 math)", situ_naive),
    ("SwiGLU F.silu(g)*u", swiglu),
]


def saved_bytes(fn, x):
    """Bytes of distinct storages autograd keeps alive for backward."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return out, sum(storages.values()), len(storages)


def time_fwd_bwd(fns, x, grad, reps, warmup=1):
    """Median / min fwd+bwd seconds per fn. The variants are interleaved within each repetition,
    so that load from other processes on a shared machine hits them alike."""
    times = [[] for _ in fns]
    for i in range(warmup + reps):
        for k, fn in enumerate(fns):
            xi = x.detach().requires_grad_(True)
            t0 = time.perf_counter()
            fn(xi).backward(grad)
            t1 = time.perf_counter()
            if i >= warmup:
                times[k].append(t1 - t0)
    return [(statistics.median(t), min(t)) for t in times]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=3072, help="F: per-expert intermediate size (m_e)")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="torch intra-op thread counts to run (default: 1 and the default count)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                "results", "bench_situ.json"))
    a = p.parse_args()
    default_threads = torch.get_num_threads()
    thread_counts = list(dict.fromkeys(a.threads or [1, default_threads]))
    torch.manual_seed(0)
    rows = []
    for threads, dname in [(t, d) for t in thread_counts for d in a.dtypes]:
        torch.set_num_threads(threads)
        dt = DTYPES[dname]
        x = (torch.randn(a.tokens, 2 * a.ffn) * 3).to(dt)
        grad = torch.randn(a.tokens, a.ffn).to(dt)
        in_bytes = x.numel() * x.element_size()
        timings = time_fwd_bwd([fn for _, fn in VARIANTS], x, grad, a.reps)
        base = None
        for (name, fn), (med, best) in zip(VARIANTS, timings):
            _, nbytes, ntensors = saved_bytes(fn, x.detach().requires_grad_(True))
            row = dict(threads=threads, dtype=dname, variant=name, tokens=a.tokens, ffn=a.ffn,
                       fwd_bwd_ms_median=med * 1e3, fwd_bwd_ms_min=best * 1e3,
                       saved_bytes=nbytes, saved_storages=ntensors,
                       saved_over_input=nbytes / in_bytes)
            if base is None:
                base = row
            row["time_vs_situ_glu"] = med / (base["fwd_bwd_ms_median"] / 1e3)
            row["saved_vs_situ_glu"] = nbytes / base["saved_bytes"]
            rows.append(row)

    hdr = (f"{'thr':>3} {'dtype':5} {'variant':34} {'fwd+bwd ms':>10} {'x time':>7} "
           f"{'saved MiB':>10} {'x saved':>8} {'saved/input':>11}")
    lines = [f"SiTU-GLU benchmark: tokens={a.tokens}, F={a.ffn} (input [tokens, 2F]), "
             f"torch {torch.__version__}, CPU, load avg {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} cores (shared machine)", hdr,
             "-" * len(hdr)]
    for r in rows:
        lines.append(f"{r['threads']:3d} {r['dtype']:5} {r['variant']:34} "
                     f"{r['fwd_bwd_ms_median']:10.1f} {r['time_vs_situ_glu']:7.2f} "
                     f"{r['saved_bytes'] / 2**20:10.1f} "
                     f"{r['saved_vs_situ_glu']:8.2f} {r['saved_over_input']:11.2f}")
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    meta = dict(torch=torch.__version__, thread_counts=thread_counts, device="cpu",
                cpu_count=os.cpu_count(), loadavg_1_5_15=list(os.getloadavg()),
                machine=platform.machine(), python=platform.python_version(),
                reps=a.reps, note="time is the median of reps after 1 warm-up, variants interleaved "
                "within each rep; saved bytes count "
                "distinct storages held by autograd for backward (views of the input count once)")
    with open(a.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows, table=table), f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
