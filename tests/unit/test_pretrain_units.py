"""The entry point's pieces (``training/pretrain.py``) called directly with small inputs: a tmp
dir, a namespace of flags, fakes for Megatron's loaders. Whole runs (these pieces wired into
Megatron's loop) are ``tests/training/test_pretrain.py``'s and ``test_resume.py``'s; the tracker
repair is ``tests/training/test_tracker_repair.py``'s."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from megatron_latentmoe.checkpoint_layout import TRACKER_FILE, iteration_dir_name
from megatron_latentmoe.training import pretrain


def test_startup_env_sets_megatrons_variables_unless_given(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setenv("NO_VCS_VERSION", "0")
    pretrain._startup_env()
    assert (os.environ["CUDA_DEVICE_MAX_CONNECTIONS"], os.environ["NO_VCS_VERSION"]) == ("1", "0")
    monkeypatch.delenv("NO_VCS_VERSION")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    pretrain._startup_env()
    assert (os.environ["CUDA_DEVICE_MAX_CONNECTIONS"], os.environ["NO_VCS_VERSION"]) == ("8", "1")


@pytest.mark.parametrize("rank, printed", [(None, "a 1\n"), ("0", "a 1\n"), ("1", "")])
def test_print0_prints_on_rank_0_only(monkeypatch, capsys, rank, printed):
    monkeypatch.delenv("RANK", raising=False)
    if rank is not None:
        monkeypatch.setenv("RANK", rank)
    pretrain._print0("a", 1)
    assert capsys.readouterr().out == printed


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch_dcp", "fsdp_dtensor"])
def test_a_distributed_checkpoint_is_complete_with_both_metadata_files(tmp_path, ckpt_format):
    path = tmp_path / iteration_dir_name(2)
    path.mkdir()
    (path / "__0_0.distcp").write_text("shard")
    complete = []
    for name in ("metadata.json", ".metadata"):
        (path / name).write_text("{}")
        complete.append(pretrain._complete_checkpoint(str(path), ckpt_format))
    (path / "metadata.json").unlink()  # torch DCP's .metadata alone: Megatron had not finished
    complete.append(pretrain._complete_checkpoint(str(path), ckpt_format))
    assert complete == [False, True, False]


def test_a_checkpoint_of_another_format_is_complete_when_not_empty(tmp_path):
    path = tmp_path / iteration_dir_name(2)
    assert not pretrain._complete_checkpoint(str(path), "torch")  # absent
    path.mkdir()
    assert not pretrain._complete_checkpoint(str(path), "torch")  # created, nothing written
    (path / "mp_rank_00").mkdir()
    assert pretrain._complete_checkpoint(str(path), "torch")


def _checkpoints(root, iterations, tracker=None, files=(".metadata", "metadata.json")):
    for iteration in iterations:
        (root / iteration_dir_name(iteration)).mkdir()
        for name in files:
            (root / iteration_dir_name(iteration) / name).write_text("{}")
    if tracker is not None:
        (root / TRACKER_FILE).write_bytes(tracker)
    return str(root)


@pytest.fixture
def common_state(monkeypatch):
    """``dist_checkpointing.load_common_state_dict`` of folders holding ``args`` named after
    them (``bad``: not a distributed checkpoint); the folders read are listed."""
    from megatron.core import dist_checkpointing

    read = []

    def load_common_state_dict(path):
        read.append(os.path.basename(path))
        if "bad" in path:
            raise FileNotFoundError(path)
        return {"args": f"args of {os.path.basename(path)}"}

    monkeypatch.setattr(dist_checkpointing, "load_common_state_dict", load_common_state_dict)
    return read


def test_saved_args_are_the_resumed_checkpoints(tmp_path, common_state):
    """The checkpoint a run resumes from (the tracker repaired, without writing it), of the
    run's format; a release one only when asked for; None where nothing can be loaded."""
    root = _checkpoints(tmp_path, [2, 4], tracker=b"6")
    assert pretrain.saved_args(root) == "args of iter_0000004"
    assert (tmp_path / TRACKER_FILE).read_bytes() == b"6"  # answered, not repaired
    (tmp_path / iteration_dir_name(7)).mkdir()
    (tmp_path / iteration_dir_name(7) / "model.pt").write_text("")  # a legacy torch checkpoint
    (tmp_path / TRACKER_FILE).write_bytes(b"7")
    assert pretrain.saved_args(root, "torch") == "args of iter_0000007"
    assert pretrain.saved_args(root) == "args of iter_0000004"
    assert common_state == ["iter_0000004", "iter_0000007", "iter_0000004"]
    assert pretrain.saved_args(str(tmp_path / "absent")) is None
    assert common_state[3:] == []


