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


def export_checkpoint(*args, **kwargs):
    from .export import export_checkpoint as _export

    return _export(*args, **kwargs)


def import_checkpoint(*args, **kwargs):
    from .importer import import_checkpoint as _import

    return _import(*args, **kwargs)


def verify_export(*args, **kwargs):
    from .verify import verify_export as _verify

    return _verify(*args, **kwargs)
