"""Bad input gives one clear error naming the path / tensor / key / field, and never a partial
output directory (conversions write into a temporary sibling and rename at the end)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_latentmoe.convert import ConversionError, export_checkpoint, import_checkpoint

from . import _workers

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def no_leftovers(parent) -> bool:
    return not [n for n in os.listdir(parent) if ".partial-" in n or ".old-" in n]


def export_fails(ckpt, out, match, **kw):
    with pytest.raises(ConversionError, match=match) as info:
        export_checkpoint(ckpt, out, progress=False, **kw)
    assert not os.path.exists(out), "a failed export left an output directory"
    assert no_leftovers(os.path.dirname(str(out)))
    return str(info.value)


def copy_ckpt(workspace, tmp_path, name="ck_single"):
    dst = tmp_path / name
    shutil.copytree(workspace.path(name), dst)
    return dst


# -------------------------------------------------------------------------- unreadable checkpoint
def test_missing_or_not_a_checkpoint(tmp_path):
    export_fails(tmp_path / "nope", tmp_path / "out", r"checkpoint '.*nope' does not exist")
    (tmp_path / "empty").mkdir()
    export_fails(
        tmp_path / "empty",
        tmp_path / "out",
        r"'.*empty' is not a torch_dist checkpoint: no '.metadata'",
    )
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "latest_checkpointed_iteration.txt").write_text("100")
    export_fails(tmp_path / "root", tmp_path / "out", r"the tracker names 'iter_0000100'")
    (tmp_path / "root" / "latest_checkpointed_iteration.txt").write_text("1O0\n")
    export_fails(tmp_path / "root", tmp_path / "out", r"iteration.txt' holds '1O0': expected an")


def test_metadata_json_that_is_not_an_object(tmp_path):
    """Megatron's ``metadata.json`` that parses but is not a JSON object (a corrupt or
    hand-edited file) is one error naming it, not an AttributeError traceback."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".metadata").write_bytes(b"")
    for text in ("[1]", '"torch_dist"', "3"):
        (ck / "metadata.json").write_text(text)
        export_fails(ck, tmp_path / "out", r"metadata.json' cannot be parsed: .*not an object")


@pytest.mark.parametrize("size", ["infGB", "1e400MB", "nanGB", "lots"])
def test_unreadable_max_shard_size(tmp_path, size):
    """``--max-shard-size`` that is no finite number of bytes: one error naming the value, before
    the checkpoint is opened (``inf``: an OverflowError traceback before)."""
    export_fails(
        tmp_path / "nope",
        tmp_path / "out",
        rf"size '{size}' is not understood",
        max_shard_size=size,
    )


def test_corrupt_metadata(workspace, tmp_path):
    ck = copy_ckpt(workspace, tmp_path)
    (ck / ".metadata").write_bytes(b"\x80\x04garbage")
    export_fails(ck, tmp_path / "out", r"'.metadata' cannot be read")


def test_missing_data_file(workspace, tmp_path):
    ck = copy_ckpt(workspace, tmp_path)
    os.remove(ck / "__0_0.distcp")
    export_fails(ck, tmp_path / "out", r"incomplete: data file\(s\) \['__0_0.distcp'\] are missing")


def test_truncated_data_file_fails_midway_without_output(workspace, tmp_path):
    ck = copy_ckpt(workspace, tmp_path)
    data = ck / "__0_0.distcp"
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    export_fails(ck, tmp_path / "out", r"reading failed .*truncated or corrupt")


# ------------------------------------------------------------------------ config vs the weights
@pytest.mark.parametrize(
    "change,match",
    [
        (
            dict(moe_latent_size=16),
            r"local_experts.0.linear_fc1.weight .*shape \(64, 32\), config implies \(64, 16\)",
        ),
        (dict(num_layers=5), r"missing tensor\(s\) .*decoder\.layers\.4\."),
        (dict(num_layers=3), r"unexpected tensor\(s\).*decoder\.layers\.3\."),
        (dict(num_moe_experts=16), r"stacked axes \(8,\) but the config implies \(16,\)"),
        (dict(num_query_groups=4), r"linear_qkv.weight.*shape \(128, 64\).*implies \(192, 64\)"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not allowed"),
        (
            dict(first_k_dense_replace=2),
            r"missing tensor\(s\).*decoder.layers.1.mlp.linear_fc1.weight",
        ),
    ],
)
def test_config_not_matching_the_weights(workspace, tmp_path, change, match):
    cfg = tmp_path / "megatron.json"
    cfg.write_text(json.dumps(dict(_workers.MEGATRON_CFG, **change)))
    export_fails(workspace.path("ck_single"), tmp_path / "out", match, config_file=str(cfg))


def test_correct_config_file_gives_the_same_export(workspace, tmp_path):
    cfg = tmp_path / "megatron.json"
    cfg.write_text(json.dumps(_workers.MEGATRON_CFG))
    s = export_checkpoint(
        workspace.path("ck_single"),
        tmp_path / "out",
        config_file=str(cfg),
        progress=False,
        max_shard_size="300KB",
    )
    assert s.config_source.startswith("config file")
    for f in sorted(os.listdir(workspace.path("hf_main"))):
        assert (tmp_path / "out" / f).read_bytes() == open(
            workspace.path("hf_main", f), "rb"
        ).read(), f


def test_checkpoint_without_model_description(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"embedding.word_embeddings.weight": torch.zeros(4, 4)},
        checkpoint_id=str(tmp_path / "ck"),
        no_dist=True,
    )
    export_fails(
        tmp_path / "ck", tmp_path / "out", r"carries no model description.*--megatron-config"
    )


