"""MXFP4 QAT of the routed experts (``moe_expert_weight_qat``, ``moe/qat.py``) on one rank.

A QAT layer == the plain layer whose routed-expert weights were replaced by their MXFP4
round trip: same output, same input gradient and same gradient for EVERY parameter (straight
through: the master weight gets the gradient of the quantized one). The state dicts have the
same keys and shapes (checkpoints are interchangeable: QAT can be switched on when resuming).
"""

import pytest
import torch

from tests.parallel.launcher import run_distributed

SEQ, BATCH = 12, 3


def _compare(rank, world_size):
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.ops.mxfp4 import mxfp4_round_trip
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu()
    torch.manual_seed(3)
    layers = {}
    for name, qat in (("qat", "mxfp4"), ("plain", "none"), ("rounded", "none")):
        cfg = tiny_config(moe_ffn_hidden_size=64, moe_latent_size=64, moe_expert_weight_qat=qat)
        layers[name] = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1)
    with torch.no_grad():
        layers["qat"].router.expert_bias.normal_(0.0, 0.05)
    state = layers["qat"].state_dict()
    keys_match = {k: tuple(v.shape) for k, v in state.items() if torch.is_tensor(v)} == {
        k: tuple(v.shape) for k, v in layers["plain"].state_dict().items() if torch.is_tensor(v)
    }
    expert_keys = [k for k in state if k.startswith("experts.") and k.endswith(".weight")]
    layers["plain"].load_state_dict(state)
    layers["rounded"].load_state_dict(
        {k: mxfp4_round_trip(v) if k in expert_keys else v for k, v in state.items()}
    )
    x = torch.randn(SEQ, BATCH, 64)
    upstream = torch.randn(SEQ, BATCH, 64)
    out = {}
    for name, layer in layers.items():
        xi = x.clone().requires_grad_()
        y, _ = layer(xi)
        (y * upstream).sum().backward()
        out[name] = dict(
            y=y.detach(),
            dx=xi.grad,
            grads={k: p.grad.clone() for k, p in layer.named_parameters() if p.grad is not None},
        )
    master_unchanged = all(
        torch.equal(layers["qat"].state_dict()[k], state[k]) for k in expert_keys
    )
    # Megatron's fused wgrad accumulation (on in GPU training) writes into weight.main_grad of
    # the tensor handed to the GEMM: the fake-quantized copy has none, so the QAT linears turn
    # it off and the gradient reaches the parameter's .grad as for an unfused layer
    qat_linears = [m for m in layers["qat"].experts.modules() if hasattr(m, "_forward_impl")]
    for m in qat_linears:
        m.gradient_accumulation_fusion = True
        m.weight.main_grad = torch.zeros_like(m.weight)
        m.weight.grad = None
    try:
        xi = x.clone().requires_grad_()
        (layers["qat"](xi)[0] * upstream).sum().backward()
        fused_wgrad = dict(
            n_linears=len(qat_linears),
            grads_equal=all(
                torch.equal(p.grad, out["qat"]["grads"][k])
                for k, p in layers["qat"].named_parameters()
                if k.startswith("experts.")
            ),
            main_grad_untouched=all(m.weight.main_grad.eq(0).all() for m in qat_linears),
        )
    except Exception as e:  # reported by its own test, not as an error of the whole module
        fused_wgrad = repr(e)
    # without moe_latent_size: Megatron's MoELayer, its experts' linears fake-quantized too
    plain_moe = {}
    for name, qat in (("qat", "mxfp4"), ("rounded", "none")):
        cfg = tiny_config(moe_latent_size=None, moe_ffn_hidden_size=64, moe_expert_weight_qat=qat)
        plain_moe[name] = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1)
    state = plain_moe["qat"].state_dict()
    plain_keys = [k for k in state if k.startswith("experts.") and k.endswith(".weight")]
    plain_moe["rounded"].load_state_dict(
        {k: mxfp4_round_trip(v) if k in plain_keys else v for k, v in state.items()}
    )
    with torch.no_grad():
        y_plain = {name: layer(x)[0] for name, layer in plain_moe.items()}
    return dict(
        out=out,
        keys_match=keys_match,
        n_expert_weights=len(expert_keys),
        master_unchanged=master_unchanged,
        fused_wgrad=fused_wgrad,
        y_plain_moe=y_plain,
        plain_moe_expert_weights=len(plain_keys),
    )


@pytest.fixture(scope="module")
def result():
    (r,) = run_distributed(_compare, 1)
    return r


