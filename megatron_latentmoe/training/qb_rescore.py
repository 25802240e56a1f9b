"""QB rescoring (``--moe-qb-rescore-iters N``): the next step's bias solved from this step's batch
as the UPDATED model scores it.

SPEC §4 solves the bias of step t+1 from the scores step t's forward observed, i.e. under the
model of step t. Early in training the optimizer step moves the router and every layer below it
far enough that step t+1's tokens are scored differently, and the bias lags: in the balance race
(K3-shaped tiny model, seed 1234) MaxVio peaks at 11.05 at iteration 16 and averages 4.35 over
iterations 1-50 (dead experts in 48 iterations). Replaying that run's recorded router inputs showed
the lag, not sampling, is the spike: a bias solved from the other half of the same step's batch
(no lag, other tokens) gives 1.78 / worst 3.11 over iterations 2-50.

Rescoring removes the lag within the method. For each of the first N steps the step end moves
behind the optimizer step:

1. the training forward records the micro-batches it consumes (``forward_step.py``; references
   to the loader's host tensors, no copy);
2. before ``optimizer.step()`` each QB router arms its drift correction (``moe/router.py``) at the
   previous step's global mean router input, so that the first forward after the update starts
   from the bias moved by the update's score shift;
3. after ``optimizer.step()``, one forward-only pass of those micro-batches through Megatron's own
   schedule (pipeline and token dispatchers as in evaluation), under ``no_grad``, the routers in
   training mode with ``qb_rescoring`` set: the QB histograms observe the updated model's scores
   under the drift-corrected bias. Loads, losses and aux losses stay those of the training forward;
4. the usual step end (``moe/balance_step.py``): ONE integer all-reduce (rescored histograms,
   training loads, mean router input), the global solve, the balance log.

``--moe-qb-rescore-solves S`` (default 1) repeats steps 3-4's solve S times per rescored step:
S - 1 extra solves (``balance_step.solve_quantile_bias``: one integer all-reduce of the
histograms each), each followed by another forward-only pass under the bias it solved; the step
end solves the last. QB's solve fixes every token's cutoff at the bias the batch was observed
under, so when the bias has to move far (the warm-up's collapse) one solve lands short of the
bias that balances even the observed batch; repeated solves on the same batch close the gap. This
breaks the one-all-reduce-per-step contract, inside the rescoring window only, and costs S
forward passes per rescored step: opt-in. Measured (benchmarks/BALANCE_RACE.md section 7, d 512).

The next batch is still routed with a bias computed from another batch (this one), by one global
solve per step. The cost is one forward of the batch per rescored step. Measured in the race
(seed 1234, 300 iterations; benchmarks/BALANCE_RACE.md), MaxVio iterations 1-50 / 51-300 /
worst after iteration 1 / dead-expert iterations / final loss: plain QB 4.35 / 1.20 / 11.05 / 48 /
4.725; rescoring without step 2 3.21 / 1.11 / 6.96 / 52 / 4.730 (QB's one-shot solve, started
from a bias that lags the update, moves too little); with step 2 1.40 / 0.91 / 2.36 / 4 / 4.714.

Resuming is bit-exact, inside the window too: a run that rescores checkpoints each QB router's
last global mean router input (``router.qb_mean_input``, the armed correction's reference). A
checkpoint written without rescoring lacks it and still loads; the first rescored step after that
load then runs without the armed correction, and :meth:`QBRescore.wrap_train_step` warns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def _known_mean_inputs(routers) -> list[bool]:
    """Whether each router's ``qb_mean_input`` is known (finite); one host sync for all."""
    if not routers:
        return []
    return torch.stack([torch.isfinite(r.qb_mean_input).all() for r in routers]).tolist()


