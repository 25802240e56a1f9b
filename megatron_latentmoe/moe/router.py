"""Routers that count their global-batch loads (every balancing type) and the Quantile Balancing
router (SPEC §3, §4), both Megatron ``TopKRouter`` subclasses.

``BalanceCountingRouter`` is Megatron's ``TopKRouter`` unchanged (``aux_loss``, ``seq_aux_loss``,
``global_aux_loss``, ``none`` with or without ``--moe-router-enable-expert-bias``, Megatron's own
``quantile_balancing``) plus one int64 load counter per step, so the balance metrics of every
router come from the same count (``balance_step.py``). Its behavioural changes: megatron-core
0.19.2's ``_apply_expert_bias`` masks a [T, n] routing map with a [T] padding mask (no broadcast,
a crash at the first step); here padding is broadcast over the experts, so padding is counted out
of the sign update's loads as Megatron intends. Megatron's fp32 routing buffers stay fp32 under a
half-precision cast of the model (``_apply``). Megatron's ``quantile_balancing`` is refused, one
line, for a micro-batch with loss-masked tokens, which its per-micro-batch QB cannot skip
(``routing``).

``QuantileBalancingRouter`` selects the top-k of ``scores + bias`` (in fp32) with ``scores =
sigmoid(logits)``; the same top-(k+1) gives the QB cutoffs. Weights: the RAW scores of the
selected experts renormalised over the k (times ``moe_router_topk_scaling_factor``); the bias
never enters the weights or the gradient. In a training forward with autograd on, the router
feeds this micro-batch's scores into the layer's ``QuantileHistogram`` (SPEC §4 step 1-2). The
bias itself changes only at the step end (``balance_step.py``), so a batch is never routed with
a bias computed from itself.

Counted: the copies the experts keep (after Megatron's capacity dropping, without its fill up to
capacity, which has probability 0). Counted / observed: the non-padding tokens (``padding_mask``
True = padding) of training
forwards with autograd on; observed only: a QB rescoring pass (``qb_rescoring``,
``training/qb_rescore.py``); only kept aside: the scores of a QB calibration pass
(``qb_calibration_scores``, ``training/qb_calibrate.py``). Not counted: eval / inference
forwards and the first pass of an activation-recomputed forward (Megatron runs it under
``no_grad``; the recompute in backward is the one that counts), so every token is counted
exactly once. No host sync in the forward.

Suffixes name dimensions as in ``balancing.py``: M tokens, E experts, K top-k, D hidden.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss
from megatron.core.transformer.moe.router import TopKRouter

from megatron_latentmoe.balancing import (
    CenteredQuantileHistogram,
    QuantileHistogram,
    cutoff_route,
    non_finite_entries,
)


def megatron_device() -> torch.device:
    """Where Megatron's model and buffers live: the current CUDA device if there is one, else
    the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def token_parallel_group(config, pg_collection):
    """The ranks that route different tokens, over which the step end sums a router's counts:
    DP×CP, and TP too when SP splits the sequence (without SP the TP ranks route the same
    tokens). From the layer's ``pg_collection`` (a model built with its own process groups);
    Megatron's MoE default collection has no ``dp_cp``, which then comes from parallel_state."""
    tp = pg_collection.tp
    if config.sequence_parallel and tp is not None and tp.size() > 1:
        return pg_collection.tp_dp_cp
    dp_cp = getattr(pg_collection, "dp_cp", None)
    if dp_cp is not None:
        return dp_cp
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


class NonFiniteBiasError(ValueError):
    """A checkpoint's ``expert_bias`` holds NaN or inf (refused at load, naming the key)."""


