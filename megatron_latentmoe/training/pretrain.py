"""Pretrain a Stable LatentMoE model with Megatron's own training loop
(``megatron.training.pretrain``).

Order of work (everything that can be wrong about the command line fails before anything heavy):

1. parse Megatron's flags plus ours (:mod:`.arguments`), check ours (the data flags':
   :mod:`.data_args`; :class:`..cli_errors.FlagError`, exit 2), run Megatron's
   ``validate_args``, build the ``StableLatentMoETransformerConfig`` (its validation too; what
   Megatron refuses, told in flags: :mod:`.megatron_refusals`);
2. without ``--data-path``: tokenize the shipped corpus once (cached) and use the shipped tokenizer;
3. ``set_global_variables`` (tokenizer, TensorBoard writer, timers);
4. on a machine without CUDA: a gloo world, Megatron's parallel groups and a CPU RNG tracker
   (``compat.cpu``), and ``megatron.training``'s CUDA walls moved aside (``compat.training``);
5. ``--load`` given (or ``--pretrained-checkpoint``, which Megatron loads where ``--load`` holds
   no checkpoint; :mod:`.resume`): a checkpoint tracker left broken by a kill is repaired
   (:mod:`.checkpoint_repair`); a damaged checkpoint, or one Megatron fails to load with this
   run's ``--ckpt-format``, is refused at step 1, one of another model shape or (legacy
   ``torch``) parallel layout here; a layout change Megatron reshards is planned;
6. ``pretrain(cfg_container, datasets, ModelType.encoder_or_decoder, forward_step)`` where
   ``cfg_container.model`` builds the model with ``build_gpt_model`` and installs the step-end
   hook (grads -> QB bias update -> balance logging); a checkpoint save that fills ``--save``'s
   disk, or meets it turned read-only, ends the run with one line
   (:func:`.file_checks.stop_if_save_disk_failed`), so does a full disk (or one the kernel
   turned read-only) under another write of the run, on each rank that hit it
   (:func:`megatron_latentmoe.files.write_disk_failure_error`); a rank whose collective fails
   because another rank stopped says so in one line, exit 1 (:func:`.console.peer_stopped_error`),
   there and in the barrier that ends the run; so does one whose process groups (step 4) could
   not be built because another rank went away (:func:`.console.startup_peer_error`).

Entry point: ``examples/pretrain_stable_latentmoe.py`` (torchrun), or ``python -m
megatron_latentmoe.training.pretrain``; both run :func:`process_main`.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial

from megatron_latentmoe.training.console import (
    PROG,
    error,
    error_once,
    peer_stopped_error,
    print0,
    rank,
    startup_peer_error,
)


def _startup_env() -> None:
    # Megatron's TP/CP code paths require it on pre-Blackwell GPUs; harmless elsewhere.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # megatron.core.package_info otherwise runs `git rev-parse` in the current directory.
    os.environ.setdefault("NO_VCS_VERSION", "1")


def main(argv: list[str] | None = None, check_only: bool = False) -> int:
    """Run pretraining; returns the process exit code (2: bad flags).

    ``argv`` (default: ``sys.argv[1:]``) replaces ``sys.argv`` for the run: Megatron reads it.
    ``check_only``: stop after the flags are checked (0: good), before any heavy work.
    """
    saved_argv = sys.argv
    if argv is not None:
        sys.argv = [saved_argv[0] if saved_argv else PROG, *argv]
    try:
        return _main(check_only)
    finally:
        sys.argv = saved_argv


def process_main(argv: list[str] | None = None, check_only: bool = False) -> int | None:
    """:func:`main` as a process's entry point (``examples/pretrain_stable_latentmoe.py``,
    ``python -m``), wrapped in torch's ``record`` (the torchrun convention;
    :func:`..compat.record.record`: torch DCP's ``CheckpointException`` too): an unexpected
    exception's traceback also goes to torchrun's error file, so that plain torchrun's table shows
    it instead of ``error_file: <N/A>``. A one-line error (:func:`.console.error`) returns its
    exit code, it does not raise: its file is left as it is; ``SystemExit`` passes unchanged
    (``record`` returns None for a ``SystemExit(0)``, ``--help``'s: ``sys.exit`` reads 0)."""
    from megatron_latentmoe.compat.record import record

    return record(main)(argv, check_only=check_only)


def checked_args(has_cuda: bool):
    """Megatron's args from ``sys.argv`` with our flags, checked and completed as a run needs
    them (the shipped corpus and tokenizer as defaults, CPU-only fusions off, Megatron's
    ``validate_args``), and the transformer config built from them.

    Returns ``(args, transformer_config, cpu_notes, default_data_dir)``; a bad flag raises
    ``FlagError``. Needs the compat shims of ``_main`` applied first.
    """
    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.compat.training import parse_with_our_flags
    from megatron_latentmoe.training.arguments import (
        add_stable_latentmoe_args,
        checkpoint_origin,
    )
    from megatron_latentmoe.training.resume import load_checkpoint_args

    args = parse_with_our_flags(add_stable_latentmoe_args)
    from_checkpoint = load_checkpoint_args(args) if args.use_checkpoint_args else set()
    try:
        return _checked(args, has_cuda)
    except FlagError as err:
        raise FlagError(checkpoint_origin(str(err), from_checkpoint)) from None


def _checked(args, has_cuda: bool):
    """``checked_args`` after parsing (and ``--use-checkpoint-args``' load)."""
    from megatron.training.arguments import validate_args

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.compat.training import apply_cpu_training_compat, cpu_training_defaults
    from megatron_latentmoe.data.corpus import (
        DEFAULT_CACHE_ORIGIN,
        default_cache_dir,
        default_dataset_name,
        default_tokenizer_dir,
    )
    from megatron_latentmoe.files import folder_refusal
    from megatron_latentmoe.training.arguments import validate_stable_latentmoe_args
    from megatron_latentmoe.training.checkpoint_repair import save_tracker_refusal
    from megatron_latentmoe.training.data_args import (
        apply_default_tokenizer,
        data_vocabulary_refusal,
        uses_default_data,
    )
    from megatron_latentmoe.training.megatron_refusals import (
        expert_layout_refusal,
        interleaved_schedule_refusal,
        megatron_refusal,
        optimizer_instances_refusal,
    )
    from megatron_latentmoe.training.model_provider import transformer_config_from_args
    from megatron_latentmoe.training.resume import (
        ckpt_step_refusal,
        format_refusal,
        load_refusal,
        loaded_arg,
        pretrained_refusal,
    )

    validate_stable_latentmoe_args(args, has_cuda=has_cuda)
    default_data_dir = None
    if uses_default_data(args):
        default_data_dir = (
            os.path.join(args.data_cache_path, "default_data")
            if args.data_cache_path
            else str(default_cache_dir())
        )
    load_arg = loaded_arg(args) or "load"  # --pretrained-checkpoint where --load holds none
    for refusal in (
        load_refusal(args, load_arg),
        pretrained_refusal(args),  # after an HF export's
        ckpt_step_refusal(args, load_arg),
        format_refusal(args, load_arg),
        folder_refusal("--save", args.save),
        save_tracker_refusal(args),
        folder_refusal("--data-cache-path", args.data_cache_path),
        None if args.data_cache_path else folder_refusal(DEFAULT_CACHE_ORIGIN, default_data_dir),
    ):
        if refusal:
            raise FlagError(refusal)
    if default_data_dir is not None:
        args.data_path = [
            os.path.join(
                default_data_dir,
                default_dataset_name(args.tokenizer_model, args.trust_remote_code),
            )
        ]
        if args.split is None:
            args.split = "98,2,0"
    if apply_default_tokenizer(args, default_tokenizer_dir()):
        print0(f"[{PROG}] tokenizer: the shipped one (HuggingFaceTokenizer {args.tokenizer_model})")
    cpu_notes = [] if has_cuda else cpu_training_defaults(args)
    if not has_cuda:
        apply_cpu_training_compat()
    refusal = expert_layout_refusal(args) or optimizer_instances_refusal(args)
    if refusal:
        raise FlagError(refusal)
    try:
        validate_args(args, {})
    except (AssertionError, ValueError, RuntimeError) as err:  # mostly bare asserts
        raise FlagError(megatron_refusal(args, err)) from None
    # the tokenizer flags are final here; the shipped corpus is made with the run's tokenizer
    refusal = None if default_data_dir is not None else data_vocabulary_refusal(args)
    if refusal:
        raise FlagError(refusal)
    config = transformer_config_from_args(args)
    # the layer pattern the model builds (--first-k-dense-replace's dense layers): Megatron's
    # FLOPs count (--log-throughput) reads it from the args, where it would say "all MoE"
    args.moe_layer_freq = config.moe_layer_freq
    refusal = interleaved_schedule_refusal(args, config.microbatch_group_size_per_vp_stage)
    if refusal:
        raise FlagError(refusal)
    return args, config, cpu_notes, default_data_dir


def _main(check_only: bool = False) -> int:
    t_start = time.time()
    _startup_env()
    from megatron_latentmoe.compat import apply_python311_compat
    from megatron_latentmoe.compat.training import (
        begin_run,
        exclude_from_step_time,
        load_distributed_checkpoint_as_such,
        load_optimizer_with_new_lr,
        load_optional_checkpoint_keys,
        log_each_iteration_once,
        on_save_error,
        wrap_train_step,
    )

    apply_python311_compat()
    import torch

    from megatron_latentmoe.compat import apply_core_compat, apply_cpu_compat
    from megatron_latentmoe.compat.tensorboard import apply_tensorboard_compat

    has_cuda = torch.cuda.is_available()
    apply_core_compat()
    if not has_cuda:
        apply_cpu_compat()
    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.data.corpus import prepare_default_dataset
    from megatron_latentmoe.data.errors import PreprocessError

    begin_run()
    try:
        args, transformer_config, cpu_notes, default_data_dir = checked_args(has_cuda)
    except FlagError as err:  # the same on every rank: said once
        error_once(str(err))
        return 2
    if check_only:
        return 0
    if cpu_notes:
        print0(f"[{PROG}] no CUDA: gloo, local spec; off on CPU: {', '.join(cpu_notes)}")
    if args.disable_jit_fuser:
        from megatron_latentmoe.ops.situ import set_cpu_compile

        set_cpu_compile(False)
        print0(
            f"[{PROG}] --disable-jit-fuser: no torch.compile for SiTU-GLU on CPU (its eager math)"
        )

    if default_data_dir is not None:
        try:
            prefix = prepare_default_dataset(
                default_data_dir,
                tokenizer=args.tokenizer_model,
                trust_remote_code=args.trust_remote_code,
            )
        except PreprocessError as err:  # e.g. a read-only file system
            error(f"the shipped corpus's dataset: {err}")
            return 2
        except OSError as err:  # a full disk: a traceback before (its writes name no file)
            from megatron_latentmoe.files import write_disk_failure_error

            line = write_disk_failure_error(
                err, [("--data-cache-path", default_data_dir)], written=True
            )
            if line is None:
                raise
            error(f"the shipped corpus's dataset: {line}")
            return 2
        tokenizer = f"{args.tokenizer_type} {args.tokenizer_model}"
        print0(f"[{PROG}] data: the shipped corpus, tokenized by {tokenizer} ({prefix}.bin/.idx)")

    from megatron.core.enums import ModelType
    from megatron.training import training as mtraining
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.global_vars import set_global_variables

    from megatron_latentmoe.convert.names import TRAINING_STATE_SUFFIXES
    from megatron_latentmoe.files import write_disk_failure_error
    from megatron_latentmoe.moe.router import NonFiniteBiasError
    from megatron_latentmoe.training import forward_step as fstep
    from megatron_latentmoe.training.balance_logging import (
        balance_step_end,
        default_jsonl_path,
        make_finalize_model_grads_func,
    )
    from megatron_latentmoe.training.checkpoint_repair import (
        AUTO_FORMAT,
        repair_checkpoint_tracker,
        repair_non_persistent_checkpoints,
        repair_save_folder,
    )
    from megatron_latentmoe.training.data_left import DataLeftError, checks_data_left
    from megatron_latentmoe.training.file_checks import (
        SaveDiskFailure,
        stop_if_save_disk_failed,
        written_folders,
    )
    from megatron_latentmoe.training.model_provider import (
        install_finalize_hook,
        model_config_from_args,
    )
    from megatron_latentmoe.training.qb_calibrate import QBCalibration, kept_bias_line
    from megatron_latentmoe.training.qb_rescore import QBRescore
    from megatron_latentmoe.training.rerun_balance import RerunBalance
    from megatron_latentmoe.training.resume import (
        activation_warning,
        ckpt_step_warning,
        fresh_routing_state,
        fresh_routing_state_warning,
        layout_changed,
        legacy_layout_refusal,
        load_flag,
        load_format,
        loaded_arg,
        loads_release,
        lr_refusal,
        optimizer_refusal,
        plan_layout_change,
        release_data_warning,
        restores_optimizer,
        resumed_by_args,
        saved_args,
        shape_refusal,
        take_checkpoint_lr,
        unused_checkpoint_schedule_warning,
    )

    apply_tensorboard_compat()  # --tensorboard-dir's writer thread: its failure said once
    set_global_variables(args)  # the padded vocabulary: checkpoint_bytes reads it
    if rank() == 0:
        from megatron_latentmoe.training.arguments import ignored_flag_warning
        from megatron_latentmoe.training.file_checks import save_space_warning

        for warning in (save_space_warning(args), ignored_flag_warning(args)):
            if warning:
                print(f"[{PROG}] WARNING: {warning}", flush=True)
    model_cfg = model_config_from_args(args, transformer_config)
    cfg_container = pretrain_cfg_container_from_args(args, model_cfg)

    if not has_cuda:
        if not _started_cpu_world(args):
            return 1
    if load_format(args) == AUTO_FORMAT and args.ckpt_format != "torch_dist":
        load_distributed_checkpoint_as_such(args)
    if args.load and rank() == 0:
        repair_checkpoint_tracker(args.load, load_format(args))
        repair_non_persistent_checkpoints(args)
    if rank() == 0:
        repair_save_folder(args)
    load_arg = loaded_arg(args)  # --pretrained-checkpoint where --load holds none (repaired)
    optional_keys = ()  # checkpoint keys loaded where the checkpoint holds them
    if load_arg:
        warning = ckpt_step_warning(args, load_arg)
        if warning:
            print0(f"[{PROG}] WARNING: {warning}")
        path = resumed_by_args(args, load_arg)
        saved = saved_args(path)
        # megatron-core 0.19.2 loads the model alone, from iteration 0, where it fine-tunes (it
        # sets --finetune for --pretrained-checkpoint) and from a release checkpoint
        model_only = args.finetune or load_arg != "load" or loads_release(path)
        load_dir, flag = getattr(args, load_arg), load_flag(load_arg)
        refusal = (
            shape_refusal(load_dir, args, saved, flag)
            or legacy_layout_refusal(args, saved, path, load_arg)
            or (None if model_only else optimizer_refusal(args, saved, load_dir, flag))
            or (None if model_only else lr_refusal(args, saved, load_dir, flag))
        )
        if refusal:
            error(refusal)
            return 2
        for warning in (
            release_data_warning(args, saved, path, load_arg),
            fresh_routing_state_warning(args, saved, load_dir, flag, resumed=not model_only),
            activation_warning(args, saved, load_dir, flag),
            unused_checkpoint_schedule_warning(args, saved, model_only),
        ):
            if warning:
                print0(f"[{PROG}] WARNING: {warning}")
        optional_keys = fresh_routing_state(args, saved)
        # another LR than the checkpoint's: lr_refusal has required --override-opt_param-scheduler
        # (this run's values, loaded) or --use-checkpoint-opt_param-scheduler (the checkpoint's)
        if not model_only and restores_optimizer(args, saved):
            warning = take_checkpoint_lr(args, saved)
            if warning:
                print0(f"[{PROG}] WARNING: {warning}")
            load_optimizer_with_new_lr(saved, args)
        restores = not model_only and not (args.no_load_optim and args.no_load_rng)
        if restores and saved is not None and layout_changed(args, saved):
            plan_layout_change(args, saved)

    jsonl_path = default_jsonl_path(args)
    balance_logger = _make_balance_logger(args, jsonl_path)
    fstep.set_balance_logger(balance_logger)
    rescore = None
    if args.moe_qb_rescore_iters:
        rescore = QBRescore(
            args.moe_qb_rescore_iters,
            partial(balance_step_end, balance_logger=balance_logger),
            solves=args.moe_qb_rescore_solves,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.decoder_seq_length,
        )
        wrap_train_step(rescore.wrap_train_step)
        optional_keys += TRAINING_STATE_SUFFIXES
    wrap_train_step(RerunBalance(balance_logger).wrap_train_step)  # outside the rescoring
    if optional_keys:
        load_optional_checkpoint_keys(optional_keys)
    fstep.set_batch_recorder(rescore)
    install_finalize_hook(make_finalize_model_grads_func(balance_logger, rescore))
    exclude_from_step_time(balance_logger.excluded)
    log_each_iteration_once()
    if args.save:
        on_save_error(partial(stop_if_save_disk_failed, args))
    datasets_provider = checks_data_left(fstep.train_valid_test_datasets_provider)
    if args.moe_qb_calibrate_batches:
        calibration = QBCalibration(
            args.moe_qb_calibrate_batches,
            train_iters=args.train_iters,
            global_batch_size=args.global_batch_size,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.decoder_seq_length,
            log=lambda line: print(line, flush=True),
            kept_bias=kept_bias_line(args, saved, path, load_arg) if load_arg else None,
        )
        datasets_provider = calibration.wrap_datasets_provider(datasets_provider)
        wrap_train_step(calibration.wrap_train_step)  # outermost: before a rescored first step

    try:
        mtraining.pretrain(
            cfg_container,
            datasets_provider,
            ModelType.encoder_or_decoder,
            fstep.forward_step,
        )
    except SystemExit:  # Megatron's early exits (--exit-interval, --exit-duration-in-mins, the
        # signal handler), after their save: sys.exit inside pretrain skipped the summary
        _print_summary(balance_logger)
        raise
    except SaveDiskFailure:  # rank 0 has said so
        return 2
    except DataLeftError as err:  # every rank alike: said once
        error_once(str(err))
        return 2
    except fstep.OutOfVocabularyError as err:  # a batch's token id (get_batch)
        error(str(err))
        return 2
    except NonFiniteBiasError as err:  # a loaded router bias: each rank of its stage
        error(f"{flag} {path}: {err}" if load_arg else str(err))
        return 2
    except AssertionError as err:
        if not str(err).startswith("OptimizerParamScheduler:"):
            raise
        # Megatron's check on load (every rank hits it identically): say what to do about it.
        error_once(
            "the checkpoint's LR / weight-decay schedule differs from this run's "
            f"flags ({err}). Pass --override-opt_param-scheduler to continue with this run's "
            "schedule (e.g. a longer --train-iters), or --use-checkpoint-opt_param-scheduler to "
            "keep the checkpoint's."
        )
        return 2
    except Exception as err:
        if _said_peer_stopped(err):
            return 1
        # a full disk outside a save: the balance JSONL, TensorBoard, the dataset index cache
        # (megatron-core 0.19.2 raises a bare Exception from numpy's OSError there)
        line = write_disk_failure_error(err, written_folders(args, jsonl_path))
        if line is None:
            raise
        error(line)  # each rank that hit it
        return 2

    _print_summary(balance_logger)
    print0(f"[{PROG}] done in {time.time() - t_start:.1f} s")
    return _end_world()


def _print_summary(balance_logger) -> None:
    """The balance summary of the iterations trained, on the rank that logs them."""
    if balance_logger.is_logging_rank and balance_logger.history:
        from megatron_latentmoe.training.balance_summary import summarize, summary_lines

        lines = summary_lines(summarize(balance_logger.history))
        print("\n".join([f"[{PROG}] summary: {lines[0]}", *lines[1:]]), flush=True)


def _started_cpu_world(args) -> bool:
    """The gloo world and Megatron's parallel groups (``compat.training.init_cpu_world``); False
    where another rank went away while they were built, or never joined them: said in one line
    (:func:`.console.startup_peer_error`, measured: a gloo or store traceback before), and the
    caller exits 1, as for a peer stopped later (:func:`_said_peer_stopped`)."""
    from megatron_latentmoe.compat.training import init_cpu_world

    try:
        init_cpu_world(args)
    except RuntimeError as err:
        line = startup_peer_error(err)
        if line is None:
            raise
        error(line, after_peer=True)
        return False
    return True


def _end_world() -> int:
    """The run's last barrier and the end of its process group: 0, or 1 where another rank
    stopped before it (killed at the end, after the last collective of ``pretrain``: this rank
    waits for it here; measured, a gloo traceback from this barrier before)."""
    import torch

    if torch.distributed.is_initialized():
        try:
            torch.distributed.barrier()
        except RuntimeError as err:
            if _said_peer_stopped(err):
                return 1
            raise
        torch.distributed.destroy_process_group()
    return 0


def _said_peer_stopped(err: BaseException) -> bool:
    """Print the one line where ``err`` is a collective that failed because another rank
    stopped (:func:`.console.peer_stopped_error`); the caller then exits 1, not 2: nothing is to
    be fixed on this rank, and the launcher names the rank that stopped."""
    line = peer_stopped_error(err)
    if line:
        error(line, after_peer=True)
    return line is not None


def _make_balance_logger(args, jsonl_path):
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size
    from megatron.training import get_args, get_tensorboard_writer, get_wandb_writer

    from megatron_latentmoe.training.balance_logging import BalanceLogger

    if jsonl_path and rank() == int(os.environ.get("WORLD_SIZE", "1")) - 1:
        os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
    return BalanceLogger(
        num_layers=args.num_layers,
        num_experts=args.num_experts,
        # the step's own batch: --step-batch-size-schedule changes it during the run
        tokens_per_step=lambda: get_current_global_batch_size() * args.seq_length,
        iteration_fn=lambda: get_args().curr_iteration + 1,
        log_interval=args.log_interval,
        tensorboard_log_interval=args.tensorboard_log_interval,
        loads_interval=args.balance_log_loads_interval,
        jsonl_path=jsonl_path,
        writer_fn=get_tensorboard_writer,
        wandb_writer_fn=get_wandb_writer,
        per_layer_tensorboard=args.moe_per_layer_logging,
        dp_group=lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
        pp_group=parallel_state.get_pipeline_model_parallel_group,
        is_last_stage=parallel_state.is_pipeline_last_stage,
    )


if __name__ == "__main__":
    sys.exit(process_main())
