"""Compatibility layers: megatron-core 0.19.2 on CPU + gloo (:mod:`.cpu`), megatron.training
on CPU and from the wheel (:mod:`.training`) and on Python 3.11
(:mod:`.python311`). Importing this package imports neither megatron nor anything heavy."""

from .cpu import (
    TESTED_MEGATRON_CORE_VERSION,
    apply_cpu_compat,
    check_megatron_core_version,
    initialize_parallel_cpu,
    revert_cpu_compat,
)
from .python311 import apply_python311_compat

__all__ = [
    "TESTED_MEGATRON_CORE_VERSION",
    "apply_cpu_compat",
    "apply_python311_compat",
    "check_megatron_core_version",
    "initialize_parallel_cpu",
    "revert_cpu_compat",
]
