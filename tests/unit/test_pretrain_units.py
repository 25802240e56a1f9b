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


def test_a_distributed_checkpoint_is_complete_with_both_metadata_files(tmp_path):
    path = tmp_path / iteration_dir_name(2)
    path.mkdir()
    (path / "__0_0.distcp").write_text("shard")
    complete = []
    for name in ("metadata.json", ".metadata"):
        (path / name).write_text("{}")
        complete.append(pretrain._complete_checkpoint(str(path), "torch_dist"))
    (path / "metadata.json").unlink()  # torch DCP's .metadata alone: Megatron had not finished
    complete.append(pretrain._complete_checkpoint(str(path), "torch_dist"))
    assert complete == [False, True, False]


@pytest.mark.parametrize("ckpt_format", ["torch_dcp", "fsdp_dtensor"])
def test_a_torch_dcp_checkpoint_is_complete_with_its_metadata_file(tmp_path, ckpt_format):
    """Megatron saves these with torch.distributed.checkpoint.save alone: no metadata.json."""
    path = tmp_path / iteration_dir_name(2)
    path.mkdir()
    (path / "__0_0.distcp").write_text("shard")
    complete = [pretrain._complete_checkpoint(str(path), ckpt_format)]  # killed mid-save
    (path / ".metadata").write_text("{}")
    complete.append(pretrain._complete_checkpoint(str(path), ckpt_format))
    assert complete == [False, True]
    (tmp_path / TRACKER_FILE).write_bytes(b"")  # cut by a kill: repaired to the complete one
    assert pretrain.repair_checkpoint_tracker(str(tmp_path), ckpt_format) == 2
    assert (tmp_path / TRACKER_FILE).read_text() == "2"


def test_a_checkpoint_of_another_format_is_complete_when_not_empty(tmp_path):
    path = tmp_path / iteration_dir_name(2)
    assert not pretrain._complete_checkpoint(str(path), "torch")  # absent
    path.mkdir()
    assert not pretrain._complete_checkpoint(str(path), "torch")  # created, nothing written
    (path / "mp_rank_00").mkdir()
    assert pretrain._complete_checkpoint(str(path), "torch")


def test_auto_detected_formats_are_each_complete_by_their_own_rule(tmp_path):
    """--auto-detect-ckpt-format: a run that saved torch_dist and then legacy torch checkpoints
    resumes from the newest, a legacy one; a torch_dist save cut before its .metadata is not
    complete. Before, --ckpt-format's torch_dist rule made 6 incomplete and the tracker was
    rewritten to 3: a silent resume three iterations back."""
    _checkpoints(tmp_path, [3])
    (tmp_path / iteration_dir_name(6) / "mp_rank_00_000").mkdir(parents=True)
    (tmp_path / iteration_dir_name(9)).mkdir()
    (tmp_path / iteration_dir_name(9) / "__0_0.distcp").write_text("shard")  # killed mid-save
    (tmp_path / TRACKER_FILE).write_text("6")
    auto = pretrain.AUTO_FORMAT
    assert [
        pretrain._complete_checkpoint(str(tmp_path / iteration_dir_name(i)), auto)
        for i in (3, 6, 9, 12)
    ] == [True, True, False, False]
    assert pretrain.repair_checkpoint_tracker(str(tmp_path), auto) == 6
    assert (tmp_path / TRACKER_FILE).read_text() == "6"
    assert pretrain.load_format(SimpleNamespace(ckpt_format="torch_dist")) == "torch_dist"
    assert (
        pretrain.load_format(
            SimpleNamespace(ckpt_format="torch_dist", auto_detect_ckpt_format=True)
        )
        == pretrain.AUTO_FORMAT
    )


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


def _format_refusal(root, ckpt_format, auto=False, non_persistent=None):
    args = SimpleNamespace(load=str(root), ckpt_format=ckpt_format, auto_detect_ckpt_format=auto)
    return pretrain.format_refusal(args, non_persistent and str(non_persistent))


TORCH_DIST_FILES, TORCH_DCP_FILES = (".metadata", "metadata.json"), (".metadata",)


