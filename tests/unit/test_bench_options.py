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


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "benchmarks").glob("bench_*.py")))
def test_help_names_the_default_of_every_option_that_takes_a_value(script):
    """Each option of every benchmark that takes a value says its default in --help (audits
    found bench_block's --tokens / --iters / --warmup / --dispatcher / --dtype, bench_gpu_block's,
    bench_export_mxfp4's --layers / --workdir, bench_step_balancers' --args-file / --steps /
    --warmup / --nproc, then bench_balance_floor's, bench_balancing's, bench_convert's,
    bench_situ's and bench_training_balance's without one); a list default reads as it is typed
    (bench_convert's --layers, bench_balancing's --bins, bench_balance_floor's --seeds printed
    Python lists: "[2, 5, 9]")."""
    import re

    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    options = proc.stdout.split("\noptions:\n")[1]
    entries = re.split(r"\n(?=  -)", options.strip("\n"))
    takes_value = [e for e in entries if re.match(r"\s*--?[\w-]+[ =][\[{A-Z]", e)]
    assert len(takes_value) >= 2
    missing = [e.split()[0] for e in takes_value if "default" not in e]
    assert missing == []
    # a list default as it is typed, not as Python prints it ("[2, 5, 9]" before)
    text = " ".join(proc.stdout.split())
    assert re.findall(r"default:? [\[(]['\d]", text) == []
    shown = LIST_DEFAULTS.get(script)
    assert shown is None or shown in text


LIST_DEFAULTS = {
    "bench_balance_floor.py": "the model's seeds, one torchrun each (default: 1234)",
    "bench_balancing.py": "histogram sizes B (default: 250 1000 4000)",
    "bench_convert.py": "5 ~ 1.2 GB fp32 (default: 2 5 9)",
}
"""Options whose default is a list: the text --help shows for it."""