class QBRescore:
    """Records each rescored step's micro-batches, re-runs them forward after the optimizer step
    (``solves`` times, an extra QB solve between two passes) and then calls
    ``step_end(model, drift_correction=False)``."""

    def __init__(
        self,
        iters: int,
        step_end: Callable[..., None],
        *,
        solves: int = 1,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        num_microbatches: Callable[[], int] | None = None,
    ) -> None:
        self.iters = iters
        self.step_end = step_end
        self.solves = solves
        self.schedule = dict(
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length,
        )
        if num_microbatches is None:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            num_microbatches = get_num_microbatches
        self.num_microbatches = num_microbatches
        self.deferring = False
        """True during a rescored step's training forward/backward: the finalize hook then
        leaves the step end to :meth:`wrap_train_step`."""
        self._batches: dict[int, list] = {}
        self._warned = False

    def record(self, data_iterator, batch) -> None:
        """The training forward step consumed ``batch`` from ``data_iterator``."""
        if self.deferring:
            self._batches.setdefault(id(data_iterator), []).append(batch)

    def before_optimizer_step(self, model) -> None:
        """Arm each QB router's drift correction at the last step's global mean router input,
        under the weights the optimizer is about to update: the rescoring pass, the first forward
        after the update, then observes under the bias moved by the weight update's score shift
        (one fixed-point step ahead, from numbers every rank has: no extra all-reduce)."""
        routers = self._qb_routers(model)
        for router, known in zip(routers, _known_mean_inputs(routers), strict=True):
            if known:  # NaN before the first step end, or after loading an older checkpoint
                router.set_drift_reference()

    def _warn_if_resumed(self, model, iteration: int) -> None:
        """A run resumed inside the rescoring window from a checkpoint written without rescoring
        (or before rescoring's state was checkpointed): it has no ``router.qb_mean_input``, so
        the first rescored step runs without the armed drift correction."""
        self._warned = True
        if not all(_known_mean_inputs(self._qb_routers(model))):
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_rank() == 0:
                print(
                    f"WARNING: resumed at iteration {iteration}, inside --moe-qb-rescore-iters "
                    f"{self.iters}, from a checkpoint without the QB routers' mean router input "
                    "(router.qb_mean_input: written without --moe-qb-rescore-iters, or by a "
                    "version of this package from before it was checkpointed): the first "
                    "rescored step runs without the armed drift correction",
                    flush=True,
                )

    @staticmethod
    def _qb_routers(model):
        from megatron_latentmoe.moe.balance_step import balance_routers
        from megatron_latentmoe.moe.router import QuantileBalancingRouter

        return [r for r in balance_routers(model) if isinstance(r, QuantileBalancingRouter)]

    def _replay(self, data_iterator):
        if isinstance(data_iterator, list):  # virtual pipeline: one iterator per model chunk
            return [self._replay(d) for d in data_iterator]
        if data_iterator is None:
            return None
        return iter(self._batches.get(id(data_iterator), []))

    def wrap_train_step(self, train_step: Callable) -> Callable:
        """``megatron.training.training.train_step`` with the rescoring pass and the step end
        after it, for iterations 1..``iters`` (Megatron's 0-based ``iteration`` < ``iters``)."""
        from megatron_latentmoe.training.forward_step import train_step_signature

        signature = train_step_signature(train_step, "QBRescore.wrap_train_step")

        @functools.wraps(train_step)
        def train_step_with_qb_rescore(*args, **kwargs):
            call = signature.bind(*args, **kwargs).arguments
            iteration = call.get("iteration")
            if iteration is None or iteration >= self.iters:
                return train_step(*args, **kwargs)
            if iteration > 0 and not self._warned:
                self._warn_if_resumed(call["model"], iteration)
            self.deferring, self._batches = True, {}
            try:
                out = train_step(*args, **kwargs)
            finally:
                self.deferring = False
            try:
                for solve in range(self.solves):
                    if solve:  # the last pass's histograms -> bias; observe again under it
                        self._solve(call["model"])
                    self._rescore(call)
            finally:
                self._batches = {}
            self.step_end(call["model"], drift_correction=False)
            return out

        return train_step_with_qb_rescore

    @staticmethod
    def _solve(model) -> None:
        from megatron_latentmoe.moe.balance_step import solve_quantile_bias

        solve_quantile_bias(model)

    def _rescore(self, call: dict) -> None:
        """The forward-only pass of the recorded micro-batches; ``call``: ``train_step``'s
        arguments by name."""
        from megatron_latentmoe.training.forward_step import forward_only_pass

        routers = self._qb_routers(call["model"])
        for router in routers:
            router.qb_histogram.reset()  # the training forward's scores: superseded
            router.qb_rescoring = True
        try:
            with torch.no_grad():
                forward_only_pass(
                    call,
                    self._replay(call["data_iterator"]),
                    self.num_microbatches(),
                    self.schedule,
                )
        finally:
            for router in routers:
                router.qb_rescoring = False