def test_a_checkpoint_megatron_fails_to_load_in_this_runs_format_is_refused(tmp_path):
    """torch_dist with --ckpt-format torch: megatron-core 0.19.2 failed on every rank with
    "RuntimeError: Detected load from a distributed checkpoint, but neither --use-dist-ckpt nor
    --auto-detect-ckpt-format is set"; a torch_dcp one (what an FSDP2 run saves) with torch or
    torch_dist, --auto-detect-ckpt-format or not: "AttributeError: 'NoneType' object has no
    attribute 'items'". Now one line names the folder, its format, this run's and the ways out.
    What Megatron loads is not refused: torch_dist with --auto-detect-ckpt-format, a legacy
    torch checkpoint with torch_dist, each format with its own, nothing to load."""
    (tmp_path / "dist").mkdir()
    dist = _checkpoints(tmp_path / "dist", [2], tracker=b"2", files=TORCH_DIST_FILES)
    assert _format_refusal(dist, "torch") == (
        f"--load {dist}: {dist}/iter_0000002 is a torch_dist checkpoint, which megatron-core "
        "0.19.2 fails to load with --ckpt-format torch; resume from it with --ckpt-format "
        "torch_dist, or add --auto-detect-ckpt-format (the run then saves in --ckpt-format torch)"
    )
    assert _format_refusal(dist, "torch", auto=True) is None
    assert _format_refusal(dist, "torch_dist") is None
    (tmp_path / "dcp").mkdir()
    dcp = _checkpoints(tmp_path / "dcp", [2], tracker=b"2", files=TORCH_DCP_FILES)
    ways = (
        "resume from it with --ckpt-format torch_dcp (Megatron allows it with --use-torch-fsdp2 "
        "only); --auto-detect-ckpt-format does not load it"
    )
    assert _format_refusal(dcp, "torch", auto=True) == (
        f"--load {dcp}: {dcp}/iter_0000002 is a torch_dcp checkpoint, which megatron-core 0.19.2 "
        f"fails to load with --ckpt-format torch --auto-detect-ckpt-format; {ways}"
    )
    # by torch_dist's rule no folder is complete: Megatron loads the tracked one as it is
    assert _format_refusal(dcp, "torch_dist").endswith(f"with --ckpt-format torch_dist; {ways}")
    assert _format_refusal(dcp, "torch_dcp") is None
    (tmp_path / "legacy").mkdir()
    legacy = _checkpoints(tmp_path / "legacy", [2], tracker=b"2", files=())
    (tmp_path / "legacy" / iteration_dir_name(2) / "mp_rank_00").mkdir()
    assert _format_refusal(legacy, "torch_dist") is None
    assert _format_refusal(legacy, "torch") is None
    assert _format_refusal(tmp_path / "new", "torch") is None
    assert pretrain.format_refusal(SimpleNamespace(load=None, ckpt_format="torch")) is None


def test_a_newer_non_persistent_checkpoint_is_the_one_judged(tmp_path):
    """Megatron loads a global non-persistent checkpoint as a torch_dist one (with --ckpt-format
    torch the same RuntimeError) where it is as new as the persistent one or newer."""
    root = _checkpoints(tmp_path, [2], tracker=b"2", files=())
    (tmp_path / iteration_dir_name(2) / "mp_rank_00").mkdir()
    (tmp_path / "np").mkdir()
    _checkpoints(tmp_path / "np", [3], tracker=b"3")
    assert _format_refusal(root, "torch") is None
    assert _format_refusal(root, "torch", non_persistent=tmp_path / "np").startswith(
        f"--load {root}: {tmp_path}/np/iter_0000003 is a torch_dist checkpoint"
    )
    (tmp_path / TRACKER_FILE).write_text("4")
    (tmp_path / iteration_dir_name(4)).mkdir()
    (tmp_path / iteration_dir_name(4) / "mp_rank_00").mkdir()
    assert _format_refusal(root, "torch", non_persistent=tmp_path / "np") is None


def _checkpoint_args(monkeypatch, saved, **flags):
    """``load_checkpoint_args`` on ``flags`` with Megatron's loader faked (it records the
    checkpoint flag it reads, and --pretrained-checkpoint's holds 4 layers) and ``saved_args``
    answering ``saved[folder]``; returns the flags, what was read and the dests it changed."""
    loaded, asked = [], []

    def load_args_from_checkpoint(args, load_arg):
        loaded.append(load_arg)
        if load_arg == "pretrained_checkpoint":
            args.num_layers = 4

    checkpointing = SimpleNamespace(load_args_from_checkpoint=load_args_from_checkpoint)
    monkeypatch.setitem(sys.modules, "megatron.training.checkpointing", checkpointing)

    def saved_args(load_dir, ckpt_format, *, release, non_persistent):
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
        num_layers=4,
    )
    vars(args).update(flags)
    changed = pretrain.load_checkpoint_args(args)
    return args, loaded, asked, changed


def test_use_checkpoint_args_takes_our_model_flags_from_each_checkpoint(monkeypatch, capsys):
    """Megatron's flags from --pretrained-checkpoint, then --load; ours that the model's config
    holds (an HF key) from each, where the checkpoint has them; a training flag of ours (the QB
    bins) stays the command line's."""
    saved = {
        "pre": SimpleNamespace(hidden_act="situ_glu", first_k_dense_replace=1, moe_qb_num_bins=9),
        "ck": SimpleNamespace(hidden_act=None, first_k_dense_replace=2),
    }
    args, loaded, asked, changed = _checkpoint_args(
        monkeypatch,
        saved,
        load="ck",
        pretrained_checkpoint="pre",
        ckpt_format="torch_dcp",
        num_layers=2,
    )
    assert changed == {"hidden_act", "first_k_dense_replace", "num_layers"}
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
    args, loaded, asked, changed = _checkpoint_args(monkeypatch, {}, load="ck")  # nothing saved
    assert changed == set()
    assert loaded == ["load"] and asked == [("ck", "torch_dist", True)]
    assert (args.hidden_act, args.first_k_dense_replace) == ("silu", 0)
    args, loaded, asked, changed = _checkpoint_args(monkeypatch, saved, pretrained_checkpoint="pre")
    assert changed == {"hidden_act", "first_k_dense_replace"}  # 4 layers given, 4 read
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


