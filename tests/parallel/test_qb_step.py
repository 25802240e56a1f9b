"""The step-end QB update across real ranks (SPEC §4, appendix D).

Several micro-batches of a global batch are routed by the QB routers of 2 MoE layers, each rank
seeing its own share of the tokens (the share of the ranks that hold different tokens: DP, EP,
CP, and TP under sequence parallelism). Then ``update_balance`` runs as it does at the
end of a Megatron step. Which tokens a rank sees follows from its DP / CP / TP coordinates, not
from the group under test, so a group that leaves out a dimension fails. Checked against ONE
process that observed the whole global batch:

* the all-reduced counts equal the single-process counts, as integers, for every layer, and so
  do the all-reduced routed loads per expert (what MaxVio is computed from);
* every rank ends with the same bias, bit for bit, equal to the single-process solve;
* exactly one all-reduce per step for all layers, of L·(n·B + header + 2d + n + 1) integers
  (histogram, summed router input in fixed point, loads, tokens), whatever the number of tokens;
* the same with QB as a drop-in router in Megatron's own ``MoELayer`` (no latent projections);
* a model built with its own process groups (``pg_collection``) reduces over its ``dp_cp``
  group, not over parallel_state's.
* the second step bins with the new bias (the range moves) and still agrees.
"""

import pytest
import torch

from .launcher import run_distributed

# BINS: the fewest uniform bins the config allows (fields.QB_MIN_BINS)
EXPERTS, TOPK, BINS, LAYERS, MICRO_BATCHES, STEPS = 8, 2, 512, 2, 3, 2

LAYOUTS = {
    2: {
        "DP2": dict(),
        "TP2+SP": dict(tp=2),
        "CP2": dict(cp=2),
        "EP2": dict(ep=2),
        "EP2-centered": dict(ep=2, binning="centered"),
        "EP2-megatron-moe": dict(ep=2, latent=False),
        "DP2-own-groups": dict(own_groups=True),
    },
    4: {
        "DP2xEP2": dict(ep=2),
        "TP2+SPxEP2": dict(tp=2, ep=2),
        "CP2xEP2": dict(cp=2, ep=2),
        "TP2+SPxCP2": dict(tp=2, cp=2),
    },
}


def _global_logits(step, layer, micro_batch, tokens):
    g = torch.Generator().manual_seed(1000 * step + 100 * layer + micro_batch)
    skew = torch.linspace(-1.5, 1.5, EXPERTS)  # unbalanced on purpose: bias has work to do
    return torch.randn(tokens, EXPERTS, generator=g) + skew


def _reference(tokens, binning="uniform"):
    """One process, the whole global batch: per step and layer the counts, the routed loads per
    expert and the bias after the step."""
    from megatron_latentmoe.balancing import CenteredQuantileHistogram, QuantileHistogram
    from megatron_latentmoe.balancing_reference import topk_loads

    histogram = CenteredQuantileHistogram if binning == "centered" else QuantileHistogram
    bias = [torch.zeros(EXPERTS) for _ in range(LAYERS)]
    counts, loads, biases = [], [], []
    for step in range(STEPS):
        step_counts, step_loads = [], []
        for layer in range(LAYERS):
            hist = histogram(EXPERTS, TOPK, BINS)
            layer_loads = torch.zeros(EXPERTS, dtype=torch.int64)
            for mb in range(MICRO_BATCHES):
                scores = torch.sigmoid(_global_logits(step, layer, mb, tokens))
                hist.observe(scores, bias[layer])
                layer_loads += topk_loads(scores, bias[layer], TOPK).to(torch.int64)
            step_counts.append(hist.counts.clone())
            step_loads.append(layer_loads)
            bias[layer] = hist.solve(bias[layer])
        counts.append(step_counts)
        loads.append(step_loads)
        biases.append([b.clone() for b in bias])
    return counts, loads, biases