# ----------------------------------------------------------------------------------- output dir
def test_existing_output_needs_overwrite(workspace, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(
        ConversionError, match=r"output directory '.*out' exists and is not empty; pass --overwrite"
    ):
        export_checkpoint(workspace.path("ck_single"), out, progress=False)
    assert (out / "keep.txt").read_text() == "precious"
    # with overwrite, but failing (corrupt checkpoint): the old output stays as it was
    ck = copy_ckpt(workspace, tmp_path)
    os.truncate(ck / "__0_0.distcp", 100)
    with pytest.raises(ConversionError):
        export_checkpoint(ck, out, overwrite=True, progress=False)
    assert (out / "keep.txt").read_text() == "precious" and no_leftovers(tmp_path)
    # with overwrite and good input: replaced
    export_checkpoint(workspace.path("ck_single"), out, overwrite=True, progress=False)
    assert (
        not (out / "keep.txt").exists()
        and (out / "config.json").is_file()
        and no_leftovers(tmp_path)
    )
    with pytest.raises(ConversionError, match="exists and is not empty"):
        import_checkpoint(workspace.path("hf_main"), out, progress=False)


# ----------------------------------------------------------------------------------- HF import
def _hf_copy(workspace, tmp_path):
    dst = tmp_path / "hf"
    shutil.copytree(workspace.path("hf_main"), dst)
    return dst


def _import_fails(src, out, match, **kw):
    with pytest.raises(ConversionError, match=match):
        import_checkpoint(src, out, progress=False, **kw)
    assert not os.path.exists(out) and no_leftovers(os.path.dirname(str(out)))


def test_import_bad_hf_input(workspace, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = _hf_copy(workspace, tmp_path)
    out = tmp_path / "mg"
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(cfg, moe_intermediate_size=16)))
    _import_fails(
        hf,
        out,
        r"experts.0.w1.weight' shape=\(32, 32\) is not allowed: \(16, 32\), "
        r"what the model config implies",
    )
    (hf / "config.json").write_text(json.dumps(dict(cfg, hidden_act="relu")))
    _import_fails(hf, out, r"hidden_act='relu' is not allowed")
    (hf / "config.json").write_text(json.dumps(cfg))
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    save_file(
        {"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}, str(hf / "extra.safetensors")
    )
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "extra.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    _import_fails(hf, out, r"unexpected tensor\(s\).*model.layers.9.mlp.up_proj.weight")
    del index["weight_map"]["model.layers.9.mlp.up_proj.weight"]
    os.remove(hf / "extra.safetensors")
    name = "model.layers.2.block_sparse_moe.gate.weight"
    shard = index["weight_map"].pop(name)
    kept = load_file(str(hf / shard))
    del kept[name]
    save_file(kept, str(hf / shard))
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    _import_fails(hf, out, r"missing tensor 'model.layers.2.block_sparse_moe.gate.weight'")
    os.remove(hf / shard)
    _import_fails(hf, out, r"safetensors file '.*' \(named by the index\) is missing")
    _import_fails(tmp_path / "nothing", out, r"HF model directory '.*nothing' does not exist")


def test_fp16_export_of_values_beyond_its_range_is_refused(workspace, tmp_path):
    """``--dtype fp16`` where a weight exceeds fp16's 65504: one error naming the option, the
    tensor and its largest value, and no output (it was written as inf)."""
    from safetensors.torch import load_file, save_file

    hf = _hf_copy(workspace, tmp_path)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    name = "model.layers.0.mlp.up_proj.weight"
    tensors = load_file(str(hf / index["weight_map"][name]))
    tensors[name][0, 0] = -1.0e5
    save_file(tensors, str(hf / index["weight_map"][name]), metadata={"format": "pt"})
    mg = tmp_path / "mg"
    import_checkpoint(hf, mg, progress=False)
    message = export_fails(mg, tmp_path / "out", r"dtype='fp16' is not allowed", dtype="fp16")
    assert "'model.layers.0.mlp.up_proj.weight' holds |values| up to 1e+05" in message, message
    assert "bf16 or fp32" in message
    export_checkpoint(mg, tmp_path / "out_bf16", dtype="bf16", progress=False)  # fine in bf16


def test_import_corrupt_safetensors_structure_is_a_clear_error(tmp_path):
    """A safetensors header or index that parses as JSON but has the wrong structure (a
    corrupt or hand-edited file) is one ConversionError naming the file, not a traceback."""
    import struct

    a = _workers.arch()
    hf, out = tmp_path / "hf", tmp_path / "mg"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps(dict(model_type="stable_latentmoe", **a.to_hf_config_kwargs()))
    )

    def shard(header) -> None:
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(64))

    good = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    for header in (
        [1, 2, 3],
        "text",
        {"x": 5},
        {"x": {"dtype": "F32", "shape": [2, 2]}},
        {"x": {"dtype": "F32", "shape": "2x2", "data_offsets": [0, 16]}},
        {"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16]}},
        {"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}},
        {"x": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}},
        {"x": {"dtype": ["F32"], "shape": [2, 2], "data_offsets": [0, 16]}},
    ):
        shard(header)
        _import_fails(hf, out, r"model.safetensors'.*(cannot be read|malformed header entry)")
    shard({"x": good})
    index = hf / "model.safetensors.index.json"
    for text in ("[1]", '{"weight_map": 5}', '{"weight_map": {"x": 5}}', '"x"'):
        index.write_text(text)
        _import_fails(hf, out, r"index.json' is not a valid safetensors index")


def test_an_output_that_would_replace_an_input_is_refused(workspace, tmp_path):
    """``--overwrite`` never deletes an input: an output that is the checkpoint or HF directory,
    or contains it (the save root of the exported iteration), is refused before any work."""
    run = tmp_path / "run"
    shutil.copytree(workspace.path("ck_single"), run / "iter_0000005")
    (run / "latest_checkpointed_iteration.txt").write_text("5")
    hf = _hf_copy(workspace, tmp_path)
    files = sorted(tmp_path.rglob("*"))
    it = run / "iter_0000005"
    for ckpt, out in ((it, it), (it, run), (run, run), (run, it), (it, tmp_path)):
        with pytest.raises(ConversionError, match=r"would replace the input --checkpoint"):
            export_checkpoint(ckpt, out, overwrite=True, progress=False)
    for out in (hf, tmp_path):
        with pytest.raises(ConversionError, match=r"would replace the input --hf"):
            import_checkpoint(hf, out, overwrite=True, progress=False)
    assert sorted(tmp_path.rglob("*")) == files
    # an output inside an input is fine (an export next to the iterations of its save root)
    export_checkpoint(run, run / "hf", progress=False)
    assert (run / "hf" / "config.json").is_file() and (it / ".metadata").is_file()


def test_sigterm_while_writing_leaves_no_partial_output(tmp_path):
    """SIGTERM (``timeout``, Slurm) in the middle of a conversion removes the partial output as
    Ctrl-C does and exits with 143; the output it was to replace stays as it was."""
    from megatron_latentmoe.convert.summary import atomic_output_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous")
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "model-00001.safetensors").write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler raises first
    assert info.value.code == 128 + signal.SIGTERM
    assert (out / "keep.txt").read_text() == "previous" and no_leftovers(tmp_path)
    assert signal.getsignal(signal.SIGTERM) is handler


