"""compat.core's aux-loss token count on 2 gloo ranks: with a padding mask, the local token count
Megatron's aux losses scale by under ``--calculate-per-token-loss`` is the rank's own, not the
group's (megatron-core 0.19.2 took it from the counts its in-place all-reduce had summed)."""

from __future__ import annotations

import pytest

from .launcher import run_distributed

pytestmark = pytest.mark.slow

TOPK = 2


def _counts(rank, world_size):
    """(global counts, local token count, total token count) on this rank, whose 8 x 4 routing
    map routes ``3 + 2 * rank`` tokens (the others padding) to two experts each."""
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe import router

    routing_map = torch.zeros(8, 4, dtype=torch.bool)
    routing_map[: 3 + 2 * rank, :TOPK] = True
    global_e, local, total = router.get_tokens_per_expert_and_token_count(
        routing_map=routing_map, reduce_group=dist.group.WORLD, topk=TOPK, with_padding_mask=True
    )
    return global_e.tolist(), float(local), float(total)


def test_padded_aux_loss_local_token_count_is_the_ranks_own():
    results = run_distributed(_counts, 2)
    assert [r[1] for r in results] == [3.0, 5.0]  # 0.19.2: 8.0 on both
    assert all(r[0] == [8, 8, 0, 0] and r[2] == 8.0 for r in results)