def test_qat_layer_equals_plain_layer_on_mxfp4_weights(result):
    qat, rounded, plain = (result["out"][k] for k in ("qat", "rounded", "plain"))
    assert result["keys_match"] and result["n_expert_weights"] == 16  # 8 experts x fc1, fc2
    assert result["master_unchanged"]
    scale = rounded["y"].abs().max()
    assert (qat["y"] - rounded["y"]).abs().max() <= 1e-6 * scale
    assert (qat["dx"] - rounded["dx"]).abs().max() <= 1e-6 * rounded["dx"].abs().max()
    assert qat["grads"].keys() == rounded["grads"].keys()
    for k, g in rounded["grads"].items():
        assert (qat["grads"][k] - g).abs().max() <= 1e-6 * g.abs().max().clamp_min(1e-30), k
    # and QAT is really on: the plain layer on the master weights differs by the quantization
    assert (plain["y"] - qat["y"]).abs().max() > 1e-3 * scale


def test_qat_linears_turn_off_fused_wgrad_accumulation(result):
    """With gradient_accumulation_fusion on, the expert weights get the same .grad as without
    (it was an AttributeError on the fake-quantized weight's missing main_grad)."""
    assert result["fused_wgrad"] == dict(n_linears=16, grads_equal=True, main_grad_untouched=True)


def test_qat_of_a_plain_megatron_moe_equals_it_on_mxfp4_weights(result):
    """Without moe_latent_size (Megatron's MoELayer) the routed experts are fake-quantized too."""
    qat, rounded = result["y_plain_moe"]["qat"], result["y_plain_moe"]["rounded"]
    assert result["plain_moe_expert_weights"] == 16  # 8 experts x fc1, fc2
    assert (qat - rounded).abs().max() <= 1e-6 * rounded.abs().max()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(moe_ffn_hidden_size=48),
            "moe_ffn_hidden_size=48 is not allowed: a multiple of 32 x "
            "expert_tensor_parallel_size=1",
        ),
        (
            dict(moe_ffn_hidden_size=32, expert_tensor_parallel_size=2),
            "moe_ffn_hidden_size=32 is not allowed: a multiple of 32 x "
            "expert_tensor_parallel_size=2",
        ),
        (
            dict(moe_latent_size=48, moe_ffn_hidden_size=64),
            "moe_latent_size=48 is not allowed: a multiple of 32",
        ),
        (  # the expert TP size defaults to TP's
            dict(
                moe_ffn_hidden_size=32,
                expert_tensor_parallel_size=None,
                tensor_model_parallel_size=2,
            ),
            "moe_ffn_hidden_size=32 is not allowed: a multiple of 32 x "
            "expert_tensor_parallel_size=2",
        ),
        (  # a plain Megatron MoE's experts reduce over hidden_size
            dict(moe_latent_size=None, hidden_size=48, moe_ffn_hidden_size=64),
            "hidden_size=48 is not allowed: a multiple of 32 with moe_expert_weight_qat='mxfp4'",
        ),
        (
            dict(moe_ffn_hidden_size=64, fp8="e4m3", fp8_recipe="delayed"),
            "fp8_recipe='delayed' is not allowed: 'mxfp8' with moe_expert_weight_qat='mxfp4'",
        ),
        (
            dict(moe_ffn_hidden_size=64, fp8_param=True),
            "fp8_param=True is not allowed: False with moe_expert_weight_qat='mxfp4'",
        ),
        (
            dict(moe_ffn_hidden_size=64, moe_expert_weight_qat="nvfp4"),
            r"moe_expert_weight_qat='nvfp4' is not allowed: one of \('none', 'mxfp4'\)",
        ),
    ],
)
def test_qat_config_errors_name_the_width(overrides, message):
    from megatron_latentmoe.config import tiny_config

    with pytest.raises(ValueError, match=message):
        tiny_config(**{"moe_expert_weight_qat": "mxfp4", **overrides})


def test_qat_width_rules_wait_for_a_width_the_flags_leave_unset():
    """Flags before Megatron's validate_args may leave ffn_hidden_size None (Megatron fills in
    4 x hidden_size): the rule waits for the config, as the TP width rules do. It was a
    TypeError: unsupported operand type(s) for %: 'NoneType' and 'int'."""
    import dataclasses

    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.fields import check_stable_latentmoe

    cfg = tiny_config(moe_ffn_hidden_size=64, moe_latent_size=64, moe_expert_weight_qat="mxfp4")
    flags = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    flags.update(ffn_hidden_size=None, moe_ffn_hidden_size=None)
    check_stable_latentmoe(flags.get)
    flags.update(ffn_hidden_size=48)  # the experts' width when moe_ffn_hidden_size is unset
    with pytest.raises(ValueError, match=r"^moe_ffn_hidden_size=48 is not allowed: a multiple"):
        check_stable_latentmoe(flags.get)


