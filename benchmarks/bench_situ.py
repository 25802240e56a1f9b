"""SiTU-GLU cost, side by side in one run: the op as the model runs it (fused: Triton on CUDA,
torch.compile'd on CPU) vs its eager math, vs the plain-autograd reference (the HF modeling
function) and vs SwiGLU (plain, and fused where TE / Megatron provide one); fwd+bwd time,
activation bytes kept for backward, and on CUDA the achieved bytes/s against a device copy.
Prints a table and writes benchmarks/results/bench_situ.json (or ``--out``: a file, or a folder
to write it in).

    python benchmarks/bench_situ.py [--tokens 4096] [--ffn F] [--dtypes bf16 fp32] [--reps 5]

Defaults: 4096 rows (one 4k-token micro-batch's worth of rows through one expert group) at the
K3 expert intermediate size m_e (SPEC §5). Bytes moved by one fwd+bwd of a packed [R, 2F] input:
forward reads 2F and writes F per row, backward reads 2F + F (the gradient) and writes 2F, so
8 R F elements in all; ``copy_fraction`` = achieved bytes/s over ``x.clone()``'s bytes/s (read +
write) measured in the same run (an H200 copies at ~4.3 TB/s).
"""

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.results_io import json_path, write_json  # noqa: E402
from megatron_latentmoe.fields import BY_NAME
from megatron_latentmoe.hf.modeling_stable_latentmoe import situ_glu as situ_reference
from megatron_latentmoe.ops import situ as situ_mod

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
B1, B2 = situ_mod.DEFAULT_SITU_BETA, situ_mod.DEFAULT_SITU_LINEAR_BETA


def situ_fused(x):
    return situ_mod.situ_glu_packed(x, B1, B2)


@contextlib.contextmanager
def _eager_situ():
    saved = situ_mod._path
    situ_mod._path = lambda t, n: "eager"
    try:
        yield
    finally:
        situ_mod._path = saved


def situ_naive(x):
    f = x.shape[-1] // 2
    return situ_reference(x[..., :f], x[..., f:], B1, B2)


def swiglu(x):
    f = x.shape[-1] // 2
    return F.silu(x[..., :f]) * x[..., f:]


def _fused_swiglu():
    """(name, fn) of a fused SwiGLU on CUDA: TE's op, else Megatron's jit-fused bias_swiglu."""
    try:
        import transformer_engine.pytorch.ops as te_ops

        return "SwiGLU fused (TE ops.SwiGLU)", te_ops.SwiGLU()
    except Exception as exc:  # noqa: BLE001 - no usable TE: try Megatron's
        print(f"TE SwiGLU unavailable ({type(exc).__name__}); trying Megatron's bias_swiglu")
    try:
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

        return "SwiGLU fused (Megatron bias_swiglu)", lambda x: bias_swiglu_impl(x, None)
    except Exception as exc:  # noqa: BLE001 - neither: the table shows the plain SwiGLU only
        print(f"no fused SwiGLU ({type(exc).__name__})")
        return None


def variants(device):
    """(name, fn, context) triples; the context wraps fwd and bwd (the eager variant forces the
    op's eager math for both)."""
    none = contextlib.nullcontext
    rows = [
        ("situ_glu fused (as run)", situ_fused, none),
        ("situ_glu eager math", situ_fused, _eager_situ),
        ("SiTU reference autograd", situ_naive, none),
        ("SwiGLU F.silu(g)*u", swiglu, none),
    ]
    if device.type == "cuda":
        fused = _fused_swiglu()
        if fused is not None:
            rows.append((*fused, none))
    return rows


