"""The checkpoint ``--load`` resumes from, and whether this run can load it: this module's one
job (the entry point, :mod:`.pretrain`, calls it; the folders it reads are repaired after a kill
first, :mod:`.checkpoint_repair`).

Which checkpoint: the folder Megatron will load (:func:`resumed_by_args`, the one place that says
which: a ``release`` one, ``--ckpt-step``'s, a newer global non-persistent one) and its format
(:func:`.checkpoint_repair.checkpoint_format`), that folder's saved args (:func:`saved_args`;
with ``--use-checkpoint-args`` the model flags come from them, :func:`load_checkpoint_args`).

What is wrong with it, found before any rank loads it: megatron-core 0.19.2 meets each of these
in the middle of its load, on every rank, as a Python traceback (``FileNotFoundError`` for a
tracker naming a folder that is not there; torch DCP's ``CheckpointException`` around an
``EOFError`` or an ``UnpicklingError`` for a shard file or ``.metadata`` cut short; a
``JSONDecodeError`` for a cut ``metadata.json``: :func:`load_refusal`; a format this run's
``--ckpt-format`` does not load: :func:`format_refusal`; another model shape:
:func:`shape_refusal`), or not at all: a Hugging Face export given to ``--load`` trains from
random weights after one warning line, a legacy ``torch`` checkpoint of another parallel layout
trains nothing and exits 0 (:func:`legacy_layout_refusal`). :func:`load_refusal` reads only the
tracker, ``metadata.json``, torch DCP's ``.metadata`` and the shard files' sizes (no tensor), so
the flag check can afford it. A loaded data offset that this run's datasets cannot serve is known
once Megatron builds them, after the model: :mod:`.data_left`.

A layout Megatron does reshard: what it loads and what starts over (:func:`plan_layout_change`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_latentmoe.checkpoint_layout import (
    RELEASE,
    TRACKER_FILE,
    iteration_dir_name,
    iteration_of_dir_name,
    tracked_checkpoint_dir,
)
from megatron_latentmoe.training.checkpoint_repair import (
    AUTO_FORMAT,
    checkpoint_format,
    complete_checkpoint,
    non_persistent_dir,
    rank_file_args,
    rank_files,
    repair_checkpoint_tracker,
    shard_problem,
    tracker_text,
)
from megatron_latentmoe.training.console import PROG, print0


def load_format(args) -> str:
    """The checkpoint format ``--load`` reads: ``--ckpt-format``, or each folder's own with
    ``--auto-detect-ckpt-format`` (:data:`.checkpoint_repair.AUTO_FORMAT`)."""
    return AUTO_FORMAT if getattr(args, "auto_detect_ckpt_format", False) else args.ckpt_format


def resumed_checkpoint(
    load_dir: str,
    ckpt_format: str = "torch_dist",
    *,
    non_persistent: str | None = None,
    ckpt_step: int | None = None,
) -> str | None:
    """The folder of the checkpoint a run will resume from (None: nothing to load), as
    megatron-core 0.19.2's ``_load_base_checkpoint`` picks it from ``load_dir`` (``--load`` or
    ``--pretrained-checkpoint``): the tracker's (repaired,
    :func:`.checkpoint_repair.repair_checkpoint_tracker`), a ``release`` one included (its
    iteration: 0). ``ckpt_step`` (``--ckpt-step``, :func:`ckpt_step`) replaces the tracker's
    iteration: that iteration's folder, there or not, complete or not, with or without a tracker; a
    ``release`` tracker still loads ``release``. ``non_persistent``
    (:func:`.checkpoint_repair.non_persistent_dir`): the newest global non-persistent checkpoint
    there where its iteration is that iteration or newer."""
    release = tracker_text(load_dir) == RELEASE
    iteration = ckpt_step or (
        0 if release else repair_checkpoint_tracker(load_dir, ckpt_format, write=False)
    )
    newer = (
        repair_checkpoint_tracker(non_persistent, "torch_dist", write=False)
        if non_persistent
        else None
    )
    if newer is not None and (iteration is None or newer >= iteration):
        return os.path.join(non_persistent, iteration_dir_name(newer))
    if release:
        return os.path.join(load_dir, RELEASE)
    return None if iteration is None else os.path.join(load_dir, iteration_dir_name(iteration))


def ckpt_step(args) -> int | None:
    """``--ckpt-step``: the iteration Megatron loads in place of the tracker's (None: none given;
    0 is none to megatron-core 0.19.2, which tests it for truth)."""
    return getattr(args, "ckpt_step", None) or None


def resumed_by_args(args, load_arg: str | None = None) -> str | None:
    """:func:`resumed_checkpoint` for this run's flags: the folder megatron-core 0.19.2 loads
    (``load_arg``: default :func:`loaded_arg`), None where it loads none; where no folder is
    complete by this run's format, the one the tracker names, which Megatron loads as it is."""
    load_arg = load_arg or loaded_arg(args)
    if load_arg is None:
        return None
    load_dir = getattr(args, load_arg)
    path = resumed_checkpoint(
        load_dir,
        load_format(args),
        non_persistent=non_persistent_dir(args, load_dir),
        ckpt_step=ckpt_step(args),
    )
    if path is None:
        try:
            tracked = tracked_checkpoint_dir(load_dir)
        except ValueError:  # an unreadable tracker: Megatron will report it
            tracked = None
        path = tracked and str(tracked)
    return path


