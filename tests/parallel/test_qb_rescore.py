"""QB rescoring (``training/qb_rescore.py``) in a real Megatron step: one process, EP2, and PP2
(Megatron's 1F1B schedule runs the rescoring pass through the pipeline).

A step wrapped by ``QBRescore`` must leave:

* the weights of a plain step (the rescoring pass adds no gradient, moves nothing but the bias);
* the routed loads of the training forward (routed with the old bias), not the rescored ones;
* the bias that a plain step-end update solves from a training forward of the SAME batch under
  the UPDATED weights, i.e. the rescored scores (and not the lagged bias a plain step solves),
  routed with the bias the step started from moved by the drift correction at the previous
  step's mean router input (armed before the optimizer step, applied after it);
* exactly one integer all-reduce for the balance update (under EP2: DP2 over the tokens): the
  integer all-reduces of a plain step, no more;
* under EP2 the same bias on every rank, to the bit (the plain update's equality with one
  process, layout by layout, is ``test_qb_step.py``'s and ``test_model_parallel.py``'s).

With ``solves=2`` (``--moe-qb-rescore-solves 2``) the bias is that of one more reference solve:
a second training forward of the same batch under the first solve's bias, then the step end;
with exactly one more integer all-reduce, of the histograms.
"""

from __future__ import annotations

import pytest

from .launcher import run_distributed
from .megatron_step import GLOBAL_BATCH, SEQ, batch, build, int32_all_reduces, loss_func

pytestmark = pytest.mark.slow


def _micro_batches():
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tokens, labels = batch()
    per_rank = GLOBAL_BATCH // dp
    return [
        (tokens[i : i + 1], labels[i : i + 1])
        for i in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    ]


def _mean_input(router):
    """A global mean router input, the same on every rank (what the step end all-reduces)."""
    import torch

    g = torch.Generator().manual_seed(7 + router.layer_number)
    return torch.randn(router.config.hidden_size, generator=g)


LAYOUTS = {
    "1 process": (1, {}, 1),
    "EP2": (2, dict(ep=2), 1),
    "PP2": (2, dict(pp=2), 1),
    "1 process, 2 solves": (1, {}, 2),
    "EP2, 2 solves": (2, dict(ep=2), 2),
}


def _run(rank, world_size, layout, solves):
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_latentmoe.moe.balance_step import balance_routers
    from megatron_latentmoe.training.balance_logging import (
        balance_step_end,
        make_finalize_model_grads_func,
    )
    from megatron_latentmoe.training.qb_rescore import QBRescore

    recorder = {}

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        if torch.is_grad_enabled() and "rescore" in recorder:
            recorder["rescore"].record(data_iterator, (tokens, labels))
        position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
        return model(tokens, position_ids, None, labels=labels), loss_func

    def forward_backward(ddps):
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=ddps,
            num_microbatches=len(micro_batches),
            seq_length=SEQ,
            micro_batch_size=1,
        )

    def megatron_train_step(
        forward_step_func,
        data_iterator,
        model,
        optimizer,
        opt_param_scheduler,
        config,
        forward_backward_func,
        iteration=None,
    ):  # megatron.training's train_step, reduced to what the rescoring relies on
        for ddp in model:
            ddp.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward_func(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=len(micro_batches),
            seq_length=SEQ,
            micro_batch_size=1,
        )
        assert optimizer.step()[0]

    def state(model):
        routers = balance_routers([model])
        return dict(
            params={n: p.detach().clone() for n, p in model.named_parameters()},
            bias=[r.expert_bias.clone() for r in routers],
            loads=[r.last_loads_E.clone() for r in routers],
        )

    # ---- A: one rescored step
    (model,), ddps, optimizer = build("alltoall", **layout)
    micro_batches = _micro_batches()
    rescore = QBRescore(
        1,
        lambda model, drift_correction: balance_step_end(model, None, drift_correction),
        solves=solves,
        seq_length=SEQ,
        micro_batch_size=1,
        num_microbatches=lambda: len(micro_batches),
    )
    recorder["rescore"] = rescore
    model.config.finalize_model_grads_func = make_finalize_model_grads_func(None, rescore)
    for router in balance_routers([model]):  # as if an earlier step had measured it
        router.qb_mean_input.copy_(_mean_input(router))
    with int32_all_reduces() as int_reduces:
        rescore.wrap_train_step(megatron_train_step)(
            forward_step,
            iter(micro_batches),
            ddps,
            optimizer,
            None,
            model.config,
            get_forward_backward_func(),
            iteration=0,
        )
    rescored = state(model)
    assert not rescore._batches and all(not r.qb_rescoring for r in balance_routers([model]))
    recorder.clear()

    # ---- B: a plain step (lagged solve), then the reference solve: bias back to the one the
    # step started from, a training forward/backward of the same batch under the updated
    # weights, the plain step-end update -- no optimizer step
    (model_b,), ddps_b, optimizer_b = build("alltoall", **layout)
    model_b.config.finalize_model_grads_func = make_finalize_model_grads_func(None)
    start_bias = [r.expert_bias.clone() for r in balance_routers([model_b])]
    # the drift correction's reference: the mean input's scores under the weights before the step
    drift_refs = [
        (h, r._scores_at(h)) for r in balance_routers([model_b]) for h in [_mean_input(r)]
    ]
    with int32_all_reduces() as plain_reduces:
        megatron_train_step(
            forward_step,
            iter(micro_batches),
            ddps_b,
            optimizer_b,
            None,
            model_b.config,
            get_forward_backward_func(),
        )
    lagged = state(model_b)
    for router, bias, ref in zip(balance_routers([model_b]), start_bias, drift_refs, strict=True):
        router.expert_bias.copy_(bias)
        router._drift_ref = ref  # applied by the next forward, under the updated weights
    for _ in range(solves):  # each: the same batch under the last solve's bias, the step end
        for ddp in ddps_b:
            ddp.zero_grad_buffer()
        forward_backward(ddps_b)
    reference = state(model_b)
    return dict(
        rescored=rescored,
        lagged=lagged,
        reference=reference,
        int_reduces=int_reduces,
        plain_reduces=plain_reduces,
    )