def test_use_checkpoint_args_reads_the_checkpoint_megatron_resumes_from(monkeypatch, tmp_path):
    """--non-persistent-ckpt-type global: Megatron's ``load_args_from_checkpoint`` (and its load)
    read the non-persistent checkpoint where it is as new as the persistent one or newer; our
    model flags come from that one too (--non-persistent-global-ckpt-dir, else
    ``LOAD/non_persistent``). Before, from the persistent one: the run built a model with
    --first-k-dense-replace 1 where the checkpoint it loads has 2."""
    from megatron.core import dist_checkpointing

    def load_common_state_dict(path):
        return {"args": SimpleNamespace(first_k_dense_replace=2 if "non_pers" in path else 1)}

    monkeypatch.setattr(dist_checkpointing, "load_common_state_dict", load_common_state_dict)
    checkpointing = SimpleNamespace(
        load_args_from_checkpoint=lambda args, load_arg: None,
        _NON_PERSISTENT_CKPT_SUBDIR="non_persistent",
    )
    monkeypatch.setitem(sys.modules, "megatron.training.checkpointing", checkpointing)
    monkeypatch.setenv("RANK", "0")
    root = _checkpoints(tmp_path, [2], tracker=b"2")
    (tmp_path / "non_persistent").mkdir()
    _checkpoints(tmp_path / "non_persistent", [3], tracker=b"3")

    def first_k(**flags):
        args = SimpleNamespace(
            load=root,
            pretrained_checkpoint=None,
            non_persistent_ckpt_type="global",
            non_persistent_global_ckpt_dir=None,
            ckpt_format="torch_dist",
            first_k_dense_replace=0,
        )
        vars(args).update(flags)
        assert pretrain.load_checkpoint_args(args) == {"first_k_dense_replace"}
        return args.first_k_dense_replace

    assert first_k() == 2
    assert first_k(non_persistent_ckpt_type=None) == 1
    assert first_k(non_persistent_global_ckpt_dir=str(tmp_path / "elsewhere")) == 1
    (tmp_path / "non_persistent").rename(tmp_path / "elsewhere_non_pers")
    assert first_k(non_persistent_global_ckpt_dir=str(tmp_path / "elsewhere_non_pers")) == 2
    _checkpoints(tmp_path, [4], tracker=b"4")  # the persistent checkpoint is newer
    assert first_k(non_persistent_global_ckpt_dir=str(tmp_path / "elsewhere_non_pers")) == 1


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


MAIN_STEPS = (
    "apply_core_compat",
    "apply_cpu_compat",
    "begin_run",
    "checked_args",
    "set_global_variables",
    "save_space_warning",
    "init_cpu_world",
    "apply_qb_gloo_compat",
    "_make_balance_logger",
    "set_balance_logger",
    "set_batch_recorder",
    "install_finalize_hook",
    "exclude_from_step_time",
    "pretrain",
)
"""What ``main`` does, in order, on a machine without CUDA."""
CPU_ONLY_STEPS = {"apply_cpu_compat", "init_cpu_world", "apply_qb_gloo_compat"}
"""The steps ``main`` leaves out where CUDA is available."""


