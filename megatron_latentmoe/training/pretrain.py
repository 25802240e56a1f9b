"""Pretrain a Stable LatentMoE model with Megatron's own training loop
(``megatron.training.pretrain``).

Order of work (everything that can be wrong about the command line fails before anything heavy):

1. parse Megatron's flags plus ours (:mod:`.arguments`), check ours (:class:`FlagError`, exit 2),
   run Megatron's ``validate_args``, build the ``StableLatentMoETransformerConfig`` (its
   validation too);
2. without ``--data-path``: tokenize the shipped corpus once (cached) and use the shipped tokenizer;
3. ``set_global_variables`` (tokenizer, TensorBoard writer, timers);
4. on a machine without CUDA: a gloo world, Megatron's parallel groups and a CPU RNG tracker
   (``compat.cpu``), and ``megatron.training``'s CUDA walls moved aside (``compat.training``);
5. ``--load`` given: a checkpoint tracker left broken by a kill is repaired
   (:func:`repair_checkpoint_tracker`); a damaged checkpoint, or one Megatron fails to load
   with this run's ``--ckpt-format`` (:func:`format_refusal`), is refused at step 1, one of
   another model shape here (:mod:`.file_checks`);
6. ``pretrain(cfg_container, datasets, ModelType.encoder_or_decoder, forward_step)`` where
   ``cfg_container.model`` builds the model with ``build_gpt_model`` and installs the step-end
   hook (grads -> QB bias update -> balance logging); a checkpoint save that fills ``--save``'s
   disk ends the run with one line (:func:`_stop_if_disk_full`).

Entry point: ``examples/pretrain_stable_latentmoe.py`` (torchrun), or ``python -m
megatron_latentmoe.training.pretrain``.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial

from megatron_latentmoe.checkpoint_layout import (
    RELEASE,
    TRACKER_FILE,
    iteration_dir_name,
    iteration_of_dir_name,
    tracked_checkpoint_dir,
)

PROG = "pretrain_stable_latentmoe"


def _startup_env() -> None:
    # Megatron's TP/CP code paths require it on pre-Blackwell GPUs; harmless elsewhere.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # megatron.core.package_info otherwise runs `git rev-parse` in the current directory.
    os.environ.setdefault("NO_VCS_VERSION", "1")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _print0(*parts) -> None:
    if _rank() == 0:
        print(*parts, flush=True)


# ------------------------------------------------------------------------------------ checkpoints
AUTO_FORMAT = "auto"
"""The ``ckpt_format`` of a run with ``--auto-detect-ckpt-format``: each folder's own."""


def load_format(args) -> str:
    """The checkpoint format ``--load`` reads: ``--ckpt-format``, or each folder's own with
    ``--auto-detect-ckpt-format`` (:data:`AUTO_FORMAT`)."""
    return AUTO_FORMAT if getattr(args, "auto_detect_ckpt_format", False) else args.ckpt_format


def _complete_checkpoint(path: str, ckpt_format: str) -> bool:
    """A checkpoint folder a run can load: Megatron's distributed checkpoint (``torch_dist``)
    writes ``metadata.json`` after everything else (torch DCP's ``.metadata`` just before it);
    ``torch_dcp`` and ``fsdp_dtensor`` are torch DCP's ``save`` alone, ``.metadata`` last and no
    ``metadata.json`` (with one, Megatron's ``_get_checkpoint_format`` takes it for torch_dist).
    :data:`AUTO_FORMAT`: a legacy ``torch`` folder by :func:`checkpoint_format` (as Megatron
    tells them apart), any other needs torch DCP's ``.metadata``."""
    if ckpt_format == AUTO_FORMAT:
        if not os.path.isdir(path):
            return False
        ckpt_format = "torch" if checkpoint_format(path) == "torch" else "torch_dcp"
    if ckpt_format == "torch_dist":
        return os.path.isfile(os.path.join(path, "metadata.json")) and os.path.isfile(
            os.path.join(path, ".metadata")
        )
    if ckpt_format in ("torch_dcp", "fsdp_dtensor"):
        return os.path.isfile(os.path.join(path, ".metadata"))
    return os.path.isdir(path) and any(os.scandir(path))


