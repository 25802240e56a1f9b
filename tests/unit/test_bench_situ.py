"""benchmarks/bench_situ.py without timing it: the variants it compares compute the same function
as the model and the HF reference (gate first, the model's betas), the eager variant forces the
op's eager math only inside it, the bytes autograd keeps count each storage once, and the table's
figures are the right ratios of the times it measured (fixed here)."""

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from benchmarks import bench_situ as bench
from megatron_latentmoe.hf.modeling_stable_latentmoe import situ_glu


def test_the_compared_variants_compute_the_models_functions():
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    gate, up = x[:, :8], x[:, 8:]
    reference = situ_glu(gate, up)  # the HF modeling function at its own defaults (4, 25)
    (_, fused, _), (_, eager, eager_ctx), (_, naive, _), (_, swiglu, _) = bench.variants(
        torch.device("cpu")
    )
    torch.testing.assert_close(naive(x), reference)
    torch.testing.assert_close(fused(x), reference)
    with eager_ctx():
        torch.testing.assert_close(eager(x), reference)
    torch.testing.assert_close(swiglu(x), F.silu(gate) * up)  # Megatron's: the gate half first
    assert len(bench.variants(torch.device("cpu"))) == 4  # a fused SwiGLU only on CUDA


def test_eager_variant_forces_the_eager_math_only_inside_it():
    before = bench.situ_mod._path
    x = torch.randn(4, 8)
    with bench._eager_situ():
        assert bench.situ_mod._path(x, 16) == "eager"
    assert bench.situ_mod._path is before
    with pytest.raises(RuntimeError), bench._eager_situ():
        raise RuntimeError("a failing variant")
    assert bench.situ_mod._path is before


def test_saved_bytes_count_each_storage_once():
    rows, f = 5, 3
    x = torch.randn(rows, 2 * f, requires_grad=True)
    out, nbytes, storages = bench.saved_bytes(bench.swiglu, x, bench.contextlib.nullcontext)
    # SwiGLU keeps both halves of x (views of one storage, counted once) and silu(gate)
    assert (nbytes, storages) == (4 * rows * 2 * f + 4 * rows * f, 2)
    assert out.shape == (rows, f)


def test_one_timed_repetition_after_the_warm_up_is_enough():
    x, grad = torch.randn(4, 8), torch.randn(4, 4)
    timings = bench.time_fwd_bwd(bench.variants(torch.device("cpu"))[2:], x, grad, reps=1)
    assert len(timings) == 2 and all(med == best > 0 for med, best in timings)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens", "0"], "--tokens 0: an integer >= 1"),
        (["--ffn", "0"], "--ffn 0: an integer >= 1"),
        (["--threads", "2", "0"], "--threads 0: integers >= 1"),
        (["--device", "cuda"], "--device cuda: no CUDA device here; allowed: cpu"),
    ],
)
def test_bad_options_name_the_option_value_and_what_is_allowed(
    argv, message, monkeypatch, capsys, tmp_path
):
    if argv[0] == "--device" and torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    monkeypatch.setattr(sys, "argv", ["bench_situ.py", *argv, "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_table_figures_are_ratios_of_the_measured_times(monkeypatch, tmp_path):
    """Times fixed per variant (median, min) and the copy at 1e9 B/s: every figure follows."""
    measured = [(0.002, 0.001), (0.004, 0.003), (0.006, 0.001), (0.001, 0.001)]
    monkeypatch.setattr(bench, "time_fwd_bwd", lambda vs, *a: measured[: len(vs)])
    monkeypatch.setattr(bench, "copy_bytes_per_s", lambda x, reps: 1e9)
    monkeypatch.setattr(bench.torch, "set_num_threads", lambda n: None)
    argv = ["--tokens", "4", "--ffn", "8", "--dtypes", "bf16", "--threads", "1", "1"]
    argv += ["--device", "cpu", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["bench_situ.py", *argv])
    bench.main()
    result = json.loads((tmp_path / "bench_situ.json").read_text())
    rows = result["rows"]
    assert result["meta"]["thread_counts"] == [1]  # a count asked twice runs once
    assert [r["time_vs_situ_glu"] for r in rows] == pytest.approx([1.0, 2.0, 3.0, 0.5])
    moved = 8 * 4 * 8 * 2  # bytes of one fwd+bwd: 8 R F bf16 elements
    assert [r["bytes_per_s"] for r in rows] == pytest.approx([moved / m for m, _ in measured])
    assert rows[1]["copy_fraction"] == pytest.approx(moved / 0.004 / 1e9)
    assert rows[1]["fwd_bwd_ms_median"] == pytest.approx(4.0)
    assert rows[1]["fwd_bwd_ms_min"] == pytest.approx(3.0)
    swiglu = rows[3]  # keeps x (the input's own storage) and silu(gate): 1.5 inputs
    assert swiglu["saved_bytes"] == 4 * 16 * 2 + 4 * 8 * 2
    assert swiglu["saved_over_input"] == pytest.approx(1.5)
    assert swiglu["saved_vs_situ_glu"] == pytest.approx(
        swiglu["saved_bytes"] / rows[0]["saved_bytes"]
    )
    assert rows[0]["saved_vs_situ_glu"] == 1.0


def test_copy_bandwidth_counts_the_read_and_the_write(monkeypatch):
    """Each clone timed at 2 s (a fake clock): 2 x 24 bytes (read + write) over 2 s."""
    clock = iter(range(0, 1000, 2))
    x = torch.zeros(2, 3)
    with monkeypatch.context() as patched:  # the fake clock only around the call
        patched.setattr(bench.time, "perf_counter", lambda: next(clock))
        bytes_per_s = bench.copy_bytes_per_s(x, reps=3)
    assert bytes_per_s == 2 * 24 / 2