class _Run:
    """``pretrain._main`` with everything heavy faked (the flag check, Megatron's globals, its
    training loop, the CPU world, the loggers): what it wires, in order, in ``events``."""

    def __init__(self, monkeypatch, tmp_path, **flags):
        import torch

        from megatron_latentmoe import compat
        from megatron_latentmoe.compat import qb_gloo
        from megatron_latentmoe.compat import training as compat_training
        from megatron_latentmoe.data import corpus
        from megatron_latentmoe.ops import situ
        from megatron_latentmoe.training import (
            balance_logging,
            balance_summary,
            file_checks,
            forward_step,
        )

        self.events, self.raises, self.fstep = [], None, forward_step
        event = self.events.append
        layout = dict.fromkeys(pretrain.LAYOUT_FIELDS, 1)
        self.args = SimpleNamespace(
            **layout,
            disable_jit_fuser=False,
            load=None,
            save=None,
            finetune=False,
            no_load_optim=False,
            no_load_rng=False,
            ckpt_format="torch_dist",
            moe_qb_rescore_iters=0,
            moe_qb_rescore_solves=1,
            moe_qb_calibrate_batches=0,
            train_iters=10,
            global_batch_size=4,
            seq_length=8,
            micro_batch_size=1,
            decoder_seq_length=None,
        )
        vars(self.args).update(flags)
        self.cpu_notes, self.default_data_dir, self.flag_error = ["fusions"], None, None
        self.saved = None  # the checkpoint's args
        self.logger = SimpleNamespace(excluded="excluded", is_logging_rank=True, history=[])

        def checked_args(has_cuda):
            event(("checked_args", has_cuda))
            if self.flag_error:
                from megatron_latentmoe.training.arguments import FlagError

                raise FlagError(self.flag_error)
            return self.args, "transformer config", self.cpu_notes, self.default_data_dir

        def pretrain_loop(cfg_container, datasets_provider, model_type, forward_step_func):
            event(("pretrain", cfg_container, datasets_provider, model_type, forward_step_func))
            if self.raises:
                raise self.raises

        def recorder(name):
            return lambda *a, **k: event((name, *a, *k.values()))

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("RANK", "0")
        for module, name in (
            (compat, "apply_core_compat"),
            (compat, "apply_cpu_compat"),
            (compat_training, "begin_run"),
            (compat_training, "init_cpu_world"),
            (compat_training, "exclude_from_step_time"),
            (compat_training, "load_optional_checkpoint_keys"),
            (compat_training, "wrap_train_step"),
            (compat_training, "on_save_error"),
            (file_checks, "save_space_warning"),
            (qb_gloo, "apply_qb_gloo_compat"),
            (situ, "set_cpu_compile"),
            (forward_step, "set_balance_logger"),
            (forward_step, "set_batch_recorder"),
            (pretrain, "repair_checkpoint_tracker"),
            (pretrain, "_plan_layout_change"),
            (pretrain, "legacy_layout_refusal"),  # reads the folder (tests/training meet it)
        ):
            monkeypatch.setattr(module, name, recorder(name))
        monkeypatch.setattr(pretrain, "checked_args", checked_args)
        monkeypatch.setattr(
            pretrain, "saved_args", lambda *a, **kw: event(("saved_args", *a)) or self.saved
        )
        monkeypatch.setattr(
            pretrain,
            "_make_balance_logger",
            lambda args, path: event(("_make_balance_logger", args, path)) or self.logger,
        )
        monkeypatch.setattr(corpus, "prepare_default_dataset", lambda d, n: f"{d}/{n}")
        monkeypatch.setattr(balance_logging, "default_jsonl_path", lambda args: "balance.jsonl")
        monkeypatch.setattr(
            balance_logging, "make_finalize_model_grads_func", lambda *a: ("finalize", *a)
        )
        monkeypatch.setattr(balance_summary, "summarize", lambda history: ("summary", *history))
        monkeypatch.setattr(balance_summary, "summary_lines", lambda s: [f"{s}", "second line"])
        model_provider = SimpleNamespace(
            install_finalize_hook=recorder("install_finalize_hook"),
            model_config_from_args=lambda args, config: ("model config", config),
        )
        monkeypatch.setitem(
            sys.modules, "megatron_latentmoe.training.model_provider", model_provider
        )
        training = SimpleNamespace(pretrain=pretrain_loop)
        monkeypatch.setitem(sys.modules, "megatron.training", SimpleNamespace(training=training))
        monkeypatch.setitem(
            sys.modules,
            "megatron.training.argument_utils",
            SimpleNamespace(pretrain_cfg_container_from_args=lambda args, cfg: ("container", cfg)),
        )
        monkeypatch.setitem(
            sys.modules,
            "megatron.training.global_vars",
            SimpleNamespace(set_global_variables=recorder("set_global_variables")),
        )

    def __call__(self, check_only=False):
        return pretrain._main(check_only)

    def named(self, name):
        return [e[1:] for e in self.events if e[0] == name]


def test_main_hands_megatron_the_model_datasets_and_step_it_built(monkeypatch, tmp_path, capsys):
    from megatron.core.enums import ModelType

    run = _Run(monkeypatch, tmp_path)
    assert run() == 0
    container = ("container", ("model config", "transformer config"))
    provider = run.fstep.train_valid_test_datasets_provider
    assert [e[0] for e in run.events] == list(MAIN_STEPS)
    assert run.named("checked_args") == [(False,)]
    assert run.named("set_global_variables") == run.named("init_cpu_world") == [(run.args,)]
    assert run.named("_make_balance_logger") == [(run.args, "balance.jsonl")]
    assert run.named("set_balance_logger") == [(run.logger,)]
    assert run.named("set_batch_recorder") == [(None,)]
    assert run.named("install_finalize_hook") == [(("finalize", run.logger, None),)]
    assert run.named("exclude_from_step_time") == [("excluded",)]
    assert run.named("pretrain") == [
        (container, provider, ModelType.encoder_or_decoder, run.fstep.forward_step)
    ]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[pretrain_stable_latentmoe] no CUDA: gloo, local spec; off on CPU: fusions"
    assert out[1].startswith("[pretrain_stable_latentmoe] done in ") and len(out) == 2


def test_main_warns_of_a_small_save_disk_and_ends_a_full_one_with_exit_2(monkeypatch, capsys):
    """``--save``: rank 0's start-up warning when less than a checkpoint is free, and the
    disk-full handler on Megatron's save; a save that filled the disk (the handler raised
    ``_DiskFull`` after rank 0 said so) ends ``main`` with exit 2 and nothing more printed."""
    from megatron_latentmoe.training import file_checks

    run = _Run(monkeypatch, None, save="ckpt")
    monkeypatch.setattr(file_checks, "save_space_warning", lambda args: "--save ckpt: 1 MB free")
    run.raises = pretrain._DiskFull()
    assert run() == 2
    assert len(run.named("on_save_error")) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "[pretrain_stable_latentmoe] WARNING: --save ckpt: 1 MB free"
    assert not any("done in" in line for line in out)
    run = _Run(monkeypatch, None)  # no --save: neither
    assert run() == 0 and run.named("on_save_error") == []


