"""Compatibility layers: megatron-core 0.19.2 walls on every device (:mod:`.core`), on CPU + gloo
(:mod:`.cpu`) and megatron.training's (:mod:`.training`), TensorBoard's writer
thread (:mod:`.tensorboard`), every patch recorded in :mod:`.registry` (version-checked,
revertible); torch's gloo errors for a peer process gone (:mod:`.gloo_peer`, no patch); torch's
``record`` that also records DCP's ``CheckpointException`` (:mod:`.record`, no patch); and
Python 3.11 (:mod:`.python311`: adds
``typing.override``, which 3.12 has, and is never reverted). Importing this package imports
neither megatron nor anything heavy."""

from .core import apply_core_compat
from .cpu import apply_cpu_compat, initialize_parallel_cpu, revert_cpu_compat
from .python311 import apply_python311_compat

__all__ = [
    "apply_core_compat",
    "apply_cpu_compat",
    "apply_python311_compat",
    "initialize_parallel_cpu",
    "revert_cpu_compat",
]
