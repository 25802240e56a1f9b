"""QB calibration (``training/qb_calibrate.py``) in Megatron's forward-only schedule: one process,
EP2 and PP2 (the pool's passes run through the pipeline; each stage solves its own layers).

Calibrating a pool of two global batches must leave:

* every MoE layer's bias equal to the damped solve (``calibrate_bias``) on the pool's scores
  with the layers BEFORE it routing under their calibrated bias: one more pass of the pool under
  the calibrated biases gives each layer the scores it was calibrated on, and re-solving them
  gives the same bias to the bit (a calibration that collected every layer in one pass, from
  bias 0, fails this from the second MoE layer on);
* the pool's MaxVio lower than without a bias, in every layer;
* the same bias on every layout (one process, EP2, PP2) and on every rank of a layout;
* one integer all-reduce per solver update under EP2 (DP2 over the tokens), nothing else;
* the RNG streams (torch's and Megatron's tracker) as they were: training continues as if no
  calibration had run; and no weight moved.
"""

from __future__ import annotations

import pytest

from .launcher import run_distributed, shard_state_dict_for_rank
from .megatron_step import GLOBAL_BATCH, SEQ, VOCAB, build, forward_step, int32_all_reduces

pytestmark = pytest.mark.slow

POOL_BATCHES = 2
LAYERS = 4  # layer 1 dense, MoE layers 2-4: two of them follow another MoE layer