def test_main_stops_at_a_bad_flag_or_after_the_check(monkeypatch, tmp_path, capsys):
    run = _Run(monkeypatch, tmp_path)
    run.flag_error = "--train-iters 0 is not allowed; allowed: >= 1"
    assert run() == 2
    out, err = capsys.readouterr()
    assert (
        err == "pretrain_stable_latentmoe: error: --train-iters 0 is not allowed; allowed: >= 1\n"
    )
    assert out == "" and [e[0] for e in run.events][2:] == ["begin_run", "checked_args"]
    run.flag_error = None
    run.events.clear()
    assert run(check_only=True) == 0
    assert [e[0] for e in run.events][2:] == ["begin_run", "checked_args"]
    assert capsys.readouterr().out == ""


def test_main_prepares_the_shipped_corpus_and_eager_situ_when_asked(monkeypatch, tmp_path, capsys):
    run = _Run(monkeypatch, tmp_path, disable_jit_fuser=True)
    run.default_data_dir, run.cpu_notes = "/cache/default_data", []
    assert run() == 0
    assert run.named("set_cpu_compile") == [(False,)]
    assert capsys.readouterr().out.splitlines()[:2] == [
        "[pretrain_stable_latentmoe] --disable-jit-fuser: no torch.compile for SiTU-GLU on CPU "
        "(its eager math)",
        "[pretrain_stable_latentmoe] data: the shipped corpus "
        "(/cache/default_data/default_corpus.bin/.idx)",
    ]


def test_main_wires_rescoring_and_calibration(monkeypatch, tmp_path):
    """Rescoring: its train-step wrapper, its batch recorder, its finalize hook, the checkpoint
    keys it may find missing; calibration: the datasets provider it keeps the training set of,
    its train-step wrapper outermost (it runs before a rescored first step)."""
    from megatron_latentmoe.convert.names import TRAINING_STATE_SUFFIXES
    from megatron_latentmoe.training import balance_logging

    flags = dict(moe_qb_rescore_iters=3, moe_qb_rescore_solves=2, moe_qb_calibrate_batches=2)
    run = _Run(monkeypatch, tmp_path, decoder_seq_length=16, **flags)
    assert run() == 0
    (rescore_wrap,), (calibration_wrap,) = run.named("wrap_train_step")
    rescore, calibration = rescore_wrap.__self__, calibration_wrap.__self__
    assert rescore_wrap == rescore.wrap_train_step
    assert calibration_wrap == calibration.wrap_train_step
    assert (rescore.iters, rescore.solves) == (3, 2)
    assert rescore.schedule == dict(seq_length=8, micro_batch_size=1, decoder_seq_length=16)
    assert calibration.schedule == rescore.schedule
    assert (calibration.num_batches, calibration.first_sample) == (2, 32)
    assert run.named("load_optional_checkpoint_keys") == [(TRAINING_STATE_SUFFIXES,)]
    assert run.named("set_batch_recorder") == [(rescore,)]
    assert run.named("install_finalize_hook") == [(("finalize", run.logger, rescore),)]
    ((_, provider, _, _),) = run.named("pretrain")
    assert provider.__wrapped__ is run.fstep.train_valid_test_datasets_provider
    assert rescore.step_end.func is balance_logging.balance_step_end  # with this run's logger
    assert rescore.step_end.keywords == dict(balance_logger=run.logger)


@pytest.mark.parametrize(
    "flags, saved_layout, planned",
    [
        ({}, dict(tensor_model_parallel_size=2), True),
        ({}, dict(tensor_model_parallel_size=1), False),  # the same layout
        ({}, dict(tensor_model_parallel_size=None), False),  # not in the checkpoint's args
        ({}, None, False),  # nothing to resume from
        (dict(finetune=True), dict(tensor_model_parallel_size=2), False),
        (dict(no_load_optim=True, no_load_rng=True), dict(context_parallel_size=2), False),
        (dict(no_load_optim=True), dict(context_parallel_size=2), True),
        (dict(no_load_rng=True), dict(expert_tensor_parallel_size=2), True),
        # more or fewer data-parallel ranks alone: Megatron loads the optimizer and RNG state
        ({}, dict(data_parallel_size=4), False),
        (dict(data_parallel_random_init=True), dict(data_parallel_size=4), True),  # RNG per rank
        ({}, dict(data_parallel_size=4, pipeline_model_parallel_size=2), True),
    ],
)
def test_main_plans_a_layout_change_when_it_resumes_from_another_layout(
    monkeypatch, tmp_path, flags, saved_layout, planned
):
    run = _Run(monkeypatch, tmp_path, load="ckpt", ckpt_format="torch_dcp", **flags)
    if saved_layout is not None:
        run.saved = SimpleNamespace(**{**dict.fromkeys(pretrain.LAYOUT_FIELDS, 1), **saved_layout})
    assert run() == 0
    assert run.named("repair_checkpoint_tracker") == [("ckpt", "torch_dcp")]
    assert run.named("saved_args") == [("ckpt", "torch_dcp")]  # read for the shape check too
    assert run.named("_plan_layout_change") == ([(run.args, run.saved)] if planned else [])


