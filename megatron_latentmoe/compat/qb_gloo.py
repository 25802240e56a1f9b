"""Megatron-Core 0.19.2's own ``quantile_balancing`` step on gloo with torch < 2.8 (CPU runs).

``megatron.core.distributed.finalize_model_grads._update_router_qb_beta`` averages the routers'
per-micro-batch quantiles with ``all_reduce(op=ReduceOp.AVG)``, which gloo refused before torch
2.8 ("Cannot use ReduceOp.AVG with Gloo"; gloo's AVG came with pytorch PR #149781, and 2.7.1 still
refuses it). :func:`apply_qb_gloo_compat` replaces it, on gloo under an older torch only, with the
same update written as a SUM all-reduce divided by the group size (NCCL, and gloo from torch 2.8 on,
keep Megatron's function: the pinned CPU torch 2.13 runs Megatron's own). Patched through
:mod:`.registry` (version-checked; ``registry.revert(GROUP)`` undoes it).
(The other router wall, ``TopKRouter._apply_expert_bias``'s unbroadcast padding mask, is fixed
in our router subclass, ``moe/router.py``.)
"""

from __future__ import annotations

import importlib

import torch
from torch.torch_version import TorchVersion

from . import registry

GROUP = "qb-gloo"
GLOO_AVG_SINCE = "2.8"
"""The first torch release whose gloo all-reduce takes ``ReduceOp.AVG``."""
# the package re-exports the function under the module's name: import the module by path
_MODULE = "megatron.core.distributed.finalize_model_grads"


def _update_router_qb_beta(model, config, dp_cp_group=None):
    """Megatron's ``_update_router_qb_beta`` with AVG = SUM / group size."""
    from megatron.core.utils import get_attr_wrapped_model

    betas, avgs = [], []
    for chunk in model:
        for module in get_attr_wrapped_model(chunk, "modules")():
            if getattr(module, "qb_beta_accum", None) is not None and module.training:
                betas.append(module.qb_beta)
                avgs.append(
                    module.qb_beta_accum
                    / module.qb_beta_count.clamp(min=1).to(module.qb_beta_accum.dtype)
                )
    if not betas:
        return
    stacked_avg = torch.stack(avgs, dim=0)
    torch.distributed.all_reduce(stacked_avg, op=torch.distributed.ReduceOp.SUM, group=dp_cp_group)
    stacked_avg /= torch.distributed.get_world_size(dp_cp_group)
    ema = config.moe_router_quantile_balancing_ema
    new = ema * torch.stack(betas, dim=0) + (1.0 - ema) * stacked_avg
    new = new - new.mean(dim=-1, keepdim=True)
    for beta, value in zip(betas, new, strict=True):
        beta.copy_(value)


def _shim() -> None:
    fmg = importlib.import_module(_MODULE)
    registry.patch(GROUP, fmg, "_update_router_qb_beta", _update_router_qb_beta)


def apply_qb_gloo_compat() -> bool:
    """Install the replacement when the default process group is gloo and torch's gloo refuses
    AVG (torch < :data:`GLOO_AVG_SINCE`); idempotent. True if it is installed."""
    if registry.is_applied(GROUP):
        return True
    if not (torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"):
        return False
    if TorchVersion(torch.__version__) >= GLOO_AVG_SINCE:
        return False
    return registry.apply_group(GROUP, [_shim])
