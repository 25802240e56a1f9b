"""tools/gpu_checks.sh and tools/fetch_gpu_kit.sh on the CPU: the kit is refused when its
checksum does not match (nothing unpacked), a kit without the expected layout fails with the
missing piece named, bad flags and missing kits get a one-line message. The full ``--check``
dry run over the real kit (unpack, GLIBCXX, install dry run, imports, test collection) is
``test_check_mode_with_real_kit`` (slow; skipped unless .tekit/ holds the kit)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_checks.sh"


def _fake_kit(tmp_path, members=("site/megatron/core/__init__.py",)):
    src = tmp_path / "src"
    for m in members:
        (src / m).parent.mkdir(parents=True, exist_ok=True)
        (src / m).write_text("")
    kit = tmp_path / "kit"
    kit.mkdir()
    with tarfile.open(kit / "te_site.tar.xz", "w:xz") as tar:
        tar.add(src / "site", arcname="site")
    digest = hashlib.sha256((kit / "te_site.tar.xz").read_bytes()).hexdigest()
    (kit / "SHA256SUMS").write_text(f"{digest}  te_site.tar.xz\n")
    return kit


def _run(args, tmp_path, timeout=120, **env):
    """The script with ``env`` over this environment (a value of None unsets the variable)."""
    full_env = dict(os.environ, OUT=str(tmp_path / "out"), **env)
    full_env = {k: v for k, v in full_env.items() if v is not None}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=REPO,
        timeout=timeout,
        check=False,
    )


def test_bad_flag_and_missing_kit(tmp_path):
    r = _run(["--fast"], tmp_path)
    assert r.returncode == 2
    assert r.stderr == "usage: bash tools/gpu_checks.sh [--check | --help]; got '--fast'\n"
    # an argument after a good flag is refused the same way (--check ran, the rest ignored)
    for args in (["--check", "extra"], ["--help", "--check"]):
        r = _run(args, tmp_path, KIT=str(tmp_path / "nowhere"))
        assert (r.returncode, r.stdout) == (2, "")
        assert (
            r.stderr
            == f"usage: bash tools/gpu_checks.sh [--check | --help]; got '{' '.join(args)}'\n"
        )
    assert not (tmp_path / "out").exists()  # nothing begun
    r = _run(["--check"], tmp_path, KIT=str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "no kit in" in r.stdout and "fetch_gpu_kit.sh" in r.stdout


@pytest.mark.parametrize("script", ["gpu_checks.sh", "fetch_gpu_kit.sh"])
def test_help_prints_the_header_and_a_bad_flag_is_the_usage_line(tmp_path, script):
    """``--help`` / ``-h`` print the script's header comment (what it does, how it is run), exit
    0, and touch nothing: gpu_checks.sh printed its usage line and exited 2, fetch_gpu_kit.sh
    took --help for the kit folder. Another flag is the usage line naming it, exit 2 (for
    fetch_gpu_kit.sh it was "--fast/te_site.tar.xz not found")."""
    path = REPO / "tools" / script
    header = path.read_text().split("\nset -")[0].splitlines()[1:]
    for flag in ("--help", "-h"):
        r = subprocess.run(
            ["bash", str(path), flag],
            capture_output=True,
            text=True,
            env=dict(os.environ, OUT=str(tmp_path / "out")),
            timeout=60,
            check=False,
        )
        assert (r.returncode, r.stderr) == (0, "")
        assert r.stdout.splitlines() == [line[2:] for line in header]
        assert f"bash tools/{script} --help" in r.stdout
    r = subprocess.run(
        ["bash", str(path), "--fast"], capture_output=True, text=True, timeout=60, check=False
    )
    usage = "[--check | --help]" if script == "gpu_checks.sh" else "[KIT_DIR | --help]"
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"usage: bash tools/{script} {usage}; got '--fast'\n"
    assert not (tmp_path / "out").exists()  # gpu_checks.sh's $OUT: not even created


def test_checksum_mismatch_refuses_to_unpack(tmp_path):
    kit = _fake_kit(tmp_path)
    with open(kit / "te_site.tar.xz", "ab") as f:
        f.write(b"corrupted in transit")
    site = tmp_path / "site"
    r = _run([], tmp_path, KIT=str(kit), SITE=str(site))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "kit checksum mismatch: refusing to unpack" in r.stdout
    assert not site.exists()


def test_kit_layout_is_checked_and_named(tmp_path):
    """A kit whose archive lacks TE: the check names every missing piece and fails (rc 1)."""
    kit = _fake_kit(tmp_path)
    r = _run(["--check"], tmp_path, KIT=str(kit), PYTHON="false")  # no Python steps run usefully
    out = r.stdout
    assert r.returncode == 1, out + r.stderr
    for piece in ("transformer_engine/pytorch", "pydantic", "transformer_engine/wheel_lib"):
        assert f"kit lacks {piece}" in out
    assert "kit lacks megatron/core" not in out
    assert "kit lacks the prebuilt transformer_engine_torch extension" in out
    assert "FAIL: PYTHON=false cannot import torch; allowed: a python with torch" in out


def test_check_mode_defaults_to_the_venv(tmp_path):
    """Without PYTHON the CPU dry run uses the venv of scripts/setup_env.sh (the machine's python3
    may lack torch); the GPU run keeps python3. Recorded as ``python`` in gpu_checks.json."""
    venv_py = REPO / ".venv" / "bin" / "python"
    if not venv_py.exists():
        pytest.skip("no .venv here (bash scripts/setup_env.sh makes it)")
    kit = _fake_kit(tmp_path)
    r = _run(["--check"], tmp_path, timeout=300, KIT=str(kit), PYTHON=None)
    summary = json.loads((tmp_path / "out" / "gpu_checks.json").read_text())
    assert summary["python"] == str(venv_py), r.stdout + r.stderr
    assert "cannot import torch" not in r.stdout


def test_fetch_gpu_kit_copies_verified_kit(tmp_path):
    kit = _fake_kit(tmp_path)
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "tools", repo / "tools")
    shutil.copy(REPO / ".gitignore", repo / ".gitignore")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)

    def fetch():
        return subprocess.run(
            ["bash", str(repo / "tools" / "fetch_gpu_kit.sh"), str(kit)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    r = fetch()
    assert r.returncode == 0, r.stderr
    assert (repo / ".tekit" / "te_site.tar.xz").read_bytes() == (
        kit / "te_site.tar.xz"
    ).read_bytes()
    (kit / "SHA256SUMS").write_text("0" * 64 + "  te_site.tar.xz\n")
    r = fetch()
    assert r.returncode != 0  # a bad checksum leaves the previous good copy in place
    assert (repo / ".tekit" / "te_site.tar.xz").exists()
    assert not list(repo.glob(".tekit.tmp.*"))


@pytest.mark.slow
def test_check_mode_with_real_kit(tmp_path):
    if not (REPO / ".tekit" / "SHA256SUMS").exists():
        pytest.skip("no kit in .tekit/ (bash tools/fetch_gpu_kit.sh copies it)")
    import sys

    r = _run(["--check"], tmp_path, timeout=900, PYTHON=sys.executable)  # ~1-3 min, 2 cores
    summary = json.loads((tmp_path / "out" / "gpu_checks.json").read_text())
    assert summary["kit_checksum"] == "ok" and summary["mode"] == "check", summary
    assert summary["glibcxx"].startswith("ok"), summary
    assert summary["install"].startswith("ok"), summary
    assert summary["pytest"] == "collected (--check)", summary
    assert r.returncode == 0, (tmp_path / "out" / "gpu_checks.log").read_text()[-3000:]


def test_gpu_benchmark_skips_cleanly_without_cuda(tmp_path):
    """benchmarks/bench_gpu_block.py on a CPU machine: exit 0 and a JSON that says why."""
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: tools/gpu_checks.sh runs the real benchmark")
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_gpu_block.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["skipped"].startswith("needs a CUDA GPU"), result
    args = result["args"]
    assert args["experts"] / args["topk"] == 896 / 16  # K3's n / k: K3's tokens per expert
    assert "bench_gpu_block: skipped: needs a CUDA GPU" in r.stdout


def test_te_probe_help_and_a_bad_probe():
    """``--help`` prints the probes and exit codes, exit 0 (it was the usage line, exit 2); an
    unknown probe is the usage line naming what was given, exit 2."""
    probe = [sys.executable, str(REPO / "tools" / "te_probe.py")]
    shown = subprocess.run([*probe, "--help"], capture_output=True, text=True, timeout=60)
    assert (shown.returncode, shown.stderr) == (0, "")
    assert shown.stdout.startswith("Probes of the Transformer Engine kit's known risks")
    assert "3: skipped (no CUDA" in shown.stdout
    bad = subprocess.run([*probe, "nrom"], capture_output=True, text=True, timeout=60)
    assert (bad.returncode, bad.stdout) == (2, "")
    assert bad.stderr == (
        "usage: python tools/te_probe.py {imports,norm,fp8,grouped}; got ['nrom']\n"
    )
