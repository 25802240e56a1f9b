"""``megatron.training`` (megatron-core 0.19.2 wheel) patches of the training entry point.

Every rebinding goes through :mod:`.registry` (version-checked, revertible):

* :func:`cpu_training_defaults`: flags that need CUDA kernels, switched off on CPU (no patch);
* :func:`apply_cpu_training_compat`: ``initialize_megatron`` gets ``allow_no_cuda``, the CUDA
  fusion warm-up is skipped, ``validate_args``' GPU-architecture query answers 0, building the
  data iterators keeps the CPU generator's state;
* :func:`init_cpu_world`: what ``initialize_megatron`` skips without a GPU (gloo world, parallel
  groups, seeded RNG tracker);
* :func:`parse_with_our_flags`: every parse of the command line includes our flags;
* per run (:func:`begin_run` reverts the previous run's): :func:`exclude_from_step_time`,
  :func:`log_each_iteration_once`, :func:`wrap_train_step`, :func:`install_layout_change_load`,
  :func:`load_optional_checkpoint_keys`, :func:`load_distributed_checkpoint_as_such`,
  :func:`load_optimizer_with_new_lr` and :func:`on_save_error`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta

from . import registry

_CPU_GROUP, _FLAGS_GROUP, _RUN_GROUP = "training-cpu", "training-flags", "training-run"


def cpu_training_defaults(args, argv: list[str] | None = None) -> list[str]:
    """Flags that only work with CUDA kernels: switched off on CPU (returns the notes).

    Megatron's default ``--rerun-mode validate_results`` becomes ``disabled`` unless ``argv``
    (default: ``sys.argv[1:]``) names ``--rerun-mode``: the state machine runs on CPU (its RNG
    and device calls go through compat/cpu.py), but by default a CPU run's NaN / Inf loss
    stops the run at once rather than re-running the iteration."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    notes = []
    for name, value in (
        ("bias_dropout_fusion", False),  # torch.compile'd fused kernels: a C++ build on CPU
        ("bias_swiglu_fusion", False),
        ("masked_softmax_fusion", False),
        ("apply_rope_fusion", False),
        ("gradient_accumulation_fusion", False),  # needs apex/TE CUDA kernels
        ("cross_entropy_loss_fusion", False),
    ):
        if getattr(args, name, value) != value:
            setattr(args, name, value)
            notes.append(name)
    given = any(a == "--rerun-mode" or a.startswith("--rerun-mode=") for a in argv)
    if args.rerun_mode != "disabled" and not given:
        args.rerun_mode = "disabled"
        notes.append("rerun_mode=disabled")
    return notes


def _shim_cpu_training() -> None:
    import megatron.training.arguments as margs
    import megatron.training.training as mtraining

    original = mtraining.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*a, **kw):
        kw["allow_no_cuda"] = True
        return original(*a, **kw)

    registry.patch(_CPU_GROUP, mtraining, "initialize_megatron", initialize_megatron)

    import torch

    build_iterators = mtraining.build_train_valid_test_data_iterators

    @functools.wraps(build_iterators)
    def build_train_valid_test_data_iterators(*a, **kw):
        state = torch.get_rng_state()
        try:
            return build_iterators(*a, **kw)
        finally:
            torch.set_rng_state(state)

    registry.patch(
        _CPU_GROUP,
        mtraining,
        "build_train_valid_test_data_iterators",
        build_train_valid_test_data_iterators,
    )
    registry.patch(_CPU_GROUP, mtraining, "set_jit_fusion_options", lambda *a, **kw: None)
    registry.patch(_CPU_GROUP, margs, "get_device_arch_version", lambda: 0)


