"""compat.training: the patches of megatron.training's entry point, called in one process with
recording stand-ins for Megatron's functions (the tests/training runs meet them end to end)."""

from __future__ import annotations

import sys
import types
from datetime import timedelta

import pytest
import torch

from megatron_latentmoe.compat import apply_python311_compat, cpu, registry
from megatron_latentmoe.compat import training as ctraining

GROUPS = (ctraining._CPU_GROUP, ctraining._FLAGS_GROUP, ctraining._RUN_GROUP)


@pytest.fixture
def megatron_training(monkeypatch):
    """``(megatron.training.arguments, megatron.training.training)`` with this module's patch
    groups off for the test; the registry and the patched attributes are as before afterwards."""
    apply_python311_compat()
    import megatron.training.arguments as margs
    import megatron.training.training as mtraining

    monkeypatch.setattr(registry, "_patched", list(registry._patched))
    monkeypatch.setattr(registry, "_groups", set(registry._groups))
    for group in GROUPS:
        for owner, name, _ in registry.patched(group):
            monkeypatch.setattr(owner, name, getattr(owner, name))  # restored afterwards
        registry.revert(group)
    yield margs, mtraining
    for group in GROUPS:
        registry.revert(group)


def test_cpu_training_defaults_switch_off_cuda_kernels():
    args = types.SimpleNamespace(
        bias_dropout_fusion=True,
        masked_softmax_fusion=False,
        apply_rope_fusion=True,
        gradient_accumulation_fusion=True,
        cross_entropy_loss_fusion=True,
        rerun_mode="validate_results",
    )  # no bias_swiglu_fusion: a namespace without a flag is left without it
    notes = ctraining.cpu_training_defaults(args, argv=["--rerun-modes"])
    assert notes == [
        "bias_dropout_fusion",
        "apply_rope_fusion",
        "gradient_accumulation_fusion",
        "cross_entropy_loss_fusion",
        "rerun_mode=disabled",
    ]
    assert vars(args) == dict.fromkeys(vars(args), False) | {"rerun_mode": "disabled"}
    assert not hasattr(args, "bias_swiglu_fusion")
    assert ctraining.cpu_training_defaults(args, argv=[]) == []


@pytest.mark.parametrize("argv", [["--rerun-mode", "validate_results"], ["--rerun-mode=x"]])
def test_a_cpu_run_keeps_the_rerun_mode_it_names(argv):
    """Megatron's rerun state machine runs on CPU (tests/training/test_rerun.py): a run that
    names --rerun-mode keeps it (it was replaced by 'disabled')."""
    args = types.SimpleNamespace(rerun_mode="validate_results")
    assert ctraining.cpu_training_defaults(args, argv=argv) == []
    assert args.rerun_mode == "validate_results"


