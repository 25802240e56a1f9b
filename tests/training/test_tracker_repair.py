"""``repair_checkpoint_tracker``: the tracker names the newest COMPLETE checkpoint after a kill,
whatever the kill (or a corruption) left in it; nothing to resume from is None.
``repair_non_persistent_checkpoints``: the global non-persistent checkpoints' tracker, the same
way, removed where none of them is complete; their folders cut by a kill and newer than the
newest complete one removed, so that Megatron's next non-persistent save keeps that one."""

from __future__ import annotations

import os
import shutil
import time
from types import SimpleNamespace

import pytest

from megatron_latentmoe.checkpoint_layout import TRACKER_FILE, iteration_dir_name
from megatron_latentmoe.training.checkpoint_repair import (
    repair_checkpoint_tracker,
    repair_non_persistent_checkpoints,
    repair_save_folder,
    save_tracker_refusal,
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
        ckpt_format="torch_dist",
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
    repair_non_persistent_checkpoints(args)
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
    repair_non_persistent_checkpoints(args)
    assert tracker.read_bytes() == after


def test_cut_non_persistent_folders_newer_than_the_complete_one_are_removed(tmp_path, capsys):
    """After a kill during a non-persistent save (6 cut, the tracker at the complete 4), Megatron's
    next non-persistent save would delete every folder but the newest by name: 4, the one the run
    loads. The cut folders newer than 4 go, with one line; 4, the tracker and a cut folder older
    than 4 (which Megatron's cleanup deletes itself) are left."""
    args, tracker = _non_persistent(tmp_path, b"4", complete=[4], cut=[2, 6, 8])
    (tracker.parent / "notes").mkdir()  # not an iteration's folder: not ours
    repair_non_persistent_checkpoints(args)
    assert sorted(os.listdir(tracker.parent)) == [
        iteration_dir_name(2),
        iteration_dir_name(4),
        TRACKER_FILE,
        "notes",
    ]
    assert sorted(os.listdir(tracker.parent / iteration_dir_name(4))) == [
        ".metadata",
        "__0_0.distcp",
        "metadata.json",
    ]
    assert tracker.read_bytes() == b"4"
    assert capsys.readouterr().out == (
        f"[pretrain_stable_latentmoe] removed the non-persistent checkpoint(s) of iteration(s) "
        f"6, 8 in {tracker.parent}, cut by a kill during their save: Megatron's next "
        f"non-persistent save would have deleted the complete one of iteration 4 and kept the "
        f"newer cut one\n"
    )


def test_the_non_persistent_folders_are_tested_in_the_format_they_are_saved_in(tmp_path):
    """Megatron saves them in --ckpt-format: with torch_dcp, a folder with torch DCP's
    ``.metadata`` and no ``metadata.json`` is complete (kept, the tracker too), one without
    ``.metadata`` is cut."""
    args, tracker = _non_persistent(tmp_path, b"4")
    args.ckpt_format = "torch_dcp"
    for iteration, names in ((4, (".metadata", "__0_0.distcp")), (6, ("__0_0.distcp",))):
        (tracker.parent / iteration_dir_name(iteration)).mkdir()
        for name in names:
            (tracker.parent / iteration_dir_name(iteration) / name).write_text("{}")
    repair_non_persistent_checkpoints(args)
    assert tracker.read_bytes() == b"4"
    assert sorted(os.listdir(tracker.parent)) == [iteration_dir_name(4), TRACKER_FILE]
    # a torch_dist run (--auto-detect-ckpt-format or not) on them: megatron-core 0.19.2 loads a
    # non-persistent checkpoint as torch_dist alone ("CheckpointingException: Checkpoint
    # directory None does not exist" for this one), so none is complete: the tracker goes
    args.ckpt_format = "torch_dist"
    repair_non_persistent_checkpoints(args)
    assert sorted(os.listdir(tracker.parent)) == [iteration_dir_name(4)]


def test_no_non_persistent_tracker_is_touched_where_megatron_reads_none(tmp_path):
    args, tracker = _non_persistent(tmp_path, b"4", cut=[6])
    for flags in (
        dict(non_persistent_ckpt_type=None),
        dict(non_persistent_ckpt_type="local"),
        dict(non_persistent_global_ckpt_dir=str(tmp_path / "elsewhere")),  # Megatron reads that
        dict(load=None),  # nothing resumed: the repair is --load's
    ):
        repair_non_persistent_checkpoints(SimpleNamespace(**{**vars(args), **flags}))
        assert tracker.read_bytes() == b"4"


NON_PERSISTENT = [
    "--expert-model-parallel-size",
    "1",
    "--train-iters",
    "8",
    "--non-persistent-ckpt-type",
    "global",
    "--non-persistent-save-interval",
    "2",
    "--save-interval",
    "8",  # the persistent checkpoint: the last iteration's alone
]


def _kill_during_non_persistent_save(folder, iteration):
    """Kill condition: the non-persistent save of ``iteration`` has written a shard file into
    its folder in ``folder``, and not finished."""
    target = folder / iteration_dir_name(iteration)
    announced = f"saving checkpoint at iteration {iteration:7d} to {folder}"

    def should_kill(line: str) -> bool:
        if announced not in line:
            return False
        deadline = time.time() + 20
        while time.time() < deadline:
            if target.is_dir() and any(p.suffix == ".distcp" for p in target.iterdir()):
                return True
            time.sleep(0.01)
        return True

    return should_kill


@pytest.mark.slow
def test_a_twice_killed_run_resumes_from_its_complete_non_persistent_checkpoint():
    """One rank, a non-persistent checkpoint every 2 iterations, killed twice during the save of
    iteration 6. Before, the first kill's cut folder outlived the complete one of 4 (Megatron's
    cleanup keeps the newest by name), the second kill left nothing to resume from but the
    persistent checkpoint, and the third run started from scratch. Now the cut folder goes
    before each load: the third run loads the non-persistent checkpoint of 4, and iterations 5-8
    log the unkilled run's losses to the bit."""
    from . import read_jsonl, run_and_kill, run_entry, scratch_dir

    base = scratch_dir() / "non_persistent_killed"
    whole = run_entry(
        NON_PERSISTENT + ["--save", str(base / "whole"), "--balance-log-file", str(base / "w")],
        nproc=1,
    ).check()
    ckpt, jsonl = base / "ckpt", base / "killed.jsonl"
    args = NON_PERSISTENT + ["--save", str(ckpt), "--load", str(ckpt)]
    args += ["--balance-log-file", str(jsonl)]
    folder = ckpt / "non_persistent"
    removal = (
        f"[pretrain_stable_latentmoe] removed the non-persistent checkpoint(s) of iteration(s) 6 "
        f"in {folder}, cut by a kill during their save: Megatron's next non-persistent save would "
        f"have deleted the complete one of iteration 4 and kept the newer cut one\n"
    )
    for kill in (1, 2):
        killed = run_and_kill(args, _kill_during_non_persistent_save(folder, 6), nproc=1)
        assert not (folder / iteration_dir_name(6) / "metadata.json").exists(), kill
        assert (folder / TRACKER_FILE).read_text() == "4", kill
        assert (folder / iteration_dir_name(4) / "metadata.json").exists(), kill
        assert killed.output.count(removal) == kill - 1, killed.output[-3000:]
    resumed = run_entry(args, nproc=1).check()
    print(f"unkilled {whole.seconds:.0f} s, resumed {resumed.seconds:.0f} s")
    assert resumed.output.count(removal) == 1, resumed.output[-3000:]
    assert "Loading from a non-persistent checkpoint (non-persistent iter 4)" in resumed.output
    ref, chain = read_jsonl(base / "w"), read_jsonl(jsonl)
    assert sorted(chain) == list(range(1, 9)), sorted(chain)
    assert [chain[i]["loss"] for i in range(5, 9)] == [ref[i]["loss"] for i in range(5, 9)]


def test_a_checkpoint_whose_deletion_a_kill_cut_is_never_chosen(tmp_path):
    """megatron-core 0.19.2 deletes an old checkpoint (``--save-retain-interval``, the
    non-persistent cleanup) with ``shutil.rmtree``, in the file system's order: a kill midway
    can leave ``.metadata`` and ``metadata.json`` without the shard file. A repair (the tracker
    cut) took such a folder for complete and named it; Megatron's load then failed on every rank.
    Every cut point of every deletion order: the repair names the whole iteration 2."""
    import itertools

    from tests.training import dcp_checkpoint

    whole = dcp_checkpoint(tmp_path, 2)
    files = sorted(p.name for p in whole.iterdir())
    for order in itertools.permutations(files):
        for cut in range(1, len(files)):
            shutil.rmtree(tmp_path / iteration_dir_name(4), ignore_errors=True)
            deleted = dcp_checkpoint(tmp_path, 4)
            for name in order[:cut]:
                (deleted / name).unlink()
            (tmp_path / TRACKER_FILE).write_text("")
            assert repair_checkpoint_tracker(str(tmp_path), write=False) == 2, order[:cut]


def _dcp_save(root, iteration, torch_dist: bool):
    """torch DCP's part of a save at ``root/iter_N`` (``.metadata``, one shard file), no
    ``metadata.json``: a complete ``torch_dcp`` checkpoint, or (``torch_dist``: with the common
    state megatron-core 0.19.2's torch_dist save adds) a torch_dist save cut before its last
    file."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_latentmoe.training.checkpoint_repair import COMMON_STATE

    state = {"w": torch.arange(64.0)}
    if torch_dist:
        state[COMMON_STATE + "shard_0_1"] = "the common state"
    path = root / iteration_dir_name(iteration)
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _legacy_checkpoint(root, iteration, ep=2, no_save_optim=False):
    """A legacy torch checkpoint of two expert ranks saved with the distributed optimizer: each
    rank folder's model file (its args) and distrib_optim.pt (none with ``no_save_optim``)."""
    import torch

    saved = SimpleNamespace(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep,
        use_distributed_optimizer=True,
        no_save_optim=no_save_optim,
    )
    path = root / iteration_dir_name(iteration)
    for e in range(ep):
        rank = path / f"mp_rank_00_{e:03d}"
        rank.mkdir(parents=True)
        torch.save({"args": saved}, rank / "model_optim_rng.pt")
        if not no_save_optim:
            torch.save({}, rank / "distrib_optim.pt")
    return path


def test_a_legacy_checkpoint_is_judged_by_the_layout_its_readable_args_give(tmp_path):
    """The files a legacy folder needs come from the first rank file that can be read (rank 0's
    cut: the next one's), and a --no-save-optim save needs no distrib_optim.pt."""
    _legacy_checkpoint(tmp_path, 2)
    _legacy_checkpoint(tmp_path, 4, no_save_optim=True)
    (tmp_path / TRACKER_FILE).write_text("")
    assert repair_checkpoint_tracker(str(tmp_path), "torch", write=False) == 4
    shutil.rmtree(tmp_path / iteration_dir_name(4))
    folder = _legacy_checkpoint(tmp_path, 4)
    (folder / "mp_rank_00_000" / "model_optim_rng.pt").write_bytes(b"cut")
    (folder / "mp_rank_00_001" / "distrib_optim.pt").unlink()  # a deletion a kill cut
    assert repair_checkpoint_tracker(str(tmp_path), "torch", write=False) == 2


@pytest.mark.parametrize("ckpt_format", ["torch_dcp", "torch"])
def test_a_checkpoint_of_another_format_whose_deletion_a_kill_cut_is_never_chosen(
    tmp_path, ckpt_format
):
    """As for torch_dist: a torch_dcp folder's shard files against its ``.metadata``, a legacy
    torch folder's rank files against the layout its saved args give (distrib_optim.pt
    included), by the run's format and auto-detected. Every set of files a deletion can have
    removed: the repair names the whole iteration 2."""
    import itertools

    from megatron_latentmoe.training.checkpoint_repair import AUTO_FORMAT

    def make(iteration):
        if ckpt_format == "torch":
            return _legacy_checkpoint(tmp_path, iteration)
        return _dcp_save(tmp_path, iteration, torch_dist=False)

    make(2)
    folder = make(4)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    (tmp_path / TRACKER_FILE).write_text("")
    for each in (ckpt_format, AUTO_FORMAT):
        assert repair_checkpoint_tracker(str(tmp_path), each, write=False) == 4
    for cut in range(1, len(files)):
        for deleted in itertools.combinations(files, cut):
            shutil.rmtree(folder)
            make(4)
            for name in deleted:
                (folder / name).unlink()
            for each in (ckpt_format, AUTO_FORMAT):
                assert repair_checkpoint_tracker(str(tmp_path), each, write=False) == 2, deleted


def _save_args(tmp_path, **flags):
    args = dict(save=str(tmp_path / "save"), load=str(tmp_path / "load"), ckpt_format="torch_dist")
    return SimpleNamespace(**{**args, "save_retain_interval": None, **flags})


def test_save_folder_repair_names_the_complete_checkpoint_and_removes_unfinished_ones(
    tmp_path, capsys
):
    """``--save`` other than ``--load``: its tracker, cut by a kill, made megatron-core 0.19.2's
    save with ``--save-retain-interval`` fail (``int('')``); it is repaired as ``--load``'s,
    removed where no checkpoint there is complete. Unfinished folders (a save cut by a kill, a
    full or read-only disk) are removed, so that a later save of their iteration does not mix
    their files with its own; complete ones and the one the tracker names stay."""
    from tests.training import dcp_checkpoint

    args = _save_args(tmp_path)
    save = tmp_path / "save"
    save.mkdir()
    dcp_checkpoint(save, 2)
    (save / iteration_dir_name(4)).mkdir()  # the save a read-only disk stopped
    (save / iteration_dir_name(6)).mkdir()
    (save / iteration_dir_name(6) / "__0_0.distcp").write_bytes(b"old")  # a kill, mid-write
    (save / TRACKER_FILE).write_text("")
    repair_save_folder(args)
    assert sorted(p.name for p in save.iterdir()) == [iteration_dir_name(2), TRACKER_FILE]
    assert (save / TRACKER_FILE).read_text() == "2"
    out = capsys.readouterr().out
    assert "resuming from the newest complete checkpoint, iteration 2" in out
    assert (
        f"removed the unfinished checkpoint folder(s) iter_0000004, iter_0000006 in --save {save}"
    ) in out

    shutil.rmtree(save / iteration_dir_name(2))
    (save / TRACKER_FILE).write_text("")
    (save / iteration_dir_name(8)).mkdir()
    repair_save_folder(args)
    assert sorted(p.name for p in save.iterdir()) == []
    assert (
        f"{save / TRACKER_FILE} named nothing readable, and no checkpoint in --save {save} is "
        "complete: removed it"
    ) in capsys.readouterr().out


def test_a_torch_dist_save_cut_before_its_metadata_json_is_unfinished(tmp_path, capsys):
    """torch DCP's ``.metadata`` without Megatron's ``metadata.json`` is a complete torch_dcp
    checkpoint by its files' names; a torch_dist save cut between the two looked like one and
    was kept in ``--save``, its shard files mixed with a later save's of that iteration. Its
    ``.metadata`` tells them apart: the cut save is removed, the torch_dcp checkpoint kept."""
    from megatron_latentmoe.training.checkpoint_repair import AUTO_FORMAT, complete_checkpoint

    save = tmp_path / "save"
    save.mkdir()
    cut, dcp = _dcp_save(save, 2, torch_dist=True), _dcp_save(save, 4, torch_dist=False)
    (cut / "__1_0.distcp").write_bytes(b"a rank of the cut save")
    assert not complete_checkpoint(str(cut), AUTO_FORMAT)
    assert complete_checkpoint(str(dcp), AUTO_FORMAT)
    repair_save_folder(_save_args(tmp_path))
    assert sorted(p.name for p in save.iterdir()) == [iteration_dir_name(4), TRACKER_FILE]
    assert "removed the unfinished checkpoint folder(s) iter_0000002 in" in capsys.readouterr().out


@pytest.mark.parametrize("other", ["torch_dcp", "torch"])
def test_a_cut_save_tracker_names_a_complete_checkpoint_of_another_format(tmp_path, other):
    """``--save`` other than ``--load``, a torch_dist run: a complete checkpoint of another
    format there is a checkpoint still (this run does not load it; a later --load of the folder
    judges its format), so a cut tracker is repaired to name it, not removed as naming
    nothing."""
    save = tmp_path / "save"
    save.mkdir()
    if other == "torch":
        _legacy_checkpoint(save, 2)
    else:
        _dcp_save(save, 2, torch_dist=False)
    (save / TRACKER_FILE).write_text("")
    repair_save_folder(_save_args(tmp_path))
    assert (save / TRACKER_FILE).read_text() == "2"
    assert (save / iteration_dir_name(2)).is_dir()


def test_the_folder_the_tracker_names_is_left_to_the_load_checks(tmp_path):
    """``--save`` is ``--load``: the tracker is ``--load``'s repair's, in the run's format; a
    folder it names is not removed (the load checks judge it), another unfinished one is, and a
    complete checkpoint of another format (torch_dcp in a torch_dist run) does not make it name
    that one, as a repair in every format would."""
    save = tmp_path / "save"
    for i in (4, 6):
        (save / iteration_dir_name(i)).mkdir(parents=True)
    _dcp_save(save, 2, torch_dist=False)
    (save / TRACKER_FILE).write_text("4")
    assert repair_checkpoint_tracker(str(save), "torch_dist") is None  # --load's: left
    repair_save_folder(_save_args(tmp_path, load=str(save)))
    assert sorted(p.name for p in save.iterdir()) == [
        iteration_dir_name(2),
        iteration_dir_name(4),
        TRACKER_FILE,
    ]
    assert (save / TRACKER_FILE).read_text() == "4"


def test_a_release_tracker_in_save_with_save_retain_interval_is_refused(tmp_path):
    """megatron-core 0.19.2's first save with ``--save-retain-interval`` read ``release`` as an
    iteration number: a ValueError traceback on every rank."""
    args = _save_args(tmp_path)
    (tmp_path / "save").mkdir()
    (tmp_path / "save" / TRACKER_FILE).write_text("release")
    assert save_tracker_refusal(args) is None
    args.save_retain_interval = 2
    assert save_tracker_refusal(args) == (
        f"--save-retain-interval 2 with --save {args.save}, whose {TRACKER_FILE} says release: "
        "megatron-core 0.19.2's first save would fail reading it as an iteration number; give "
        "--save another folder, or leave --save-retain-interval out"
    )
    (tmp_path / "save" / TRACKER_FILE).write_text("4")
    assert save_tracker_refusal(args) is None


@pytest.mark.slow
def test_a_cut_save_tracker_and_an_unfinished_folder_meet_the_next_run(tmp_path):
    """A run killed during a save into ``--save`` (not ``--load``), restarted with the same
    flags: its cut tracker there failed the first save with "ValueError: invalid literal for
    int() with base 10: ''" on every rank (``--save-retain-interval``); the unfinished folder's
    files stayed among those of the new save of that iteration. Now both are cleared at
    start-up, and the new save of iteration 2 is whole and alone in its folder."""
    from tests.training import iter_dir, run_entry

    save = tmp_path / "save"
    _dcp_save(save, 2, torch_dist=True)  # cut after torch DCP's .metadata
    (iter_dir(save, 2) / "__1_0.distcp").write_bytes(b"from the cut save")
    (save / TRACKER_FILE).write_text("")
    run = run_entry(
        ["--train-iters", "2", "--save-interval", "1", "--save-retain-interval", "1"]
        + ["--save", str(save), "--load", str(tmp_path / "load")]
        + ["--expert-model-parallel-size", "1", "--balance-log-file", str(tmp_path / "b.jsonl")],
        nproc=1,
    ).check()
    assert "removed the unfinished checkpoint folder(s) iter_0000002" in run.output
    assert (save / TRACKER_FILE).read_text() == "2"
    assert sorted(p.name for p in iter_dir(save, 2).iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "metadata.json",
    ]


def test_each_metadata_file_is_read_once_until_it_changes(tmp_path, monkeypatch):
    """The start-up checks each judge every ``iter_*`` folder (a repair with ``write=False``);
    each torch_dcp-looking folder's ``.metadata`` was unpickled by each (201 times for 50
    folders, 20 s: ``checkpoint_repair._dcp_metadata``). Now once per process, and again where the
    file is another: here a torch_dcp checkpoint's replaced by a cut torch_dist save's."""
    from torch.distributed.checkpoint import FileSystemReader

    reads = []
    original = FileSystemReader.read_metadata

    def read_metadata(self, *a, **kw):
        reads.append(os.path.basename(self.path))
        return original(self, *a, **kw)

    monkeypatch.setattr(FileSystemReader, "read_metadata", read_metadata)
    _dcp_save(tmp_path, 2, torch_dist=False)
    newest = _dcp_save(tmp_path, 4, torch_dist=False)
    for _ in range(3):
        assert repair_checkpoint_tracker(str(tmp_path), "torch_dcp", write=False) == 4
    assert sorted(reads) == [iteration_dir_name(2), iteration_dir_name(4)]
    cut = _dcp_save(tmp_path / "other", 4, torch_dist=True)
    os.replace(cut / ".metadata", newest / ".metadata")
    assert repair_checkpoint_tracker(str(tmp_path), "torch_dcp", write=False) == 2


def test_a_torch_dist_run_counts_a_legacy_checkpoint_complete(tmp_path):
    """megatron-core 0.19.2 loads a legacy torch checkpoint in a ``--ckpt-format torch_dist``
    run (its ``load_checkpoint`` detects each folder's format). By the torch_dist rule alone it
    was not complete: a tracker a kill cut next to one was left cut, and Megatron's load printed
    "ERROR: Invalid metadata file" and exited 0, having trained nothing. Now it is repaired to
    the legacy checkpoint, and one whose deletion a kill cut is not chosen."""
    from tests.training import dcp_checkpoint

    dcp_checkpoint(tmp_path, 2)
    legacy = _legacy_checkpoint(tmp_path, 4)
    (tmp_path / TRACKER_FILE).write_text("")
    assert repair_checkpoint_tracker(str(tmp_path), "torch_dist") == 4
    assert (tmp_path / TRACKER_FILE).read_text() == "4"
    (legacy / "mp_rank_00_001" / "distrib_optim.pt").unlink()
    (tmp_path / TRACKER_FILE).write_text("")
    assert repair_checkpoint_tracker(str(tmp_path), "torch_dist", write=False) == 2
