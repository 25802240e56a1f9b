"""Every Megatron balancer with our MoE layers (latent and Megatron's own): the balance metrics
of a step equal a recount from the routing map the router returned (padding excluded; with a
capacity factor the tokens the experts keep, without the fill up to capacity), and Megatron's
sign update counts the same loads (its [T, n] & [T] padding crash is fixed).
"""

import pytest
import torch

from tests.parallel.launcher import run_distributed

SEQ, BATCH, HIDDEN = 12, 4, 64
# (name, config overrides); Megatron's quantile_balancing cannot take a padding mask
BALANCERS = {
    "aux_loss": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2),
    "global_aux_loss": dict(
        moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-2
    ),
    "sign_update": dict(moe_router_load_balancing_type="none", moe_router_enable_expert_bias=True),
    "none": dict(moe_router_load_balancing_type="none"),
    "megatron_qb": dict(moe_router_load_balancing_type="quantile_balancing"),
    # token dropping: loads are the kept copies; padded to capacity, the fill is not a load
    "aux_loss_capacity": dict(
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_expert_capacity_factor=1.0,
    ),
    "aux_loss_capacity_padded": dict(
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
    ),
    "qb_uniform": dict(moe_qb_binning="uniform"),
    "qb_centered": dict(moe_qb_binning="centered"),
    # the MoE layer's activation recompute (--moe-layer-recompute): the first pass runs without
    # autograd and is not counted, the recompute in backward is, so every token counts once
    "qb_moe_recompute": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    "qb_z_loss": dict(moe_z_loss_coeff=1e-2),  # Megatron's router z-loss, with QB and without
    "none_z_loss": dict(moe_router_load_balancing_type="none", moe_z_loss_coeff=1e-2),
    "qb_seq_aux_loss": dict(  # QB with Megatron's seq aux loss beside it
        moe_router_load_balancing_type=["quantile_histogram", "seq_aux_loss"],
        moe_aux_loss_coeff=[0.0, 1e-2],
    ),
}


def _run(rank, world_size):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.moe.balance_step import BalanceMetrics, update_balance
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu()
    out = {}
    for latent in (True, False):
        for name, overrides in BALANCERS.items():
            extra = {} if latent else dict(moe_latent_size=None, latent_moe_use_norm=False)
            cfg = tiny_config(**overrides, **extra)
            torch.manual_seed(5)
            layer = get_stable_latentmoe_mlp_spec(cfg)(config=cfg)
            layer.set_layer_number(1)
            layer.train()
            if name == "qb_seq_aux_loss":  # a bias that changes QB's selection
                layer.router.expert_bias.copy_(torch.linspace(-0.5, 0.5, cfg.num_moe_experts))
            seen = []
            layer.router.register_forward_hook(  # the selections that carry a weight
                lambda m, i, o, *, seen=seen: seen.append((o[1] & (o[0] != 0)).detach().clone())
            )
            padding = None
            if name != "megatron_qb":
                padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
                padding[:, -3:] = True
            recount = torch.zeros(cfg.num_moe_experts, dtype=torch.int64)
            tokens = 0
            for _step in range(2):  # two micro-batches of one step
                x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
                y, _ = layer(x, padding_mask=padding)
                y.float().sum().backward()
                valid = (
                    torch.ones(SEQ * BATCH, dtype=torch.bool)
                    if padding is None
                    else ~padding.T.reshape(-1)
                )
                recount += seen[-1][valid].sum(dim=0)
                tokens += int(valid.sum())
            sign_loads = None
            if layer.router.enable_expert_bias:
                sign_loads = layer.router.local_tokens_per_expert.clone()
            update_balance([layer])
            tracker = get_moe_metrics_tracker()
            aux = {k: e.values.clone() for k, e in tracker.metrics.items() if e.values.any()}
            tracker.clear()
            out[(latent, name)] = dict(
                aux=aux,
                layer_type=type(layer).__name__,
                metrics=layer.router.last_balance,
                loads=layer.router.last_loads_E.clone(),
                expected=BalanceMetrics.from_loads(recount, tokens),
                recount=recount,
                sign_loads=sign_loads,
                tokens=tokens,
                router_passes=len(seen),
            )
    return out


