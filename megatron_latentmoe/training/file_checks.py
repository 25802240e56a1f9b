"""The files and folders a run reads and writes, checked before any rank starts.

``--save`` and ``--data-cache-path`` (:func:`folder_refusal`): megatron-core 0.19.2 fails on a
folder it cannot create or write only when it first writes there (the first checkpoint, after
the iterations before it; the dataset index cache), with a traceback.

``--save`` filling its disk during a save (:func:`disk_full`, :func:`disk_full_error`): a torch
DCP ``CheckpointException`` traceback on every rank and the unfinished ``iter_*`` folder left
behind; the entry point makes it one line (the one check here made after the start).

``--load``: what is wrong with the folder, found before any rank loads it.

megatron-core 0.19.2 meets each of these in the middle of its load, on every rank, as a Python
traceback (``FileNotFoundError`` for a tracker naming a folder that is not there; torch DCP's
``CheckpointException`` around an ``EOFError`` or an ``UnpicklingError`` for a shard file or
``.metadata`` cut short; a ``JSONDecodeError`` for a cut ``metadata.json``), or not at all: a
Hugging Face export given to ``--load`` trains from random weights after one warning line.
:func:`load_refusal` reads only the tracker, ``metadata.json``, torch DCP's ``.metadata`` and the
shard files' sizes (no tensor), so the flag check can afford it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from megatron_latentmoe.checkpoint_layout import (
    TRACKER_FILE,
    iteration_dir_name,
    tracked_checkpoint_dir,
)

HF_IMPORT = "python -m megatron_latentmoe.convert import --hf {path} --output SAVE_ROOT"


def _nearest_existing(path: str) -> Path:
    """``path``, or the nearest of its parents that exists (where it would be created)."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def folder_refusal(flag: str, path: str | None) -> str | None:
    """One line when ``path`` cannot become a folder this process writes in: it, or the
    nearest of its parents that exists, is not a folder or not writable (None: it can, or no
    path). Nothing is created. A read-only file system (``statvfs``'s ``ST_RDONLY``) is named as
    such; ``os.access`` refuses it too (access(2)'s EROFS, root included: checked on a read-only
    tmpfs and a read-only bind mount), as "not writable"."""
    if not path:
        return None
    existing = _nearest_existing(path)
    if not existing.is_dir():
        why = f"{existing} is not a folder"
    elif os.statvfs(existing).f_flag & os.ST_RDONLY:
        why = f"{existing} is on a read-only file system"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable"
    else:
        return None
    return f"{flag} {path}: {why}; give a folder this run can create or write in"


def checkpoint_bytes(args) -> int | None:
    """A lower bound of the bytes one checkpoint of this run takes: its tensors' bytes (the
    model's, from the converter's tensor list ``convert.names.iter_tensor_maps``, in
    ``--params-dtype``, the QB biases in fp32; Adam's two moments and, for bf16/fp16 weights, the
    fp32 main weights, unless ``--no-save-optim``). Not counted: the files' per-tensor overhead,
    torch DCP's ``.metadata``, the RNG and scheduler state: the tiny model's checkpoints are
    3.9 % (fp32), 4.3 % (--bf16) and 5.5 % (--no-save-optim) larger (measured: 22.02, 25.78
    and 7.45 MB). None for a model the converter does not describe (e.g. ``--qk-layernorm``:
    Megatron trains it, the HF model has no such tensors)."""
    import torch

    from megatron_latentmoe.convert.arch import ModelArch
    from megatron_latentmoe.convert.errors import ConversionError
    from megatron_latentmoe.convert.names import iter_tensor_maps

    try:
        arch = ModelArch.from_megatron_args(args, source="this run's flags")
    except ConversionError:
        return None
    params_dtype = getattr(args, "params_dtype", torch.float32)
    weights = [t for t in iter_tensor_maps(arch) if not t.zeros]
    trained = sum(t.numel() for t in weights if not t.fp32)
    total = 4 * sum(t.numel() for t in weights if t.fp32) + trained * params_dtype.itemsize
    if not getattr(args, "no_save_optim", False) and getattr(args, "optimizer", "") == "adam":
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            total += trained * getattr(args, name, torch.float32).itemsize
        if params_dtype != torch.float32:
            total += trained * getattr(args, "main_params_dtype", torch.float32).itemsize
    return total


