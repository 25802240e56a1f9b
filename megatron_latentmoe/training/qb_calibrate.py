"""QB calibration (``--moe-qb-calibrate-batches N``): a bias for iteration 1, solved before it.

Every balancer starts training with the bias at 0, so iteration 1 routes with the initial router's
own preferences: in the balance race (K3-shaped tiny model) its MaxVio is 2.23 / 4.20 / 2.49 on
seeds 1234 / 1 / 2, the worst iteration of many runs. ``benchmarks/bench_balance_floor.py`` showed
that one bias solved on other batches at the initial weights routes batch 1 at 0.70 / 0.95 / 0.88.

Calibration solves that bias inside the run, once, when training starts at iteration 0 (a fresh
run or ``--finetune``; a resumed run keeps its checkpoint's bias, and so does a run that resumes
a ``release`` checkpoint of a QB run without ``--finetune``: :func:`kept_bias_line`):

1. the pool: the LAST ``N`` global batches of the run's own sample order (Megatron's training
   sampler started at ``(train_iters - N) * global_batch_size``), so iteration 1's batch is never
   in it (``N < train_iters``) and the training data order is untouched;
2. layer after layer (in layer order, over every pipeline stage): one forward-only pass of the
   pool through Megatron's schedule (pipeline and token dispatchers as in evaluation), under
   ``no_grad``, the earlier layers routing with their calibrated bias; the layer's router keeps
   its local fp32 scores (``router.qb_calibration_scores``);
3. on those scores, ``QB_CALIBRATION_ITERS`` damped QB updates ``b += 0.5 (solve(b) - b)`` (the
   layer's own histogram binning, ONE integer all-reduce of histogram + loads per update over
   the ranks that hold different tokens), keeping the iterate with the lowest MaxVio on the pool.

Nothing else changes: the training RNG streams are restored after the passes (dropout), no load,
loss or histogram of training is touched, and iteration 1 starts from the same weights and batch.
Cost: (MoE layers) forward passes of N global batches, and memory for one layer's local pool
scores (N x local tokens x experts x 4 bytes).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

QB_CALIBRATION_ITERS = 40
"""Damped QB updates per layer; the best iterate is kept. It came at updates 10-39 on the race's
model (seed 1234, 4 pooled batches: 30 and 39) and in the parallel test (12-29)."""
QB_CALIBRATION_DAMPING = 0.5
"""As in ``benchmarks/bench_balance_floor.py``, whose solve the race's rows reproduce. Measured on
the race's model (seed 1234, N = 16): the undamped update (1.0) fits the pool faster (MaxVio 0.007
/ 0.006 against 0.013 / 0.009 in the two MoE layers) and routes iteration 1 alike (0.750 against
0.742); on a fixed pool the kept best iterate makes either safe."""


def kept_bias_line(args, saved, path: str | None, load_arg: str | None) -> str | None:
    """The log line of a run that keeps the QB bias it loads instead of calibrating, or None
    (it calibrates): one that ``--load``s a ``release`` checkpoint (``path``, its args ``saved``;
    ``load_arg``: :func:`.resume.loaded_arg`) without ``--finetune`` and saved by a run that
    balanced with QB. megatron-core 0.19.2 starts it at iteration 0 with that checkpoint's
    model, its ``router.expert_bias`` included, and continues its data
    (:func:`.resume.release_data_warning`): it goes on with the trained router, as a resumed
    run does. ``--finetune`` starts over (the data from sample 0): it calibrates."""
    from megatron_latentmoe.fields import QUANTILE_HISTOGRAM, balancer_list
    from megatron_latentmoe.training.resume import loads_release

    if load_arg != "load" or args.finetune or not loads_release(path) or saved is None:
        return None
    if QUANTILE_HISTOGRAM not in balancer_list(
        getattr(saved, "moe_router_load_balancing_type", None)
    ):
        return None
    return (
        f"[QB calibration] skipped (--moe-qb-calibrate-batches {args.moe_qb_calibrate_batches}): "
        f"the model loads its QB bias from the release checkpoint {path}; pass --finetune to "
        "calibrate anew"
    )


@dataclass(frozen=True)
class LayerCalibration:
    """One layer's calibration: MaxVio on the pool without and with the chosen bias."""

    layer_number: int
    tokens: int
    max_vio_before: float
    max_vio_after: float
    best_iter: int


