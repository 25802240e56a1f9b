"""Megatron training-loop glue for Stable LatentMoE: flags, model builder, forward step, balance
logging.

Entry point: :func:`megatron_latentmoe.training.pretrain.main`
(``examples/pretrain_stable_latentmoe.py``).
Importing this package imports none of its submodules (nor Megatron); ``balance_summary`` is
plain Python, the others import torch and Megatron.
"""

__all__ = [
    "arguments",
    "balance_logging",
    "balance_summary",
    "forward_step",
    "model_provider",
    "pretrain",
    "qb_calibrate",
    "qb_rescore",
]