def repair_checkpoint_tracker(
    load_dir: str, ckpt_format: str = "torch_dist", *, write: bool = True
) -> int | None:
    """Make ``latest_checkpointed_iteration.txt`` name the newest COMPLETE checkpoint.

    Megatron writes the tracker only after every rank finished a save, so a kill during a save
    leaves it at the previous checkpoint (what we want). A kill while the tracker itself is
    written can leave it empty or cut; then (or if it names a folder that is not complete) the
    newest complete ``iter_*`` folder is written there, atomically. Returns the iteration the
    tracker names afterwards, or None if there is nothing to resume from. ``write=False`` only
    answers that question.
    """
    if not load_dir or not os.path.isdir(load_dir):
        return None
    tracker = os.path.join(load_dir, TRACKER_FILE)
    named = None
    if os.path.isfile(tracker):
        try:
            text = open(tracker).read().strip()
        except (OSError, UnicodeDecodeError):  # unreadable or not text: repaired below
            text = ""
        if text == RELEASE:
            return None
        if text.isdecimal():  # isdigit() takes "²", which int() refuses
            named = int(text)
    complete = sorted(
        iteration
        for entry in os.listdir(load_dir)
        if (iteration := iteration_of_dir_name(entry)) is not None
        and _complete_checkpoint(os.path.join(load_dir, entry), ckpt_format)
    )
    if named is not None and named in complete:
        return named
    if not complete:
        return None
    best = (
        complete[-1] if named is None else max([i for i in complete if i <= named] or complete[-1:])
    )
    if not write:
        return best
    tmp = f"{tracker}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(best))
    os.replace(tmp, tracker)
    print(
        f"[{PROG}] {tracker} named {named if named is not None else 'nothing readable'}; "
        f"resuming from the newest complete checkpoint, iteration {best}",
        flush=True,
    )
    return best


LAYOUT_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "context_parallel_size",
    "data_parallel_size",
)


def _layout_changed(args, saved) -> bool:
    """The checkpoint (``saved``: its args) was saved with a parallel layout that Megatron does
    not load as it is. A change of the data-parallel size alone it does: the model, the optimizer
    state (plain or distributed) and the RNG state load, and the losses after DP2 -> DP1,
    DP1 -> DP2 (either optimizer) and EP2 x DP4 -> EP2 x DP2 equal the uninterrupted run's to
    fp32 rounding. Not with ``--data-parallel-random-init``: each DP rank has its own RNG state."""
    fields = [
        f
        for f in LAYOUT_FIELDS
        if f != "data_parallel_size" or getattr(args, "data_parallel_random_init", False)
    ]
    return any(getattr(saved, f, None) not in (None, getattr(args, f, None)) for f in fields)


def legacy_layout_refusal(args, saved, non_persistent: str | None = None) -> str | None:
    """One line when the checkpoint ``--load`` resumes from (its args ``saved``; see
    :func:`resumed_checkpoint` for ``non_persistent``) is a legacy
    ``torch`` one of another tensor / pipeline / expert layout: megatron-core 0.19.2 keeps one
    file per (TP, PP, EP) rank of that layout and does not reshard it; it looked for this run's
    rank files, printed "could not load the checkpoint" and exited 0 on every rank, having
    trained nothing (EP1 -> EP2, measured). Its distributed (``torch_dist``) checkpoint does
    reshard: the line says how to get one."""
    if saved is None:
        return None
    from megatron_latentmoe.training.arguments import flag_for_field

    differ = [
        f"{flag_for_field(f)} {getattr(saved, f)} (this run: {getattr(args, f)})"
        for f in LAYOUT_FIELDS[:4]
        if getattr(saved, f, None) not in (None, getattr(args, f, None))
    ]
    path = differ and resumed_checkpoint(
        args.load, load_format(args), non_persistent=non_persistent
    )
    if checkpoint_format(path or None) != "torch":
        return None
    return (
        f"--load {args.load}: {path} is a legacy torch checkpoint of another parallel layout: "
        f"{', '.join(differ)}; megatron-core 0.19.2 loads one only in the layout it was saved "
        "with. Resume once in that layout with --ckpt-format torch_dist "
        "--auto-detect-ckpt-format (it then saves a torch_dist checkpoint, which loads into "
        "another layout), or pass that layout"
    )


