"""Elementwise ops of Stable LatentMoE (no Megatron imports here)."""

from megatron_latentmoe.ops.situ import (
    DEFAULT_SITU_BETA,
    DEFAULT_SITU_LINEAR_BETA,
    SiTUGLU,
    situ_glu,
    situ_glu_packed,
    situ_glu_reference,
    validate_situ_beta,
)

__all__ = [
    "DEFAULT_SITU_BETA",
    "DEFAULT_SITU_LINEAR_BETA",
    "SiTUGLU",
    "situ_glu",
    "situ_glu_packed",
    "situ_glu_reference",
    "validate_situ_beta",
]