# ------------------------------------------------------------------------------------------- CLI
def test_cli_reports_bad_input_with_exit_status_2(workspace, tmp_path):
    cfg = tmp_path / "megatron.json"
    cfg.write_text(json.dumps(dict(_workers.MEGATRON_CFG, num_layers=3)))
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "convert_checkpoint.py"),
            "export",
            "--checkpoint",
            workspace.path("ck_single"),
            "--output",
            str(tmp_path / "out"),
            "--megatron-config",
            str(cfg),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "error: checkpoint" in proc.stderr and "decoder.layers.3." in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_plain_megatron_moe_naming_its_latent(workspace, tmp_path, capsys):
    """QB as a drop-in for a Megatron MoE (no moe_latent_size; a softmax router besides): export
    and verify exit 2 with one line naming the latent, the cause, and write nothing (the line
    named the router, and then the latent once fixed)."""
    from megatron_latentmoe.convert import cli

    cfg = tmp_path / "megatron.json"
    drop_in = dict(_workers.MEGATRON_CFG, moe_router_score_function="softmax")
    del drop_in["moe_latent_size"]
    cfg.write_text(json.dumps(drop_in))
    out = tmp_path / "out"
    for argv in (
        ["export", "--output", str(out), "--no-progress"],
        ["verify", "--hf", workspace.path("hf_main")],
    ):
        code = cli.main(
            [*argv, "--checkpoint", workspace.path("ck_single"), "--megatron-config", str(cfg)]
        )
        assert code == cli.EXIT_BAD_INPUT
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"error: config file {str(cfg)!r}: moe_latent_size=None is not allowed: a positive "
            "integer (the HF model is the Stable LatentMoE block, its routed experts in a latent "
            "of this width); unset, the MoE layers are Megatron's MoELayer (QB as a drop-in), "
            "which the HF model does not implement"
        )
    assert not out.exists() and no_leftovers(tmp_path)