def format_refusal(args, non_persistent: str | None = None) -> str | None:
    """One line when the checkpoint ``--load`` resumes from (see :func:`resumed_checkpoint` for
    ``non_persistent``; where no folder is complete by this run's format, the one the tracker
    names, which Megatron loads as it is) is of a format megatron-core 0.19.2 fails to load with
    this run's ``--ckpt-format``, with a traceback on every rank (measured with one rank):

    - ``torch_dist`` with ``--ckpt-format torch`` without ``--auto-detect-ckpt-format``:
      "RuntimeError: Detected load from a distributed checkpoint, but neither --use-dist-ckpt
      nor --auto-detect-ckpt-format is set." (with it, the run loads it:
      ``compat.training.load_distributed_checkpoint_as_such``);
    - ``torch_dcp`` with ``--ckpt-format torch`` or ``torch_dist``, with or without
      ``--auto-detect-ckpt-format``: "AttributeError: 'NoneType' object has no attribute
      'items'" (its load builds the state dict to read into only for a torch_dcp run).

    A legacy ``torch`` checkpoint loads with ``--ckpt-format torch_dist`` (measured; Megatron's
    code path is the one with ``--auto-detect-ckpt-format``, whose losses
    tests/training/test_ckpt_formats.py checks). A torch_dcp run (``--use-torch-fsdp2``) is not
    judged: FSDP2 does not start on CPU here, so what it loads is not measured."""
    if not args.load:
        return None
    path = resumed_checkpoint(
        args.load, load_format(args), release=True, non_persistent=non_persistent
    )
    if path is None:
        try:
            tracked = tracked_checkpoint_dir(args.load)
        except ValueError:  # an unreadable tracker: Megatron will report it
            tracked = None
        path = tracked and str(tracked)
    found, run = checkpoint_format(path), args.ckpt_format
    auto = getattr(args, "auto_detect_ckpt_format", False)
    if found == "torch_dist" and run == "torch" and not auto:
        ways = (
            "--ckpt-format torch_dist, or add --auto-detect-ckpt-format (the run then saves in "
            "--ckpt-format torch)"
        )
    elif found == "torch_dcp" and run in ("torch", "torch_dist"):
        ways = (
            "--ckpt-format torch_dcp (Megatron allows it with --use-torch-fsdp2 only); "
            "--auto-detect-ckpt-format does not load it"
        )
    else:
        return None
    flags = f"--ckpt-format {run}" + (" --auto-detect-ckpt-format" if auto else "")
    return (
        f"--load {args.load}: {path} is a {found} checkpoint, which megatron-core 0.19.2 fails "
        f"to load with {flags}; resume from it with {ways}"
    )


# Both runs need these for megatron-core 0.19.2 to reshard the Adam moments on a layout change.
RESHARDABLE_OPTIM_FLAGS = ("--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable")


def checkpoint_format(path: str | None) -> str | None:
    """The format of the checkpoint folder ``path`` as megatron-core 0.19.2's
    ``_get_checkpoint_format`` tells it on load (``metadata.json``: ``torch_dist``; ``mp_rank_0*``
    entries: a legacy ``torch`` one; torch DCP's ``.metadata``: ``torch_dcp``); None: not a
    folder, or none of these."""
    if not path or not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return "torch_dist"
    names = os.listdir(path)
    if any(name.startswith("mp_rank_0") for name in names):
        return "torch"
    return "torch_dcp" if ".metadata" in names else None


def non_persistent_dir(args, load_dir: str | None = None) -> str | None:
    """The folder of the run's global non-persistent checkpoints (``--non-persistent-ckpt-type
    global``: ``--non-persistent-global-ckpt-dir``, else ``non_persistent`` in ``load_dir``,
    default ``--load``, as Megatron's ``_load_base_checkpoint`` looks for them, for the load and
    for ``--use-checkpoint-args``); None for any other type."""
    load_dir = load_dir or args.load
    if getattr(args, "non_persistent_ckpt_type", None) != "global" or not load_dir:
        return None
    from megatron.training.checkpointing import _NON_PERSISTENT_CKPT_SUBDIR

    return args.non_persistent_global_ckpt_dir or os.path.join(
        load_dir, _NON_PERSISTENT_CKPT_SUBDIR
    )


