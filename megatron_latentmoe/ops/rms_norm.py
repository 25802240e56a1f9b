"""RMSNorm with fp32 math that works under Megatron sequence parallelism (SPEC §1 latent norm).

Megatron's torch-norm wrapper refuses ``sequence_parallel``; this norm accepts it and tags its
weight so that Megatron's ``finalize_model_grads`` sums the weight gradient over the tensor-
parallel group (each TP rank normalised a different slice of the tokens). Used for the latent
RMSNorm of the block and, in the local spec, for every other norm of the model.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight``, computed in fp32, returned in the input dtype.

    Signature follows Megatron's ``LayerNormBuilder`` (``config``, ``hidden_size``, ``eps``).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"hidden_size={hidden_size!r} is not allowed: a positive integer")
        self.eps = eps
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        # Replicated across TP; under sequence parallelism each TP rank saw other tokens.
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y32 * self.weight.float()).to(x.dtype)
