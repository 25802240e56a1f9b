"""The Quantile Balancing router (SPEC §3, §4) as a Megatron ``TopKRouter`` subclass.

Selection: top-k of ``scores + bias`` (in fp32) with ``scores = sigmoid(logits)``; the same
top-(k+1) gives the QB cutoffs. Weights: the RAW scores
of the selected experts renormalised over the k (times ``moe_router_topk_scaling_factor``); the
bias never enters the weights or the gradient. In a training forward with autograd on, the
router feeds this micro-batch's scores into the layer's ``QuantileHistogram`` (SPEC §4 step
1-2) and counts the routed load for the balance metrics. The bias itself changes only at the
step end (``balance_step.py``), so a batch is never routed with a bias computed from itself.

Not observed: padding tokens (``padding_mask`` True = padding, as in Megatron's own expert-bias
counting), eval / inference forwards (``self.training`` False or autograd off), and the first
pass of an activation-recomputed forward (Megatron runs it under ``no_grad``; the recompute in
backward, with autograd on, is the one that counts), so every token is counted exactly once.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_latentmoe.balancing import CenteredQuantileHistogram, QuantileHistogram, cutoff_route


def _buffer_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class QuantileBalancingRouter(TopKRouter):
    """Sigmoid top-k router whose ``expert_bias`` is set by Quantile Balancing.

    ``expert_bias`` ([n], fp32, persistent) is Megatron's own buffer name, so distributed
    checkpoints carry it and the HF export maps it to ``gate.e_score_correction_bias``. The
    histogram and the load counters are per-step scratch, kept out of checkpoints.
    """

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False) -> None:
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        n = config.num_moe_experts
        device = _buffer_device()
        # TopKRouter leaves ``expert_bias = None`` when Megatron's sign-update bias is off.
        del self.expert_bias
        self.register_buffer("expert_bias", torch.zeros(n, dtype=torch.float32, device=device))
        self.register_buffer(
            "step_loads_E", torch.zeros(n, dtype=torch.int64, device=device), persistent=False
        )
        histogram = CenteredQuantileHistogram if config.moe_qb_binning == "centered" else QuantileHistogram
        # validate=False: no host sync in the forward; NaN/inf scores are counted on the device and
        # raise at the step-end update, on every rank (balance_step.py).
        self.qb_histogram = histogram(
            n, self.topk, num_bins=config.moe_qb_num_bins, device=device, validate=False
        )
        self.last_balance = None  # BalanceMetrics of the last step (set by balance_step)
        self.last_loads_E = None  # global routed tokens per expert of the last step

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """Return dense ``probs`` [m, n] and the boolean ``routing_map`` [m, n] (SPEC §3);
        suffixes as in ``balancing.py``: M tokens, E experts, K top-k."""
        logits_ME = logits.view(-1, self.config.num_moe_experts)
        padding_M = padding_mask.reshape(-1) if padding_mask is not None else None
        logits_ME = self.apply_z_loss(logits_ME, padding_mask=padding_M)

        scores_ME = torch.sigmoid(logits_ME)
        with torch.no_grad():  # top-(k+1) of fp32 s + b: k routes and the QB cutoff alpha
            topk_idx_MK, alpha_M = cutoff_route(scores_ME, self.expert_bias, self.topk)
        weights_MK = scores_ME.gather(1, topk_idx_MK)
        if self.topk > 1:
            weights_MK = weights_MK / (weights_MK.sum(dim=-1, keepdim=True) + 1e-20)
        if self.config.moe_router_topk_scaling_factor:
            weights_MK = weights_MK * self.config.moe_router_topk_scaling_factor
        probs_ME = torch.zeros_like(scores_ME).scatter(1, topk_idx_MK, weights_MK)
        routing_map_ME = torch.zeros_like(scores_ME, dtype=torch.bool).scatter(1, topk_idx_MK, True)

        if self.training and torch.is_grad_enabled():
            self._observe(scores_ME.detach(), alpha_M, routing_map_ME, padding_M)
        return probs_ME, routing_map_ME

    @torch.no_grad()
    def _observe(self, scores_ME, alpha_M, routing_map_ME, padding_M) -> None:
        valid_M = None if padding_M is None else ~padding_M.bool()
        self.qb_histogram.observe(
            scores_ME.float(), self.expert_bias, valid_M=valid_M, alpha_M=alpha_M
        )
        counted_ME = routing_map_ME if valid_M is None else routing_map_ME & valid_M[:, None]
        self.step_loads_E += counted_ME.sum(dim=0)
