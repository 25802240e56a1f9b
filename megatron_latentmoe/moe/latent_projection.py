"""The shared latent projections W_down (d -> l) and W_up (l -> d) of SPEC §1, without TE.

ONE of each per layer, replicated on every tensor-parallel rank (Megatron calls this
``parallel_mode="duplicated"``; its TE version is ``TELinear``, used by the TE spec). Each TP
rank projects its own sequence-parallel slice of the tokens, so the weight gradient is summed
over TP by Megatron's ``finalize_model_grads`` (``sequence_parallel`` tag) and over DP by DDP
(``allreduce`` tag).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel

from megatron_latentmoe.fields import not_allowed


class LatentProjection(torch.nn.Module):
    """A replicated linear with Megatron's linear call convention: ``forward(x) -> (y, None)``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method,
        bias: bool = False,
        name: str | None = None,
        **_unused,
    ):
        super().__init__()
        if bias:
            raise not_allowed("bias", True, "False (the latent projections are bias-free)")
        # Where Megatron's own linears put theirs: on the GPU unless --use-cpu-initialization
        # (allocated on the CPU, the init below drew from the CPU RNG, which the tracker's fork
        # does not swap on CUDA, instead of the data-parallel stream).
        on_gpu = torch.cuda.is_available() and not config.use_cpu_initialization
        self.weight = torch.nn.Parameter(
            torch.empty(
                output_size,
                input_size,
                dtype=config.params_dtype,
                device=torch.cuda.current_device() if on_gpu else "cpu",
            )
        )
        if config.perform_initialization:
            # Same values on every TP rank: draw from the data-parallel RNG stream, which is
            # seeded identically across TP (as Megatron's TELinear does for duplicated weights).
            tracker = tensor_parallel.get_cuda_rng_tracker()
            stream = tensor_parallel.random.get_data_parallel_rng_tracker_name()
            if stream in tracker.get_states():
                with tracker.fork(stream):
                    init_method(self.weight)
            else:  # no model-parallel seeding (single process): plain torch RNG
                init_method(self.weight)
        self.weight.allreduce = True
        self.weight.tensor_model_parallel = False
        self.weight.sequence_parallel = config.sequence_parallel
        self.name = name

    def forward(self, x: torch.Tensor):
        return F.linear(x, self.weight), None

    def backward_dw(self) -> None:
        """Megatron's ``MoELayer.backward_dw`` calls this on the latent projections when expert
        communication overlap defers weight gradients (TE's ``TELinear`` computes them here);
        plain autograd has already computed this weight's gradient, so there is nothing to do."""
