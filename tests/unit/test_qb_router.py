"""The QB router (SPEC §3, §4): what it routes, and which forwards it observes.

Observed: every non-padding token of a training forward, exactly once, also under activation
recompute. Not observed: padding tokens, eval forwards, forwards without autograd.
"""

import pytest
import torch

from tests.parallel.launcher import run_distributed

SEQ, BATCH = 10, 4


def _layer(**overrides):
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    cfg = tiny_config(**overrides)
    layer = get_stable_latentmoe_mlp_spec(cfg)(config=cfg)
    layer.set_layer_number(1)  # what TransformerLayer does; the router reports it in errors
    return layer, cfg


def _observed(layer):
    hist = layer.router.qb_histogram
    return int(hist.num_tokens), hist.counts.clone(), layer.router.step_loads_E.clone()


def _run(rank, world_size):
    from megatron_latentmoe.balancing import QuantileHistogram
    from megatron_latentmoe.compat import initialize_parallel_cpu

    initialize_parallel_cpu()
    out = {}
    torch.manual_seed(3)
    x = torch.randn(SEQ, BATCH, 64)

    # 1. one training forward + backward: every token observed once; loads = routed copies.
    # A non-zero bias that changes selections: the loads must count the BIASED top-k.
    layer, cfg = _layer()
    with torch.no_grad():
        layer.router.expert_bias.copy_(0.3 * torch.randn(cfg.num_moe_experts))
    layer.train()
    y, _ = layer(x.clone().requires_grad_())
    y.sum().backward()
    out["train"] = _observed(layer)
    out["router_state_keys"] = sorted(layer.router.state_dict())
    logits = x.reshape(-1, 64) @ layer.router.weight.detach().T
    expected = QuantileHistogram(cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_qb_num_bins)
    expected.observe(torch.sigmoid(logits), layer.router.expert_bias)
    out["expected_counts"] = expected.counts.clone()
    n, k = cfg.num_moe_experts, cfg.moe_router_topk

    def loads_of(scores):
        return torch.bincount(scores.topk(k, dim=1).indices.flatten(), minlength=n)

    scores = torch.sigmoid(logits)
    out["expected_loads"] = loads_of(scores + layer.router.expert_bias)
    out["unbiased_loads"] = loads_of(scores)

    # 2. padding: tokens flagged True in padding_mask ([batch, seq], Megatron's layout) are skipped
    layer.router.qb_histogram.reset()
    layer.router.step_loads_E.zero_()
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[:, -3:] = True
    y, _ = layer(x.clone().requires_grad_(), padding_mask=padding)
    y.sum().backward()
    out["padded"] = _observed(layer)
    keep = ~padding.T.reshape(-1)
    expected.reset()
    expected.observe(torch.sigmoid(logits[keep]), layer.router.expert_bias)
    out["expected_padded_counts"] = expected.counts.clone()
    out["expected_padded_loads"] = loads_of(scores[keep] + layer.router.expert_bias)

    # 3. eval and no-grad forwards are not observed
    layer.router.qb_histogram.reset()
    layer.router.step_loads_E.zero_()
    layer.router.step_input_sum_D.zero_()
    from megatron_latentmoe.moe.balance_step import balance_routers

    layer.eval()
    layer(x)
    out["eval_balance_routers"] = len(balance_routers([layer]))  # eval: no step end for it
    layer.train()
    out["train_balance_routers"] = balance_routers([layer]) == [layer.router]
    with torch.no_grad():
        layer(x)
    out["eval"] = _observed(layer)
    out["eval_input_sum"] = layer.router.step_input_sum_D.clone()

    # 4. NaN router input: the forward does not sync; the step-end update names layer and cause
    from megatron_latentmoe.moe.balance_step import update_balance

    layer.router.qb_histogram.reset()
    layer.router.step_loads_E.zero_()
    bad = x.clone()
    bad[0, 0, :] = float("nan")
    layer(bad.requires_grad_())
    try:
        update_balance([layer])
        out["nan_error"] = None
    except ValueError as err:
        out["nan_error"] = str(err)
    out["bias_after_nan"] = layer.router.expert_bias.clone()

    # 5. activation recompute of the whole MoE layer: observed once, not twice, not zero times
    layer_rc, _ = _layer(recompute_granularity="selective", recompute_modules=["moe"])
    layer_rc.load_state_dict(layer.state_dict())
    layer_rc.train()
    y, _ = layer_rc(x.clone().requires_grad_())
    out["recompute_after_forward"] = _observed(layer_rc)
    y.sum().backward()
    out["recompute"] = _observed(layer_rc)
    # 6. drift correction: after the step-end solve and a change of the router weight (what the
    # optimizer step does), the next forward moves the bias by the score shift at the mean input
    layer.router.qb_histogram.reset()
    layer.router.step_loads_E.zero_()
    layer.router.step_tokens.zero_()
    layer.router.step_input_sum_D.zero_()
    y, _ = layer(x.clone().requires_grad_(), padding_mask=padding)
    y.sum().backward()
    update_balance([layer])
    solved = layer.router.expert_bias.clone()
    # the armed correction keeps its own copy of the mean input (a later step end overwrites it)
    layer.router.qb_mean_input.fill_(3.0)
    mean_input = x.transpose(0, 1)[~padding].mean(dim=0)  # padding excluded
    w_old = layer.router.weight.detach().clone()
    with torch.no_grad():
        layer.router.weight.add_(0.05 * torch.randn_like(layer.router.weight))
    shift = torch.sigmoid(layer.router.weight.detach() @ mean_input) - torch.sigmoid(
        w_old @ mean_input
    )
    out["drift_expected"] = solved - (shift - shift.mean())
    out["drift_solved"] = solved
    out["drift_saved"] = layer.router.state_dict()["expert_bias"].clone()  # applies it once
    layer.eval()
    layer(x)
    out["drift_after_forward"] = layer.router.expert_bias.clone()  # not applied twice
    layer.train()

    # 7. the absorption loss (moe_qb_absorb_coeff c): the router weight's gradient with it minus
    # without it, on the same padded forward, against the closed form
    # d/dw_j [-c (b_j - mean b) P_j] = -c (b_j - mean b) / T_valid * sum_valid s'(l_ij) x_i
    coeff = 0.7
    grads = {}
    for c in (0.0, coeff):
        lay, _ = _layer(moe_qb_absorb_coeff=c)
        lay.load_state_dict(layer.state_dict())
        lay.train()
        y, _ = lay(x.clone(), padding_mask=padding)
        y.sum().backward()
        grads[c] = lay.router.weight.grad.clone()
    kept = x.reshape(-1, 64)[keep]
    s = torch.sigmoid(kept @ layer.router.weight.detach().T)
    centred = layer.router.expert_bias - layer.router.expert_bias.mean()
    out["absorb_grad"] = grads[coeff] - grads[0.0]
    out["absorb_expected"] = -coeff * centred[:, None] * ((s * (1 - s)).T @ kept) / len(kept)
    # the same without a padding mask (every token counts) and with a bias whose mean is not 0
    # (the solve's is): the loss takes the bias centred; and on a micro-batch of padding only
    # (no valid token: no gradient, not 0 / 0) or of ONE valid token (its own gradient, whole)
    grads, empty, single = {}, {}, {}
    one = torch.ones(BATCH, SEQ, dtype=torch.bool)
    one[1, 2] = False  # token x[2, 1] (x is [SEQ, BATCH, D])
    for c in (0.0, coeff):
        lay, _ = _layer(moe_qb_absorb_coeff=c)
        lay.load_state_dict(layer.state_dict())
        with torch.no_grad():
            lay.router.expert_bias.add_(0.5)
        lay.train()
        y, _ = lay(x.clone())
        y.sum().backward()
        grads[c] = lay.router.weight.grad.clone()
        lay.router.weight.grad = None
        y, _ = lay(x.clone(), padding_mask=torch.ones(BATCH, SEQ, dtype=torch.bool))
        y.sum().backward()
        empty[c] = lay.router.weight.grad.clone()
        lay.router.weight.grad = None
        y, _ = lay(x.clone(), padding_mask=one)
        y.sum().backward()
        single[c] = lay.router.weight.grad.clone()
    every = x.reshape(-1, 64)
    s = torch.sigmoid(every @ layer.router.weight.detach().T)
    out["absorb_grad_unpadded"] = grads[coeff] - grads[0.0]
    out["absorb_expected_unpadded"] = (
        -coeff * centred[:, None] * ((s * (1 - s)).T @ every) / len(every)
    )
    out["absorb_grad_all_padding"] = empty[coeff] - empty[0.0]
    x_1 = x[2, 1]
    s_1 = torch.sigmoid(layer.router.weight.detach() @ x_1)
    out["absorb_grad_one_token"] = single[coeff] - single[0.0]
    out["absorb_expected_one_token"] = -coeff * (centred * s_1 * (1 - s_1))[:, None] * x_1

    # 8. a step whose tokens are all padding: the mean router input is 0 (not 0/0), so the
    # drift correction leaves the bias alone; a step of ONE token: its input is the mean
    lay, _ = _layer()
    lay.train()
    bias0 = lay.router.expert_bias.clone()
    for case, pad in (("no_token", torch.ones(BATCH, SEQ, dtype=torch.bool)), ("one_token", None)):
        if pad is None:
            pad = torch.ones(BATCH, SEQ, dtype=torch.bool)
            pad[2, 5] = False
        y, _ = lay(x.clone().requires_grad_(), padding_mask=pad)
        y.sum().backward()
        update_balance([lay])
        out[f"{case}_mean_input"] = lay.router.qb_mean_input.clone()
        out[f"{case}_last"] = (lay.router.last_balance, lay.router.last_loads_E)
        if case == "no_token":
            with torch.no_grad():
                lay.router.weight.add_(0.05 * torch.randn_like(lay.router.weight))
            lay.eval()
            lay(x)  # applies the armed drift correction
            lay.train()
            out["no_token_bias"] = (bias0, lay.router.expert_bias.clone())
    out["one_token_input"] = x[5, 2].clone()

    # 9. two steps in a row: the second step's metrics and mean router input are its own (the
    # step end resets the token count and the input sum along with the histogram and the loads)
    lay, _ = _layer()
    lay.train()
    for step_x, pad in ((x + 2.0, None), (x, padding)):
        y, _ = lay(step_x.clone().requires_grad_(), padding_mask=pad)
        y.sum().backward()
        update_balance([lay])
    out["second_step"] = (
        lay.router.last_balance,
        lay.router.last_loads_E.clone(),
        lay.router.qb_mean_input.clone(),
        x.transpose(0, 1)[~padding].mean(dim=0),
    )

    # 10. an extra solve inside a rescored step (balance_step.solve_quantile_bias): the bias the
    # histogram solves to, the histogram reset; loads, tokens and input sum kept for the step end
    from megatron_latentmoe.moe.balance_step import solve_quantile_bias

    lay, _ = _layer()
    lay.train()
    y, _ = lay(x.clone().requires_grad_(), padding_mask=padding)
    y.sum().backward()
    r = lay.router
    want = r.qb_histogram.solve(r.expert_bias).clone()
    kept = (r.step_loads_E.clone(), r.step_tokens.clone(), r.step_input_sum_D.clone())
    solve_quantile_bias([lay])
    out["extra_solve"] = dict(
        bias=(r.expert_bias.clone(), want),
        histogram_tokens=int(r.qb_histogram.num_tokens),
        kept=(kept, (r.step_loads_E.clone(), r.step_tokens.clone(), r.step_input_sum_D.clone())),
    )

    # 11. the step end's mean router input divides by the ranks that ROUTED tokens: an emulated
    # two-rank all-reduce (the idle rank's words added to the busy rank's) where one rank's
    # micro-batch was all padding leaves the busy rank's mean input, not half of it
    import megatron_latentmoe.moe.balance_step as balance_step

    sum_over_ranks = balance_step._sum_over_ranks
    idle, _ = _layer()
    busy, _ = _layer()
    busy.load_state_dict(idle.state_dict())
    captured = []
    try:
        balance_step._sum_over_ranks = lambda packed, group: captured.extend(packed) or packed
        idle.train()
        y, _ = idle(
            x.clone().requires_grad_(), padding_mask=torch.ones(BATCH, SEQ, dtype=torch.bool)
        )
        y.sum().backward()
        update_balance([idle])
        balance_step._sum_over_ranks = lambda packed, group: sum_over_ranks(
            [p + q for p, q in zip(packed, captured, strict=True)], group
        )
        busy.train()
        y, _ = busy(x.clone().requires_grad_())
        y.sum().backward()
        update_balance([busy])
    finally:
        balance_step._sum_over_ranks = sum_over_ranks
    out["idle_rank"] = (
        busy.router.qb_mean_input.clone(),
        x.reshape(-1, 64).mean(dim=0),
        busy.router.last_balance.num_tokens,
    )

    # 12. the next training forward applies the armed drift correction by itself (no checkpoint
    # save in between): b - (shift - mean shift) at the step's mean input
    lay, _ = _layer()
    lay.train()
    y, _ = lay(x.clone().requires_grad_())
    y.sum().backward()
    update_balance([lay])
    solved, mean_in = lay.router.expert_bias.clone(), lay.router.qb_mean_input.clone()
    w_old = lay.router.weight.detach().clone()
    with torch.no_grad():
        lay.router.weight.add_(0.05 * torch.randn_like(lay.router.weight))
    shift = torch.sigmoid(lay.router.weight.detach() @ mean_in) - torch.sigmoid(w_old @ mean_in)
    y, _ = lay(x.clone().requires_grad_())
    out["drift_by_forward"] = (
        lay.router.expert_bias.clone(),
        solved - (shift - shift.mean()),
        solved,
    )

    # 13. the weights of the routed experts: the RAW scores (the bias only selects), renormalised
    # over the k when k > 1 (k = 1: the raw score itself), times the scaling factor (SPEC §3)
    probs = {}
    for k in (2, 1):
        lay, cfg = _layer(moe_router_topk=k)
        lay.router.expert_bias.copy_(0.3 * torch.randn(cfg.num_moe_experts))
        lay.eval()
        with torch.no_grad():
            logits = x.reshape(-1, 64) @ lay.router.weight.T
            got, _ = lay.router.routing(logits.view(SEQ, BATCH, -1))
            s = torch.sigmoid(logits)
            idx = (s + lay.router.expert_bias).topk(k, dim=1).indices
            w = s.gather(1, idx)
            if k > 1:
                w = w / w.sum(dim=1, keepdim=True)
            w = w * (cfg.moe_router_topk_scaling_factor or 1.0)
            probs[k] = (got, torch.zeros_like(s).scatter(1, idx, w))
    out["probs"] = probs

    # 14. qb_mean_input is optional in a checkpoint both ways: one without it loads into a
    # rescoring run (persistent key) as "unknown" (NaN), whatever the router held; one with it
    # loads into a run without rescoring (non-persistent key)
    lay, _ = _layer(moe_qb_rescore_iters=5)
    state = {k: v for k, v in lay.router.state_dict().items() if k != "qb_mean_input"}
    lay.router.qb_mean_input.fill_(3.0)
    lay.router.load_state_dict(state)  # strict
    out["mean_input_loaded_without_key"] = lay.router.qb_mean_input.clone()
    plain, _ = _layer()
    plain.router.load_state_dict({**state, "qb_mean_input": torch.ones(64)})  # strict
    out["mean_input_loaded_unexpected"] = plain.router.qb_mean_input.clone()

    # 15. forward-only passes without autograd: a QB rescoring pass observes the non-padding
    # tokens (and counts no load), a calibration pass keeps every micro-batch's fp32 scores with
    # its valid-token mask; neither applies (nor logs) the losses beside QB
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    lay, _ = _layer(
        moe_router_load_balancing_type=["quantile_histogram", "seq_aux_loss"],
        moe_aux_loss_coeff=[0.0, 1e-2],
        moe_qb_absorb_coeff=0.3,
    )
    lay.router.expert_bias.copy_(0.3 * torch.randn(lay.router.expert_bias.shape))  # loss != 0
    lay.train()
    lay.router.qb_rescoring = True
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    with torch.no_grad():
        lay(x, padding_mask=padding)
    out["rescoring"] = _observed(lay)
    out["rescoring_logged"] = sorted(k for k, e in tracker.metrics.items() if e.values.any())
    lay.router.qb_rescoring = False
    lay.router.qb_calibration_scores = []
    with torch.no_grad():
        lay(x, padding_mask=padding)
    ((scores, valid),) = lay.router.qb_calibration_scores
    logits = x.reshape(-1, 64) @ lay.router.weight.T
    out["calibration"] = (scores, torch.sigmoid(logits), valid, ~padding.T.reshape(-1))
    lay.router.qb_calibration_scores = None

    # 16. a step end without drift correction (update_balance(drift_correction=False): the
    # rescoring step's solve) arms none: after a weight change the next forward keeps its bias
    lay, _ = _layer()
    lay.train()
    y, _ = lay(x.clone().requires_grad_())
    y.sum().backward()
    update_balance([lay], drift_correction=False)
    solved = lay.router.expert_bias.clone()
    with torch.no_grad():
        lay.router.weight.add_(0.05 * torch.randn_like(lay.router.weight))
    y, _ = lay(x.clone().requires_grad_())
    out["no_drift_correction"] = (lay.router.expert_bias.clone(), solved)

    # 17. a checkpoint whose expert_bias holds NaN / inf (corrupt) is refused at load, naming the
    # key, the layer and the experts, by the QB router and by Megatron's sign-update router (whose
    # loaded NaN took every token, step after step, with a finite loss); the bias stays as it was
    from megatron_latentmoe.moe.router import NonFiniteBiasError

    out["bad_bias"] = {}
    for name, flags in (
        ("qb", {}),
        ("sign", dict(moe_router_load_balancing_type="none", moe_router_enable_expert_bias=True)),
    ):
        lay, _ = _layer(**flags)
        before = lay.router.expert_bias.clone()
        state = dict(lay.state_dict())
        state["router.expert_bias"] = before.clone()
        state["router.expert_bias"][2] = float("nan")
        state["router.expert_bias"][5] = float("-inf")
        try:
            lay.load_state_dict(state)
            error = None
        except NonFiniteBiasError as err:
            error = str(err)
        out["bad_bias"][name] = (error, torch.equal(lay.router.expert_bias, before))

    return out


