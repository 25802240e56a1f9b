"""What ``--load`` resumes from (``training/resume.py``), called directly with small inputs: a tmp
dir, a namespace of flags, fakes for Megatron's loaders. The entry point's use of it is
``test_pretrain_units.py``'s; whole resumed runs are ``tests/training/test_resume.py``'s and
``test_ckpt_formats.py``'s; what makes a checkpoint folder complete is
``test_checkpoint_repair.py``'s, the tracker repair ``tests/training/test_tracker_repair.py``'s."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from megatron_latentmoe.checkpoint_layout import TRACKER_FILE, iteration_dir_name
from megatron_latentmoe.training import checkpoint_repair, resume
from tests.training import dcp_checkpoint


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
    auto = checkpoint_repair.AUTO_FORMAT
    assert [
        checkpoint_repair.complete_checkpoint(str(tmp_path / iteration_dir_name(i)), auto)
        for i in (3, 6, 9, 12)
    ] == [True, True, False, False]
    assert checkpoint_repair.repair_checkpoint_tracker(str(tmp_path), auto) == 6
    assert (tmp_path / TRACKER_FILE).read_text() == "6"
    assert resume.load_format(SimpleNamespace(ckpt_format="torch_dist")) == "torch_dist"
    assert (
        resume.load_format(SimpleNamespace(ckpt_format="torch_dist", auto_detect_ckpt_format=True))
        == checkpoint_repair.AUTO_FORMAT
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


def test_saved_args_are_the_given_folders(tmp_path, common_state):
    """The args of the folder :func:`resumed_by_args` names (the one Megatron loads: which one is
    test_pretrain_units.py's ``test_every_check_reads_the_folder_megatron_loads``): a distributed
    checkpoint's common state, a legacy torch one's rank-0 file; None where nothing is loaded or
    it cannot be read (Megatron reports it)."""
    import torch

    root = _checkpoints(tmp_path, [4])
    assert resume.saved_args(f"{root}/iter_0000004") == "args of iter_0000004"
    assert resume.saved_args(None) is None
    (tmp_path / "bad").mkdir()
    assert resume.saved_args(str(tmp_path / "bad")) is None  # not a distributed checkpoint
    assert common_state == ["iter_0000004", "bad"]
    legacy = tmp_path / iteration_dir_name(7) / "mp_rank_00"
    legacy.mkdir(parents=True)
    torch.save({"args": "legacy args"}, legacy / "model_optim_rng.pt")
    assert resume.saved_args(str(legacy.parent)) == "legacy args"
    (legacy / "model_optim_rng.pt").write_bytes(b"cut")
    assert resume.saved_args(str(legacy.parent)) is None
    assert common_state == ["iter_0000004", "bad"]


def test_a_release_checkpoint_is_resumed_from_where_the_tracker_names_it(tmp_path):
    """megatron-core 0.19.2 loads ``release`` from --load and --pretrained-checkpoint alike."""
    root = _checkpoints(tmp_path, [], tracker=b"release")
    (tmp_path / "release").mkdir()
    assert resume.resumed_checkpoint(root) == f"{root}/release"
    (tmp_path / TRACKER_FILE).write_bytes(b"7")  # an iteration never saved: not the release
    assert resume.resumed_checkpoint(root) is None
    (tmp_path / TRACKER_FILE).write_bytes(b"\xff")  # unreadable: Megatron reports it
    assert resume.resumed_checkpoint(root) is None
    (tmp_path / TRACKER_FILE).unlink()
    assert resume.resumed_checkpoint(root) is None


def _format_refusal(root, ckpt_format, auto=False, non_persistent=None):
    args = SimpleNamespace(
        load=str(root),
        ckpt_format=ckpt_format,
        auto_detect_ckpt_format=auto,
        non_persistent_ckpt_type="global" if non_persistent else None,
        non_persistent_global_ckpt_dir=non_persistent and str(non_persistent),
    )
    return resume.format_refusal(args)


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
    assert resume.format_refusal(SimpleNamespace(load=None, ckpt_format="torch")) is None


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

    def saved_args(path):
        asked.append(path)
        return saved.get(path)

    monkeypatch.setattr(resume, "saved_args", saved_args)
    monkeypatch.setattr(resume, "resumed_by_args", lambda args, load_arg: getattr(args, load_arg))
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
    changed = resume.load_checkpoint_args(args)
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
    assert asked == ["pre", "ck"]
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
    assert loaded == ["load"] and asked == ["ck"]
    assert (args.hidden_act, args.first_k_dense_replace) == ("silu", 0)
    args, loaded, asked, changed = _checkpoint_args(monkeypatch, saved, pretrained_checkpoint="pre")
    assert changed == {"hidden_act", "first_k_dense_replace"}  # 4 layers given, 4 read
    assert loaded == ["pretrained_checkpoint"] and asked == ["pre"]
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
    from megatron_latentmoe.cli_errors import FlagError

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
        assert resume.load_checkpoint_args(args) == {"first_k_dense_replace"}
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
    assert resume._reshardable_optim(SimpleNamespace(**both))
    for flag in both:
        assert not resume._reshardable_optim(SimpleNamespace(**{**both, flag: False}))
    assert not resume._reshardable_optim(SimpleNamespace())  # an old checkpoint's args


class _Scheduler:
    def __init__(self):
        self.increments = []

    def step(self, increment):
        self.increments.append(increment)


def _layout_change(monkeypatch, saved_optim, run_optim, no_load_optim=False, no_save_optim=False):
    """``plan_layout_change`` from EP2 to TP2 with the optimizer flags given; returns what it
    installed (the optimizer loaded?) and its ``on_load``."""
    from megatron_latentmoe.compat import training as compat_training

    installed = []
    monkeypatch.setattr(
        compat_training,
        "install_layout_change_load",
        lambda args, keep, on_load: installed.append((args, keep, on_load)),
    )
    monkeypatch.setenv("RANK", "0")
    layout = dict.fromkeys(resume.LAYOUT_FIELDS, 1)
    reshard = ("use_distributed_optimizer", "dist_ckpt_optim_fully_reshardable")
    saved = SimpleNamespace(**{**layout, "expert_model_parallel_size": 2, "data_parallel_size": 2})
    vars(saved).update(dict.fromkeys(reshard, saved_optim), no_save_optim=no_save_optim)
    args = SimpleNamespace(**{**layout, "tensor_model_parallel_size": 2})
    vars(args).update(dict.fromkeys(reshard, run_optim))
    args.no_load_optim, args.global_batch_size = no_load_optim, 8
    resume.plan_layout_change(args, saved)
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


NONE_SAVED_WHY = "the checkpoint was saved with --no-save-optim: it holds no optimizer state"


@pytest.mark.parametrize(
    "saved_optim, run_optim, no_load_optim, no_save_optim, why",
    [
        (True, False, False, False, RESHARD_WHY),
        (False, True, False, False, RESHARD_WHY),
        (True, True, True, False, "--no-load-optim"),
        # the flags would not have kept moments the checkpoint does not hold
        (False, False, False, True, NONE_SAVED_WHY),
        (True, False, False, True, NONE_SAVED_WHY),
    ],
)
def test_a_layout_change_without_the_optimizer_steps_the_schedule(
    monkeypatch, capsys, saved_optim, run_optim, no_load_optim, no_save_optim, why
):
    """The moments start over; the LR schedule is stepped to the loaded iteration (samples:
    iterations x global batch), not at iteration 0, nor without a scheduler."""
    keep, on_load = _layout_change(
        monkeypatch, saved_optim, run_optim, no_load_optim, no_save_optim
    )
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


def _load_refusal(load_dir, load_arg="load", **flags):
    """:func:`resume.load_refusal` of a run whose ``load_arg`` flag gives ``load_dir``."""
    args = SimpleNamespace(
        load=None,
        pretrained_checkpoint=None,
        ckpt_format="torch_dist",
        ckpt_step=None,
        non_persistent_ckpt_type=None,
        non_persistent_global_ckpt_dir=None,
    )
    setattr(args, load_arg, str(load_dir))
    vars(args).update(flags)
    return resume.load_refusal(args, load_arg)


def test_a_damaged_load_folder_is_refused_in_one_line(tmp_path):
    """Each of these failed in megatron-core's load, on every rank, with a traceback (or, for an
    HF export, trained from random weights); now one line naming the file and what to do."""
    path = dcp_checkpoint(tmp_path, 4)
    assert _load_refusal(tmp_path) is None
    (shard,) = path.glob("*.distcp")
    size = shard.stat().st_size
    damaged = f"--load {tmp_path}: the checkpoint of iteration 4 is damaged: "
    advice = (
        f". Write {TRACKER_FILE} with an earlier iteration whose folder is whole, or delete "
        "iter_0000004 (the run then resumes from the newest complete one)"
    )
    os.truncate(shard, size - 1)
    assert _load_refusal(tmp_path) == (
        f"{damaged}shard file {shard} is cut short: {size - 1} bytes, where .metadata has data "
        f"up to byte {size}{advice}"
    )
    shard.unlink()
    assert _load_refusal(tmp_path) == (f"{damaged}shard file {shard} is missing{advice}")
    metadata = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(metadata[:100])
    refusal = _load_refusal(tmp_path)
    assert refusal.startswith(
        f"{damaged}{path / '.metadata'} cannot be read ("
    ) and refusal.endswith(advice), refusal
    (path / ".metadata").write_bytes(metadata)
    (path / "metadata.json").write_text('{"sharded_backend": ')
    refusal = _load_refusal(tmp_path)
    assert refusal.startswith(f"{damaged}{path / 'metadata.json'} cannot be read (Expecting value")
    (path / "metadata.json").write_text("[]")  # JSON, but not the object Megatron reads
    assert _load_refusal(tmp_path) == (
        f"{damaged}{path / 'metadata.json'} cannot be read (a JSON list, not an object){advice}"
    )


def test_the_damage_check_judges_the_checkpoint_megatron_loads(tmp_path):
    """--non-persistent-ckpt-type global: megatron-core 0.19.2 loads the newest non-persistent
    checkpoint where it is as new as the persistent one or newer (resume.resumed_by_args). Before,
    the damage check read the persistent one alone: a damaged non-persistent one passed (and
    failed in Megatron's load with a traceback), a damaged persistent one that Megatron does not
    load was refused. A damaged release checkpoint was not checked at all."""
    np_dir = tmp_path / "non_persistent"
    np_dir.mkdir()
    global_np = {
        "non_persistent_ckpt_type": "global",
        "non_persistent_global_ckpt_dir": str(np_dir),
    }
    dcp_checkpoint(tmp_path, 2)
    newest = dcp_checkpoint(np_dir, 4)
    (shard,) = newest.glob("*.distcp")
    shard.unlink()
    assert _load_refusal(tmp_path) is None  # no non-persistent type: Megatron loads iteration 2
    assert _load_refusal(tmp_path, **global_np) == (
        f"--load {tmp_path}: the non-persistent checkpoint of iteration 4 ({newest}), which "
        f"Megatron loads as the newest, is damaged: shard file {shard} is missing. Delete "
        f"{np_dir} (the run then loads the persistent checkpoint in {tmp_path})"
    )
    dcp_checkpoint(np_dir, 6)  # a whole newer one: Megatron loads it, not the damaged ones
    (persistent_shard,) = (tmp_path / iteration_dir_name(2)).glob("*.distcp")
    persistent_shard.unlink()
    assert _load_refusal(tmp_path, **global_np) is None
    assert _load_refusal(tmp_path).startswith(
        f"--load {tmp_path}: the checkpoint of iteration 2 is damaged: shard file "
    )
    release = tmp_path / "pre"
    release.mkdir()
    path = dcp_checkpoint(release, 0).rename(release / "release")
    (release / TRACKER_FILE).write_text("release")
    (shard,) = path.glob("*.distcp")
    shard.unlink()
    assert _load_refusal(release, "pretrained_checkpoint") == (
        f"--pretrained-checkpoint {release}: the release checkpoint {path} is damaged: shard file "
        f"{shard} is missing. Write it again (for an HF model: the import)"
    )


def test_a_tracker_naming_a_missing_checkpoint_and_an_hf_export_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _load_refusal(empty) is None  # a new run: starts from scratch
    assert _load_refusal(tmp_path / "absent") is None
    (empty / TRACKER_FILE).write_text("8")
    assert _load_refusal(empty) == (
        f"--load {empty}: {empty / TRACKER_FILE} names iteration 8, but "
        f"{empty / 'iter_0000008'} is not there and no other complete checkpoint is: give --load "
        f"the folder that holds it, or delete {empty / TRACKER_FILE} to start from scratch"
    )
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert _load_refusal(hf) == (
        f"--load {hf} is a Hugging Face export (config.json, *.safetensors), not a Megatron "
        "checkpoint: Megatron would start from random weights. Import it first (python -m "
        f"megatron_latentmoe.convert import --hf {hf} --output SAVE_ROOT) and give --load SAVE_ROOT"
    )


def test_a_checkpoint_of_another_model_shape_is_named_by_its_flags():
    from types import SimpleNamespace

    from megatron_latentmoe.training.resume import shape_refusal

    saved = SimpleNamespace(hidden_size=64, num_layers=4, padded_vocab_size=4096, kv_channels=None)
    run = SimpleNamespace(hidden_size=128, num_layers=4, padded_vocab_size=8192, kv_channels=32)
    assert shape_refusal("ck", run, None) is None
    assert shape_refusal("ck", saved, saved) is None
    assert shape_refusal("ck", run, saved) == (
        "--load ck: the checkpoint is of another model shape: --hidden-size 64 (this run: 128), "
        "the padded vocabulary 4096 (this run: 8192). Give the checkpoint's model flags, or "
        "--use-checkpoint-args to take them from it"
    )


@pytest.mark.parametrize(
    "saved, run, fresh",
    [
        ("aux_loss", "quantile_histogram", (".router.expert_bias",)),
        ("aux_loss", "none+bias", (".router.expert_bias",)),
        ("aux_loss", "quantile_balancing", (".router.qb_beta",)),
        ("quantile_balancing", "quantile_histogram", (".router.expert_bias",)),
        ("quantile_histogram", "quantile_balancing", (".router.qb_beta",)),
        (["quantile_histogram", "seq_aux_loss"], "none+bias", ()),  # the one bias: kept
        ("none+bias", "quantile_histogram", ()),
        ("quantile_histogram", "aux_loss", ()),  # Megatron loads without the unused bias
        ("quantile_balancing", "aux_loss", ()),
        ("aux_loss", "seq_aux_loss", ()),
    ],
)
def test_router_state_the_checkpoints_balancer_did_not_keep_starts_anew(saved, run, fresh):
    """Resumed with another balancer: the router buffers this run keeps and the checkpoint's
    balancer did not are the ones loaded where present (megatron-core 0.19.2 failed the load
    with a KeyError traceback on every rank, measured: aux_loss -> quantile_histogram)."""

    def args(lb):
        sign = lb == "none+bias"
        return SimpleNamespace(
            moe_router_load_balancing_type="none" if sign else lb,
            moe_router_enable_expert_bias=sign,
        )

    assert resume.fresh_routing_state(args(run), args(saved)) == fresh
    assert resume.fresh_routing_state(args(run), None) == ()
    warning = resume.fresh_routing_state_warning(args(run), args(saved), "ck")
    assert (warning is None) == (not fresh)


def test_the_fresh_router_state_warning_names_both_balancers():
    saved = SimpleNamespace(moe_router_load_balancing_type="aux_loss")
    run = SimpleNamespace(
        moe_router_load_balancing_type=["quantile_histogram", "seq_aux_loss"],
        moe_router_enable_expert_bias=False,
    )
    assert resume.fresh_routing_state_warning(run, saved, "ck", "--pretrained-checkpoint") == (
        "--pretrained-checkpoint ck: the checkpoint was trained with "
        "--moe-router-load-balancing-type aux_loss, which keeps no expert bias "
        "(router.expert_bias): with --moe-router-load-balancing-type quantile_histogram "
        "seq_aux_loss it starts at 0, as in a new run (every other tensor is loaded)"
    )
    run.moe_qb_calibrate_batches = 4  # a resumed run does not calibrate; --finetune does
    assert resume.fresh_routing_state_warning(run, saved, "ck").endswith(
        "(every other tensor is loaded); --moe-qb-calibrate-batches 4 solves it only in a run "
        "that starts at iteration 0 (--finetune), not in a resumed one"
    )
    assert resume.fresh_routing_state_warning(run, saved, "ck", resumed=False).endswith("loaded)")


def test_a_checkpoint_whose_optimizer_has_another_lr_needs_a_schedule_flag():
    """Another --lr / --min-lr where the optimizer is restored: one line naming
    --override-opt_param-scheduler (with it the run loads the moments:
    compat.training.load_optimizer_with_new_lr) and --use-checkpoint-opt_param-scheduler (the
    checkpoint's values: take_checkpoint_lr); --decoupled-lr in one run only is refused with
    or without the first, not with the second; nothing to say with --no-load-optim or where a
    layout change starts the optimizer over."""
    saved = SimpleNamespace(lr=1e-3, min_lr=1e-4, decoupled_lr=None, decoupled_min_lr=None)
    run = SimpleNamespace(
        lr=5e-4,
        min_lr=1e-4,
        decoupled_lr=None,
        decoupled_min_lr=None,
        no_load_optim=False,
        override_opt_param_scheduler=False,
        use_checkpoint_opt_param_scheduler=False,
    )
    assert resume.lr_refusal(run, saved, "ck") == (
        "--load ck: the checkpoint's optimizer was saved with --lr 0.001 (this run: 0.0005): "
        "add --override-opt_param-scheduler to train on with this run's learning rates and "
        "schedule, or --use-checkpoint-opt_param-scheduler to train on with the checkpoint's, "
        "the Adam moments kept; or give the checkpoint's values, or add --no-load-optim to train "
        "on with this run's (the Adam moments and the learning-rate schedule start anew, the "
        "iteration number goes on)"
    )
    keep = SimpleNamespace(**{**vars(run), "use_checkpoint_opt_param_scheduler": True})
    assert resume.lr_refusal(keep, saved, "ck") is None
    assert (
        resume.lr_refusal(SimpleNamespace(**{**vars(keep), "decoupled_lr": 2e-3}), saved, "ck")
        is None
    )
    assert resume.lr_refusal(SimpleNamespace(**{**vars(run), "lr": 1e-3}), saved, "ck") is None
    assert "--min-lr 0.0001 (this run: 5e-05):" in resume.lr_refusal(
        SimpleNamespace(**{**vars(run), "lr": 1e-3, "min_lr": 5e-5}), saved, "ck"
    )
    override = SimpleNamespace(**{**vars(run), "override_opt_param_scheduler": True})
    assert resume.lr_refusal(override, saved, "ck") is None
    decoupled = SimpleNamespace(**{**vars(override), "decoupled_lr": 2e-3})
    assert resume.lr_refusal(decoupled, saved, "ck") == (
        "--load ck: the checkpoint's optimizer was saved with --lr 0.001 (this run: 0.0005), "
        "--decoupled-lr None (this run: 0.002): with --decoupled-lr in one run only the "
        "embedding and output layer have a parameter group of their own in one run only, which "
        "megatron-core 0.19.2 cannot match; give the checkpoint's --decoupled-lr, or use "
        "--use-checkpoint-opt_param-scheduler to train on with the checkpoint's learning rates, "
        "or add --no-load-optim to train on with this run's (the Adam moments and the "
        "learning-rate schedule start anew, the iteration number goes on)"
    )
    saved.decoupled_lr = 1e-3  # in both runs: another value loads like --lr
    assert resume.lr_refusal(decoupled, saved, "ck") is None
    assert "--decoupled-lr 0.001 (this run: 0.002):" in resume.lr_refusal(
        SimpleNamespace(**{**vars(decoupled), "override_opt_param_scheduler": False}), saved, "ck"
    )
    saved.decoupled_lr = None
    no_optim = SimpleNamespace(**{**vars(run), "no_load_optim": True})
    assert resume.lr_refusal(no_optim, saved, "ck") is None
    # another layout: the plain optimizer starts over (plan_layout_change), the fully
    # reshardable distributed one is loaded
    saved.expert_model_parallel_size, run.expert_model_parallel_size = 2, 1
    assert resume.lr_refusal(run, saved, "ck") is None
    for a in (saved, run):
        a.use_distributed_optimizer = a.dist_ckpt_optim_fully_reshardable = True
    assert resume.lr_refusal(run, saved, "ck").startswith("--load ck: the checkpoint's optimizer")
    assert resume.lr_refusal(run, None, "ck") is None


def test_the_checkpoints_schedule_flag_takes_the_checkpoints_lr():
    """--use-checkpoint-opt_param-scheduler: this run's LR args become the checkpoint's (its
    --decoupled-lr None included: Megatron then builds the saving run's param groups), and the
    warning names each one this run gave otherwise; an older checkpoint's args without
    --decoupled-min-lr leave this run's; without the flag, or with the checkpoint's values,
    nothing changes and nothing is said."""
    saved = SimpleNamespace(lr=1e-3, min_lr=1e-4, decoupled_lr=None)
    args = SimpleNamespace(
        lr=5e-4,
        min_lr=1e-4,
        decoupled_lr=2e-3,
        decoupled_min_lr=3e-5,
        use_checkpoint_opt_param_scheduler=False,
    )
    assert resume.take_checkpoint_lr(args, saved) is None and args.lr == 5e-4
    args.use_checkpoint_opt_param_scheduler = True
    assert resume.take_checkpoint_lr(args, saved) == (
        "--use-checkpoint-opt_param-scheduler: this run's learning rates are not used, the "
        "checkpoint's schedule goes on with its own: --lr 0.001 (this run: 0.0005), "
        "--decoupled-lr None (this run: 0.002)"
    )
    assert vars(args) == dict(
        lr=1e-3,
        min_lr=1e-4,
        decoupled_lr=None,
        decoupled_min_lr=3e-5,
        use_checkpoint_opt_param_scheduler=True,
    )
    assert resume.take_checkpoint_lr(args, saved) is None


def test_the_checkpoints_schedule_flag_names_the_weight_decay_it_does_not_use():
    """--use-checkpoint-opt_param-scheduler: megatron-core 0.19.2's scheduler takes the
    checkpoint's weight-decay schedule too (start_wd, end_wd, wd_incr_style), so the warning
    names another one: --weight-decay where both runs keep it constant (validate_args sets both
    ends to it), else each end and the style; the args become the checkpoint's, as the learning
    rates do (this run's checkpoints then record the schedule their scheduler holds). The same
    weight decay adds nothing to the learning rates' warning."""
    wd = dict(
        weight_decay=0.01,
        start_weight_decay=0.01,
        end_weight_decay=0.01,
        weight_decay_incr_style="constant",
    )
    saved = SimpleNamespace(lr=1e-3, min_lr=1e-4, **wd)
    constant = {**wd, "weight_decay": 0.1, "start_weight_decay": 0.1, "end_weight_decay": 0.1}
    args = SimpleNamespace(lr=1e-3, min_lr=1e-4, use_checkpoint_opt_param_scheduler=True)
    vars(args).update(constant)
    assert resume.take_checkpoint_lr(args, saved) == (
        "--use-checkpoint-opt_param-scheduler: this run's weight decay is not used, the "
        "checkpoint's schedule goes on with its own: --weight-decay 0.01 (this run: 0.1)"
    )
    assert vars(args) == dict(lr=1e-3, min_lr=1e-4, use_checkpoint_opt_param_scheduler=True, **wd)
    assert resume.take_checkpoint_lr(args, saved) is None
    vars(args).update(constant, lr=5e-4)
    assert resume.take_checkpoint_lr(args, saved) == (
        "--use-checkpoint-opt_param-scheduler: this run's learning rates and weight decay are "
        "not used, the checkpoint's schedule goes on with its own: --lr 0.001 (this run: "
        "0.0005), --weight-decay 0.01 (this run: 0.1)"
    )
    vars(args).update(weight_decay=0.05, start_weight_decay=0.0, end_weight_decay=0.1)
    args.weight_decay_incr_style = "linear"
    assert resume.take_checkpoint_lr(args, saved) == (
        "--use-checkpoint-opt_param-scheduler: this run's weight decay is not used, the "
        "checkpoint's schedule goes on with its own: --start-weight-decay 0.01 (this run: "
        "0.0), --end-weight-decay 0.01 (this run: 0.1), --weight-decay-incr-style constant "
        "(this run: linear)"
    )
    vars(args).update(wd)
    assert resume.take_checkpoint_lr(args, saved) is None
    args.lr = 5e-4
    assert resume.take_checkpoint_lr(args, saved) == (
        "--use-checkpoint-opt_param-scheduler: this run's learning rates are not used, the "
        "checkpoint's schedule goes on with its own: --lr 0.001 (this run: 0.0005)"
    )


def test_the_checkpoints_schedule_flag_names_the_schedule_lengths_it_does_not_use():
    """--use-checkpoint-opt_param-scheduler: megatron-core 0.19.2's scheduler takes the
    checkpoint's warmup and decay lengths (in samples, from --train-iters / --lr-decay-iters /
    --lr-warmup-* x --global-batch-size, or --train-samples and its kin) and decay style too: a
    longer --train-iters, a warmup fraction, another style are named, their flags left as given
    (--train-iters still ends the run). The weight decay's length only where it is not constant
    in both. The saving run's args hold lr_decay_iters as Megatron set it (= its train_iters);
    a sample-based checkpoint's hold train_iters too (set from --train-samples)."""
    common = dict(
        lr=1e-3,
        min_lr=1e-4,
        weight_decay=0.01,
        start_weight_decay=0.01,
        end_weight_decay=0.01,
        weight_decay_incr_style="constant",
        lr_decay_style="cosine",
        lr_warmup_iters=0,
        lr_warmup_fraction=None,
        global_batch_size=32,
        train_samples=None,
    )
    saved = SimpleNamespace(**common, train_iters=300, lr_decay_iters=300)
    args = SimpleNamespace(**common, train_iters=300, lr_decay_iters=None)
    args.use_checkpoint_opt_param_scheduler = True
    assert resume.take_checkpoint_lr(args, saved) is None
    args.train_iters = 600
    head = "--use-checkpoint-opt_param-scheduler: this run's "
    assert resume.take_checkpoint_lr(args, saved) == (
        head + "schedule lengths are not used, the checkpoint's schedule goes on with its own: "
        "LR decay over 9600 samples (this run: 19200)"
    )
    assert (args.train_iters, args.lr_decay_iters) == (600, None)
    vars(args).update(lr_warmup_fraction=0.1, lr_decay_style="linear", lr=5e-4)
    args.weight_decay_incr_style = "linear"
    assert resume.take_checkpoint_lr(args, saved) == (
        head + "learning rates, weight decay and schedule lengths are not used, the "
        "checkpoint's schedule goes on with its own: --lr 0.001 (this run: 0.0005), "
        "--weight-decay-incr-style constant (this run: linear), --lr-decay-style cosine (this "
        "run: linear), LR warmup over 0 samples (this run: 1920), LR decay over 9600 samples "
        "(this run: 19200), WD schedule over 9600 samples (this run: 19200)"
    )
    samples = dict(common, train_samples=9600, lr_decay_samples=None, lr_warmup_samples=0)
    saved = SimpleNamespace(**samples, train_iters=300, lr_decay_iters=None)
    args = SimpleNamespace(**samples, train_iters=None, lr_decay_iters=None)
    args.use_checkpoint_opt_param_scheduler = True
    assert resume.take_checkpoint_lr(args, saved) is None
    args.lr_warmup_samples = 320
    assert resume.take_checkpoint_lr(args, saved) == (
        head + "schedule lengths are not used, the checkpoint's schedule goes on with its own: "
        "LR warmup over 0 samples (this run: 320)"
    )


def test_the_checkpoints_schedule_flag_is_said_to_do_nothing_where_no_schedule_loads():
    """--use-checkpoint-opt_param-scheduler where megatron-core 0.19.2 loads no scheduler state
    (the model alone, --no-load-optim, a layout change the plain optimizer starts over on): one
    warning naming why; none where the state loads, without the flag or without saved args."""
    saved = SimpleNamespace(expert_model_parallel_size=2)
    args = SimpleNamespace(
        use_checkpoint_opt_param_scheduler=True, no_load_optim=False, expert_model_parallel_size=2
    )
    tail = (
        ", and the learning-rate schedule comes with the optimizer state; this run's schedule "
        "flags apply"
    )
    head = "--use-checkpoint-opt_param-scheduler does nothing here: "
    assert resume.unused_checkpoint_schedule_warning(args, saved, model_only=False) is None
    assert resume.unused_checkpoint_schedule_warning(args, saved, model_only=True) == (
        head + "this run loads the checkpoint's model alone (--finetune, --pretrained-checkpoint "
        "or a release checkpoint)" + tail
    )
    args.expert_model_parallel_size = 1  # plain optimizer: starts over on another layout
    assert resume.unused_checkpoint_schedule_warning(args, saved, model_only=False) == (
        head + "the optimizer starts over on this run's parallel layout" + tail
    )
    args.no_load_optim = True
    assert resume.unused_checkpoint_schedule_warning(args, saved, model_only=False) == (
        head + "--no-load-optim loads no optimizer state" + tail
    )
    assert resume.unused_checkpoint_schedule_warning(args, None, model_only=False) is None
    args.use_checkpoint_opt_param_scheduler = False
    assert resume.unused_checkpoint_schedule_warning(args, saved, model_only=True) is None


def test_a_no_save_optim_checkpoint_is_refused_only_where_its_optimizer_would_be_loaded():
    """A --no-save-optim checkpoint: refused where megatron-core 0.19.2 would load its (absent)
    optimizer state, not where a layout change starts the optimizer over (plain optimizer, or
    one side not fully reshardable: plan_layout_change), nor with --no-load-optim."""
    saved = SimpleNamespace(no_save_optim=True, expert_model_parallel_size=2)
    run = SimpleNamespace(no_load_optim=False, expert_model_parallel_size=2)
    assert resume.optimizer_refusal(run, saved, "ck").startswith(
        "--load ck: the checkpoint was saved with --no-save-optim"
    )
    assert (
        resume.optimizer_refusal(
            SimpleNamespace(**{**vars(run), "no_load_optim": True}), saved, "ck"
        )
        is None
    )
    run.expert_model_parallel_size = 1  # EP2 -> EP1, plain optimizer: not loaded
    assert resume.optimizer_refusal(run, saved, "ck") is None
    for a in (saved, run):
        a.use_distributed_optimizer = a.dist_ckpt_optim_fully_reshardable = True
    assert resume.optimizer_refusal(run, saved, "ck") is not None  # resharded: it is loaded
    saved.no_save_optim = False
    assert resume.optimizer_refusal(run, saved, "ck") is None
    assert resume.optimizer_refusal(run, None, "ck") is None


def test_a_checkpoint_with_or_without_shared_experts_or_latents_is_another_shape():
    """Before, a None in this run's args was skipped: a checkpoint with shared experts resumed
    without them trained on silently, those weights dropped (measured: tiny.sh, 1 rank)."""
    saved = SimpleNamespace(moe_shared_expert_intermediate_size=64, moe_latent_size=None)
    run = SimpleNamespace(moe_shared_expert_intermediate_size=None, moe_latent_size=32)
    assert resume.shape_refusal("ck", run, saved) == (
        "--load ck: the checkpoint is of another model shape: --moe-latent-size not given "
        "(this run: 32), --moe-shared-expert-intermediate-size 64 (this run: not given). Give "
        "the checkpoint's model flags, or --use-checkpoint-args to take them from it"
    )
    assert resume.shape_refusal("ck", run, SimpleNamespace()) is None  # args it does not hold


def test_a_checkpoint_with_or_without_the_latent_norm_is_another_shape():
    """The routed experts' norm exists or not: turned on, megatron-core 0.19.2 failed the load
    with a KeyError traceback; turned off, it dropped the trained norm silently."""
    saved = SimpleNamespace(latent_moe_use_norm=False)
    run = SimpleNamespace(latent_moe_use_norm=True)
    assert resume.shape_refusal("ck", run, saved) == (
        "--load ck: the checkpoint is of another model shape: --moe-latent-norm False (this run: "
        "True). Give the checkpoint's model flags, or --use-checkpoint-args to take them from it"
    )
    assert resume.shape_refusal("ck", saved, run).endswith(
        "the checkpoint is of another model shape: --moe-latent-norm True (this run: False). "
        "Give the checkpoint's model flags, or --use-checkpoint-args to take them from it"
    )


def test_another_activation_than_the_checkpoints_is_warned_of():
    def args(act, beta=4.0, linear=25.0):
        return SimpleNamespace(
            hidden_act=act, activation_situ_beta=beta, activation_situ_linear_beta=linear
        )

    assert resume.activation_warning(args("situ"), args("situ"), "ck") is None
    assert resume.activation_warning(args("swiglu", 2.0), args("swiglu"), "ck") is None
    assert resume.activation_warning(args("situ"), None, "ck") is None
    assert resume.activation_warning(args("swiglu"), args("situ"), "ck") == (
        "--load ck: the checkpoint was trained with --hidden-act situ; this run uses "
        "--hidden-act swiglu: its weights are trained on with another activation (give the "
        "checkpoint's flags, or --use-checkpoint-args, to keep its own)"
    )
    assert resume.activation_warning(args("situ", 2.0), args("situ"), "ck").startswith(
        "--load ck: the checkpoint was trained with --hidden-act situ --activation-situ-beta 4.0 "
        "--activation-situ-linear-beta 25.0; this run uses --hidden-act situ "
        "--activation-situ-beta 2.0 "
    )


def test_megatron_loads_the_pretrained_checkpoint_where_load_holds_none(tmp_path):
    """megatron-core 0.19.2's ``load_checkpoint``: --pretrained-checkpoint where --load has no
    tracker (counted after our repair, which writes one where a complete checkpoint is)."""

    def loaded(load=None, pretrained=None):
        args = SimpleNamespace(
            load=load and str(load), pretrained_checkpoint=pretrained, ckpt_format="torch_dist"
        )
        return resume.loaded_arg(args)

    assert loaded() is None
    assert loaded(load=tmp_path / "new") == "load"
    assert loaded(pretrained="pre") == "pretrained_checkpoint"
    assert loaded(load=tmp_path / "new", pretrained="pre") == "pretrained_checkpoint"
    (tmp_path / "ck").mkdir()
    _checkpoints(tmp_path / "ck", [2])  # complete, no tracker yet: the repair writes one
    assert loaded(load=tmp_path / "ck", pretrained="pre") == "load"
    (tmp_path / "rel").mkdir()
    _checkpoints(tmp_path / "rel", [], tracker=b"release")
    assert loaded(load=tmp_path / "rel", pretrained="pre") == "load"
    assert resume.load_flag("pretrained_checkpoint") == "--pretrained-checkpoint"


def test_a_pretrained_checkpoint_megatron_falls_back_to_is_checked_as_load_is(tmp_path):
    """Before, none of these was checked for --pretrained-checkpoint; megatron-core 0.19.2 failed
    on each after building the model, on every rank (measured, CPU, one rank): nothing there,
    "FileNotFoundError: No checkpoint found in load directory or pretrained directory"; a
    torch_dist one with --ckpt-format torch, "RuntimeError: Detected load from a distributed
    checkpoint ..."; another shape, "CheckpointException ... Global shape mismatch". Now one
    line each, named by its flag; no advice to start from scratch (Megatron does not)."""
    pre = tmp_path / "pre"
    args = SimpleNamespace(
        load=None,
        pretrained_checkpoint=str(pre),
        ckpt_format="torch",
        auto_detect_ckpt_format=False,
        non_persistent_ckpt_type=None,
    )
    advice = "give it the folder a Megatron save or the HF import wrote (SAVE_ROOT)"
    assert resume.pretrained_refusal(args) == (
        f"--pretrained-checkpoint {pre}: no checkpoint there ({TRACKER_FILE} is not there) and "
        f"no --load is given; {advice}"
    )
    args.load = str(tmp_path / "new")
    assert resume.pretrained_refusal(args).endswith(
        f" and --load {tmp_path / 'new'} holds none either; {advice}"
    )
    pre.mkdir()
    _checkpoints(pre, [2], tracker=b"2", files=TORCH_DIST_FILES)
    assert resume.pretrained_refusal(args) is None
    assert resume.format_refusal(args, "pretrained_checkpoint") == (
        f"--pretrained-checkpoint {pre}: {pre}/iter_0000002 is a torch_dist checkpoint, which "
        "megatron-core 0.19.2 fails to load with --ckpt-format torch; resume from it with "
        "--ckpt-format torch_dist, or add --auto-detect-ckpt-format (the run then saves in "
        "--ckpt-format torch)"
    )
    assert resume.format_refusal(args) is None  # --load: nothing there
    saved, run = SimpleNamespace(hidden_size=64), SimpleNamespace(hidden_size=128)
    assert resume.shape_refusal(str(pre), run, saved, "--pretrained-checkpoint").startswith(
        f"--pretrained-checkpoint {pre}: the checkpoint is of another model shape: "
        "--hidden-size 64 (this run: 128)"
    )
    gone = tmp_path / "gone"
    gone.mkdir()
    _checkpoints(gone, [], tracker=b"8")
    assert _load_refusal(gone, "pretrained_checkpoint") == (
        f"--pretrained-checkpoint {gone}: {gone / TRACKER_FILE} names iteration 8, but "
        f"{gone / 'iter_0000008'} is not there and no other complete checkpoint is: give "
        "--pretrained-checkpoint the folder that holds it"
    )
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert _load_refusal(hf, "pretrained_checkpoint").endswith(
        "--output SAVE_ROOT) and give --pretrained-checkpoint SAVE_ROOT"
    )


def test_a_damaged_pretrained_checkpoint_is_refused_without_the_resume_advice(tmp_path):
    path = dcp_checkpoint(tmp_path, 4)
    (shard,) = path.glob("*.distcp")
    shard.unlink()
    assert _load_refusal(tmp_path, "pretrained_checkpoint") == (
        f"--pretrained-checkpoint {tmp_path}: the checkpoint of iteration 4 is damaged: shard "
        f"file {shard} is missing. Write {TRACKER_FILE} with an earlier iteration whose folder "
        "is whole"
    )


@pytest.mark.parametrize("load_arg", ["pretrained_checkpoint", "load"])
def test_a_legacy_release_checkpoint_of_another_layout_is_refused(tmp_path, load_arg):
    """A legacy ``torch`` release checkpoint (what Megatron fine-tunes from; from --load too) of
    another tensor parallel size: megatron-core 0.19.2 loads one only in its own layout."""
    _checkpoints(tmp_path, [], tracker=b"release")
    (tmp_path / "release" / "mp_rank_00").mkdir(parents=True)
    layout = dict.fromkeys(resume.LAYOUT_FIELDS, 1)
    args = SimpleNamespace(
        **layout,
        load=None,
        pretrained_checkpoint=None,
        ckpt_format="torch",
        non_persistent_ckpt_type=None,
    )
    setattr(args, load_arg, str(tmp_path))
    saved = SimpleNamespace(**{**layout, "tensor_model_parallel_size": 2})
    path = resume.resumed_by_args(args, load_arg)
    assert resume.legacy_layout_refusal(args, saved, path, load_arg).startswith(
        f"{resume.load_flag(load_arg)} {tmp_path}: {tmp_path}/release is a legacy torch "
        "checkpoint of another parallel layout: --tensor-model-parallel-size 2 (this run: 1)"
    )
    same = SimpleNamespace(**layout)
    assert resume.legacy_layout_refusal(args, same, path, load_arg) is None  # its own layout
    # another data-parallel size: its rank files are per (TP, PP, EP) rank, so it loads
    other_dp = SimpleNamespace(**{**layout, "data_parallel_size": 2})
    assert resume.legacy_layout_refusal(args, other_dp, path, load_arg) is None
    (tmp_path / "release" / "metadata.json").write_text("{}")  # torch_dist: Megatron reshards it
    assert resume.legacy_layout_refusal(args, saved, path, load_arg) is None


def test_a_layout_change_is_one_megatron_does_not_load_as_it_is():
    """Another data-parallel size alone loads as it is (unless each DP rank has its own RNG
    state, --data-parallel-random-init); a field the checkpoint's args lack is no change."""
    layout = dict.fromkeys(resume.LAYOUT_FIELDS, 1)
    run = SimpleNamespace(**layout, data_parallel_random_init=False)
    dp2 = SimpleNamespace(**{**layout, "data_parallel_size": 2})
    assert not resume.layout_changed(run, dp2)
    assert resume.layout_changed(
        SimpleNamespace(**{**vars(run), "data_parallel_random_init": True}), dp2
    )
    assert resume.layout_changed(
        run, SimpleNamespace(**{**layout, "expert_model_parallel_size": 2})
    )
    assert not resume.layout_changed(
        run, SimpleNamespace(**{**layout, "context_parallel_size": None})
    )


def _step_args(root, step, **flags):
    args = SimpleNamespace(
        load=str(root),
        pretrained_checkpoint=None,
        ckpt_format="torch_dist",
        ckpt_step=step,
        non_persistent_ckpt_type=None,
    )
    vars(args).update(flags)
    return args


def test_ckpt_step_is_the_checkpoint_judged_as_megatron_loads_it(tmp_path, common_state):
    """megatron-core 0.19.2 loads --ckpt-step's iteration in place of the tracker's (0: none;
    a release tracker keeps release; a non-persistent one as new or newer wins). Before, the
    start-up checks read the tracker's folder (here iteration 4) whatever --ckpt-step said."""
    root = _checkpoints(tmp_path, [2, 4], tracker=b"4")
    assert resume.resumed_checkpoint(root, ckpt_step=2) == f"{root}/iter_0000002"
    assert resume.resumed_checkpoint(root, ckpt_step=0) == f"{root}/iter_0000004"
    assert resume.saved_args(resume.resumed_by_args(_step_args(root, 2))) == "args of iter_0000002"
    assert resume.resumed_by_args(_step_args(root, 2)) == f"{root}/iter_0000002"
    (tmp_path / "np").mkdir()
    _checkpoints(tmp_path / "np", [3], tracker=b"3")
    assert resume.resumed_checkpoint(root, ckpt_step=2, non_persistent=str(tmp_path / "np")) == (
        f"{tmp_path}/np/iter_0000003"
    )
    assert resume.resumed_checkpoint(root, ckpt_step=4, non_persistent=str(tmp_path / "np")) == (
        f"{root}/iter_0000004"
    )
    # as new: megatron-core 0.19.2 loads the non-persistent one (non_persistent_iteration >= ...)
    assert resume.resumed_checkpoint(root, ckpt_step=3, non_persistent=str(tmp_path / "np")) == (
        f"{tmp_path}/np/iter_0000003"
    )
    (tmp_path / iteration_dir_name(7)).mkdir()
    (tmp_path / iteration_dir_name(7) / "mp_rank_00").mkdir()  # a legacy torch checkpoint
    assert _format_refusal(root, "torch") is not None  # the tracker's: torch_dist
    args = _step_args(root, 7, ckpt_format="torch", auto_detect_ckpt_format=False)
    assert resume.format_refusal(args) is None  # --ckpt-step's: a legacy torch one
    args = _step_args(root, 2, ckpt_format="torch", auto_detect_ckpt_format=False)
    assert resume.format_refusal(args).startswith(
        f"--load {root}: {root}/iter_0000002 is a torch_dist checkpoint"
    )
    (tmp_path / TRACKER_FILE).write_bytes(b"release")
    assert resume.resumed_checkpoint(root, ckpt_step=2) == f"{root}/release"


def test_a_ckpt_step_without_a_complete_checkpoint_is_refused_in_one_line(tmp_path):
    """megatron-core 0.19.2, --ckpt-step 5 with no iter_0000005 (measured, CPU, one rank): after
    building the model and optimizer, "FileNotFoundError: [Errno 2] No such file or directory:
    '.../iter_0000005'". Now one line naming the flag, the folder and the complete ones."""
    root = _checkpoints(tmp_path, [2, 4], tracker=b"4")
    (tmp_path / iteration_dir_name(6)).mkdir()
    (tmp_path / iteration_dir_name(6) / ".metadata").write_text("{}")  # killed mid-save
    assert resume.ckpt_step_refusal(_step_args(root, 2)) is None
    assert resume.ckpt_step_refusal(_step_args(root, None)) is None
    tail = f" (--load {root}); give an iteration whose checkpoint there is complete (complete "
    tail += "ones: 2, 4), or leave --ckpt-step out to load the tracker's"
    assert resume.ckpt_step_refusal(_step_args(root, 5)) == (
        f"--ckpt-step 5: {root}/iter_0000005 is not there{tail}"
    )
    assert resume.ckpt_step_refusal(_step_args(root, 6)) == (
        f"--ckpt-step 6: {root}/iter_0000006 is not a complete checkpoint{tail}"
    )
    assert _load_refusal(root, ckpt_step=6) is None  # left to the line above
    (tmp_path / TRACKER_FILE).write_text("5")  # the tracker names --ckpt-step's missing folder:
    assert _load_refusal(root, ckpt_step=5) is None  # not "no other complete checkpoint is"
    assert resume.ckpt_step_refusal(_step_args(root, 5)).startswith(
        f"--ckpt-step 5: {root}/iter_0000005 is not there"
    )


def test_ckpt_step_of_a_legacy_checkpoint_is_not_refused_in_a_torch_dist_run(tmp_path):
    """megatron-core 0.19.2 loads a legacy torch checkpoint with --ckpt-format torch_dist (it
    detects each folder's format): --ckpt-step of one was refused as "not a complete
    checkpoint", and the complete ones listed left it out."""
    root = _checkpoints(tmp_path, [2], tracker=b"2")
    (tmp_path / iteration_dir_name(6) / "mp_rank_00").mkdir(parents=True)
    assert resume.ckpt_step_refusal(_step_args(root, 6)) is None
    assert resume.ckpt_step_refusal(_step_args(root, 4)).endswith(
        "(complete ones: 2, 6), or leave --ckpt-step out to load the tracker's"
    )


def test_ckpt_step_advice_without_a_tracker_says_what_megatron_does_instead(tmp_path):
    """Leaving --ckpt-step out loads the tracker's checkpoint only where there is a tracker:
    without one the start-up repair writes one naming the newest complete checkpoint, and with
    none complete Megatron finds nothing to load and starts from scratch. Before, each said
    "leave --ckpt-step out to load the tracker's"."""
    new = tmp_path / "new"
    assert resume.ckpt_step_refusal(_step_args(new, 5)) == (
        f"--ckpt-step 5: {new}/iter_0000005 is not there (--load {new}); no checkpoint is there: "
        "leave --ckpt-step out to start from scratch"
    )
    args = _step_args(new, 5, load=None, pretrained_checkpoint=str(new))
    assert resume.ckpt_step_refusal(args, "pretrained_checkpoint").endswith(
        "no checkpoint is there: give --pretrained-checkpoint the folder that holds one"
    )
    root = _checkpoints(tmp_path, [2, 4])  # no tracker: the repair will name 4
    assert resume.ckpt_step_refusal(_step_args(root, 5)).endswith(
        "(complete ones: 2, 4), or leave --ckpt-step out to load the newest complete one (4)"
    )


def test_ckpt_step_with_a_release_tracker_is_warned_of(tmp_path):
    """megatron-core 0.19.2 keeps the tracker's release flag and loads ``release`` whatever
    --ckpt-step says (resumed_checkpoint follows it): a warning, not a refusal."""
    root = _checkpoints(tmp_path, [2], tracker=b"release")
    (tmp_path / "release").mkdir()
    assert resume.ckpt_step_warning(_step_args(root, None)) is None
    assert resume.ckpt_step_refusal(_step_args(root, 7)) is None
    assert resume.ckpt_step_warning(_step_args(root, 7)) == (
        f"--ckpt-step 7 is ignored: --load {root} holds a release checkpoint ({TRACKER_FILE}: "
        f"release), which megatron-core 0.19.2 loads whatever --ckpt-step says: {root}/release"
    )
    (tmp_path / TRACKER_FILE).write_text("2")
    assert resume.ckpt_step_warning(_step_args(root, 2)) is None


def test_a_damaged_ckpt_step_checkpoint_is_refused(tmp_path):
    """The damage check reads --ckpt-step's folder, not the tracker's."""
    path = dcp_checkpoint(tmp_path, 4)
    dcp_checkpoint(tmp_path, 2)  # the tracker's
    assert _load_refusal(tmp_path) is None
    (shard,) = path.glob("*.distcp")
    shard.unlink()
    assert _load_refusal(tmp_path, ckpt_step=4).startswith(
        f"--load {tmp_path}: the checkpoint of iteration 4 is damaged: shard file {shard} is "
        "missing"
    )


def test_a_release_on_load_whose_data_continues_is_warned_of(tmp_path):
    """megatron-core 0.19.2 loads a release checkpoint from --load as the model alone, from
    iteration 0, but without --finetune takes consumed_train_samples from its args: the data
    continues after them (measured: tests/training/test_ckpt_formats.py's release test). One warning
    where that happens; none where the data starts over or the checkpoint is not a release."""
    _checkpoints(tmp_path, [4], tracker=b"release")
    (tmp_path / "release").mkdir()
    args = _step_args(tmp_path, None, finetune=False)
    path = resume.resumed_by_args(args, "load")
    assert path == f"{tmp_path}/release" and resume.loads_release(path)
    consumed = SimpleNamespace(consumed_train_samples=16)
    assert resume.release_data_warning(args, consumed, path) == (
        f"--load {tmp_path} holds a release checkpoint ({TRACKER_FILE}: release): megatron-core "
        "0.19.2 restores its model weights alone (the QB router bias included) and starts the "
        "iteration count, optimizer, LR schedule (warm-up included) and RNG over, but continues "
        "the data after the 16 training samples the run that saved it consumed (validation data "
        "likewise). Pass --finetune to start the data from sample 0 too: for a release "
        "checkpoint it changes nothing else in megatron-core 0.19.2 but skipping Megatron's "
        "comparison of the checkpoint's model args (this entry point's shape check still runs)"
    )
    for saved in (SimpleNamespace(consumed_train_samples=0), SimpleNamespace(), None):
        assert resume.release_data_warning(args, saved, path) is None  # nothing to continue after
    finetune = _step_args(tmp_path, None, finetune=True)
    assert resume.release_data_warning(finetune, consumed, path) is None
    override = _step_args(tmp_path, None, finetune=False, override_ckpt_iteration=3)
    assert resume.release_data_warning(override, consumed, path) is None  # the user's offset
    # --pretrained-checkpoint: Megatron sets --finetune itself (args.finetune is set at its load)
    pretrained = _step_args(None, None, finetune=False, load=None, pretrained_checkpoint=path)
    assert resume.release_data_warning(pretrained, consumed, path, "pretrained_checkpoint") is None
    (tmp_path / TRACKER_FILE).write_text("4")  # not a release: Megatron resumes all of it
    path = resume.resumed_by_args(args, "load")
    assert path == f"{tmp_path}/iter_0000004" and not resume.loads_release(path)
    assert resume.release_data_warning(args, consumed, path) is None