def saved_bytes(fn, x, ctx):
    """Bytes of distinct storages autograd keeps alive for backward."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with ctx(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return out, sum(storages.values()), len(storages)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_fwd_bwd(vs, x, grad, reps, warmup=2):
    """Median / min fwd+bwd seconds per fn, variants interleaved within each repetition so that
    load from other processes on a shared machine hits them alike."""
    times = [[] for _ in vs]
    for i in range(warmup + reps):
        for k, (_, fn, ctx) in enumerate(vs):
            xi = x.detach().requires_grad_(True)
            _sync(x.device)
            t0 = time.perf_counter()
            with ctx():
                fn(xi).backward(grad)
            _sync(x.device)
            t1 = time.perf_counter()
            if i >= warmup:
                times[k].append(t1 - t0)
    return [(statistics.median(t), min(t)) for t in times]


def copy_bytes_per_s(x, reps):
    """Read + write bytes per second of x.clone() (the device's practical copy bandwidth)."""
    t = []
    for _ in range(reps + 2):
        _sync(x.device)
        t0 = time.perf_counter()
        x.clone()
        _sync(x.device)
        t.append(time.perf_counter() - t0)
    return 2 * x.numel() * x.element_size() / statistics.median(t[2:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--tokens",
        type=int,
        default=4096,
        help="R: rows of the [R, 2F] input (default: %(default)s)",
    )
    p.add_argument(
        "--ffn",
        type=int,
        default=BY_NAME["moe_ffn_hidden_size"].hf_default,  # K3's m_e (SPEC §5)
        help="F: per-expert intermediate size (m_e; default: K3's, %(default)s)",
    )
    dtypes = ["bf16", "fp32"]
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=dtypes,
        choices=sorted(DTYPES),
        help=f"default: {' '.join(dtypes)}",
    )
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (default: %(default)s)")
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="CPU: torch intra-op thread counts to run (default: 1 and the default count)",
    )
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        choices=["cpu", "cuda"],
        help="default: cuda if available, else cpu",
    )
    p.add_argument(
        "--out", help="JSON file or folder (default: benchmarks/results/bench_situ.json)"
    )
    a = p.parse_args()
    a.out = json_path(p, a.out, "bench_situ.json")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; allowed: cpu")
    for flag, value in (("--tokens", a.tokens), ("--ffn", a.ffn), ("--reps", a.reps)):
        if value < 1:
            p.error(f"{flag} {value}: an integer >= 1")
    if a.threads and min(a.threads) < 1:
        p.error(f"--threads {min(a.threads)}: integers >= 1")
    device = torch.device(a.device)
    default_threads = torch.get_num_threads()
    thread_counts = (
        list(dict.fromkeys(a.threads or [1, default_threads]))
        if device.type == "cpu"
        else [default_threads]
    )
    torch.manual_seed(0)
    rows = []
    for threads, dname in [(t, d) for t in thread_counts for d in a.dtypes]:
        torch.set_num_threads(threads)
        dt = DTYPES[dname]
        x = (torch.randn(a.tokens, 2 * a.ffn, device=device) * 3).to(dt)
        grad = torch.randn(a.tokens, a.ffn, device=device).to(dt)
        in_bytes = x.numel() * x.element_size()
        moved = 8 * a.tokens * a.ffn * x.element_size()
        copy_bw = copy_bytes_per_s(x, a.reps)
        vs = variants(device)
        timings = time_fwd_bwd(vs, x, grad, a.reps)
        base = None
        for (vname, fn, ctx), (med, best) in zip(vs, timings, strict=True):
            _, nbytes, ntensors = saved_bytes(fn, x.detach().requires_grad_(True), ctx)
            row = dict(
                threads=threads,
                dtype=dname,
                variant=vname,
                tokens=a.tokens,
                ffn=a.ffn,
                fwd_bwd_ms_median=med * 1e3,
                fwd_bwd_ms_min=best * 1e3,
                saved_bytes=nbytes,
                saved_storages=ntensors,
                saved_over_input=nbytes / in_bytes,
                bytes_per_s=moved / med,
                copy_bytes_per_s=copy_bw,
                copy_fraction=moved / med / copy_bw,
            )
            if base is None:
                base = row
            row["time_vs_situ_glu"] = med / (base["fwd_bwd_ms_median"] / 1e3)
            row["saved_vs_situ_glu"] = nbytes / base["saved_bytes"]
            rows.append(row)

    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    hdr = (
        f"{'thr':>3} {'dtype':5} {'variant':36} {'fwd+bwd ms':>10} {'x time':>7} "
        f"{'GB/s':>8} {'of copy':>7} {'saved MiB':>10} {'saved/input':>11}"
    )
    title = (
        f"SiTU-GLU benchmark: tokens={a.tokens}, F={a.ffn} (input [tokens, 2F]), "
        f"torch {torch.__version__}, {device.type} ({name}), load avg "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    lines = [title, hdr, "-" * len(hdr)]
    for r in rows:
        lines.append(
            f"{r['threads']:3d} {r['dtype']:5} {r['variant']:36} "
            f"{r['fwd_bwd_ms_median']:10.2f} {r['time_vs_situ_glu']:7.2f} "
            f"{r['bytes_per_s'] / 1e9:8.1f} {r['copy_fraction']:7.2f} "
            f"{r['saved_bytes'] / 2**20:10.1f} {r['saved_over_input']:11.2f}"
        )
    table = "\n".join(lines)
    print(table)
    meta = dict(
        torch=torch.__version__,
        thread_counts=thread_counts,
        device=device.type,
        device_name=name,
        cpu_count=os.cpu_count(),
        loadavg_1_5_15=list(os.getloadavg()),
        machine=platform.machine(),
        python=platform.python_version(),
        reps=a.reps,
        note=(
            "time is the median of reps after 2 warm-ups, variants interleaved within "
            "each rep; saved bytes count distinct storages held by autograd for backward "
            "(views of the input count once); bytes moved per fwd+bwd = 8 * tokens * F "
            "* element size"
        ),
    )
    write_json(a.out, dict(meta=meta, rows=rows, table=table), indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