@pytest.fixture(scope="module")
def result():
    (r,) = run_distributed(_run, 1)
    return r


def test_training_forward_observes_every_token_once(result):
    tokens, counts, loads = result["train"]
    assert tokens == SEQ * BATCH
    assert torch.equal(counts, result["expected_counts"])
    assert int(loads.sum()) == SEQ * BATCH * 2  # top-2 copies
    # per expert: the routed copies under the biased selection (the bias does change some)
    assert torch.equal(loads, result["expected_loads"])
    assert not torch.equal(result["expected_loads"], result["unbiased_loads"])


def test_only_weight_and_bias_are_checkpointed(result):
    # the histogram and the load counters are per-step scratch, kept out of checkpoints
    assert result["router_state_keys"] == ["expert_bias", "weight"]


def test_padding_tokens_are_not_observed(result):
    tokens, counts, loads = result["padded"]
    assert tokens == SEQ * BATCH - 3 * BATCH
    assert torch.equal(counts, result["expected_padded_counts"])
    assert int(loads.sum()) == (SEQ - 3) * BATCH * 2
    assert torch.equal(loads, result["expected_padded_loads"])


def test_eval_and_no_grad_forwards_are_not_observed(result):
    assert result["eval_balance_routers"] == 0 and result["train_balance_routers"]
    tokens, counts, loads = result["eval"]
    assert tokens == 0 and int(counts.sum()) == 0 and int(loads.sum()) == 0
    # nor summed into the mean router input of the drift correction
    assert int(torch.count_nonzero(result["eval_input_sum"])) == 0


