#!/usr/bin/env python
"""Training-step tokens/s of every balancer, side by side in one run: the balance race's tokens/s
without its run-to-run noise.

    python benchmarks/bench_step_balancers.py [--steps 60] [--methods M ...] [--args-file FILE]

The race (``bench_training_balance.py``) trains each method in its own pair of processes, minutes
apart. On a shared machine that moves one method's median step time by more than the 3 % its
tokens/s target asks about: on this project's 2-core VM two identical ``none`` runs started
together (one process each, EP1) had medians of 978 and 1,079 ms, and QB centered's race-run
medians ranged over 561-686 ms. Here every method's model trains in the SAME two processes (the
race's args file and layout, EP2 over 2 ranks, DP2 for the dense part), one whole step each in
turn (Megatron's schedule, DDP, ``finalize_model_grads`` with the step-end balance update, Adam
at the args file's LR after its linear warm-up, no decay), on the same random windows of the
shipped corpus, from the same initialisation, with the race's flags per method
(``bench_training_balance.METHODS``). Machine noise then hits every method
alike; each step is timed between barriers, so it is the slower rank's time.

Prints per method the median step time over the steps after ``--warmup``, tokens/s, the ratio to
``none`` and the median of the per-round ratios (``none``'s step and the method's in the same round,
seconds apart) with its 95 % bootstrap interval, and writes
``benchmarks/results/bench_step_balancers.json``. The methods' routing evolves as in the race
(``none`` collapses onto a few experts, the balancers spread the tokens), so the ratio includes what
balanced routing itself costs, not only the balancer's own work. That work is timed apart: ``router
ms`` is the median per step of the time spent in the routers' forward (QB: its input sum, drift
correction, top-(k+1) cutoffs and histogram; the aux losses' top-k and loss; every router's load
count) plus the step-end update (``update_balance``: the all-reduce, QB's solve, the balance
metrics), on rank 0, without the routers' small backward. Launches itself with torchrun (2
processes) when started with plain ``python``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import time
from functools import partial

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarks.results_io import json_path, write_json  # noqa: E402


def parse_args(argv=None):
    from bench_training_balance import (
        add_model_and_method_args,
        check_model_and_method_args,
        results_dir,
    )

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_method_args(p)
    p.add_argument(
        "--steps",
        type=int,
        default=60,
        help="timed rounds, one step per method (default: %(default)s)",
    )
    p.add_argument(
        "--warmup", type=int, default=5, help="untimed first rounds (default: %(default)s)"
    )
    p.add_argument(
        "--nproc", type=int, default=2, help="ranks, torchrun processes (default: %(default)s)"
    )
    p.add_argument(
        "--out",
        help="JSON file or folder (default: bench_step_balancers.json in benchmarks/results for "
        "k3_sparse_tiny.sh, in benchmarks/results/<args file's name> for any other)",
    )
    a = p.parse_args(argv)
    check_model_and_method_args(p, a)
    for flag, value, least in (
        ("--steps", a.steps, 1),
        ("--warmup", a.warmup, 0),
        ("--nproc", a.nproc, 1),
    ):
        if value < least:
            p.error(f"{flag} {value}: an integer >= {least}")
    a.out = json_path(p, a.out or results_dir(a.args_file) + os.sep, "bench_step_balancers.json")
    given = " ".join(map(repr, a.methods))
    if "none" not in a.methods:
        p.error(f"--methods {given}: must include 'none' (the ratios are to it)")
    if len(set(a.methods)) < len(a.methods):  # a method twice would step twice a round
        p.error(f"--methods {given}: each method at most once")
    return a


def checked(argv):
    """(args, transformer config) for ``argv``, checked as the entry point checks them."""
    from megatron_latentmoe.training.pretrain import checked_args

    saved = sys.argv
    sys.argv = ["bench_step_balancers", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args, config, _, _ = checked_args(has_cuda=False)
    finally:
        sys.argv = saved
    return args, config


class Trainee:
    """One method's model, DDP wrapper and optimizer."""

    def __init__(self, args, config, seed):
        import torch
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from megatron_latentmoe.model import build_gpt_model
        from megatron_latentmoe.training.balance_logging import (
            balance_step_end,
            make_finalize_model_grads_func,
        )
        from megatron_latentmoe.training.qb_rescore import QBRescore

        self.args, self.config = args, config
        self.iteration, self.num_micro_batches = 0, None
        self.rescore, self.train_step = None, self._train_step
        if args.moe_qb_rescore_iters:  # QB rescoring, as the entry point runs it
            self.rescore = QBRescore(
                args.moe_qb_rescore_iters,
                partial(balance_step_end, balance_logger=None),
                solves=args.moe_qb_rescore_solves,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                num_microbatches=lambda: self.num_micro_batches,
            )
            self.train_step = self.rescore.wrap_train_step(self._train_step)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        model = build_gpt_model(
            self.config,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
        )
        self.ddp = DistributedDataParallel(
            config=self.config, ddp_config=DistributedDataParallelConfig(), module=model
        )
        self.config.finalize_model_grads_func = make_finalize_model_grads_func(None, self.rescore)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=args.lr,
                weight_decay=args.weight_decay,
                adam_beta1=args.adam_beta1,
                adam_beta2=args.adam_beta2,
                clip_grad=args.clip_grad,
            ),
            [self.ddp],
        )

    def step(self, micro_batches, lr):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_latentmoe.training.forward_step import forward_step, set_batch_recorder

        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.num_micro_batches = len(micro_batches)
        set_batch_recorder(self.rescore)  # the trainees share the forward step's recorder slot
        self.train_step(
            forward_step,
            iter(micro_batches),
            [self.ddp],
            self.optimizer,
            None,
            self.config,
            get_forward_backward_func(),
            iteration=self.iteration,
        )
        self.iteration += 1

    def _train_step(
        self,
        forward_step_func,
        data_iterator,
        model,
        optimizer,
        opt_param_scheduler,
        config,
        forward_backward_func,
        iteration=None,
    ):
        """What ``megatron.training``'s ``train_step`` does here (no LR scheduler, no rerun)."""
        self.ddp.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward_func(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=self.num_micro_batches,
            seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size,
            forward_only=False,
        )
        optimizer.step()


