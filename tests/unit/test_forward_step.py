"""The entry point's batch (``training/forward_step.get_batch``) under context parallelism."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state

from megatron_latentmoe.training.forward_step import get_batch


def _batch(seq: int = 8) -> dict:
    positions = torch.arange(seq).repeat(2, 1)  # micro-batch 2
    loss_mask = torch.ones(2, seq)
    loss_mask[1, -1] = 0  # one loss-masked token: the last of sequence 1 (CP rank 0's share)
    return {
        "tokens": positions + 100,
        "labels": positions + 200,
        "loss_mask": loss_mask,
        "attention_mask": torch.tril(torch.ones(seq, seq)).lt(0.5).expand(2, 1, seq, seq),
        "position_ids": positions,
    }


@pytest.mark.parametrize("cp_rank, positions", [(0, [0, 1, 6, 7]), (1, [2, 3, 4, 5])])
def test_each_context_parallel_rank_gets_its_zigzag_share(monkeypatch, cp_rank, positions):
    """CP 2: sequence chunks (0, 3) to rank 0 and (1, 2) to rank 1, as Megatron-LM's pretrain_gpt
    splits them; without the split every CP rank ran the whole sequence (attention, router and
    loss all on the same tokens twice)."""
    group = object()
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda: group)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda g=None: cp_rank)
    batch = _batch()
    tokens, labels, loss_mask, attention_mask, position_ids, padding = get_batch(
        batch, pre_process=True
    )
    expected = torch.tensor(positions).repeat(2, 1)
    assert torch.equal(position_ids, expected)
    assert torch.equal(tokens, expected + 100)
    assert torch.equal(labels, expected + 200)
    assert attention_mask.shape == (2, 1, 4, 8)  # this rank's queries, every key
    assert torch.equal(attention_mask[0, 0], _batch()["attention_mask"][0, 0, positions])
    if cp_rank == 0:
        assert padding is not None and padding.tolist() == [[False] * 4, [False] * 3 + [True]]
    else:
        assert padding is None and loss_mask.eq(1).all()
    assert batch["tokens"].shape == (2, 8)  # the loader's batch stays whole


def test_without_context_parallelism_the_batch_is_whole(monkeypatch):
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    tokens, *_, padding = get_batch(_batch(), pre_process=True)
    assert torch.equal(tokens, _batch()["tokens"]) and padding[1, -1] and padding.sum() == 1