def _pool():
    """This DP rank's micro-batches (size 1) of the pool's global batches, in order."""
    import torch
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = GLOBAL_BATCH // dp
    out = []
    for b in range(POOL_BATCHES):
        g = torch.Generator().manual_seed(100 + b)
        # a skewed token distribution, so that the initial router prefers some experts
        tokens = torch.randint(0, VOCAB // 8, (GLOBAL_BATCH, SEQ + 1), generator=g)
        for i in range(dp_rank * per_rank, (dp_rank + 1) * per_rank):
            out.append(
                (tokens[i : i + 1, :-1].contiguous(), tokens[i : i + 1, 1:].contiguous(), None)
            )
    return out, per_rank


def _run(rank, world_size, layout, state=None, **extra):
    """Calibrate on ``layout``; ``state``: the one-process model's state dict, sharded here (every
    layout then starts from the same weights)."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_latentmoe.moe.balance_step import balance_routers
    from megatron_latentmoe.training.qb_calibrate import QBCalibration, calibrate_bias

    models, ddps, _ = build("alltoall", layers=LAYERS, **layout, **extra)
    if state is None:
        state = {
            k: v.detach().clone() if torch.is_tensor(v) else v
            for k, v in models[0].state_dict().items()
        }
    else:
        for model in models:
            model.load_state_dict(shard_state_dict_for_rank(state, model), strict=True)
    routers = balance_routers(models)
    pool, per_rank = _pool()

    class Calibration(QBCalibration):
        def pool_micro_batches(self, num_microbatches):
            assert num_microbatches == per_rank
            return pool

    calibration = Calibration(
        POOL_BATCHES,
        train_iters=10,
        global_batch_size=GLOBAL_BATCH,
        seq_length=SEQ,
        micro_batch_size=1,
        num_microbatches=lambda: per_rank,
        log=lambda line: None,
    )
    call = dict(
        forward_step_func=forward_step,
        data_iterator=[iter([]) for _ in ddps] if len(ddps) > 1 else iter([]),
        model=ddps,
        config=models[0].config,
        forward_backward_func=get_forward_backward_func(),
        iteration=0,
    )
    params = {n: p.detach().clone() for m in models for n, p in m.named_parameters()}
    rng, tracker = torch.get_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states()
    with int32_all_reduces() as int_reduces:
        results = calibration.calibrate(call)
    rng_kept = torch.equal(torch.get_rng_state(), rng) and all(
        torch.equal(v, tracker[k])
        for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()
    )
    moved = [n for m in models for n, p in m.named_parameters() if not torch.equal(p, params[n])]

    # One more pass of the pool, every layer keeping its scores, all under the calibrated biases.
    for router in routers:
        router.qb_calibration_scores = []
    with torch.no_grad():
        for b in range(POOL_BATCHES):
            chunk = pool[b * per_rank : (b + 1) * per_rank]
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(chunk) for _ in ddps] if len(ddps) > 1 else iter(chunk),
                model=ddps,
                num_microbatches=per_rank,
                seq_length=SEQ,
                micro_batch_size=1,
                forward_only=True,
            )
    resolved = {}
    for router in routers:
        scores, router.qb_calibration_scores = router.qb_calibration_scores, None
        hist = type(router.qb_histogram)(8, 2, num_bins=router.qb_histogram.num_bins)
        zero = torch.zeros_like(router.expert_bias)
        resolved[router.layer_number] = calibrate_bias(hist, zero, scores, router.token_group)[0]
    return dict(
        bias={r.layer_number: r.expert_bias.clone() for r in routers},
        resolved=resolved,
        results={r.layer_number: r for r in results},
        int_reduces=int_reduces,
        rng_kept=rng_kept,
        moved=moved,
        state=state,
    )


LAYOUTS = {"1 process": (1, {}), "EP2": (2, dict(ep=2)), "PP2": (2, dict(pp=2))}


@pytest.fixture(scope="module")
def runs():
    out = {"1 process": run_distributed(_run, 1, {})}
    state = out["1 process"][0]["state"]
    for name, (n, layout) in LAYOUTS.items():
        if name not in out:
            out[name] = run_distributed(_run, n, layout, state)
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layer_is_solved_after_the_layers_before_it(runs, name):
    import torch

    for out in runs[name]:
        assert out["bias"], "this rank holds no MoE layer"
        for layer, bias in out["bias"].items():
            assert torch.equal(bias, out["resolved"][layer]), (
                f"layer {layer}: calibrated bias off the re-solve on its scores by "
                f"{(bias - out['resolved'][layer]).abs().max()}"
            )
            result = out["results"][layer]
            print(
                f"{name} layer {layer}: pool MaxVio {result.max_vio_before:.3f} -> "
                f"{result.max_vio_after:.3f} (update {result.best_iter})"
            )
            assert result.max_vio_after < 0.5 * result.max_vio_before, result
        assert not out["moved"], out["moved"]


def test_every_layout_calibrates_the_same_bias(runs):
    import torch

    def merged(name):
        out = {}
        for rank_out in runs[name]:
            for layer, bias in rank_out["bias"].items():
                if layer in out:  # replicated (EP2: both ranks): bit-identical
                    assert torch.equal(out[layer], bias), (name, layer)
                out[layer] = bias
        return out

    ref = merged("1 process")
    assert sorted(ref) == [2, 3, 4]
    for name in ("EP2", "PP2"):
        got = merged(name)
        assert sorted(got) == sorted(ref)
        for layer in ref:
            err = (got[layer] - ref[layer]).abs().max().item()
            print(f"{name} layer {layer}: |bias - 1 process| = {err:.2e}")
            assert err <= 1e-6, (name, layer, err)


def test_rng_streams_are_left_as_they_were():
    """With dropout the pool's passes draw random numbers; training must not see that."""
    (out,) = run_distributed(_run, 1, {}, hidden_dropout=0.2, attention_dropout=0.2)
    assert out["rng_kept"], "calibration left the RNG streams moved"


def test_one_integer_all_reduce_per_update(runs):
    from megatron_latentmoe.training.qb_calibrate import QB_CALIBRATION_ITERS

    for out in runs["EP2"]:
        # 3 MoE layers x (start + QB_CALIBRATION_ITERS updates), each n*B + header + n words
        assert len(out["int_reduces"]) == 3 * (QB_CALIBRATION_ITERS + 1), out["int_reduces"]
        assert len(set(out["int_reduces"])) == 1
