"""Every Megatron balancer trains our models under EP2 (2 ranks, DP2 for the dense part) through
Megatron's schedule, DDP, ``finalize_model_grads`` and Adam, two steps each, with padding in every
sequence (except Megatron's ``quantile_balancing``, which takes no padding mask): the loss is
finite, the balance metrics count exactly the global non-padding tokens, and the bias each
balancer keeps (QB's, the sign update's, Megatron QB's ``qb_beta``) moved and is the same on
both ranks. Runs the latent block and, for QB, Megatron's own MoE layer (QB as a drop-in)."""

from __future__ import annotations

import pytest

from .launcher import run_distributed

SEQ, BATCH, PAD, VOCAB, STEPS = 16, 4, 3, 128, 2
BALANCERS = {
    "aux_loss": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2),
    "global_aux_loss": dict(
        moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-2
    ),
    "sign_update": dict(
        moe_router_load_balancing_type="none",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-2,
    ),
    "none": dict(moe_router_load_balancing_type="none"),
    "sinkhorn": dict(moe_router_load_balancing_type="sinkhorn"),
    "megatron_qb": dict(moe_router_load_balancing_type="quantile_balancing"),
    "qb_uniform": dict(moe_qb_binning="uniform"),
    "qb_centered": dict(moe_qb_binning="centered"),
    "qb_seq_aux_loss": dict(
        moe_router_load_balancing_type=["quantile_histogram", "seq_aux_loss"],
        moe_aux_loss_coeff=[0.0, 0.3],
    ),
    "qb_absorb_loss": dict(moe_qb_binning="centered", moe_qb_absorb_coeff=0.3),
    "qb_megatron_moe_layer": dict(moe_latent_size=None, latent_moe_use_norm=False),
}


def _run(rank, world_size):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.model import build_gpt_model
    from megatron_latentmoe.moe.balance_step import finalize_model_grads_with_quantile_balancing

    out = {}
    for name, overrides in BALANCERS.items():
        ps.destroy_model_parallel()
        initialize_parallel_cpu(expert_model_parallel_size=2, seed=7)
        cfg = tiny_config(
            num_layers=2, first_k_dense_replace=1, expert_model_parallel_size=2, **overrides
        )
        model = build_gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ)
        ddp = DistributedDataParallel(
            config=cfg, ddp_config=DistributedDataParallelConfig(), module=model
        )
        cfg.finalize_model_grads_func = finalize_model_grads_with_quantile_balancing
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [ddp])
        padded = name != "megatron_qb"

        def forward_step(data_iterator, model, *, padded=padded):
            tokens, labels = next(data_iterator)
            position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
            padding = torch.zeros_like(tokens, dtype=torch.bool)
            padding[:, -PAD:] = True
            output = model(
                tokens, position_ids, None, labels=labels, padding_mask=padding if padded else None
            )
            return output, lambda loss: (
                loss.float().mean(),
                {"lm loss": loss.float().mean().detach()},
            )

        g = torch.Generator().manual_seed(100 + rank)  # each DP rank its own tokens
        losses, metrics = [], []
        for _ in range(STEPS):
            data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
            micro = [(data[i : i + 1, :-1], data[i : i + 1, 1:]) for i in range(BATCH)]
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            reported = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=[ddp],
                num_microbatches=BATCH,
                seq_length=SEQ,
                micro_batch_size=1,
                forward_only=False,
            )
            optimizer.step()
            losses.append(float(torch.stack([r["lm loss"] for r in reported]).mean()))
            metrics.append(model.decoder.layers[1].mlp.router.last_balance)
        router = model.decoder.layers[1].mlp.router
        bias = getattr(router, "qb_beta", None) if name == "megatron_qb" else router.expert_bias
        out[name] = dict(
            losses=losses,
            metrics=metrics,
            layer=type(model.decoder.layers[1].mlp).__name__,
            bias=None if bias is None else bias.clone(),
            topk=cfg.moe_router_topk,
        )
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_distributed(_run, 2)


@pytest.mark.parametrize("name", list(BALANCERS))
def test_balancer_trains_under_ep2(per_rank, name):
    import math

    import torch

    first, second = per_rank[0][name], per_rank[1][name]
    assert all(math.isfinite(x) for x in first["losses"])
    assert first["layer"] == (
        "MoELayer" if name == "qb_megatron_moe_layer" else "StableLatentMoELayer"
    )
    pad = PAD if name != "megatron_qb" else 0
    tokens = 2 * BATCH * (SEQ - pad)  # global (both DP ranks), padding excluded
    for m, m2 in zip(first["metrics"], second["metrics"], strict=True):
        assert m == m2  # global metrics, the same on both ranks
        assert m.num_tokens == tokens
        assert m.max_load <= tokens and m.min_load >= 0
    if first["bias"] is not None:  # the balancers that keep a bias: moved, identical on both ranks
        assert torch.equal(first["bias"], second["bias"])
        assert first["bias"].abs().max() > 0
    assert (first["bias"] is not None) == (
        name not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none", "sinkhorn")
    )
