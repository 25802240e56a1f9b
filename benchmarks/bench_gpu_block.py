"""GPU (Transformer Engine) fwd+bwd of the Stable LatentMoE block at K3 widths, side by side in
one run: vs Megatron-Core's own ``moe_latent_size`` MoELayer (TE, SwiGLU, no norm), and bf16 vs
every FP8 recipe the GPU runs. Writes JSON (with the GPU's name) and prints a table of ratios.

K3 widths (SPEC §5; the defaults are ``fields``' K3 values): d, l, m_e and the N_s shared experts
of m_e each. K3's n = 896, k = 16 do not fit one GPU; n and k are divided by 8 (n 112, k 2), which
keeps K3's tokens per expert T*k/n = 146 at T = 8192 tokens per rank, so each expert GEMM has
K3's shape.

    python benchmarks/bench_gpu_block.py [--tokens 8192] [--experts 112] [--topk 2] [--out ...]

Without CUDA or Transformer Engine it writes ``{"skipped": reason}`` and exits 0 (the CPU
comparison is benchmarks/bench_block.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_block import check_block_options  # noqa: E402
from benchmarks.results_io import json_path, write_json  # noqa: E402
from megatron_latentmoe.fields import hf_defaults, read_hf  # noqa: E402

FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
K3 = read_hf(
    hf_defaults(),
    [
        "hidden_size",
        "moe_latent_size",
        "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size",
        "num_experts",
        "moe_router_topk",
    ],
)
"""SPEC §5's sizes (the HF config class's defaults), in Megatron units."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=K3["hidden_size"], help="d (default: %(default)s)")
    p.add_argument(
        "--latent", type=int, default=K3["moe_latent_size"], help="l (default: %(default)s)"
    )
    p.add_argument(
        "--expert-ffn",
        type=int,
        default=K3["moe_ffn_hidden_size"],
        help="m_e (default: %(default)s)",
    )
    n, k = K3["num_experts"], K3["moe_router_topk"]
    p.add_argument("--experts", type=int, default=n // 8, help=f"n (K3: {n}; default: %(default)s)")
    p.add_argument("--topk", type=int, default=k // 8, help=f"k (K3: {k}; default: %(default)s)")
    shared = K3["moe_shared_expert_intermediate_size"]
    p.add_argument(
        "--shared-ffn", type=int, default=shared, help="N_s * m_e (default: %(default)s)"
    )
    p.add_argument(
        "--tokens", type=int, default=8192, help="tokens per rank (default: %(default)s)"
    )
    p.add_argument("--iters", type=int, default=10, help="timed iterations (default: %(default)s)")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed first iterations (default: %(default)s)"
    )
    p.add_argument(
        "--recipes",
        nargs="*",
        default=list(FP8_RECIPES),
        choices=FP8_RECIPES,
        help=f"FP8 recipes to time (default: {' '.join(FP8_RECIPES)})",
    )
    p.add_argument(
        "--no-grouped-gemm",
        action="store_true",
        help="sequential TE experts (where cuBLASLt grouped GEMM is unavailable)",
    )
    p.add_argument(
        "--out", help="JSON file or folder (default: benchmarks/results/bench_gpu_block.json)"
    )
    a = p.parse_args(argv)
    a.out = json_path(p, a.out, "bench_gpu_block.json")
    check_block_options(p, a)
    return a


def tokens_per_expert(a):
    """T*k/n: the rows of each expert's GEMM (K3's 146 at the defaults)."""
    return a.tokens * a.topk / a.experts


def bf16_rows(seconds, tokens):
    """ms, tokens/s and tokens/s over Megatron's latent layer's (above 1: faster) per variant."""
    rows = {name: dict(ms=1e3 * sec, tokens_per_s=tokens / sec) for name, sec in seconds.items()}
    base = rows["megatron_latent_moe"]["tokens_per_s"]
    for r in rows.values():
        r["ratio_vs_megatron_latent_moe"] = r["tokens_per_s"] / base
    return rows


def fp8_row(seconds, recipe):
    """One FP8 recipe's ms beside bf16's, and bf16's seconds over its (above 1: FP8 faster)."""
    return dict(
        ms=1e3 * seconds[recipe],
        bf16_ms=1e3 * seconds["bf16"],
        speedup_vs_bf16=seconds["bf16"] / seconds[recipe],
    )


def skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - TE raises RuntimeError without CUDA libs
        return f"needs Transformer Engine ({exc})"
    return None


def recipe_available(name: str) -> tuple[bool, str]:
    import transformer_engine.pytorch as te_pt

    check = {
        "mxfp8": te_pt.is_mxfp8_available,
        "blockwise": te_pt.is_fp8_block_scaling_available,
    }.get(name, te_pt.is_fp8_available)
    ok, reason = check(return_reason=True)
    return bool(ok), reason or ""


def build(a, **overrides):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    values = dict(
        hidden_size=a.hidden,
        num_attention_heads=56,
        ffn_hidden_size=4 * a.hidden,
        num_moe_experts=a.experts,
        moe_router_topk=a.topk,
        moe_shared_expert_intermediate_size=a.shared_ffn or None,
        moe_ffn_hidden_size=a.expert_ffn,
        moe_latent_size=a.latent,
        params_dtype=torch.bfloat16,
        bf16=True,
        moe_router_dtype="fp32",
        use_cpu_initialization=False,
        moe_grouped_gemm=not a.no_grouped_gemm,
        moe_token_dispatcher_type="alltoall",
    )
    megatron = overrides.pop("megatron", False)
    values.update(overrides)
    if megatron:  # Megatron's own latent MoE layer: TE, SwiGLU, no latent norm, its router
        cfg = tiny_config(
            **values,
            latent_moe_use_norm=False,
            hidden_act="swiglu",
            moe_router_load_balancing_type="none",
        )
        spec = get_moe_module_spec(True, a.experts, not a.no_grouped_gemm)
    else:
        cfg = tiny_config(**values)
        spec = get_stable_latentmoe_mlp_spec(cfg, "te")
    return spec(config=cfg, layer_number=1).cuda().train(), cfg


def fp8_context(cfg):
    from megatron.core.fp8_utils import get_fp8_context

    return get_fp8_context(cfg) if cfg.fp8 else contextlib.nullcontext()


def time_side_by_side(variants, x, grad, iters, warmup):
    """Median fwd+bwd seconds per variant (name -> (layer, cfg)), interleaved per iteration."""
    times = {name: [] for name in variants}
    for i in range(warmup + iters):
        for name, (layer, cfg) in variants.items():
            inp = x.detach().requires_grad_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with fp8_context(cfg):
                out, _ = layer(inp)
            out.backward(grad)
            torch.cuda.synchronize()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
            layer.zero_grad(set_to_none=True)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
    a = parse_args(argv)
    reason = skip_reason()
    if reason:
        print(f"bench_gpu_block: skipped: {reason}")
        result = dict(skipped=reason, args=vars(a))
    else:
        from bench_block import init_single_process

        init_single_process()
        torch.manual_seed(0)
        x = torch.randn(a.tokens, 1, a.hidden, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn_like(x)
        fp8_rows, skipped = {}, {}
        bf16 = {
            "megatron_latent_moe": build(a, megatron=True),
            "stable": build(a),
            "stable_no_norm_swiglu": build(a, latent_moe_use_norm=False, hidden_act="swiglu"),
        }
        rows = bf16_rows(time_side_by_side(bf16, x, grad, a.iters, a.warmup), a.tokens)
        stable_bf16 = bf16.pop("stable")
        del bf16
        gc.collect()
        torch.cuda.empty_cache()
        for recipe in a.recipes:
            ok, why = recipe_available(recipe)
            if not ok:
                skipped[recipe] = why
                continue
            fmt = "hybrid" if recipe == "delayed" else "e4m3"
            layer, cfg = build(
                a, fp8=fmt, fp8_recipe=recipe, moe_router_padding_for_quantization=True
            )
            weights = {
                k: v
                for k, v in stable_bf16[0].state_dict().items()
                if not k.endswith("_extra_state")
            }  # keep the FP8 layer's own TE meta
            layer.load_state_dict(weights, strict=False)
            pair = {"bf16": stable_bf16, recipe: (layer, cfg)}
            sec = time_side_by_side(pair, x, grad, a.iters, a.warmup)
            fp8_rows[recipe] = fp8_row(sec, recipe)
            del layer, pair
            gc.collect()
            torch.cuda.empty_cache()
        result = dict(
            gpu=torch.cuda.get_device_name(),
            torch=torch.__version__,
            te=__import__("transformer_engine").__version__,
            args=vars(a),
            tokens_per_expert=tokens_per_expert(a),
            bf16=rows,
            fp8=fp8_rows,
            fp8_skipped=skipped,
            peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
        )
        print(
            f"\n{result['gpu']}: fwd+bwd, T={a.tokens} d={a.hidden} l={a.latent} "
            f"m_e={a.expert_ffn} n={a.experts} k={a.topk} (T*k/n = "
            f"{result['tokens_per_expert']:.0f}), bf16"
        )
        print(f"{'variant':<26}{'ms':>9}{'tokens/s':>12}{'vs Megatron latent':>20}")
        for name, r in rows.items():
            print(
                f"{name:<26}{r['ms']:>9.2f}{r['tokens_per_s']:>12.0f}"
                f"{r['ratio_vs_megatron_latent_moe']:>19.3f}x"
            )
        print(f"{'FP8 recipe':<26}{'ms':>9}{'bf16 ms':>12}{'speed-up':>20}")
        for name, r in fp8_rows.items():
            print(f"{name:<26}{r['ms']:>9.2f}{r['bf16_ms']:>12.2f}{r['speedup_vs_bf16']:>19.3f}x")
        for name, why in skipped.items():
            print(f"{name:<26} skipped: {why}")
    write_json(a.out, result, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
