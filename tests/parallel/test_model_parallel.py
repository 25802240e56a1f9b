"""A GPT model with Stable LatentMoE blocks under every parallel layout == one process (SPEC §1).

The model (2 layers: a dense SiTU-GLU layer, then a Stable LatentMoE layer with shared experts,
latent norm and the QB router) is built once in a 1-process world; its full state dict is sliced
into each layout (``shard_state_dict_for_rank``), for both the ``allgather`` and ``alltoall``
dispatchers. Each layout runs one Megatron training step (DDP, forward-backward schedule, 1F1B
for PP, ``finalize_model_grads`` + the QB step-end update, Adam with clipping) on the same global
batch and must reproduce the single process's loss, every parameter gradient (this rank's shard),
the optimizer's gradient norm, and the loss after the step to ``RTOL`` (fp32 round-off; fp64
router), and the QB bias after the step to one histogram bin (the bias is recomputed from r values
that carry fp32 round-off of the layout; typically it is identical).

Layouts: TP2+SP, EP2, PP2, EP2 with full activation recompute (world 2); EP4, TP2+SP x EP2 with
ETP1 and ETP2, PP2 x EP2 (world 4). With recompute the QB router must still count every token
once: the bias after the step proves it. Virtual pipeline stages (interleaved 1F1B): PP2 x VPP2
(world 2) and PP2 x VPP2 x EP2 (world 4), and uneven stages (1 dense layer | 3 MoE layers: a
first stage without router) PP2 and PP2 x EP2, on a 4-layer model against its own single
process.
MXFP4 QAT of the routed experts (m_e = 64): TP2+SP (ETP2: w2's MXFP4 blocks inside each shard),
EP2 with recompute, PP2 (world 2) and TP2 x EP2 with ETP2 (world 4), against a QAT single process.
QB's absorption loss from a non-zero bias: TP2+SP and EP2 (world 2), and TP2+SP with padding
in the micro-batches (its mean score over the non-padding tokens of the TP group, which the two
sequence halves hold in different numbers), against a single process with the same padding.
"""

from __future__ import annotations

import itertools

import pytest

from .launcher import run_distributed, shard_state_dict_for_rank
from .megatron_step import (
    BINS,
    DISPATCHERS,
    RECOMPUTE,
    build,
    check_layouts,
    grad_error,
    step_errors,
    train_step,
)

pytestmark = pytest.mark.slow

LAYOUTS_2 = {
    "TP2+SP": dict(tp=2, pp=1, ep=1, etp=2),
    "EP2": dict(tp=1, pp=1, ep=2, etp=1),
    "PP2": dict(tp=1, pp=2, ep=1, etp=1),
    "EP2 recompute": dict(tp=1, pp=1, ep=2, etp=1, **RECOMPUTE),
}
LAYOUTS_4 = {
    "EP4": dict(tp=1, pp=1, ep=4, etp=1),
    "TP2xEP2-ETP1": dict(tp=2, pp=1, ep=2, etp=1),
    "TP2xEP2-ETP2": dict(tp=2, pp=1, ep=2, etp=2),
    "PP2xEP2": dict(tp=1, pp=2, ep=2, etp=1),
}
# 4 layers (dense, then 3 MoE): each of the 2 pipeline ranks holds 2 chunks of one layer, run by
# Megatron's interleaved 1F1B schedule; the QB update covers the routers of both chunks at once.
# With PP2 the previous and next stage are the same rank: like megatron.training (which refuses
# VPP with PP2 otherwise), overlap the p2p communication instead of batching it, so the two
# directions travel on different groups.
P2P_OVERLAP = dict(overlap_p2p_comm=True, batch_p2p_comm=False)
QAT = dict(moe_expert_weight_qat="mxfp4", moe_ffn_hidden_size=64)
LAYOUTS_QAT = {
    2: {
        "TP2+SP QAT": dict(tp=2, pp=1, ep=1, etp=2, **QAT),
        "EP2 recompute QAT": dict(tp=1, pp=1, ep=2, etp=1, **RECOMPUTE, **QAT),
        "PP2 QAT": dict(tp=1, pp=2, ep=1, etp=1, **QAT),
    },
    4: {"TP2xEP2-ETP2 QAT": dict(tp=2, pp=1, ep=2, etp=2, **QAT)},
}
# QB's absorption loss (moe_qb_absorb_coeff) from a non-zero starting bias (a zero bias gives it
# no gradient): its mean score is over the (non-padding) tokens of the whole TP x CP group, like
# Megatron's aux losses, so TP2+SP must give one process's router gradient. ``padded``: a layout
# option, the micro-batches carry ``megatron_step.padding()``.
ABSORB = dict(moe_qb_absorb_coeff=0.5)
LAYOUTS_ABSORB = {
    "TP2+SP absorb": dict(tp=2, pp=1, ep=1, etp=2, **ABSORB),
    "EP2 absorb": dict(tp=1, pp=1, ep=2, etp=1, **ABSORB),
    "TP2+SP absorb padded": dict(tp=2, pp=1, ep=1, etp=2, padded=True, **ABSORB),
}
# Uneven stages (--decoder-first-pipeline-num-layers 1): the first stage holds only the dense
# layer, no router; the second the 3 MoE layers.
LAYOUTS_VPP = {
    2: {
        "PP2-VPP2": dict(pp=2, vpp=2, layers=4, **P2P_OVERLAP),
        "PP2-first1": dict(pp=2, layers=4, num_layers_in_first_pipeline_stage=1),
    },
    4: {
        "PP2-VPP2xEP2": dict(pp=2, vpp=2, ep=2, layers=4, **P2P_OVERLAP),
        "PP2-first1xEP2": dict(pp=2, ep=2, layers=4, num_layers_in_first_pipeline_stage=1),
    },
}