def ckpt_step_refusal(args, load_arg: str = "load") -> str | None:
    """One line when ``--ckpt-step N`` makes Megatron load a folder that is not there or not
    complete (:func:`.checkpoint_repair.complete_checkpoint` by this run's format): megatron-core
    0.19.2 failed after building the model and optimizer, on every rank, with "FileNotFoundError:
    [Errno 2] No such file or directory: '.../iter_0000005'" (measured: CPU, one rank, tiny.sh, an
    empty --load, --ckpt-step 5)."""
    step, load_dir = ckpt_step(args), getattr(args, load_arg, None)
    path = step and load_dir and resumed_by_args(args, load_arg)
    if not path or path != os.path.join(load_dir, iteration_dir_name(step)):
        return None
    if complete_checkpoint(path, load_format(args)):
        return None
    what = "is not a complete checkpoint" if os.path.isdir(path) else "is not there"
    complete = sorted(
        i
        for e in (os.listdir(load_dir) if os.path.isdir(load_dir) else ())
        if (i := iteration_of_dir_name(e)) is not None
        and complete_checkpoint(os.path.join(load_dir, e), load_format(args))
    )
    head = f"--ckpt-step {step}: {path} {what} ({load_flag(load_arg)} {load_dir}); "
    tracked = os.path.isfile(os.path.join(load_dir, TRACKER_FILE))
    if not tracked and not complete:  # without --ckpt-step Megatron finds no checkpoint there
        return head + (
            "no checkpoint is there: leave --ckpt-step out to start from scratch"
            if load_arg == "load"
            else f"no checkpoint is there: give {load_flag(load_arg)} the folder that holds one"
        )
    # no tracker: the start-up repair writes one naming the newest complete checkpoint
    instead = "the tracker's" if tracked else f"the newest complete one ({complete[-1]})"
    return head + (
        "give an iteration whose checkpoint there is complete (complete ones: "
        f"{', '.join(map(str, complete)) or 'none'}), or leave --ckpt-step out to load {instead}"
    )


def ckpt_step_warning(args, load_arg: str = "load") -> str | None:
    """A warning when ``--ckpt-step N`` has no effect: megatron-core 0.19.2's
    ``_load_base_checkpoint`` replaces the tracker's iteration with N but keeps its ``release``
    flag, so a ``release`` tracker loads ``release`` whatever N is, silently (the iteration it
    records is N). None where Megatron loads another folder (a newer non-persistent one)."""
    step, load_dir = ckpt_step(args), getattr(args, load_arg, None)
    path = step and load_dir and resumed_by_args(args, load_arg)
    if not loads_release(path):
        return None
    return (
        f"--ckpt-step {step} is ignored: {load_flag(load_arg)} {load_dir} holds a release "
        f"checkpoint ({TRACKER_FILE}: release), which megatron-core 0.19.2 loads whatever "
        f"--ckpt-step says: {path}"
    )


def loads_release(path: str | None) -> bool:
    """Whether the folder Megatron loads (``path``, :func:`resumed_by_args`) is a ``release``
    checkpoint: megatron-core 0.19.2 restores its model alone (the QB ``router.expert_bias``
    included: model state), from iteration 0, with no optimizer, LR scheduler, RNG or rerun
    state, from ``--load`` as from ``--pretrained-checkpoint``."""
    return bool(path) and os.path.basename(os.path.normpath(path)) == RELEASE


def release_data_warning(args, saved, path: str | None, load_arg: str = "load") -> str | None:
    """A warning when ``--load`` resumes a ``release`` checkpoint (``path``, its args ``saved``)
    without ``--finetune``: megatron-core 0.19.2 then starts the iteration count, optimizer, LR
    schedule and RNG over (:func:`loads_release`) but still takes ``consumed_train_samples`` (and
    the validation and skipped counts) from the checkpoint's args, so the fresh run reads its
    data after the samples the release's own run consumed. Measured (CPU, 1 rank, tiny.sh, global
    batch 8): a release made of iteration 2 logged "consumed samples: 24" at iteration 1, whose
    loss and per-expert loads equal the saving run's iteration 3, the QB bias so loaded;
    ``--finetune``: 8. None for ``--pretrained-checkpoint`` (Megatron sets ``--finetune``), no
    consumed samples, or ``--override-ckpt-iteration`` (the user sets the data offset; Megatron
    refuses it with ``--finetune``)."""
    consumed = getattr(saved, "consumed_train_samples", 0) or 0
    if (
        load_arg != "load"
        or args.finetune
        or getattr(args, "override_ckpt_iteration", None) is not None
        or not loads_release(path)
        or consumed <= 0
    ):
        return None
    return (
        f"--load {args.load} holds a release checkpoint ({TRACKER_FILE}: release): "
        "megatron-core 0.19.2 restores its model weights alone (the QB router bias included) and "
        "starts the iteration count, optimizer, LR schedule (warm-up included) and RNG over, but "
        f"continues the data after the {consumed} training samples the run that saved it "
        "consumed (validation data likewise). Pass --finetune to start the data from sample 0 "
        "too: for a release checkpoint it changes nothing else in megatron-core 0.19.2 but "
        "skipping Megatron's comparison of the checkpoint's model args (this entry point's shape "
        "check still runs)"
    )


