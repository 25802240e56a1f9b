"""``training.file_checks``: the folders a run writes (``--save``, ``--data-cache-path``) and the
checkpoint ``--load`` names, checked before any rank starts; one line each, naming the file."""

from __future__ import annotations

import os

from megatron_latentmoe.checkpoint_layout import TRACKER_FILE, iteration_dir_name

from . import mounted_tmpfs


def _dcp_checkpoint(root, iteration: int):
    """A small real torch_dist folder (torch DCP's ``.metadata`` and shard file, Megatron's
    ``metadata.json``) at ``root/iter_N``, the tracker naming it; returns its folder."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = root / iteration_dir_name(iteration)
    dcp.save({"w": torch.arange(64.0)}, checkpoint_id=str(path), no_dist=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (root / TRACKER_FILE).write_text(str(iteration))
    return path


def test_a_damaged_load_folder_is_refused_in_one_line(tmp_path):
    """Each of these failed in megatron-core's load, on every rank, with a traceback (or, for an
    HF export, trained from random weights); now one line naming the file and what to do."""
    from megatron_latentmoe.training.file_checks import load_refusal

    path = _dcp_checkpoint(tmp_path, 4)
    assert load_refusal(str(tmp_path), "torch_dist") is None
    (shard,) = path.glob("*.distcp")
    size = shard.stat().st_size
    damaged = f"--load {tmp_path}: the checkpoint of iteration 4 is damaged: "
    advice = (
        f". Write {TRACKER_FILE} with an earlier iteration whose folder is whole, or delete "
        "iter_0000004 (the run then resumes from the newest complete one)"
    )
    os.truncate(shard, size - 1)
    assert load_refusal(str(tmp_path), "torch_dist") == (
        f"{damaged}shard file {shard} is cut short: {size - 1} bytes, where .metadata has data "
        f"up to byte {size}{advice}"
    )
    shard.unlink()
    assert load_refusal(str(tmp_path), "torch_dist") == (
        f"{damaged}shard file {shard} is missing{advice}"
    )
    metadata = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(metadata[:100])
    refusal = load_refusal(str(tmp_path), "torch_dist")
    assert refusal.startswith(
        f"{damaged}{path / '.metadata'} cannot be read ("
    ) and refusal.endswith(advice), refusal
    (path / ".metadata").write_bytes(metadata)
    (path / "metadata.json").write_text('{"sharded_backend": ')
    refusal = load_refusal(str(tmp_path), "torch_dist")
    assert refusal.startswith(f"{damaged}{path / 'metadata.json'} cannot be read (Expecting value")


def test_a_tracker_naming_a_missing_checkpoint_and_an_hf_export_are_refused(tmp_path):
    from megatron_latentmoe.training.file_checks import load_refusal

    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_refusal(str(empty), "torch_dist") is None  # a new run: starts from scratch
    assert load_refusal(str(tmp_path / "absent"), "torch_dist") is None
    (empty / TRACKER_FILE).write_text("8")
    assert load_refusal(str(empty), "torch_dist") == (
        f"--load {empty}: {empty / TRACKER_FILE} names iteration 8, but "
        f"{empty / 'iter_0000008'} is not there and no other complete checkpoint is: give --load "
        f"the folder that holds it, or delete {empty / TRACKER_FILE} to start from scratch"
    )
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert load_refusal(str(hf), "torch_dist") == (
        f"--load {hf} is a Hugging Face export (config.json, *.safetensors), not a Megatron "
        "checkpoint: Megatron would start from random weights. Import it first (python -m "
        f"megatron_latentmoe.convert import --hf {hf} --output SAVE_ROOT) and give --load SAVE_ROOT"
    )


def test_a_checkpoint_of_another_model_shape_is_named_by_its_flags():
    from types import SimpleNamespace

    from megatron_latentmoe.training.file_checks import shape_refusal

    saved = SimpleNamespace(hidden_size=64, num_layers=4, padded_vocab_size=4096, kv_channels=None)
    run = SimpleNamespace(hidden_size=128, num_layers=4, padded_vocab_size=8192, kv_channels=32)
    assert shape_refusal("ck", run, None) is None
    assert shape_refusal("ck", saved, saved) is None
    assert shape_refusal("ck", run, saved) == (
        "--load ck: the checkpoint is of another model shape: --hidden-size 64 (this run: 128), "
        "the padded vocabulary 4096 (this run: 8192). Give the checkpoint's model flags, or "
        "--use-checkpoint-args to take them from it"
    )


def test_a_folder_a_run_cannot_write_is_refused(tmp_path):
    """megatron-core failed on these at its first write (the checkpoint after the first
    --save-interval iterations; the dataset index cache) with a NotADirectoryError traceback."""
    from megatron_latentmoe.training.file_checks import folder_refusal

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert folder_refusal("--save", None) is None
    assert folder_refusal("--save", str(tmp_path / "new" / "deeper")) is None  # created later
    assert folder_refusal("--save", str(a_file / "save")) == (
        f"--save {a_file / 'save'}: {a_file} is not a folder; give a folder this run can create "
        "or write in"
    )
    assert folder_refusal("--data-cache-path", str(a_file)) == (
        f"--data-cache-path {a_file}: {a_file} is not a folder; give a folder this run can "
        "create or write in"
    )


def test_a_read_only_file_system_is_refused_before_the_run(tmp_path):
    """Named as a read-only file system (before: "is not writable", which as root reads as a
    permission problem that root does not have). A real read-only tmpfs mount."""
    from megatron_latentmoe.training.file_checks import folder_refusal

    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        assert folder_refusal("--save", str(ro / "ckpt")) == (
            f"--save {ro / 'ckpt'}: {ro} is on a read-only file system; give a folder this run "
            "can create or write in"
        )
    assert folder_refusal("--save", str(tmp_path / "ro" / "ckpt")) is None  # unmounted: writable


def test_a_full_disk_is_told_and_the_unfinished_save_removed(tmp_path):
    """The line a save that ran out of space ends with (rank 0; the end-to-end run on a real
    full tmpfs is tests/training/test_disk_full.py): the unfinished folder is removed, the
    one a resume loads is named; a complete folder the tracker does not name yet is kept."""
    import errno

    from megatron_latentmoe.training.file_checks import disk_full, disk_full_error

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    other = OSError(errno.EIO, os.strerror(errno.EIO))
    assert disk_full(full, str(tmp_path)) and not disk_full(other, str(tmp_path))
    from torch.distributed.checkpoint import CheckpointException

    chained = RuntimeError("Worker failure")
    chained.__context__ = full
    assert disk_full(chained, str(tmp_path))
    assert disk_full(CheckpointException("write", {1: (chained, None)}), str(tmp_path))
    assert not disk_full(CheckpointException("write", {1: (other, None)}), str(tmp_path))

    _dcp_checkpoint(tmp_path, 1)
    unfinished = tmp_path / iteration_dir_name(2)
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"cut")
    line = disk_full_error(str(tmp_path), 2, "torch_dist")
    assert not unfinished.exists()
    assert line.startswith(
        f"--save {tmp_path}: the disk filled up while saving the checkpoint of iteration 2 ("
    ), line
    assert " free of " in line and f", the unfinished {unfinished} removed); " in line, line
    assert line.endswith(
        f"a resume (--load {tmp_path}) loads iteration 1 ({tmp_path / 'iter_0000001'}, 0.0 MB). "
        "Free space there or give --save a folder on a larger disk"
    ), line

    # saved, but the tracker not written: a resume loads it (the tracker is repaired), kept
    _dcp_checkpoint(tmp_path, 3)
    (tmp_path / TRACKER_FILE).write_text("")
    line = disk_full_error(str(tmp_path), 3, "torch_dist")
    assert (tmp_path / "iter_0000003").is_dir() and "removed" not in line
    assert f"a resume (--load {tmp_path}) loads iteration 3 " in line, line

    # nothing complete: from scratch
    empty = tmp_path / "empty"
    (empty / "iter_0000005").mkdir(parents=True)
    line = disk_full_error(str(empty), 5, "torch_dist")
    assert not (empty / "iter_0000005").exists()
    assert "there is no complete checkpoint there: a resume starts from scratch." in line, line
