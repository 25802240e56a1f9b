"""Stable LatentMoE checkpoint conversion: Megatron ``torch_dist`` (any TP/EP/ETP/PP/DP layout)
<-> Hugging Face (``model_type = "stable_latentmoe"``, SPEC §6 names, remote code included).

* :func:`export_checkpoint` -- Megatron -> HF (``export.py``), streaming, tensor by tensor;
* :func:`import_checkpoint` -- HF -> Megatron, one layout-free checkpoint (``importer.py``);
* :func:`verify_export` -- both models on the same tokens (``verify.py``);
* ``names.py`` -- the one name / layout mapping; ``dist_reader.py`` -- random access into a
  ``torch_dist`` checkpoint; ``arch.py`` -- where the model hyper-parameters come from.

Command line: ``python -m megatron_latentmoe.convert --help`` or ``tools/convert_checkpoint.py``.
Heavy imports (megatron, transformers) happen inside the functions.
"""

from __future__ import annotations

import importlib

from .arch import ARCH_STATE_KEY, ModelArch, arch_common_state, arch_from_config_file, resolve_arch
from .errors import ConversionError

__all__ = [
    "ARCH_STATE_KEY",
    "ConversionError",
    "ModelArch",
    "arch_common_state",
    "arch_from_config_file",
    "export_checkpoint",
    "import_checkpoint",
    "resolve_arch",
    "verify_export",
]

_LAZY = {
    "export_checkpoint": ".export",
    "import_checkpoint": ".importer",
    "verify_export": ".verify",
}


def __getattr__(name: str):
    """The three entry points, imported on first use (they pull in torch / megatron)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
