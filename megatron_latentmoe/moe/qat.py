"""Quantization-aware training of the routed experts (``moe_expert_weight_qat="mxfp4"``, SPEC §5).

Each routed expert's fc1 ([w1; w3], reduction dim = latent width) and fc2 (w2, reduction dim =
its ETP shard of ``moe_ffn_hidden_size``) run their GEMM on ``fake_quantize_mxfp4(weight)``: the
MXFP4 values the export writes (``convert export --expert-dtype mxfp4``), with a
straight-through gradient into the unchanged master weight. Parameters, checkpoints and
optimizer state are those of the plain model, so the flag can be switched on when resuming.

* local spec: Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` with the weight
  fake-quantized in ``_forward_impl`` (the one place both hand their weight to the GEMM);
* TE spec: Megatron's TE grouped linears (or, for sequential TE experts, TE linears) with the
  weights fake-quantized in ``_get_weight_tensors`` (TE's hook between parameters and GEMM).
  Under a TE MXFP8 recipe the MXFP4 values are re-encoded exactly (each E2M1 value times 2**6
  fits E4M3 under the same block's E8M0 scale), so the GEMM still sees the MXFP4 weights.

Both turn off fused wgrad accumulation for these layers: the GEMM's weight is the fake-quantized
copy, which has no ``main_grad``; its gradient flows back to the parameter, whose ``.grad``
Megatron's DDP hook adds to ``main_grad`` as for any unfused layer.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_latentmoe.fields import not_allowed
from megatron_latentmoe.ops.mxfp4 import fake_quantize_mxfp4


class _MXFP4WeightLinear:
    """Mixin for Megatron's local parallel linears: the GEMM sees the MXFP4 fake-quant weight."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        kwargs["gradient_accumulation_fusion"] = False
        return super()._forward_impl(input, fake_quantize_mxfp4(weight), *args, **kwargs)


class MXFP4ColumnParallelLinear(_MXFP4WeightLinear, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose weight is MXFP4 fake-quantized in the forward."""


class MXFP4RowParallelLinear(_MXFP4WeightLinear, RowParallelLinear):
    """``RowParallelLinear`` whose weight is MXFP4 fake-quantized in the forward."""


def _te_linears():
    """{Megatron TE expert linear: its fake-quantizing subclass} (grouped-GEMM and sequential
    experts; both hand their weights to the GEMM through TE's ``_get_weight_tensors``)."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelGroupedLinear,
        TEColumnParallelLinear,
        TERowParallelGroupedLinear,
        TERowParallelLinear,
    )

    class _MXFP4WeightTELinear:
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if getattr(self, "single_grouped_weight", False):
                raise not_allowed(
                    "moe_expert_weight_qat",
                    "mxfp4",
                    "'none' with TE's single grouped weight (one weight tensor per expert needed)",
                )
            self.fuse_wgrad_accumulation = False

        def _get_weight_tensors(self):
            return [fake_quantize_mxfp4(w) for w in super()._get_weight_tensors()]

    return {
        base: type(f"MXFP4{base.__name__}", (_MXFP4WeightTELinear, base), {})
        for base in (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
            TEColumnParallelLinear,
            TERowParallelLinear,
        )
    }


def with_expert_weight_qat(experts, config):
    """The routed-experts builder (``partial(SequentialMLP | TEGroupedMLP, submodules=...)``)
    with its fc1 / fc2 replaced by the fake-quantizing linears; unchanged when QAT is off."""
    if config.moe_expert_weight_qat == "none":
        return experts
    swap = {
        ColumnParallelLinear: MXFP4ColumnParallelLinear,
        RowParallelLinear: MXFP4RowParallelLinear,
    }
    sub = experts.keywords["submodules"]
    if sub.linear_fc1 not in swap and HAVE_TE:
        swap = _te_linears()
    fc1, fc2 = swap.get(sub.linear_fc1), swap.get(sub.linear_fc2)
    if fc1 is None or fc2 is None:
        raise not_allowed(
            "moe_expert_weight_qat",
            config.moe_expert_weight_qat,
            f"'none' for experts built from {sub.linear_fc1.__name__} / {sub.linear_fc2.__name__}",
        )
    sub = dataclasses.replace(sub, linear_fc1=fc1, linear_fc2=fc2)
    return partial(experts.func, *experts.args, **{**experts.keywords, "submodules": sub})
