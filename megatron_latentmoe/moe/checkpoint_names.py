"""The name of the Stable LatentMoE layer's latent norm (``layer.py``), today's and the one older
checkpoints store.

Plain Python, apart from ``layer.py`` (which imports megatron.core): the converter and the model
provider read these names without building or importing the layer.
"""

from __future__ import annotations

NORM_NAME = "routed_expert_norm"
"""The latent RMSNorm's module name in the MoE layer (Megatron-Bridge's Kimi K3 layer and the HF
model use it too)."""
LEGACY_NORM_NAME = "latent_norm"
"""Its name in checkpoints written before the rename (they still load:
``layer.use_legacy_names_of``, ``convert.names.current_key``)."""
