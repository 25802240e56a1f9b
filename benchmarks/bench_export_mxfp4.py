"""Export with MXFP4 routed experts vs plain bf16: size of the routed experts, throughput, memory.

One wide random Stable LatentMoE checkpoint (``bench_convert.py``'s ``WIDE_ARCH``, fp32,
torch_dist, one process) is exported twice, each in a fresh process, side by side:

* ``--dtype bf16``                       (everything bf16);
* ``--dtype bf16 --expert-dtype mxfp4``  (routed experts MXFP4-packed, the rest bf16).

Reported: routed-expert bytes of each export and their ratio (16 / 4.25 = 3.76 expected), total
HF bytes, seconds, checkpoint MB read per second and parameters per second of the tensor loop,
and the RSS growth during the loop (streaming: bounded by a read batch, not the model size).

    python benchmarks/bench_export_mxfp4.py [--layers 3] [--workdir DIR] [--out FILE/DIR]

Writes benchmarks/results/bench_export_mxfp4.json (or ``--out``: a file, or a folder to write it
in) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_convert import (  # noqa: E402 (needs sys.path above)
    WIDE_ARCH,
    dir_bytes,
    machine,
    make_in_child,
    run_cli,
)

from benchmarks.results_io import json_path, write_json  # noqa: E402

VARIANTS = {
    "bf16": ["--dtype", "bf16"],
    "bf16 + mxfp4 experts": ["--dtype", "bf16", "--expert-dtype", "mxfp4"],
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--layers",
        type=int,
        default=3,
        help="1 dense + (layers - 1) MoE layers (default: %(default)s)",
    )
    ap.add_argument(
        "--workdir",
        default=None,
        help="folder of the checkpoint and its exports, kept (default: a temporary folder, "
        "removed)",
    )
    ap.add_argument(
        "--out",
        "--output",
        dest="out",
        help="JSON file or folder (default: benchmarks/results/bench_export_mxfp4.json)",
    )
    args = ap.parse_args(argv)
    if args.layers < 2:
        ap.error(f"--layers {args.layers}: an integer >= 2 (the dense first layer + >= 1 MoE)")
    args.out = json_path(ap, args.out, "bench_export_mxfp4.json")
    return args


def summarize(rows, params):
    """(table, routed-expert bytes bf16 / mxfp4, MXFP4 tensor-loop seconds / bf16's) from the two
    exports' summaries (``rows``: variant name -> dict(summary=..., hf_bytes=...))."""
    header = (
        "export",
        "routed-expert MB",
        "HF MB",
        "s",
        "stream s",
        "ckpt MB read/s (stream)",
        "M params/s (stream)",
        "RSS growth MiB",
    )
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for name, r in rows.items():
        s, x = r["summary"], r["summary"]["extra"]
        lines.append(
            " | ".join(
                [
                    name,
                    f"{x['routed_expert_bytes'] / 1e6:.1f}",
                    f"{r['hf_bytes'] / 1e6:.1f}",
                    f"{s['seconds']:.1f}",
                    f"{x['stream_seconds']:.1f}",
                    f"{s['bytes_read'] / 1e6 / x['stream_seconds']:.0f}",
                    f"{params / 1e6 / x['stream_seconds']:.0f}",
                    f"{s['max_rss_growth_bytes'] / 2**20:.0f}",
                ]
            )
        )
    bf16, mx = (rows[k]["summary"]["extra"]["routed_expert_bytes"] for k in VARIANTS)
    ratio = bf16 / mx
    slowdown = (
        rows["bf16 + mxfp4 experts"]["summary"]["extra"]["stream_seconds"]
        / rows["bf16"]["summary"]["extra"]["stream_seconds"]
    )
    table = "\n".join(lines) + (
        f"\nrouted experts bf16 / mxfp4 = {ratio:.4f} (16 / 4.25 = 3.7647); "
        f"MXFP4 tensor loop {slowdown:.2f}x the bf16 one"
    )
    return table, ratio, slowdown


def main(argv=None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()
    work = args.workdir or tempfile.mkdtemp(prefix="bench_mxfp4_")
    ck = os.path.join(work, "ck")
    try:
        shutil.rmtree(ck, ignore_errors=True)
        made = make_in_child(ck, args.layers)
        ck_bytes = dir_bytes(ck)
        rows = {}
        for name, flags in VARIANTS.items():
            hf = os.path.join(work, "hf")
            shutil.rmtree(hf, ignore_errors=True)
            s = run_cli(
                ["export", "--checkpoint", ck, "--output", hf, "--tokenizer", "none", *flags],
                os.path.join(work, "summary.json"),
            )
            rows[name] = dict(summary=s, hf_bytes=dir_bytes(hf))
            shutil.rmtree(hf, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    params = made["params"]
    table, ratio, slowdown = summarize(rows, params)
    print(table)

    result = dict(
        benchmark="bench_export_mxfp4",
        description=__doc__.split("\n\n")[0],
        arch=dict(WIDE_ARCH, num_layers=args.layers),
        params=params,
        checkpoint_bytes=ck_bytes,
        machine=machine(load_before),
        notes=(
            "each export in a fresh process; 'stream' = the tensor loop alone (read, quantize, "
            "write); RSS growth = max RSS sampled during the loop minus RSS before it. Shared "
            "2-core machine: throughputs are lower bounds, the ratio of the two rows is the "
            "comparison."
        ),
        routed_expert_ratio=ratio,
        mxfp4_stream_time_ratio=slowdown,
        rows=rows,
        table=table,
    )
    write_json(args.out, result, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
