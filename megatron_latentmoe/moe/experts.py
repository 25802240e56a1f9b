"""Routed experts of the Stable LatentMoE block run one by one (``SequentialMLP``), with the
activation applied ONCE over all local experts' tokens.

Megatron's ``SequentialMLP`` runs each local expert's whole MLP (fc1, activation, fc2) in turn.
fc1 and fc2 must stay per expert (each has its own weights), but the activation has no weights:
SiTU-GLU is the same function for every expert. At K3-like sparsity (many experts, few tokens
each) the per-call cost of its ~10 elementwise kernels dominates: 42 % of the sparse block's CPU
time at the balance race's shape (64 local experts, ~32 tokens each; ``benchmarks/bench_block.py``).
Concatenating the experts' fc1 outputs (already contiguous in the permuted order) and activating
them in one call gives the same numbers (an elementwise function of each row) at one call's cost.

Falls back to Megatron's forward where its per-expert path does more than fc1 / activation /
probs / fc2: FP8/FP4 padding, probs applied on the input, linear biases, or an activation that
is not a module (``use_te_activation_func`` off), and with one local expert.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


class BatchedActivationSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose experts share one activation call (see the module docstring)."""

    def _batched(self) -> bool:
        c = self.config
        return (
            self.num_local_experts > 1
            and c.use_te_activation_func
            and not (c.fp8 or c.fp4 or c.moe_apply_probs_on_input or c.add_bias_linear)
        )

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ):
        if not self._batched():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts = tokens_per_expert.tolist()  # the same host read as Megatron's forward
        experts = self.local_experts
        fc1_TF = torch.cat(
            [
                e.linear_fc1(x)[0]
                for e, x in zip(experts, permuted_local_hidden_states.split(counts), strict=True)
            ]
        )
        act_TF = experts[0].activation_func(fc1_TF)
        act_TF = (act_TF * permuted_probs.unsqueeze(-1)).to(act_TF.dtype)
        out = [e.linear_fc2(a)[0] for e, a in zip(experts, act_TF.split(counts), strict=True)]
        return torch.cat(out), None