def loaded_arg(args) -> str | None:
    """The flag (its dest) whose folder megatron-core 0.19.2's ``load_checkpoint`` loads:
    ``load``, or ``pretrained_checkpoint`` where ``--load`` holds no checkpoint (no tracker
    there, ``checkpoint_exists``; counted after
    :func:`.checkpoint_repair.repair_checkpoint_tracker`, which may write one): it then fine-tunes
    from that one (``args.finetune``: the model alone, from iteration 0). None: neither is given."""
    if getattr(args, "pretrained_checkpoint", None) is None:
        return "load" if args.load else None
    if args.load and (
        os.path.isfile(os.path.join(args.load, TRACKER_FILE))
        or repair_checkpoint_tracker(args.load, load_format(args), write=False) is not None
    ):
        return "load"
    return "pretrained_checkpoint"


def load_flag(load_arg: str) -> str:
    """The flag of a dest :func:`loaded_arg` returns."""
    return "--" + load_arg.replace("_", "-")


def saved_args(path: str | None):
    """The arguments of the checkpoint in the folder ``path`` (:func:`resumed_by_args`: the one
    Megatron loads; None: nothing to load, or not readable): a distributed checkpoint's common
    state, a legacy ``torch`` one's rank-0 file (memory-mapped: its tensors are not read)."""
    if path is None:
        return None
    if checkpoint_format(path) == "torch":
        try:
            return rank_file_args(rank_files(Path(path))[0])
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

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.fields import ADDED

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
        saved = saved_args(resumed_by_args(args, load_arg))
        for f in ADDED:
            value = getattr(saved, f.name, None) if f.hf else None
            if value is not None:
                print0(f"Setting {f.name} to {value} from checkpoint")
                setattr(args, f.name, value)
    missing = object()
    return {dest for dest, value in vars(args).items() if typed.get(dest, missing) != value}


# ------------------------------------------------------------------------- start-up refusals
HF_IMPORT = "python -m megatron_latentmoe.convert import --hf {path} --output SAVE_ROOT"


def _is_hf_export(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _torch_dist_refusal(path: Path) -> str | None:
    """A complete-looking ``torch_dist`` folder (``metadata.json`` and ``.metadata`` present)
    whose metadata cannot be read, or whose shard files are missing or shorter than
    ``.metadata`` says."""
    try:
        meta = json.loads((path / "metadata.json").read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (OSError, ValueError) as e:
        return f"{path / 'metadata.json'} cannot be read ({e})"
    try:
        return shard_problem(path)
    except Exception as e:  # noqa: BLE001 - any unpickling / IO problem of a cut or corrupt file
        return f"{path / '.metadata'} cannot be read ({type(e).__name__}: {e})"


def load_refusal(args, load_arg: str = "load") -> str | None:
    """One line saying what is wrong with the checkpoint ``--load`` resumes from and what to do,
    or None (nothing wrong, or nothing to load: a run given an empty or new folder starts from
    scratch, as Megatron does). Judges the folder :func:`resumed_by_args` names, the one
    Megatron loads (the tracker's after :func:`.checkpoint_repair.repair_checkpoint_tracker`,
    ``--ckpt-step``'s, a newer global non-persistent one, a ``release`` one); checks its files where
    it is a ``torch_dist`` one. ``load_arg``: the flag (its dest) whose folder Megatron loads
    (:func:`loaded_arg`; ``--pretrained-checkpoint``: the advice to start from scratch is left out,
    Megatron does not start from scratch without it). A ``--ckpt-step`` folder that is not complete:
    :func:`ckpt_step_refusal`'s."""
    load_dir, flag = getattr(args, load_arg), load_flag(load_arg)
    if not load_dir or not os.path.isdir(load_dir):
        return None
    root = Path(load_dir)
    if _is_hf_export(root) and not (root / TRACKER_FILE).exists():
        return (
            f"{flag} {load_dir} is a Hugging Face export (config.json, *.safetensors), not a "
            f"Megatron checkpoint: Megatron would start from random weights. Import it first "
            f"({HF_IMPORT.format(path=load_dir)}) and give {flag} SAVE_ROOT"
        )
    resumes = flag == "--load"
    path = resumed_by_args(args, load_arg)
    if path is None:
        return None
    tracker, text = root / TRACKER_FILE, tracker_text(load_dir) or ""
    if not os.path.isdir(path):
        if (
            text.isdecimal()
            and not ckpt_step(args)  # its folder: ckpt_step_refusal's
            and path == str(root / iteration_dir_name(int(text)))
        ):
            return (
                f"{flag} {load_dir}: {tracker} names iteration {int(text)}, but "
                f"{path} is not there and no other complete checkpoint is: give {flag} the "
                "folder that holds it"
                + (f", or delete {tracker} to start from scratch" if resumes else "")
            )
        return None
    if not complete_checkpoint(path, load_format(args)) or checkpoint_format(path) != (
        "torch_dist"
    ):
        return None
    problem = _torch_dist_refusal(Path(path))
    if problem is None:
        return None
    name, iteration = os.path.basename(path), iteration_of_dir_name(os.path.basename(path))
    folder = os.path.dirname(path)
    if os.path.normpath(folder) != os.path.normpath(load_dir):  # a newer non-persistent one
        return (
            f"{flag} {load_dir}: the non-persistent checkpoint of iteration {iteration} ({path}), "
            f"which Megatron loads as the newest, is damaged: {problem}. Delete {folder} (the run "
            f"then loads the persistent checkpoint in {load_dir})"
        )
    if iteration is None:  # release
        return (
            f"{flag} {load_dir}: the release checkpoint {path} is damaged: {problem}. Write it "
            "again (for an HF model: the import)"
        )
    return (
        f"{flag} {load_dir}: the checkpoint of iteration {iteration} is damaged: {problem}. "
        f"Write {TRACKER_FILE} with an earlier iteration whose folder is whole"
        + (
            f", or delete {name} (the run then resumes from the newest complete one)"
            if resumes
            else ""
        )
    )


def pretrained_refusal(args) -> str | None:
    """One line when Megatron loads ``--pretrained-checkpoint`` (:func:`loaded_arg`) and there
    is no checkpoint there: megatron-core 0.19.2 raised "FileNotFoundError: No checkpoint found
    in load directory or pretrained directory" on every rank, after building the model
    (measured). What is wrong with a checkpoint that is there: :func:`load_refusal` and the
    others, given ``load_arg="pretrained_checkpoint"``."""
    if loaded_arg(args) != "pretrained_checkpoint":
        return None
    path = args.pretrained_checkpoint
    if os.path.isfile(os.path.join(path, TRACKER_FILE)):
        return None
    load = f"--load {args.load} holds none either" if args.load else "no --load is given"
    return (
        f"--pretrained-checkpoint {path}: no checkpoint there ({TRACKER_FILE} is not there) and "
        f"{load}; give it the folder a Megatron save or the HF import wrote (SAVE_ROOT)"
    )


def format_refusal(args, load_arg: str = "load") -> str | None:
    """One line when the checkpoint ``--load`` resumes from (:func:`resumed_by_args`: a newer
    non-persistent one, ``--ckpt-step``'s; where no folder is complete by this run's format, the
    one the tracker names, which Megatron loads as it is) is of a format megatron-core 0.19.2
    fails to load with this run's ``--ckpt-format``, with a traceback on every rank (measured
    with one rank):

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
    judged: FSDP2 does not start on CPU here, so what it loads is not measured. ``load_arg``: the
    folder's flag (:func:`loaded_arg`)."""
    load_dir = getattr(args, load_arg)
    if not load_dir:
        return None
    path = resumed_by_args(args, load_arg)
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
        f"{load_flag(load_arg)} {load_dir}: {path} is a {found} checkpoint, which megatron-core "
        f"0.19.2 fails to load with {flags}; resume from it with {ways}"
    )


SHAPE_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_latent_size",
    "moe_shared_expert_intermediate_size",
    "first_k_dense_replace",
    "latent_moe_use_norm",
    "padded_vocab_size",
)
"""The args that set a tensor's shape or whether it exists (``--moe-latent-norm``: the routed
experts' ``routed_expert_norm.weight``; turned on, megatron-core 0.19.2 failed the load with
"KeyError: 'decoder.layers.1.mlp.routed_expert_norm.weight from model not in state dict'" on every
rank; turned off, it dropped the trained norm silently; measured: tiny.sh, 1 rank), as the
checkpoint's args and this run's hold them (the vocabulary: the tokenizer's, padded; every other
is named by its flag)."""

