"""One line for what megatron-core 0.19.2 refuses with a traceback: this module's one job.

Megatron's own checks run after :mod:`.arguments`' (``pretrain.checked_args``), on the args its
``validate_args`` completes: its bare asserts (:func:`megatron_refusal`), its
``TransformerConfig``'s checks (:func:`megatron_config_refusal`), and what it checks only later,
on every rank (the process grid of the experts, :func:`expert_layout_refusal`, and of the
distributed optimizer's instances, :func:`optimizer_instances_refusal`, in
``initialize_model_parallel``; the interleaved schedule's micro-batch groups at the first step,
:func:`interleaved_schedule_refusal`). Each names the flags, their values and what is allowed,
spelt as :mod:`.arguments` spells config fields as flags.
"""

from __future__ import annotations

import math
import os
import re
import traceback

from megatron_latentmoe.training.arguments import (
    ARG_DEST,
    flag_for_field,
    flag_text,
    package_installed,
    pipeline_split_flags,
)

_PIPELINE_TEXT = re.compile(r"pipeline|\bPP\b|stage", re.IGNORECASE)


def megatron_config_refusal(args, err: Exception) -> str:
    """One line for a check of Megatron's ``TransformerConfig`` (a ``ValueError``, or a bare
    assert): its text, and for the checks of the pipeline split (uneven stages,
    ``--pipeline-model-parallel-layout``: a traceback before) the flags that set the split."""
    frames = traceback.extract_tb(err.__traceback__)
    text = str(err) or (frames[-1].line if frames else type(err).__name__)
    in_layout = any("pipeline_parallel_layer_layout" in f.filename for f in frames)
    if in_layout or _PIPELINE_TEXT.search(text):
        return (
            f"{pipeline_split_flags(args)}: Megatron's TransformerConfig refused this pipeline "
            f"split: {text}"
        )
    flags = _config_fields_as_flags(args, text)
    return f"{text} ({flags})" if flags else text


_CONFIG_ALIASES = {"moe_router_padding_for_quantization": "moe_router_padding_for_fp8"}
"""Config fields that a deprecated one also sets (megatron-core 0.19.2's
``TransformerConfig.__post_init__``): a check naming the field names the deprecated flag where
that is the one given."""