def test_saved_args_of_a_release_checkpoint_only_with_release(tmp_path, common_state):
    root = _checkpoints(tmp_path, [], tracker=b"release")
    (tmp_path / "release").mkdir()
    assert pretrain.saved_args(root) is None
    assert pretrain.saved_args(root, release=True) == "args of release"
    (tmp_path / TRACKER_FILE).write_bytes(b"7")  # an iteration never saved: not the release
    assert pretrain.saved_args(root, release=True) is None
    (tmp_path / TRACKER_FILE).write_bytes(b"\xff")  # unreadable: Megatron reports it
    assert pretrain.saved_args(root, release=True) is None
    (tmp_path / TRACKER_FILE).unlink()
    assert pretrain.saved_args(root, release=True) is None
    assert common_state == ["release"]
    (tmp_path / "bad").mkdir()
    bad = _checkpoints(tmp_path / "bad", [3])
    assert pretrain.saved_args(bad) is None  # not a distributed checkpoint: Megatron reports it
    assert common_state == ["release", "iter_0000003"]


def _checkpoint_args(monkeypatch, saved, **flags):
    """``load_checkpoint_args`` on ``flags`` with Megatron's loader faked (it records the
    checkpoint flag it reads) and ``saved_args`` answering ``saved[folder]``."""
    loaded, asked = [], []
    checkpointing = SimpleNamespace(
        load_args_from_checkpoint=lambda args, load_arg: loaded.append(load_arg)
    )
    monkeypatch.setitem(sys.modules, "megatron.training.checkpointing", checkpointing)

    def saved_args(load_dir, ckpt_format, *, release):
        asked.append((load_dir, ckpt_format, release))
        return saved.get(load_dir)

    monkeypatch.setattr(pretrain, "saved_args", saved_args)
    monkeypatch.setenv("RANK", "0")
    args = SimpleNamespace(
        load=None,
        pretrained_checkpoint=None,
        non_persistent_ckpt_type=None,
        ckpt_format="torch_dist",
        hidden_act="silu",
        first_k_dense_replace=0,
        moe_qb_num_bins=256,
    )
    vars(args).update(flags)
    pretrain.load_checkpoint_args(args)
    return args, loaded, asked


def test_use_checkpoint_args_takes_our_model_flags_from_each_checkpoint(monkeypatch, capsys):
    """Megatron's flags from --pretrained-checkpoint, then --load; ours that the model's config
    holds (an HF key) from each, where the checkpoint has them; a training flag of ours (the QB
    bins) stays the command line's."""
    saved = {
        "pre": SimpleNamespace(hidden_act="situ_glu", first_k_dense_replace=1, moe_qb_num_bins=9),
        "ck": SimpleNamespace(hidden_act=None, first_k_dense_replace=2),
    }
    args, loaded, asked = _checkpoint_args(
        monkeypatch, saved, load="ck", pretrained_checkpoint="pre", ckpt_format="torch_dcp"
    )
    assert loaded == ["pretrained_checkpoint", "load"]
    assert asked == [("pre", "torch_dcp", True), ("ck", "torch_dcp", True)]
    assert (args.hidden_act, args.first_k_dense_replace, args.moe_qb_num_bins) == (
        "situ_glu",
        2,
        256,
    )
    assert capsys.readouterr().out == (
        "Setting hidden_act to situ_glu from checkpoint\n"
        "Setting first_k_dense_replace to 1 from checkpoint\n"
        "Setting first_k_dense_replace to 2 from checkpoint\n"
    )
    args, loaded, asked = _checkpoint_args(monkeypatch, {}, load="ck")  # nothing saved there
    assert loaded == ["load"] and asked == [("ck", "torch_dist", True)]
    assert (args.hidden_act, args.first_k_dense_replace) == ("silu", 0)
    args, loaded, asked = _checkpoint_args(monkeypatch, saved, pretrained_checkpoint="pre")
    assert loaded == ["pretrained_checkpoint"] and asked == [("pre", "torch_dist", True)]
    assert args.hidden_act == "situ_glu"


@pytest.mark.parametrize(
    "flags, message",
    [
        ({}, "--use-checkpoint-args reads the model flags from a checkpoint: give it with --load"),
        (
            dict(load="ck", non_persistent_ckpt_type="local"),
            "--use-checkpoint-args with --non-persistent-ckpt-type local: not supported",
        ),
    ],
)
def test_use_checkpoint_args_refusals(monkeypatch, flags, message):
    from megatron_latentmoe.training.arguments import FlagError

    with pytest.raises(FlagError, match=message):
        _checkpoint_args(monkeypatch, {}, **flags)


def test_reshardable_optimizer_needs_both_flags():
    both = dict(use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=True)
    assert pretrain._reshardable_optim(SimpleNamespace(**both))
    for flag in both:
        assert not pretrain._reshardable_optim(SimpleNamespace(**{**both, flag: False}))
    assert not pretrain._reshardable_optim(SimpleNamespace())  # an old checkpoint's args


class _Scheduler:
    def __init__(self):
        self.increments = []

    def step(self, increment):
        self.increments.append(increment)


