"""Megatron training-loop glue for Stable LatentMoE: flags (:mod:`.arguments`, the data flags'
:mod:`.data_args`, Megatron's own checks told in flags :mod:`.megatron_refusals`), model builder,
forward step, balance logging, and the checkpoint folders a run loads (:mod:`.resume`; their
repair after a kill, :mod:`.checkpoint_repair`) and writes (:mod:`.file_checks`).

Entry point: :func:`megatron_latentmoe.training.pretrain.main`
(``examples/pretrain_stable_latentmoe.py``).
Importing this package imports none of its submodules (nor Megatron); ``balance_logging``,
``forward_step``, ``model_provider``, ``qb_calibrate`` and ``qb_rescore`` import torch (the
first and the third Megatron too), the others neither (``arguments``, ``data_args`` and
``megatron_refusals`` numpy).
"""

__all__ = [
    "arguments",
    "balance_logging",
    "balance_summary",
    "checkpoint_repair",
    "console",
    "data_args",
    "data_left",
    "file_checks",
    "forward_step",
    "launch",
    "megatron_refusals",
    "model_provider",
    "pretrain",
    "qb_calibrate",
    "qb_rescore",
    "resume",
]
