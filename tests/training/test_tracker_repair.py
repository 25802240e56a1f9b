"""``repair_checkpoint_tracker``: the tracker names the newest COMPLETE checkpoint after a kill,
whatever the kill (or a corruption) left in it; nothing to resume from is None.
``repair_non_persistent_tracker``: the global non-persistent checkpoints' tracker, the same way;
removed where none of them is complete."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from megatron_latentmoe.checkpoint_layout import TRACKER_FILE, iteration_dir_name
from megatron_latentmoe.training.resume import (
    repair_checkpoint_tracker,
    repair_non_persistent_tracker,
)


@pytest.fixture
def load_dir(tmp_path):
    """Complete torch_dist checkpoints at iterations 2 and 4, a half-written one at 6."""
    for iteration, files in (
        (2, (".metadata", "metadata.json")),
        (4, (".metadata", "metadata.json")),
    ):
        (tmp_path / iteration_dir_name(iteration)).mkdir()
        for name in files:
            (tmp_path / iteration_dir_name(iteration) / name).write_text("{}")
    (tmp_path / iteration_dir_name(6)).mkdir()
    (tmp_path / iteration_dir_name(6) / ".metadata").write_text("{}")  # killed mid-save
    return tmp_path


@pytest.mark.parametrize(
    "held, resumes",
    [
        (b"4", 4),  # names a complete checkpoint: left as it is
        (b"6", 4),  # the half-written one: the newest complete one before it
        (b"3", 2),  # a folder that is not there: the newest complete one before it
        (b"1", 4),  # older than every complete checkpoint: the newest
        (b"", 4),  # cut while written
        (b"2\xc2\xb2", 4),  # "2" then a superscript 2: isdigit() takes it, int() does not
        (b"\xff4", 4),  # not UTF-8 text
    ],
)
def test_the_tracker_is_repaired_to_the_newest_complete_checkpoint(load_dir, held, resumes):
    tracker = load_dir / TRACKER_FILE
    tracker.write_bytes(held)
    assert repair_checkpoint_tracker(str(load_dir), write=False) == resumes
    assert tracker.read_bytes() == held  # write=False only answers
    assert repair_checkpoint_tracker(str(load_dir)) == resumes
    assert tracker.read_text() == str(resumes)


@pytest.mark.parametrize("held", [b"", b"1"])
def test_the_newest_is_chosen_whatever_order_the_folders_are_listed_in(load_dir, monkeypatch, held):
    """os.listdir's order is the file system's: listed newest first, the newest is still 4."""
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: sorted(listdir(path), reverse=True))
    (load_dir / TRACKER_FILE).write_bytes(held)
    assert repair_checkpoint_tracker(str(load_dir), write=False) == 4


def test_nothing_to_resume_from(load_dir, tmp_path_factory):
    (load_dir / TRACKER_FILE).write_text("release")
    assert repair_checkpoint_tracker(str(load_dir)) is None  # a release is loaded as it is
    empty = tmp_path_factory.mktemp("empty")
    (empty / TRACKER_FILE).write_text("7")
    assert repair_checkpoint_tracker(str(empty)) is None
    assert (empty / TRACKER_FILE).read_text() == "7"
    assert repair_checkpoint_tracker(str(empty / "absent")) is None


def test_a_repair_says_what_the_tracker_named_and_leaves_no_temporary_file(load_dir, capsys):
    tracker = load_dir / TRACKER_FILE
    for held, named in ((b"6", "6"), (b"", "nothing readable")):
        tracker.write_bytes(held)
        assert repair_checkpoint_tracker(str(load_dir), write=False) == 4
        assert capsys.readouterr().out == ""  # only answered
        assert repair_checkpoint_tracker(str(load_dir)) == 4
        assert capsys.readouterr().out == (
            f"[pretrain_stable_latentmoe] {tracker} named {named}; resuming from the newest "
            "complete checkpoint, iteration 4\n"
        )
    tracker.write_bytes(b"2\n")  # written by hand, with a newline: it names a complete one
    assert repair_checkpoint_tracker(str(load_dir)) == 2
    assert tracker.read_bytes() == b"2\n" and capsys.readouterr().out == ""
    assert sorted(os.listdir(load_dir)) == sorted(
        [TRACKER_FILE, *(iteration_dir_name(i) for i in (2, 4, 6))]
    )


def test_the_tracker_is_replaced_atomically(load_dir, monkeypatch):
    """The repaired tracker is written aside and renamed over the old one: a kill during the
    repair leaves a tracker naming a checkpoint, never an empty or cut one."""
    tracker = load_dir / TRACKER_FILE
    tracker.write_bytes(b"6")
    replace, seen = os.replace, []

    def replace_seen(src, dst):
        seen.append((os.fspath(dst), open(dst, "rb").read(), open(src, "rb").read()))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_seen)
    assert repair_checkpoint_tracker(str(load_dir)) == 4
    assert seen == [(str(tracker), b"6", b"4")]  # untouched until the rename
    assert tracker.read_bytes() == b"4"


def _non_persistent(tmp_path, tracker: bytes | None, complete=(), cut=()):
    """``--load`` ``tmp_path`` with its global non-persistent folder (``non_persistent`` there, as
    --non-persistent-global-ckpt-dir): complete torch_dist folders, cut ones (a shard file alone,
    as a kill left it: measured) and the tracker holding ``tracker``; returns the flags and the
    tracker."""
    folder = tmp_path / "non_persistent"
    folder.mkdir()
    for iteration in complete:
        (folder / iteration_dir_name(iteration)).mkdir()
        for name in (".metadata", "metadata.json", "__0_0.distcp"):
            (folder / iteration_dir_name(iteration) / name).write_text("{}")
    for iteration in cut:
        (folder / iteration_dir_name(iteration)).mkdir()
        (folder / iteration_dir_name(iteration) / "__0_0.distcp").write_text("")
    if tracker is not None:
        (folder / TRACKER_FILE).write_bytes(tracker)
    args = SimpleNamespace(
        load=str(tmp_path),
        non_persistent_ckpt_type="global",
        non_persistent_global_ckpt_dir=str(folder),
    )
    return args, folder / TRACKER_FILE


def test_a_non_persistent_tracker_naming_a_folder_megatrons_cleanup_removed_is_removed(
    tmp_path, capsys
):
    """The state two kills left (measured, CPU, one rank, --non-persistent-save-interval 2): the
    first during the save of iteration 6 (iter_0000006 cut, the tracker at 4), the second during
    the resumed run's save of 6, after Megatron's cleanup had deleted iter_0000004. Before, the
    next run failed on every rank with "CheckpointingException: Checkpoint directory None does not
    exist"; the tracker removed, it starts from the persistent checkpoint (here: from scratch)."""
    args, tracker = _non_persistent(tmp_path, b"4", cut=[6])
    repair_non_persistent_tracker(args)
    assert not tracker.exists()
    assert capsys.readouterr().out == (
        f"[pretrain_stable_latentmoe] {tracker} named 4, and no non-persistent checkpoint in "
        f"{tracker.parent} is complete: removed it; the run loads the persistent checkpoint in "
        f"--load {tmp_path}, if there is one\n"
    )
    assert os.listdir(tracker.parent) == [iteration_dir_name(6)]