def test_nan_scores_raise_at_the_step_end_naming_the_layer(result):
    assert result["nan_error"] is not None
    assert "layer 1" in result["nan_error"] and "NaN/inf" in result["nan_error"]
    assert torch.isfinite(result["bias_after_nan"]).all()


def test_drift_correction_moves_the_bias_by_the_score_shift_once(result):
    # fixed-point mean input (resolution 2.4e-4): the bias agrees to ~1e-5, far below the shift
    assert not torch.allclose(result["drift_expected"], result["drift_solved"], atol=1e-3)
    torch.testing.assert_close(result["drift_saved"], result["drift_expected"], atol=2e-5, rtol=0)
    assert torch.equal(result["drift_after_forward"], result["drift_saved"])


def test_absorb_loss_gradient_is_the_closed_form(result):
    """moe_qb_absorb_coeff's loss reaches the router weight with the right sign and scale, over
    the non-padding tokens only (the bias here is the solve of section 6: non-zero)."""
    assert result["absorb_expected"].abs().max() > 1e-4
    torch.testing.assert_close(
        result["absorb_grad"], result["absorb_expected"], rtol=1e-4, atol=1e-7
    )


def test_absorb_loss_without_a_padding_mask_averages_over_every_token(result):
    """... with the bias centred (here its mean is 0.5); padding only: no gradient from it; one
    valid token: that token's gradient, whole (the count is clamped to 1, not more)."""
    torch.testing.assert_close(
        result["absorb_grad_unpadded"], result["absorb_expected_unpadded"], rtol=1e-4, atol=1e-7
    )
    assert torch.equal(result["absorb_grad_all_padding"], torch.zeros(8, 64))
    torch.testing.assert_close(
        result["absorb_grad_one_token"], result["absorb_expected_one_token"], rtol=1e-4, atol=1e-7
    )


