"""Baselines and the exact reference of Quantile Balancing, for tests and benchmarks (SPEC §4).

Production routes with ``balancing.QuantileHistogram`` (the step-end histogram solve); what is
here is what it is compared with: the exact sort-based QB update (``exact_quantiles`` /
``exact_quantile_bias``, the statistic the histogram estimates within one bin), the DeepSeek-V3
sign update (``sign_update_bias``), biased top-k loads and MaxVio. Pure PyTorch (no Megatron).
Eager checks here may sync (reference code, not a hot path).
"""

from __future__ import annotations

import math

import torch

from megatron_latentmoe.balancing import (
    _BIAS_DTYPES,
    _check_scores_bias,
    _check_tensor,
    _check_valid,
    cutoff_route,
)


def _raise_if_bad(scores_ME: torch.Tensor, bias_E: torch.Tensor) -> None:
    """Eager finiteness / range check (one host sync for all three flags)."""
    flags = torch.stack(
        [
            torch.isfinite(scores_ME).all(),
            torch.isfinite(bias_E).all(),
            ((scores_ME >= 0) & (scores_ME <= 1)).all(),
        ]
    ).tolist()
    if not flags[0]:
        raise ValueError("scores_ME contains NaN or inf; allowed: finite sigmoid scores in [0, 1]")
    if not flags[1]:
        raise ValueError("bias_E contains NaN or inf; allowed: finite values")
    if not flags[2]:
        lo, hi = scores_ME.min().item(), scores_ME.max().item()
        raise ValueError(
            f"scores_ME has values in [{lo:.4g}, {hi:.4g}]; "
            "allowed: [0, 1] (sigmoid scores, not logits)"
        )


def topk_loads(scores_ME, bias_E, topk: int, valid_M: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens routed to each expert by top-k of fp32 ``s + b`` -> int64 ``loads_E`` [n]."""
    _check_scores_bias(scores_ME, bias_E, topk)
    _check_valid(valid_M, scores_ME.shape[0], scores_ME.device)
    n = scores_ME.shape[1]
    idx_MK = (scores_ME.float() + bias_E.float()).topk(topk, dim=1, sorted=False).indices
    loads_E = torch.zeros(n, dtype=torch.int64, device=scores_ME.device)
    if valid_M is None:
        src = torch.ones(1, dtype=torch.int64, device=idx_MK.device).expand(idx_MK.numel())
    else:
        src = valid_M.to(torch.int64)[:, None].expand_as(idx_MK).reshape(-1)
    return loads_E.scatter_add_(0, idx_MK.reshape(-1), src)


def max_violation(loads_E: torch.Tensor) -> float:
    """MaxVio = (max load - mean load) / mean load (0.0 for an empty batch)."""
    loads = loads_E.double()
    mean = loads.mean().item()
    return 0.0 if mean <= 0 else (loads.max().item() - mean) / mean


def sign_update_bias(loads_E: torch.Tensor, bias_E: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3 baseline (SignSGD on the dual, SPEC §4):
    ``b += rate * sign(mean(load) - load)``."""
    _check_tensor("bias_E", bias_E, 1, _BIAS_DTYPES)
    if loads_E.shape != bias_E.shape:
        raise ValueError(
            f"loads_E.shape={tuple(loads_E.shape)}; allowed: bias_E.shape={tuple(bias_E.shape)}"
        )
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate >= 0):
        raise ValueError(f"rate={rate!r}; allowed: finite float >= 0")
    loads = loads_E.to(device=bias_E.device, dtype=torch.float64)
    return (bias_E.float() + rate * torch.sign(loads.mean() - loads).float()).float()


# ----------------------------------------------------------------------------- exact reference
def exact_quantiles(
    scores_ME, bias_E, topk: int, valid_M: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-expert Q-th smallest ``r = alpha - s``, Q = ceil(m k / n) (fp32, NOT mean-centred);
    bias unchanged if m = 0. The order statistic the histogram estimates (why this one of the
    interval SPEC §4 allows: the ``balancing`` module docstring)."""
    return _exact_quantiles(scores_ME, bias_E, topk, valid_M)[0]


def _exact_quantiles(scores_ME, bias_E, topk, valid_M):
    _check_scores_bias(scores_ME, bias_E, topk)
    _check_valid(valid_M, scores_ME.shape[0], scores_ME.device)
    _raise_if_bad(scores_ME, bias_E)
    s32, b32 = scores_ME.float(), bias_E.float()
    n = s32.shape[1]
    _, alpha_M = cutoff_route(s32, b32, topk)
    r_ME = alpha_M[:, None] - s32
    if valid_M is not None:
        r_ME = r_ME[valid_M]
    m = r_ME.shape[0]
    if m == 0:
        return b32.clone(), 0
    big_q = -(-m * topk // n)  # ceil(m k / n), exact integer arithmetic
    if 4 * big_q <= m:  # partial selection is much cheaper than kthvalue for the small k/n tail
        return r_ME.topk(big_q, dim=0, largest=False, sorted=True).values[big_q - 1], m
    return r_ME.kthvalue(big_q, dim=0).values, m


def exact_quantile_bias(
    scores_ME, bias_E, topk: int, valid_M: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact sort-based QB update (SPEC §4 steps 2-3): column Q-th smallest r, minus its mean."""
    q_E, m = _exact_quantiles(scores_ME, bias_E, topk, valid_M)
    return q_E if m == 0 else q_E - q_E.mean()  # empty batch: bias unchanged