@pytest.mark.parametrize(
    "held, complete, cut, after",
    [
        (b"4", [4], [6], b"4"),  # the first kill: the tracker names the complete one, left
        (b"", [4], [6], b"4"),  # cut while written (Megatron: "Invalid metadata file", exit)
        (b"6", [4], [6], b"4"),  # names the cut one
        (b"release", [], [], b"release"),  # Megatron refuses it itself
    ],
)
def test_a_non_persistent_tracker_is_repaired_as_loads_is(tmp_path, held, complete, cut, after):
    args, tracker = _non_persistent(tmp_path, held, complete, cut)
    repair_non_persistent_tracker(args)
    assert tracker.read_bytes() == after


def test_no_non_persistent_tracker_is_touched_where_megatron_reads_none(tmp_path):
    args, tracker = _non_persistent(tmp_path, b"4", cut=[6])
    for flags in (
        dict(non_persistent_ckpt_type=None),
        dict(non_persistent_ckpt_type="local"),
        dict(non_persistent_global_ckpt_dir=str(tmp_path / "elsewhere")),  # Megatron reads that
        dict(load=None),  # nothing resumed: the repair is --load's
    ):
        repair_non_persistent_tracker(SimpleNamespace(**{**vars(args), **flags}))
        assert tracker.read_bytes() == b"4"
