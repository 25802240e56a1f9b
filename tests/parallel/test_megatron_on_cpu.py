"""Megatron-Core's own GPT-MoE (local spec) on CPU + gloo matches a single process exactly.

A tiny GPTModel (2 layers, hidden 64, 8 experts, top-2, SwiGLU experts, seq 32, vocab 128, fp32,
fp64 router, aux-loss balancing) is built once in a 1-process world; its full state dict is then
sharded (``shard_state_dict_for_rank``) into every parallel layout below, for both the
``allgather`` and ``alltoall`` dispatchers. Each layout runs one training step the way
``megatron.training`` does -- mcore DDP, the forward-backward schedule (1F1B for PP),
``finalize_model_grads``, the Megatron Adam optimizer with grad clipping -- on the same global
batch (4 sequences, micro-batch 1), and must reproduce the single-process

* loss before the step,
* every parameter's gradient (this rank's shard, compared with the sliced full gradient),
* gradient norm computed by the optimizer (across TP/PP/EP groups),
* loss after the Adam step

to fp32 round-off (``RTOL``). All layouts of one world size run inside one spawned world.

Not covered: the ``flex`` dispatcher (needs DeepEP: GPU only), context parallelism (Megatron's
local attention refuses it: TE only). Virtual pipeline stages are covered with our blocks in
``test_model_parallel.py``.
"""

from __future__ import annotations

import math

import pytest

from .launcher import run_distributed, shard_state_dict_for_rank
from .megatron_step import (
    DISPATCHERS,
    RECOMPUTE,
    SEQ,
    VOCAB,
    check_layouts,
    grad_error,
    step_errors,
    train_step,
)

pytestmark = pytest.mark.slow


# Keyword arguments of _build: tp/pp/ep/etp sizes (etp defaults to tp), distopt (Megatron's
# distributed optimizer), overlap (overlapped grad reduce / param gather), anything else goes to
# the TransformerConfig.
LAYOUTS_2 = {
    "EP2": dict(ep=2),
    "TP2+SP": dict(tp=2),
    "PP2": dict(pp=2),
    "TP2+SP recompute": dict(tp=2, **RECOMPUTE),
    "EP2 distopt overlap": dict(ep=2, distopt=True, overlap=True),
}
LAYOUTS_4 = {
    "TP2xEP2 ETP1": dict(tp=2, ep=2, etp=1),
    "TP2xEP2 ETP2": dict(tp=2, ep=2, etp=2),
    "EP4": dict(ep=4),
    "PP2xEP2": dict(pp=2, ep=2),
    "TP2xPP2": dict(tp=2, pp=2),
}


# ---------------------------------------------------------------------------- model + one step
def _config(dispatcher, tp=1, pp=1, ep=1, etp=None, **extra):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_token_dispatcher_type=dispatcher,
        moe_router_dtype="fp64",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp or tp,
        sequence_parallel=tp > 1,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        **extra,
    )


def _build(
    dispatcher, full_state=None, tp=1, pp=1, ep=1, etp=None, distopt=False, overlap=False, **extra
):
    """Parallel state + GPTModel (Megatron's local spec) + DDP + Megatron Adam, for this rank.

    ``full_state``: single-process weights to shard into this rank's model (else Megatron's
    seeded init). ``overlap``: overlapped grad reduce (+ param gather with ``distopt``), wired
    into the schedule as ``megatron.training`` does."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.timers import Timers

    from megatron_latentmoe.compat import initialize_parallel_cpu

    ps.destroy_model_parallel()
    initialize_parallel_cpu(tp, pp, ep, etp or tp, seed=1234)
    config = _config(dispatcher, tp, pp, ep, etp, **extra)
    config.timers = Timers(log_level=2, log_option="minmax")  # as megatron.training does
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    if full_state is not None:
        model.load_state_dict(shard_state_dict_for_rank(full_state, model), strict=True)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distopt,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap and distopt,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    if overlap:
        config.no_sync_func, config.grad_sync_func = ddp.no_sync, ddp.start_grad_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            clip_grad=1.0,
            use_distributed_optimizer=distopt,
            timers=config.timers,
        ),
        [ddp],
    )
    return model, ddp, optimizer


# ---------------------------------------------------------------------------- rank functions
def _reference(rank, world_size):
    """1 process: initial full weights + the step's results, per dispatcher."""
    import torch

    out = {}
    for dispatcher in DISPATCHERS:
        model, ddp, optimizer = _build(dispatcher)
        full = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
        loss, (grads,), grad_norm, loss_after = train_step([model], [ddp], optimizer)
        out[dispatcher] = dict(
            state=full, loss=loss, grads=grads, grad_norm=grad_norm, loss_after=loss_after
        )
    return out


def _layouts(rank, world_size, layouts, reference):
    """Every layout x dispatcher on this rank; returns {(layout, dispatcher): relative errors}."""
    results = {}
    for name, layout in layouts.items():
        for dispatcher in DISPATCHERS:
            ref = reference[dispatcher]
            model, ddp, optimizer = _build(dispatcher, ref["state"], **layout)
            loss, (grads,), grad_norm, loss_after = train_step([model], [ddp], optimizer)
            err = step_errors(ref, loss, grad_norm, loss_after)
            if not layout.get("distopt"):  # distopt keeps only this rank's reduced grad shard
                err["grads"] = grad_error(grads, shard_state_dict_for_rank(ref["grads"], model))
            results[(name, dispatcher)] = err
    return results


# ---------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def reference():
    (ref,) = run_distributed(_reference, 1)
    for r in ref.values():
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
        assert r["loss_after"] < r["loss"], "the Adam step should lower the loss"
    return ref


def test_world2_matches_single_process(reference):
    check_layouts(run_distributed(_layouts, 2, LAYOUTS_2, reference))


def test_world4_matches_single_process(reference):
    check_layouts(run_distributed(_layouts, 4, LAYOUTS_4, reference))
