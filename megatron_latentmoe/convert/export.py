"""Megatron ``torch_dist`` checkpoint (any parallel layout) -> Hugging Face model directory.

Output (written into a temporary directory next to the target, renamed at the end)::

    config.json                      model_type stable_latentmoe, SPEC §6 + attention keys, auto_map
    generation_config.json           bos / eos / pad ids
    configuration_stable_latentmoe.py, modeling_stable_latentmoe.py   (trust_remote_code)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json    (the training tokenizer)
    model-00001-of-0000N.safetensors ...  + model.safetensors.index.json

Streaming: the safetensors headers are planned up front from the model config (every tensor's
name, shape and dtype is known before any data is read), then tensors are read from the
checkpoint in small batches (``read_batch_bytes``), converted, and appended to the open shard.
Peak memory is about one read batch plus the largest tensor, independent of the model size.
The HF config and the tokenizer are checked before any tensor is read.

``expert_dtype="mxfp4"``: the routed experts are written MXFP4-packed (layout and config:
``convert/mxfp4.py``), quantized from the checkpoint's own values (before any ``dtype`` cast), as
QAT's forward does; widths that are not a multiple of 32 are refused before anything is written.

Tokenizer (``tokenizer_dir="default"``): the HF tokenizer directory the checkpoint was trained
with (megatron.training's ``--tokenizer-model``, read from the checkpoint's args; the package's
own tokenizer if the run used it, wherever that clone was), else the package's tokenizer for a
checkpoint without args. Only tokenizer files are copied (``TOKENIZER_FILE_PATTERNS``); it must
load and fit the vocabulary. For a megatron.training checkpoint its bos / eos / pad ids go into
the config (the training args do not record them); a converter-written checkpoint keeps its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import struct
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from megatron_latentmoe.balancing import non_finite_entries
from megatron_latentmoe.data import is_shipped_tokenizer
from megatron_latentmoe.data.corpus import default_tokenizer_dir
from megatron_latentmoe.fields import not_allowed

from . import mxfp4
from .arch import ARCH_STATE_KEY, ModelArch
from .dist_reader import DistCheckpointReader, open_checkpoint
from .errors import ConversionError
from .names import TensorMap, hf_dtype_for, iter_tensor_maps
from .options import (
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_READ_BATCH_MB,
    DEFAULT_VERIFY_TOKENS,
    DTYPE_CHOICES,
    DTYPE_TORCH_NAMES,
    EXPERT_DTYPES,
)
from .summary import (
    ConversionSummary,
    Progress,
    Timer,
    atomic_output_dir,
    check_not_an_input,
    check_output_dir,
)
from .verify import check_verify_length, verify_text_ids

DTYPES = {
    name: getattr(torch, torch_name)
    for short, torch_name in DTYPE_TORCH_NAMES.items()
    for name in (short, torch_name)
}
"""``dtype`` names (``--dtype``'s and torch's) -> torch dtype."""
ST_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.uint8: "U8",
}
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
INDEX_FILE = "model.safetensors.index.json"


def parse_size(text: str | int) -> int:
    """'5GB' / '500MB' / '2GiB' / 1000000 -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    units = {
        "KIB": 1 << 10,
        "MIB": 1 << 20,
        "GIB": 1 << 30,
        "TIB": 1 << 40,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "B": 1,
    }
    for unit, mult in units.items():
        if s.endswith(unit):
            try:
                return int(float(s[: -len(unit)]) * mult)
            except (ValueError, OverflowError):  # not a number; inf
                break
    try:
        return int(s)
    except ValueError:
        raise ConversionError(
            f"size {text!r} is not understood: use e.g. 5GB, 500MB, 2GiB"
        ) from None


def check_expert_dtype(expert_dtype: str, arch: ModelArch) -> bool:
    """Validate ``expert_dtype`` for ``arch``; True for MXFP4 (before anything is written)."""
    if expert_dtype not in EXPERT_DTYPES:
        raise not_allowed("expert_dtype", expert_dtype, f"one of {EXPERT_DTYPES}", ConversionError)
    if expert_dtype != "mxfp4":
        return False
    from megatron_latentmoe.ops.mxfp4 import BLOCK

    for field, value, tensors in (
        ("moe_latent_size", arch.moe_latent_size, "w1/w3"),
        ("moe_ffn_hidden_size", arch.moe_ffn_hidden_size, "w2"),
    ):
        if value % BLOCK:
            raise ConversionError(
                f"--expert-dtype mxfp4: {field}={value} (the reduction width of the routed "
                f"experts' {tensors}) is not a multiple of the MXFP4 block size {BLOCK}; MXFP4 "
                "blocks are never padded. Export with --expert-dtype auto"
            )
    return True


