"""Forward+backward throughput of the Stable LatentMoE block vs Megatron's own MoE layer, one run.

Variants (single process, same tokens, same n / k / shared experts):

* ``megatron_moe``: Megatron-Core's MoELayer. With TE on a GPU: its ``moe_latent_size`` layer
  (TE latent projections, no norm, SwiGLU). Without TE: a plain full-width MoELayer whose expert
  width is chosen for EQUAL ACTIVATED PARAMETERS per token (k·3·d·m' = k·3·l·m_e + 2·d·l).
* ``stable``: our block (W_down, latent SiTU-GLU experts, latent RMSNorm, W_up, QB router).
* ``stable_no_norm``, ``stable_swiglu``, ``stable_no_norm_swiglu``: our block with the latent
  norm and / or SiTU-GLU switched off (SwiGLU instead). SwiGLU is Megatron's function activation,
  not a module, so its routed experts run Megatron's per-expert forward: with many small experts
  the "SiTU-GLU share" printed below then also counts the one-call activation's gain (negative
  at the race's shape).
* ``stable_eager_situ``: our block with SiTU-GLU forced onto its eager math (what ran before the
  fused CPU path / the Triton kernels), to show the fused op's gain in the same run.
* ``stable_per_expert_act``: our block with Megatron's ``SequentialMLP`` forward (per expert: its
  linear modules and its own activation call; ``moe/experts.py``).
* ``stable_module_linears``: our block with each routed expert's fc1 / fc2 called as Megatron's
  parallel linear modules instead of as bare GEMMs on their weights, the activation still once
  for all experts. Beside ``stable_per_expert_act`` it prices the one activation call, beside
  ``stable`` the bare GEMMs.
* ``stable_router_none``: our block with Megatron's plain sigmoid top-k router (balancing
  ``none``; loads still counted). Beside ``stable`` it prices Quantile Balancing itself: the
  top-(k+1) cutoffs, the histogram and the step-end solve (each timed step of a variant ends with
  the step-end update, ``balance_step.update_balance``). At initialisation both routers spread
  the tokens alike, so the experts do the same work.

Prints a table of tokens/s and the ratio to ``megatron_moe``; writes JSON (default
``benchmarks/results/bench_block.json``). Run: ``python benchmarks/bench_block.py [--help]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.results_io import json_path, write_json  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512, help="d (default: %(default)s)")
    p.add_argument("--latent", type=int, default=256, help="l (default: %(default)s)")
    p.add_argument("--expert-ffn", type=int, default=384, help="m_e (default: %(default)s)")
    p.add_argument("--experts", type=int, default=16, help="n (default: %(default)s)")
    p.add_argument("--topk", type=int, default=4, help="k (default: %(default)s)")
    p.add_argument(
        "--shared-ffn", type=int, default=768, help="N_s * m_e, 0: none (default: %(default)s)"
    )
    p.add_argument("--tokens", type=int, default=2048, help="tokens (default: %(default)s)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (default: %(default)s)")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed first iterations (default: %(default)s)"
    )
    p.add_argument(
        "--dispatcher",
        default="alltoall",
        choices=["alltoall", "allgather"],
        help="default: %(default)s",
    )
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="default: %(default)s")
    p.add_argument(
        "--out", help="JSON file or folder (default: benchmarks/results/bench_block.json)"
    )
    a = p.parse_args()
    a.out = json_path(p, a.out, "bench_block.json")
    check_block_options(p, a)
    if megatron_expert_ffn(a) < 1:  # Megatron refuses experts of width 0 deep in its build
        p.error(
            f"--hidden {a.hidden} --latent {a.latent} --expert-ffn {a.expert_ffn} --topk {a.topk}: "
            "Megatron's layer at equal activated parameters gets expert width 0; allowed: "
            "2*(k*3*l*m_e + 2*d*l) > 3*d*k (a width >= 1)"
        )
    return a


def check_block_options(p, a) -> None:
    """The block's shape and timing options (this benchmark's and ``bench_gpu_block.py``'s):
    ``p.error`` (one line, exit 2) naming the option, its value and what is allowed."""
    for name in ("hidden", "latent", "expert_ffn", "experts", "topk", "tokens", "iters"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: an integer >= 1")
    if a.topk >= a.experts:
        p.error(f"--topk {a.topk}: an integer below --experts {a.experts}")
    for name in ("warmup", "shared_ffn"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: an integer >= 0")


def megatron_expert_ffn(a):
    """Megatron's full-width expert width m' for equal activated parameters per token:
    k·3·d·m' = k·3·l·m_e + 2·d·l, rounded."""
    activated = a.topk * 3 * a.latent * a.expert_ffn + 2 * a.hidden * a.latent
    return round(activated / (3 * a.hidden * a.topk))


