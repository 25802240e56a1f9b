"""megatron-core 0.19.2 walls met on every device (CPU and GPU), one named shim per wall.

:func:`apply_core_compat` installs them through :mod:`.registry` (version-checked, revertible,
idempotent). It is applied by :func:`.cpu.apply_cpu_compat`, by the training entry point and by
the local spec (:mod:`megatron_latentmoe.specs`), whose norm needs the first shim.
"""

from __future__ import annotations

import copy
import os

from . import registry

__all__ = ["GROUP", "apply_core_compat"]

GROUP = "core"


def _shim_torch_norm_sequence_parallel() -> None:
    """Let Megatron's torch norm run with sequence parallelism and megatron.training's defaults.

    ``transformer/torch_norm.WrappedTorchNorm`` (the local spec's norm without apex, and what
    ``LocalSpecProvider.layer_norm(rms_norm=True)`` always returns) asserts
    ``not config.sequence_parallel``, yet MoE with TP>1 requires sequence parallelism. The norm
    is per-token, so it is SP-safe once its weights carry ``sequence_parallel=True`` like
    Megatron's fused/TE norms: ``finalize_model_grads`` then all-reduces their grads over the TP
    group. It also asserts ``not config.persist_layer_norm``, which megatron.training turns on
    unless ``--no-persist-layer-norm``: a choice of apex kernel, meaningless for a torch norm.
    ``torch.nn.RMSNorm`` computes in fp32 for bf16 inputs (measured: bit-identical to an explicit
    fp32 ``x * rsqrt(mean(x^2) + eps) * w`` in fp32 and bf16, hidden 512).
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel or config.persist_layer_norm:
            config = copy.copy(config)
            config.sequence_parallel = config.persist_layer_norm = False
        norm = original(cls, config, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    registry.patch(GROUP, WrappedTorchNorm, "__new__", staticmethod(__new__))


def _shim_dataset_helpers() -> None:
    """Use the dataset helpers the megatron-core wheel ships compiled.

    ``megatron.training.initialize`` calls ``datasets.utils.compile_helpers()``, which runs
    ``make`` in the installed package; the wheel has no Makefile (but has the compiled
    ``helpers_cpp``), so ``make`` fails and Megatron calls ``sys.exit(1)``. Without a Makefile,
    ``compile_helpers`` becomes a check that the compiled extension imports (a clear error if
    not); a source checkout (Makefile present) keeps Megatron's build. ``GPTDataset`` itself
    never compiles: it imports ``megatron.core.datasets.helpers`` directly.
    """
    import importlib

    import megatron.core.datasets.utils as dutils

    if os.path.isfile(os.path.join(os.path.dirname(dutils.__file__), "Makefile")):
        return

    def compile_helpers() -> None:
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError as e:
            raise RuntimeError(
                "megatron.core.datasets.helpers_cpp (Megatron's compiled dataset helpers) is "
                "missing from this megatron-core install; reinstall the megatron-core wheel"
            ) from e

    registry.patch(GROUP, dutils, "compile_helpers", compile_helpers)


_SHIMS = (
    _shim_torch_norm_sequence_parallel,
    _shim_dataset_helpers,
)


def apply_core_compat() -> bool:
    """Install the shims of this module (idempotent; False if they already were)."""
    return registry.apply_group(GROUP, _SHIMS)
