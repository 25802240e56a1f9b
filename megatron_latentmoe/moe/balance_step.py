"""Step-end Quantile Balancing update (SPEC §4, appendix D), hooked into Megatron's training loop.

``finalize_model_grads_with_quantile_balancing`` is a drop-in ``finalize_model_grads_func``:
Megatron's own training loop (and its pipeline schedules) call it once per step after the last
micro-batch's backward. It runs Megatron's ``finalize_model_grads`` and then, for ALL QB routers
of this pipeline stage at once:

1. packs each router's histogram (n·B counts + token count) and its routed loads (n) into ONE
   integer buffer and all-reduces it (sum) over exactly the ranks that hold different tokens:
   data × context parallel, plus tensor parallel when sequence parallelism splits the tokens;
2. every rank solves the same new bias from the same global histogram (bit-identical);
3. records the balance metrics of the step that was just routed, and resets the scratch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.utils import get_model_config

from megatron_latentmoe.balancing import max_violation
from megatron_latentmoe.moe.router import QuantileBalancingRouter


@dataclass(frozen=True)
class BalanceMetrics:
    """Global-batch load balance of one MoE layer for one step."""

    max_vio: float
    """(max load - mean load) / mean load."""
    min_load: int
    max_load: int
    frac_under_half: float
    """Fraction of experts with less than half the mean load."""
    num_tokens: int

    @classmethod
    def from_loads(cls, loads_E: torch.Tensor, num_tokens: int) -> "BalanceMetrics":
        loads = loads_E.double()
        mean = loads.mean().item()
        return cls(
            max_vio=max_violation(loads_E),
            min_load=int(loads_E.min().item()),
            max_load=int(loads_E.max().item()),
            frac_under_half=float((loads < 0.5 * mean).double().mean().item()) if mean else 0.0,
            num_tokens=int(num_tokens),
        )


def quantile_balancing_routers(model_chunks: Iterable[torch.nn.Module]) -> List[QuantileBalancingRouter]:
    """The QB routers of this pipeline stage in a fixed order (same on every rank of a stage)."""
    return [
        module
        for chunk in model_chunks
        for module in chunk.modules()
        if isinstance(module, QuantileBalancingRouter) and module.training
    ]


def token_parallel_group(config) -> Optional[dist.ProcessGroup]:
    """The ranks that route different tokens: DP×CP, and TP too when SP splits the sequence."""
    if config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
        return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


@torch.no_grad()
def update_quantile_balancing(
    model_chunks: Iterable[torch.nn.Module], group: Optional[dist.ProcessGroup]
) -> List[BalanceMetrics]:
    """ONE integer all-reduce for all QB layers of this stage, then solve and reset (SPEC §4)."""
    routers = quantile_balancing_routers(model_chunks)
    if not routers:
        return []
    packed = []
    for r in routers:
        hist = r.qb_histogram.pack()
        packed.append(torch.cat([hist, r.step_loads_E.to(hist.dtype)]))
    sizes = [p.numel() for p in packed]
    buffer = torch.cat(packed)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    metrics = []
    for router, part in zip(routers, buffer.split(sizes)):
        n = router.config.num_moe_experts
        hist_part, loads_E = part[:-n], part[-n:]
        try:
            router.qb_histogram.unpack_(hist_part)
        except (ValueError, OverflowError) as err:
            raise type(err)(f"QB router of layer {router.layer_number}: {err}") from None
        num_tokens = int(router.qb_histogram.num_tokens)
        router.last_balance = BalanceMetrics.from_loads(loads_E, num_tokens) if num_tokens else None
        router.last_loads_E = loads_E.clone() if num_tokens else None
        if router.last_balance is not None:
            metrics.append(router.last_balance)
        router.expert_bias.copy_(router.qb_histogram.solve(router.expert_bias))
        router.qb_histogram.reset()
        router.step_loads_E.zero_()
    return metrics


def finalize_model_grads_with_quantile_balancing(
    model, num_tokens=None, pg_collection=None, force_all_reduce=False
):
    """Megatron's ``finalize_model_grads`` followed by the QB step-end update."""
    finalize_model_grads(
        model, num_tokens=num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce
    )
    update_quantile_balancing(model, token_parallel_group(get_model_config(model[0])))