def test_mean_router_input_of_a_step_with_no_token_and_with_one(result):
    assert result["no_token_last"] == (None, None)  # no metrics for a step that routed nothing
    balance, loads = result["one_token_last"]
    assert balance.num_tokens == 1 and int(loads.sum()) == 2
    assert torch.equal(result["no_token_mean_input"], torch.zeros(64))
    before, after = result["no_token_bias"]
    assert torch.equal(after, before)  # mean input 0: every score 1/2 under both weights
    torch.testing.assert_close(
        result["one_token_mean_input"], result["one_token_input"], rtol=0, atol=2.5e-4
    )


def test_a_steps_metrics_and_mean_input_are_its_own(result):
    """The second of two steps (the first's inputs shifted by +2): its token count, loads and
    mean router input count its own tokens only."""
    balance, loads, mean_input, want = result["second_step"]
    assert balance.num_tokens == (SEQ - 3) * BATCH
    assert int(loads.sum()) == (SEQ - 3) * BATCH * 2
    torch.testing.assert_close(mean_input, want, rtol=0, atol=2.5e-4)


def test_an_extra_solve_resets_only_the_histogram(result):
    got = result["extra_solve"]
    assert torch.equal(*got["bias"]) and got["bias"][0].abs().max() > 0
    assert got["histogram_tokens"] == 0
    before, after = got["kept"]
    assert int(before[1]) == (SEQ - 3) * BATCH
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