@pytest.fixture(scope="module")
def runs():
    return {
        name: run_distributed(_run, n, layout, solves)
        for name, (n, layout, solves) in LAYOUTS.items()
    }


@pytest.mark.parametrize("name", LAYOUTS)
def test_rescored_step_solves_from_the_updated_model(runs, name):
    import torch

    for out in runs[name]:
        rescored, lagged, reference = out["rescored"], out["lagged"], out["reference"]
        for param, p in rescored["params"].items():
            assert torch.equal(p, lagged["params"][param]), f"{param}: the rescoring moved weights"
        for got, want in zip(rescored["loads"], lagged["loads"], strict=True):  # 2 solves too
            assert torch.equal(got, want), "loads must be the training forward's"
        for got, want, lag in zip(rescored["bias"], reference["bias"], lagged["bias"], strict=True):
            assert torch.equal(got, want), (
                f"rescored bias off the reference by {(got - want).abs().max()}"
            )
            assert (got - lag).abs().max() > 1e-4, "the test needs a lag the rescoring removes"
        if name == "EP2":  # the integer all-reduces (sizes) of a plain step, the QB one included
            assert sorted(out["int_reduces"]) == sorted(out["plain_reduces"]), out
            assert sum(size > 1000 for size in out["int_reduces"]) == 1, out["int_reduces"]
        if name == "EP2, 2 solves":  # one more, of the QB histograms only
            extra = sorted(out["int_reduces"])
            for size in out["plain_reduces"]:
                extra.remove(size)
            assert len(extra) == 1 and extra[0] > 1000, out


@pytest.mark.parametrize("name", ["EP2", "EP2, 2 solves"])
def test_ep2_ranks_end_with_the_same_bias(runs, name):
    import torch

    first, second = runs[name]
    for a, b in zip(first["rescored"]["bias"], second["rescored"]["bias"], strict=True):
        assert torch.equal(a, b)


def test_a_second_solve_moves_the_bias(runs):
    for one, two in zip(runs["1 process"], runs["1 process, 2 solves"], strict=True):
        pairs = zip(one["rescored"]["bias"], two["rescored"]["bias"], strict=True)
        moved = max(float((a - b).abs().max()) for a, b in pairs)
        assert moved > 1e-6, "the test needs a second solve that differs from the first"