def test_cli_help_imports_no_torch():
    """``--help`` answers at once: the parser takes its defaults and choices from
    ``convert/options.py`` and imports neither torch nor megatron / transformers."""
    code = (
        "import sys\n"
        "from megatron_latentmoe.convert.cli import main\n"
        "for command in ('export', 'import', 'verify'):\n"
        "    try:\n"
        "        main([command, '--help'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "heavy = [m for m in ('torch', 'megatron', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--verify-batch", "0"], r"batch \(--verify-batch\)=0 is not allowed: an integer >= 1"),
        (["--verify-tokens", "-1"], r"new_tokens \(--verify-tokens\)=-1 is not allowed"),
        (["--verify-atol", "nan"], r"atol \(--verify-atol\)=nan is not allowed"),
        (
            ["--summary-json", "/nonexistent/s.json"],
            r"--summary-json '/nonexistent/s.json': directory",
        ),
        (["--verify-text", " "], r"text \(--verify-text\)=' ' is not allowed: a non-empty text"),
    ],
)
def test_cli_refuses_bad_options_before_any_work(workspace, tmp_path, capsys, argv, match):
    import re

    from megatron_latentmoe.convert import cli

    out = tmp_path / "out"
    code = cli.main(
        [
            "export",
            "--checkpoint",
            workspace.path("ck_single"),
            "--output",
            str(out),
            "--no-progress",
            "--verify",
            *argv,
        ]
    )
    assert code == cli.EXIT_BAD_INPUT
    assert re.search(match, capsys.readouterr().err)
    assert not out.exists(), "the export ran although an option was bad"


def test_verify_text_that_cannot_fill_the_prompt_is_an_error():
    """An explicit ``--verify-text`` shorter than ``--verify-seq-len`` tokens is refused (the
    default, the corpus, falls back to random ids instead, and the report says so). The shipped
    tokenizer is the one an export of a checkpoint without training args ships."""
    from megatron_latentmoe.convert.verify import sample_tokens
    from megatron_latentmoe.data.corpus import default_tokenizer_dir

    with pytest.raises(
        ConversionError, match=r"--verify-text 'hi' gives 2 tokens .*at least 64 tokens"
    ):
        sample_tokens(default_tokenizer_dir(), 1000, text="hi")


def test_verify_needs_an_hf_directory(workspace, tmp_path, capsys):
    from megatron_latentmoe.convert import cli

    code = cli.main(
        ["verify", "--checkpoint", workspace.path("ck_single"), "--hf", str(tmp_path / "nope")]
    )
    assert code == cli.EXIT_BAD_INPUT and "has no config.json" in capsys.readouterr().err


def test_verify_against_a_model_of_another_vocabulary_is_bad_input(workspace, tmp_path, capsys):
    """``verify`` of a checkpoint against the HF export of a model with another vocab_size (a
    padded vocabulary, another tokenizer) cannot compare logits: one error naming both sizes,
    before either model is built, not a broadcasting traceback."""
    from safetensors.torch import load_file, save_file

    from megatron_latentmoe.convert import cli

    hf = _hf_copy(workspace, tmp_path)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(cfg, vocab_size=4224)))
    weight_map = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors = load_file(str(hf / weight_map[name]))
        tensors[name] = torch.cat([tensors[name], torch.zeros(128, tensors[name].shape[1])])
        save_file(tensors, str(hf / weight_map[name]), metadata={"format": "pt"})
    code = cli.main(["verify", "--checkpoint", workspace.path("ck_single"), "--hf", str(hf)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_BAD_INPUT, err
    assert "vocab_size=4224 is not allowed: 4096" in err and "Traceback" not in err


def test_verify_against_unreadable_hf_weights_is_bad_input(tmp_path, capsys, monkeypatch):
    """``verify`` against an HF directory whose weights are cut short or missing: one line naming
    the file, exit 2, before either model is built (from_pretrained's SafetensorError / OSError
    traceback before). A tiny export imported, not the workspace: no training run needed."""
    from megatron_latentmoe.convert import cli, verify

    hf, ckpt = tmp_path / "hf", tmp_path / "mg"
    _tiny_hf_export(hf)
    import_checkpoint(hf, ckpt, progress=False)
    monkeypatch.setattr(verify, "load_megatron_model", lambda *a: pytest.fail("model built"))
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()  # save_pretrained's progress bar
    argv = ["verify", "--checkpoint", str(ckpt), "--hf", str(hf), "--verify-seq-len", "32"]
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        f"error: safetensors file {str(weights)!r} cannot be read: header longer than the file\n"
    )
    weights.unlink()
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        f"error: HF model directory {str(hf)!r} has neither model.safetensors.index.json nor "
        "model.safetensors\n"
    )


def test_verify_seq_len_beyond_the_models_positions_is_refused(tmp_path, capsys, monkeypatch):
    """``verify --verify-seq-len`` + ``--verify-tokens`` above the model's max_position_embeddings
    (64 here): one line naming both flags, their values and the limit, exit 2, before either
    model is built (the audit's --verify-seq-len 100000 was an out-of-memory RuntimeError
    traceback; a prompt at the limit compared the greedy tokens beyond it, silently); the limit
    itself is checked no further here (its run is the workspace's verify)."""
    from megatron_latentmoe.convert import cli, verify

    hf, ckpt = tmp_path / "hf", tmp_path / "mg"
    _tiny_hf_export(hf)
    import_checkpoint(hf, ckpt, progress=False)
    monkeypatch.setattr(verify, "load_megatron_model", lambda *a: pytest.fail("model built"))
    capsys.readouterr()  # save_pretrained's progress bar
    argv = ["verify", "--checkpoint", str(ckpt), "--hf", str(hf), "--verify-tokens", "4"]
    assert cli.main([*argv, "--verify-seq-len", "61"]) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        "error: --verify-seq-len 61 + --verify-tokens 4 = 65 tokens is not allowed: at most 64, "
        "the model's max_position_embeddings (max_sequence_length): the greedy tokens continue "
        "the prompt\n"
    )
    # the limit passes the check: on to the models
    with pytest.raises(pytest.fail.Exception, match="model built"):
        cli.main([*argv, "--verify-seq-len", "60"])


def test_conversion_refuses_a_verify_seq_len_beyond_the_models_positions_first(
    tmp_path, capsys, monkeypatch
):
    """``export`` / ``import --verify`` whose --verify-seq-len + --verify-tokens (the default 32
    here) is above max_position_embeddings (64 here) is refused in the same line, exit 2, as
    soon as the model description is read: no output directory is begun (it was refused after
    the whole conversion had been written)."""
    from megatron_latentmoe.convert import cli, export, importer

    hf, ckpt = tmp_path / "hf", tmp_path / "mg"
    _tiny_hf_export(hf)
    import_checkpoint(hf, ckpt, progress=False)
    for module in (export, importer):
        monkeypatch.setattr(module, "atomic_output_dir", lambda *a: pytest.fail("output begun"))
    capsys.readouterr()  # save_pretrained's progress bar
    line = (
        "error: --verify-seq-len 33 + --verify-tokens 32 = 65 tokens is not allowed: at most 64, "
        "the model's max_position_embeddings (max_sequence_length): the greedy tokens continue "
        "the prompt\n"
    )
    out = tmp_path / "out"
    for source in (["export", "--checkpoint", str(ckpt)], ["import", "--hf", str(hf)]):
        argv = [*source, "--output", str(out), "--verify", "--no-progress"]
        assert cli.main([*argv, "--verify-seq-len", "33"]) == cli.EXIT_BAD_INPUT
        assert capsys.readouterr() == ("", line)
        assert sorted(os.listdir(tmp_path)) == ["hf", "mg"]
        # the limit passes: on to the conversion (stopped where its output would begin)
        with pytest.raises(pytest.fail.Exception, match="output begun"):
            cli.main([*argv, "--verify-seq-len", "32"])


