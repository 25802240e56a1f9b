"""``megatron.training`` walls (megatron-core 0.19.2), next to the megatron-core ones in ``cpu.py``.

* :func:`cpu_training_defaults`: flags that need CUDA kernels, switched off on CPU;
* :func:`apply_cpu_training_compat`: ``initialize_megatron`` gets ``allow_no_cuda``, the CUDA
  fusion warm-up is skipped, ``validate_args``' GPU-architecture query answers 0;
* :func:`init_cpu_world`: what ``initialize_megatron`` skips without a GPU (gloo world, parallel
  groups, seeded RNG tracker);
* :func:`skip_dataset_helper_build` (CPU and GPU): the wheel has no Makefile for the dataset
  helpers but ships them compiled.
"""

from __future__ import annotations

from datetime import timedelta
from typing import List

def cpu_training_defaults(args) -> List[str]:
    """Flags that only work with CUDA kernels: switched off on CPU (returns the notes)."""
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
    if args.rerun_mode != "disabled":
        args.rerun_mode = "disabled"  # the rerun state machine keeps CUDA-only state
        notes.append("rerun_mode=disabled")
    return notes


def apply_cpu_training_compat() -> None:
    """``megatron.training`` walls on a machine without CUDA.

    * ``pretrain`` calls ``initialize_megatron()`` without ``allow_no_cuda``: pass it.
    * ``set_jit_fusion_options`` warms torch.compile'd CUDA fusions up with ``device="cuda"``
      tensors: nothing to warm on CPU (the fusions are switched off by :func:`cpu_training_defaults`).
    * ``validate_args`` asks the GPU architecture for TP/CP > 1: report "pre-Blackwell" (0), so
      Megatron applies its CUDA_DEVICE_MAX_CONNECTIONS=1 rule (the entry point sets it).
    """
    import functools

    import megatron.training.arguments as margs
    import megatron.training.training as mtraining

    if not getattr(mtraining.initialize_megatron, "_latentmoe_cpu", False):
        original = mtraining.initialize_megatron

        @functools.wraps(original)
        def initialize_megatron(*a, **kw):
            kw["allow_no_cuda"] = True
            return original(*a, **kw)

        initialize_megatron._latentmoe_cpu = True
        mtraining.initialize_megatron = initialize_megatron
        mtraining.set_jit_fusion_options = lambda *a, **kw: None
    margs.get_device_arch_version = lambda: 0


def skip_dataset_helper_build() -> None:
    """``initialize_megatron`` runs ``make`` for the dataset helpers, and the megatron-core wheel
    ships no Makefile (the compiled ``helpers_cpp`` is inside): keep the compiled one."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # a source checkout: let Megatron build them
    import megatron.core.datasets.utils as dutils

    dutils.compile_helpers = lambda: None


def init_cpu_world(args) -> None:
    """gloo process group, Megatron parallel groups and the CPU RNG tracker (seeded like
    ``megatron.training.initialize._set_random_seed`` seeds the CUDA one)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_latentmoe.compat.cpu import initialize_parallel_cpu

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
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        order="tp-cp-ep-dp-pp" if not args.use_tp_pp_dp_mapping else "tp-cp-ep-pp-dp",
        create_gloo_process_groups=args.use_gloo_process_groups,
    )
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if args.data_parallel_random_init:
        seed += 10 * parallel_state.get_data_parallel_rank()
    model_parallel_cuda_manual_seed(seed)
