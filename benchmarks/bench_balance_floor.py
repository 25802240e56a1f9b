#!/usr/bin/env python
"""How low can ANY balancer take the balance race's MaxVio? Floors measured on the race's model at
its initial weights (the weights every method routes iteration 1 with), or at a race run's trained
weights (``--load``), and on the race's batches.

    python benchmarks/bench_balance_floor.py [--args-file FILE] [--seeds 1234 1 2] [--batches 300]
        [--load SAVE_DIR [--ckpt-step N]]

Every balancer of the race routes a token to the top-k of ``scores + b`` for some bias b (b = 0
for the aux losses and ``none``). So for one batch at fixed weights, no method can beat the best
b for that batch, and a method that never routes a batch with a bias computed from the batch
itself (QB's rule; no method can know a batch before routing it) can at best expect what a b
learnt from OTHER data gives. This benchmark builds the race's model exactly as the race does
(same args file, seed, EP2 over 2 processes, Megatron's data pipeline and sample order; checked:
the ``none`` routing of batch 1 reproduces the race's iteration-1 loads expert for expert), feeds it
the race's batches 1..N without training, and records per batch the MaxVio of the global batch
(mean over the MoE layers, as the race) under four biases:

* ``no bias``: what every method routes iteration 1 with;
* ``the batch's own balancing bias``: solved on the batch itself (forbidden to QB: the best any
  b can do on that batch);
* ``the previous batch's balancing bias``: solved on batch t-1, routing batch t (a balancer
  that knew batch t-1 exactly and the weights did not move);
* ``a pooled bias from other batches``: solved on the pooled tokens of up to ``--pool`` batches
  of the other parity (odd batches are routed with a bias from even ones and vice versa): the
  population bias, what a balancer that knew many other batches, but not this one, would use.

A balancing bias is solved layer by layer in the forward (layer l's bias changes layer l+1's
input) by iterating the exact sort-based QB update (``balancing_reference.exact_quantile_bias``)
with damping 0.5, keeping the iterate with the lowest MaxVio on the tokens it is solved on.
With ``--load``, the weights are a checkpoint's (a race run trained with ``--save``; its
``--ckpt-step``, default the latest), loaded into the same model before the batches are routed:
the floor once the router has learnt what its balancer taught it.
Prints a table (mean, worst and how many batches reach MaxVio <= 1.0) and writes
``benchmarks/results/balance_floor.json``. Launches itself with torchrun (2 processes) when
started with plain ``python``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from functools import partial

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarks.results_io import json_path, write_json  # noqa: E402

VARIANTS = {
    "none": "no bias (iteration 1 of every method)",
    "own": "the batch's own balancing bias (forbidden)",
    "previous": "the previous batch's balancing bias",
    "pooled": "a pooled bias from other batches",
}
TARGET = 1.0  # issue #10: worst iteration MaxVio <= 1.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args_file = os.path.join(REPO, "examples", "args", "k3_sparse_tiny.sh")
    p.add_argument(
        "--args-file",
        default=args_file,
        help="the race's model flags, a bash file as in examples/args (default: "
        f"{os.path.relpath(args_file, REPO)})",
    )
    seeds = [1234]
    p.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=seeds,
        metavar="S",
        help=f"the model's seeds, one torchrun each (default: {' '.join(map(str, seeds))})",
    )
    p.add_argument(
        "--batches", type=int, default=300, help="the race's batches 1..N (default: %(default)s)"
    )
    p.add_argument(
        "--race-iters",
        type=int,
        default=300,
        help="the race's --iters (it sizes Megatron's dataset, hence the sample order; default: "
        "%(default)s)",
    )
    p.add_argument(
        "--global-batch-size",
        type=int,
        help="sequences per batch, one micro-batch per rank (default: the args file's; another "
        "size is not the race's data, so batch 1 is not checked against it)",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        metavar="V",
        help=f"biases to route with, of {' '.join(VARIANTS)} (default: all)",
    )
    p.add_argument(
        "--pool", type=int, default=50, help="batches pooled per parity (default: %(default)s)"
    )
    p.add_argument(
        "--load",
        help="a race run's --save folder: route at its trained weights (default: none, route at "
        "the initial weights)",
    )
    p.add_argument("--ckpt-step", type=int, help="with --load: that iteration (default: latest)")
    p.add_argument(
        "--solver-iters",
        type=int,
        default=40,
        help="damped exact QB updates per balancing bias (default: %(default)s)",
    )
    p.add_argument(
        "--nproc", type=int, default=2, help="ranks, torchrun processes (default: %(default)s)"
    )
    p.add_argument(
        "--race-dir",
        help="the race's workdir: batch 1 is checked against its none run's iteration 1 "
        "(default: the race's default for --args-file)",
    )
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)  # one torchrun per seed
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument(
        "--out", help="JSON file or folder (default: benchmarks/results/balance_floor.json)"
    )
    a = p.parse_args(argv)
    a.out = json_path(p, a.out, "balance_floor.json")
    for name in ("batches", "pool", "solver_iters"):
        if getattr(a, name) < 2:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be >= 2")
    if a.ckpt_step is not None and not a.load:
        p.error(f"--ckpt-step {a.ckpt_step}: allowed only with --load")
    if a.load and not os.path.isdir(a.load):
        p.error(f"--load {a.load}: not a folder; allowed: a run's --save folder")
    if a.load and len(a.seeds) > 1:
        p.error(f"--load with --seeds {' '.join(map(str, a.seeds))}: allowed: the run's one seed")
    a.load = a.load and os.path.abspath(a.load)
    if a.nproc < 1:
        p.error(f"--nproc {a.nproc}: an integer >= 1")
    gbs = a.global_batch_size
    if gbs is not None and (gbs < a.nproc or gbs % a.nproc):
        p.error(f"--global-batch-size {gbs}: allowed: a positive multiple of --nproc {a.nproc}")
    a.args_file = os.path.abspath(a.args_file)
    if a.race_dir is None:
        from bench_training_balance import race_workdir

        a.race_dir = race_workdir(a.args_file)
    return a


# ----------------------------------------------------------------------------- bias math
def loads_of(scores_ME, bias_E, topk):
    """Tokens per expert when each token takes the top-k of fp32 ``scores + bias``, as the QB
    router routes (``balancing.cutoff_route``)."""
    import torch

    from megatron_latentmoe.balancing import cutoff_route

    idx_MK, _ = cutoff_route(scores_ME, bias_E, topk)
    return torch.bincount(idx_MK.reshape(-1), minlength=scores_ME.shape[1])


def max_vio(loads_E) -> float:
    """The race's MaxVio of one layer's loads (``balance_step.BalanceMetrics``)."""
    from megatron_latentmoe.moe.balance_step import BalanceMetrics

    return BalanceMetrics.from_loads(loads_E, int(loads_E.sum())).max_vio


def balancing_bias(scores_ME, topk, iters):
    """(bias, MaxVio on ``scores_ME``): damped iterations of the exact QB update from b = 0, the
    iterate with the lowest MaxVio."""
    import torch

    from megatron_latentmoe.balancing_reference import exact_quantile_bias

    bias = torch.zeros(scores_ME.shape[1], dtype=torch.float32)
    best = (bias, max_vio(loads_of(scores_ME, bias, topk)))
    for _ in range(iters):
        bias = bias + 0.5 * (exact_quantile_bias(scores_ME, bias, topk) - bias)
        vio = max_vio(loads_of(scores_ME, bias, topk))
        if vio < best[1]:
            best = (bias, vio)
    return best


# ----------------------------------------------------------------------------- model and data
def build(a):
    """(args, config, model, this rank's micro-batch of batches 1..N, the iteration of the
    ``--load`` checkpoint or None) as the race builds them."""
    from bench_step_balancers import checked
    from bench_training_balance import METHODS, args_file_flags
    from megatron.training.global_vars import set_global_variables

    from megatron_latentmoe.compat.training import init_cpu_world
    from megatron_latentmoe.model import build_gpt_model
    from megatron_latentmoe.training.forward_step import train_valid_test_datasets_provider

    flags = args_file_flags(a.args_file) + METHODS["QB centered (ours)"]
    flags += ["--train-iters", str(max(a.batches, a.race_iters)), "--eval-iters", "0"]
    flags += ["--seed", str(a.seed)]
    if a.global_batch_size:  # one micro-batch per rank and step: the routing hooks see a batch
        mbs = a.global_batch_size // a.nproc
        flags += ["--global-batch-size", str(a.global_batch_size), "--micro-batch-size", str(mbs)]
    if a.load:
        flags += ["--load", a.load, "--no-load-optim", "--no-load-rng"]
        flags += [] if a.ckpt_step is None else ["--ckpt-step", str(a.ckpt_step)]
    args, config = checked(flags)
    with contextlib.redirect_stdout(io.StringIO()):
        set_global_variables(args)
    init_cpu_world(args)  # seeds the RNGs as the race's pretrain does, before the model is built
    model = build_gpt_model(
        config, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings
    )
    loaded = None
    if a.load:  # the trained weights (the router's bias is each variant's own, set per batch)
        from megatron.training.checkpointing import load_checkpoint

        with contextlib.redirect_stdout(io.StringIO()):
            loaded = load_checkpoint([model], None, None)[0]
    from megatron.training.training import build_train_valid_test_data_iterators

    args.iteration, args.consumed_train_samples, args.consumed_valid_samples = 0, 0, 0
    with contextlib.redirect_stdout(io.StringIO()):
        train_iter, _, _ = build_train_valid_test_data_iterators(train_valid_test_datasets_provider)
    if args.global_batch_size != args.micro_batch_size * args.data_parallel_size:
        raise SystemExit(
            f"--global-batch-size {args.global_batch_size}: this benchmark routes one "
            f"micro-batch per rank and step; allowed: micro-batch size ({args.micro_batch_size}) "
            f"x data-parallel ranks ({args.data_parallel_size})"
        )
    batches = [next(train_iter) for _ in range(a.batches)]
    return args, config, model, batches, loaded


class Floors:
    """Routes every batch through the model with each variant's bias, set in the routers' own
    ``routing`` (instance wrappers) layer by layer, and records the global loads."""

    def __init__(self, a, config, model, batches):
        import torch.distributed as dist

        from megatron_latentmoe.moe.router import QuantileBalancingRouter

        self.a, self.config, self.model, self.batches = a, config, model, batches
        self.topk = config.moe_router_topk
        self.routers = [m for m in model.modules() if isinstance(m, QuantileBalancingRouter)]
        self.group = self.routers[0].token_group
        self.world = dist.get_world_size(self.group)
        self.policy = None
        for layer, router in enumerate(self.routers):
            router.routing = self._wrap(layer, router, router.routing)

    def _wrap(self, layer, router, routing):
        def wrapped(logits, padding_mask=None):
            import torch

            with torch.no_grad():
                router.expert_bias.copy_(
                    self.policy(layer, self._global_scores(logits, padding_mask))
                )
            return routing(logits, padding_mask=padding_mask)

        return wrapped

    def _global_scores(self, logits, padding_mask):
        """fp32 sigmoid scores [tokens of every rank, n], padding dropped."""
        import torch
        import torch.distributed as dist

        n = logits.shape[-1]
        s = torch.sigmoid(logits.detach().reshape(-1, n).float())
        valid = (
            torch.ones(s.shape[0]) if padding_mask is None else (~padding_mask.reshape(-1)).float()
        )
        both = torch.cat([s, valid[:, None]], dim=1)
        parts = [torch.empty_like(both) for _ in range(self.world)]
        dist.all_gather(parts, both, group=self.group)
        g = torch.cat(parts)
        return g[g[:, -1] > 0, :-1].contiguous()

    def forward(self, batch, policy):
        """This rank's micro-batch of one step through the model, each router's bias from
        ``policy(layer, global scores)``."""
        import torch

        from megatron_latentmoe.training.forward_step import get_batch

        self.policy = policy
        self.model.train()
        with torch.no_grad():
            tokens, labels, loss_mask, attention, position_ids, padding = get_batch(
                batch, pre_process=True, config=self.config
            )
            self.model(
                tokens,
                position_ids,
                attention,
                labels=labels,
                loss_mask=loss_mask,
                padding_mask=padding,
            )

    def run_variant(self, name, pooled=None):
        """Per batch: [MaxVio of each MoE layer]; and the loads of batch 1 per layer."""
        import torch

        zeros = torch.zeros(self.config.num_moe_experts)
        state = dict(zeros=zeros, previous=[zeros] * len(self.routers), vios=None, loads_1=[])
        out = []
        for t, batch in enumerate(self.batches):
            state["vios"] = [None] * len(self.routers)
            self.forward(batch, partial(self._variant_bias, name, t, pooled, state))
            out.append(state["vios"])
        return out, state["loads_1"]

    def _variant_bias(self, name, t, pooled, state, layer, g):
        """The bias variant ``name`` routes batch ``t`` with at MoE layer ``layer`` (global scores
        ``g``); records the loads it gives."""
        if name == "none":
            bias = state["zeros"]
        elif name == "own":
            bias = balancing_bias(g, self.topk, self.a.solver_iters)[0]
        elif name == "previous":
            bias = state["previous"][layer]
            state["previous"][layer] = balancing_bias(g, self.topk, self.a.solver_iters)[0]
        else:
            bias = pooled[1 - t % 2][layer]
        loads = loads_of(g, bias, self.topk)
        state["vios"][layer] = max_vio(loads)
        if t == 0:
            state["loads_1"].append(loads.tolist())
        return bias

    def pooled_biases(self):
        """For each parity: the balancing bias of each layer, solved on the pooled tokens of that
        parity's first ``--pool`` batches, layer after layer."""
        import torch

        biases = []
        for parity in (0, 1):
            solved = []
            for layer in range(len(self.routers)):
                pool = []
                for batch in self.batches[parity::2][: self.a.pool]:
                    self.forward(batch, partial(_pool_bias, solved, layer, pool))
                solved.append(balancing_bias(torch.cat(pool), self.topk, self.a.solver_iters)[0])
            biases.append(solved)
        return biases