def _token_share(sequence_parallel):
    """(this rank's index, number of shares) of the global batch, from the rank's coordinates
    alone (not from the group under test): tokens differ across DP and CP ranks, and across TP
    ranks when sequence parallelism splits the sequence."""
    from megatron.core import parallel_state as ps

    dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    cp, cp_size = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
    tp, tp_size = (
        (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
        if sequence_parallel
        else (0, 1)
    )
    return (dp * cp_size + cp) * tp_size + tp, dp_size * cp_size * tp_size


def _run_layout(rank, world_size, layout, tokens):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.moe.balance_step import update_balance
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    tp, ep, cp = layout.get("tp", 1), layout.get("ep", 1), layout.get("cp", 1)
    ps.destroy_model_parallel()
    initialize_parallel_cpu(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, context_parallel_size=cp
    )
    cfg = tiny_config(
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_qb_num_bins=BINS,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        context_parallel_size=cp,
        sequence_parallel=tp > 1,
        moe_qb_binning=layout.get("binning", "uniform"),
        **(
            {}
            if layout.get("latent", True)
            else dict(moe_latent_size=None, latent_moe_use_norm=False)
        ),
    )
    pg_collection = None
    if layout.get("own_groups"):  # the model's groups: the same ranks, not parallel_state's
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        pg_collection.dp_cp = dist.new_group(ranks=list(range(world_size)))
    layers = torch.nn.ModuleList(
        [
            get_stable_latentmoe_mlp_spec(cfg)(
                config=cfg, layer_number=i + 1, pg_collection=pg_collection
            )
            for i in range(LAYERS)
        ]
    )
    layers.train()
    expected_type = "StableLatentMoELayer" if layout.get("latent", True) else "MoELayer"
    assert type(layers[0]).__name__ == expected_type
    group = layers[0].router.token_group
    if pg_collection is not None:
        assert group is pg_collection.dp_cp, "QB does not reduce over the model's dp_cp group"
    index, share = _token_share(cfg.sequence_parallel)
    group_size = dist.get_world_size(group) if group is not None else 1
    assert group_size == share, f"QB reduces over {group_size} ranks; {share} hold different tokens"
    mine = slice(index * tokens // share, (index + 1) * tokens // share)

    reduced = []
    original_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        assert kwargs.get("group") is group, "the step end reduced over another group"
        result = original_all_reduce(tensor, *args, **kwargs)
        reduced.append(tensor.clone())
        return result

    per_step = []
    for step in range(STEPS):
        for layer_idx, layer in enumerate(layers):
            for mb in range(MICRO_BATCHES):
                logits = _global_logits(step, layer_idx, mb, tokens)[mine]
                layer.router.routing(logits.requires_grad_())
        reduced.clear()
        dist.all_reduce = recording_all_reduce
        try:
            update_balance([layers])
        finally:
            dist.all_reduce = original_all_reduce
        n_bins = EXPERTS * BINS
        per_layer = len(reduced[0]) // LAYERS if reduced else 0
        counts = (
            [
                reduced[0][i * per_layer : i * per_layer + n_bins].view(EXPERTS, BINS).clone()
                for i in range(LAYERS)
            ]
            if reduced
            else []
        )
        loads = (
            [
                reduced[0][(i + 1) * per_layer - EXPERTS - 1 : (i + 1) * per_layer - 1].to(
                    torch.int64
                )
                for i in range(LAYERS)
            ]
            if reduced
            else []
        )
        per_step.append(
            dict(
                all_reduces=len(reduced),
                numel=reduced[0].numel() if reduced else 0,
                counts=counts,
                loads=loads,
                last_loads=[layer.router.last_loads_E.clone() for layer in layers],
                bias=[layer.router.expert_bias.clone() for layer in layers],
            )
        )
    return per_step


def _run_layouts(rank, world_size, runs):
    """``_run_layout`` for each (layout, tokens) of ``runs`` in turn, in the same processes (one
    spawn per world size: each costs ~10 s of start-up on 2 CPU cores)."""
    return [_run_layout(rank, world_size, layout, tokens) for layout, tokens in runs]


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_all_reduced_counts_and_bias_equal_one_process(world_size):
    tokens = 48
    layouts = LAYOUTS[world_size]
    runs = run_distributed(_run_layouts, world_size, [(lay, tokens) for lay in layouts.values()])
    for i, (name, layout) in enumerate(layouts.items()):
        ref_counts, ref_loads, ref_bias = _reference(tokens, layout.get("binning", "uniform"))
        per_rank = [rank_runs[i] for rank_runs in runs]
        for step in range(STEPS):
            for rank, steps in enumerate(per_rank):
                got = steps[step]
                assert got["all_reduces"] == 1, f"{name}: {got['all_reduces']} all-reduces"
                for layer in range(LAYERS):
                    assert torch.equal(got["counts"][layer], ref_counts[step][layer]), (
                        f"{name} step {step} rank {rank} layer {layer}: counts differ"
                    )
                    for what in ("loads", "last_loads"):  # the all-reduced routed loads per expert
                        assert torch.equal(
                            got[what][layer].to(torch.int64), ref_loads[step][layer]
                        ), f"{name} step {step} rank {rank} layer {layer}: {what} differ"
                    assert torch.equal(got["bias"][layer], ref_bias[step][layer]), (
                        f"{name} step {step} rank {rank} layer {layer}: bias not bit-identical"
                    )


def test_all_reduce_size_is_independent_of_the_batch():
    from megatron_latentmoe.balancing import HEADER_FIELDS

    runs = run_distributed(_run_layouts, 2, [({"ep": 2}, 16), ({"ep": 2}, 96)])
    sizes = {s["numel"] for rank_runs in runs for steps in rank_runs for s in steps}
    hidden = 64  # tiny_config's hidden size: the summed router input rides along in fixed point,
    # two words per feature
    assert sizes == {LAYERS * (EXPERTS * BINS + len(HEADER_FIELDS) + 2 * hidden + EXPERTS + 1)}


def _run_mean_input(rank, world_size, valid_on_rank1):
    """Rank 0 routes 40 tokens around +1; rank 1 the first ``valid_on_rank1`` of its 40 (the rest
    padding: the tail of the data, or of a sequence-parallel half), around -1. Returns the global
    mean router input as read by this rank and the exact mean over both ranks' routed tokens."""
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.moe.balance_step import update_balance
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu()
    cfg = tiny_config()
    torch.manual_seed(0)
    layer = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1)
    layer.train()
    xs = [torch.randn(10, 4, 64, generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
    xs = [xs[0] + 1.0, xs[1] - 1.0]
    paddings = [torch.zeros(4, 10, dtype=torch.bool), torch.ones(4, 10, dtype=torch.bool)]
    paddings[1].view(-1)[:valid_on_rank1] = False  # [batch, seq], True = padding
    y, _ = layer(xs[rank].clone().requires_grad_(), padding_mask=paddings[rank])
    y.sum().backward()
    update_balance([layer])
    routed = torch.cat([x.transpose(0, 1)[~p] for x, p in zip(xs, paddings, strict=True)])
    return layer.router.qb_mean_input.clone(), routed.mean(dim=0)


@pytest.mark.parametrize("valid_on_rank1", [0, 8])
def test_mean_router_input_is_the_mean_over_every_routed_token(valid_on_rank1):
    """The drift correction's global mean router input (``router.qb_mean_input``) is the mean
    over the tokens routed this step, as one process's, whichever rank routed them: weighted by
    the ranks' token counts (40 and 8: the ranks' means averaged were 0.67 off on average, 1.03
    at most), and a rank whose micro-batches were all padding adds nothing (it used to count as a
    rank with mean 0: the mean came out halved)."""
    (mean0, true0), (mean1, _) = run_distributed(_run_mean_input, 2, valid_on_rank1)
    assert torch.equal(mean0, mean1)  # every rank reads the same
    torch.testing.assert_close(mean0, true0, rtol=0, atol=1e-5)  # fixed point: 2**-12 / tokens
