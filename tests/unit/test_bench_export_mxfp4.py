"""benchmarks/bench_export_mxfp4.py without exporting: ``--layers`` needs the dense first layer and
a MoE one, the table's units (MB = 1e6 bytes, MiB for the RSS growth, rates over the tensor loop's
seconds) and its two ratios (routed experts bf16 / mxfp4 bytes: 16 / 4.25 expected; MXFP4 loop
seconds over bf16's: above 1 is slower) from fixed export summaries, and the flags each export
gets."""

import json

import pytest

from benchmarks import bench_export_mxfp4 as bench

MX = "bf16 + mxfp4 experts"


def _summary(seconds, stream_seconds, routed, rss_mib):
    return dict(
        seconds=seconds,
        bytes_read=100e6,
        max_rss_growth_bytes=rss_mib * 2**20,
        extra=dict(routed_expert_bytes=routed, stream_seconds=stream_seconds),
    )


ROWS = {
    "bf16": dict(summary=_summary(4.0, 2.0, 16e6, 300), hf_bytes=20e6),
    MX: dict(summary=_summary(5.0, 3.0, 4.25e6, 200), hf_bytes=8.5e6),
}


def test_layers_below_two_are_refused_and_a_folder_gets_the_json(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--layers", "1", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--layers 1: an integer >= 2 (the dense first layer + >= 1 MoE)" in (
        capsys.readouterr().err
    )
    a = bench.parse_args(["--layers", "2", "--out", str(tmp_path)])
    assert (a.layers, a.out) == (2, str(tmp_path / "bench_export_mxfp4.json"))


def test_table_units_and_ratios_from_fixed_summaries():
    table, ratio, slowdown = bench.summarize(ROWS, params=12e6)
    assert ratio == pytest.approx(16 / 4.25)  # bf16 bytes over mxfp4's
    assert slowdown == 1.5  # MXFP4's tensor loop 3 s over bf16's 2 s
    lines = table.splitlines()
    assert lines[0].startswith("export | routed-expert MB | HF MB | s | stream s")
    # MB = 1e6 bytes; read MB/s and M params/s over the stream seconds; RSS in MiB
    assert lines[2] == "bf16 | 16.0 | 20.0 | 4.0 | 2.0 | 50 | 6 | 300"
    assert lines[3] == f"{MX} | 4.2 | 8.5 | 5.0 | 3.0 | 33 | 4 | 200"
    assert lines[4] == (
        "routed experts bf16 / mxfp4 = 3.7647 (16 / 4.25 = 3.7647); MXFP4 tensor loop 1.50x the "
        "bf16 one"
    )


def test_main_exports_once_per_variant_and_writes_the_ratios(monkeypatch, tmp_path):
    calls = []

    def run_cli(args, summary_path):
        calls.append(args)
        return ROWS[MX if "mxfp4" in args else "bf16"]["summary"]

    monkeypatch.setattr(bench, "make_in_child", lambda path, layers: {"params": 12000000})
    monkeypatch.setattr(bench, "run_cli", run_cli)
    monkeypatch.setattr(bench, "dir_bytes", lambda path: 7)
    monkeypatch.setattr(bench, "machine", lambda load: {})
    bench.main(["--layers", "4", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path)])
    assert [c[c.index("--tokenizer") + 2 :] for c in calls] == [
        ["--dtype", "bf16"],
        ["--dtype", "bf16", "--expert-dtype", "mxfp4"],
    ]
    out = json.loads((tmp_path / "bench_export_mxfp4.json").read_text())
    assert out["routed_expert_ratio"] == pytest.approx(16 / 4.25)
    assert out["mxfp4_stream_time_ratio"] == 1.5
    assert (out["arch"]["num_layers"], out["params"], out["checkpoint_bytes"]) == (4, 12e6, 7)
    assert out["rows"]["bf16"]["hf_bytes"] == 7
