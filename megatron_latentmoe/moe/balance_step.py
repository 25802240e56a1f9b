"""Step-end balance update and metrics (SPEC §4, appendix D), hooked into Megatron's training loop.

``finalize_model_grads_with_quantile_balancing`` is a drop-in ``finalize_model_grads_func``:
Megatron's own training loop (and its pipeline schedules) call it once per step after the last
micro-batch's backward. It runs Megatron's ``finalize_model_grads`` (which applies Megatron's own
sign update / ``quantile_balancing`` step) and then, for ALL load-counting routers of this
pipeline stage at once (``moe/router.py``: every balancing type):

1. packs each QB router's histogram (n·B counts + header) and every router's routed loads (n)
   and token count into ONE integer buffer and all-reduces it (sum) over exactly the ranks that
   hold different tokens: data × context parallel, plus tensor parallel when sequence
   parallelism splits the tokens;
2. every rank solves the same new QB bias from the same global histogram (bit-identical);
3. records the balance metrics of the step that was just routed, and resets the scratch.

The host reads the device once for all layers: the metrics and the QB solves' deferred checks
(``QuantileHistogram.solve_packed``) in one copy; a bias is used once its checks have passed.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads

from megatron_latentmoe.moe.router import BalanceCountingRouter, QuantileBalancingRouter


@dataclass(frozen=True)
class BalanceMetrics:
    """Global-batch load balance of one MoE layer for one step."""

    max_vio: float
    """(max load - mean load) / mean load."""
    min_load: int
    max_load: int
    frac_under_half: float
    """Fraction of experts with less than half the mean load."""
    num_dead: int
    """Experts that received no token (load 0)."""
    num_tokens: int

    @staticmethod
    def stats(loads_E: torch.Tensor, num_tokens: torch.Tensor | int) -> torch.Tensor:
        """The metrics' inputs as one float64 tensor on the loads' device (no host read):
        ``[num_tokens, mean, max, min, experts under half the mean, dead experts]``."""
        loads = loads_E.double()
        mean = loads.mean()
        tokens = torch.as_tensor(num_tokens, dtype=torch.float64, device=loads.device)
        under, dead = (loads < 0.5 * mean).sum(), (loads == 0).sum()
        return torch.stack([tokens, mean, loads.max(), loads.min(), under.double(), dead.double()])

    @classmethod
    def from_stats(cls, values: list[float], num_experts: int) -> BalanceMetrics:
        tokens, mean, hi, lo, under, dead = values
        return cls(
            max_vio=(hi - mean) / mean if mean > 0 else 0.0,
            min_load=int(lo),
            max_load=int(hi),
            frac_under_half=under / num_experts if mean else 0.0,
            num_dead=int(dead),
            num_tokens=int(tokens),
        )

    @classmethod
    def from_loads(cls, loads_E: torch.Tensor, num_tokens: torch.Tensor | int) -> BalanceMetrics:
        return cls.from_stats(cls.stats(loads_E, num_tokens).tolist(), loads_E.numel())


_ROUTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def balance_routers(model_chunks: Iterable[torch.nn.Module]) -> list[BalanceCountingRouter]:
    """The load-counting routers (QB or not) of this pipeline stage in training mode, in a fixed
    order (the same on every rank of a stage). Each chunk's module tree is walked once: a walk
    costs ~1.7 ms per step on the race's model (~600 modules) and grows with experts x layers."""
    out = []
    for chunk in model_chunks:
        routers = _ROUTERS.get(chunk)
        if routers is None:
            routers = [m for m in chunk.modules() if isinstance(m, BalanceCountingRouter)]
            _ROUTERS[chunk] = routers
        out += [r for r in routers if r.training]
    return out


def _token_group(routers: list[BalanceCountingRouter]) -> dist.ProcessGroup | None:
    """The one group the routers' counts are summed over (each router's ``token_group``)."""
    groups = {id(r.token_group): r.token_group for r in routers}
    if len(groups) > 1:
        raise ValueError(
            f"the MoE layers' routers hold {len(groups)} different token-parallel groups "
            "(pg_collection.dp_cp / tp_dp_cp); the step-end balance update needs one"
        )
    return next(iter(groups.values()))