def test_recomputed_forward_is_observed_exactly_once(result):
    assert result["recompute_after_forward"][0] == 0  # first pass runs without autograd
    tokens, counts, _ = result["recompute"]
    assert tokens == SEQ * BATCH
    assert torch.equal(counts, result["expected_counts"])


def _run_half_precision(rank, world_size):
    """The QB router inside a half-precision model: Megatron's ``Float16Module`` casts the whole
    module with ``.bfloat16()`` / ``.half()``, buffers included."""
    from megatron_latentmoe.balancing import QuantileHistogram
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.moe.balance_step import update_balance

    initialize_parallel_cpu()
    out = {}
    for name, dtype, flag in (("bf16", torch.bfloat16, "bf16"), ("fp16", torch.float16, "fp16")):
        torch.manual_seed(5)
        layer, cfg = _layer(params_dtype=dtype, **{flag: True})
        bias = 0.3 * torch.randn(cfg.num_moe_experts)  # not representable in bf16 / fp16
        with torch.no_grad():
            layer.router.expert_bias.copy_(bias)
        layer = layer.to(dtype)  # what Float16Module does
        router = layer.router
        res = {"buffers": {k: v.dtype for k, v in router.named_buffers()}}
        res["bias_kept"] = torch.equal(router.expert_bias, bias)
        x = torch.randn(SEQ, BATCH, 64).to(dtype)
        layer.train()
        y, _ = layer(x.clone().requires_grad_())
        y.float().sum().backward()
        scores = torch.sigmoid(x.float().reshape(-1, 64) @ router.weight.detach().float().T)
        expected = QuantileHistogram(cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_qb_num_bins)
        expected.observe(scores, bias)
        res["expected_bias"] = expected.solve(bias)
        update_balance([layer])  # step end (drift correction armed)
        res["solved_bias"] = router.expert_bias.clone()
        res["mean_input"] = router.qb_mean_input.clone()
        res["true_mean_input"] = x.float().reshape(-1, 64).mean(dim=0)
        layer(x.clone().requires_grad_())  # the next step's forward applies the correction
        res["buffers_after"] = {k: v.dtype for k, v in router.named_buffers()}
        out[name] = res
    return out