def apply_cpu_training_compat() -> None:
    """``megatron.training`` walls on a machine without CUDA (idempotent).

    * ``pretrain`` calls ``initialize_megatron()`` without ``allow_no_cuda``: pass it.
    * ``set_jit_fusion_options`` warms torch.compile'd CUDA fusions up with ``device="cuda"``
      tensors: nothing to warm on CPU (:func:`cpu_training_defaults` switches the fusions off).
    * ``validate_args`` asks the GPU architecture for TP/CP > 1: report "pre-Blackwell" (0), so
      Megatron applies its CUDA_DEVICE_MAX_CONNECTIONS=1 rule (the entry point sets it).
    * ``build_train_valid_test_data_iterators`` leaves the CPU generator as it found it: it runs
      after the checkpoint's RNG state is loaded, and each ``iter(DataLoader)`` draws its base
      seed from that generator (workers or not), which on CPU is also the "CUDA" one the
      dropouts draw from (:mod:`.cpu`): a run resumed with ``--hidden-dropout 0.1`` started
      iteration 3 from another state than the uninterrupted run (loss 8.211238 against 8.209346,
      tiny.sh on one rank, resumed at 2). On a GPU the dropouts draw from the CUDA generator.
    """
    registry.apply_group(_CPU_GROUP, [_shim_cpu_training])


def init_cpu_world(args) -> None:
    """gloo process group, Megatron parallel groups and the CPU RNG tracker, seeded once like
    ``megatron.training.initialize._set_random_seed`` seeds the CUDA one."""
    import torch

    from .cpu import initialize_parallel_cpu

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="gloo",
            rank=args.rank,
            world_size=args.world_size,
            timeout=timedelta(minutes=args.distributed_timeout_minutes),
        )
    initialize_parallel_cpu(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        context_parallel_size=args.context_parallel_size,
        seed=args.seed,
        data_parallel_random_init=args.data_parallel_random_init,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        order="tp-cp-ep-dp-pp" if not args.use_tp_pp_dp_mapping else "tp-cp-ep-pp-dp",
        create_gloo_process_groups=args.use_gloo_process_groups,
    )


def parse_with_our_flags(add_args: Callable):
    """Parse ``sys.argv`` with Megatron's parser plus ``add_args(parser)``.

    ``pretrain`` re-parses the command line on its own (``ft_integration.setup``; in-process
    restart) with Megatron's bare parser, which would reject our flags: Megatron's
    ``parse_args`` is wrapped (once per process) so that every parse includes them.
    """
    import megatron.training.arguments as margs

    def shim() -> None:
        original = margs.parse_args

        @functools.wraps(original)
        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            def provider(parser):
                parser = add_args(parser)
                return extra_args_provider(parser) if extra_args_provider else parser

            return original(provider, ignore_unknown_args)

        registry.patch(_FLAGS_GROUP, margs, "parse_args", parse_args)

    registry.apply_group(_FLAGS_GROUP, [shim])
    return margs.parse_args()


def _patch_run(owner: object, name: str, value: object) -> None:
    """A per-run patch: version-checked like the groups (:func:`.registry.apply_group`), which
    the per-run patches do not go through (each run adds to the group), then recorded."""
    registry.check_megatron_core_version()
    registry.patch(_RUN_GROUP, owner, name, value)


def begin_run() -> None:
    """Drop the per-run patches of a previous run in this process (``main`` called again)."""
    registry.revert(_RUN_GROUP)


def exclude_from_step_time(wrap: Callable[[Callable], Callable]) -> None:
    """``megatron.training.training``'s checkpoint save and evaluation run inside ``wrap`` (the
    balance logger's timer: tokens/s of a step must not include them)."""
    import megatron.training.training as mtraining

    for name in ("save_checkpoint_and_time", "evaluate_and_print_results"):
        _patch_run(mtraining, name, wrap(getattr(mtraining, name)))