NONE_IS_ABSENT = ("moe_latent_size", "moe_shared_expert_intermediate_size")
"""The :data:`SHAPE_ARGS` whose None is a model without that part (no latent projection, no
shared experts), compared as a value where the checkpoint's args hold it: a checkpoint trained
with --moe-shared-expert-intermediate-size 64 resumed without it loaded and trained on with no
word, its shared experts dropped (measured: tiny.sh, 1 rank, EP1, exit 0). Any other None is a
value the args do not say (an older checkpoint's, a plain GPT one's)."""

ACTIVATION_ARGS = ("hidden_act", "activation_situ_beta", "activation_situ_linear_beta")
"""The args that set the experts' and dense MLPs' activation (the betas: SiTU's alone)."""


def activation_warning(args, saved, load_dir: str, flag: str = "--load") -> str | None:
    """A warning when the checkpoint (its args ``saved``) was trained with another activation:
    its weights fit, so megatron-core 0.19.2 loads them and trains on with this run's activation,
    silently (measured: tiny.sh, 1 rank, situ -> --hidden-act swiglu). Not refused: a change may
    be meant; ``--use-checkpoint-args`` takes the checkpoint's."""
    if saved is None:
        return None
    both_situ = getattr(saved, "hidden_act", None) == getattr(args, "hidden_act", None) == "situ"
    names = ACTIVATION_ARGS if both_situ else ACTIVATION_ARGS[:1]

    from megatron_latentmoe.training.arguments import flag_for_field

    def flags(a) -> str:
        return " ".join(f"{flag_for_field(n)} {getattr(a, n, None)}" for n in names)

    if all(getattr(saved, n, None) in (None, getattr(args, n, None)) for n in names):
        return None
    return (
        f"{flag} {load_dir}: the checkpoint was trained with {flags(saved)}; this run uses "
        f"{flags(args)}: its weights are trained on with another activation (give the "
        "checkpoint's flags, or --use-checkpoint-args, to keep its own)"
    )


