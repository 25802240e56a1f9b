"""Compatibility layers, every patch recorded in :mod:`.registry` (version-checked, revertible):
megatron-core 0.19.2 walls on every device (:mod:`.core`), on CPU + gloo (:mod:`.cpu`),
megatron.training's (:mod:`.training`) and Python 3.11 (:mod:`.python311`). Importing this
package imports neither megatron nor anything heavy."""

from .core import apply_core_compat
from .cpu import apply_cpu_compat, initialize_parallel_cpu, revert_cpu_compat
from .python311 import apply_python311_compat
from .registry import TESTED_MEGATRON_CORE_VERSION, check_megatron_core_version

__all__ = [
    "TESTED_MEGATRON_CORE_VERSION",
    "apply_core_compat",
    "apply_cpu_compat",
    "apply_python311_compat",
    "check_megatron_core_version",
    "initialize_parallel_cpu",
    "revert_cpu_compat",
]