def parse_dtype(name: str) -> torch.dtype | None:
    if name in (None, "auto"):
        return None
    if name not in DTYPES:
        raise not_allowed("dtype", name, f"one of {', '.join(DTYPE_CHOICES)}", ConversionError)
    return DTYPES[name]


# ------------------------------------------------------------------------- safetensors writer


class ShardedSafetensorsWriter:
    """Writes a planned list of tensors into size-capped safetensors shards, one tensor at a time.

    ``plan``: [(name, shape, dtype)] in the order the tensors will be written. Each shard's
    header (names, dtypes, shapes, byte offsets) is written when the shard is opened, so nothing
    but the tensor being written is held in memory.
    """

    def __init__(
        self,
        directory: Path,
        plan: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
        max_shard_bytes: int,
    ):
        self.directory = Path(directory)
        self.shards: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
        size = 0
        seen = set()
        for name, shape, dtype in plan:
            if name in seen:
                raise ConversionError(f"tensor {name!r} planned twice")
            seen.add(name)
            n = dtype.itemsize * math.prod(shape)
            if self.shards[-1] and size + n > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append((name, tuple(shape), dtype, n))
            size += n
        count = len(self.shards)
        self.files = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self.weight_map = {
            name: self.files[i] for i, shard in enumerate(self.shards) for name, *_ in shard
        }
        self.total_bytes = sum(n for shard in self.shards for *_, n in shard)
        self._order = [(i, entry) for i, shard in enumerate(self.shards) for entry in shard]
        self._pos = 0
        self._file = None
        self._shard = -1
        self.bytes_written = 0

    def _open(self, i: int) -> None:
        if self._file is not None:
            self._file.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype, n in self.shards[i]:
            header[name] = {
                "dtype": ST_DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
        self._file = open(self.directory / self.files[i], "wb")
        self._file.write(struct.pack("<Q", len(blob)))
        self._file.write(blob)
        self._shard = i

    def write(self, name: str, tensor: torch.Tensor) -> int:
        if self._pos >= len(self._order):
            raise ConversionError(f"tensor {name!r} was not planned")
        i, (want, shape, dtype, n) = self._order[self._pos]
        if name != want:
            raise ConversionError(f"tensor {name!r} written out of order (expected {want!r})")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ConversionError(
                f"tensor {name!r}: got {tuple(tensor.shape)} {tensor.dtype}, "
                f"planned {shape} {dtype}"
            )
        if i != self._shard:
            self._open(i)
        data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._pos += 1
        self.bytes_written += n
        return n

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._pos != len(self._order):
            missing = self._order[self._pos][1][0]
            raise ConversionError(
                f"only {self._pos} of {len(self._order)} tensors were written "
                f"(next expected: {missing!r})"
            )
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def cast_checked(name: str, tensor: torch.Tensor, to: torch.dtype, option: str) -> torch.Tensor:
    """``tensor`` in ``to``; a ConversionError naming ``--dtype``'s value ``option`` where fp16's
    range (65504) would turn a finite value into inf (bf16 shares fp32's range)."""
    out = tensor.to(to)
    if to == torch.float16 and not bool(torch.isfinite(out).all()):
        finite = tensor[torch.isfinite(tensor)].abs()
        top = torch.finfo(torch.float16).max
        if finite.numel() and finite.max().item() > top:
            raise not_allowed(
                "dtype",
                option,
                f"bf16 or fp32 for this checkpoint: {name!r} holds |values| up to "
                f"{finite.max().item():.4g}, above fp16's largest, {top:.0f}",
                ConversionError,
            )
    return out


def checked_bias(name: str, tensor: torch.Tensor, tm: TensorMap) -> torch.Tensor:
    """``tensor`` as it is, unless it is the expert bias (``tm.fp32``) and holds NaN / inf: a
    ConversionError naming it (converted, a NaN bias would send every token to that expert, and
    training refuses such a bias at load)."""
    bad = non_finite_entries(tensor) if tm.fp32 and not tm.zeros else None
    if bad:
        raise ConversionError(
            f"{name} = {bad}; allowed: finite values (a corrupt checkpoint: convert an earlier one)"
        )
    return tensor


# ----------------------------------------------------------------------------------- checking


def _expected_lead(key: str, arch: ModelArch) -> tuple[int, ...]:
    """Sizes of the stacked leading axes of a checkpoint key (layers, experts)."""
    lead = []
    if (
        key.startswith("decoder.layers.")
        and not key[len("decoder.layers.") :].split(".", 1)[0].isdigit()
    ):
        lead.append(arch.num_layers)
    if "mlp.experts.experts." in key:
        tail = key.split("mlp.experts.experts.", 1)[1]
        if not tail.split(".", 1)[0].isdigit():
            lead.append(arch.num_experts)
    return tuple(lead)


def match_checkpoint(reader: DistCheckpointReader, arch: ModelArch, ckpt_name: str):
    """Locate every canonical tensor the checkpoint stores (all but the ``zeros`` maps); raise one
    ConversionError listing missing tensors, shape mismatches and unexpected model tensors.
    Returns the number of canonical tensors located."""
    missing, mismatched, used = [], [], set()
    count = 0
    for tm in iter_tensor_maps(arch):
        if tm.zeros:
            continue
        count += 1
        loc = reader.locate(tm)
        if loc is None:
            missing.append(
                tm.megatron
                if tm.checkpoint_name is None
                else f"{tm.megatron} (saved as {tm.checkpoint_name})"
            )
            continue
        used.update(loc.keys)
        for key, lead in loc.parts:
            want_lead = _expected_lead(key, arch)
            have = reader.shape(key)
            if have[: len(lead)] != want_lead[: len(lead)]:
                mismatched.append(
                    f"{key}: stacked axes {have[: len(lead)]} but the config implies "
                    f"{want_lead[: len(lead)]} (num_layers / num_experts)"
                )
        found = reader.location_shape(loc)
        if found != tm.shape:
            mismatched.append(
                f"{tm.megatron} (checkpoint key {loc.keys[0]!r}): shape {found}, config "
                f"implies {tm.shape}"
            )
        elif not reader.dtype(loc.keys[0]).is_floating_point:
            mismatched.append(
                f"{tm.megatron}: dtype {reader.dtype(loc.keys[0])} is not floating point"
            )
    unexpected = [k for k in reader.model_keys() if k not in used]
    problems = []
    if missing:
        problems.append(
            f"missing tensor(s) ({len(missing)}): {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
    if mismatched:
        problems.append(
            f"shape mismatch ({len(mismatched)}):\n    "
            + "\n    ".join(mismatched[:8])
            + ("\n    ..." if len(mismatched) > 8 else "")
        )
    if unexpected:
        problems.append(
            f"unexpected tensor(s) not described by the config ({len(unexpected)}): "
            f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    if problems:
        raise ConversionError(
            f"checkpoint {ckpt_name!r} does not match the model config:\n  " + "\n  ".join(problems)
        )
    return count


# ------------------------------------------------------------------------------------- export


def _batches(maps: Iterable[TensorMap], budget: int) -> Iterable[list[TensorMap]]:
    batch, size = [], 0
    for tm in maps:
        n = tm.numel() * 4
        if batch and size + n > budget:
            yield batch
            batch, size = [], 0
        batch.append(tm)
        size += n
    if batch:
        yield batch


HF_CODE_DIR = Path(__file__).resolve().parent.parent / "hf"
REMOTE_CODE_FILES = ("configuration_stable_latentmoe.py", "modeling_stable_latentmoe.py")


def _hf_config_class():
    """The HF config class, loaded from its file alone: importing the ``megatron_latentmoe.hf``
    package would also import the modeling code and with it most of transformers (~3 s)."""
    import importlib.util

    name = "_stable_latentmoe_configuration"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(
            name, HF_CODE_DIR / "configuration_stable_latentmoe.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module.StableLatentMoEConfig


def resolve_tokenizer_dir(tokenizer_dir: str | None, common_state: dict) -> str | None:
    """The tokenizer directory to ship: an explicit one, None, or for ``"default"`` the training
    run's (see the module docstring). Raises :class:`ConversionError` if it cannot be told."""
    if tokenizer_dir != "default":
        return tokenizer_dir
    args = common_state.get("args")
    kind, model = getattr(args, "tokenizer_type", None), getattr(args, "tokenizer_model", None)
    if args is None or (kind is None and model is None):
        return default_tokenizer_dir()
    if kind in (None, "HuggingFaceTokenizer") and model:
        if Path(model).is_dir():
            return str(model)
        if is_shipped_tokenizer(model):
            return default_tokenizer_dir()  # the package's tokenizer, trained in another clone
        raise ConversionError(
            f"the checkpoint was trained with --tokenizer-model {model!r}, which is not a "
            "directory here; pass --tokenizer DIR (its HF tokenizer files) or --tokenizer none"
        )
    raise ConversionError(
        f"the checkpoint was trained with --tokenizer-type {kind} (--tokenizer-model {model!r}); "
        "pass --tokenizer DIR with its HF tokenizer files, or --tokenizer none"
    )


TOKENIZER_FILE_PATTERNS = (
    "tokenizer*.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "tokenization_*.py",
    "chat_template*",
)
"""The files of an HF tokenizer: only these are copied from a tokenizer directory (a training run's
--tokenizer-model is often a whole HF model folder, whose config and weights must not come
along)."""


def tokenizer_files(src: Path) -> list[Path]:
    return sorted(
        {p for pattern in TOKENIZER_FILE_PATTERNS for p in src.glob(pattern) if p.is_file()}
    )


def prepare_hf_metadata(
    arch: ModelArch, dtype: torch.dtype, tokenizer_dir: str | None, adopt_token_ids: bool = False
):
    """Check everything the metadata needs BEFORE the tensors stream: the tokenizer (its files,
    loadable, fits ``arch.vocab_size``) and the HF config. ``adopt_token_ids``: take bos / eos /
    pad from the tokenizer (for a megatron.training checkpoint, whose args do not record them);
    otherwise the ids of the model description are kept.
    Returns ``(hf_config, arch, tokenizer files to copy)``."""
    files = []
    if tokenizer_dir:
        src = Path(tokenizer_dir)
        if not src.is_dir():
            raise ConversionError(f"tokenizer directory {str(src)!r} does not exist")
        files = tokenizer_files(src)
        if not files:
            raise ConversionError(
                f"tokenizer directory {str(src)!r} has no tokenizer files "
                f"({', '.join(TOKENIZER_FILE_PATTERNS)})"
            )
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(src))
        except Exception as e:  # noqa: BLE001 - any load failure is bad input here
            raise ConversionError(
                f"tokenizer directory {str(src)!r} does not load as an HF tokenizer: {e}"
            ) from None
        if len(tok) > arch.vocab_size:
            raise ConversionError(
                f"tokenizer {str(src)!r} has {len(tok)} tokens, more than the model's "
                f"vocab_size={arch.vocab_size}"
            )
        if adopt_token_ids:
            ids = {
                name: getattr(tok, name)
                for name in ("bos_token_id", "eos_token_id", "pad_token_id")
            }
            arch = dataclasses.replace(arch, **{k: v for k, v in ids.items() if v is not None})
    StableLatentMoEConfig = _hf_config_class()
    try:
        config = StableLatentMoEConfig(
            **arch.to_hf_config_kwargs(),
            dtype=_HF_DTYPE_NAMES[dtype],
            architectures=["StableLatentMoEForCausalLM"],
        )
    except ValueError as e:
        raise ConversionError(
            f"the model config cannot be expressed as an HF config: {e}"
        ) from None
    return config, arch, files


def write_hf_metadata(directory: Path, config, arch: ModelArch, tokenizer_paths) -> None:
    """config.json, generation_config.json, the remote-code files and the tokenizer files."""
    from transformers import GenerationConfig

    config.save_pretrained(directory)
    GenerationConfig(
        bos_token_id=arch.bos_token_id,
        eos_token_id=arch.eos_token_id,
        pad_token_id=arch.pad_token_id,
    ).save_pretrained(directory)
    for name in REMOTE_CODE_FILES:
        shutil.copyfile(HF_CODE_DIR / name, directory / name)
    for p in tokenizer_paths:
        shutil.copyfile(p, directory / p.name)


def export_checkpoint(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    config_file: str | None = None,
    dtype: str = "auto",
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    tokenizer_dir: str | None = "default",
    overwrite: bool = False,
    progress: bool | None = None,
    read_batch_bytes: int = DEFAULT_READ_BATCH_MB << 20,
    expert_dtype: str = "auto",
    verify_seq_len: int | None = None,
    verify_tokens: int = DEFAULT_VERIFY_TOKENS,
    verify_text: str | None = None,
) -> ConversionSummary:
    """Export a Megatron ``torch_dist`` checkpoint to an HF directory (see module docstring).

    ``dtype``: ``auto`` (the checkpoint's), ``bf16``, ``fp32`` or ``fp16``;
    ``e_score_correction_bias`` is always fp32. ``expert_dtype``: ``auto`` or ``mxfp4`` (routed
    experts MXFP4-packed, see the module docstring). ``tokenizer_dir``: ``"default"`` = the training
    run's (see the module docstring), a directory, or None = none. ``progress``: a byte bar on
    stderr, None = on a terminal only (``summary.Progress``). ``verify_seq_len``: the prompt
    length of a ``--verify`` to follow, refused with its ``verify_tokens``
    (:func:`~.verify.check_verify_length`) as soon as the checkpoint's model description is read,
    before anything is written; ``verify_text``: its
    prompt, refused (:func:`~.verify.verify_text_ids`) under the tokenizer to ship, too. Raises
    :class:`ConversionError` on bad input; never leaves a partial output directory.
    """
    timer = Timer()
    check_output_dir(output, overwrite)
    check_not_an_input(output, "--checkpoint", checkpoint)
    out_dtype = parse_dtype(dtype)
    max_shard = parse_size(max_shard_size)
    if max_shard <= 0:
        raise not_allowed("max_shard_size", max_shard_size, "a positive size", ConversionError)
    reader, arch, config_source, common = open_checkpoint(checkpoint, config_file)
    if verify_seq_len is not None:
        check_verify_length(arch, verify_seq_len, verify_tokens)
    check_not_an_input(output, "--checkpoint", reader.path)  # the iteration a save root names
    packed_experts = check_expert_dtype(expert_dtype, arch)
    name = str(reader.path)
    n_maps = match_checkpoint(reader, arch, name)
    tok = resolve_tokenizer_dir(tokenizer_dir, common)
    trained_by_megatron = (
        config_file is None and ARCH_STATE_KEY not in common and common.get("args") is not None
    )

    # dtype and the header plan
    locs_dtype = reader.dtype(reader.locate(next(iter_tensor_maps(arch))).keys[0])
    model_dtype = out_dtype or locs_dtype
    if model_dtype not in _HF_DTYPE_NAMES:
        raise ConversionError(
            f"checkpoint dtype {model_dtype} cannot be exported; pass --dtype bf16/fp32"
        )
    plan, largest = [], 0
    for tm in iter_tensor_maps(arch):
        dt = hf_dtype_for(tm, model_dtype)
        for hf_name, shape in tm.hf:
            if packed_experts and tm.expert is not None:
                plan.extend((n, s, torch.uint8) for n, s in mxfp4.packed_shapes(hf_name, shape))
            else:
                plan.append((hf_name, shape, dt))
        stored = dt if tm.zeros else reader.dtype(reader.locate(tm).keys[0])
        largest = max(largest, tm.numel() * max(dt.itemsize, stored.itemsize))

    hf_config, arch, tok_files = prepare_hf_metadata(
        arch, model_dtype, tok, adopt_token_ids=trained_by_megatron
    )
    if verify_seq_len is not None and verify_text:
        verify_text_ids(tok, verify_text, verify_seq_len, arch.vocab_size)
    if packed_experts:
        hf_config.quantization_config = mxfp4.quantization_config()
    expert_bytes = 0
    summary = ConversionSummary(
        "export", name, str(output), config_source=config_source, largest_tensor_bytes=largest
    )
    with atomic_output_dir(output, overwrite) as tmp:
        writer = ShardedSafetensorsWriter(tmp, plan, max_shard)
        bar = Progress(writer.total_bytes, "export", enabled=progress)
        stream = Timer()
        try:
            budget = max(read_batch_bytes, 1)
            for batch in _batches(iter_tensor_maps(arch), budget):
                read = iter(
                    reader.read_locations([reader.locate(tm) for tm in batch if not tm.zeros])
                )
                tensors = [torch.zeros(tm.shape) if tm.zeros else next(read) for tm in batch]
                for tm, t in zip(batch, tensors, strict=True):
                    t = checked_bias(tm.megatron, t, tm)
                    for hf_name, hf_t in tm.to_hf(t).items():
                        if packed_experts and tm.expert is not None:
                            try:
                                out = mxfp4.pack(hf_name, hf_t)
                            except ValueError as e:
                                raise ConversionError(f"--expert-dtype mxfp4: {e}") from None
                        else:
                            out = {
                                hf_name: cast_checked(
                                    hf_name, hf_t, hf_dtype_for(tm, model_dtype), dtype
                                )
                            }
                        for out_name, out_t in out.items():
                            n = writer.write(out_name, out_t)
                            bar.update(n)
                            expert_bytes += n if tm.expert is not None else 0
                            summary.tensors += 1
                del tensors, read  # the iterator holds the batch too, while the next is read
            writer.close()
        finally:
            bar.close()
        stream_s = stream.elapsed()
        write_hf_metadata(tmp, hf_config, arch, tok_files)
        summary.files = sum(1 for _ in tmp.iterdir())
    summary.bytes_written = writer.bytes_written
    return summary.finish(
        timer,
        bar,
        reader.bytes_read,
        stream_s,
        dtype=str(model_dtype).replace("torch.", ""),
        shards=len(writer.files),
        expert_dtype="mxfp4" if packed_experts else "auto",
        routed_expert_bytes=expert_bytes,
        megatron_tensors=n_maps,
    )