def shape_refusal(load_dir: str, args, saved, flag: str = "--load") -> str | None:
    """One line naming the model flags whose values in the checkpoint's args (``saved``; None:
    nothing to load) differ from this run's: megatron-core's load fails on the first tensor
    of another shape with a ``CheckpointException`` traceback (``Global shape mismatch``).
    ``flag``: the one that gave ``load_dir``."""
    if saved is None:
        return None
    from megatron_latentmoe.training.arguments import flag_for_field

    def name(dest: str) -> str:
        return "the padded vocabulary" if dest == "padded_vocab_size" else flag_for_field(dest)

    def differs(dest: str) -> bool:
        before, now = getattr(saved, dest, None), getattr(args, dest, None)
        if dest in NONE_IS_ABSENT and hasattr(saved, dest):
            return before != now
        return before is not None and now is not None and before != now

    def value(v) -> str:
        return "not given" if v is None else str(v)

    differ = [
        f"{name(dest)} {value(getattr(saved, dest))} (this run: {value(getattr(args, dest))})"
        for dest in SHAPE_ARGS
        if differs(dest)
    ]
    if not differ:
        return None
    return (
        f"{flag} {load_dir}: the checkpoint is of another model shape: {', '.join(differ)}. Give "
        "the checkpoint's model flags, or --use-checkpoint-args to take them from it"
    )


def restores_optimizer(args, saved) -> bool:
    """Whether megatron-core 0.19.2 loads the optimizer state of a checkpoint (its args ``saved``)
    into this run, for a caller that leaves out the loads of the model alone: not with
    ``--no-load-optim``, nor where a layout change starts the optimizer over
    (:func:`plan_layout_change`: the plain optimizer, or one side not fully reshardable)."""
    if saved is None or args.no_load_optim:
        return False
    return not layout_changed(args, saved) or (
        _reshardable_optim(saved) and _reshardable_optim(args)
    )


def optimizer_refusal(args, saved, load_dir: str, flag: str = "--load") -> str | None:
    """One line where the checkpoint was saved with ``--no-save-optim`` (its args, ``saved``) and
    this run restores its optimizer (no ``--no-load-optim``; the caller leaves out the loads of
    the model alone: ``--finetune``, ``--pretrained-checkpoint``, a release): megatron-core
    0.19.2's load skips the absent state in its sharded read but then reads
    ``state_dict['optimizer']``, a ``KeyError`` traceback on every rank ("Unable to load
    optimizer from checkpoint"; measured: 2 ranks, tiny.sh, saved with --no-save-optim). Not
    where a layout change starts the optimizer over (:func:`restores_optimizer`)."""
    if not restores_optimizer(args, saved) or not getattr(saved, "no_save_optim", False):
        return None
    return (
        f"{flag} {load_dir}: the checkpoint was saved with --no-save-optim (it holds no "
        "optimizer state), which megatron-core 0.19.2 fails to load; add --no-load-optim (the "
        "optimizer and its learning-rate schedule start anew, the iteration number goes on) or "
        "--finetune (the weights alone, from iteration 0)"
    )


LR_ARGS = ("lr", "min_lr", "decoupled_lr", "decoupled_min_lr")
"""The args megatron-core 0.19.2 keys an optimizer's param groups by (its
``param_group_identifier_keys``: ``max_lr``, ``min_lr``; the weight-decay ones are set by
per-group overrides only): another value loads through
:func:`..compat.training.load_optimizer_with_new_lr`, or is replaced by the checkpoint's
(:func:`take_checkpoint_lr`)."""


WD_ARGS = ("start_weight_decay", "end_weight_decay", "weight_decay_incr_style")
"""The weight-decay schedule megatron-core 0.19.2's ``OptimizerParamScheduler`` takes from the
checkpoint with ``--use-checkpoint-opt_param-scheduler`` (its ``start_wd``, ``end_wd``,
``wd_incr_style``, besides the LR schedule; ``validate_args`` sets both ends to
``--weight-decay`` for the constant style). Not keys of the param groups: another value loads
as it is (measured: test_resume_new_lr, --weight-decay 0.1 resumed from tiny.sh's 0.01)."""


def _changes(args, saved, dests) -> list[str]:
    """The args ``dests`` the checkpoint (its args ``saved``) holds another value of than this
    run, each as ``--lr 0.001 (this run: 0.0005)``."""
    from megatron_latentmoe.training.arguments import flag_for_field

    return [
        f"{flag_for_field(dest)} {getattr(saved, dest, None)} (this run: {getattr(args, dest)})"
        for dest in dests
        if hasattr(saved, dest) and getattr(saved, dest) != getattr(args, dest, None)
    ]


def _constant_wd(args, saved) -> bool:
    """Whether this run and the checkpoint (its args ``saved``) both keep the weight decay
    constant (``--weight-decay-incr-style constant``)."""
    return all(getattr(a, "weight_decay_incr_style", None) == "constant" for a in (args, saved))


def _wd_changes(args, saved) -> list[str]:
    """The weight-decay schedule the checkpoint holds another one of than this run
    (:func:`_changes`): ``--weight-decay`` where both keep it constant (the flag given), else
    each of :data:`WD_ARGS`."""
    return _changes(args, saved, ("weight_decay",) if _constant_wd(args, saved) else WD_ARGS)