def _time_balancer_work(trainees) -> list[float]:
    """Accumulate, in the returned one-element list, the seconds spent in every trainee's routers'
    forward (instance-level wrappers: no class is patched) and in the step-end
    ``update_balance``."""
    import functools

    from megatron_latentmoe.moe.balance_step import balance_routers
    from megatron_latentmoe.training import balance_logging

    spent = [0.0]

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        return wrapper

    for trainee in trainees.values():
        for router in balance_routers([trainee.ddp.module]):
            router.forward = timed(router.forward)
    balance_logging.update_balance = timed(balance_logging.update_balance)
    return spent


def paired(none_times, times) -> list[float]:
    """Per-round ratios: ``none``'s step over the method's, seconds apart in the same round."""
    return [n / x for n, x in zip(none_times, times, strict=True)]


def bootstrap_ci95(ratios, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the median of ``ratios`` (rounds resampled with
    replacement; a fixed seed, so a run's JSON reproduces its interval)."""
    import random

    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def round_order(methods, step) -> list:
    """The order the methods step in round ``step``: rotated by one each round, so that none of
    them always steps first (or right after the same one)."""
    return methods[step % len(methods) :] + methods[: step % len(methods)]


def summarize(times, router_times, global_tokens) -> dict:
    """Per method, from its timed step seconds (``times``, one per round) and seconds of balancer
    work (``router_times``): the figures the table and JSON give; ratios are ``none``'s time over
    the method's (above 1: faster than ``none``)."""
    rows = {}
    for m, t in times.items():
        rows[m] = dict(
            step_s_median=statistics.median(t),
            step_s_min=min(t),
            tokens_per_s=global_tokens / statistics.median(t),
            ratio_vs_none=statistics.median(times["none"]) / statistics.median(t),
            ratio_vs_none_paired=statistics.median(paired(times["none"], t)),
            ratio_vs_none_paired_ci95=bootstrap_ci95(paired(times["none"], t)),
            router_s_median=statistics.median(router_times[m]),
        )
    return rows


def micro_batches(tokens, args, step, rank, world):
    """This DP rank's micro-batches of global batch ``step`` (the same for every method)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(10_000 + step)
    seq = args.seq_length
    starts = rng.integers(0, len(tokens) - seq - 1, args.global_batch_size)
    mine = starts[rank * len(starts) // world : (rank + 1) * len(starts) // world]
    data = torch.from_numpy(np.stack([tokens[s : s + seq + 1] for s in mine]))
    out = []
    for i in range(0, len(mine), args.micro_batch_size):
        chunk = data[i : i + args.micro_batch_size]
        out.append(
            dict(
                tokens=chunk[:, :-1],
                labels=chunk[:, 1:],
                loss_mask=torch.ones(chunk.shape[0], seq),
                position_ids=torch.arange(seq).expand(chunk.shape[0], seq),
            )
        )
    return out


def run_rank(a):
    import logging

    import torch
    import torch.distributed as dist
    from bench_training_balance import METHODS, args_file_flags, corpus_tokens

    from megatron_latentmoe.compat import (
        apply_core_compat,
        apply_cpu_compat,
        apply_python311_compat,
    )
    from megatron_latentmoe.compat.training import init_cpu_world

    logging.getLogger("megatron").setLevel(logging.ERROR)  # set-up chatter, once per model
    apply_python311_compat()
    apply_core_compat()
    apply_cpu_compat()
    base = args_file_flags(a.args_file) + ["--eval-iters", "0"]
    per_method = {m: checked(base + METHODS[m]) for m in a.methods}
    first = per_method[a.methods[0]][0]
    from megatron.training.global_vars import set_global_variables

    with contextlib.redirect_stdout(io.StringIO()):
        set_global_variables(first)
    init_cpu_world(first)
    rank, world = dist.get_rank(), dist.get_world_size()
    for m in a.methods:
        per_method[m][0].padded_vocab_size = first.padded_vocab_size
    trainees = {m: Trainee(*per_method[m], first.seed) for m in a.methods}
    router_s = _time_balancer_work(trainees)
    tokens = corpus_tokens()
    warm_lr = max(1, round(first.lr_warmup_fraction * first.train_iters))
    times = {m: [] for m in a.methods}
    router_times = {m: [] for m in a.methods}
    global_tokens = first.global_batch_size * first.seq_length
    for step in range(a.warmup + a.steps):
        batches = micro_batches(tokens, first, step, rank, world)
        lr = first.lr * min(1.0, (step + 1) / warm_lr)
        order = round_order(a.methods, step)
        for m in order:
            dist.barrier()
            t0, r0 = time.perf_counter(), router_s[0]
            trainees[m].step(batches, lr)
            dist.barrier()
            if step >= a.warmup:
                times[m].append(time.perf_counter() - t0)
                router_times[m].append(router_s[0] - r0)
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"[bench_step] round {step + 1}/{a.warmup + a.steps}", flush=True)
    if rank != 0:
        return
    rows = summarize(times, router_times, global_tokens)
    print(
        f"\nwhole training steps, {os.path.relpath(a.args_file, REPO)}, "
        f"EP{first.expert_model_parallel_size} on {world} CPU processes, "
        f"{a.steps} rounds after {a.warmup}, {global_tokens} tokens/step"
    )
    width = max(len(m) for m in rows) + 2
    print(
        f"{'method':<{width}}{'ms/step':>9}{'tokens/s':>10}{'vs none':>9}{'paired':>8}"
        f"{'95% CI':>14}{'router ms':>11}{'of step':>9}"
    )
    for m, r in rows.items():
        print(
            f"{m:<{width}}{1e3 * r['step_s_median']:>9.0f}{r['tokens_per_s']:>10.0f}"
            f"{r['ratio_vs_none']:>9.3f}{r['ratio_vs_none_paired']:>8.3f}"
            f"{'{:.3f}-{:.3f}'.format(*r['ratio_vs_none_paired_ci95']):>14}"
            f"{1e3 * r['router_s_median']:>11.1f}"
            f"{r['router_s_median'] / r['step_s_median']:>9.1%}"
        )
    write_json(
        a.out,
        dict(
            args=vars(a),
            torch=torch.__version__,
            world_size=world,
            tokens_per_step=global_tokens,
            step_times_s=times,
            router_times_s=router_times,
            results=rows,
        ),
        indent=1,
    )
    print(f"wrote {a.out}")


def torchrun(script, nproc, argv) -> int:
    """Run ``script argv`` under torchrun on ``nproc`` CPU processes; its exit status."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        PYTHONWARNINGS="ignore",
        NO_VCS_VERSION="1",
        CUDA_DEVICE_MAX_CONNECTIONS="1",
        PYTHONPATH=REPO,
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), script, *argv]
    return subprocess.run(cmd, env=env).returncode


def main(argv=None):
    a = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        return torchrun(os.path.abspath(__file__), a.nproc, sys.argv[1:] if argv is None else argv)
    run_rank(a)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
