"""The benchmarks refuse a bad option in one line with exit 2, before any work (they used to
fail with a traceback, some only after the whole benchmark had run)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("bench_balancing.py", ["--steps", "0"], "--steps 0: an integer >= 1"),
        (
            "bench_balancing.py",
            ["--experts", "8", "--topk", "8"],
            "--topk 8: an integer below --experts 8 (QB's top-(k+1))",
        ),
        ("bench_balancing.py", ["--bins", "64", "1"], "--bins 64 1: each an integer >= 2"),
        ("bench_block.py", ["--experts", "4", "--topk", "5"], "--topk 5: an integer below"),
        ("bench_block.py", ["--shared-ffn", "-1"], "--shared-ffn -1: an integer >= 0"),
        ("bench_situ.py", ["--reps", "0"], "--reps 0: an integer >= 1"),
        ("bench_block.py", ["--iters", "0"], "--iters 0: an integer >= 1"),
        ("bench_step_balancers.py", ["--methods", "none", "--steps", "0"], "--steps 0"),
        ("bench_convert.py", ["--layers", "2", "0"], "--layers 0: each an integer >= 2"),
    ],
)
def test_bad_option_is_one_line_exit_2(script, argv, message, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *argv, "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())