def _schedule_lengths(a) -> dict[str, float] | None:
    """The lengths, in samples, megatron-core 0.19.2's ``OptimizerParamScheduler`` takes from a
    checkpoint with ``--use-checkpoint-opt_param-scheduler`` besides the values (its
    ``lr_warmup_steps``, ``lr_decay_steps``, ``wd_incr_steps``), from the args ``a`` as
    ``megatron.training.get_optimizer_param_scheduler`` computes them (None: args without them,
    an older checkpoint's). Sample-based where ``--train-samples`` is given: Megatron sets
    ``train_iters`` from it as it builds the scheduler, so a checkpoint's args hold both."""
    try:
        if a.train_samples:
            decay = a.lr_decay_samples or a.train_samples
            wd_incr, warmup = a.train_samples, a.lr_warmup_samples
        else:
            decay = (a.lr_decay_iters or a.train_iters) * a.global_batch_size
            wd_incr = a.train_iters * a.global_batch_size
            warmup = a.lr_warmup_iters * a.global_batch_size
        if a.lr_warmup_fraction is not None:
            warmup = a.lr_warmup_fraction * decay
    except (AttributeError, TypeError):
        return None
    return {"LR warmup": warmup, "LR decay": decay, "WD schedule": wd_incr}


def _schedule_changes(args, saved) -> list[str]:
    """The checkpoint's schedule lengths and LR decay style this run's flags give others of
    (--train-iters, --lr-decay-iters, --lr-warmup-*, --global-batch-size, or their sample
    counterparts), each as ``LR decay over 9600 samples (this run: 19200)``; the weight decay's
    length only where a schedule makes it matter (not both constant)."""
    out = _changes(args, saved, ("lr_decay_style",))
    mine, theirs = _schedule_lengths(args), _schedule_lengths(saved)
    if mine is None or theirs is None:
        return out
    constant = _constant_wd(args, saved)
    for name, value in theirs.items():
        if mine[name] != value and not (name == "WD schedule" and constant):
            out.append(f"{name} over {value:.0f} samples (this run: {mine[name]:.0f})")
    return out


def lr_refusal(args, saved, load_dir: str, flag: str = "--load") -> str | None:
    """One line where this run restores the optimizer (no ``--no-load-optim``; the caller leaves
    out the loads of the model alone) of a checkpoint (its args ``saved``) saved with another
    ``--lr`` / ``--min-lr`` / ``--decoupled-lr`` / ``--decoupled-min-lr`` and neither
    ``--override-opt_param-scheduler`` nor ``--use-checkpoint-opt_param-scheduler`` is given.
    With the first the param groups load with this run's values
    (:func:`..compat.training.load_optimizer_with_new_lr`; without it megatron-core 0.19.2
    failed with "ValueError: Could not find parameter group with key (None, 0.0005, 0.0001,
    ...)", the distributed optimizer "KeyError: (None, 0.0005, ...)", a traceback on every rank;
    measured: tiny.sh, 1 rank, --lr 1e-3 -> 5e-4) and its ``OptimizerParamScheduler`` takes this
    run's schedule, which it would otherwise refuse as another one; with the second this run
    takes the checkpoint's values (:func:`take_checkpoint_lr`; before, the same refusal, which
    named only the first). ``--decoupled-lr`` given in one run only is refused with the first:
    the embedding and output layer then have a param group of their own in one run only
    (megatron-core 0.19.2's ``get_standard_config_overrides``), which its pairing cannot match
    (measured: tiny.sh, 1 rank, plain optimizer, saved with --decoupled-lr 2e-3, resumed
    without: "ValueError: Cannot merge two lists with different lengths (3 and 2, encountered
    at level ('optimizer', 'param_groups'))"; another --decoupled-lr in both runs loads and
    trains). Not where a layout change starts the optimizer over (:func:`restores_optimizer`)."""
    if not restores_optimizer(args, saved) or args.use_checkpoint_opt_param_scheduler:
        return None
    differ = _changes(args, saved, LR_ARGS)
    if not differ:
        return None
    head = f"{flag} {load_dir}: the checkpoint's optimizer was saved with {', '.join(differ)}"
    keep = "--use-checkpoint-opt_param-scheduler to train on with the checkpoint's"
    fresh = (
        "--no-load-optim to train on with this run's (the Adam moments and the learning-rate "
        "schedule start anew, the iteration number goes on)"
    )
    if (getattr(saved, "decoupled_lr", None) is None) != (args.decoupled_lr is None):
        return (
            f"{head}: with --decoupled-lr in one run only the embedding and output layer have "
            "a parameter group of their own in one run only, which megatron-core 0.19.2 cannot "
            f"match; give the checkpoint's --decoupled-lr, or use {keep} learning rates, or add "
            + fresh
        )
    if args.override_opt_param_scheduler:
        return None
    return (
        f"{head}: add --override-opt_param-scheduler to train on with this run's learning rates "
        f"and schedule, or {keep}, the Adam moments kept; or give the checkpoint's values, or "
        "add " + fresh
    )


def unused_checkpoint_schedule_warning(args, saved, model_only: bool) -> str | None:
    """``--use-checkpoint-opt_param-scheduler`` where megatron-core 0.19.2 loads no scheduler
    state (it comes with the optimizer's): the model alone (``model_only``: ``--finetune``,
    ``--pretrained-checkpoint``, a release), ``--no-load-optim``, or a layout change that starts
    the optimizer over (:func:`restores_optimizer`). The flag then does nothing and this run's
    schedule flags apply, silently before; the warning says so (None: the state is loaded, or
    the flag is not given)."""
    if not args.use_checkpoint_opt_param_scheduler or saved is None:
        return None
    if model_only:
        why = "this run loads the checkpoint's model alone (--finetune, --pretrained-checkpoint "
        why += "or a release checkpoint)"
    elif args.no_load_optim:
        why = "--no-load-optim loads no optimizer state"
    elif not restores_optimizer(args, saved):
        why = "the optimizer starts over on this run's parallel layout"
    else:
        return None
    return (
        f"--use-checkpoint-opt_param-scheduler does nothing here: {why}, and the learning-rate "
        "schedule comes with the optimizer state; this run's schedule flags apply"
    )


