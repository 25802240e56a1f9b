"""GPU + Transformer Engine: MXFP4 QAT of the routed experts in the TE spec (skipped on CPU; the
CPU twin is tests/unit/test_expert_qat.py, local spec).

* TE QAT layer == TE plain layer whose expert weights are their MXFP4 round trip (same GEMMs on
  the same values: output, input gradient and expert-weight gradients, straight through);
* TE QAT layer == local QAT layer on the same weights (bf16 tolerance);
for grouped-GEMM experts and for sequential TE experts.
"""

import pytest
import torch

from tests.gpu.test_te_block import (
    BF16_RTOL,
    GROUPED_SKIP,
    NO_GROUPED_GEMM,
    TOKENS,
    D,
    _config,
    _rel,
    local_to_te_state,
    needs_te,
)

pytestmark = pytest.mark.gpu
QAT = {"moe_expert_weight_qat": "mxfp4"}


def _run(layer, x):
    inp = x.clone().requires_grad_()
    out, _ = layer(inp)
    out.float().square().sum().backward()
    grads = {k: p.grad.clone() for k, p in layer.named_parameters() if k.startswith("experts.")}
    return out.detach(), inp.grad, grads


@needs_te
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_gemm", "sequential"])
def test_te_qat_equals_te_on_mxfp4_weights_and_local_qat(megatron_world, grouped):
    from megatron_latentmoe.ops.mxfp4 import mxfp4_round_trip
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    if grouped and NO_GROUPED_GEMM:
        pytest.skip(GROUPED_SKIP)
    te_qat_cfg = _config(moe_grouped_gemm=grouped, **QAT)
    te_cfg = _config(moe_grouped_gemm=grouped)
    local_cfg = _config(**QAT)
    local = get_stable_latentmoe_mlp_spec(local_cfg, "local")(config=local_cfg, layer_number=1)
    te_qat = get_stable_latentmoe_mlp_spec(te_qat_cfg, "te")(config=te_qat_cfg, layer_number=1)
    te = get_stable_latentmoe_mlp_spec(te_cfg, "te")(config=te_cfg, layer_number=1)
    local, te_qat, te = local.cuda(), te_qat.cuda(), te.cuda()
    state = local_to_te_state(local.state_dict(), grouped)
    rounded = {
        k: mxfp4_round_trip(v)
        if k.startswith("experts.") and torch.is_tensor(v) and v.dim() == 2
        else v
        for k, v in state.items()
    }
    te_qat.load_state_dict(state, strict=False)
    te.load_state_dict(rounded, strict=False)
    x = torch.randn(TOKENS, 1, D, device="cuda", dtype=torch.bfloat16)
    out_q, dx_q, g_q = _run(te_qat, x)
    out_r, dx_r, g_r = _run(te, x)
    out_l, dx_l, _ = _run(local, x)
    assert _rel(out_q, out_r) < 1e-3 and _rel(dx_q, dx_r) < 1e-3
    assert g_q.keys() == g_r.keys() and all(_rel(g_q[k], g_r[k]) < 1e-3 for k in g_r)
    assert _rel(out_q, out_l) < BF16_RTOL and _rel(dx_q, dx_l) < BF16_RTOL