@pytest.fixture(scope="module")
def half_precision_result():
    (r,) = run_distributed(_run_half_precision, 1)
    return r


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_router_buffers_stay_fp32_in_a_half_precision_model(half_precision_result, name):
    """SPEC §4 under bf16/fp16 training: the bias, the summed router input and the mean router
    input stay fp32 through the model's half-precision cast, and the step end runs (it used to
    fail in the drift correction: an fp32 weight times a bf16 mean input)."""
    res = half_precision_result[name]
    fp32 = {"expert_bias", "step_input_sum_D", "qb_mean_input"}
    for key in ("buffers", "buffers_after"):
        assert {k for k, v in res[key].items() if v == torch.float32} == fp32, res[key]
    assert res["bias_kept"]  # not rounded to half precision by the cast
    torch.testing.assert_close(res["solved_bias"], res["expected_bias"], rtol=0, atol=1e-6)
    assert torch.isfinite(res["mean_input"]).all()
    # the input is summed in fp32, not in the model dtype; the mean travels in fixed point 2**-12
    torch.testing.assert_close(res["mean_input"], res["true_mean_input"], rtol=0, atol=2.5e-4)


def test_an_idle_ranks_words_do_not_dilute_the_mean_router_input(result):
    """A rank whose micro-batches were all padding sends 'routed tokens' = 0: the summed mean
    router input is divided by 1 rank, not 2 (which would halve it)."""
    mean_input, want, tokens = result["idle_rank"]
    assert tokens == SEQ * BATCH and want.abs().max() > 0.05
    torch.testing.assert_close(mean_input, want, rtol=0, atol=2.5e-4)