def take_checkpoint_lr(args, saved) -> str | None:
    """``--use-checkpoint-opt_param-scheduler`` where this run restores the checkpoint's
    optimizer (its args ``saved``; the caller checks :func:`restores_optimizer`): this run's
    :data:`LR_ARGS` are set to the checkpoint's, so megatron-core 0.19.2 builds the param groups
    as the run that saved it did (its pairing finds them, the decoupled one included) and its
    ``OptimizerParamScheduler``, which this flag makes take the checkpoint's schedule, steps
    them by it: the run logs the learning rates an uninterrupted run would have, and its own
    checkpoints record them (a later resume pairs them again). Measured: tiny.sh, 1 rank, saved
    at iteration 2 with --lr 1e-3 --min-lr 1e-4, resumed with --lr 5e-4 --min-lr 5e-5
    --decoupled-lr 2e-3: iteration 3 logs the saving run's 2.452233e-04 and its checkpoint equals
    the saving run's; the args left as given, "KeyError: (None, 0.002, 5e-05, ...)" (distributed
    optimizer). The scheduler takes the checkpoint's weight-decay schedule too (:data:`WD_ARGS`),
    which the param groups do not pair by; those args are set to the checkpoint's all the same,
    so that this run's checkpoints record the schedule their scheduler state holds: left as
    given, a later resume with this flag and the same --weight-decay again compared it with
    this run's recorded one and said nothing, while the schedule kept the first checkpoint's.
    The checkpoint's schedule lengths and LR decay style (:func:`_schedule_changes`) are named
    too, their flags left as given (--train-iters still ends the run). Returns the warning that
    says which flags go unused (None: the checkpoint's values are this run's, or the flag is not
    given)."""
    if not args.use_checkpoint_opt_param_scheduler:
        return None
    differ = {
        "learning rates": _changes(args, saved, LR_ARGS),
        "weight decay": _wd_changes(args, saved),
        "schedule lengths": _schedule_changes(args, saved),
    }
    names = [name for name, changes in differ.items() if changes]
    if not names:
        return None
    for dest in (*LR_ARGS, "weight_decay", *WD_ARGS):
        if hasattr(saved, dest):
            setattr(args, dest, getattr(saved, dest))
    unused = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    verb = "is" if names == ["weight decay"] else "are"
    return (
        f"--use-checkpoint-opt_param-scheduler: this run's {unused} {verb} not used, the "
        "checkpoint's schedule goes on with its own: "
        + ", ".join(c for changes in differ.values() for c in changes)
    )


ROUTING_STATE = {
    ".router.expert_bias": "expert bias (router.expert_bias)",
    ".router.qb_beta": "quantile thresholds (router.qb_beta)",
}
"""The router buffers a balancer keeps in its checkpoints (checkpoint key suffix: what it is), as
megatron-core 0.19.2 registers them persistent: ``expert_bias`` for our QB (its bias) and for the
sign update (``--moe-router-enable-expert-bias``), ``qb_beta`` for its ``quantile_balancing``."""


def routing_state(a) -> tuple[str, ...]:
    """The :data:`ROUTING_STATE` keys a run with the args ``a`` keeps (and so loads)."""
    from megatron_latentmoe.fields import QUANTILE_HISTOGRAM, balancer_list

    types = balancer_list(getattr(a, "moe_router_load_balancing_type", None))
    bias = QUANTILE_HISTOGRAM in types or getattr(a, "moe_router_enable_expert_bias", False)
    return (".router.expert_bias",) * bool(bias) + (".router.qb_beta",) * (
        "quantile_balancing" in types
    )


def fresh_routing_state(args, saved) -> tuple[str, ...]:
    """The router buffers this run's balancer keeps that the checkpoint's (its args ``saved``)
    did not: trained with ``aux_loss`` and resumed with QB, ``--moe-router-enable-expert-bias``
    or ``quantile_balancing`` (or from either of those to another of them).
    megatron-core 0.19.2 failed such a load on every rank with a traceback ("KeyError:
    'decoder.layers.1.mlp.router.expert_bias from model not in state dict'", measured: tiny.sh,
    1 rank, aux_loss -> quantile_histogram, none --moe-router-enable-expert-bias, and
    quantile_balancing; quantile_balancing -> quantile_histogram); the entry point loads the rest
    and these start as in a new run (:func:`fresh_routing_state_warning`). The other way round
    (a buffer the checkpoint holds and this run's balancer does not keep) Megatron loads without
    it; QB <-> the sign update keep the one bias both route with."""
    if saved is None:
        return ()
    return tuple(k for k in routing_state(args) if k not in routing_state(saved))


def _balancer_flags(a) -> str:
    from megatron_latentmoe.fields import balancer_list

    types = balancer_list(getattr(a, "moe_router_load_balancing_type", None))
    bias = (
        " --moe-router-enable-expert-bias" if getattr(a, "moe_router_enable_expert_bias", 0) else ""
    )
    return f"--moe-router-load-balancing-type {' '.join(map(str, types))}{bias}"