def test_a_verify_text_too_short_is_refused_before_any_output_or_model(
    tmp_path, capsys, monkeypatch
):
    """``--verify-text`` that gives fewer than --verify-seq-len tokens under the tokenizer the
    comparison will use (export: the one it ships; import / verify: the HF directory's), or an
    export that ships none: one line, exit 2, before the output is begun or a model built (the
    conversion was written whole and refused only then)."""
    from megatron_latentmoe.convert import cli, export, importer, verify
    from megatron_latentmoe.data.corpus import default_tokenizer_dir

    hf, ckpt = tmp_path / "hf", tmp_path / "mg"
    _tiny_hf_export(hf)
    import_checkpoint(hf, ckpt, progress=False)
    for module in (export, importer):
        monkeypatch.setattr(module, "atomic_output_dir", lambda *a: pytest.fail("output begun"))
    monkeypatch.setattr(verify, "load_megatron_model", lambda *a: pytest.fail("model built"))
    capsys.readouterr()  # save_pretrained's progress bar
    out = tmp_path / "out"
    short = ["--verify-text", "Hi", "--verify-seq-len", "8"]
    for source, tokenizer in (
        (["export", "--checkpoint", str(ckpt), "--output", str(out)], default_tokenizer_dir()),
        (["import", "--hf", str(hf), "--output", str(out)], hf),
        (["verify", "--checkpoint", str(ckpt), "--hf", str(hf)], hf),
    ):
        argv = [*source, *(["--verify", "--no-progress"] if "--output" in source else [])]
        assert cli.main([*argv, *short]) == cli.EXIT_BAD_INPUT
        assert capsys.readouterr() == (
            "",
            f"error: --verify-text 'Hi' gives 2 tokens under the tokenizer of "
            f"{str(tokenizer)!r}; allowed: a text of at least 8 tokens (--verify-seq-len)\n",
        )
        assert sorted(os.listdir(tmp_path)) == ["hf", "mg"]
        # 8 tokens suffice: on to the conversion / the models
        with pytest.raises(pytest.fail.Exception, match="output begun|model built"):
            cli.main([*argv, "--verify-seq-len", "8", "--verify-text", "a b c d e f g h"])
    argv = ["export", "--checkpoint", str(ckpt), "--output", str(out), "--tokenizer", "none"]
    assert cli.main([*argv, "--verify", "--no-progress", *short]) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr() == (
        "",
        "error: --verify-text 'Hi': the export ships no tokenizer (--tokenizer none) to give its "
        "tokens; allowed: a text of at least 8 tokens (--verify-seq-len), with a tokenizer "
        "shipped, or no --verify-text\n",
    )
    with pytest.raises(pytest.fail.Exception, match="output begun"):  # random ids: no text
        cli.main([*argv, "--verify", "--no-progress", "--verify-seq-len", "32"])


def test_a_verify_text_outside_the_vocabulary_is_refused_before_any_output_or_model(
    tmp_path, capsys, monkeypatch
):
    """``--verify-text`` whose prompt has a token id beyond the model's vocab_size under the HF
    directory's tokenizer (a 300-token model with the 4096-token tokenizer): one line naming
    --verify-text, exit 2, before the import's output is begun or a model built (the comparison
    ran on seeded random ids instead of the text asked for). An export cannot ship such a
    tokenizer (refused: more tokens than vocab_size)."""
    from megatron_latentmoe.convert import cli, importer, verify

    hf, ckpt = tmp_path / "hf", tmp_path / "mg"
    _tiny_hf_export(hf, vocab_size=300)
    import_checkpoint(hf, ckpt, progress=False)
    monkeypatch.setattr(importer, "atomic_output_dir", lambda *a: pytest.fail("output begun"))
    monkeypatch.setattr(verify, "load_megatron_model", lambda *a: pytest.fail("model built"))
    capsys.readouterr()  # save_pretrained's progress bar
    text = ["--verify-text", "a b c d e f g h"]  # ids 66 271 285 290 319 273 304 269
    for argv in (
        ["import", "--hf", str(hf), "--output", str(tmp_path / "out"), "--verify", "--no-progress"],
        ["verify", "--checkpoint", str(ckpt), "--hf", str(hf)],
    ):
        assert cli.main([*argv, *text, "--verify-seq-len", "5"]) == cli.EXIT_BAD_INPUT
        assert capsys.readouterr() == (
            "",
            f"error: --verify-text 'a b c d e f g h' gives token id 319 under the tokenizer of "
            f"{str(hf)!r}, outside the model's vocab_size=300; allowed: a text whose first 5 "
            "tokens (--verify-seq-len) are ids below 300, or no --verify-text\n",
        )
        assert sorted(os.listdir(tmp_path)) == ["hf", "mg"]
        # its first 4 tokens fit: on to the conversion / the models
        with pytest.raises(pytest.fail.Exception, match="output begun|model built"):
            cli.main([*argv, *text, "--verify-seq-len", "4"])


