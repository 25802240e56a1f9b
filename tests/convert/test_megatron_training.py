"""The converter against checkpoints of the real training entry point (``megatron.training``).

1. ``examples/pretrain_stable_latentmoe.py`` (torchrun, 2 ranks, EP2, tiny model) trains 3
   iterations with QB rescoring and saves a torch_dist checkpoint: the model description comes
   from the ``args`` that megatron.training stores (no --megatron-config); the rescoring state
   (``router.qb_mean_input``) is not exported.
2. CLI export with ``--verify``: Megatron vs HF logits / greedy generation on that trained model.
3. CLI import of the export as a layout-free ``release`` checkpoint (loaded by the EP2 runs).
4. Two 1-iteration runs from iteration 0 with the same data: ``--load <original> --finetune``
   and ``--load <imported>`` with NO extra flag (release: fresh optimizer and RNG by design),
   both rescoring (the import has no rescoring state: it loads without it).
   Same weights, same batch, same layout: the losses of iteration 1 are bit-identical.
5. A third such run with ``--load <imported> --use-checkpoint-args`` and every model flag given
   wrong: the model comes from the imported checkpoint's args (Megatron's flags and ours), and
   its loss is bit-identical too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.training import read_jsonl, run_entry, scratch_dir

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_latentmoe.convert", *args, "--no-progress"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, NO_VCS_VERSION="1", OMP_NUM_THREADS="1"),
    )


def test_trained_checkpoint_exports_verifies_imports_and_loads_for_training():
    base = scratch_dir() / "convert_training"
    base.mkdir()
    ckpt, hf, imported = base / "ckpt", base / "hf", base / "imported"
    run_entry(
        [
            "--train-iters",
            "3",
            "--save-interval",
            "3",
            "--save",
            str(ckpt),
            "--balance-log-file",
            "none",
            "--moe-qb-rescore-iters",  # its checkpoint holds router.qb_mean_input: not exported
            "3",
        ]
    ).check()

    report = base / "export.json"
    proc = cli(
        "export",
        "--checkpoint",
        str(ckpt),
        "--output",
        str(hf),
        "--verify",
        "--verify-seq-len",
        "48",
        "--verify-tokens",
        "16",
        "--summary-json",
        str(report),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.load(open(report))
    assert result["summary"]["config_source"] == "checkpoint common state (megatron.training args)"
    assert result["verify"]["max_abs_diff"] <= 1e-4 and result["verify"]["greedy_identical"]
    assert result["verify"]["tokens_source"] == "real text, exported tokenizer"
    cfg = json.load(open(hf / "config.json"))
    assert (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["routed_expert_hidden_size"],
        cfg["num_shared_experts"],
        cfg["first_k_dense_replace"],
    ) == (4, 128, 64, 1, 1)

    # --ep (a flag of earlier versions) is accepted and ignored: the import loads at any layout
    proc = cli("import", "--hf", str(hf), "--output", str(imported), "--ep", "2")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "note: --ep ignored" in proc.stderr
    assert (imported / "latest_checkpointed_iteration.txt").read_text() == "release"

    # the runs rescore: the import has no router.qb_mean_input and still loads
    losses = {}
    for name, extra in (
        ("original", ["--load", str(ckpt), "--finetune"]),
        ("imported", ["--load", str(imported)]),
        ("checkpoint_args", ["--load", str(imported), "--use-checkpoint-args", *WRONG_MODEL]),
    ):
        jsonl = base / f"{name}.jsonl"
        run = run_entry(
            ["--train-iters", "1", "--balance-log-file", str(jsonl), "--moe-qb-rescore-iters", "1"]
            + extra
        ).check()
        if name != "original":
            assert "loading release" in run.output, run.output[-3000:]
        losses[name] = read_jsonl(jsonl)[1]["loss"]
    assert losses["imported"] == losses["original"], losses
    assert losses["checkpoint_args"] == losses["original"], losses
    for line in ("Setting num_experts to 8", "Setting hidden_act to situ", "first_k_dense_replace"):
        assert line in run.output, run.output[-3000:]


# The model flags of examples/args/tiny.sh that --use-checkpoint-args takes from the checkpoint
# (Megatron forces its own, we force ours), each given a wrong value: the run would not load
# otherwise. Flags it only fills in when not given (--num-layers, --hidden-size) stay the user's.
WRONG_MODEL = [
    *("--num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 32 --num-query-groups 4").split(),
    *("--moe-latent-size 32 --no-moe-latent-norm").split(),
    *("--moe-shared-expert-intermediate-size 128 --first-k-dense-replace 0").split(),
    *("--hidden-act swiglu --activation-situ-beta 2.0 --activation-situ-linear-beta 9.0").split(),
]
