"""benchmarks/results_io.py: where a benchmark writes (``--out`` a file or a folder) and that a
result is never half-written; the two folder benchmarks refuse a file name for ``--out``."""

import argparse
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.results_io import (  # noqa: E402
    RESULTS,
    folder_refusal,
    json_path,
    write_json,
    write_png,
)


def test_out_is_a_file_or_a_folder(tmp_path, capsys):
    p = argparse.ArgumentParser(prog="bench.py")
    assert json_path(p, None, "b.json") == str(Path(RESULTS) / "b.json")
    assert json_path(p, str(tmp_path / "x.json"), "b.json") == str(tmp_path / "x.json")
    assert json_path(p, str(tmp_path), "b.json") == str(tmp_path / "b.json")  # an existing folder
    assert json_path(p, str(tmp_path / "new") + "/", "b.json") == str(tmp_path / "new" / "b.json")
    assert folder_refusal(str(tmp_path / "x.json"), "b.json") is not None
    assert folder_refusal(str(tmp_path / "new"), "b.json") is None
    # a file in the way of the folder: refused before the run (a FileExistsError traceback after
    # it, the results lost), by either kind of benchmark
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    why = f"{blocker} is not a folder; give a folder this run can create or write in"
    for out, folder in ((f"{blocker}/x.json", blocker), (f"{blocker}/sub/", blocker / "sub")):
        with pytest.raises(SystemExit) as info:
            json_path(p, out, "b.json")
        assert info.value.code == 2
        assert capsys.readouterr().err.endswith(f"bench.py: error: --out {folder}: {why}\n")
    assert folder_refusal(str(blocker / "sub"), "b.json") == f"--out {blocker / 'sub'}: {why}"


def test_write_json_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "sub" / "r.json"
    write_json(str(path), {"a": 1}, indent=1)
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        write_json(str(path), {"a": object()})  # fails mid-dump
    assert json.loads(path.read_text()) == {"a": 1}  # the old result, intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"]  # no temporary left


def test_a_folder_benchmark_refuses_a_picture_or_an_existing_file_for_out(tmp_path):
    """``--out x.png`` or an existing file: os.makedirs would fail with a traceback after the
    whole run, or make a folder named like a picture."""
    existing = tmp_path / "results"
    existing.write_text("")
    for out in (str(tmp_path / "x.png"), str(existing)):
        assert folder_refusal(out, "b.json and b.png") == (
            f"--out {out}: a folder is needed (this benchmark writes b.json and b.png there)"
        )


def test_write_json_passes_the_dump_options(tmp_path):
    """The race writes strict JSON (``allow_nan=False``): a NaN is refused, nothing written."""
    path = tmp_path / "r.json"
    with pytest.raises(ValueError, match="JSON compliant"):
        write_json(str(path), {"a": float("nan")}, allow_nan=False)
    assert not list(tmp_path.iterdir())
    write_json(str(path), {"a": 1}, indent=1)
    assert path.read_text() == '{\n "a": 1\n}'


def test_write_png_at_90_dpi(tmp_path):
    """The README's pictures: figure inches x 90 pixels, written whole."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(2, 1))
    path = tmp_path / "sub" / "p.png"
    write_png(fig, str(path))
    plt.close(fig)
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", head[16:24]) == (180, 90)  # IHDR: width, height
    assert [p.name for p in path.parent.iterdir()] == ["p.png"]


def _run(script, *argv):
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def test_a_folder_benchmark_refuses_a_file_for_out(tmp_path):
    proc = _run("bench_balancing.py", "--out", str(tmp_path / "x.json"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--out" in proc.stderr and "a folder is needed" in proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


def test_a_one_json_benchmark_writes_into_a_folder(tmp_path):
    """A folder given to --out failed with IsADirectoryError after the whole run."""
    proc = _run(
        "bench_situ.py", "--tokens", "8", "--ffn", "8", "--reps", "1", "--dtypes", "fp32",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["bench_situ.json"]
    assert json.loads((tmp_path / "bench_situ.json").read_text())["rows"]