def init_single_process():
    import torch.distributed as dist

    from megatron_latentmoe.compat import apply_cpu_compat, initialize_parallel_cpu

    apply_cpu_compat()
    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="bench_block_"), "store")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if torch.cuda.is_available():
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(1234)
    else:
        initialize_parallel_cpu()


def build_variants(a, dtype):
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    on_gpu = torch.cuda.is_available()
    te = HAVE_TE and on_gpu
    common = dict(
        hidden_size=a.hidden,
        num_attention_heads=8,
        ffn_hidden_size=4 * a.hidden,
        num_moe_experts=a.experts,
        moe_router_topk=a.topk,
        moe_shared_expert_intermediate_size=a.shared_ffn or None,
        moe_token_dispatcher_type=a.dispatcher,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        moe_router_dtype="fp32",
        use_cpu_initialization=not on_gpu,
    )
    variants, notes = {}, {}
    if te:
        cfg = tiny_config(
            **common,
            moe_ffn_hidden_size=a.expert_ffn,
            moe_latent_size=a.latent,
            latent_moe_use_norm=False,
            hidden_act="swiglu",
            moe_router_load_balancing_type="none",
            moe_grouped_gemm=True,
        )
        variants["megatron_moe"] = get_moe_module_spec(True, a.experts, True)(
            config=cfg, layer_number=1
        )
        notes["megatron_moe"] = "Megatron MoELayer with moe_latent_size (TE)"
    else:
        wide_ffn = megatron_expert_ffn(a)
        cfg = tiny_config(
            **common,
            moe_ffn_hidden_size=wide_ffn,
            moe_latent_size=None,
            latent_moe_use_norm=False,
            hidden_act="swiglu",
            moe_router_load_balancing_type="none",
        )
        variants["megatron_moe"] = get_moe_module_spec(False, a.experts, False)(
            config=cfg, layer_number=1
        )
        notes["megatron_moe"] = (
            f"plain Megatron MoELayer, full width, expert ffn {wide_ffn} (equal activated params)"
        )
    backend = "te" if te else "local"
    for name, extra in {
        "stable": dict(),
        "stable_no_norm": dict(latent_moe_use_norm=False),
        "stable_swiglu": dict(hidden_act="swiglu"),
        "stable_no_norm_swiglu": dict(latent_moe_use_norm=False, hidden_act="swiglu"),
        "stable_eager_situ": dict(),
        "stable_per_expert_act": dict(),
        "stable_module_linears": dict(),
        "stable_router_none": dict(
            moe_router_load_balancing_type="none", moe_router_score_function="sigmoid"
        ),
    }.items():
        cfg = tiny_config(
            **common,
            moe_ffn_hidden_size=a.expert_ffn,
            moe_latent_size=a.latent,
            moe_grouped_gemm=te,
            **extra,
        )
        variants[name] = get_stable_latentmoe_mlp_spec(cfg, backend)(config=cfg, layer_number=1)
        if name == "stable_per_expert_act":  # Megatron's SequentialMLP forward: one call per expert
            variants[name].experts._batched = lambda: False
        if name == "stable_module_linears":  # Megatron's linear modules, not bare GEMMs
            variants[name].experts._bare_gemms = lambda: False
        notes[name] = f"ours ({backend} spec) " + (
            ", ".join(f"{k}={v}" for k, v in extra.items()) or "full"
        )
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    return {k: v.to(device).train() for k, v in variants.items()}, notes, device