def save_space_warning(args) -> str | None:
    """One line when the free space under ``--save`` is less than one checkpoint of this run
    (:func:`checkpoint_bytes`): the first save would fill the disk, after the iterations before
    it. A warning, not a refusal: space may be freed meanwhile, and the size is a lower bound."""
    if not args.save:
        return None
    need = checkpoint_bytes(args)
    free = shutil.disk_usage(_nearest_existing(args.save)).free
    if need is None or free >= need:
        return None
    return (
        f"--save {args.save}: {_megabytes(free)} free there, less than one checkpoint of this "
        f"run (at least {_megabytes(need)}: its weights and optimizer state): the first save "
        "will likely fill the disk"
    )


def _enospc(err: BaseException | None, seen: set[int] | None = None) -> bool:
    """``err``, what it was raised from or during, or a rank's error in a torch DCP
    ``CheckpointException`` is an ``OSError`` ENOSPC."""
    seen = set() if seen is None else seen
    if err is None or id(err) in seen:
        return False
    seen.add(id(err))
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    failures = getattr(err, "failures", None)
    wrapped = [f[0] for f in failures.values()] if isinstance(failures, dict) else []
    return any(_enospc(e, seen) for e in (err.__cause__, err.__context__, *wrapped))


def disk_full(err: BaseException, save_dir: str) -> bool:
    """A failed checkpoint save (``err``) ran out of space on ``save_dir``'s file system: an
    ENOSPC in the error, or no block left there for this process (``statvfs``'s ``f_bavail``).

    The second is what each rank can see: megatron-core 0.19.2's DCP writer keeps only a
    worker error's type (``RuntimeError: Worker failure: An error is caught while starting
    worker 0, error: <class 'OSError'>``), the rank that got torch's zip writer's error instead
    (``unexpected pos 704 vs 598``) holds no ENOSPC at all, and ranks other than the
    coordinator get ``CheckpointException`` with no failures (measured on a full tmpfs)."""
    if _enospc(err):
        return True
    try:
        return os.statvfs(save_dir).f_bavail == 0
    except OSError:
        return False


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def disk_full_error(save_dir: str, iteration: int, ckpt_format: str) -> str:
    """The one line for a save of ``iteration`` into ``save_dir`` that ran out of space, after
    removing the unfinished ``iter_*`` folder (rank 0 only; every rank's writes have ended:
    Megatron's DCP save reports a failure only after a barrier and the gather of every rank's
    write results, and the files only rank 0 writes, ``metadata.json`` and the tracker, come
    after that, while the other ranks wait in a barrier). The folder is kept where a resume
    would load it (the tracker names it, or it is complete: a tracker cut by the full disk is
    repaired at the resume)."""
    from megatron_latentmoe.training.pretrain import repair_checkpoint_tracker

    root = Path(save_dir)
    unfinished = root / iteration_dir_name(iteration)
    resume = repair_checkpoint_tracker(save_dir, ckpt_format, write=False)
    try:
        named = tracked_checkpoint_dir(root)
    except ValueError:  # a tracker the full disk cut: names nothing
        named = None
    removed = ""
    if unfinished.is_dir() and resume != iteration and named != unfinished:
        shutil.rmtree(unfinished, ignore_errors=True)
        removed = f", the unfinished {unfinished} removed"
    usage = shutil.disk_usage(save_dir)
    if resume is None:
        then = "there is no complete checkpoint there: a resume starts from scratch"
    else:
        last = root / iteration_dir_name(resume)
        then = (
            f"a resume (--load {save_dir}) loads iteration {resume} ({last}, "
            f"{_megabytes(_tree_size(last))})"
        )
    return (
        f"--save {save_dir}: the disk filled up while saving the checkpoint of iteration "
        f"{iteration} ({_megabytes(usage.free)} free of {_megabytes(usage.total)}{removed}); "
        f"{then}. Free space there or give --save a folder on a larger disk"
    )