def log_each_iteration_once() -> None:
    """``megatron.training.training.training_log`` resets its interval sums (losses, iteration
    counts, the interval timer) after a run's first iteration where that iteration ends a
    ``--log-interval`` (Megatron-LM's fix of NVIDIA/Megatron-LM#6237, PR 7092, after 0.19.2).
    megatron-core 0.19.2 prints every run's first iteration and never resets there, so the next
    printed line averaged that iteration in: with ``--log-interval 1`` every run's second line,
    a fresh run's iteration 2 and a run resumed at 2 its iteration 4 (measured, tiny.sh on one
    rank: "lm loss: 8.133631E+00", the mean of iterations 3 and 4, where the uninterrupted run
    and the balance JSONL have 8.076569E+00). A first iteration inside an interval still stays
    in it. Here that iteration is logged as a regular one, so with
    ``--log-timers-to-tensorboard`` its iteration time goes to TensorBoard too."""
    import megatron.training.training as mtraining

    original = mtraining.training_log

    @functools.wraps(original)
    def training_log(loss_dict, total_loss_dict, lr, iteration, *a, is_first_iteration=False, **kw):
        if iteration % mtraining.get_args().log_interval == 0:
            is_first_iteration = False
        return original(
            loss_dict,
            total_loss_dict,
            lr,
            iteration,
            *a,
            is_first_iteration=is_first_iteration,
            **kw,
        )

    _patch_run(mtraining, "training_log", training_log)


def on_save_error(handle: Callable[[BaseException, int], None]) -> None:
    """``megatron.training.training.save_checkpoint`` (the name ``save_checkpoint_and_time`` and
    ``pretrain``'s own saves call): an exception out of a persistent (``--save``) checkpoint's
    save goes to ``handle(error, iteration)`` first, which may raise its own; if it returns, the
    error is re-raised as it was. ``BaseException``: torch DCP's ``CheckpointException`` is one."""
    import megatron.training.training as mtraining

    original = mtraining.save_checkpoint

    @functools.wraps(original)
    def save_checkpoint(iteration, *a, **kw):
        try:
            return original(iteration, *a, **kw)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:
            if not kw.get("non_persistent_ckpt", False):
                handle(err, iteration)
            raise

    _patch_run(mtraining, "save_checkpoint", save_checkpoint)


def wrap_train_step(wrap: Callable[[Callable], Callable]) -> None:
    """``megatron.training.training.train_step`` becomes ``wrap(train_step)`` (QB rescoring runs
    its forward-only pass after the optimizer step: ``training/qb_rescore.py``)."""
    import megatron.training.training as mtraining

    _patch_run(mtraining, "train_step", wrap(mtraining.train_step))


def install_layout_change_load(args, load_optim: bool, on_load: Callable) -> None:
    """``megatron.training.training.load_checkpoint`` for a checkpoint of another parallel layout.

    Megatron reshards the model (and with it the QB ``router.expert_bias``) itself. Its RNG
    state is per (PP, TP, DP) rank and is not loaded (``--no-load-rng``); the optimizer and
    scheduler state only if ``load_optim`` (the caller knows where megatron-core can reshard
    it). ``on_load(iteration, opt_param_scheduler)`` runs after the load (the entry point's
    announcement; the LR schedule where the scheduler state was not loaded).
    """
    import megatron.training.training as mtraining

    original = mtraining.load_checkpoint
    explicit_optim, explicit_rng = args.no_load_optim, args.no_load_rng

    def load_checkpoint(model, optimizer, opt_param_scheduler, *a, **kw):
        args.no_load_optim, args.no_load_rng = explicit_optim or not load_optim, True
        try:
            iteration, flops = original(model, optimizer, opt_param_scheduler, *a, **kw)
        finally:
            args.no_load_optim, args.no_load_rng = explicit_optim, explicit_rng
        on_load(iteration, opt_param_scheduler)
        return iteration, flops

    _patch_run(mtraining, "load_checkpoint", load_checkpoint)


