"""A ``--data-path`` dataset whose token ids are outside the run's vocabulary, deeper in the
``.bin`` than the head the flag check reads (``data_args.data_vocabulary_refusal``; its case is
``data_path_made_with_another_tokenizer`` in test_bad_flags): the first micro-batch that holds
one stops the run with one line and exit 2 (``forward_step.get_batch``), where megatron-core
0.19.2 raised ``IndexError: index out of range in self`` in the embedding, a traceback on every
rank (exit 1)."""

from __future__ import annotations

import numpy
import pytest

from megatron_latentmoe.data.index_file import HEAD_BYTES

from . import LAUNCH, run_entry, scratch_dir, write_dataset

pytestmark = pytest.mark.timeout(300)

VOCAB = 4096  # the shipped tokenizer's


def test_an_id_past_the_checked_head_stops_the_run_in_one_line():
    rng = numpy.random.default_rng(0)
    head_docs = HEAD_BYTES // 2 // 1000 + 1  # uint16: the checked head holds in-vocabulary ids
    documents = [rng.integers(0, VOCAB, 1000) for _ in range(head_docs)]
    # then 4x as many ids, 1 in 5 out of the vocabulary: each rank's first micro-batch (4
    # sequences of 128 drawn from the whole file) holds one
    documents += [rng.integers(0, 5 * VOCAB // 4, 1000) for _ in range(4 * head_docs)]
    prefix = write_dataset(scratch_dir() / "deep_other_ids", documents)
    run = run_entry(
        ["--data-path", prefix, "--split", "100,0,0", "--train-iters", "3"], launcher=LAUNCH
    )
    assert run.returncode == 2, run.output[-6000:]
    assert "Traceback" not in run.output, run.output[-6000:]
    assert "lm loss:" not in run.output  # the first micro-batch is refused
    errors = [line for line in run.output.splitlines() if "error:" in line]
    assert errors, run.output[-6000:]
    for line in errors:
        assert line.startswith(
            f"pretrain_stable_latentmoe: error: a micro-batch of --data-path {prefix} holds "
            "token id "
        ), line
        assert f"has {VOCAB} ids (allowed: 0..{VOCAB - 1}): the dataset was made with another " in (
            line
        )
    last = run.output.splitlines()[-1]
    assert last.startswith("[launch] rank ") and last.endswith(
        " exited with code 2 (its output is above)"
    )