def time_variants(variants, x, grad, iters, warmup):
    """(median, min) seconds per fwd+bwd; variants are interleaved so machine noise hits all
    alike (on a shared, oversubscribed machine the min is the steadier estimate)."""

    from megatron_latentmoe.moe.balance_step import update_balance

    def step(layer):
        inp = x.detach().requires_grad_()
        out, _ = layer(inp)
        out.backward(grad)
        update_balance([layer])  # the step end: QB solve, load metrics (no-op: Megatron's)
        layer.zero_grad(set_to_none=True)

    from megatron_latentmoe.ops import situ

    times = {name: [] for name in variants}
    for i in range(warmup + iters):
        for name, layer in variants.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fused_path = situ._path
            if name == "stable_eager_situ":
                situ._path = lambda t, n: "eager"
            try:
                step(layer)
            finally:
                situ._path = fused_path
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def main():
    a = parse_args()
    torch.manual_seed(0)
    init_single_process()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    variants, notes, device = build_variants(a, dtype)
    x = torch.randn(a.tokens, 1, a.hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    rows = {}
    for name, (seconds, best) in time_variants(variants, x, grad, a.iters, a.warmup).items():
        layer = variants[name]
        rows[name] = dict(
            seconds=seconds,
            seconds_min=best,
            tokens_per_s=a.tokens / seconds,
            note=notes[name],
            params=sum(p.numel() for p in layer.parameters()),
        )
    base = rows["megatron_moe"]["tokens_per_s"]
    print(
        f"\nfwd+bwd, {a.tokens} tokens, d={a.hidden} l={a.latent} m_e={a.expert_ffn} "
        f"n={a.experts} k={a.topk} shared={a.shared_ffn}, {a.dtype}, {device.type}"
    )
    print(f"{'variant':<24}{'ms/iter':>10}{'tokens/s':>12}{'vs megatron':>13}{'params':>11}  note")
    for name, r in rows.items():
        r["ratio_vs_megatron_moe"] = r["tokens_per_s"] / base
        print(
            f"{name:<24}{1e3 * r['seconds']:>10.2f}{r['tokens_per_s']:>12.0f}"
            f"{r['ratio_vs_megatron_moe']:>12.2f}x{r['params']:>11d}  {r['note']}"
        )

    # SiTU-GLU's share of our block's fwd+bwd: the time it adds over SwiGLU, side by side.
    def share(key, variant):
        return 1.0 - rows["stable_swiglu"][key] / rows[variant][key]

    situ_share, eager_share = share("seconds", "stable"), share("seconds", "stable_eager_situ")
    print(
        f"SiTU-GLU share of the block's fwd+bwd (1 - t(stable_swiglu) / t(stable)): median "
        f"{100 * situ_share:.1f} % fused, {100 * eager_share:.1f} % eager math; min "
        f"{100 * share('seconds_min', 'stable'):.1f} % fused, "
        f"{100 * share('seconds_min', 'stable_eager_situ'):.1f} % eager math"
    )
    # both with Megatron's linear modules: the activation call is the only difference
    batched = (
        rows["stable_per_expert_act"]["seconds_min"] / rows["stable_module_linears"]["seconds_min"]
    )
    print(f"one activation call for all experts: {batched:.2f}x faster than one per expert (min)")
    bare = rows["stable_module_linears"]["seconds"] / rows["stable"]["seconds"]
    print(f"bare expert GEMMs: the block {bare:.2f}x faster than with Megatron's linears (median)")
    qb_share = 1.0 - rows["stable_router_none"]["seconds"] / rows["stable"]["seconds"]
    qb_share_min = 1.0 - rows["stable_router_none"]["seconds_min"] / rows["stable"]["seconds_min"]
    print(
        f"Quantile Balancing's share of the block's fwd+bwd+step end (1 - t(stable_router_none) "
        f"/ t(stable)): median {100 * qb_share:.1f} %, min {100 * qb_share_min:.1f} %"
    )
    write_json(
        a.out,
        dict(
            args=vars(a),
            device=device.type,
            torch=torch.__version__,
            situ_share=situ_share,
            situ_share_eager=eager_share,
            situ_share_min=share("seconds_min", "stable"),
            situ_share_eager_min=share("seconds_min", "stable_eager_situ"),
            batched_activation_speedup_min=batched,
            bare_gemm_speedup=bare,
            qb_share=qb_share,
            qb_share_min=qb_share_min,
            results=rows,
        ),
        indent=2,
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