def test_main_refuses_a_checkpoint_of_another_model_shape(monkeypatch, tmp_path, capsys):
    """Before: megatron-core's load failed on every rank with a CheckpointException traceback
    ("Global shape mismatch ..."); now one line naming the flags, exit 2, before the loop."""
    run = _Run(monkeypatch, tmp_path, load="ckpt", hidden_size=128)
    run.saved = SimpleNamespace(hidden_size=64)
    assert run() == 2
    assert run.named("pretrain") == []
    assert capsys.readouterr().err == (
        "pretrain_stable_latentmoe: error: --load ckpt: the checkpoint is of another model shape: "
        "--hidden-size 64 (this run: 128). Give the checkpoint's model flags, or "
        "--use-checkpoint-args to take them from it\n"
    )


def test_main_repairs_the_tracker_on_rank_0_only(monkeypatch, tmp_path):
    run = _Run(monkeypatch, tmp_path, load="ckpt")
    monkeypatch.setenv("RANK", "1")
    assert run() == 0
    assert run.named("repair_checkpoint_tracker") == []
    assert run.named("saved_args") == [("ckpt", "torch_dist")]
    run = _Run(monkeypatch, tmp_path)  # no --load
    assert run() == 0
    assert run.named("repair_checkpoint_tracker") == run.named("saved_args") == []
    run = _Run(monkeypatch, tmp_path, load="ckpt", auto_detect_ckpt_format=True)
    assert run() == 0
    assert run.named("repair_checkpoint_tracker") == [("ckpt", pretrain.AUTO_FORMAT)]
    assert run.named("saved_args") == [("ckpt", pretrain.AUTO_FORMAT)]


def test_main_explains_megatrons_schedule_mismatch_on_load(monkeypatch, tmp_path, capsys):
    run = _Run(monkeypatch, tmp_path)
    run.raises = AssertionError("OptimizerParamScheduler: class input value 10 and checkpoint 5")
    assert run() == 2
    err = capsys.readouterr().err
    assert err == (
        "pretrain_stable_latentmoe: error: the checkpoint's LR / weight-decay schedule differs "
        "from this run's flags (OptimizerParamScheduler: class input value 10 and checkpoint 5). "
        "Pass --override-opt_param-scheduler to continue with this run's schedule (e.g. a longer "
        "--train-iters), or --use-checkpoint-opt_param-scheduler to keep the checkpoint's.\n"
    )
    run.raises = AssertionError("another check")
    with pytest.raises(AssertionError, match="another check"):
        run()


def test_main_stops_at_a_batch_outside_the_vocabulary_in_one_line(monkeypatch, tmp_path, capsys):
    """A micro-batch's refusal (``forward_step.get_batch``) inside Megatron's loop: its line,
    exit 2, where the embedding's IndexError was a traceback."""
    run = _Run(monkeypatch, tmp_path)
    run.raises = run.fstep.OutOfVocabularyError("a micro-batch of --data-path /d holds token id 9")
    assert run() == 2
    assert capsys.readouterr().err == (
        "pretrain_stable_latentmoe: error: a micro-batch of --data-path /d holds token id 9\n"
    )


def test_main_with_cuda_skips_the_cpu_world(monkeypatch, tmp_path, capsys):
    """With CUDA: Megatron-Core's compat only (no CPU shims, no gloo world, no QB gloo
    all-reduce), and the flag check is told CUDA is there."""
    import torch

    run = _Run(monkeypatch, tmp_path)
    run.cpu_notes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert run() == 0
    assert [e[0] for e in run.events] == [e for e in MAIN_STEPS if e not in CPU_ONLY_STEPS]
    assert run.named("checked_args") == [(True,)]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("[pretrain_stable_latentmoe] done in ")


@pytest.mark.parametrize("initialized", [True, False])
def test_main_ends_with_a_barrier_and_destroys_the_process_group(
    monkeypatch, tmp_path, initialized
):
    """After Megatron's loop the ranks meet at a barrier and the process group is destroyed
    (a rank that exits first leaves gloo / NCCL peers waiting); without a group, nothing."""
    import torch

    run = _Run(monkeypatch, tmp_path)
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroy"))
    assert run() == 0
    assert calls == (["barrier", "destroy"] if initialized else [])


@pytest.mark.parametrize(
    "logging_rank, history, printed", [(True, [1], True), (False, [1], False), (True, [], False)]
)
def test_main_prints_the_balance_summary_on_the_logging_rank(
    monkeypatch, tmp_path, capsys, logging_rank, history, printed
):
    run = _Run(monkeypatch, tmp_path)
    run.logger.is_logging_rank, run.logger.history = logging_rank, history
    assert run() == 0
    out = capsys.readouterr().out.splitlines()
    summary = ["[pretrain_stable_latentmoe] summary: ('summary', 1)", "second line"]
    assert (out[1:3] == summary) is printed and len(out) == (4 if printed else 2)


