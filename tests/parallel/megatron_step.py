"""One Megatron training step on any parallel layout, and its comparison with a single process.

Shared by the parallel equivalence tests: ``build`` makes a rank's model chunks (the tiny GPT
with Stable LatentMoE layers), their DDP wrappers and Megatron Adam; a fixed global batch
(``GLOBAL_BATCH`` sequences of ``SEQ`` tokens, vocab ``VOCAB``) is split over data-parallel ranks
in micro-batches of 1 and run through Megatron's forward-backward schedule (1F1B with PP,
interleaved 1F1B with virtual stages), optionally with the fixed ``padding`` mask for the routers;
``train_step`` returns the loss, the reduced gradients (``main_grad``) of each model chunk, the
optimizer's grad norm and the loss after the step.
"""

from __future__ import annotations

import contextlib

RTOL = 1e-5  # relative, fp32; what is measured is printed by the tests (typically ~1e-7)
GLOBAL_BATCH, SEQ, VOCAB = 4, 32, 128
BINS = 1000
DISPATCHERS = ("allgather", "alltoall")
# Megatron activation recomputation of every layer: a layout option of the parallel tests.
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def batch():
    import torch

    g = torch.Generator().manual_seed(42)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def padding():
    """The global batch's padding mask [GLOBAL_BATCH, SEQ] (True = padding, the routers' only:
    the loss still averages over every token): positions 16-31, 0-16 and 12-31 of sequences 1-3,
    so the two sequence-parallel halves of a micro-batch hold different non-padding counts
    (16 + 16, 16 + 0, 0 + 15, 12 + 0), some none, and 44 + 31 over the step (the drift
    correction's mean router input is over every routed token, the ranks' token counts its
    weights: their means averaged put TP2+SP's bias 0.80 of a bin off one process's)."""
    import torch

    mask = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.bool)
    for i, (start, end) in enumerate(((0, 0), (16, 32), (0, 17), (12, 32))):
        mask[i, start:end] = True
    return mask


def forward_step(data_iterator, model):
    """Run one micro-batch ``(tokens, labels, padding_mask or None)``."""
    import torch

    tokens, labels, padding_mask = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels, padding_mask=padding_mask)
    return output, loss_func


def loss_func(per_token_loss):
    loss = per_token_loss.float().mean()
    return loss, {"lm loss": loss.clone().detach()}


def run_schedule(ddps, forward_only, padded=False):
    """Run this DP rank's micro-batches (size 1; with ``padding()`` when ``padded``) through this
    rank's model chunks ``ddps`` (one per virtual pipeline stage); return the global-batch loss on
    last stages, else None."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tokens, labels = batch()
    mask = padding() if padded else None
    per_rank = GLOBAL_BATCH // dp
    mine = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    micro_batches = [
        (tokens[i : i + 1], labels[i : i + 1], None if mask is None else mask[i : i + 1])
        for i in mine
    ]
    iterators = [iter(micro_batches) for _ in ddps]  # every chunk reads the same micro-batches
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(ddps) > 1 else iterators[0],
        model=list(ddps),
        num_microbatches=per_rank,
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=forward_only,
    )
    if not ps.is_pipeline_last_stage():
        return None
    loss = torch.stack([d["lm loss"] for d in losses]).mean()
    torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
    return loss.item() / dp


def train_step(models, ddps, optimizer, padded=False):
    """One step of this rank's model chunks (lists, one entry per virtual pipeline stage), with
    ``padding()`` when ``padded``.

    Returns the loss before, ``[{name: reduced grad} per chunk]``, the grad norm, the loss after.
    """
    for ddp in ddps:
        ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = run_schedule(ddps, forward_only=False, padded=padded)
    grads = [{n: p.main_grad.detach().clone() for n, p in m.named_parameters()} for m in models]
    ok, grad_norm, _ = optimizer.step()
    assert ok
    return loss, grads, grad_norm, run_schedule(ddps, forward_only=True, padded=padded)


def build(dispatcher, tp=1, pp=1, ep=1, etp=1, vpp=None, layers=2, seed=1234, **extra):
    """This rank's model chunks (one per virtual stage), their DDP wrappers and Megatron Adam."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.model import build_gpt_model
    from megatron_latentmoe.moe.balance_step import finalize_model_grads_with_quantile_balancing

    ps.destroy_model_parallel()
    initialize_parallel_cpu(tp, pp, ep, etp, seed=seed, virtual_pipeline_model_parallel_size=vpp)
    config = tiny_config(
        num_layers=layers,
        first_k_dense_replace=1,
        moe_token_dispatcher_type=dispatcher,
        moe_router_dtype="fp64",
        moe_qb_num_bins=BINS,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,
        pipeline_dtype=torch.float32,
        **extra,
    )
    stages = range(vpp) if vpp else [None]
    models = [
        build_gpt_model(
            config,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            vp_stage=stage,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
        )
        for stage in stages
    ]
    ddps = [
        DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(),
            module=model,
            disable_bucketing=i > 0,
        )
        for i, model in enumerate(models)
    ]
    config.finalize_model_grads_func = finalize_model_grads_with_quantile_balancing
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0), ddps
    )
    return models, ddps, optimizer


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def step_errors(ref, loss, grad_norm, loss_after) -> dict:
    """Relative errors of one ``train_step`` against the single process's ``ref`` (the losses
    exist on last pipeline stages only)."""
    err = {"grad_norm": rel(grad_norm, ref["grad_norm"])}
    if loss is not None:
        err["loss"] = rel(loss, ref["loss"])
        err["loss_after"] = rel(loss_after, ref["loss_after"])
    return err


def grad_error(grads, expected) -> float:
    """Worst per-parameter ``||grad - expected|| / ||expected||`` over ``grads``."""
    return max(
        (g - expected[n]).norm().item() / max(expected[n].norm().item(), 1e-30)
        for n, g in grads.items()
    )


def check_layouts(per_rank):
    worst = {}
    for rank_result in per_rank:
        for key, errors in rank_result.items():
            for what, value in errors.items():
                worst.setdefault(key, {})[what] = max(worst.get(key, {}).get(what, 0.0), value)
    for key, errors in sorted(worst.items()):
        print(f"{key[0]:>22s} {key[1]:>9s} " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    bad = {k: e for k, e in worst.items() if max(e.values()) > RTOL or "loss" not in e}
    assert not bad, f"layouts off the single-process run by more than {RTOL}: {bad}"


@contextlib.contextmanager
def int32_all_reduces():
    """Yields a list that records the size of every int32 ``all_reduce`` made inside the block
    (QB's balance traffic: histograms, loads, token counts)."""
    import torch
    import torch.distributed as dist

    sizes = []
    original = dist.all_reduce

    def counting(tensor, *a, **kw):
        if tensor.dtype == torch.int32:
            sizes.append(tensor.numel())
        return original(tensor, *a, **kw)

    dist.all_reduce = counting
    try:
        yield sizes
    finally:
        dist.all_reduce = original