def _pool_bias(solved, layer, pool, i, g):
    """Layers before ``layer`` route with their solved pooled bias; ``layer`` adds its scores to
    ``pool`` (routed without a bias, as are the layers after it, which nothing reads)."""
    import torch

    if i == layer:
        pool.append(g)
    return solved[i] if i < layer else torch.zeros(g.shape[1])


def race_iteration_1(a):
    """Per-layer loads of iteration 1 in the race's ``none`` run of this seed (None: not run):
    ``none_seed_S.jsonl`` of a race with ``--seeds``, or ``none.jsonl`` of one without (the
    default command), trained with its args file's seed (the last ``--seed`` of the flags it
    recorded, ``none.cmd.json``)."""
    from bench_training_balance import _slug, record_path

    if a.global_batch_size or a.load:
        return None
    path = os.path.join(a.race_dir, _slug(f"none seed {a.seed}") + ".jsonl")
    if not os.path.exists(path):
        path = os.path.join(a.race_dir, _slug("none") + ".jsonl")
        try:
            with open(record_path(path)) as f:
                flags = json.load(f)
        except (OSError, ValueError):
            return None
        seeds = [flags[i + 1] for i, w in enumerate(flags[:-1]) if w == "--seed"]
        if not os.path.exists(path) or seeds[-1:] != [str(a.seed)]:
            return None
    with open(path) as f:
        first = json.loads(f.readline())
    return [layer["loads"] for layer in first["layers"]]