@pytest.mark.parametrize("rank, made", [("1", True), ("0", False)])
def test_the_balance_logger_follows_the_flags(monkeypatch, tmp_path, rank, made):
    """The last rank (it writes the JSONL records) makes the file's folder; the logger counts
    the step's global batch x sequence tokens (Megatron's current batch: a
    --step-batch-size-schedule changes it) and numbers steps from Megatron's iteration + 1."""
    from megatron.core import num_microbatches_calculator, parallel_state

    writers = SimpleNamespace(
        get_args=lambda: SimpleNamespace(curr_iteration=6),
        get_tensorboard_writer=lambda: "tensorboard",
        get_wandb_writer=lambda: "wandb",
    )
    monkeypatch.setitem(sys.modules, "megatron.training", writers)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = SimpleNamespace(
        num_layers=3,
        num_experts=8,
        global_batch_size=4,
        seq_length=16,
        log_interval=5,
        tensorboard_log_interval=7,
        balance_log_loads_interval=9,
        moe_per_layer_logging=True,
    )
    batch = [4]
    monkeypatch.setattr(
        num_microbatches_calculator, "get_current_global_batch_size", lambda: batch[0]
    )
    path = tmp_path / "logs" / "balance.jsonl"
    logger = pretrain._make_balance_logger(args, str(path))
    assert path.parent.is_dir() is made and not path.exists()
    assert (logger.num_layers, logger.num_experts, logger.tokens_per_step()) == (3, 8, 64)
    batch[0] = 8
    assert logger.tokens_per_step() == 128
    assert (logger.log_interval, logger.tensorboard_log_interval, logger.loads_interval) == (
        5,
        7,
        9,
    )
    assert (logger.jsonl_path, logger.iteration_fn(), logger.per_layer_tensorboard) == (
        str(path),
        7,
        True,
    )
    assert (logger.writer_fn(), logger.wandb_writer_fn()) == ("tensorboard", "wandb")
    assert logger._pp_group is parallel_state.get_pipeline_model_parallel_group
    assert logger._is_last_stage is parallel_state.is_pipeline_last_stage
    dp_groups = []
    monkeypatch.setattr(
        parallel_state,
        "get_data_parallel_group",
        lambda with_context_parallel: dp_groups.append(with_context_parallel) or "dp-cp",
    )
    assert logger._dp_group() == "dp-cp" and dp_groups == [True]
    assert pretrain._make_balance_logger(args, None).jsonl_path is None


class _Checked:
    """``pretrain.checked_args`` with the flag parser, our checks, Megatron's ``validate_args``
    and the config builder faked: the calls it makes, in order, in ``events``."""

    def __init__(self, monkeypatch, **flags):
        from megatron_latentmoe.compat import training as compat_training
        from megatron_latentmoe.data import corpus
        from megatron_latentmoe.training import arguments, file_checks

        self.events = []
        event = self.events.append
        self.args = SimpleNamespace(
            use_checkpoint_args=False,
            load=None,
            save=None,
            ckpt_format="torch_dist",
            data_cache_path=None,
            split=None,
            tokenizer_model=None,
            data_path=None,
        )
        vars(self.args).update(flags)
        self.default_data, self.default_tokenizer = True, True
        self.layout_refusal = self.interleaved_refusal = self.megatron_assert = None
        self.vocabulary_refusal = None

        def validate_args(args, defaults):
            event(("validate_args", args, defaults))
            if self.megatron_assert:
                raise AssertionError(self.megatron_assert)

        def apply_default_tokenizer(args, tokenizer_dir):
            event(("apply_default_tokenizer", tokenizer_dir))
            args.tokenizer_model = tokenizer_dir if self.default_tokenizer else "mine"
            return self.default_tokenizer

        fakes = {
            (compat_training, "parse_with_our_flags"): lambda add: (
                event(("parse", add)) or self.args
            ),
            (compat_training, "cpu_training_defaults"): lambda args: ["fused kernels"],
            (compat_training, "apply_cpu_training_compat"): lambda: event(("cpu compat",)),
            (corpus, "default_cache_dir"): lambda: "/home/cache",
            (corpus, "default_tokenizer_dir"): lambda: "/shipped/tokenizer",
            (arguments, "validate_stable_latentmoe_args"): lambda args, has_cuda: event(
                ("validate ours", has_cuda)
            ),
            (arguments, "uses_default_data"): lambda args: self.default_data,
            (arguments, "apply_default_tokenizer"): apply_default_tokenizer,
            (arguments, "expert_layout_refusal"): lambda args: self.layout_refusal,
            (arguments, "data_vocabulary_refusal"): lambda args: (
                event(("data vocabulary",)) or self.vocabulary_refusal
            ),
            (arguments, "interleaved_schedule_refusal"): lambda args, group: (
                event(("interleaved", group)) or self.interleaved_refusal
            ),
            (arguments, "megatron_refusal"): lambda args, err: f"refused: {err}",
            (file_checks, "folder_refusal"): lambda flag, path: None,  # tests/training/
            (pretrain, "load_checkpoint_args"): lambda args: (
                event(("checkpoint args",)) or {"expert_model_parallel_size"}
            ),  # what the checkpoint changed
        }
        for (module, name), fake in fakes.items():
            monkeypatch.setattr(module, name, fake)
        monkeypatch.setitem(
            sys.modules,
            "megatron.training.arguments",
            SimpleNamespace(validate_args=validate_args),
        )
        config = SimpleNamespace(microbatch_group_size_per_vp_stage=3, moe_layer_freq=[0, 1, 1])
        monkeypatch.setitem(
            sys.modules,
            "megatron_latentmoe.training.model_provider",
            SimpleNamespace(transformer_config_from_args=lambda args: config),
        )
        self.config = config
        monkeypatch.setenv("RANK", "0")

    def __call__(self, has_cuda=False):
        return pretrain.checked_args(has_cuda)


