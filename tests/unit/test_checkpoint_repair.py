"""What makes a checkpoint folder complete (``training/checkpoint_repair.py``), called directly
with a tmp dir: a save cut by a kill is not. The repairs built on it are
``tests/training/test_tracker_repair.py``'s; ``--auto-detect-ckpt-format``'s rule, each folder by
its own format, is ``test_resume_units.py``'s."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_latentmoe.checkpoint_layout import TRACKER_FILE, iteration_dir_name
from megatron_latentmoe.training import checkpoint_repair


def test_a_distributed_checkpoint_is_complete_with_both_metadata_files(tmp_path):
    path = tmp_path / iteration_dir_name(2)
    path.mkdir()
    (path / "__0_0.distcp").write_text("shard")
    complete = []
    for name in ("metadata.json", ".metadata"):
        (path / name).write_text("{}")
        complete.append(checkpoint_repair.complete_checkpoint(str(path), "torch_dist"))
    (path / "metadata.json").unlink()  # torch DCP's .metadata alone: Megatron had not finished
    complete.append(checkpoint_repair.complete_checkpoint(str(path), "torch_dist"))
    assert complete == [False, True, False]


@pytest.mark.parametrize("ckpt_format", ["torch_dcp", "fsdp_dtensor"])
def test_a_torch_dcp_checkpoint_is_complete_with_its_metadata_file(tmp_path, ckpt_format):
    """Megatron saves these with torch.distributed.checkpoint.save alone: no metadata.json."""
    path = tmp_path / iteration_dir_name(2)
    path.mkdir()
    (path / "__0_0.distcp").write_text("shard")
    complete = [checkpoint_repair.complete_checkpoint(str(path), ckpt_format)]  # killed mid-save
    (path / ".metadata").write_text("{}")
    complete.append(checkpoint_repair.complete_checkpoint(str(path), ckpt_format))
    assert complete == [False, True]
    (tmp_path / TRACKER_FILE).write_bytes(b"")  # cut by a kill: repaired to the complete one
    assert checkpoint_repair.repair_checkpoint_tracker(str(tmp_path), ckpt_format) == 2
    assert (tmp_path / TRACKER_FILE).read_text() == "2"


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch", "auto"])
def test_a_folder_removed_while_it_is_read_is_not_complete(tmp_path, monkeypatch, ckpt_format):
    """Rank 0 removes the unfinished folders at start-up while the other ranks check --load's
    tracker (``write=False``): one gone between their checks is not complete, and the answer is
    the complete one (it was a FileNotFoundError on rank 1 of a 2-rank resume, test_resume's
    distributed-optimizer kill)."""
    import os
    import shutil

    done = tmp_path / iteration_dir_name(5)
    done.mkdir()
    for name in ("metadata.json", ".metadata", "mp_rank_00"):
        (done / name).write_text("{}")
    cut = tmp_path / iteration_dir_name(10)
    cut.mkdir()
    (cut / "__0_0.distcp").write_text("shard")
    (tmp_path / TRACKER_FILE).write_text("5")
    listdir = os.listdir

    def removed_first(path):  # rank 0's rmtree, just after this rank saw the folder
        if str(path) == str(cut):
            shutil.rmtree(cut)
        return listdir(path)

    monkeypatch.setattr(os, "listdir", removed_first)
    assert not checkpoint_repair.complete_checkpoint(str(cut), ckpt_format)
    cut.mkdir()
    (cut / "__0_0.distcp").write_text("shard")
    got = checkpoint_repair.repair_checkpoint_tracker(str(tmp_path), ckpt_format, write=False)
    assert got == 5 and not cut.exists()


def test_a_checkpoint_of_another_format_is_complete_when_not_empty(tmp_path):
    path = tmp_path / iteration_dir_name(2)
    assert not checkpoint_repair.complete_checkpoint(str(path), "torch")  # absent
    path.mkdir()
    assert not checkpoint_repair.complete_checkpoint(str(path), "torch")  # created, nothing written
    (path / "mp_rank_00").mkdir()
    assert checkpoint_repair.complete_checkpoint(str(path), "torch")


def test_a_tracker_is_read_stripped_and_non_persistent_folders_follow_the_loaded_flag(tmp_path):
    """A tracker written by hand ends with a newline; the global non-persistent folder is looked
    for in the folder given (``--pretrained-checkpoint``'s), as Megatron's load does."""
    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()  # typing.override, for megatron.training on Python 3.11

    (tmp_path / TRACKER_FILE).write_text("release\n")
    assert checkpoint_repair.tracker_text(str(tmp_path)) == "release"
    args = SimpleNamespace(
        load="/load", non_persistent_ckpt_type="global", non_persistent_global_ckpt_dir=None
    )
    assert checkpoint_repair.non_persistent_dir(args, "/pretrained") == "/pretrained/non_persistent"
    assert checkpoint_repair.non_persistent_dir(args) == "/load/non_persistent"
