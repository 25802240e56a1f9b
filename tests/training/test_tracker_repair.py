"""``repair_checkpoint_tracker``: the tracker names the newest COMPLETE checkpoint after a kill,
whatever the kill (or a corruption) left in it; nothing to resume from is None."""

from __future__ import annotations

import os

import pytest

from megatron_latentmoe.checkpoint_layout import TRACKER_FILE, iteration_dir_name
from megatron_latentmoe.training.resume import repair_checkpoint_tracker


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