def test_checked_args_complete_a_cpu_run_with_the_shipped_corpus_and_tokenizer(monkeypatch, capsys):
    from megatron_latentmoe.training.arguments import add_stable_latentmoe_args

    checked = _Checked(monkeypatch)
    args, config, cpu_notes, default_data_dir = checked()
    assert (args, config, cpu_notes) == (checked.args, checked.config, ["fused kernels"])
    assert default_data_dir == "/home/cache"
    assert args.data_path == ["/home/cache/default_corpus"] and args.split == "98,2,0"
    assert args.moe_layer_freq == [0, 1, 1]  # the model's layers, for Megatron's FLOPs count
    assert checked.events == [
        ("parse", add_stable_latentmoe_args),
        ("validate ours", False),
        ("apply_default_tokenizer", "/shipped/tokenizer"),
        ("cpu compat",),
        ("validate_args", args, {}),
        ("interleaved", 3),
    ]
    assert capsys.readouterr().out == (
        "[pretrain_stable_latentmoe] tokenizer: the shipped one (HuggingFaceTokenizer "
        "/shipped/tokenizer)\n"
    )


def test_checked_args_keep_the_users_choices(monkeypatch, capsys):
    """A --data-cache-path holds the shipped corpus's tokens; a given --split is kept; a given
    tokenizer is not announced; on CUDA nothing of the CPU compat; --use-checkpoint-args first."""
    from megatron_latentmoe.training.arguments import FlagError

    checked = _Checked(monkeypatch, data_cache_path="/scratch", split="90,10,0")
    checked.default_tokenizer = False
    args, _, cpu_notes, default_data_dir = checked(has_cuda=True)
    assert default_data_dir == "/scratch/default_data" and cpu_notes == []
    assert args.data_path == ["/scratch/default_data/default_corpus"] and args.split == "90,10,0"
    assert [e[0] for e in checked.events] == [
        "parse",
        "validate ours",
        "apply_default_tokenizer",
        "validate_args",
        "interleaved",
    ]
    assert checked.events[1] == ("validate ours", True)
    assert capsys.readouterr().out == ""
    checked = _Checked(monkeypatch, use_checkpoint_args=True, data_path=["mine"])
    checked.default_data = False
    args, _, _, default_data_dir = checked()
    assert [e[0] for e in checked.events[:3]] == ["parse", "checkpoint args", "validate ours"]
    assert default_data_dir is None and args.data_path == ["mine"] and args.split is None
    # the given dataset's ids against the tokenizer, once its flags are final (not the shipped
    # corpus's: the shipped tokenizer made it)
    assert [e[0] for e in checked.events[-3:]] == [
        "validate_args",
        "data vocabulary",
        "interleaved",
    ]
    checked.vocabulary_refusal = "--data-path mine: mine.bin, in its first 1 MiB, holds token id 9"
    with pytest.raises(FlagError) as err:
        checked()
    assert str(err.value) == checked.vocabulary_refusal


@pytest.mark.parametrize("refusal", ["layout", "megatron", "interleaved"])
def test_checked_args_refusals_are_flag_errors(monkeypatch, refusal):
    from megatron_latentmoe.training.arguments import FlagError

    checked = _Checked(monkeypatch)
    checked.layout_refusal = "--expert-model-parallel-size 3" if refusal == "layout" else None
    checked.megatron_assert = "num_layers % pp" if refusal == "megatron" else None
    checked.interleaved_refusal = "--micro-batch-size 2" if refusal == "interleaved" else None
    message = {
        "layout": "--expert-model-parallel-size 3",
        "megatron": "refused: num_layers % pp",
        "interleaved": "--micro-batch-size 2",
    }[refusal]
    with pytest.raises(FlagError) as err:
        checked()
    assert str(err.value) == message and err.value.__cause__ is None
    called = [e[0] for e in checked.events]
    assert ("validate_args" in called) is (refusal != "layout")
    assert ("interleaved" in called) is (refusal == "interleaved")


def test_checked_args_name_a_refused_flag_the_checkpoint_gave(monkeypatch):
    from megatron_latentmoe.training.arguments import FlagError

    checked = _Checked(monkeypatch, use_checkpoint_args=True)
    checked.layout_refusal = "--expert-model-parallel-size 3 is not allowed"
    with pytest.raises(FlagError) as err:
        checked()
    assert str(err.value) == (
        "--expert-model-parallel-size 3 is not allowed (--expert-model-parallel-size: from the "
        "checkpoint's args, --use-checkpoint-args)"
    )
    assert err.value.__cause__ is None