def test_a_full_disk_under_a_conversion_is_one_line_and_leaves_no_output(
    tmp_path, capsys, monkeypatch
):
    """ENOSPC in the converter's own writes (faked: export's safetensors shard write, import's
    torch.save of a tensor into its torch_dist data file, export's copy of the remote code raise
    it once a file of the output is begun): one line naming --output and the free space, exit 2,
    the temporary directory removed, the output absent or, under --overwrite, as it was (an
    OSError traceback, exit 1, before); EROFS likewise. A copy's error names the source first:
    the line names the file being written."""
    import errno

    from megatron_latentmoe import files
    from megatron_latentmoe.convert import cli, export

    hf, ckpt, out = tmp_path / "hf", tmp_path / "mg", tmp_path / "out"
    _tiny_hf_export(hf)
    import_checkpoint(hf, ckpt, progress=False)
    monkeypatch.setattr(files, "free_bytes", lambda path: 0)
    partial, code = [], [errno.ENOSPC]

    def full_after_one(real):
        def write(*args, **kwargs):
            partial.extend(tmp_path.glob(".out.partial-*/*"))
            if not partial:  # writes go through until a file of the output is begun
                return real(*args, **kwargs)
            raise OSError(code[0], os.strerror(code[0]))

        return write

    shard_write = export.ShardedSafetensorsWriter.write
    monkeypatch.setattr(export.ShardedSafetensorsWriter, "write", full_after_one(shard_write))
    monkeypatch.setattr(torch, "save", full_after_one(torch.save))  # import's tensor writes
    capsys.readouterr()  # save_pretrained's progress bar
    line = (
        f"error: the disk filled up writing in --output {out} (0.0 MB free); free space there "
        "or give --output a folder on a larger disk\n"
    )
    for source in (["export", "--checkpoint", str(ckpt)], ["import", "--hf", str(hf)]):
        partial.clear()
        assert cli.main([*source, "--output", str(out), "--no-progress"]) == cli.EXIT_BAD_INPUT
        assert capsys.readouterr() == ("", line)
        assert partial and sorted(os.listdir(tmp_path)) == ["hf", "mg"]
    code[0] = errno.EROFS  # a file system the kernel turned read-only: the same, in its words
    source = ["export", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress"]
    assert cli.main(source) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr() == (
        "",
        f"error: the file system turned read-only writing in --output {out}; {files.REMOUNT} or "
        "give --output a folder on another disk\n",
    )
    assert sorted(os.listdir(tmp_path)) == ["hf", "mg"]

    targets = []

    def copy_full(src, dst, **kwargs):  # as shutil's sendfile copy raises it
        targets.append(str(dst))
        err = OSError(errno.ENOSPC, "No space left on device")
        err.filename, err.filename2 = str(src), str(dst)
        raise err

    monkeypatch.setattr(export.shutil, "copyfile", copy_full)
    monkeypatch.setattr(export.ShardedSafetensorsWriter, "write", shard_write)
    out.mkdir()
    (out / "keep.txt").write_text("previous")
    argv = ["export", "--checkpoint", str(ckpt), "--output", str(out), "--overwrite"]
    assert cli.main([*argv, "--no-progress"]) == cli.EXIT_BAD_INPUT
    assert targets[0].startswith(f"{tmp_path}/.out.partial-")
    assert capsys.readouterr() == (
        "",
        f"error: the disk filled up writing {targets[0]} (0.0 MB free); free space there or "
        "give --output a folder on a larger disk\n",
    )
    assert sorted(os.listdir(tmp_path)) == ["hf", "mg", "out"]
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "previous"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_anywhere_in_a_conversion_is_one_line_and_leaves_no_partial_output(
    tmp_path, capsys, monkeypatch, signum
):
    """Ctrl-C / SIGTERM (sent to the process: os.kill) in the middle of export's shard write or
    import's torch_dist write: one line, exit 130 / 143, the temporary directory removed, the
    output absent or, under --overwrite, as it was; during the --verify that follows: the line
    says the output is complete. (Ctrl-C printed two lines there; SIGTERM outside the output's
    writing ended the process without a word, exit -15.)"""
    from megatron_latentmoe.convert import cli, export, verify

    hf, ckpt, out = tmp_path / "hf", tmp_path / "mg", tmp_path / "out"
    _tiny_hf_export(hf)
    import_checkpoint(hf, ckpt, progress=False)
    begun = []

    def signalled(real):
        def write(*args, **kwargs):
            begun.extend(tmp_path.glob(".out.partial-*/*"))
            if begun:  # a file of the output is begun: the signal comes now
                os.kill(os.getpid(), signum)
                time.sleep(10)  # the handler raises first
            return real(*args, **kwargs)

        return write

    shard_write = export.ShardedSafetensorsWriter.write
    monkeypatch.setattr(export.ShardedSafetensorsWriter, "write", signalled(shard_write))
    monkeypatch.setattr(torch, "save", signalled(torch.save))  # import's tensor writes
    capsys.readouterr()  # save_pretrained's progress bar
    what = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}[signum]
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    for source in (["export", "--checkpoint", str(ckpt)], ["import", "--hf", str(hf)]):
        argv = [*source, "--output", str(out), "--no-progress"]
        for kept in (False, True):
            begun.clear()
            if kept:
                out.mkdir()
                (out / "keep.txt").write_text("previous")
                argv.append("--overwrite")
            assert cli.main(argv) == 128 + signum
            state = "kept as it was" if kept else "not created"
            assert capsys.readouterr() == (
                "",
                f"interrupted ({what}): nothing written, --output {str(out)!r} {state} (no "
                "partial output left)\n",
            )
            assert begun and no_leftovers(tmp_path)
            assert sorted(os.listdir(tmp_path)) == ["hf", "mg", *(["out"] if kept else [])]
            if kept:
                assert os.listdir(out) == ["keep.txt"]
                shutil.rmtree(out)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers

    monkeypatch.setattr(export.ShardedSafetensorsWriter, "write", shard_write)
    monkeypatch.setattr(verify, "verify_export", signalled(lambda *a, **k: None))
    begun.append("verify")
    argv = ["export", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress", "--verify"]
    argv += ["--verify-seq-len", "32"]  # + the default 32 greedy tokens: the model's 64 positions
    assert cli.main(argv) == 128 + signum
    stdout, stderr = capsys.readouterr()
    assert stdout.startswith(f"export: {ckpt}/release -> {out}\n")
    assert stderr == (
        f"interrupted ({what}) after the conversion: --output {str(out)!r} is complete; "
        "--verify did not finish\n"
    )
    assert (out / "config.json").is_file() and no_leftovers(tmp_path)


# -------------------------------------------------------------------------- tokenizer
def test_bad_tokenizer_fails_before_any_tensor_is_written(workspace, tmp_path, monkeypatch):
    from megatron_latentmoe.convert import export as export_module

    written = []
    original = export_module.ShardedSafetensorsWriter.write
    monkeypatch.setattr(
        export_module.ShardedSafetensorsWriter,
        "write",
        lambda self, *a: written.append(a[0]) or original(self, *a),
    )
    export_fails(
        workspace.path("ck_single"),
        tmp_path / "out",
        r"tokenizer directory '.*nope' does not exist",
        tokenizer_dir=str(tmp_path / "nope"),
    )
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "readme.txt").write_text("not a tokenizer")
    export_fails(
        workspace.path("ck_single"),
        tmp_path / "out",
        r"'.*junk' has no tokenizer files",
        tokenizer_dir=str(tmp_path / "junk"),
    )
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    export_fails(
        workspace.path("ck_single"),
        tmp_path / "out",
        r"'.*broken' does not load as an HF tokenizer",
        tokenizer_dir=str(tmp_path / "broken"),
    )
    assert written == []