def run_rank(a):
    import logging

    import torch.distributed as dist

    from megatron_latentmoe.compat import (
        apply_core_compat,
        apply_cpu_compat,
        apply_python311_compat,
    )

    logging.getLogger("megatron").setLevel(logging.ERROR)
    apply_python311_compat()
    apply_core_compat()
    apply_cpu_compat()
    args, config, model, batches, loaded = build(a)
    floors = Floors(a, config, model, batches)
    start, result = time.time(), {}
    pooled = floors.pooled_biases() if "pooled" in a.variants else None
    result["tokens_per_batch"] = args.global_batch_size * args.seq_length
    result["loaded_iteration"] = loaded
    for name in a.variants:
        vios, loads_1 = floors.run_variant(name, pooled)
        result[name] = vios
        if name == "none":
            race = race_iteration_1(a)
            result["batch_1_loads"] = loads_1
            result["matches_race_iteration_1"] = None if race is None else race == loads_1
        if dist.get_rank() == 0:
            print(f"[floor] seed {a.seed}: {name} done ({time.time() - start:.0f} s)", flush=True)
    if dist.get_rank() == 0:
        write_json(a.part, result)


def summarize(per_seed, variants):
    """Per variant: mean over the batches' MaxVio (mean over layers), the worst, the share of
    batches at or under the target; 'previous' skips batch 1 (nothing precedes it)."""
    rows = {}
    for name in variants:
        per_batch = []
        for result in per_seed.values():
            vios = result[name][1:] if name == "previous" else result[name]
            per_batch += [sum(v) / len(v) for v in vios]
        rows[name] = dict(
            mean=sum(per_batch) / len(per_batch),
            worst=max(per_batch),
            at_or_under_target=sum(v <= TARGET for v in per_batch) / len(per_batch),
            batch_1={  # 'previous' has no bias for batch 1
                s: None if name == "previous" else sum(r[name][0]) / len(r[name][0])
                for s, r in per_seed.items()
            },
        )
    return rows