def resumed_checkpoint(
    load_dir: str,
    ckpt_format: str = "torch_dist",
    *,
    release: bool = False,
    non_persistent: str | None = None,
) -> str | None:
    """The folder of the checkpoint a run will resume from (None: nothing to load); with
    ``release``, a ``release`` checkpoint too (one a run starts from). ``non_persistent``
    (:func:`non_persistent_dir`): Megatron resumes from the newest global non-persistent
    checkpoint there where it is as new as the persistent one, or newer."""
    iteration = repair_checkpoint_tracker(load_dir, ckpt_format, write=False)
    newer = (
        repair_checkpoint_tracker(non_persistent, "torch_dist", write=False)
        if non_persistent
        else None
    )
    if newer is not None and (iteration is None or newer >= iteration):
        return os.path.join(non_persistent, iteration_dir_name(newer))
    if iteration is None:
        try:
            tracked = tracked_checkpoint_dir(load_dir)
        except ValueError:  # an unreadable tracker: Megatron will report it
            tracked = None
        if not (release and tracked is not None and tracked.name == RELEASE):
            return None
    return os.path.join(load_dir, iteration_dir_name(iteration))


def saved_args(
    load_dir: str,
    ckpt_format: str = "torch_dist",
    *,
    release: bool = False,
    non_persistent: str | None = None,
):
    """The arguments of the checkpoint a run will resume from (:func:`resumed_checkpoint`; None:
    nothing to load, or not readable): a distributed checkpoint's common state, a legacy
    ``torch`` one's rank-0 file (memory-mapped: its tensors are not read)."""
    path = resumed_checkpoint(load_dir, ckpt_format, release=release, non_persistent=non_persistent)
    if path is None:
        return None
    if checkpoint_format(path) == "torch":
        import glob

        import torch

        files = sorted(glob.glob(os.path.join(path, "mp_rank_0*", "model_optim_rng.pt")))
        try:
            return torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)["args"]
        except Exception:  # noqa: BLE001 - unreadable: Megatron will report it
            return None
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception:  # noqa: BLE001 - not a distributed checkpoint: Megatron will report it
        return None
    return common.get("args")


def load_checkpoint_args(args) -> set[str]:
    """``--use-checkpoint-args``: the model flags come from the checkpoint, as in Megatron's
    ``parse_and_validate_args`` (this entry point parses and validates on its own, so it calls
    Megatron's ``load_args_from_checkpoint`` here, for ``--pretrained-checkpoint`` and then
    ``--load``). The flags this package adds that the model's config holds (the ``ADDED`` rows
    of ``fields.FIELDS`` with an HF key: ``--hidden-act``, the SiTU betas, ``--moe-latent-norm``,
    ``--first-k-dense-replace``) are taken from the checkpoint too, always, as Megatron takes
    ``--swiglu`` and ``--moe-latent-size``, from the one Megatron reads its flags from: with
    ``--non-persistent-ckpt-type global``, a newer non-persistent one (:func:`saved_args`).
    Raises ``FlagError`` where Megatron asserts.

    Returns the dests whose values the checkpoint changed (a later refusal names them as the
    checkpoint's, not as flags the user typed)."""
    from megatron.training.checkpointing import load_args_from_checkpoint

    from megatron_latentmoe.fields import ADDED
    from megatron_latentmoe.training.arguments import FlagError

    if args.load is None and args.pretrained_checkpoint is None:
        raise FlagError(
            "--use-checkpoint-args reads the model flags from a checkpoint: give it with --load "
            "(or --pretrained-checkpoint)"
        )
    if args.non_persistent_ckpt_type == "local":
        raise FlagError(
            "--use-checkpoint-args with --non-persistent-ckpt-type local: not supported by "
            "megatron-core 0.19.2 (all flags must be known before its local checkpoint manager "
            "starts); give the model flags instead"
        )
    typed = dict(vars(args))
    for load_arg in ("pretrained_checkpoint", "load"):
        if getattr(args, load_arg) is None:
            continue
        load_args_from_checkpoint(args, load_arg=load_arg)
        load_dir = getattr(args, load_arg)
        saved = saved_args(
            load_dir,
            load_format(args),
            release=True,
            non_persistent=non_persistent_dir(args, load_dir),
        )
        for f in ADDED:
            value = getattr(saved, f.name, None) if f.hf else None
            if value is not None:
                _print0(f"Setting {f.name} to {value} from checkpoint")
                setattr(args, f.name, value)
    missing = object()
    return {dest for dest, value in vars(args).items() if typed.get(dest, missing) != value}


def _reshardable_optim(a) -> bool:
    """Megatron saves (and loads) this run's optimizer state in a layout-independent form:
    the distributed optimizer in the ``fully_reshardable`` format."""
    return bool(getattr(a, "use_distributed_optimizer", False)) and bool(
        getattr(a, "dist_ckpt_optim_fully_reshardable", False)
    )