def test_cpu_training_compat(megatron_training, monkeypatch):
    """initialize_megatron gets allow_no_cuda, the CUDA fusion warm-up does nothing, the GPU
    architecture query answers 0 (pre-Blackwell), building the data iterators leaves the CPU
    generator as it was; applying twice patches once."""
    import torch

    margs, mtraining = megatron_training
    calls = []
    monkeypatch.setattr(mtraining, "initialize_megatron", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(
        mtraining, "build_train_valid_test_data_iterators", lambda provider: torch.rand(3)
    )
    ctraining.apply_cpu_training_compat()
    ctraining.apply_cpu_training_compat()
    mtraining.initialize_megatron(store="store", skip_random_seed=True)  # as pretrain calls it
    assert calls == [((), {"store": "store", "skip_random_seed": True, "allow_no_cuda": True})]
    assert mtraining.set_jit_fusion_options(tp_size=2) is None
    assert margs.get_device_arch_version() == 0
    state = torch.get_rng_state()
    drawn = mtraining.build_train_valid_test_data_iterators(None)
    assert torch.get_rng_state().equal(state) and torch.rand(3).equal(drawn)
    assert len(registry.patched(ctraining._CPU_GROUP)) == 4


def _world_args(**kw):
    return types.SimpleNamespace(
        rank=1,
        world_size=8,
        distributed_timeout_minutes=7,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=3,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=5,
        context_parallel_size=6,
        seed=11,
        data_parallel_random_init=True,
        virtual_pipeline_model_parallel_size=9,
        num_distributed_optimizer_instances=10,
        use_tp_pp_dp_mapping=False,
        use_gloo_process_groups=False,
        **kw,
    )


def test_init_cpu_world_hands_megatrons_flags_on(monkeypatch):
    calls = {}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(
        torch.distributed, "init_process_group", lambda **kw: calls.setdefault("world", kw)
    )
    monkeypatch.setattr(cpu, "initialize_parallel_cpu", lambda **kw: calls.setdefault("mp", kw))
    ctraining.init_cpu_world(_world_args())
    assert calls["world"] == dict(
        backend="gloo", rank=1, world_size=8, timeout=timedelta(minutes=7)
    )
    assert calls["mp"] == dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=3,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=5,
        context_parallel_size=6,
        seed=11,
        data_parallel_random_init=True,
        virtual_pipeline_model_parallel_size=9,
        num_distributed_optimizer_instances=10,
        distributed_timeout_minutes=7,
        order="tp-cp-ep-dp-pp",
        create_gloo_process_groups=False,
    )
    # an initialised world is kept; --use-tp-pp-dp-mapping puts PP before DP
    calls.clear()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    args = _world_args()
    args.use_tp_pp_dp_mapping = args.use_gloo_process_groups = True
    ctraining.init_cpu_world(args)
    assert "world" not in calls
    assert calls["mp"]["order"] == "tp-cp-ep-pp-dp" and calls["mp"]["create_gloo_process_groups"]


def test_every_parse_includes_our_flags(megatron_training, monkeypatch):
    """Megatron's own re-parses (ft_integration, in-process restart: ignore_unknown_args) and a
    parse with another extra provider see our flags too."""
    margs, _ = megatron_training

    def add_ours(parser):
        parser.add_argument("--our-flag", type=int, default=1)
        return parser

    def add_extra(parser):
        parser.add_argument("--extra-flag", type=int, default=7)
        return parser

    monkeypatch.setattr(sys, "argv", ["pretrain", "--our-flag", "3"])
    assert ctraining.parse_with_our_flags(add_ours).our_flag == 3
    monkeypatch.setattr(sys, "argv", ["pretrain", "--our-flag", "4", "--not-a-flag"])
    assert margs.parse_args(ignore_unknown_args=True).our_flag == 4
    monkeypatch.setattr(sys, "argv", ["pretrain", "--our-flag", "5"])
    args = margs.parse_args(add_extra)
    assert (args.our_flag, args.extra_flag) == (5, 7)
    assert len(registry.patched(ctraining._FLAGS_GROUP)) == 1
    ctraining.parse_with_our_flags(add_ours)  # a second run in this process: wrapped once
    assert len(registry.patched(ctraining._FLAGS_GROUP)) == 1


def test_run_patches_wrap_megatrons_and_begin_run_drops_them(megatron_training, monkeypatch):
    _, mtraining = megatron_training
    names = ("save_checkpoint_and_time", "evaluate_and_print_results", "train_step")
    originals = {}
    for name in names:
        originals[name] = lambda *a, _name=name: (_name, a)
        monkeypatch.setattr(mtraining, name, originals[name])

    def excluded(fn):
        return lambda *a: ("excluded", fn(*a))

    ctraining.exclude_from_step_time(excluded)
    ctraining.wrap_train_step(lambda fn: lambda *a: ("rescored", fn(*a)))
    ctraining.wrap_train_step(lambda fn: lambda *a: ("calibrated", fn(*a)))  # the outermost
    assert mtraining.save_checkpoint_and_time(1) == ("excluded", ("save_checkpoint_and_time", (1,)))
    assert mtraining.evaluate_and_print_results(2) == (
        "excluded",
        ("evaluate_and_print_results", (2,)),
    )
    assert mtraining.train_step(3) == ("calibrated", ("rescored", ("train_step", (3,))))
    ctraining.begin_run()
    assert [getattr(mtraining, n) for n in names] == [originals[n] for n in names]