def load_distributed_checkpoint_as_such(args) -> None:
    """``--auto-detect-ckpt-format`` with another ``--ckpt-format`` (``torch``): a distributed
    (``torch_dist``) checkpoint is loaded as one, and the run saves in its own format.

    megatron-core 0.19.2's ``load_checkpoint`` detects the folder's format, then builds the state
    dict it loads into from ``args.ckpt_format``, the run's: a plain one, which
    ``dist_checkpointing.load`` fills with nothing, and the load fails with ``KeyError: 'model'``.
    Here ``args.ckpt_format`` is ``torch_dist`` from the detection (its first
    ``_load_base_checkpoint``, rank 0's common state) to the end of the load, the run's again
    afterwards, after a failed load too. A legacy (``torch``) checkpoint Megatron loads as it is.
    """
    import megatron.training.checkpointing as checkpointing
    import megatron.training.training as mtraining

    original_load, original_base = mtraining.load_checkpoint, checkpointing._load_base_checkpoint
    requested = args.ckpt_format
    distributed = (checkpointing.CheckpointType.GLOBAL, checkpointing.CheckpointType.LOCAL)
    loading = []

    def _load_base_checkpoint(*a, **kw):
        result = original_base(*a, **kw)
        if loading and result[3] in distributed:
            args.ckpt_format = "torch_dist"
        return result

    def load_checkpoint(*a, **kw):
        loading.append(True)
        try:
            return original_load(*a, **kw)
        finally:
            loading.clear()
            args.ckpt_format = requested

    _patch_run(checkpointing, "_load_base_checkpoint", _load_base_checkpoint)
    _patch_run(mtraining, "load_checkpoint", load_checkpoint)


def load_optional_checkpoint_keys(suffixes: tuple[str, ...]) -> None:
    """``megatron.core.dist_checkpointing.load`` skips a requested tensor whose checkpoint key ends
    with one of ``suffixes`` when the checkpoint does not hold it (state added to the model
    after the checkpoint was written: QB rescoring's ``router.qb_mean_input``; a router buffer of
    another balancer than the checkpoint's, :func:`..training.resume.fresh_routing_state`).
    Megatron would fail the load (a ``KeyError`` naming the key, on every rank); the module keeps
    its value: the loaded state dict gets the module's own tensor under that key, so Megatron's
    strict ``load_state_dict`` finds it (missing, it failed and megatron-core 0.19.2 retried with
    ``strict=False``, printing "load_return: None" and forgiving every missing key). Every other
    key is loaded as strictly as before."""
    import megatron.core.dist_checkpointing as dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    original = dist_checkpointing.load

    def optional(value) -> bool:
        return isinstance(value, ShardedTensor) and value.key.endswith(suffixes)

    def drop_absent(tree, present, path=()) -> list:
        """Remove the absent optional tensors; return each one's (path, the module's tensor)."""
        dropped = []
        for name, value in list(tree.items()):
            if isinstance(value, dict):
                dropped += drop_absent(value, present, (*path, name))
            elif optional(value) and value.key not in present:
                del tree[name]
                dropped.append(((*path, name), value.data))
        return dropped

    def has_optional(tree) -> bool:
        return any(has_optional(v) if isinstance(v, dict) else optional(v) for v in tree.values())

    @functools.wraps(original)
    def load(sharded_state_dict, checkpoint_dir, *a, **kw):
        dropped = []
        if has_optional(sharded_state_dict):
            dropped = drop_absent(
                sharded_state_dict, set(dist_checkpointing.load_tensors_metadata(checkpoint_dir))
            )
        loaded = original(sharded_state_dict, checkpoint_dir, *a, **kw)
        state = loaded[0] if isinstance(loaded, tuple) else loaded
        for path, data in dropped:
            tree = state
            for name in path[:-1]:
                tree = tree.setdefault(name, {})
            tree[path[-1]] = data
        return loaded

    _patch_run(dist_checkpointing, "load", load)


def lr_group_values(a) -> dict[bool, tuple[float, float]]:
    """The (``max_lr``, ``min_lr``) megatron-core 0.19.2 gives the optimizer's param groups of a
    run with the args ``a``, by whether a group is decoupled (True: embedding and output layer):
    ``_get_param_groups`` fills every group with ``--lr`` / ``--min-lr``, and
    ``get_standard_config_overrides`` overrides the decoupled ones' ``max_lr`` with
    ``--decoupled-lr`` and their ``min_lr`` with ``--decoupled-min-lr`` where given (else they
    keep ``--min-lr``); with ``--decoupled-lr`` None no group is decoupled."""
    values = {False: (a.lr, a.min_lr)}
    if getattr(a, "decoupled_lr", None) is not None:
        decoupled_min = getattr(a, "decoupled_min_lr", None)
        values[True] = (a.decoupled_lr, a.min_lr if decoupled_min is None else decoupled_min)
    return values


