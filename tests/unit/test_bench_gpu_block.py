"""benchmarks/bench_gpu_block.py without a GPU: its options (K3's widths, n and k divided by 8; bad
ones refused in one line before any work), the table's ratios from fixed times (tokens/s over
Megatron's latent layer's: above 1 is faster; an FP8 recipe's speed-up is bf16's time over its)
and which Transformer Engine check decides each FP8 recipe (a fake TE module)."""

import sys
from types import ModuleType

import pytest

from benchmarks import bench_gpu_block as bench


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--experts", "14", "--topk", "14"], "--topk 14: an integer below --experts 14"),
        (["--iters", "0"], "--iters 0: an integer >= 1"),
        (["--tokens", "0"], "--tokens 0: an integer >= 1"),
        (["--latent", "0"], "--latent 0: an integer >= 1"),
        (["--warmup", "-1"], "--warmup -1: an integer >= 0"),
        (["--shared-ffn", "-1"], "--shared-ffn -1: an integer >= 0"),
        (["--recipes", "fp4"], "--recipes: invalid choice: 'fp4'"),
    ],
)
def test_bad_options_name_the_option_value_and_what_is_allowed(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_defaults_are_k3s_widths_with_n_and_k_over_8(tmp_path):
    a = bench.parse_args(["--out", str(tmp_path)])
    assert (a.experts, a.topk, a.tokens) == (896 // 8, 16 // 8, 8192)
    assert bench.tokens_per_expert(a) == pytest.approx(146.3, abs=0.1)  # K3's T*k/n = 8192*2/112
    assert (a.hidden, a.latent) == (bench.K3["hidden_size"], bench.K3["moe_latent_size"])
    assert a.recipes == list(bench.FP8_RECIPES) and a.out == str(tmp_path / "bench_gpu_block.json")
    small = bench.parse_args(["--experts", "2", "--topk", "1", "--warmup", "0", "--iters", "1"])
    assert (small.experts, small.topk, small.warmup, small.iters) == (2, 1, 0, 1)


def test_bf16_ratios_are_over_megatrons_latent_layer():
    rows = bench.bf16_rows(
        {"megatron_latent_moe": 0.5, "stable": 0.25, "stable_no_norm_swiglu": 1.0}, tokens=1000
    )
    assert rows["megatron_latent_moe"] == dict(
        ms=500.0, tokens_per_s=2000.0, ratio_vs_megatron_latent_moe=1.0
    )
    assert rows["stable"] == dict(ms=250.0, tokens_per_s=4000.0, ratio_vs_megatron_latent_moe=2.0)
    assert rows["stable_no_norm_swiglu"]["ratio_vs_megatron_latent_moe"] == 0.5


def test_fp8_speed_up_is_bf16s_time_over_the_recipes():
    row = bench.fp8_row({"bf16": 0.3, "mxfp8": 0.2}, "mxfp8")
    assert row == dict(ms=200.0, bf16_ms=300.0, speedup_vs_bf16=pytest.approx(1.5))


def test_each_recipe_asks_its_own_transformer_engine_check(monkeypatch):
    te = ModuleType("transformer_engine")
    te_pt = ModuleType("transformer_engine.pytorch")
    te_pt.is_fp8_available = lambda return_reason: (True, None)
    te_pt.is_mxfp8_available = lambda return_reason: (False, "needs Blackwell")
    te_pt.is_fp8_block_scaling_available = lambda return_reason: (0, "needs Hopper")
    te.pytorch = te_pt
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pt)
    assert bench.recipe_available("delayed") == (True, "")
    assert bench.recipe_available("tensorwise") == (True, "")
    assert bench.recipe_available("mxfp8") == (False, "needs Blackwell")
    assert bench.recipe_available("blockwise") == (False, "needs Hopper")
