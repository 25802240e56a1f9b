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


def test_dataset_config_carries_megatrons_validation_and_loader_flags(tmp_path, monkeypatch):
    """The GPT dataset config gets the data flags that Megatron-LM's pretrain_gpt passes on.
    ``--multiple-validation-sets`` was dropped: with ``--full-validation`` the validation
    prefixes were blended into one set and evaluated as one ("validation-0" only)."""
    import json
    import sys
    import types
    import warnings

    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import parse_args

    from megatron_latentmoe.training.forward_step import gpt_dataset_config_from_args

    counts = tmp_path / "sequences.json"
    counts.write_text(json.dumps({"/d/a": [10, 10], "/d/b": [20, 20], "/d/t": [5, 5]}))
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    flags += ["--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1"]
    flags += ["--train-data-path", "/d/t", "--valid-data-path", "/d/a", "/d/b"]
    flags += ["--multiple-validation-sets", "--full-validation", "--dataloader-fast-cache-load"]
    flags += ["--dataloader-defer-npy-index-mmap", "--per-dataset-sequences-path", str(counts)]
    flags += ["--data-cache-path", str(tmp_path / "cache")]
    monkeypatch.setattr(sys, "argv", ["pretrain", *flags])
    args = parse_args()
    tokenizer = types.SimpleNamespace(vocab_size=4096)
    config = gpt_dataset_config_from_args(args, tokenizer)
    assert config.blend_per_split[1] == (["/d/a", "/d/b"], None)
    assert config.multiple_validation_sets is True
    assert config.full_validation is True
    assert config.fast_cache_load is True
    assert config.defer_npy_index_mmap is True
    assert config.sequences_per_dataset == {"/d/a": [10, 10], "/d/b": [20, 20], "/d/t": [5, 5]}