def _decoupled(group: dict) -> bool:
    """A saved param group of the decoupled LR. megatron-core 0.19.2 sets ``is_decoupled_lr``
    False in every group (its ``_get_param_groups``); a decoupled group is the one whose override
    sets ``max_lr``, which makes its ``default_config`` False (the standard overrides set no other
    LR; measured: tiny.sh, 1 rank, --decoupled-lr 2e-3 -> 1e-3 with --lr 1e-3 -> 5e-4 loads and
    trains)."""
    return bool(group.get("is_decoupled_lr")) or group.get("default_config") is False


def rewrite_lr_groups(groups: list[dict], renames: dict) -> list[dict]:
    """Rewrite (in place, and return) the saved param groups whose (decoupled, (``max_lr``,
    ``min_lr``)) is a key of ``renames`` with its value's (``max_lr``, ``min_lr``); any other
    group is left as it is (Megatron's matching then judges it as strictly as before)."""
    for group in groups:
        new = renames.get((_decoupled(group), (group.get("max_lr"), group.get("min_lr"))))
        if new is not None:
            group["max_lr"], group["min_lr"] = new
    return groups


def lr_renames(saved, args) -> dict:
    """(decoupled, checkpoint's (max_lr, min_lr)) -> this run's, for the kinds of group both runs
    have (:func:`lr_group_values` of the checkpoint's args ``saved`` and of ``args``) and whose
    values differ."""
    before, now = lr_group_values(saved), lr_group_values(args)
    return {
        (kind, old): now[kind] for kind, old in before.items() if kind in now and now[kind] != old
    }


def load_optimizer_with_new_lr(saved, args) -> None:
    """The optimizer state of a checkpoint saved with another ``--lr`` / ``--min-lr`` /
    ``--decoupled-lr`` / ``--decoupled-min-lr`` (its args ``saved``) loads into this run (its
    ``args``), the Adam moments with it.

    megatron-core 0.19.2 pairs each saved param group with this run's by
    ``param_group_identifier_keys``, ``max_lr`` and ``min_lr`` among them, so the load failed:
    "ValueError: Could not find parameter group with key ..." (the plain optimizer,
    ``MegatronOptimizer._filter_and_reorder_param_groups``) or "KeyError: (...)" (the distributed
    one: ``DistributedOptimizer.load_state_dict`` pairs them itself, for each of its checkpoint
    formats, ``fully_reshardable`` included; ``torch_dist`` and legacy ``torch`` checkpoints both
    come through it). Here the saved groups' ``max_lr`` / ``min_lr`` are rewritten from the
    checkpoint's values to this run's (:func:`lr_renames`) before either pairs them; every other
    key is matched as strictly as before. The LR schedule's own values are checked by
    ``OptimizerParamScheduler.load_state_dict`` (``--override-opt_param-scheduler``, which the
    entry point requires for such a load). A call with nothing to rename patches nothing."""
    renames = lr_renames(saved, args)
    if not renames:
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    original_filter = MegatronOptimizer._filter_and_reorder_param_groups
    original_load = DistributedOptimizer.load_state_dict

    def _filter_and_reorder_param_groups(current_groups, state_dict_groups):
        return original_filter(current_groups, rewrite_lr_groups(state_dict_groups, renames))

    @functools.wraps(original_load)
    def load_state_dict(self, state_dict):
        optimizer = state_dict.get("optimizer") if isinstance(state_dict, dict) else None
        if isinstance(optimizer, dict) and isinstance(optimizer.get("param_groups"), list):
            rewrite_lr_groups(optimizer["param_groups"], renames)
        return original_load(self, state_dict)

    _patch_run(
        MegatronOptimizer,
        "_filter_and_reorder_param_groups",
        staticmethod(_filter_and_reorder_param_groups),
    )
    _patch_run(DistributedOptimizer, "load_state_dict", load_state_dict)