def test_a_first_iteration_that_ends_a_log_interval_is_logged_as_a_regular_one(
    megatron_training, monkeypatch
):
    """log_each_iteration_once: Megatron's training_log is told that a run's first iteration is
    a regular one where it ends a --log-interval (its sums are then reset after it is printed);
    inside an interval it stays the first one; the other arguments are handed on as given."""
    _, mtraining = megatron_training
    seen, args = [], types.SimpleNamespace(log_interval=1)

    def training_log(*a, is_first_iteration=False, **kw):
        seen.append((a, is_first_iteration, kw))
        return "logged"

    monkeypatch.setattr(mtraining, "training_log", training_log)
    monkeypatch.setattr(mtraining, "get_args", lambda: args)
    ctraining.begin_run()
    ctraining.log_each_iteration_once()
    # (log interval, iteration, is_first_iteration given, handed to Megatron)
    for interval, iteration, first, handed in [(1, 3, True, False), (2, 4, True, False)] + [
        (2, 3, True, True),
        (2, 5, False, False),
    ]:
        args.log_interval = interval
        logged = mtraining.training_log(
            "losses", "sums", 1e-3, iteration, 1.0, is_first_iteration=first, pg_collection="pg"
        )
        assert logged == "logged"
        assert seen.pop() == (
            ("losses", "sums", 1e-3, iteration, 1.0),
            handed,
            {"pg_collection": "pg"},
        ), (interval, iteration, first)


def test_layout_change_load(megatron_training, monkeypatch):
    """During the load: no RNG state, the optimizer only where it may be loaded (and never
    against --no-load-optim); the flags are the user's again afterwards, after a failed load
    too, and on_load sees the iteration and the scheduler."""
    _, mtraining = megatron_training
    seen, loaded = [], []

    def load_checkpoint(model, optimizer, scheduler, *a, **kw):
        seen.append((args.no_load_optim, args.no_load_rng, a, kw))
        if model == "broken":
            raise RuntimeError("torn checkpoint")
        return 12, 34

    monkeypatch.setattr(mtraining, "load_checkpoint", load_checkpoint)
    for explicit_optim, load_optim, during in [
        (False, True, False),
        (False, False, True),
        (True, True, True),
    ]:
        args = types.SimpleNamespace(no_load_optim=explicit_optim, no_load_rng=False)
        ctraining.begin_run()
        ctraining.install_layout_change_load(args, load_optim, lambda *a: loaded.append(a))
        assert mtraining.load_checkpoint("model", "opt", "sched", "x", k=1) == (12, 34)
        assert seen.pop() == (during, True, ("x",), {"k": 1})
        assert (args.no_load_optim, args.no_load_rng) == (explicit_optim, False)
        assert loaded.pop() == (12, "sched")
    with pytest.raises(RuntimeError, match="torn checkpoint"):
        mtraining.load_checkpoint("broken", "opt", "sched")
    assert (args.no_load_optim, args.no_load_rng) == (True, False) and not loaded