def main(argv=None):
    a = parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        run_rank(a)
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
        return 0
    from bench_step_balancers import torchrun

    per_seed = {}
    argv = sys.argv[1:] if argv is None else list(argv)
    for seed in a.seeds:
        part = a.out + f".seed{seed}.part"
        if torchrun(
            os.path.abspath(__file__), a.nproc, [*argv, "--seed", str(seed), "--part", part]
        ):
            raise SystemExit(f"seed {seed}: the run failed (its output is above)")
        with open(part) as f:
            per_seed[str(seed)] = json.load(f)
        os.remove(part)
    rows = summarize(per_seed, a.variants)
    tokens = next(iter(per_seed.values()))["tokens_per_batch"]
    loaded = next(iter(per_seed.values()))["loaded_iteration"]
    weights = "the initial weights" if not a.load else f"{a.load}'s weights (iteration {loaded})"
    print(
        f"\nMaxVio floors at {weights}, {os.path.relpath(a.args_file, REPO)}, "
        f"batches 1-{a.batches} of {tokens} tokens, seeds {' '.join(per_seed)} "
        "(mean over MoE layers, global batch)"
    )
    labels = dict(VARIANTS, none="no bias (the router's own top-k)") if a.load else VARIANTS
    width = max(len(v) for v in labels.values()) + 2
    print(f"{'bias':<{width}}{'mean':>7}{'worst':>7}{'<= 1.0':>8}  batch 1 by seed")
    for name, r in rows.items():
        batch_1 = " / ".join("-" if v is None else f"{v:.2f}" for v in r["batch_1"].values())
        print(
            f"{labels[name]:<{width}}{r['mean']:>7.2f}{r['worst']:>7.2f}"
            f"{r['at_or_under_target']:>8.0%}  {batch_1}"
        )
    checks = {s: r.get("matches_race_iteration_1") for s, r in per_seed.items()}
    print(f"batch 1 under no bias == the race's iteration-1 loads (none run): {checks}")
    write_json(a.out, dict(args=vars(a), results=rows, per_seed=per_seed), indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