def _is_hf_export(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _torch_dist_refusal(path: Path) -> str | None:
    """A complete-looking ``torch_dist`` folder (``metadata.json`` and ``.metadata`` present)
    whose metadata cannot be read, or whose shard files are missing or shorter than
    ``.metadata`` says."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = json.loads((path / "metadata.json").read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (OSError, ValueError) as e:
        return f"{path / 'metadata.json'} cannot be read ({e})"
    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - any unpickling / IO problem of a cut or corrupt file
        return f"{path / '.metadata'} cannot be read ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for info in storage.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"shard file {shard} is missing"
        if shard.stat().st_size < end:
            return (
                f"shard file {shard} is cut short: {shard.stat().st_size} bytes, where .metadata "
                f"has data up to byte {end}"
            )
    return None


def load_refusal(load_dir: str | None, ckpt_format: str) -> str | None:
    """One line saying what is wrong with ``--load load_dir`` and what to do, or None (nothing
    wrong, or nothing to load: a run given an empty or new folder starts from scratch, as
    Megatron does). Looks at the checkpoint the run would resume from after
    ``pretrain.repair_checkpoint_tracker``; checks its files for ``torch_dist`` only."""
    from megatron_latentmoe.training.pretrain import repair_checkpoint_tracker

    if not load_dir or not os.path.isdir(load_dir):
        return None
    root = Path(load_dir)
    if _is_hf_export(root) and not (root / TRACKER_FILE).exists():
        return (
            f"--load {load_dir} is a Hugging Face export (config.json, *.safetensors), not a "
            f"Megatron checkpoint: Megatron would start from random weights. Import it first "
            f"({HF_IMPORT.format(path=load_dir)}) and give --load SAVE_ROOT"
        )
    iteration = repair_checkpoint_tracker(load_dir, ckpt_format, write=False)
    if iteration is None:
        tracker = root / TRACKER_FILE
        try:
            text = tracker.read_text().strip() if tracker.is_file() else ""
        except (OSError, UnicodeDecodeError):
            text = ""
        if text.isdecimal() and not (root / iteration_dir_name(int(text))).is_dir():
            return (
                f"--load {load_dir}: {tracker} names iteration {int(text)}, but "
                f"{root / iteration_dir_name(int(text))} is not there and no other complete "
                f"checkpoint is: give --load the folder that holds it, or delete {tracker} to "
                "start from scratch"
            )
        return None
    if ckpt_format != "torch_dist":
        return None
    path = root / iteration_dir_name(iteration)
    problem = _torch_dist_refusal(path)
    if problem is None:
        return None
    return (
        f"--load {load_dir}: the checkpoint of iteration {iteration} is damaged: {problem}. "
        f"Write {TRACKER_FILE} with an earlier iteration whose folder is whole, or delete "
        f"{path.name} (the run then resumes from the newest complete one)"
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
    "padded_vocab_size",
)
"""The args that set a tensor's shape, as the checkpoint's args and this run's hold them (the
vocabulary: the tokenizer's, padded; every other is named by its flag)."""


def shape_refusal(load_dir: str, args, saved) -> str | None:
    """One line naming the model flags whose values in the checkpoint's args (``saved``; None:
    nothing to load) differ from this run's: megatron-core's load fails on the first tensor
    of another shape with a ``CheckpointException`` traceback (``Global shape mismatch``)."""
    if saved is None:
        return None
    from megatron_latentmoe.training.arguments import flag_for_field

    def name(dest: str) -> str:
        return "the padded vocabulary" if dest == "padded_vocab_size" else flag_for_field(dest)

    differ = [
        f"{name(dest)} {getattr(saved, dest)} (this run: {getattr(args, dest)})"
        for dest in SHAPE_ARGS
        if getattr(saved, dest, None) is not None
        and getattr(args, dest, None) is not None
        and getattr(saved, dest) != getattr(args, dest)
    ]
    if not differ:
        return None
    return (
        f"--load {load_dir}: the checkpoint is of another model shape: {', '.join(differ)}. Give "
        "the checkpoint's model flags, or --use-checkpoint-args to take them from it"
    )