# The mean router input travels in the integer all-reduce as each rank's SUM of router inputs in
# fixed point (x = round(sum * 2**12), resolution 2.4e-4 per token sum), two int32 words per
# feature: lo = x mod 2**16 and hi = floor(x / 2**16). Summed over up to balancing.MAX_RANKS
# (2**15 - 1) ranks (the histogram header's rank count is checked against it), the lo words stay
# below 2**31, and the hi words too: a rank's sum is clamped to +-15 per token (RMS-normed inputs
# sit far inside), so |hi| <= 15/16 of its tokens, and the step's tokens are checked below 2**31
# (balancing.py). Divided by the summed token count, that is the mean over every token routed
# this step, whichever rank routed it, as one process's: the ranks' means averaged put TP2+SP's
# drift-corrected bias 0.80 of a histogram bin off one process's where the sequence-parallel
# halves held 44 and 31 non-padding tokens (now 5e-5: tests/parallel/test_model_parallel.py);
# a rank whose micro-batches were all padding adds 0 to both.
_FIXED_SCALE = 2.0**12
_FIXED_CLAMP = 15.0
_LO = 2**16


def _to_fixed(sum_D: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[2D] int32: the lo words, then the hi words, of ``sum_D`` (``tokens``: the 0-d number of
    tokens summed) in fixed point."""
    bound = _FIXED_CLAMP * tokens.to(torch.float64)
    x = (sum_D.double().clamp(-bound, bound) * _FIXED_SCALE).round().to(torch.int64)
    return torch.cat([torch.remainder(x, _LO), torch.div(x, _LO, rounding_mode="floor")]).to(
        torch.int32
    )


def _from_fixed(words: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[D] float32 mean from the summed words of :func:`_to_fixed` and the summed (0-d) token
    count (0: no token this step, the mean reads 0). No host read."""
    lo, hi = words.to(torch.int64).chunk(2)
    total = (hi * _LO + lo).double()
    return (total / (_FIXED_SCALE * tokens.clamp(min=1).double())).float()


@torch.no_grad()
def update_balance(
    model_chunks: Iterable[torch.nn.Module], drift_correction: bool = True
) -> list[BalanceMetrics]:
    """ONE integer all-reduce for all counting routers of this stage: QB histograms, routed loads
    and token counts, over the routers' ``token_group``; then every QB router solves its new
    bias (SPEC §4); metrics; reset.
    ``drift_correction=False``: the histograms were observed under the weights the next batch is
    routed with (a rescoring pass, training/qb_rescore.py), so no drift correction follows (the
    global mean router input is kept: ``router.qb_mean_input``)."""
    routers = balance_routers(model_chunks)
    if not routers:
        return []
    packed = []
    for r in routers:
        parts = []
        if isinstance(r, QuantileBalancingRouter):
            parts = [r.qb_histogram.pack(), _to_fixed(r.step_input_sum_D, r.step_tokens)]
        # int32 words: a layer's routed copies per expert and its tokens are <= the global
        # tokens per step, which a QB router's histogram checks against 2**31 - 1 (balancing.py);
        # other routers have no such check (their counts would wrap beyond 2**31 - 1 tokens)
        parts += [r.step_loads_E.to(torch.int32), r.step_tokens.view(1).to(torch.int32)]
        packed.append(torch.cat(parts))
    stats, solved = [], []
    for router, part in zip(routers, _sum_over_ranks(packed, _token_group(routers)), strict=True):
        n = router.config.num_moe_experts
        router.last_loads_E = part[-n - 1 : -1].to(torch.int64)
        stats.append(BalanceMetrics.stats(router.last_loads_E, part[-1]))
        if isinstance(router, QuantileBalancingRouter):
            hist_words = part.numel() - n - 1 - 2 * router.step_input_sum_D.numel()
            solved.append(_solve_deferred(router, part[:hist_words]))
            router.qb_mean_input.copy_(_from_fixed(part[hist_words : -n - 1], part[-1]))
            if drift_correction:
                router.set_drift_reference()
        _clear_step_counts(router)
    stats_values, checks = _read_once(torch.stack(stats), solved)  # the one host read
    _apply_solved(solved, checks)
    metrics = []
    for router, values in zip(routers, stats_values, strict=True):
        balance = BalanceMetrics.from_stats(values, router.last_loads_E.numel())
        router.last_balance = balance if balance.num_tokens else None
        if router.last_balance is None:
            router.last_loads_E = None
        else:
            metrics.append(balance)
    return metrics


def _sum_over_ranks(packed: list[torch.Tensor], group) -> tuple[torch.Tensor, ...]:
    """Each router's int32 words summed over ``group`` by ONE all-reduce of their concatenation."""
    buffer = torch.cat(packed)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    return buffer.split([p.numel() for p in packed])


def _solve_deferred(router: QuantileBalancingRouter, words: torch.Tensor):
    """The router's new bias from its all-reduced histogram words (SPEC §4 steps 2-3) and the
    checks to read before using it: ``(router, bias, checks)``, no host read."""
    try:
        bias, checks = router.qb_histogram.solve_packed(words, router.expert_bias)
    except (ValueError, OverflowError) as err:
        raise type(err)(f"QB router of layer {router.layer_number}: {err}") from None
    return router, bias, checks


def _read_once(stats: torch.Tensor | None, solved) -> tuple[list, list[list[int]]]:
    """``stats`` (float64 rows) and every solved router's checks (int64, exact in float64: a
    token total stays far below 2**53) read to the host together: ONE device-to-host copy."""
    parts = [] if stats is None else [stats.flatten()]
    parts += [checks.to(torch.float64) for _, _, checks in solved]
    if not parts:
        return [], []
    values = torch.cat(parts).tolist()
    rows = []
    if stats is not None:
        width = stats.shape[1]
        rows = [values[i * width : (i + 1) * width] for i in range(stats.shape[0])]
        values = values[stats.numel() :]
    checks, start = [], 0
    for _, _, words in solved:
        checks.append([int(v) for v in values[start : start + words.numel()]])
        start += words.numel()
    return rows, checks


def _apply_solved(solved, checks: list[list[int]]) -> None:
    """Each router's new bias, once its checks (host values) pass; raises as ``unpack_`` and
    ``solve`` would, naming the layer."""
    for (router, bias, _), values in zip(solved, checks, strict=True):
        try:
            router.qb_histogram.check_packed(values)
        except (ValueError, OverflowError) as err:
            raise type(err)(f"QB router of layer {router.layer_number}: {err}") from None
        router.expert_bias.copy_(bias)


@torch.no_grad()
def _clear_step_counts(router) -> None:
    """Empty a counting router's per-step scratch: its routed loads and token count and, for QB,
    its histogram and router-input sum (after a step end, and before a re-run pass)."""
    router.step_loads_E.zero_()
    router.step_tokens.zero_()
    if isinstance(router, QuantileBalancingRouter):
        router.qb_histogram.reset()
        router.step_input_sum_D.zero_()


def solve_quantile_bias(model_chunks: Iterable[torch.nn.Module]) -> None:
    """An extra QB solve inside a rescored step (``--moe-qb-rescore-solves S > 1``,
    training/qb_rescore.py): ONE integer all-reduce of the QB routers' histograms only, each
    router's new bias (one host read for all), histograms reset. Loads, token counts and mean
    router inputs stay for the step end (:func:`update_balance`)."""
    routers = [r for r in balance_routers(model_chunks) if isinstance(r, QuantileBalancingRouter)]
    if not routers:
        return
    packed = [r.qb_histogram.pack() for r in routers]
    solved = []
    for router, words in zip(routers, _sum_over_ranks(packed, _token_group(routers)), strict=True):
        solved.append(_solve_deferred(router, words))
        router.qb_histogram.reset()
    _apply_solved(solved, _read_once(None, solved)[1])  # one host read


# What a step end changes that the next step reads: the bias (QB's, Megatron's sign update's),
# Megatron's own QB beta and QB's mean router input; the armed drift correction is kept beside.
_STEP_STATE_BUFFERS = ("expert_bias", "qb_beta", "qb_mean_input")


@torch.no_grad()
def save_step_state(model_chunks: Iterable[torch.nn.Module]) -> list:
    """The routing state an iteration starts from, for :func:`restore_step_state` (copies on the
    device, no host read): each counting router's step-end buffers and armed drift correction."""
    state = []
    for router in balance_routers(model_chunks):
        buffers = {}
        for name in _STEP_STATE_BUFFERS:
            value = getattr(router, name, None)
            if isinstance(value, torch.Tensor):
                buffers[name] = value.clone()
        state.append((router, buffers, getattr(router, "_drift_ref", None)))
    return state


@torch.no_grad()
def restore_step_state(state: list) -> None:
    """Put the routers back as :func:`save_step_state` found them, their per-step scratch
    (histogram, loads, token count, router input sum) empty: the iteration runs again exactly as
    its first pass did (Megatron's rerun state machine, training/rerun_balance.py)."""
    for router, buffers, drift_ref in state:
        for name, value in buffers.items():
            getattr(router, name).copy_(value)
        if isinstance(router, QuantileBalancingRouter):
            router._drift_ref = drift_ref
        _clear_step_counts(router)


def finalize_model_grads_with_quantile_balancing(
    model, num_tokens=None, pg_collection=None, force_all_reduce=False
):
    """Megatron's ``finalize_model_grads`` followed by the step-end balance update."""
    finalize_model_grads(
        model, num_tokens=num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce
    )
    update_balance(model)