def test_only_a_persistent_saves_error_goes_to_the_save_error_handler(
    megatron_training, monkeypatch
):
    """on_save_error: the error of a ``--save`` checkpoint's save goes to the handler with the
    iteration, then is re-raised; a non-persistent save's (another folder, not --save's disk)
    and an interrupt are re-raised without it."""
    _, mtraining = megatron_training
    failure, handled = OSError(28, "No space left on device"), []

    def save_checkpoint(iteration, *a, **kw):
        raise failure

    monkeypatch.setattr(mtraining, "save_checkpoint", save_checkpoint)
    ctraining.begin_run()
    ctraining.on_save_error(lambda err, iteration: handled.append((err, iteration)))
    for kw, seen in (({}, [(failure, 4)]), ({"non_persistent_ckpt": True}, [])):
        with pytest.raises(OSError) as raised:
            mtraining.save_checkpoint(4, "model", **kw)
        assert raised.value is failure and handled == seen, kw
        handled.clear()
    failure = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        mtraining.save_checkpoint(4, "model")
    assert handled == []


def test_a_distributed_checkpoint_is_loaded_in_its_format_and_the_run_saves_in_its_own(
    megatron_training, monkeypatch
):
    """load_distributed_checkpoint_as_such: inside Megatron's load, from the detection (its
    first ``_load_base_checkpoint``) on, ``ckpt_format`` is torch_dist for a distributed
    checkpoint (the state dict is built from it), the run's (torch) for a legacy one; afterwards
    the run's again, after a failed load too; outside a load (``load_args_from_checkpoint``) it
    is left alone."""
    import megatron.training.checkpointing as checkpointing

    _, mtraining = megatron_training
    args = types.SimpleNamespace(ckpt_format="torch")
    found, seen = [], []

    def load_base_checkpoint(load_dir, args, rank0=False, **kw):
        return {}, "iter_0000003", False, found[0]

    def load_checkpoint(model, *a, **kw):
        checkpointing._load_base_checkpoint("ck", args, rank0=True)  # the detection
        seen.append(args.ckpt_format)  # what Megatron builds the state dict from
        checkpointing._load_base_checkpoint("ck", args, rank0=False)
        if model == "broken":
            raise RuntimeError("torn checkpoint")
        return 3, 0

    monkeypatch.setattr(checkpointing, "_load_base_checkpoint", load_base_checkpoint)
    monkeypatch.setattr(mtraining, "load_checkpoint", load_checkpoint)
    ctraining.begin_run()
    ctraining.load_distributed_checkpoint_as_such(args)
    kind = checkpointing.CheckpointType
    for found[:], model, during in (
        ([kind.GLOBAL], "model", "torch_dist"),
        ([kind.LOCAL], "model", "torch_dist"),
        ([kind.LEGACY], "model", "torch"),
        ([kind.GLOBAL], "broken", "torch_dist"),
    ):
        if model == "broken":
            with pytest.raises(RuntimeError, match="torn checkpoint"):
                mtraining.load_checkpoint(model, "opt", "sched")
        else:
            assert mtraining.load_checkpoint(model, "opt", "sched") == (3, 0)
        assert (seen.pop(), args.ckpt_format) == (during, "torch"), found
    found[:] = [kind.GLOBAL]
    checkpointing._load_base_checkpoint("ck", args, rank0=True)
    assert args.ckpt_format == "torch"