def _config_fields_as_flags(args, text: str) -> str:
    """The flags behind the config fields a TransformerConfig check names in ``text``, with
    their values: ``moe_grouped_gemm: --moe-grouped-gemm not given`` (Megatron's messages name
    fields, which are not always the flags' names)."""
    import dataclasses

    from megatron_latentmoe.config import StableLatentMoETransformerConfig

    fields = {f.name for f in dataclasses.fields(StableLatentMoETransformerConfig)}
    named = []
    for field in dict.fromkeys(re.findall(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", text)):
        dest = ARG_DEST.get(field, field)
        if field not in fields or not hasattr(args, dest):
            continue
        given_as = field
        alias = _CONFIG_ALIASES.get(field)
        if alias and getattr(args, alias) and not getattr(args, dest):
            given_as = dest = alias  # set by the deprecated flag, the one given
        value, flag = getattr(args, dest), flag_for_field(given_as)
        given = f"{flag} not given" if value is False or value is None else flag_text(flag, value)
        named.append(f"{field}: {given}")
    return "; ".join(named)


def interleaved_schedule_refusal(args, microbatch_group: int | None) -> str | None:
    """Megatron's interleaved 1F1B (virtual pipeline stages) runs each step's micro-batches in
    groups of ``--microbatch-group-size-per-virtual-pipeline-stage`` (default: the pipeline size)
    and raises, at the first step on every rank, where a group is smaller than the pipeline size
    or larger than the step's micro-batches (training, and evaluation when it runs). None when
    the schedule can run (or there are no virtual stages)."""
    vpp, pp = args.virtual_pipeline_model_parallel_size, args.pipeline_model_parallel_size
    if not vpp or vpp == 1 or args.step_batch_size_schedule:
        return None
    group = microbatch_group or pp
    if group < pp:
        return (
            f"--microbatch-group-size-per-virtual-pipeline-stage {group} is not allowed with "
            f"--pipeline-model-parallel-size {pp} and virtual pipeline stages: at least {pp}"
        )
    dp = args.data_parallel_size
    batches = [("--global-batch-size", args.global_batch_size, args.micro_batch_size)]
    if args.eval_iters and args.eval_iters > 0:
        batches.append(
            ("--eval-global-batch-size", args.eval_global_batch_size, args.eval_micro_batch_size)
        )
    for flag, batch, micro in batches:
        if batch // (micro * dp) < group:
            return (
                f"{flag} {batch} is not allowed with {vpp} virtual pipeline stages per rank "
                f"({pipeline_split_flags(args)}): {micro} sequences per micro-batch x {dp} "
                f"data-parallel ranks give {batch // (micro * dp)} micro-batches per step, and "
                "Megatron's interleaved schedule runs them in groups of "
                f"--microbatch-group-size-per-virtual-pipeline-stage {group} (default: the "
                f"pipeline size); allowed: a multiple of {micro * dp} of at least "
                f"{group * micro * dp}"
            )
    return None


def _grid_refusal(world_size: int, sizes: dict[str, int], advice: str = "") -> str | None:
    """One line refusing a process count that the product of ``sizes`` (label: size) does not
    divide; None when it divides."""
    grid = math.prod(sizes.values())
    if world_size % grid == 0:
        return None
    product = " x ".join(f"{label} {size}" for label, size in sizes.items())
    return (
        f"WORLD_SIZE={world_size} (the processes launched) is not allowed with {product} "
        f"= {grid}: launch a multiple of {grid} processes{advice}"
    )


def _model_parallel_sizes(args) -> dict[str, int]:
    """The sizes whose product ``validate_args`` requires to divide the processes."""
    sizes = {
        "--tensor-model-parallel-size": args.tensor_model_parallel_size,
        "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
        "--context-parallel-size": args.context_parallel_size,
    }
    remat = getattr(args, "gtp_weight_remat_size", 1) or 1
    if remat > 1:
        sizes["the weight-remat size"] = remat
    return sizes


def expert_layout_refusal(args) -> str | None:
    """Megatron's parallel state needs the processes to be a multiple of the experts' grid,
    ``--expert-model-parallel-size`` x ``--expert-tensor-parallel-size`` x
    ``--pipeline-model-parallel-size``, which ``validate_args`` does not check (each rank would
    fail in ``initialize_model_parallel``). None when it divides. The expert tensor parallel
    size defaults to the tensor parallel size, as ``validate_args`` sets it."""
    if not getattr(args, "num_experts", None) or _grid_refusal(
        args.world_size, _model_parallel_sizes(args)
    ):
        return None  # no experts, or validate_args refuses the dense layout first
    sizes = {
        "--expert-model-parallel-size": args.expert_model_parallel_size,
        "--expert-tensor-parallel-size": args.expert_tensor_parallel_size
        or args.tensor_model_parallel_size,
        "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
    }
    return _grid_refusal(args.world_size, sizes, ", or a smaller --expert-model-parallel-size")


def optimizer_instances_refusal(args) -> str | None:
    """``--num-distributed-optimizer-instances N`` (N > 1): megatron-core 0.19.2's parallel state
    splits the data-parallel ranks (x context parallel) and the experts' data-parallel ranks
    into N groups, asserting that N divides both, and builds them with ``einops``: each rank
    failed in ``initialize_model_parallel`` with an AssertionError or an ImportError traceback
    (measured: tiny.sh, 2 CPU ranks, N 2: EP2, then EP1 without einops). None where it can."""
    n = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    if n <= 1 or _grid_refusal(args.world_size, _model_parallel_sizes(args)):
        return None  # or the grid is refused first (validate_args)
    flag = f"--num-distributed-optimizer-instances {n}"
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    sizes = [("data-parallel x context-parallel size", args.world_size // (tp * pp))]
    if getattr(args, "num_experts", None) and not expert_layout_refusal(args):
        expert_grid = args.expert_model_parallel_size * (args.expert_tensor_parallel_size or tp)
        sizes.append(("experts' data-parallel size", args.world_size // (expert_grid * pp)))
    for what, size in sizes:
        if size % n:
            return (
                f"{flag} is not allowed with {args.world_size} processes: the {what} is {size}, "
                f"which {n} does not divide; allowed: a divisor of {size}"
            )
    if not package_installed("einops"):
        return (
            f"{flag} needs the einops package (megatron-core 0.19.2 builds the instances' "
            "groups with it), which is not installed (pip install einops); allowed without it: 1"
        )
    return None


def megatron_refusal(args, err: Exception) -> str:
    """One line for an assert of Megatron's ``validate_args``: its own text, and for the commonest
    (a process count that the model-parallel layout or the batch does not divide) the flags and
    what is allowed. A ``ValueError`` / ``RuntimeError`` it raises carries its own sentence."""
    if not isinstance(err, AssertionError):
        return f"Megatron's validate_args refused these flags: {err}"
    refusal = "world size" in str(err) and _grid_refusal(
        args.world_size, _model_parallel_sizes(args)
    )
    if refusal:
        return refusal
    dp, micro = args.data_parallel_size, args.micro_batch_size
    batch = args.global_batch_size
    if (
        "eval_global_batch_size" in str(err)
        and args.eval_global_batch_size == batch
        and args.eval_micro_batch_size == micro
    ):  # the eval sizes were not given: the assert refused the training ones
        return (
            f"--global-batch-size {batch} is not allowed with --micro-batch-size {micro} x "
            f"{dp} data-parallel ranks (WORLD_SIZE={args.world_size} / the model-parallel "
            f"size): a multiple of {micro * dp}; change one of them or the process count"
        )
    frame = traceback.extract_tb(err.__traceback__)[-1]  # the assert: what it checks
    line = frame.line.rstrip(" \\(").rstrip(",")  # a multi-line assert: its first line
    if str(err) and str(err) in line:  # its message is given after the line: not twice
        line = line[: line.index(str(err))].rstrip(" '\"").rstrip(",")
    check = f"{os.path.basename(frame.filename)}:{frame.lineno} `{line}`"
    flags = _assert_args_as_flags(args, line)
    return (
        f"Megatron's validate_args refused these flags ({check})"
        + (f": {err}" if str(err) else "")
        + (f"; this run: {flags}" if flags else "")
    )


def _assert_args_as_flags(args, line: str) -> str:
    """The flags behind the ``args.X`` an assert of ``validate_args`` reads, as this run gives
    them (``--save-interval not given``, ``--bf16``): its line names attributes, not the flags
    (``--save`` alone was refused as ``assert args.save_interval is not None``, naming none).
    Attributes that no flag sets (``validate_args`` computes them) are left out."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron_latentmoe.training.arguments import add_stable_latentmoe_args

    parser = add_stable_latentmoe_args(add_megatron_arguments(argparse.ArgumentParser()))
    actions = {}
    for action in parser._actions:
        if action.option_strings:
            actions.setdefault(action.dest, action)
    named = []
    for dest in dict.fromkeys(re.findall(r"\bargs\.(\w+)", line)):
        action = actions.get(dest)
        if action is None or not hasattr(args, dest):
            continue
        flag, value = action.option_strings[0], getattr(args, dest)
        if action.nargs == 0:  # a switch: given or not
            named.append(flag if value != action.default else f"{flag} not given")
        else:
            named.append(f"{flag} not given" if value is None else flag_text(flag, value))
    return ", ".join(named)