@pytest.fixture(scope="module")
def result():
    (r,) = run_distributed(_run, 1)
    return r


@pytest.mark.parametrize("latent", [True, False], ids=["latent", "megatron_moe"])
@pytest.mark.parametrize("name", list(BALANCERS))
def test_metrics_equal_recount_from_routing_map(result, latent, name):
    r = result[(latent, name)]
    assert r["layer_type"] == ("StableLatentMoELayer" if latent else "MoELayer")
    assert torch.equal(r["loads"], r["recount"])
    assert r["metrics"] == r["expected"]
    assert r["metrics"].num_tokens == r["tokens"]
    assert r["router_passes"] == (4 if "recompute" in name else 2)  # 2 micro-batches
    if "capacity" in name:  # capacity 1.0: some copies dropped, none above the capacity
        assert r["tokens"] < int(r["loads"].sum()) < r["tokens"] * 2
    else:
        assert int(r["loads"].sum()) == r["tokens"] * 2  # top-2, nothing dropped


@pytest.mark.parametrize("latent", [True, False], ids=["latent", "megatron_moe"])
def test_sign_update_counts_padding_out(result, latent):
    r = result[(latent, "sign_update")]
    assert torch.equal(r["sign_loads"].to(torch.int64), r["recount"])


@pytest.mark.parametrize("latent", [True, False], ids=["latent", "megatron_moe"])
def test_aux_loss_beside_qb_equals_megatrons(result, latent):
    """Same weights and tokens: the seq aux loss the QB router adds is the one Megatron's own
    router computes (on the unbiased top-k; QB's non-zero bias must not enter it)."""
    with_qb, alone = result[(latent, "qb_seq_aux_loss")], result[(latent, "seq_aux_loss")]
    assert set(with_qb["aux"]) == set(alone["aux"]) == {"seq_load_balancing_loss"}
    assert torch.allclose(
        with_qb["aux"]["seq_load_balancing_loss"],
        alone["aux"]["seq_load_balancing_loss"],
        rtol=1e-6,
    )
    assert result[(latent, "qb_centered")]["aux"] == {}  # QB alone: no aux loss


@pytest.mark.parametrize("latent", [True, False], ids=["latent", "megatron_moe"])
def test_z_loss_with_qb_equals_megatrons(result, latent):
    """--moe-z-loss-coeff: the QB router adds Megatron's z-loss of the same logits."""
    with_qb, alone = result[(latent, "qb_z_loss")], result[(latent, "none_z_loss")]
    assert set(with_qb["aux"]) == set(alone["aux"]) == {"z_loss"}
    assert float(with_qb["aux"]["z_loss"].sum()) > 0
    assert torch.allclose(with_qb["aux"]["z_loss"], alone["aux"]["z_loss"], rtol=1e-6)


def _run_sign_update_bf16(rank, world_size):
    """Megatron's sign update in a bf16 model (``Float16Module`` casts buffers with the model)."""
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu()
    torch.manual_seed(0)
    cfg = tiny_config(
        **BALANCERS["sign_update"], bf16=True, params_dtype=torch.bfloat16, hidden_size=HIDDEN
    )
    layer = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1).bfloat16()
    layer.train()
    for _ in range(8):  # 8 x 512 tokens x top-2: per-expert counts far above 256
        y, _ = layer(torch.randn(64, 8, HIDDEN).bfloat16().requires_grad_())
        y.float().sum().backward()
    router = layer.router
    return {name: (buf.dtype, buf.clone()) for name, buf in router.named_buffers()}


def test_sign_update_counts_stay_exact_in_a_bf16_model():
    """The sign update's token counter stays fp32 through the model's bf16 cast, so it counts
    exactly what the routers' int64 loads count (in bf16 it stopped being exact above 256)."""
    (bufs,) = run_distributed(_run_sign_update_bf16, 1)
    for name in ("expert_bias", "local_tokens_per_expert"):
        assert bufs[name][0] == torch.float32, (name, bufs[name][0])
    assert torch.equal(bufs["local_tokens_per_expert"][1].to(torch.int64), bufs["step_loads_E"][1])


