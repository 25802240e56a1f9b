"""``BatchedActivationSequentialMLP`` (one SiTU-GLU call for all local experts, bare GEMMs) ==
Megatron's ``SequentialMLP`` forward (one activation and two linear modules per expert) on the
same weights: output, input gradient and every weight gradient within 1e-6 relative (fp32; the
activation is elementwise and ``F.linear`` is the same GEMM, so only the vectorised vs scalar
tails of the kernels and the weight gradient's operand order can differ, in the last ulps). The
counts are uneven and include an expert with no token. The bare-GEMM path must skip Megatron's
linear modules, and must not be taken where a linear does more (MXFP4 QAT); with the probs
applied on the input the experts run Megatron's forward. In bf16 (fp32 probs, as Megatron's router
gives them) the output is bf16 and Megatron's within bf16 rounding."""

import torch

from tests.parallel.launcher import run_distributed

TOL = 1e-6
COUNTS = [5, 0, 9, 1, 7, 3, 12, 2]  # 8 local experts, one of them empty


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _compare(rank, world_size):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.moe.experts import BatchedActivationSequentialMLP
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu()
    cfg = tiny_config()
    experts = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1).experts
    assert type(experts) is BatchedActivationSequentialMLP and experts._batched()
    torch.manual_seed(3)
    x = torch.randn(sum(COUNTS), cfg.moe_latent_size)
    probs = torch.rand(sum(COUNTS))
    upstream = torch.randn(sum(COUNTS), cfg.moe_latent_size)
    counts = torch.tensor(COUNTS)

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    module_calls = []  # patched linear forwards count here (a spawned worker: no restore needed)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        original = cls.forward
        cls.forward = lambda self, *a, _f=original, **k: module_calls.append(1) or _f(self, *a, **k)
    results, calls = [], []
    for forward in (experts.forward, lambda *a: SequentialMLP.forward(experts, *a)):
        experts.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out, bias = forward(xi, counts, probs)
        (out * upstream).sum().backward()
        grads = {k: p.grad.clone() for k, p in experts.named_parameters()}
        results.append((out.detach(), bias, xi.grad, grads))
        calls.append(len(module_calls))
        module_calls.clear()
    qat = tiny_config(moe_expert_weight_qat="mxfp4", moe_ffn_hidden_size=64)
    qat_experts = get_stable_latentmoe_mlp_spec(qat)(config=qat, layer_number=1).experts
    # the batched path with the linears called as modules (here the MXFP4 QAT linears)
    x_q = torch.randn(sum(COUNTS), qat.moe_latent_size)
    with torch.no_grad():
        qat_out = [
            f(x_q, counts, probs)[0]
            for f in (qat_experts.forward, lambda *a: SequentialMLP.forward(qat_experts, *a))
        ]
    # Megatron scales the INPUT by the probs here (top-1 only): the batched path, which scales
    # after the activation, must leave such a config to Megatron's forward
    experts.config.moe_apply_probs_on_input, experts.config.moe_router_topk = True, 1
    with torch.no_grad():
        on_input = [
            f(x, counts, probs)[0]
            for f in (experts.forward, lambda *a: SequentialMLP.forward(experts, *a))
        ]
    # bf16 experts, fp32 probs (Megatron's router output): the probs product is cast back to
    # bf16 before fc2, as Megatron's MLP does
    half = tiny_config(bf16=True, params_dtype=torch.bfloat16)
    half_experts = get_stable_latentmoe_mlp_spec(half)(config=half, layer_number=1).experts
    x_h = x.to(torch.bfloat16)
    with torch.no_grad():
        half_out = [
            f(x_h, counts, probs)[0]
            for f in (half_experts.forward, lambda *a: SequentialMLP.forward(half_experts, *a))
        ]
    # Megatron's GPU default: fc2's wgrad GEMM accumulates in fp32 into main_grad; a bare GEMM
    # would give a param-dtype (bf16) grad instead, so that expert's linears go back to modules
    fused = experts.local_experts[3].linear_fc2
    fused.gradient_accumulation_fusion = True
    bare_with_fusion = experts._bare_gemms()
    fused.gradient_accumulation_fusion = False
    (out_b, bias_b, dx_b, g_b), (out_s, bias_s, dx_s, g_s) = results
    return dict(
        out=_rel(out_b, out_s),
        dx=_rel(dx_b, dx_s),
        params=max(_rel(g_b[k], g_s[k]) for k in g_s if g_s[k].abs().max() > 0),
        empty_expert_grad_zero=all(
            g_b[k].abs().max().item() == 0 for k in g_b if ".1." in k or k.startswith("1.")
        ),
        bias=(bias_b, bias_s),
        n_params=len(g_s),
        bare=experts._bare_gemms(),
        bare_with_fusion=bare_with_fusion,
        module_calls=calls,
        qat_bare=qat_experts._bare_gemms(),
        qat_batched=qat_experts._batched(),
        qat_out=_rel(*qat_out),
        on_input_batched=experts._batched(),
        on_input_out=_rel(*on_input),
        half_batched=half_experts._batched() and half_experts._bare_gemms(),
        half_dtypes=[o.dtype for o in half_out],
        half_out=_rel(*(o.float() for o in half_out)),
    )


