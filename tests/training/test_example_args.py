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


# flag of k3_full_scale.sh -> the StableLatentMoETransformerConfig field it sets
K3_MODEL_FLAGS = {
    "--num-layers": "num_layers",
    "--first-k-dense-replace": "first_k_dense_replace",
    "--hidden-size": "hidden_size",
    "--ffn-hidden-size": "ffn_hidden_size",
    "--num-experts": "num_moe_experts",
    "--moe-router-topk": "moe_router_topk",
    "--moe-ffn-hidden-size": "moe_ffn_hidden_size",
    "--moe-latent-size": "moe_latent_size",
    "--moe-shared-expert-intermediate-size": "moe_shared_expert_intermediate_size",
    "--hidden-act": "hidden_act",
    "--activation-situ-beta": "activation_situ_beta",
    "--activation-situ-linear-beta": "activation_situ_linear_beta",
    "--moe-qb-num-bins": "moe_qb_num_bins",
    "--norm-epsilon": "layernorm_epsilon",
}


def test_k3_full_scale_args_are_the_k3_config():
    """k3_full_scale.sh writes SPEC §5's sizes out as flags; they must be the HF class defaults
    that ``config.k3_full_scale_config`` (and the converter) read."""
    from megatron_latentmoe.config import k3_full_scale_config

    argv = args_file_args(ARGS_DIR / "k3_full_scale.sh")
    given = {flag: argv[argv.index(flag) + 1] for flag in K3_MODEL_FLAGS if flag in argv}
    assert set(given) == set(K3_MODEL_FLAGS), set(K3_MODEL_FLAGS) - set(given)
    k3 = k3_full_scale_config()
    for flag, field in K3_MODEL_FLAGS.items():
        want = getattr(k3, field)
        assert type(want)(given[flag]) == want, (flag, given[flag], field, want)
