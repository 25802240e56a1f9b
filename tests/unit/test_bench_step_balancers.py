"""benchmarks/bench_step_balancers.py without training: its options, the per-round ratios (none's
step over the method's: above 1 means the method is faster), their seeded bootstrap interval and
the micro-batches every method trains on (the same windows for every method, split over ranks)."""

from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import bench_step_balancers as bench


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--warmup", "-1"], "--warmup -1: an integer >= 0"),
        (["--nproc", "0"], "--nproc 0: an integer >= 1"),
        (["--steps", "0"], "--steps 0: an integer >= 1"),
        (["--methods", "aux_loss"], "--methods 'aux_loss': must include 'none'"),
        (
            ["--methods", "none", "aux_loss", "none"],
            "--methods 'none' 'aux_loss' 'none': each method at most once",
        ),
    ],
)
def test_bad_options_name_the_option_value_and_what_is_allowed(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()[-1]) > len(message)


def test_smallest_allowed_options_and_where_the_json_goes(tmp_path):
    a = bench.parse_args(["--steps", "1", "--warmup", "0", "--nproc", "1", "--out", str(tmp_path)])
    assert (a.steps, a.warmup, a.nproc) == (1, 0, 1)
    assert a.out == str(tmp_path / "bench_step_balancers.json")


def test_paired_ratio_is_nones_step_over_the_methods():
    assert bench.paired([2.0, 3.0, 1.0], [1.0, 6.0, 1.0]) == [2.0, 0.5, 1.0]
    with pytest.raises(ValueError):  # rounds must pair up one to one
        bench.paired([1.0, 2.0], [1.0])


def test_bootstrap_interval_is_reproducible_and_cuts_2_5_percent_each_side():
    ratios = [1.0 + i / 100 for i in range(99)]  # median 1.49
    lo, hi = bench.bootstrap_ci95(ratios)
    # the fixed seed makes a run's JSON reproduce its interval: these exact figures (the 51st
    # smallest and the 51st largest of the 2000 resampled medians; the extremes lie outside)
    assert (lo, hi) == (pytest.approx(1.39), pytest.approx(1.58))
    assert bench.bootstrap_ci95(ratios) == (lo, hi)
    assert bench.bootstrap_ci95(ratios, seed=1) != (lo, hi)  # the seed is the seed asked
    assert bench.bootstrap_ci95([1.0] * 7) == (1.0, 1.0)


def _args(seq=4, gbs=4, mbs=1):
    return SimpleNamespace(seq_length=seq, global_batch_size=gbs, micro_batch_size=mbs)


def _first_tokens(batches):
    return [int(t) for b in batches for t in b["tokens"][:, 0]]


def test_micro_batches_are_the_steps_windows_split_over_ranks():
    tokens = np.arange(50)
    whole = bench.micro_batches(tokens, _args(), 0, 0, 1)
    # the global batch of step 0 is drawn from the step's own seed
    starts = np.random.default_rng(10_000).integers(0, 50 - 4 - 1, 4).tolist()
    assert _first_tokens(whole) == starts and len(whole) == 4
    for b in whole:  # next-token labels, every position counted
        assert b["labels"].tolist() == (b["tokens"] + 1).tolist()
        assert b["loss_mask"].tolist() == [[1.0] * 4]
        assert b["position_ids"].tolist() == [[0, 1, 2, 3]]
    ranks = [bench.micro_batches(tokens, _args(), 0, r, 2) for r in (0, 1)]
    assert [len(r) for r in ranks] == [2, 2]
    assert _first_tokens(ranks[0]) + _first_tokens(ranks[1]) == starts
    # two sequences per micro-batch: one micro-batch per rank
    paired_up = bench.micro_batches(tokens, _args(mbs=2), 0, 1, 2)
    assert len(paired_up) == 1 and _first_tokens(paired_up) == starts[2:]
    # every method of a round gets the same batch; the next round another one
    assert _first_tokens(bench.micro_batches(tokens, _args(), 0, 0, 1)) == starts
    assert _first_tokens(bench.micro_batches(tokens, _args(), 1, 0, 1)) != starts


def test_every_window_lies_inside_the_corpus():
    tokens = np.arange(7)  # seq 4: a window of 5 tokens (inputs and the last label) fits at 0, 1
    for step in range(20):
        for b in bench.micro_batches(tokens, _args(), step, 0, 1):
            assert b["tokens"].shape == (1, 4) and int(b["tokens"][0, 0]) in (0, 1)


def test_round_order_rotates_so_no_method_always_steps_first():
    methods = ["none", "aux_loss", "QB"]
    assert [bench.round_order(methods, s) for s in range(4)] == [
        ["none", "aux_loss", "QB"],
        ["aux_loss", "QB", "none"],
        ["QB", "none", "aux_loss"],
        ["none", "aux_loss", "QB"],
    ]


def test_summary_ratios_are_nones_time_over_the_methods():
    times = {"none": [1.0, 2.0, 4.0], "fast": [0.5, 2.0, 1.0]}
    router = {"none": [0.0, 0.1, 0.0], "fast": [0.2, 0.3, 0.4]}
    rows = bench.summarize(times, router, global_tokens=1000)
    assert list(rows) == ["none", "fast"]
    none, fast = rows["none"], rows["fast"]
    assert (none["ratio_vs_none"], none["ratio_vs_none_paired"]) == (1.0, 1.0)
    assert none["ratio_vs_none_paired_ci95"] == (1.0, 1.0)
    assert (fast["step_s_median"], fast["step_s_min"]) == (1.0, 0.5)
    assert fast["tokens_per_s"] == 1000.0 and none["tokens_per_s"] == 500.0  # per median step
    assert fast["ratio_vs_none"] == 2.0  # medians 2 s over 1 s: twice as fast
    assert fast["ratio_vs_none_paired"] == 2.0  # the median of round ratios 2, 1 and 4
    assert (fast["router_s_median"], none["router_s_median"]) == (0.3, 0.0)
