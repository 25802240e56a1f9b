"""Megatron training-loop glue for Stable LatentMoE: flags, model builder, forward step, balance
logging.

Entry point: :func:`megatron_latentmoe.training.pretrain.main`
(``examples/pretrain_stable_latentmoe.py``).
Submodules are imported lazily: importing this package does not import Megatron.
"""

__all__ = ["arguments", "balance_logging", "forward_step", "model_provider", "pretrain"]