def test_batched_activation_equals_sequential_mlp():
    (r,) = run_distributed(_compare, 1)
    assert r["out"] < TOL and r["dx"] < TOL and r["params"] < TOL, r
    assert r["bias"] == (None, None) and r["n_params"] == 2 * len(COUNTS), r
    assert r["empty_expert_grad_zero"], r
    # bare GEMMs: no linear module called; Megatron's forward: fc1 + fc2 of every expert
    assert r["bare"] and r["module_calls"] == [0, 2 * len(COUNTS)], r
    assert not r["bare_with_fusion"], r  # one fused-wgrad linear: all called as modules
    assert not r["qat_bare"], r  # the MXFP4 linears fake-quantize their weight: called as modules
    assert r["qat_batched"] and r["qat_out"] < TOL, r  # ... in the batched path too
    # probs applied on the input: Megatron's forward, to the bit
    assert not r["on_input_batched"] and r["on_input_out"] == 0.0, r
    # bf16: the batched path's output is bf16 and Megatron's within bf16 rounding (2^-8)
    assert r["half_batched"] and r["half_dtypes"] == [torch.bfloat16] * 2, r
    assert r["half_out"] < 2**-8, r


def _fallbacks(rank, world_size):
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu()
    cfg = tiny_config()
    experts = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1).experts
    c, missing = experts.config, object()

    def flipped(obj, name, value, predicate):
        """predicate() with obj.name = value, then obj.name restored (or removed)."""
        old = getattr(obj, name, missing)
        setattr(obj, name, value)
        try:
            return predicate()
        finally:
            if old is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

    batched = {
        name: flipped(c, name, value, experts._batched)
        for name, value in (
            ("use_te_activation_func", False),  # a bare function, applied with GLU by the MLP
            ("fp8", "e4m3"),
            ("fp4", "e2m1"),
            ("add_bias_linear", True),
            ("moe_apply_probs_on_input", True),
        )
    }
    # one local expert: Megatron's forward calls it without reading tokens_per_expert on the host
    batched["one_local_expert"] = flipped(experts, "num_local_experts", 1, experts._batched)

    class TwoRanks:
        def size(self):
            return 2

    bare = {"cpu_offloading": flipped(c, "cpu_offloading", True, experts._bare_gemms)}
    for label, linear in (
        ("fc1", experts.local_experts[5].linear_fc1),
        ("fc2", experts.local_experts[2].linear_fc2),
    ):
        for name, value in (
            ("bias", torch.nn.Parameter(torch.zeros(linear.weight.shape[0]))),
            ("gtp_remat_size", 2),
            ("gather_output", True),
            ("tp_group", TwoRanks()),  # TP > 1 without explicit expert comm: the module reduces
        ):
            bare[f"{label}.{name}"] = flipped(linear, name, value, experts._bare_gemms)
        # with explicit expert comm the dispatcher communicates: still a bare GEMM
        bare[f"{label}.tp_group+explicit_comm"] = flipped(
            linear,
            "explicit_expert_comm",
            True,
            lambda linear=linear: flipped(linear, "tp_group", TwoRanks(), experts._bare_gemms),
        )
    return dict(
        batched=batched,
        bare=bare,
        default=(experts._batched(), experts._bare_gemms()),
    )


def test_each_condition_sends_the_experts_back_to_megatrons_forward():
    """Every case the module docstring lists leaves the batched path (``_batched``: an activation
    that is not a module, FP8 / FP4 padding, linear biases, probs on the input, one local expert)
    or the bare GEMMs (``_bare_gemms``: CPU offloading, and on any single fc1 / fc2: a bias, GTP
    weight sharding, gather_output, a TP group of 2 ranks without explicit expert comm), each
    flipped alone on the tiny config's experts; TP with explicit expert comm stays bare."""
    (r,) = run_distributed(_fallbacks, 1)
    assert r["default"] == (True, True), r
    assert not any(r["batched"].values()), r
    explicit = {k: v for k, v in r["bare"].items() if k.endswith("+explicit_comm")}
    assert explicit == {"fc1.tp_group+explicit_comm": True, "fc2.tp_group+explicit_comm": True}, r
    assert len(r["bare"]) == 11 and not any(v for k, v in r["bare"].items() if k not in explicit), r