def fresh_routing_state_warning(
    args, saved, load_dir: str, flag: str = "--load", resumed: bool = True
) -> str | None:
    """The warning of a load whose router state starts anew (:func:`fresh_routing_state`), or
    None. ``resumed``: the run goes on from the checkpoint's iteration (not a load of the model
    alone, which starts at iteration 0), where ``--moe-qb-calibrate-batches`` solves no bias
    (:mod:`.qb_calibrate`): the line says so, and that ``--finetune`` calibrates."""
    fresh = fresh_routing_state(args, saved)
    if not fresh:
        return None
    what = " and ".join(ROUTING_STATE[k] for k in fresh)
    calibrate = getattr(args, "moe_qb_calibrate_batches", None)
    uncalibrated = resumed and calibrate and ".router.expert_bias" in fresh
    return (
        f"{flag} {load_dir}: the checkpoint was trained with {_balancer_flags(saved)}, which "
        f"keeps no {what}: with {_balancer_flags(args)} it starts at 0, as in a new run (every "
        "other tensor is loaded)"
        + (
            f"; --moe-qb-calibrate-batches {calibrate} solves it only in a run that starts at "
            "iteration 0 (--finetune), not in a resumed one"
            if uncalibrated
            else ""
        )
    )


LAYOUT_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "context_parallel_size",
    "data_parallel_size",
)


def legacy_layout_refusal(args, saved, path: str | None, load_arg: str = "load") -> str | None:
    """One line when the checkpoint ``--load`` resumes from (its folder ``path``, from
    :func:`resumed_by_args`; its args ``saved``) is a legacy ``torch`` one of another tensor /
    pipeline / expert layout: megatron-core 0.19.2 keeps one
    file per (TP, PP, EP) rank of that layout and does not reshard it; it looked for this run's
    rank files, printed "could not load the checkpoint" and exited 0 on every rank, having
    trained nothing (EP1 -> EP2, measured). Its distributed (``torch_dist``) checkpoint does
    reshard: the line says how to get one. ``load_arg``: the folder's flag (:func:`loaded_arg`)."""
    if saved is None or checkpoint_format(path) != "torch":
        return None
    from megatron_latentmoe.training.arguments import flag_for_field

    differ = [
        f"{flag_for_field(f)} {getattr(saved, f)} (this run: {getattr(args, f)})"
        for f in LAYOUT_FIELDS[:4]
        if getattr(saved, f, None) not in (None, getattr(args, f, None))
    ]
    if not differ:
        return None
    flag = f"{load_flag(load_arg)} {getattr(args, load_arg)}"
    return (
        f"{flag}: {path} is a legacy torch checkpoint of another parallel layout: "
        f"{', '.join(differ)}; megatron-core 0.19.2 loads one only in the layout "
        "it was saved with. Resume once in that layout with --ckpt-format torch_dist "
        "--auto-detect-ckpt-format (it then saves a torch_dist checkpoint, which loads into "
        "another layout), or pass that layout"
    )


# --------------------------------------------------------------------------- a layout change
def layout_changed(args, saved) -> bool:
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


# Both runs need these for megatron-core 0.19.2 to reshard the Adam moments on a layout change.
RESHARDABLE_OPTIM_FLAGS = ("--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable")


def _reshardable_optim(a) -> bool:
    """Megatron saves (and loads) this run's optimizer state in a layout-independent form:
    the distributed optimizer in the ``fully_reshardable`` format."""
    return bool(getattr(a, "use_distributed_optimizer", False)) and bool(
        getattr(a, "dist_ckpt_optim_fully_reshardable", False)
    )


def plan_layout_change(args, saved) -> None:
    """Loading a checkpoint saved with another parallel layout (e.g. EP2 -> TP2+SP, EP2 -> PP2).

    Megatron reshards the weights and QB biases. The Adam moments and the scheduler state are
    loaded too where megatron-core 0.19.2 reshards them: the distributed optimizer in the fully
    reshardable format, at save and now (:data:`RESHARDABLE_OPTIM_FLAGS`). Otherwise (its plain
    optimizer cannot map saved param groups onto another layout: "Could not find parameter
    group with key ...") the moments start over and the LR / weight-decay schedule is stepped to
    the loaded iteration; a warning names the flags that would have kept them, or says that the
    checkpoint holds none (saved with ``--no-save-optim``: measured, tiny.sh EP2 -> EP1, plain
    optimizer, the run trains on from the checkpoint's iteration; the flags would not help).
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
            print0(f"[{PROG}] {what} and optimizer state at iteration {iteration}")
            return
        if opt_param_scheduler is not None and iteration > 0:
            opt_param_scheduler.step(increment=iteration * args.global_batch_size)
        if keep:
            why = "--no-load-optim"
        elif getattr(saved, "no_save_optim", False):
            why = "the checkpoint was saved with --no-save-optim: it holds no optimizer state"
        else:
            why = (
                "megatron-core 0.19.2 reshards optimizer state only when the checkpoint was saved "
                f"and is loaded with {' '.join(RESHARDABLE_OPTIM_FLAGS)}"
            )
        print0(
            f"[{PROG}] WARNING: {what} at iteration {iteration}; Adam moments start over ({why}); "
            "LR schedule stepped to the loaded iteration."
        )

    install_layout_change_load(args, keep, on_load)