def test_the_next_forward_applies_the_drift_correction(result):
    """Armed at the step end, applied by the next forward itself (not only by a checkpoint save):
    the bias moves by minus the centred score shift at the step's mean router input."""
    got, want, solved = result["drift_by_forward"]
    assert (want - solved).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("k", [2, 1])
def test_routed_weights_are_the_raw_scores_renormalised_when_k_above_1(result, k):
    """SPEC §3: p_j = s_j / sum_S s_l over the k selected (selection by s + b), with a non-zero
    bias; for k = 1 the weight is the raw score (Megatron and the HF model renormalise k > 1
    only)."""
    got, want = result["probs"][k]
    assert int((got != 0).sum(dim=1).min()) == k
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_checkpoint_without_the_mean_input_leaves_it_unknown(result):
    """A strict load of a router state without ``qb_mean_input`` into a rescoring run (which
    checkpoints it) neither fails nor keeps the value the router held: it is NaN (unknown), so
    QB rescoring does not arm the drift correction at a stale mean; the key in a checkpoint loads
    into a run without rescoring, where it is not state (the router's value stays NaN)."""
    assert torch.isnan(result["mean_input_loaded_without_key"]).all()
    assert torch.isnan(result["mean_input_loaded_unexpected"]).all()


def test_rescoring_observes_and_calibration_keeps_the_valid_tokens(result):
    """A QB rescoring pass (no autograd) observes the non-padding tokens and counts no load; a
    calibration pass keeps the fp32 scores of every token with the non-padding mask (the
    calibration's histogram skips padding by it). The losses beside QB (an aux loss, the
    absorption loss) are a training forward's only: the rescoring pass logs none."""
    tokens, _, loads = result["rescoring"]
    assert tokens == SEQ * BATCH - 3 * BATCH and int(loads.sum()) == 0
    assert result["rescoring_logged"] == []  # no aux / absorption loss from a rescoring pass
    scores, expected, valid, not_padding = result["calibration"]
    assert scores.dtype == torch.float32 and torch.allclose(scores, expected, atol=1e-6)
    assert valid is not None and torch.equal(valid, not_padding) and not valid.all()


def test_a_step_end_without_drift_correction_arms_none(result):
    """``update_balance(drift_correction=False)`` (the rescored step's solve, whose histogram
    was observed under the weights the next batch uses) leaves the next forward's bias as solved,
    even though the router weight changed in between."""
    after, solved = result["no_drift_correction"]
    assert solved.abs().sum() > 0 and torch.equal(after, solved)


@pytest.mark.parametrize("router", ["qb", "sign"])
def test_a_checkpoint_bias_with_nan_or_inf_is_refused_at_load(result, router):
    """Refused before it routes a token: the key, the layer, the values and the experts, and
    what is allowed; the router's bias is left as it was."""
    error, unchanged = result["bad_bias"][router]
    assert error == (
        "router.expert_bias (layer 1's router) = [nan, -inf] at expert(s) [2, 5] (2 of 8); "
        "allowed: finite values (a corrupt checkpoint: load an earlier one)"
    )
    assert unchanged
