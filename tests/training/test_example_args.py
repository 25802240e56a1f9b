"""Every shipped args file (``examples/args/*.sh``) passes the entry point's flag checks at the
process count it is written for, so the files do not rot when a flag is renamed or a check is
added; and at a process count its layout does not divide, the entry point says so in one line.

One subprocess runs ``pretrain.main(argv, check_only=True)`` for every case (megatron is imported
once); ``WORLD_SIZE`` is what ``torchrun`` would set.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess

from . import PYTHON, REPO, args_file_args, environment, scratch_dir

ARGS_DIR = REPO / "examples" / "args"
# The process count each file is written for (its header says so).
WORLD_SIZES = {
    "tiny.sh": 2,
    "k3_sparse_tiny.sh": 2,
    "k3_sparse_wide.sh": 2,
    "k3_sparse_tiny_gbs64.sh": 2,
    "k3_sparse_tiny_gbs64_lr1e4.sh": 2,
    "k3_sparse_wide_gbs64.sh": 2,
    "k3_full_scale.sh": 1024,
}

DRIVER = r"""
import contextlib, io, json, os, sys
sys.path.insert(0, sys.argv[1])
from megatron_latentmoe.compat import apply_python311_compat
apply_python311_compat()
from megatron_latentmoe.training.pretrain import main
for name, (world, argv) in json.loads(sys.argv[2]).items():
    os.environ["WORLD_SIZE"] = str(world)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(argv, check_only=True)
    except SystemExit as exc:
        code = exc.code
    print("CASE " + json.dumps(dict(name=name, code=code, output=out.getvalue())), flush=True)
"""


def _argv(name: str) -> list[str]:
    argv = [*args_file_args(ARGS_DIR / name), "--data-cache-path", str(scratch_dir() / "args")]
    if name == "k3_full_scale.sh" and importlib.util.find_spec("transformer_engine") is None:
        argv += ["--transformer-impl", "local"]  # written for TE; here its layers are checked
    return argv


def test_every_args_file_passes_the_flag_checks_at_its_process_count():
    names = sorted(p.name for p in ARGS_DIR.glob("*.sh"))
    assert names == sorted(WORLD_SIZES), "a new args file: add its process count to WORLD_SIZES"
    cases = {name: (WORLD_SIZES[name], _argv(name)) for name in names}
    cases["k3_full_scale.sh at 1 process"] = (1, _argv("k3_full_scale.sh"))
    proc = subprocess.run(
        [PYTHON, "-c", DRIVER, str(REPO), json.dumps(cases)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=environment(),
        timeout=600,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            case = json.loads(line[5:])
            results[case["name"]] = (case["code"], case["output"])
    assert sorted(results) == sorted(cases), (proc.stdout + proc.stderr)[-5000:]
    for name in names:
        code, output = results[name]
        assert code == 0, f"{name}:\n{output[-3000:]}"
    code, output = results["k3_full_scale.sh at 1 process"]
    error = [line for line in output.splitlines() if "error:" in line]
    assert code == 2 and "Traceback" not in output, output[-3000:]
    assert error == [
        "pretrain_stable_latentmoe: error: WORLD_SIZE=1 (the processes launched) is not allowed "
        "with --tensor-model-parallel-size 8 x --pipeline-model-parallel-size 16 x "
        "--context-parallel-size 1 = 128: launch a multiple of 128 processes"
    ], output[-3000:]