def test_optional_checkpoint_keys_absent_from_the_checkpoint_are_skipped(
    megatron_training, monkeypatch
):
    import megatron.core.dist_checkpointing as dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    def tensor(key):
        return ShardedTensor.from_rank_offsets(key, torch.zeros(2))

    in_checkpoint = {"l0.router.qb_mean_input": None, "l0.weight": None}
    metadata_reads, loads = [], []
    monkeypatch.setattr(
        dist_checkpointing,
        "load_tensors_metadata",
        lambda d: metadata_reads.append(d) or in_checkpoint,
    )

    def read(tree):  # what Megatron's load returns: the tree with each tensor read
        return {k: read(v) if isinstance(v, dict) else "read" for k, v in tree.items()}

    def load(sd, d, *a, **kw):
        loads.append((sorted(sd), a, kw))
        return read(sd)

    monkeypatch.setattr(dist_checkpointing, "load", load)
    ctraining.load_optional_checkpoint_keys((".qb_mean_input",))
    layers = {
        "present": tensor("l0.router.qb_mean_input"),
        "weight": tensor("l0.weight"),
        "nested": {"absent": tensor("l1.router.qb_mean_input"), "w": tensor("l1.weight")},
        "absent": tensor("l2.router.qb_mean_input"),
        "lookalike": tensor("l3.router.qb_mean_input_v0"),  # not the suffix: required
    }
    model = {"model": layers}  # optional keys only nested
    own = (layers["absent"].data, layers["nested"]["absent"].data)
    loaded = dist_checkpointing.load(model, "ckpt", "strategy", strict="x")
    assert metadata_reads == ["ckpt"]
    assert loads == [(["model"], ("strategy",), {"strict": "x"})]
    assert sorted(layers) == ["lookalike", "nested", "present", "weight"]
    assert list(layers["nested"]) == ["w"]  # a required key absent too: Megatron's load says so
    # the skipped ones are in the loaded state dict as the module's own tensors, so that
    # Megatron's strict load_state_dict finds them (megatron-core 0.19.2 otherwise retried with
    # strict=False, forgiving any missing key)
    assert loaded["model"]["absent"] is own[0] and loaded["model"]["nested"]["absent"] is own[1]
    assert loaded["model"]["present"] == loaded["model"]["nested"]["w"] == "read"
    # nothing optional requested: the metadata is not read
    dist_checkpointing.load({"weight": tensor("l0.weight")}, "ckpt")
    assert metadata_reads == ["ckpt"] and len(loads) == 2


def _lr_groups(lr, min_lr, decoupled_lr, step=None):
    """Param groups as megatron-core 0.19.2's ``_get_param_groups`` builds them with the
    standard overrides (no weight decay on biases and norms; ``decoupled_lr`` for the embedding
    and output layer, whose ``min_lr`` stays ``min_lr``), ``step`` as the distributed optimizer
    saves it."""
    base = {"lr_mult": 1.0, "is_decoupled_lr": False, "is_expert_parallel": False}
    groups = [
        {**base, "wd_mult": 0.0, "max_lr": lr, "min_lr": min_lr, "default_config": True},
        {**base, "wd_mult": 1.0, "max_lr": lr, "min_lr": min_lr, "default_config": True},
        {**base, "wd_mult": 1.0, "max_lr": decoupled_lr, "min_lr": min_lr, "default_config": False},
    ]
    for i, g in enumerate(groups):
        g["params"] = [i]
        if step is not None:
            g["step"] = step
    return groups