def test_tokenizer_larger_than_the_vocabulary_is_refused(workspace, tmp_path):
    from megatron_latentmoe.convert.export import default_tokenizer_dir, prepare_hf_metadata

    from ._workers import arch

    small = __import__("dataclasses").replace(arch(), vocab_size=1000)
    with pytest.raises(
        ConversionError, match=r"has 4096 tokens, more than the model's vocab_size=1000"
    ):
        prepare_hf_metadata(small, torch.float32, default_tokenizer_dir())


def test_default_tokenizer_is_the_one_the_run_trained_with(tmp_path):
    from argparse import Namespace

    from megatron_latentmoe.convert.export import default_tokenizer_dir, resolve_tokenizer_dir

    shipped = default_tokenizer_dir()
    mine = tmp_path / "my_tokenizer"
    mine.mkdir()

    def args(kind, model):
        return {"args": Namespace(tokenizer_type=kind, tokenizer_model=model)}

    assert resolve_tokenizer_dir("default", {}) == shipped  # converter-written: no args
    assert resolve_tokenizer_dir("default", args(None, None)) == shipped  # args, no tokenizer
    assert resolve_tokenizer_dir("default", args("HuggingFaceTokenizer", str(mine))) == str(mine)
    assert resolve_tokenizer_dir("default", args(None, str(mine))) == str(mine)  # type unset
    other_clone = "/elsewhere/clone/megatron_latentmoe/data/assets/tokenizer"
    assert resolve_tokenizer_dir("default", args("HuggingFaceTokenizer", other_clone)) == shipped
    assert resolve_tokenizer_dir(str(mine), args("GPT2BPETokenizer", None)) == str(
        mine
    )  # explicit wins
    assert resolve_tokenizer_dir(None, args("HuggingFaceTokenizer", "/gone")) is None
    with pytest.raises(
        ConversionError, match=r"--tokenizer-model '/gone', which is not a directory here"
    ):
        resolve_tokenizer_dir("default", args("HuggingFaceTokenizer", "/gone"))
    with pytest.raises(
        ConversionError, match=r"--tokenizer-type GPT2BPETokenizer .*--tokenizer DIR"
    ):
        resolve_tokenizer_dir("default", args("GPT2BPETokenizer", "/vocab.json"))


