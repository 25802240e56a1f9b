"""The Hugging Face layout of MXFP4 routed experts (``convert export --expert-dtype mxfp4``).

compressed-tensors' ``mxfp4-pack-quantized`` format, the one vLLM / SGLang read (transformers'
own ``mxfp4`` quantizer only knows GPT-OSS's fused ``*_blocks`` / ``*_scales`` tensors): each
routed expert linear ``...block_sparse_moe.experts.{j}.w{1,2,3}`` is stored as ``weight_packed``
uint8 [out, in / 2] and ``weight_scale`` uint8 [out, in / 32] (codes, packing and scales:
``ops/mxfp4.py``), and ``config.json`` carries ``quantization_config``
(:func:`quantization_config`) whose only group targets exactly these linears, so attention, dense
and shared experts, the latent projections, the router and the LM head stay in the export dtype
(SPEC §5). Bit-exact with what QAT trains on.
"""

from __future__ import annotations

import torch

from megatron_latentmoe.ops.mxfp4 import BLOCK, dequantize_mxfp4, quantize_mxfp4

FORMAT = "mxfp4-pack-quantized"
PACKED, SCALE = "weight_packed", "weight_scale"
TARGET = r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"
"""The compressed-tensors target: every routed expert linear, nothing else."""


def quantization_config() -> dict:
    """``config.json``'s ``quantization_config`` (compressed-tensors ``QuantizationConfig``)."""
    weights = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": BLOCK,
        "strategy": "group",
        "dynamic": False,
        "scale_dtype": "torch.uint8",
    }
    group = {
        "targets": [TARGET],
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
        "format": FORMAT,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def is_mxfp4(config: dict | None) -> bool:
    """Whether an HF ``quantization_config`` (dict) is this layout."""
    if not config:
        return False
    groups = config.get("config_groups") or {}
    return (
        config.get("quant_method") == "compressed-tensors"
        and config.get("format") == FORMAT
        and [g.get("targets") for g in groups.values()] == [[TARGET]]
    )


def names(name: str) -> tuple[str, str]:
    """(packed, scale) HF names that replace the dense ``...w{1,2,3}.weight`` ``name``."""
    base = name.removesuffix(".weight")
    return f"{base}.{PACKED}", f"{base}.{SCALE}"


def packed_shapes(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """HF tensors (name, shape) that replace the dense ``...w{1,2,3}.weight`` of ``shape``."""
    *rows, k = shape
    packed, scale = names(name)
    return [(packed, (*rows, k // 2)), (scale, (*rows, k // BLOCK))]


def pack(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Dense ``...w{1,2,3}.weight`` -> its two MXFP4 tensors (ValueError names a NaN/inf)."""
    packed, scale = quantize_mxfp4(weight, name)
    packed_name, scale_name = names(name)
    return {packed_name: packed, scale_name: scale}


def unpack(name: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The dense ``...w{1,2,3}.weight`` named ``name`` from ``tensors`` holding its MXFP4 pair."""
    packed_name, scale_name = names(name)
    return dequantize_mxfp4(tensors[packed_name], tensors[scale_name], dtype)