def test_a_new_lr_loads_the_saved_param_groups_of_either_optimizer(megatron_training):
    """The checkpoint's param groups (--lr 1e-3, --decoupled-lr 2e-3) are paired with a run's
    of --lr 5e-4 --decoupled-lr 1e-3 (the checkpoint's --lr: the decoupled group is told by its
    default_config, not its values) by megatron-core's own code: the plain optimizer's
    _filter_and_reorder_param_groups and DistributedOptimizer.load_state_dict, which fail
    without the patch (ValueError / KeyError) and load the saved groups with the new LRs with it.
    A group of other values is left alone (Megatron stays strict)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    saved = types.SimpleNamespace(lr=1e-3, min_lr=1e-4, decoupled_lr=2e-3, decoupled_min_lr=None)
    args = types.SimpleNamespace(lr=5e-4, min_lr=1e-4, decoupled_lr=1e-3, decoupled_min_lr=None)
    loaded = []
    inner = types.SimpleNamespace(
        state={0: {}},  # allocated: Megatron keeps it and skips its buffers
        state_dict=lambda: {"state": {0: {}}, "param_groups": _lr_groups(5e-4, 1e-4, 1e-3)},
        load_state_dict=loaded.append,
    )
    distributed = types.SimpleNamespace(
        ddp_config=types.SimpleNamespace(use_megatron_fsdp=False),
        optimizer=inner,
        grad_scaler=None,
        config=types.SimpleNamespace(fp16=False),
    )

    def plain():
        return MegatronOptimizer._filter_and_reorder_param_groups(
            _lr_groups(5e-4, 1e-4, 1e-3), _lr_groups(1e-3, 1e-4, 2e-3)
        )

    def dist():
        groups = _lr_groups(1e-3, 1e-4, 2e-3, step=2)
        DistributedOptimizer.load_state_dict(distributed, {"optimizer": {"param_groups": groups}})
        return loaded.pop()["param_groups"]

    with pytest.raises(ValueError, match="Could not find parameter group"):
        plain()
    with pytest.raises(KeyError):
        dist()
    ctraining.load_optimizer_with_new_lr(saved, args)
    want = [(g["max_lr"], g["min_lr"]) for g in _lr_groups(5e-4, 1e-4, 1e-3)]
    assert want == [(5e-4, 1e-4), (5e-4, 1e-4), (1e-3, 1e-4)]
    assert [(g["max_lr"], g["min_lr"]) for g in plain()] == want
    groups = dist()
    assert [(g["max_lr"], g["min_lr"], g["step"]) for g in groups] == [(*w, 2) for w in want]

    other = {**_lr_groups(1e-3, 1e-4, 2e-3)[1], "max_lr": 7e-4}
    kept = ctraining.rewrite_lr_groups([dict(other)], ctraining.lr_renames(saved, args))
    assert kept == [other]
    # --decoupled-min-lr given: the decoupled groups' min_lr; same values: nothing is patched
    args.decoupled_min_lr = 2e-5
    assert ctraining.lr_renames(saved, args) == {
        (False, (1e-3, 1e-4)): (5e-4, 1e-4),
        (True, (2e-3, 1e-4)): (1e-3, 2e-5),
    }
    ctraining.begin_run()
    ctraining.load_optimizer_with_new_lr(saved, saved)
    assert not registry.patched(ctraining._RUN_GROUP)


def test_every_patch_refuses_an_untested_megatron_core(megatron_training, monkeypatch):
    """The groups and the per-run patches alike check the megatron-core version first: on an
    untested one each refuses before patching (the per-run ones are also called without the
    entry point's earlier checks); MEGATRON_LATENTMOE_ALLOW_UNTESTED_MCORE=1 warns and patches."""
    import megatron.core

    args = types.SimpleNamespace(no_load_optim=False, no_load_rng=False, ckpt_format="torch")
    applies = (
        ctraining.apply_cpu_training_compat,
        lambda: ctraining.parse_with_our_flags(lambda parser: parser),
        lambda: ctraining.exclude_from_step_time(lambda fn: fn),
        ctraining.log_each_iteration_once,
        lambda: ctraining.wrap_train_step(lambda fn: fn),
        lambda: ctraining.install_layout_change_load(args, True, lambda *a: None),
        lambda: ctraining.load_optional_checkpoint_keys((".qb_mean_input",)),
        lambda: ctraining.load_distributed_checkpoint_as_such(args),
        lambda: ctraining.load_optimizer_with_new_lr(
            types.SimpleNamespace(lr=1e-3, min_lr=0.0), types.SimpleNamespace(lr=5e-4, min_lr=0.0)
        ),
    )
    monkeypatch.delenv(registry.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(megatron.core, "__version__", "0.18.0")
    monkeypatch.setattr(sys, "argv", ["pretrain"])
    for apply in applies:
        with pytest.raises(RuntimeError, match="written for megatron-core 0.19.2, found 0.18.0"):
            apply()
    assert not any(registry.patched(group) for group in GROUPS)
    monkeypatch.setenv(registry.ALLOW_UNTESTED_ENV, "1")
    for apply in applies:
        with pytest.warns(RuntimeWarning, match="found 0.18.0"):
            apply()
    assert [len(registry.patched(group)) for group in GROUPS] == [4, 1, 10]
