"""A run with its own Hugging Face tokenizer (``--tokenizer-model OTHER``) and no ``--data-path``
trains on the shipped corpus tokenized with OTHER (``data.corpus.prepare_default_dataset``), in a
dataset of its own beside the shipped tokenizer's; resumed with ``--use-checkpoint-args`` (the
tokenizer from the checkpoint) it trains on the same dataset. Before, the data were the shipped
tokenizer's ids whatever the run's tokenizer: silently wrong training, or with OTHER's 600 ids
the first micro-batch refused (exit 2) for ids up to 4095."""

from __future__ import annotations

import json
import os
import re

import numpy
import pytest

from . import LAUNCH, data_cache, run_entry, scratch_dir, small_tokenizer

pytestmark = pytest.mark.timeout(300)


def test_another_tokenizer_trains_on_the_shipped_corpus_tokenized_with_it():
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokenizer = small_tokenizer(scratch_dir() / "shipped_corpus_other_tokenizer")
    cache = os.path.join(data_cache(), "default_data")
    shipped = os.path.join(cache, "default_corpus.bin")
    before = os.stat(shipped).st_mtime_ns if os.path.exists(shipped) else None
    ckpt = str(scratch_dir() / "shipped_corpus_other_tokenizer_ckpt")
    first = run_entry(
        ["--tokenizer-model", str(tokenizer), "--train-iters", "2"]
        + ["--save", ckpt, "--save-interval", "2", "--eval-iters", "0"],
        launcher=LAUNCH,
    ).check()
    lines = [line for line in first.output.splitlines() if "] data: " in line]
    assert len(lines) == 1, first.output[-6000:]
    match = re.fullmatch(
        r"\[pretrain_stable_latentmoe\] data: the shipped corpus, tokenized by "
        rf"HuggingFaceTokenizer {re.escape(str(tokenizer))} "
        rf"\(({re.escape(cache)}/default_corpus_[0-9a-f]{{12}})\.bin/\.idx\)",
        lines[0],
    )
    assert match, lines[0]
    prefix = match.group(1)
    ds = IndexedDataset(prefix)
    assert int(numpy.fromfile(prefix + ".bin", dtype=ds.index.dtype).max()) == 599  # OTHER's
    assert json.loads(open(prefix + ".json").read())["tokenizer"] == str(tokenizer)
    # the shipped tokenizer's dataset: not made, or left as it was
    after = os.stat(shipped).st_mtime_ns if os.path.exists(shipped) else None
    assert after == before

    resumed = run_entry(
        ["--use-checkpoint-args", "--load", ckpt, "--train-iters", "3", "--eval-iters", "0"]
        + ["--override-opt_param-scheduler"],  # the longer run's schedule
        launcher=LAUNCH,
    ).check()
    assert [line for line in resumed.output.splitlines() if "] data: " in line] == lines
    assert " iteration        3/       3 |" in resumed.output, resumed.output[-6000:]