def _plan_layout_change(args, saved) -> None:
    """Loading a checkpoint saved with another parallel layout (e.g. EP2 -> TP2+SP, EP2 -> PP2).

    Megatron reshards the weights and QB biases. The Adam moments and the scheduler state are
    loaded too where megatron-core 0.19.2 reshards them: the distributed optimizer in the fully
    reshardable format, at save and now (:data:`RESHARDABLE_OPTIM_FLAGS`). Otherwise (its plain
    optimizer cannot map saved param groups onto another layout: "Could not find parameter
    group with key ...") the moments start over and the LR / weight-decay schedule is stepped to
    the loaded iteration; a warning names the flags that would have kept them.
    """
    from megatron_latentmoe.compat.training import install_layout_change_load

    before = {f: getattr(saved, f, None) for f in LAYOUT_FIELDS}
    now = {f: getattr(args, f, None) for f in LAYOUT_FIELDS}
    keep = _reshardable_optim(saved) and _reshardable_optim(args)

    def on_load(iteration: int, opt_param_scheduler) -> None:
        what = (
            f"checkpoint layout {before} -> this run's {now}: loaded the resharded model, QB bias"
        )
        if keep and not args.no_load_optim:
            _print0(f"[{PROG}] {what} and optimizer state at iteration {iteration}")
            return
        if opt_param_scheduler is not None and iteration > 0:
            opt_param_scheduler.step(increment=iteration * args.global_batch_size)
        why = (
            "--no-load-optim"
            if keep
            else (
                "megatron-core 0.19.2 reshards optimizer state only when the checkpoint was saved "
                f"and is loaded with {' '.join(RESHARDABLE_OPTIM_FLAGS)}"
            )
        )
        _print0(
            f"[{PROG}] WARNING: {what} at iteration {iteration}; Adam moments start over ({why}); "
            "LR schedule stepped to the loaded iteration."
        )

    install_layout_change_load(args, keep, on_load)


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


def checked_args(has_cuda: bool):
    """Megatron's args from ``sys.argv`` with our flags, checked and completed as a run needs
    them (the shipped corpus and tokenizer as defaults, CPU-only fusions off, Megatron's
    ``validate_args``), and the transformer config built from them.

    Returns ``(args, transformer_config, cpu_notes, default_data_dir)``; a bad flag raises
    ``FlagError``. Needs the compat shims of ``_main`` applied first.
    """
    from megatron_latentmoe.compat.training import parse_with_our_flags
    from megatron_latentmoe.training.arguments import (
        FlagError,
        add_stable_latentmoe_args,
        checkpoint_origin,
    )

    args = parse_with_our_flags(add_stable_latentmoe_args)
    from_checkpoint = load_checkpoint_args(args) if args.use_checkpoint_args else set()
    try:
        return _checked(args, has_cuda)
    except FlagError as err:
        raise FlagError(checkpoint_origin(str(err), from_checkpoint)) from None