def test_generate_tool_refuses_an_export_without_tokenizer(workspace, tmp_path):
    hf = tmp_path / "hf_no_tokenizer"
    shutil.copytree(workspace.path("hf_main"), hf)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (hf / name).unlink(missing_ok=True)
    tool = os.path.join(REPO, "tools", "generate_hf.py")
    proc = subprocess.run(
        [sys.executable, tool, str(hf)], capture_output=True, text=True, timeout=120
    )
    assert (
        proc.returncode == 2
        and "has no tokenizer files" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    proc = subprocess.run(
        [sys.executable, tool, workspace.path("hf_main"), "--max-new-tokens", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--max-new-tokens=0 is not allowed" in proc.stderr
    proc = subprocess.run(
        [sys.executable, tool, workspace.path("hf_main"), "--prompt", ""],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--prompt='' is not allowed: a text of at least one token" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr


def _tiny_hf_export(path, vocab_size=4096):
    """A small random model saved as an export is (config, weights, remote code, the shipped
    4096-token tokenizer), without the workspace's training run; returns the model (eval, fp32)."""
    from megatron_latentmoe.data.corpus import default_tokenizer_dir
    from megatron_latentmoe.hf import StableLatentMoEForCausalLM
    from tests.unit.test_hf_modeling import _save_with_code, randomize_, tiny_config

    cfg = tiny_config(vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = StableLatentMoEForCausalLM(cfg).eval()
    randomize_(model, std=0.3, seed=5)
    _save_with_code(model, path)
    for name in os.listdir(default_tokenizer_dir()):
        shutil.copy(os.path.join(default_tokenizer_dir(), name), path / name)
    return model


def test_generate_tool_prints_the_greedy_continuation_or_a_seeded_sample(tmp_path, capsys):
    """Greedy by default: the prompt plus exactly --max-new-tokens argmax tokens (special tokens
    left out); --sample draws at temperature 0.8 from seed 0, the same text on every run."""
    from transformers import AutoTokenizer

    from tools import generate_hf

    hf = tmp_path / "hf"
    model = _tiny_hf_export(hf)
    tokenizer = AutoTokenizer.from_pretrained(hf, trust_remote_code=True)
    prompt = "<|endoftext|>In the beginning"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0, 0] == tokenizer.eos_token_id

    def continuation(pick):
        out = ids
        with torch.no_grad():
            for _ in range(5):
                nxt = pick(model(out, use_cache=False).logits[0, -1].double())
                assert nxt != 0, "the tiny model chose EOS: pick another seed"
                out = torch.cat([out, torch.tensor([[nxt]])], dim=1)
        return tokenizer.decode(out[0], skip_special_tokens=True)

    greedy = continuation(lambda logits: int(logits.argmax()))
    torch.manual_seed(0)
    sample = continuation(lambda logits: int(torch.multinomial((logits / 0.8).softmax(-1), 1)))
    assert greedy != sample and greedy.startswith("In the beginning")
    for flags, expected in (([], greedy), (["--sample"], sample), (["--sample"], sample)):
        argv = [str(hf), "--prompt", prompt, "--max-new-tokens", "5", *flags]
        assert generate_hf.main(argv) == 0
        assert capsys.readouterr().out == expected + "\n"


def test_generate_tool_refuses_a_folder_without_config(tmp_path, capsys):
    from tools import generate_hf

    hf = tmp_path / "hf"
    _tiny_hf_export(hf)
    (hf / "config.json").unlink()
    capsys.readouterr()
    assert generate_hf.main([str(hf)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: model_dir={str(hf)!r} has no config.json (an HF export is expected)\n"


def test_generate_tool_refuses_unreadable_weights_or_config_in_one_line(tmp_path, capsys):
    """Weights cut short or missing, a config.json that is not JSON: exit 2 and one line naming
    model_dir and the file (from_pretrained's OSError / SafetensorError traceback before)."""
    from tools import generate_hf

    hf = tmp_path / "hf"
    _tiny_hf_export(hf)
    weights, config = hf / "model.safetensors", hf / "config.json"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()  # save_pretrained's progress bar
    prefix = f"error: model_dir={str(hf)!r}: "
    assert generate_hf.main([str(hf)]) == 2
    assert capsys.readouterr() == (
        "",
        f"{prefix}safetensors file {str(weights)!r} cannot be read: header longer than the file\n",
    )
    weights.unlink()
    assert generate_hf.main([str(hf)]) == 2
    assert capsys.readouterr().err == (
        f"{prefix}HF model directory {str(hf)!r} has neither model.safetensors.index.json nor "
        "model.safetensors\n"
    )
    config.write_text("{")
    assert generate_hf.main([str(hf)]) == 2
    assert capsys.readouterr().err.startswith(
        f"{prefix}config file {str(config)!r} is not valid JSON: Expecting property name"
    )


def test_a_model_folder_as_tokenizer_ships_only_its_tokenizer_files(workspace, tmp_path):
    """A run's --tokenizer-model is often a whole HF model folder: its config, index and weights
    must not overwrite the export's."""
    from megatron_latentmoe.convert.export import default_tokenizer_dir

    folder = tmp_path / "some_hf_model"
    shutil.copytree(default_tokenizer_dir(), folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 99}))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"not ours")
    out = tmp_path / "out"
    export_checkpoint(workspace.path("ck_single"), out, tokenizer_dir=str(folder), progress=False)
    assert json.loads((out / "config.json").read_text())["model_type"] == "stable_latentmoe"
    assert json.loads((out / "generation_config.json").read_text())["bos_token_id"] != 99
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(p.read_bytes() == b"not ours" for p in out.glob("*.safetensors"))
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


def test_token_ids_come_from_the_tokenizer_only_for_megatron_training_checkpoints(tmp_path):
    from megatron_latentmoe.convert.export import default_tokenizer_dir, prepare_hf_metadata

    from ._workers import arch

    own_ids = __import__("dataclasses").replace(
        arch(), bos_token_id=5, eos_token_id=6, pad_token_id=7
    )
    _, kept, _ = prepare_hf_metadata(own_ids, torch.float32, default_tokenizer_dir())
    assert (kept.bos_token_id, kept.eos_token_id, kept.pad_token_id) == (
        5,
        6,
        7,
    )  # converter-written
    _, adopted, _ = prepare_hf_metadata(
        own_ids, torch.float32, default_tokenizer_dir(), adopt_token_ids=True
    )
    assert (adopted.bos_token_id, adopted.eos_token_id, adopted.pad_token_id) == (
        0,
        0,
        1,
    )  # the tokenizer's
    # a tokenizer without a pad token: its bos / eos, and the model description's pad id
    no_pad = tmp_path / "no_pad"
    shutil.copytree(default_tokenizer_dir(), no_pad)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = json.loads((no_pad / name).read_text())
        del cfg["pad_token"]
        (no_pad / name).write_text(json.dumps(cfg))
    _, adopted, _ = prepare_hf_metadata(own_ids, torch.float32, str(no_pad), adopt_token_ids=True)
    assert (adopted.bos_token_id, adopted.eos_token_id, adopted.pad_token_id) == (0, 0, 7)


def test_verify_refuses_a_checkpoint_whose_router_bias_holds_nan(tmp_path):
    """A corrupt ``expert_bias`` (NaN at expert 3 of one router) in the checkpoint ``verify``
    loads: the converter's one error line naming the key, not the router's traceback."""
    from tests.parallel.launcher import run_distributed

    ((name, error),) = run_distributed(_workers.load_with_nan_bias, 1, str(tmp_path))
    assert name == "decoder.layers.1.mlp.router.expert_bias"
    assert error == (
        "Megatron model load: decoder.layers.1.mlp.router.expert_bias (layer 2's router) = "
        "[nan] at expert(s) [3] (1 of 8); allowed: finite values (a corrupt checkpoint: load an "
        "earlier one)"
    )
