"""benchmarks/bench_balancing.py without timing it: its options (refused in one line before any
work), the per-method rows (router time over the plain top-k's: above 1 is slower), the buffer each
method's collective carries, the quantiles the methods compute (exact: the Q-th smallest margin;
megatron-core: its per-micro-batch (Q+1)-th, averaged) and, on a tiny end-to-end run, the MaxVio
curve of the NEXT batch (routed with the bias computed before it)."""

import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks import bench_balancing as bench
from megatron_latentmoe.balancing import HEADER_FIELDS, QuantileHistogram, cutoff_route
from megatron_latentmoe.balancing_reference import (
    exact_quantiles,
    max_violation,
    sign_update_bias,
    topk_loads,
)

# n=8, k=2: m_mb*k % n == 0 for m_mb a multiple of 4
TINY = ["--experts", "8", "--topk", "2", "--micro-batch", "4", "--micro-batches", "2"]
TINY += ["--steps", "3", "--bins", "4", "--hidden", "4", "--err-every", "2"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--drift", "1.5"], "--drift 1.5: a number in [0, 1]"),
        (["--drift", "nan"], "--drift nan: a number in [0, 1]"),
        (["--sign-rate", "inf"], "--sign-rate inf: a finite number >= 0"),
        (["--sign-rate", "-0.1"], "--sign-rate -0.1: a finite number >= 0"),
        (
            ["--experts", "8", "--topk", "2", "--micro-batch", "6"],
            "--micro-batch 6: a multiple of --experts / gcd(--experts, --topk) = 4 "
            "(megatron-core QB needs m_mb*k % n == 0)",
        ),
        (
            [
                "--experts",
                "8",
                "--topk",
                "2",
                "--micro-batch",
                "4",
                "--stationary-micro-batch",
                "6",
            ],
            "--stationary-micro-batch 6: a multiple of --experts / gcd(--experts, --topk) = 4",
        ),
        (["--err-every", "0"], "--err-every 0: an integer >= 1"),
    ],
)
def test_bad_options_name_the_option_value_and_what_is_allowed(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_smallest_allowed_options(tmp_path):
    argv = ["--experts", "8", "--topk", "2", "--micro-batch", "4", "--drift", "1"]
    argv += ["--sign-rate", "0", "--stationary-iters", "0", "--stationary-micro-batch", "3"]
    a = bench.parse_args([*argv, "--out", str(tmp_path)])  # 3: unchecked, no fixed-batch run
    assert (a.micro_batch, a.drift, a.sign_rate, a.stationary_micro_batch) == (4, 1.0, 0.0, 3)


def _meth(name, seconds, curve, est_err=()):
    return SimpleNamespace(
        name=name, seconds=seconds, curve=curve, est_err=list(est_err), bytes_per_step=12
    )


def test_summary_rows_time_ratio_is_the_methods_over_plains_and_means_are_of_the_tail():
    plain = SimpleNamespace(seconds=2.0)
    slow = _meth("slow", 3.0, [100.0] * 5 + [1.0] * 20, est_err=[1.0, 3.0])
    short = _meth("short", 1.0, [3.0, 1.0, 2.0])
    rows = bench.summary_rows([slow, short], plain, {"slow": [0.5, 0.25]}, steps=25)
    assert rows[0]["router_time_ratio"] == 1.5  # 3 s over plain's 2 s: slower than plain
    assert rows[1]["router_time_ratio"] == 0.5
    assert rows[0]["maxvio_next_mean_last20"] == 1.0  # the first 5 steps are outside the tail
    assert (
        rows[0]["mean_abs_bias_err_vs_exact"] == 2.0
        and rows[1]["mean_abs_bias_err_vs_exact"] is None
    )
    assert rows[0]["stationary_final_maxvio"] == 0.25 and rows[1]["stationary_final_maxvio"] is None
    assert rows[0]["bytes_per_step_per_layer"] == 12
    (row,) = bench.summary_rows([short], plain, {}, steps=3)
    assert row["maxvio_next_mean_last20"] == 2.0  # fewer than 20 steps: the mean of all 3


def test_bytes_per_step_are_the_collective_buffers():
    n, b = 4, 8
    hist = bench.Hist("ours B=8", n, 1, QuantileHistogram, b)
    packed = QuantileHistogram(n, 1, b).pack()
    assert hist.bytes_per_step == packed.numel() * packed.element_size() == (n * b + 5) * 4
    assert bench.Exact("exact", n, 1, m_step=6).bytes_per_step == 6 * n * 4  # fp32 margins
    assert bench.Sign("sign", n, 1, 1e-3).bytes_per_step == n * 4


def _scores(m, n, seed):
    return torch.rand(m, n, generator=torch.Generator().manual_seed(seed))


def test_exact_is_the_global_q_th_smallest_margin_then_centred():
    n, k = 4, 1
    mbs = [_scores(3, n, 0), _scores(2, n, 1)]  # m = 5: Q = ceil(5*1/4) = 2, not floor's 1
    bias = torch.tensor([0.05, -0.05, 0.1, -0.1])
    meth = bench.Exact("exact", n, k, 5)
    meth.bias = bias.clone()
    meth.run_step(mbs)
    _, alpha = cutoff_route(torch.cat(mbs), bias, k)
    r = alpha[:, None] - torch.cat(mbs)
    assert torch.equal(meth.raw, r.sort(dim=0).values[1])  # the 2nd smallest per expert
    assert torch.equal(meth.raw, exact_quantiles(torch.cat(mbs), bias, k))
    assert torch.allclose(meth.bias, meth.raw - meth.raw.mean())


def test_histogram_bias_is_its_raw_quantiles_centred():
    n, k = 8, 2
    meth = bench.Hist("ours B=64", n, k, QuantileHistogram, 64)
    meth.run_step([_scores(8, n, 4), _scores(8, n, 5)])
    assert meth.raw.mean().abs() > 0.01  # so centring shows
    assert torch.allclose(meth.bias, meth.raw - meth.raw.mean())
    assert meth.bias.mean().abs() < 1e-6


def test_megatron_core_gets_beta_minus_b_and_its_quantiles_are_averaged():
    qb = bench.load_megatron_qb()
    if qb is None:
        pytest.skip("megatron-core has no qb_dual_update")
    n, k = 4, 2
    bias = torch.tensor([0.3, -0.2, 0.1, -0.2])
    mbs = [_scores(6, n, 2), _scores(6, n, 3)]  # Q = 6*2/4 = 3 per micro-batch
    meth = bench.MegatronQB("megatron-core QB", n, k, qb)
    meth.bias = bias.clone()
    meth.run_step(mbs)

    def q_plus_1_th(s):  # megatron-core's target: the (Q+1)-th smallest r = alpha - s
        _, alpha = cutoff_route(s, bias, k)  # selection on s + b
        return (alpha[:, None] - s).sort(dim=0).values[3]

    want = (q_plus_1_th(mbs[0]) + q_plus_1_th(mbs[1])) / 2
    assert torch.allclose(meth.raw, want)
    assert torch.allclose(meth.bias, want - want.mean())


def test_sign_counts_the_loads_of_every_micro_batch():
    n, k = 2, 1
    first = torch.tensor([[0.9, 0.1]] * 4)  # all to expert 0
    second = torch.tensor([[0.1, 0.9]] * 4)  # all to expert 1: the step's loads are [4, 4]
    meth = bench.Sign("sign", n, k, 0.5)
    meth.run_step([first, second])
    assert torch.equal(meth.bias, torch.zeros(n))  # balanced step: sign(0) = 0
    meth.run_step([first, first])
    assert torch.equal(meth.bias, sign_update_bias(torch.tensor([8, 0]), torch.zeros(n), 0.5))


def test_drift_run_reports_the_next_batchs_maxvio_and_the_error_on_the_same_batch(tmp_path):
    args = bench.parse_args([*TINY, "--no-centred", "--out", str(tmp_path)])
    methods, plain, m_step = bench.drift_run(args)
    assert m_step == 8
    names = [m.name for m in methods]
    assert names == ["ours B=4", "exact global QB", "megatron-core QB", "sign (gamma=0.001)"]
    router = bench.DriftingRouter(8, 4, args.clusters, args.seed, args.drift)
    steps = [router.step(4, 2) for _ in range(3)]
    first = max_violation(topk_loads(torch.cat(steps[0]), torch.zeros(8), 2))
    assert [m.curve[0] for m in methods] == [first] * 4  # step 0 is routed with the zero bias
    exact = bench.Exact("exact", 8, 2, 8)
    exact.run_step(steps[0])  # the bias computed from step 0 routes step 1
    assert methods[1].curve[1] == max_violation(topk_loads(torch.cat(steps[1]), exact.bias, 2))
    assert all(len(m.curve) == 3 for m in methods)
    # accuracy at steps 0 and 2 (every 2), against the exact quantile under the bias in force
    assert [len(m.est_err) for m in methods] == [2, 0, 2, 0]
    mqb = bench.MegatronQB("m", 8, 2, bench.load_megatron_qb())
    mqb.run_step(steps[0])
    ref = exact_quantiles(torch.cat(steps[0]), torch.zeros(8), 2)
    assert methods[2].est_err[0] == pytest.approx((mqb.raw - ref).abs().mean().item())
    assert plain.bias.abs().sum() > 0  # the reference timing routes with a real bias


def test_main_writes_the_config_rows_fixed_batch_curves_and_the_control(tmp_path, monkeypatch):
    runs = []
    drift_run = bench.drift_run

    def recording(args):
        runs.append(drift_run(args))
        return runs[-1]

    monkeypatch.setattr(bench, "drift_run", recording)
    argv = [*TINY, "--stationary-iters", "2", "--stationary-micro-batch", "8"]
    bench.main([*argv, "--control-steps", "4", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "bench_balancing.json").read_text())
    assert (tmp_path / "bench_balancing.png").is_file()
    c = out["config"]
    assert (c["tokens_per_step"], c["target_load_q"], c["stationary_tokens"]) == (8, 2.0, 16)
    names = [r["method"] for r in out["methods"]]
    assert names == [
        "ours B=4",
        "centred B=4",
        "exact global QB",
        "megatron-core QB",
        "sign (gamma=0.001)",
    ]
    # the fixed batch: MaxVio before each of the 2 updates and after the last; no sign method
    curves = out["stationary_curves"]
    assert list(curves) == names[:4] and all(len(v) == 3 for v in curves.values())
    assert [r["stationary_final_maxvio"] for r in out["methods"]] == [
        *(curves[name][-1] for name in names[:4]),
        None,
    ]
    # the control: one cluster, 1000 bins, mean MaxVio next over the last half of its 4 steps
    control_methods = runs[1][0]
    assert [m.name for m in control_methods][0] == "ours B=1000"
    assert out["homogeneous_control_maxvio_next_mean_last_half"] == {
        m.name: sum(m.curve[-2:]) / 2 for m in control_methods
    }
    assert f"n*B + {len(HEADER_FIELDS)} words" in " ".join(out["notes"])