def _checked(args, has_cuda: bool):
    """``checked_args`` after parsing (and ``--use-checkpoint-args``' load)."""
    from megatron.training.arguments import validate_args

    from megatron_latentmoe.compat.training import apply_cpu_training_compat, cpu_training_defaults
    from megatron_latentmoe.data.corpus import (
        DEFAULT_CACHE_ORIGIN,
        DEFAULT_DATASET_NAME,
        default_cache_dir,
        default_tokenizer_dir,
    )
    from megatron_latentmoe.training.arguments import (
        FlagError,
        apply_default_tokenizer,
        data_vocabulary_refusal,
        expert_layout_refusal,
        interleaved_schedule_refusal,
        megatron_refusal,
        uses_default_data,
        validate_stable_latentmoe_args,
    )
    from megatron_latentmoe.training.file_checks import folder_refusal, load_refusal
    from megatron_latentmoe.training.model_provider import transformer_config_from_args

    validate_stable_latentmoe_args(args, has_cuda=has_cuda)
    default_data_dir = None
    if uses_default_data(args):
        default_data_dir = (
            os.path.join(args.data_cache_path, "default_data")
            if args.data_cache_path
            else str(default_cache_dir())
        )
    for refusal in (
        load_refusal(args.load, load_format(args)),
        format_refusal(args, non_persistent_dir(args)),
        folder_refusal("--save", args.save),
        folder_refusal("--data-cache-path", args.data_cache_path),
        None if args.data_cache_path else folder_refusal(DEFAULT_CACHE_ORIGIN, default_data_dir),
    ):
        if refusal:
            raise FlagError(refusal)
    if default_data_dir is not None:
        args.data_path = [os.path.join(default_data_dir, DEFAULT_DATASET_NAME)]
        if args.split is None:
            args.split = "98,2,0"
    if apply_default_tokenizer(args, default_tokenizer_dir()):
        _print0(
            f"[{PROG}] tokenizer: the shipped one (HuggingFaceTokenizer {args.tokenizer_model})"
        )
    cpu_notes = [] if has_cuda else cpu_training_defaults(args)
    if not has_cuda:
        apply_cpu_training_compat()
    refusal = expert_layout_refusal(args)
    if refusal:
        raise FlagError(refusal)
    try:
        validate_args(args, {})
    except (AssertionError, ValueError, RuntimeError) as err:  # mostly bare asserts
        raise FlagError(megatron_refusal(args, err)) from None
    # the tokenizer flags are final here; the shipped corpus is made with the shipped tokenizer
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
        init_cpu_world,
        load_distributed_checkpoint_as_such,
        load_optional_checkpoint_keys,
        on_save_error,
        wrap_train_step,
    )

    apply_python311_compat()
    import torch

    from megatron_latentmoe.compat import apply_core_compat, apply_cpu_compat

    has_cuda = torch.cuda.is_available()
    apply_core_compat()
    if not has_cuda:
        apply_cpu_compat()
    from megatron_latentmoe.data.corpus import DEFAULT_DATASET_NAME, prepare_default_dataset
    from megatron_latentmoe.data.indexed import PreprocessError
    from megatron_latentmoe.training.arguments import FlagError

    begin_run()
    try:
        args, transformer_config, cpu_notes, default_data_dir = checked_args(has_cuda)
    except FlagError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return 2
    if check_only:
        return 0
    if cpu_notes:
        _print0(f"[{PROG}] no CUDA: gloo, local spec; off on CPU: {', '.join(cpu_notes)}")
    if args.disable_jit_fuser:
        from megatron_latentmoe.ops.situ import set_cpu_compile

        set_cpu_compile(False)
        _print0(
            f"[{PROG}] --disable-jit-fuser: no torch.compile for SiTU-GLU on CPU (its eager math)"
        )

    if default_data_dir is not None:
        try:
            prefix = prepare_default_dataset(default_data_dir, DEFAULT_DATASET_NAME)
        except PreprocessError as err:  # e.g. a read-only file system, a full disk
            print(
                f"{PROG}: error: the shipped corpus's dataset: {err}", file=sys.stderr, flush=True
            )
            return 2
        _print0(f"[{PROG}] data: the shipped corpus ({prefix}.bin/.idx)")

    from megatron.core.enums import ModelType
    from megatron.training import training as mtraining
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.global_vars import set_global_variables

    from megatron_latentmoe.convert.names import TRAINING_STATE_SUFFIXES
    from megatron_latentmoe.training import forward_step as fstep
    from megatron_latentmoe.training.balance_logging import (
        balance_step_end,
        default_jsonl_path,
        make_finalize_model_grads_func,
    )
    from megatron_latentmoe.training.model_provider import (
        install_finalize_hook,
        model_config_from_args,
    )
    from megatron_latentmoe.training.qb_calibrate import QBCalibration
    from megatron_latentmoe.training.qb_rescore import QBRescore

    set_global_variables(args)  # the padded vocabulary: checkpoint_bytes reads it
    if _rank() == 0:
        from megatron_latentmoe.training.file_checks import save_space_warning

        warning = save_space_warning(args)
        if warning:
            print(f"[{PROG}] WARNING: {warning}", flush=True)
    model_cfg = model_config_from_args(args, transformer_config)
    cfg_container = pretrain_cfg_container_from_args(args, model_cfg)

    if not has_cuda:
        init_cpu_world(args)
        from megatron_latentmoe.compat.qb_gloo import apply_qb_gloo_compat

        apply_qb_gloo_compat()
    if load_format(args) == AUTO_FORMAT and args.ckpt_format != "torch_dist":
        load_distributed_checkpoint_as_such(args)
    if args.load and _rank() == 0:
        repair_checkpoint_tracker(args.load, load_format(args))
    if args.load:
        from megatron_latentmoe.training.file_checks import shape_refusal

        non_persistent = non_persistent_dir(args)
        saved = saved_args(args.load, load_format(args), non_persistent=non_persistent)
        refusal = shape_refusal(args.load, args, saved) or legacy_layout_refusal(
            args, saved, non_persistent
        )
        if refusal:
            print(f"{PROG}: error: {refusal}", file=sys.stderr, flush=True)
            return 2
        restores = not args.finetune and not (args.no_load_optim and args.no_load_rng)
        if restores and saved is not None and _layout_changed(args, saved):
            _plan_layout_change(args, saved)

    balance_logger = _make_balance_logger(args, default_jsonl_path(args))
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
        load_optional_checkpoint_keys(TRAINING_STATE_SUFFIXES)
    fstep.set_batch_recorder(rescore)
    install_finalize_hook(make_finalize_model_grads_func(balance_logger, rescore))
    exclude_from_step_time(balance_logger.excluded)
    if args.save:
        on_save_error(partial(_stop_if_disk_full, args))
    datasets_provider = fstep.train_valid_test_datasets_provider
    if args.moe_qb_calibrate_batches:
        calibration = QBCalibration(
            args.moe_qb_calibrate_batches,
            train_iters=args.train_iters,
            global_batch_size=args.global_batch_size,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.decoder_seq_length,
            log=lambda line: print(line, flush=True),
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
    except _DiskFull:  # rank 0 has said so
        return 2
    except fstep.OutOfVocabularyError as err:  # a batch's token id (get_batch)
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return 2
    except AssertionError as err:
        if not str(err).startswith("OptimizerParamScheduler:"):
            raise
        # Megatron's check on load (every rank hits it identically): say what to do about it.
        print(
            f"{PROG}: error: the checkpoint's LR / weight-decay schedule differs from this run's "
            f"flags ({err}). Pass --override-opt_param-scheduler to continue with this run's "
            "schedule (e.g. a longer --train-iters), or --use-checkpoint-opt_param-scheduler to "
            "keep the checkpoint's.",
            file=sys.stderr,
            flush=True,
        )
        return 2

    if balance_logger.is_logging_rank and balance_logger.history:
        from megatron_latentmoe.training.balance_summary import summarize, summary_lines

        lines = summary_lines(summarize(balance_logger.history))
        print("\n".join([f"[{PROG}] summary: {lines[0]}", *lines[1:]]), flush=True)
    _print0(f"[{PROG}] done in {time.time() - t_start:.1f} s")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


class _DiskFull(Exception):
    """A checkpoint save ran out of space; rank 0 has said so."""


def _stop_if_disk_full(args, err: BaseException, iteration: int) -> None:
    """Megatron's save of ``iteration`` failed with ``err``: where ``--save``'s disk is full,
    end the run (exit 2) with one line instead of every rank's traceback; otherwise return
    (``err`` is re-raised).

    torch DCP's ``CheckpointException`` reaches every rank at once (its failure is broadcast):
    the ranks agree first (one all-reduce of :func:`.file_checks.disk_full`, before anything is
    removed: the free space it reads is what rank 0's removal changes; measured, rank 1 then saw
    room and raised its traceback), rank 0 removes the unfinished folder and prints the line
    (:func:`.file_checks.disk_full_error`), and a barrier keeps the others from exiting first
    (torchrun would SIGTERM rank 0 midway). Any other error is this rank's alone (rank 0's
    ``metadata.json`` or tracker, the others waiting in Megatron's barrier, where a collective
    of ours would mismatch): rank 0 says it without one and exits; torchrun ends the others."""
    import torch
    from torch.distributed.checkpoint import CheckpointException

    from megatron_latentmoe.training.file_checks import disk_full, disk_full_error

    full = disk_full(err, args.save)
    every_rank = isinstance(err, CheckpointException) and torch.distributed.is_initialized()
    if every_rank:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        flag = torch.tensor([int(full)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        full = bool(flag.item())
    if not full or not (every_rank or _rank() == 0):
        return
    if _rank() == 0:
        line = disk_full_error(args.save, iteration, args.ckpt_format)
        print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
    if every_rank:
        torch.distributed.barrier()
    raise _DiskFull from None


def _make_balance_logger(args, jsonl_path):
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size
    from megatron.training import get_args, get_tensorboard_writer, get_wandb_writer

    from megatron_latentmoe.training.balance_logging import BalanceLogger

    if jsonl_path and _rank() == int(os.environ.get("WORLD_SIZE", "1")) - 1:
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
    sys.exit(main())