@torch.no_grad()
def calibrate_bias(
    histogram,
    bias_E: torch.Tensor,
    pool: list[tuple[torch.Tensor, torch.Tensor | None]],
    group: dist.ProcessGroup | None = None,
    *,
    iters: int = QB_CALIBRATION_ITERS,
    damping: float = QB_CALIBRATION_DAMPING,
) -> tuple[torch.Tensor, list[float]]:
    """Damped QB updates of ``bias_E`` on a fixed pool of scores; returns (the iterate with the
    lowest global MaxVio, MaxVio of every iterate, the start first).

    ``histogram``: an empty QB histogram (reset here after every update); ``pool``: this rank's
    ``(scores_ME fp32, valid_M or None)`` chunks; ``group``: the ranks that hold different tokens
    (each update all-reduces ONE int32 buffer over it: histogram, loads, token count)."""
    from megatron_latentmoe.balancing import cutoff_route
    from megatron_latentmoe.moe.balance_step import BalanceMetrics

    n, k = histogram.num_experts, histogram.topk
    bias = bias_E.detach().float().clone()
    best, history = None, []
    for it in range(iters + 1):
        histogram.reset()
        loads_E = torch.zeros(n, dtype=torch.int64, device=bias.device)
        for scores_ME, valid_M in pool:
            idx_MK, alpha_M = cutoff_route(scores_ME, bias, k)
            if valid_M is not None:
                idx_MK = idx_MK[valid_M]
            loads_E += torch.bincount(idx_MK.reshape(-1), minlength=n)
            histogram.observe(scores_ME, bias, valid_M=valid_M, alpha_M=alpha_M)
        buffer = torch.cat([histogram.pack(), loads_E.to(torch.int32)])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
        histogram.unpack_(buffer[:-n])
        loads_E = buffer[-n:].to(torch.int64)
        vio = BalanceMetrics.from_loads(loads_E, int(loads_E.sum()) // k).max_vio
        history.append(vio)
        if best is None or vio < best[1]:
            best = (bias, vio)
        if it < iters:
            bias = bias + damping * (histogram.solve(bias) - bias)
    histogram.reset()
    return best[0], history


class QBCalibration:
    """Holds the training datasets (``wrap_datasets_provider``) and calibrates the QB routers'
    bias before the first step of a run that starts at iteration 0 (``wrap_train_step``)."""

    def __init__(
        self,
        num_batches: int,
        *,
        train_iters: int,
        global_batch_size: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        log: Callable[[str], None] = print,
        num_microbatches: Callable[[], int] | None = None,
        kept_bias: str | None = None,
    ) -> None:
        """``kept_bias``: :func:`kept_bias_line`'s line, logged (rank 0) in place of the
        calibration."""
        self.num_batches = num_batches
        self.kept_bias = kept_bias
        self.first_sample = (train_iters - num_batches) * global_batch_size
        self.schedule = dict(
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length,
        )
        self.log = log
        if num_microbatches is None:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            num_microbatches = get_num_microbatches
        self.num_microbatches = num_microbatches
        self.train_datasets: list = []
        self._done = False

    def wrap_datasets_provider(self, provider: Callable) -> Callable:
        """Megatron's datasets provider, keeping the training dataset it builds (its attributes,
        the ``is_distributed`` that Megatron reads, copied by ``functools.wraps``)."""

        @functools.wraps(provider)
        def provider_keeping_train(*args, **kwargs):
            train_ds, valid_ds, test_ds = provider(*args, **kwargs)
            self.train_datasets.append(train_ds)
            return train_ds, valid_ds, test_ds

        return provider_keeping_train

    def wrap_train_step(self, train_step: Callable) -> Callable:
        """``megatron.training.training.train_step`` that calibrates first, once, if the run
        starts at iteration 0."""
        from megatron_latentmoe.training.forward_step import train_step_signature

        signature = train_step_signature(train_step, "QBCalibration.wrap_train_step")

        @functools.wraps(train_step)
        def train_step_after_qb_calibration(*args, **kwargs):
            if not self._done:
                self._done = True
                call = signature.bind(*args, **kwargs).arguments
                first = call.get("iteration") == 0
                if first and self.kept_bias is None:
                    self.calibrate(call)
                elif first and (not dist.is_initialized() or dist.get_rank() == 0):
                    self.log(self.kept_bias)
            return train_step(*args, **kwargs)

        return train_step_after_qb_calibration

    # ------------------------------------------------------------------------------ the pool
    def pool_micro_batches(self, num_microbatches: int) -> list:
        """This rank's micro-batches of the pool, in order: Megatron's training sampler over the
        kept training dataset, from sample ``(train_iters - N) * global_batch_size`` (a training
        loop of your own may override this with its own pool)."""
        from megatron.training.datasets.data_samplers import build_pretraining_data_loader

        dataset = next((d for d in self.train_datasets if d is not None), None)
        if dataset is None:
            return []
        loader = build_pretraining_data_loader(dataset, self.first_sample)
        batches, it = [], iter(loader)
        for _ in range(self.num_batches * num_microbatches):
            batches.append(next(it))
        return batches

    @staticmethod
    def _iterators(data_iterator, batches):
        """One iterator over the pool per model chunk, shaped like the training's."""
        if isinstance(data_iterator, list):
            return [QBCalibration._iterators(d, batches) for d in data_iterator]
        return None if data_iterator is None else iter(batches)

    # ------------------------------------------------------------------------------ calibrate
    def calibrate(self, call: dict) -> list[LayerCalibration]:
        """Calibrate every QB router of the model (``call``: ``train_step``'s arguments by name)."""
        from megatron.core import parallel_state, tensor_parallel

        from megatron_latentmoe.moe.balance_step import balance_routers
        from megatron_latentmoe.moe.router import QuantileBalancingRouter
        from megatron_latentmoe.training.forward_step import forward_only_pass

        t0 = time.time()
        routers = [
            r for r in balance_routers(call["model"]) if isinstance(r, QuantileBalancingRouter)
        ]
        numbers = [r.layer_number for r in routers]
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        if dist.is_initialized() and dist.get_world_size(pp_group) > 1:
            gathered = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(gathered, numbers, group=pp_group)
            numbers = [x for part in gathered for x in part]
        num_microbatches = self.num_microbatches()
        batches = self.pool_micro_batches(num_microbatches)
        group = routers[0].token_group if routers else None
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker_states = tracker.get_states()
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        results = []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                for number in sorted(set(numbers)):
                    own = [r for r in routers if r.layer_number == number]
                    for router in own:
                        router.qb_calibration_scores = []
                    for b in range(self.num_batches):
                        chunk = batches[b * num_microbatches : (b + 1) * num_microbatches]
                        forward_only_pass(
                            call,
                            self._iterators(call["data_iterator"], chunk),
                            num_microbatches,
                            self.schedule,
                        )
                    for router in own:
                        pool, router.qb_calibration_scores = router.qb_calibration_scores, None
                        results.append(self._solve(router, pool, group))
        finally:
            tracker.set_states(tracker_states)
            for router in routers:
                router.qb_calibration_scores = None
        self._report(results, time.time() - t0, group)
        return results

    @staticmethod
    def _solve(router, pool, group) -> LayerCalibration:
        hist = router.qb_histogram
        scratch = type(hist)(
            hist.num_experts, hist.topk, num_bins=hist.num_bins, device=router.expert_bias.device
        )
        bias, history = calibrate_bias(scratch, router.expert_bias, pool, group)
        router.expert_bias.copy_(bias)
        tokens = sum(int(v.sum()) if v is not None else s.shape[0] for s, v in pool)
        return LayerCalibration(
            router.layer_number, tokens, history[0], min(history), history.index(min(history))
        )

    def _report(self, results, seconds: float, group) -> None:
        from megatron.core import parallel_state

        if dist.is_initialized() and (
            dist.get_rank(group) != 0 or parallel_state.get_tensor_model_parallel_rank() != 0
        ):
            return
        for r in results:
            self.log(
                f"[QB calibration] layer {r.layer_number}: MaxVio on the pool "
                f"{r.max_vio_before:.3f} (bias before) -> {r.max_vio_after:.3f} (update "
                f"{r.best_iter} of {QB_CALIBRATION_ITERS}), {r.tokens} local tokens"
            )
        if results:
            self.log(
                f"[QB calibration] {len(results)} layers on {self.num_batches} global batches "
                f"(samples from {self.first_sample}: the run's last iterations) in {seconds:.1f} s"
            )