def _layout_change(monkeypatch, saved_optim, run_optim, no_load_optim=False):
    """``_plan_layout_change`` from EP2 to TP2 with the optimizer flags given; returns what it
    installed (the optimizer loaded?) and its ``on_load``."""
    from megatron_latentmoe.compat import training as compat_training

    installed = []
    monkeypatch.setattr(
        compat_training,
        "install_layout_change_load",
        lambda args, keep, on_load: installed.append((args, keep, on_load)),
    )
    monkeypatch.setenv("RANK", "0")
    layout = dict.fromkeys(pretrain.LAYOUT_FIELDS, 1)
    reshard = ("use_distributed_optimizer", "dist_ckpt_optim_fully_reshardable")
    saved = SimpleNamespace(**{**layout, "expert_model_parallel_size": 2, "data_parallel_size": 2})
    vars(saved).update(dict.fromkeys(reshard, saved_optim))
    args = SimpleNamespace(**{**layout, "tensor_model_parallel_size": 2})
    vars(args).update(dict.fromkeys(reshard, run_optim))
    args.no_load_optim, args.global_batch_size = no_load_optim, 8
    pretrain._plan_layout_change(args, saved)
    ((got_args, keep, on_load),) = installed
    assert got_args is args
    return keep, on_load


def test_a_layout_change_keeps_the_optimizer_where_megatron_reshards_it(monkeypatch, capsys):
    keep, on_load = _layout_change(monkeypatch, True, True)
    scheduler = _Scheduler()
    on_load(5, scheduler)
    assert keep and scheduler.increments == []
    before = (
        "{'tensor_model_parallel_size': 1, 'pipeline_model_parallel_size': 1, "
        "'expert_model_parallel_size': 2, 'expert_tensor_parallel_size': 1, "
        "'context_parallel_size': 1, 'data_parallel_size': 2}"
    )
    now = before.replace("'tensor_model_parallel_size': 1", "'tensor_model_parallel_size': 2")
    now = now.replace("'expert_model_parallel_size': 2", "'expert_model_parallel_size': 1")
    now = now.replace("'data_parallel_size': 2", "'data_parallel_size': 1")
    assert capsys.readouterr().out == (
        f"[pretrain_stable_latentmoe] checkpoint layout {before} -> this run's {now}: loaded "
        "the resharded model, QB bias and optimizer state at iteration 5\n"
    )


RESHARD_WHY = (
    "megatron-core 0.19.2 reshards optimizer state only when the checkpoint was saved and is "
    "loaded with --use-distributed-optimizer --dist-ckpt-optim-fully-reshardable"
)


@pytest.mark.parametrize(
    "saved_optim, run_optim, no_load_optim, why",
    [
        (True, False, False, RESHARD_WHY),
        (False, True, False, RESHARD_WHY),
        (True, True, True, "--no-load-optim"),
    ],
)
def test_a_layout_change_without_the_optimizer_steps_the_schedule(
    monkeypatch, capsys, saved_optim, run_optim, no_load_optim, why
):
    """The moments start over; the LR schedule is stepped to the loaded iteration (samples:
    iterations x global batch), not at iteration 0, nor without a scheduler."""
    keep, on_load = _layout_change(monkeypatch, saved_optim, run_optim, no_load_optim)
    assert keep is (saved_optim and run_optim)
    scheduler = _Scheduler()
    on_load(5, scheduler)
    on_load(0, scheduler)
    on_load(3, None)
    assert scheduler.increments == [40]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("[pretrain_stable_latentmoe] WARNING: checkpoint layout {")
    assert lines[0].endswith(
        ": loaded the resharded model, QB bias at iteration 5; Adam moments start over "
        f"({why}); LR schedule stepped to the loaded iteration."
    )
    assert " at iteration 0; " in lines[1]


def test_main_runs_with_its_argv_and_puts_sys_argv_back(monkeypatch):
    seen = []

    def _main(check_only):
        seen.append((list(sys.argv), check_only))
        if "--boom" in sys.argv:
            raise RuntimeError("boom")
        return 7

    monkeypatch.setattr(pretrain, "_main", _main)
    monkeypatch.setattr(sys, "argv", ["run.py", "--train-iters", "2"])
    assert pretrain.main(["--seed", "1"], check_only=True) == 7
    assert pretrain.main() == 7  # sys.argv as it is
    assert pretrain.main([]) == 7  # no flags
    with pytest.raises(RuntimeError, match="boom"):
        pretrain.main(["--boom"])
    assert sys.argv == ["run.py", "--train-iters", "2"]
    monkeypatch.setattr(sys, "argv", [])
    assert pretrain.main(["--seed", "1"]) == 7
    assert sys.argv == []
    assert seen == [
        (["run.py", "--seed", "1"], True),
        (["run.py", "--train-iters", "2"], False),
        (["run.py"], False),
        (["run.py", "--boom"], False),
        (["pretrain_stable_latentmoe", "--seed", "1"], False),
    ]
