"""Hugging Face side of Stable LatentMoE: config + modeling code that ships with exported
checkpoints.

``configuration_stable_latentmoe.py`` and ``modeling_stable_latentmoe.py`` import only torch and
transformers (and each other); they must sit next to a checkpoint so that
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` resolves the ``auto_map``
that :class:`StableLatentMoEConfig` writes into config.json by default. The model classes'
``save_pretrained`` writes them itself; :func:`copy_remote_code` does it for a folder written
otherwise (a config and weight shards written without ``save_pretrained``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .configuration_stable_latentmoe import AUTO_MAP, StableLatentMoEConfig
from .modeling_stable_latentmoe import (
    MoERouting,
    StableLatentMoEBlock,
    StableLatentMoEForCausalLM,
    StableLatentMoEModel,
    StableLatentMoEPreTrainedModel,
)

REMOTE_CODE_FILES = ("configuration_stable_latentmoe.py", "modeling_stable_latentmoe.py")
"""The files an exported model directory needs for ``trust_remote_code`` loading."""

_HERE = Path(__file__).resolve().parent


def copy_remote_code(save_directory: str | os.PathLike) -> list[Path]:
    """Copy the two remote-code files into ``save_directory`` (created if needed); returns the
    copies.

    The ``auto_map`` in config.json comes from :class:`StableLatentMoEConfig` (``AUTO_MAP``) unless
    the config was built with another one.
    """
    dst = Path(save_directory)
    dst.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(_HERE / name, dst / name)) for name in REMOTE_CODE_FILES]


__all__ = [
    "AUTO_MAP",
    "MoERouting",
    "REMOTE_CODE_FILES",
    "StableLatentMoEBlock",
    "StableLatentMoEConfig",
    "StableLatentMoEForCausalLM",
    "StableLatentMoEModel",
    "StableLatentMoEPreTrainedModel",
    "copy_remote_code",
]