@pytest.mark.parametrize("fc1, fc2", [("LatentProjection", "Row"), ("Column", "LatentProjection")])
def test_qat_refuses_experts_of_other_linears_naming_them(fc1, fc2):
    """Either linear unknown: refused by name (without Transformer Engine an unknown fc1 was an
    AttributeError: 'NoneType' object has no attribute '__name__')."""
    from functools import partial

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.moe.latent_projection import LatentProjection
    from megatron_latentmoe.moe.qat import with_expert_weight_qat

    linears = dict(
        Column=ColumnParallelLinear, Row=RowParallelLinear, LatentProjection=LatentProjection
    )
    experts = partial(
        SequentialMLP, submodules=MLPSubmodules(linear_fc1=linears[fc1], linear_fc2=linears[fc2])
    )
    cfg = tiny_config(moe_ffn_hidden_size=64, moe_latent_size=64, moe_expert_weight_qat="mxfp4")
    with pytest.raises(ValueError) as err:
        with_expert_weight_qat(experts, cfg)
    assert str(err.value) == (
        "moe_expert_weight_qat='mxfp4' is not allowed: 'none' for experts built from "
        f"{linears[fc1].__name__} / {linears[fc2].__name__}"
    )


def test_te_expert_linears_fake_quantize_their_weights(monkeypatch):
    """The TE subclasses, built here without Transformer Engine (Megatron's four TE linears
    replaced by stand-ins handing their weights on as TE's ``_get_weight_tensors`` does): the GEMM
    gets every weight's MXFP4 round trip with a straight-through gradient, fused wgrad
    accumulation is off, TE's single grouped weight is refused by name, and the builder keeps its
    other arguments. (On CPU nothing else reaches this code: the GPU twin needs TE.)"""
    from functools import partial

    import megatron.core.extensions.transformer_engine as te_ext
    from megatron.core.transformer.mlp import MLPSubmodules

    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.moe import qat
    from megatron_latentmoe.ops.mxfp4 import mxfp4_round_trip

    class StandIn:
        def __init__(self, weights, single_grouped_weight=False):
            self.weights, self.single_grouped_weight = weights, single_grouped_weight
            self.fuse_wgrad_accumulation = True

        def _get_weight_tensors(self):
            return list(self.weights)

    names = ("ColumnParallelGroupedLinear", "RowParallelGroupedLinear")
    names += ("ColumnParallelLinear", "RowParallelLinear")
    bases = {name: type(f"TE{name}", (StandIn,), {}) for name in names}
    for name, base in bases.items():
        monkeypatch.setattr(te_ext, f"TE{name}", base)
    monkeypatch.setattr(qat, "HAVE_TE", True)
    cfg = tiny_config(moe_ffn_hidden_size=64, moe_latent_size=64, moe_expert_weight_qat="mxfp4")
    for fc1, fc2 in (names[:2], names[2:]):
        sub = MLPSubmodules(linear_fc1=bases[fc1], linear_fc2=bases[fc2])
        built = qat.with_expert_weight_qat(partial(dict, 8, submodules=sub, extra=1), cfg)
        assert (built.func, built.args, built.keywords["extra"]) == (dict, (8,), 1)
        sub = built.keywords["submodules"]
        got = [(c.__name__, c.__bases__[1]) for c in (sub.linear_fc1, sub.linear_fc2)]
        assert got == [(f"MXFP4TE{fc1}", bases[fc1]), (f"MXFP4TE{fc2}", bases[fc2])]
    torch.manual_seed(0)
    weights = [torch.randn(4, 64, requires_grad=True) for _ in range(2)]
    linear = sub.linear_fc2(weights)
    assert linear.fuse_wgrad_accumulation is False
    seen = linear._get_weight_tensors()
    for w, q in zip(weights, seen, strict=True):
        assert torch.equal(q, mxfp4_round_trip(w.detach())) and not torch.equal(q, w)
    upstream = torch.randn(4, 64)
    (seen[1] * upstream).sum().backward()
    assert torch.equal(weights[1].grad, upstream)  # straight through
    with pytest.raises(ValueError) as err:
        sub.linear_fc1(weights, single_grouped_weight=True)
    assert str(err.value) == (
        "moe_expert_weight_qat='mxfp4' is not allowed: 'none' with TE's single grouped weight "
        "(one weight tensor per expert needed)"
    )