def _run_router_edges(rank, world_size):
    """Megatron's own QB given a padding mask; the sign update under no_grad; the fp32 buffers
    of the global aux loss and of Megatron's QB through a bf16 cast of the layer."""
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu()
    out = {}

    def layer_of(name):
        torch.manual_seed(5)
        cfg = tiny_config(**BALANCERS[name])
        layer = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1)
        return layer.train()

    x = torch.randn(SEQ, BATCH, HIDDEN)
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[:, -3:] = True
    try:
        layer_of("megatron_qb")(x.clone().requires_grad_(), padding_mask=padding)
        out["megatron_qb_padding"] = None
    except Exception as err:  # Megatron's own: a bare AssertionError
        out["megatron_qb_padding"] = (type(err).__name__, str(err))

    sign = layer_of("sign_update")
    with torch.no_grad():  # e.g. the first pass of an activation-recomputed forward
        sign(x)
    out["sign_loads_no_grad"] = sign.router.local_tokens_per_expert.clone()

    # a value bf16 cannot hold (8 mantissa bits): kept exactly, not rounded by the cast
    odd = 1.0 + 2.0**-12
    kept = {}
    for name, buffers in (
        ("global_aux_loss", ("global_tokens_per_expert", "ga_steps")),
        ("megatron_qb", ("qb_beta", "qb_beta_accum")),
    ):
        router = layer_of(name).router
        for buf in buffers:
            getattr(router, buf).fill_(odd)
        router.bfloat16()
        kept[name] = {buf: getattr(router, buf).clone() for buf in buffers}
    out["kept"], out["odd"] = kept, odd
    return out


@pytest.fixture(scope="module")
def edges():
    (r,) = run_distributed(_run_router_edges, 1)
    return r


def test_megatrons_qb_refuses_a_padding_mask_naming_the_alternative(edges):
    """Megatron-Core 0.19.2's QB asserts without a word; ours says why and what to use."""
    assert edges["megatron_qb_padding"] == (
        "ValueError",
        "--moe-router-load-balancing-type quantile_balancing: Megatron-Core 0.19.2's "
        "per-micro-batch QB cannot skip loss-masked tokens (this batch has some, e.g. "
        "from --eod-mask-loss or pad tokens); use quantile_histogram",
    )


def test_sign_update_does_not_count_a_forward_without_autograd(edges):
    assert torch.equal(edges["sign_loads_no_grad"], torch.zeros(8))


def test_global_aux_loss_and_megatron_qb_buffers_stay_fp32_through_a_bf16_cast(edges):
    """The global aux loss's token counts (bf16: inexact above 256) and Megatron's QB bias keep
    their fp32 values, not a bf16 rounding of them."""
    for name, buffers in edges["kept"].items():
        for buf, value in buffers.items():
            assert value.dtype == torch.float32, (name, buf)
            assert torch.all(value == edges["odd"]), (name, buf, value)


class _Group:
    """A stand-in process group: only its size is read."""

    def __init__(self, name, size=2):
        self.name, self._size = name, size

    def size(self):
        return self._size


@pytest.mark.parametrize(
    "sp, tp_size, dp_cp, expected",
    [
        (True, 2, "dp_cp", "tp_dp_cp"),  # SP splits the sequence over TP: TP ranks too
        (False, 2, "dp_cp", "dp_cp"),  # without SP the TP ranks route the same tokens
        (False, 2, None, "parallel_state dp_cp"),  # Megatron's MoE default collection
    ],
)
def test_the_loads_are_summed_over_the_ranks_that_route_different_tokens(
    monkeypatch, sp, tp_size, dp_cp, expected
):
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from megatron_latentmoe.moe.router import token_parallel_group

    groups = {n: _Group(n) for n in ("tp", "dp_cp", "tp_dp_cp", "parallel_state dp_cp")}
    monkeypatch.setattr(
        parallel_state,
        "get_data_parallel_group",
        lambda with_context_parallel=False: (
            groups["parallel_state dp_cp"] if with_context_parallel else None
        ),
    )
    pgs = SimpleNamespace(tp=_Group("tp", tp_size), tp_dp_cp=groups["tp_dp_cp"])
    if dp_cp:
        pgs.dp_cp = groups[dp_cp]
    config = SimpleNamespace(sequence_parallel=sp)
    assert token_parallel_group(config, pgs) is groups[expected]
