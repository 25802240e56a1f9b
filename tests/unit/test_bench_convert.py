"""benchmarks/bench_convert.py without converting: ``--layers`` needs the dense first layer and a
MoE one, a failed conversion is one error naming it, and the table's units (GB = 1e9 bytes for
checkpoints, GiB for memory, MiB for the largest tensor) from fixed conversion summaries."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_convert as bench


def test_layers_below_two_are_refused(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(
        sys, "argv", ["bench_convert.py", "--layers", "3", "1", "--out", str(tmp_path)]
    )
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2
    assert "--layers 1: each an integer >= 2" in capsys.readouterr().err


def _write(path, size):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def test_dir_bytes_counts_files_in_subfolders_too(tmp_path):
    _write(tmp_path / "a.bin", 3)
    _write(tmp_path / "sub" / "deeper" / "b.bin", 5)
    assert bench.dir_bytes(str(tmp_path)) == 8


def _summary(seconds, mb_per_s, peak, growth, largest=0):
    return dict(
        seconds=seconds,
        mb_per_s=mb_per_s,
        peak_rss_bytes=peak,
        max_rss_growth_bytes=growth,
        largest_tensor_bytes=largest,
        extra=dict(stream_mb_per_s=2 * mb_per_s),
    )


def test_a_failed_conversion_is_one_error_naming_it(monkeypatch, tmp_path):
    def failing(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, stdout="out", stderr="no such checkpoint")

    monkeypatch.setattr(bench.subprocess, "run", failing)
    with pytest.raises(
        SystemExit, match=r"^conversion failed: export --checkpoint c\nout\nno such"
    ):
        bench.run_cli(["export", "--checkpoint", "c"], str(tmp_path / "s.json"))

    def converting(cmd, **kw):
        summary = cmd[cmd.index("--summary-json") + 1]
        Path(summary).write_text(json.dumps(dict(summary=dict(seconds=1.5))))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", converting)
    summary = bench.run_cli(["import"], str(tmp_path / "s.json"))
    assert summary["seconds"] == 1.5 and summary["process_wall_s"] >= 0


def test_table_and_json_units_from_fixed_summaries(monkeypatch, tmp_path):
    gib = 2**30
    sizes = dict(ck=5_500_000_000, hf=5_400_000_000, mg=700)  # bytes in each folder

    def make(cmd, **kw):  # the --_make child of a model of 12.3 M parameters
        return subprocess.CompletedProcess(cmd, 0, stdout='{"params": 12300000, "save_s": 0.5}\n')

    def convert(args, summary_path):
        if args[0] == "export":
            return _summary(2.0, 970.4, 3 * gib, gib // 2, largest=300 * 2**20)
        return _summary(4.0, 600.0, 5 * gib, gib // 4)

    monkeypatch.setattr(bench.subprocess, "run", make)
    monkeypatch.setattr(bench, "run_cli", convert)
    monkeypatch.setattr(bench, "dir_bytes", lambda path: sizes[Path(path).name.split("_")[0]])
    argv = ["--layers", "2", "--workdir", str(tmp_path / "w")]
    monkeypatch.setattr(sys, "argv", ["bench_convert.py", *argv, "--out", str(tmp_path / "r.json")])
    bench.main()
    result = json.loads((tmp_path / "r.json").read_text())
    (row,) = result["rows"]
    assert (row["layers"], row["params"], row["save_s"]) == (2, 12300000, 0.5)
    assert (row["checkpoint_bytes"], row["hf_bytes"], row["mg_bytes"]) == tuple(sizes.values())
    assert row["export"]["seconds"] == 2.0 and row["import_"]["seconds"] == 4.0
    cells = result["table"].splitlines()[2].split(" | ")
    assert cells == [
        "2",
        "12",  # M parameters
        "5.50",  # GB of checkpoint: 1e9 bytes
        "2.0",
        "970 (1941)",  # MB/s (the tensor loop's)
        "3.00",  # GiB
        "0.50",
        "4.0",
        "600 (1200)",
        "5.00",
        "0.25",
        "300",  # MiB
    ]
