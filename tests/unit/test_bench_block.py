"""benchmarks/bench_block.py without timing it: the variants it builds (Megatron's MoELayer at
equal activated parameters, our block with one thing switched per variant), the eager variant's
SiTU-GLU forced only around its own step, and the table's ratios from fixed times (a ratio above 1
is faster than Megatron's layer; a share is the time a feature adds to our block)."""

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from benchmarks import bench_block as bench

NAMES = [
    "megatron_moe",
    "stable",
    "stable_no_norm",
    "stable_swiglu",
    "stable_no_norm_swiglu",
    "stable_eager_situ",
    "stable_per_expert_act",
    "stable_module_linears",
    "stable_router_none",
]


def _shape(**kw):
    shape = dict(hidden=16, latent=8, expert_ffn=12, experts=4, topk=2, shared_ffn=0)
    return SimpleNamespace(**{**shape, "dispatcher": "alltoall", **kw})


def _built(rank, world_size):
    from megatron_latentmoe.compat import initialize_parallel_cpu

    initialize_parallel_cpu()
    variants, notes, device = bench.build_variants(_shape(), torch.float32)
    return dict(
        names=list(variants),
        device=device.type,
        notes=notes,
        ffn={k: v.config.moe_ffn_hidden_size for k, v in variants.items()},
        batched={k: v.experts._batched() for k, v in variants.items() if k != "megatron_moe"},
        bare={k: v.experts._bare_gemms() for k, v in variants.items() if k != "megatron_moe"},
        balancing={k: v.config.moe_router_load_balancing_type for k, v in variants.items()},
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the TE variant is built on CUDA")
def test_megatron_layer_has_our_blocks_activated_parameters_and_each_variant_its_switch():
    from tests.parallel.launcher import run_distributed

    (r,) = run_distributed(_built, 1)
    assert r["names"] == NAMES and r["device"] == "cpu"
    # k·3·d·m' = k·3·l·m_e + 2·d·l: m' = (2·3·8·12 + 2·16·8) / (3·16·2) = 832 / 96 -> 9
    assert "expert ffn 9 (equal activated params)" in r["notes"]["megatron_moe"]
    assert r["ffn"]["megatron_moe"] == 9 and r["ffn"]["stable"] == 12
    # SwiGLU is Megatron's function activation: its experts run Megatron's per-expert forward
    per_expert = ["stable_swiglu", "stable_no_norm_swiglu", "stable_per_expert_act"]
    assert [k for k, v in r["batched"].items() if not v] == per_expert
    assert [k for k, v in r["bare"].items() if not v] == ["stable_module_linears"]
    assert r["notes"]["stable_no_norm_swiglu"].endswith(
        "latent_moe_use_norm=False, hidden_act=swiglu"
    )
    assert r["balancing"]["stable_router_none"] == r["balancing"]["megatron_moe"] == "none"
    assert r["balancing"]["stable"] != "none"


class _Layer(torch.nn.Module):
    """Records the SiTU-GLU path it ran under."""

    def __init__(self, seen):
        super().__init__()
        self.w, self.seen = torch.nn.Parameter(torch.ones(1)), seen

    def forward(self, x):
        from megatron_latentmoe.ops import situ

        self.seen.append(situ._path(x, 1))
        return x * self.w, None


def test_only_the_eager_variant_runs_the_eager_math_and_one_timed_iteration_is_enough(
    monkeypatch,
):
    from megatron_latentmoe.ops import situ

    fused = lambda t, n: "fused"  # noqa: E731
    monkeypatch.setattr(situ, "_path", fused)
    seen = {"stable": [], "stable_eager_situ": [], "stable_swiglu": []}
    layers = {name: _Layer(s) for name, s in seen.items()}
    x = torch.randn(3, 1, 2)
    timings = bench.time_variants(layers, x, torch.ones_like(x), iters=1, warmup=2)
    assert list(timings) == list(seen)
    assert all(med == best > 0 for med, best in timings.values())
    assert seen == dict(
        stable=["fused"] * 3, stable_eager_situ=["eager"] * 3, stable_swiglu=["fused"] * 3
    )
    assert situ._path is fused  # restored


def test_table_ratios_from_fixed_times(monkeypatch, tmp_path):
    seconds = dict(  # (median, min) per variant
        megatron_moe=(2.0, 1.0),
        stable=(1.0, 0.5),
        stable_no_norm=(1.0, 0.5),
        stable_swiglu=(0.8, 0.5),
        stable_no_norm_swiglu=(0.8, 0.5),
        stable_eager_situ=(1.6, 1.0),
        stable_per_expert_act=(3.0, 3.0),
        stable_module_linears=(1.5, 1.2),
        stable_router_none=(0.9, 0.4),
    )
    layers = {name: torch.nn.Linear(2, 3) for name in NAMES}
    layers["stable"] = torch.nn.Linear(4, 5)
    monkeypatch.setattr(bench, "init_single_process", lambda: None)
    monkeypatch.setattr(
        bench,
        "build_variants",
        lambda a, dtype: (layers, dict.fromkeys(NAMES, "n"), torch.device("cpu")),
    )
    monkeypatch.setattr(bench, "time_variants", lambda *a: seconds)
    monkeypatch.setattr(sys, "argv", ["bench_block.py", "--tokens", "100", "--out", str(tmp_path)])
    bench.main()
    out = json.loads((tmp_path / "bench_block.json").read_text())
    rows = out["results"]
    assert rows["stable"]["tokens_per_s"] == 100.0  # tokens over the median step
    assert (rows["stable"]["seconds"], rows["stable"]["seconds_min"]) == (1.0, 0.5)
    assert rows["stable"]["ratio_vs_megatron_moe"] == 2.0  # twice Megatron's tokens/s
    assert rows["stable_per_expert_act"]["ratio_vs_megatron_moe"] == pytest.approx(2 / 3)
    assert (rows["stable"]["params"], rows["megatron_moe"]["params"]) == (25, 9)
    assert out["situ_share"] == pytest.approx(0.2)  # 1 - 0.8 / 1.0
    assert out["situ_share_eager"] == pytest.approx(0.5)  # 1 - 0.8 / 1.6
    assert out["situ_share_min"] == 0.0 and out["situ_share_eager_min"] == 0.5
    assert out["batched_activation_speedup_min"] == 2.5  # 3.0 / 1.2
    assert out["bare_gemm_speedup"] == 1.5  # 1.5 / 1.0
    assert out["qb_share"] == pytest.approx(0.1) and out["qb_share_min"] == pytest.approx(0.2)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--latent", "0"], "--latent 0: an integer >= 1"),
        (["--expert-ffn", "0"], "--expert-ffn 0: an integer >= 1"),
        (["--experts", "4", "--topk", "4"], "--topk 4: an integer below --experts 4"),
        (["--warmup", "-1"], "--warmup -1: an integer >= 0"),
        (["--dtype", "fp16"], "--dtype: invalid choice: 'fp16'"),
        (  # m' = (64·3·1·1 + 2·4096·1) / (3·4096·64) = 0.011 -> 0: Megatron refuses it deep inside
            "--hidden 4096 --latent 1 --expert-ffn 1 --topk 64 --experts 128".split(),
            "--hidden 4096 --latent 1 --expert-ffn 1 --topk 64: Megatron's layer at equal "
            "activated parameters gets expert width 0; allowed: 2*(k*3*l*m_e + 2*d*l) > 3*d*k",
        ),
        (  # m' = (2·3·1·1 + 2·6·1) / (3·6·2) = 0.5 exactly, which round() takes to 0
            ["--hidden", "6", "--latent", "1", "--expert-ffn", "1", "--topk", "2"],
            "--hidden 6 --latent 1 --expert-ffn 1 --topk 2: Megatron's layer",
        ),
    ],
)
def test_bad_options_name_the_option_value_and_what_is_allowed(
    argv, message, monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(sys, "argv", ["bench_block.py", *argv, "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args()
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_smallest_shape_allowed(monkeypatch, tmp_path):
    argv = ["--experts", "2", "--topk", "1", "--shared-ffn", "0", "--warmup", "0", "--iters", "1"]
    monkeypatch.setattr(sys, "argv", ["bench_block.py", *argv, "--out", str(tmp_path)])
    a = bench.parse_args()
    assert (a.experts, a.topk, a.shared_ffn, a.warmup, a.iters) == (2, 1, 0, 0, 1)
    assert a.out == str(tmp_path / "bench_block.json")


def test_narrowest_megatron_width_allowed(monkeypatch, tmp_path):
    argv = ["--hidden", "4", "--latent", "1", "--expert-ffn", "1", "--topk", "1"]
    monkeypatch.setattr(sys, "argv", ["bench_block.py", *argv, "--out", str(tmp_path)])
    a = bench.parse_args()
    assert bench.megatron_expert_ffn(a) == 1  # (1·3·1·1 + 2·4·1) / (3·4·1) = 0.92 -> 1
