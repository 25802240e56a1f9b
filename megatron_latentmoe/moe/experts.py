"""Routed experts of the Stable LatentMoE block run one by one (``SequentialMLP``), with the
activation applied ONCE over all local experts' tokens and each expert's fc1 / fc2 as a bare GEMM.

Megatron's ``SequentialMLP`` runs each local expert's whole MLP (fc1, activation, fc2) in turn.
fc1 and fc2 must stay per expert (each has its own weights), but the activation has no weights:
SiTU-GLU is the same function for every expert. At K3-like sparsity (many experts, few tokens
each) the per-call cost of its ~10 elementwise kernels dominates. Concatenating the experts' fc1
outputs (already contiguous in the permuted order) and activating them in one call gives the
same numbers (an elementwise function of each row) at one call's cost: the block's fwd+bwd is
2.0-2.4x faster at the balance race's shape (128 experts, ~32 tokens each, one CPU thread;
``benchmarks/bench_block.py``, ``stable_per_expert_act`` beside ``stable_module_linears``).

The same holds for the per-call cost of Megatron's parallel linears: each routed expert's
``ColumnParallelLinear`` / ``RowParallelLinear`` wraps its GEMM in Python autograd functions
(the TP copy / reduce regions and ``LinearWithGradAccumulationAndAsyncCommunication``) that
communicate nothing for experts: with expert TP the token dispatcher does the communication
(``explicit_expert_comm``), without it the groups have one rank. Calling ``F.linear`` on the
expert's own weight is then the same GEMM (the same parameter, so the same gradient, DDP hooks
and checkpoints) without that overhead: ~0.3 ms per expert fwd+bwd on one CPU thread, the
largest cost of the block at the race's shape (``bench_block``'s ``stable_module_linears``).

Falls back to Megatron's forward where its per-expert path does more than fc1 / activation /
probs / fc2: FP8/FP4 padding, probs applied on the input, linear biases, or an activation that
is not a module (``use_te_activation_func`` off), and with one local expert. The linears are
called as modules unless they are exactly Megatron's local ones with nothing beyond the GEMM
(no fused wgrad accumulation into ``main_grad``, no GTP weight sharding, no CPU offloading, no
communication): TE linears, the MXFP4 QAT linears (``qat.py``) and any other subclass keep
their own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP


def _bare_gemm(linear, cls) -> bool:
    """``linear`` is exactly Megatron's local ``cls`` and its forward is ``F.linear(x, weight)``."""
    return (
        type(linear) is cls
        and linear.bias is None
        and not linear.gradient_accumulation_fusion
        and getattr(linear, "gtp_remat_size", 1) == 1
        and not getattr(linear, "gather_output", False)
        and (linear.explicit_expert_comm or linear.tp_group is None or linear.tp_group.size() == 1)
    )


class BatchedActivationSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose experts share one activation call and run bare GEMMs (see the
    module docstring)."""

    def _batched(self) -> bool:
        c = self.config
        return (
            self.num_local_experts > 1
            and c.use_te_activation_func
            and not (c.fp8 or c.fp4 or c.moe_apply_probs_on_input or c.add_bias_linear)
        )

    def _bare_gemms(self) -> bool:
        return not self.config.cpu_offloading and all(
            _bare_gemm(e.linear_fc1, ColumnParallelLinear)
            and _bare_gemm(e.linear_fc2, RowParallelLinear)
            for e in self.local_experts
        )

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ):
        if not self._batched():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        if self._bare_gemms():

            def linear(layer, x):
                return F.linear(x, layer.weight)

        else:

            def linear(layer, x):
                return layer(x)[0]

        counts = tokens_per_expert.tolist()  # the same host read as Megatron's forward
        experts = self.local_experts
        fc1_TF = torch.cat(
            [
                linear(e.linear_fc1, x)
                for e, x in zip(experts, permuted_local_hidden_states.split(counts), strict=True)
            ]
        )
        act_TF = experts[0].activation_func(fc1_TF)
        act_TF = (act_TF * permuted_probs.unsqueeze(-1)).to(act_TF.dtype)
        out = [linear(e.linear_fc2, a) for e, a in zip(experts, act_TF.split(counts), strict=True)]
        return torch.cat(out), None