class BalanceCountingRouter(TopKRouter):
    """Megatron's ``TopKRouter`` plus a per-step count of the tokens routed to each expert.

    ``step_loads_E`` [n] int64 (routed copies per expert) and ``step_tokens`` (tokens routed)
    are per-step scratch, out of checkpoints; the step end all-reduces them over
    ``token_group`` (:func:`token_parallel_group`) and resets them.
    """

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False) -> None:
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.token_group = token_parallel_group(config, pg_collection)
        device = megatron_device()
        n = config.num_moe_experts
        self.register_buffer(
            "step_loads_E", torch.zeros(n, dtype=torch.int64, device=device), persistent=False
        )
        self.register_buffer(
            "step_tokens", torch.zeros((), dtype=torch.int64, device=device), persistent=False
        )
        self.last_balance = None  # BalanceMetrics of the last step (set by balance_step)
        self.last_loads_E = None  # global routed tokens per expert of the last step

    # Megatron's fp32 routing buffers (sign update, global aux loss, its own QB); subclasses add.
    _FP32_BUFFERS = (
        "expert_bias",
        "local_tokens_per_expert",
        "global_tokens_per_expert",
        "ga_steps",
        "qb_beta",
        "qb_beta_accum",
    )

    def _apply(self, fn, recurse: bool = True):
        """Keep the fp32 buffers fp32 under a half-precision cast of the model (Megatron's
        ``Float16Module`` calls ``.bfloat16()`` / ``.half()``, which casts buffers too): each is
        restored from its fp32 original (a bf16 round trip would lose bits), moved to wherever
        ``fn`` put the converted copy. In bf16 the sign update's token counter stopped being
        exact above 256, and the QB router's step end multiplied the fp32 router weight by a
        bf16 mean input (a dtype error at the first step end)."""
        before = {name: self._buffers.get(name) for name in self._FP32_BUFFERS}
        out = super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if (
                old is not None
                and new is not None
                and old.dtype == torch.float32
                and new.dtype in (torch.float16, torch.bfloat16)
            ):
                src = new if "meta" in (old.device.type, new.device.type) else old
                self._buffers[name] = src.to(device=new.device, dtype=torch.float32)
        return out

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        """A non-finite ``expert_bias`` is refused, naming the key and the experts (one host read,
        at load). Loaded, a NaN bias was the top choice of every token (``topk`` ranks NaN
        first): Megatron's sign update kept it NaN and routed every token to that expert with a
        finite loss, step after step; QB stopped at the first step end blaming the scores."""
        key = prefix + "expert_bias"
        bias = state_dict.get(key)
        if isinstance(bias, torch.Tensor) and bias.is_floating_point() and not bias.is_meta:
            bad = non_finite_entries(bias)
            if bad:
                raise NonFiniteBiasError(
                    f"{key} (layer {self.layer_number}'s router) = {bad}; "
                    "allowed: finite values (a corrupt checkpoint: load an earlier one)"
                )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if padding_mask is not None and self.routing_type == "quantile_balancing":
            raise ValueError(
                "--moe-router-load-balancing-type quantile_balancing: Megatron-Core 0.19.2's "
                "per-micro-batch QB cannot skip loss-masked tokens (this batch has some, e.g. "
                "from --eod-mask-loss or pad tokens); use quantile_histogram"
            )
        probs_ME, routing_map_ME = super().routing(logits, padding_mask=padding_mask)
        if self.config.moe_pad_expert_input_to_capacity:
            # the fill up to each expert's capacity (probability 0) is not a load
            self._count(routing_map_ME & (probs_ME != 0), padding_mask)
        else:
            self._count(routing_map_ME, padding_mask)
        return probs_ME, routing_map_ME

    def _apply_expert_bias(
        self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None
    ):
        """Megatron's sign-update load count with the [T] padding mask broadcast over experts."""
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    def _count(self, routing_map_ME: torch.Tensor, padding_mask: torch.Tensor | None) -> None:
        if not (self.training and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            self._count_loads(routing_map_ME, padding_mask)

    def _count_loads(self, routing_map_ME: torch.Tensor, padding_mask: torch.Tensor | None) -> None:
        if padding_mask is None:
            self.step_loads_E += routing_map_ME.sum(dim=0)
            self.step_tokens += routing_map_ME.shape[0]
        else:
            valid_M = ~padding_mask.reshape(-1)
            self.step_loads_E += (routing_map_ME & valid_M[:, None]).sum(dim=0)
            self.step_tokens += valid_M.sum()


class QuantileBalancingRouter(BalanceCountingRouter):
    """Sigmoid top-k router whose ``expert_bias`` is set by Quantile Balancing.

    ``expert_bias`` ([n], fp32, persistent) is Megatron's own buffer name, so distributed
    checkpoints carry it and the HF export maps it to ``gate.e_score_correction_bias``. The
    histogram and the load counters are per-step scratch, kept out of checkpoints.
    """

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False) -> None:
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        n = config.num_moe_experts
        device = megatron_device()
        # TopKRouter leaves ``expert_bias = None`` when Megatron's sign-update bias is off.
        del self.expert_bias
        self.register_buffer("expert_bias", torch.zeros(n, dtype=torch.float32, device=device))
        histogram = (
            CenteredQuantileHistogram if config.moe_qb_binning == "centered" else QuantileHistogram
        )
        # Sync-free: NaN/inf scores are counted on the device and raise at the step-end update,
        # on every rank (balance_step.py).
        self.qb_histogram = histogram(n, self.topk, num_bins=config.moe_qb_num_bins, device=device)
        # Router-weight drift correction (see ``forward``): this step's summed router input
        # (per-step scratch) and, between the step-end solve and the next forward, the global
        # mean input and the scores it had under the weights the bias was solved with.
        self.register_buffer(
            "step_input_sum_D",
            torch.zeros(config.hidden_size, dtype=torch.float32, device=device),
            persistent=False,
        )
        self._drift_ref = None
        # The last step's global mean router input (step end; NaN: not known yet). QB rescoring
        # arms the drift correction at it (training/qb_rescore.py), so a run that rescores keeps
        # it in its checkpoints (a resume inside the rescoring window is then exact); a
        # checkpoint without it still loads (``_load_from_state_dict``: it stays unknown).
        self.register_buffer(
            "qb_mean_input",
            torch.full((config.hidden_size,), float("nan"), dtype=torch.float32, device=device),
            persistent=bool(config.moe_qb_rescore_iters),
        )
        # Set by training/qb_rescore.py around its forward-only pass (no grad): observe, and
        # only observe (no load count, no loss), the scores of the rescored batch.
        self.qb_rescoring = False
        # Set to a list by training/qb_calibrate.py around its forward-only passes (no grad):
        # every micro-batch's fp32 scores and valid-token mask are appended to it.
        self.qb_calibration_scores = None

    _FP32_BUFFERS = BalanceCountingRouter._FP32_BUFFERS + ("step_input_sum_D", "qb_mean_input")

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """Megatron's router forward, after applying a pending drift correction, and summing the
        router input of training tokens (no host sync).

        The step-end solve fits the bias to this step's scores under the weights W_t; the next
        batch is routed under W_{t+1}, after the optimizer step. Early in training the router
        inputs of all tokens become nearly parallel, so the weight update shifts every token's
        score for expert j by about the same amount, as large as the spread of scores across
        tokens, and a bias solved under W_t routes the same tokens under W_{t+1} at MaxVio 11-20
        (measured: benchmarks/BALANCE_RACE.md, "The early spike and the drift correction"). The
        correction moves the bias by that common shift, estimated at the global mean router
        input h (from the step-end all-reduce): ``b_j -= (s_j(h; W_{t+1}) - s_j(h; W_t))``,
        re-centred. It is a function of replicated weights and all-reduced numbers, so every rank
        applies the same one; no batch is routed with a bias computed from itself.
        """
        self._apply_drift_correction()
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                h_MD = input.detach().reshape(-1, input.shape[-1]).float()
                if padding_mask is not None:
                    h_MD = h_MD * (~padding_mask.reshape(-1, 1)).float()
                self.step_input_sum_D += h_MD.sum(dim=0)
        return super().forward(input, padding_mask=padding_mask)

    def _scores_at(self, h_D: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.weight.detach().float() @ h_D)

    @torch.no_grad()
    def set_drift_reference(self) -> None:
        """Remember the last step's mean input (``qb_mean_input``, copied: the next step end
        overwrites it) and its scores under the current weights W_t."""
        mean_input_D = self.qb_mean_input.clone()
        self._drift_ref = (mean_input_D, self._scores_at(mean_input_D))

    @torch.no_grad()
    def _apply_drift_correction(self) -> None:
        if self._drift_ref is None:
            return
        mean_input_D, old_E = self._drift_ref
        self._drift_ref = None
        shift_E = self._scores_at(mean_input_D) - old_E
        self.expert_bias.sub_(shift_E - shift_E.mean())

    def _save_to_state_dict(self, *args, **kwargs):
        self._apply_drift_correction()  # a checkpoint holds the bias the next batch will use
        return super()._save_to_state_dict(*args, **kwargs)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        """``qb_mean_input`` is optional both ways: a checkpoint written without QB rescoring
        lacks it (it stays NaN: unknown), and one written with it loads into a run without."""
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )
        key = prefix + "qb_mean_input"
        if key in missing_keys:
            missing_keys.remove(key)
            self.qb_mean_input.fill_(float("nan"))
        if key in unexpected_keys:
            unexpected_keys.remove(key)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """Return dense ``probs`` [m, n] and the boolean ``routing_map`` [m, n] (SPEC §3)."""
        seq_length, bsz = logits.shape[:2]
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

        valid_M = None if padding_M is None else ~padding_M.bool()
        if self.qb_calibration_scores is not None:
            self.qb_calibration_scores.append((scores_ME.detach().float(), valid_M))
        training = self.training and torch.is_grad_enabled()
        if training or self.qb_rescoring:
            if training and self.is_aux_loss_enabled():
                probs_ME = self._apply_aux_losses(probs_ME, logits_ME, padding_M, seq_length, bsz)
            if training and self.config.moe_qb_absorb_coeff:
                probs_ME = self._apply_absorb_loss(probs_ME, scores_ME, valid_M)
            self.qb_histogram.observe(
                scores_ME.detach().float(), self.expert_bias, valid_M=valid_M, alpha_M=alpha_M
            )
        self._count(routing_map_ME, padding_M)
        return probs_ME, routing_map_ME

    def _apply_absorb_loss(self, probs_ME, scores_ME, valid_M):
        """QB's absorption loss ``-c * sum_j (b_j - mean(b)) * P_j`` (c = ``moe_qb_absorb_coeff``),
        P_j = expert j's mean raw score over the micro-batch's non-padding tokens, the mean taken
        over the tokens of the whole TP x CP group as Megatron's aux losses take it, so every
        layout gives one process's gradient.

        The bias is a constant here; the gradient raises the scores of the experts QB boosts and
        lowers those it holds back, in proportion to the bias. The router thus learns the
        expert-wise offset that QB alone keeps cancelling (left alone it grows: in the balance race
        the expert-wise mean router logit varies across experts by 0.5-0.7 at iteration 300), the
        bias shrinks, and with it the loss's pull: its fixed point is a router whose own top-k is
        balanced. The same work as an aux loss beside QB, from QB's exact bias rather than the
        scores' own top-k counts: no top-k, no host sync, one [m, n] reduction (and the all-reduce
        of one count within the TP x CP group when padding is masked). Measured in the balance
        race (3 seeds, c = 0.3): final loss 0.050 below QB alone, 0.015 above QB + seq_aux_loss 1;
        c = 3 destabilises training (seed 1234: final loss 5.04 against 4.71;
        benchmarks/BALANCE_RACE.md). With the warm-up spike removed (``--moe-qb-rescore-iters 50``)
        c = 1 ends level with the best aux loss (4.629 against 4.624; without rescoring 4.690). At
        d 512 (``k3_sparse_wide.sh``) c = 1 destabilises training (final loss +0.20 above
        ``aux_loss`` with rescoring, +0.9 without, while QB alone is level with it): off by
        default and not in the README's recommended flags."""
        coeff = self.config.moe_qb_absorb_coeff
        if valid_M is None:
            sum_E = scores_ME.sum(dim=0)
            tokens, valid = scores_ME.shape[0] * self.tp_cp_group.size(), None
        else:
            weights_M = valid_M.to(scores_ME.dtype)
            sum_E = weights_M @ scores_ME
            valid = weights_M.sum()
            # a copy: Megatron's all-reduce works in place, and ``valid`` stays the local count
            group_valid = reduce_from_tensor_model_parallel_region(valid.clone(), self.tp_cp_group)
            tokens = group_valid.clamp(min=1)
        bias_E = self.expert_bias - self.expert_bias.mean()
        loss = -coeff * (bias_E.to(sum_E.dtype) * sum_E).sum() / tokens
        return self.attach_and_log_load_balancing_loss(
            probs_ME, coeff, loss, "qb_absorb_loss", self.tp_cp_group, valid_token_count=valid
        )

    def _apply_aux_losses(self, probs_ME, logits_ME, padding_M, seq_length, bsz):
        """The aux losses listed beside ``quantile_histogram`` (e.g. ``quantile_histogram
        seq_aux_loss`` with coefficients ``0 1``), as Megatron's ``TopKRouter.routing`` applies
        them: on the scores' own top-k, without the bias, so they teach the router weights to
        spread the tokens and leave QB less imbalance to cancel."""
        map_ME, scores_ME = compute_routing_scores_for_aux_loss(
            logits_ME, self.topk, self.score_function, padding_mask=padding_M
        )
        padded = padding_M is not None
        probs_ME = self._apply_aux_loss(probs_ME, scores_ME, map_ME, with_padding_mask=padded)
        probs_ME = self._apply_seq_aux_loss(
            probs_ME, scores_ME, map_ME, seq_length, bsz, with_padding_mask=padded
        )
        return self._apply_global_aux_loss(probs_ME, scores_ME, map_ME, with_padding_mask=padded)