def _biases(model):
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith("router.expert_bias")}


def _reference(rank, world_size, layers, extra, paddings):
    """The single process's step per ``(dispatcher, padded)``, ``padded`` in ``paddings``."""
    import torch

    out = {}
    for dispatcher, padded in itertools.product(DISPATCHERS, paddings):
        (model,), ddps, optimizer = build(dispatcher, layers=layers, **extra)
        if extra.get("moe_qb_absorb_coeff"):
            g = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for name, b in model.named_buffers():
                    if name.endswith("router.expert_bias"):
                        b.copy_(0.2 * torch.randn(b.shape, generator=g))
        full = {
            k: v.detach().clone() if torch.is_tensor(v) else v
            for k, v in model.state_dict().items()
        }
        loss, (grads,), grad_norm, loss_after = train_step([model], ddps, optimizer, padded)
        out[dispatcher, padded] = dict(
            state=full,
            loss=loss,
            grads=grads,
            grad_norm=grad_norm,
            loss_after=loss_after,
            bias=_biases(model),
        )
    return out


def _layouts(rank, world_size, layouts, reference):
    import torch
    from megatron.core import parallel_state as ps

    results = {}
    for name, layout in layouts.items():
        layout = dict(layout)
        padded = layout.pop("padded", False)
        for dispatcher in DISPATCHERS:
            ref = reference[dispatcher, padded]
            models, ddps, optimizer = build(dispatcher, **layout)
            for model in models:
                model.load_state_dict(shard_state_dict_for_rank(ref["state"], model), strict=True)
            loss, grads, grad_norm, loss_after = train_step(models, ddps, optimizer, padded)
            err = {**step_errors(ref, loss, grad_norm, loss_after), "grads": 0.0, "bias_bins": 0.0}
            bin_width = 2.0 / BINS  # the histogram range is 2 + spread wide
            for model, chunk_grads in zip(models, grads, strict=True):
                expected = shard_state_dict_for_rank(ref["grads"], model)
                err["grads"] = max(err["grads"], grad_error(chunk_grads, expected))
                # QB bias after the step, in units of bins
                want_bias = shard_state_dict_for_rank({**ref["state"], **ref["bias"]}, model)
                for k, v in _biases(model).items():
                    err["bias_bins"] = max(
                        err["bias_bins"], (v - want_bias[k]).abs().max().item() / bin_width
                    )
            results[(name, dispatcher)] = err
    ps.destroy_model_parallel()
    torch.distributed.barrier()
    return results


def _single_process(layers, paddings=(False,), **extra):
    (ref,) = run_distributed(_reference, 1, layers, extra, paddings)
    for r in ref.values():
        assert r["loss_after"] < r["loss"]
        assert any(b.abs().max() > 0 for b in r["bias"].values()), "QB should move the bias"
    return ref


@pytest.fixture(scope="module")
def reference():
    return _single_process(layers=2)


@pytest.fixture(scope="module")
def reference_qat():
    return _single_process(layers=2, **QAT)


@pytest.fixture(scope="module")
def reference_absorb():
    return _single_process(layers=2, paddings=(False, True), **ABSORB)


@pytest.fixture(scope="module")
def reference_4_layers():
    return _single_process(layers=4)


def _check_with_bias(per_rank):
    bias = [max(e.pop("bias_bins") for e in rank_result.values()) for rank_result in per_rank]
    print("max |bias - single process| in bins:", max(bias))
    # measured <= 5e-5 in every layout (float sums in another order); the drift correction's
    # mean router input averaged over the ranks' means, not their tokens, put "TP2+SP absorb
    # padded" at 0.80 (this bound was 1.0 then)
    assert max(bias) <= 0.01
    check_layouts(per_rank)


def test_world2_matches_single_process(reference):
    _check_with_bias(run_distributed(_layouts, 2, LAYOUTS_2, reference))


def test_world4_matches_single_process(reference):
    _check_with_bias(run_distributed(_layouts, 4, LAYOUTS_4, reference))


@pytest.mark.parametrize("world_size", sorted(LAYOUTS_VPP))
def test_virtual_pipeline_matches_single_process(world_size, reference_4_layers):
    _check_with_bias(
        run_distributed(_layouts, world_size, LAYOUTS_VPP[world_size], reference_4_layers)
    )


@pytest.mark.parametrize("world_size", sorted(LAYOUTS_QAT))
def test_mxfp4_qat_matches_single_process(world_size, reference_qat):
    _check_with_bias(run_distributed(_layouts, world_size, LAYOUTS_QAT[world_size], reference_qat))


def test_absorb_loss_matches_single_process(reference_absorb):
    _check_with_bias(run_distributed(_layouts, 2, LAYOUTS_ABSORB, reference_absorb))
