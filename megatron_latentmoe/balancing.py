"""Quantile Balancing math (SPEC §4). Pure PyTorch: this module never imports Megatron.

Notation of SPEC §4 (s, b, ``alpha_i``, ``r_ij = alpha_i - s_ij``, q = m·k/n), ``Q = ceil(q)``.
Suffixes name dimensions (torchtitan-style legend): M tokens (m), E experts (n), K top-k (k),
B bins; so ``scores_ME`` is [m, n] (not "TE": Transformer Engine).

The answer ("the" new bias before mean-centring) is the Q-th smallest r of each column,
``r_(Q),j`` (the lower order statistic, ``torch.kthvalue(r, Q)``). The values that put exactly Q
tokens strictly below them form the interval ``(r_(Q), r_(Q+1)]``; we take its left end, at which
exactly Q tokens satisfy ``r <= b'`` (no ties): Q-1 select the expert strictly and the Q-th sits
exactly on its cutoff. This is the statistic the histogram of SPEC §4 estimates (first bin whose
cumulative count reaches Q), so histogram and exact answers agree within one bin width.
(Megatron-Core's ``qb_dual_update`` takes the right end ``r_(Q+1)``: one token apart.)

Every observed token contributes one r to EVERY expert's row, so each row of the count matrix sums
to the number of observed tokens m: no expert is ever "under-observed"; an empty histogram
(m = 0) returns the bias unchanged, and for tiny m (q < 1, so Q = 1) the answer is the smallest r.

Two binnings, same API and same traffic (n·B int32 + a constant header per layer per step):
``QuantileHistogram`` is SPEC §4's B uniform bins over ``[min b - 1, max b + 1]``;
``CenteredQuantileHistogram`` centres each expert's bins on its current bias (asinh-spaced, still
covering every possible r), several times finer where the answer lies once balancing has settled
(closer to the exact quantile at equal B: measured in ``CenteredQuantileHistogram``).

int32 bound: a cell counts at most the tokens observed in the window, so the all-reduced counts are
exact while the GLOBAL tokens per layer per step <= 2**31 - 1 (~2.1e9; a 64M-token global batch
uses 3% of it). Each rank checks its local total in ``observe`` (sync-free unless near the
bound); the token total travels split in two words, so ``unpack_`` recovers it exactly even when
it exceeds the bound and raises ``OverflowError`` instead of solving from wrapped counts.
"""

from __future__ import annotations

import math

import torch

from megatron_latentmoe.fields import BY_NAME, QB_MAX_CELLS

__all__ = [
    "INT32_MAX",
    "HEADER_FIELDS",
    "MAX_RANKS",
    "QuantileHistogram",
    "CenteredQuantileHistogram",
    "cutoff_route",
    "non_finite_entries",
]

INT32_MAX = 2**31 - 1
# Trailing words of pack(): every word is a sum over the contributing ranks after the all-reduce.
HEADER_FIELDS = (
    "ranks",  # 1 per packed buffer -> number of buffers summed
    "tokens_lo",  # observed tokens mod 2**16
    "tokens_hi",  # observed tokens // 2**16  (exact global total = hi * 2**16 + lo)
    "bad_inputs",  # observe() calls with NaN/inf/out-of-[0,1] input
    "bias_changes",  # observe() calls whose bias differed from the window's
)
_TOKEN_SPLIT = 1 << 16
_DEFAULT_NUM_BINS: int = BY_NAME["moe_qb_num_bins"].default  # B, the config's default
MAX_RANKS = 32767  # keeps every header word of the summed buffer inside int32 (tokens_lo < 2**16)

_SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_BIAS_DTYPES = (torch.float32, torch.float64)


# ----------------------------------------------------------------------------- validation
def non_finite_entries(bias_E: torch.Tensor) -> str | None:
    """``None`` when every entry of an expert bias is finite; else which are not, for an error line
    ("[nan] at expert(s) [3] (1 of 8)"). One host read: for checkpoint loads and conversions,
    never the forward. A NaN bias is every token's top choice (``topk`` ranks NaN first)."""
    bad = torch.nonzero(~torch.isfinite(bias_E.detach().flatten())).flatten().tolist()
    if not bad:
        return None
    values = [bias_E.flatten()[i].item() for i in bad[:4]]
    more = " ..." if len(bad) > 8 else ""
    return f"{values} at expert(s) {bad[:8]}{more} ({len(bad)} of {bias_E.numel()})"


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _check_tensor(name: str, t, ndim: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}.dim()={t.dim()} (shape {tuple(t.shape)}); allowed: {ndim}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}.dtype={t.dtype}; allowed: {_names(dtypes)}")


def _check_scores_bias(scores_ME, bias_E, topk: int, num_experts: int | None = None):
    _check_tensor("scores_ME", scores_ME, 2, _SCORE_DTYPES)
    _check_tensor("bias_E", bias_E, 1, _BIAS_DTYPES)
    n = scores_ME.shape[1]
    if num_experts is not None and n != num_experts:
        raise ValueError(f"scores_ME.shape[1]={n}; allowed: num_experts={num_experts}")
    if bias_E.shape[0] != n:
        raise ValueError(
            f"bias_E.shape={tuple(bias_E.shape)}; allowed: ({n},) = scores_ME.shape[1]"
        )
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk < n:
        raise ValueError(
            f"topk={topk!r}; allowed: int in [1, num_experts-1={n - 1}] (top-(k+1) must exist)"
        )
    if bias_E.device != scores_ME.device:
        raise ValueError(
            f"bias_E.device={bias_E.device}; allowed: scores_ME.device={scores_ME.device}"
        )


def _check_valid(valid_M, m: int, device) -> None:
    if valid_M is None:
        return
    _check_tensor("valid_M", valid_M, 1, (torch.bool,))
    if valid_M.shape[0] != m:
        raise ValueError(
            f"valid_M.shape={tuple(valid_M.shape)}; allowed: ({m},) = scores_ME.shape[0]"
        )
    if valid_M.device != device:
        raise ValueError(f"valid_M.device={valid_M.device}; allowed: scores_ME.device={device}")


# ----------------------------------------------------------------------------- routing helpers
def cutoff_route(
    scores_ME: torch.Tensor, bias_E: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-(k+1) on fp32 ``s + b`` (SPEC §4 step 1): the first k indices [m, k] are the real routes
    (best first), ``alpha_M`` [m] is the (k+1)-th biased score. No validation (hot path)."""
    top = (scores_ME.float() + bias_E.float()).topk(topk + 1, dim=1, sorted=True)
    return top.indices[:, :topk], top.values[:, topk].contiguous()


# ----------------------------------------------------------------------------- histogram
class _QuantileHistogramBase:
    """Shared machinery of the two binnings (SPEC §4, appendix D): window, observe, pack, solve.

    The binning is a function of the bias in force only (fixed for the window, so every rank
    derives the same bins); ``pack()``/``unpack_()`` move the int32 counts [n, B] plus a constant
    header in ONE buffer of ``n*B + len(HEADER_FIELDS)`` words, independent of m.

    ``observe`` is sync-free: bad input (NaN/inf, scores outside [0, 1], a bias other than the
    window's) is counted in device flags that travel in the header and raise in
    ``unpack_``/``solve``, on every rank. Every rank bins with the bias in force, which the
    step-end solve made identical on all of them, so no cross-rank bias check is needed.
    """

    def __init__(self, num_experts: int, topk: int, num_bins: int = _DEFAULT_NUM_BINS, device=None):
        for name, v, low in (("num_experts", num_experts, 2), ("num_bins", num_bins, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name}={v!r}; allowed: int >= {low}")
        if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk < num_experts:
            raise ValueError(f"topk={topk!r}; allowed: int in [1, num_experts-1={num_experts - 1}]")
        if num_experts * num_bins > QB_MAX_CELLS:
            raise ValueError(
                f"num_experts*num_bins={num_experts * num_bins}; allowed: <= {QB_MAX_CELLS}"
            )
        self.num_experts, self.topk, self.num_bins = num_experts, topk, num_bins
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self.counts = torch.zeros(num_experts, num_bins, dtype=torch.int32, device=self._device)
        self._num_tokens = torch.zeros((), dtype=torch.int64, device=self._device)
        self._flags = torch.zeros(2, dtype=torch.int64, device=self._device)  # bad, bias changes
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Start a new accumulation window (call after the step-end ``solve``)."""
        self.counts.zero_()
        self._num_tokens.zero_()
        self._flags.zero_()
        self._token_bound = 0  # python upper bound on local tokens (sync-free overflow check)
        self._bias_E: torch.Tensor | None = None  # fp32 copy of the bias in force
        self._range = None  # window-fixed parameters of the binning
        self._reduced = None  # header sums after unpack_()

    @property
    def num_tokens(self) -> torch.Tensor:
        """Observed (after ``unpack_``: global) tokens, 0-d int64; each counts row sums to it."""
        return self._num_tokens

    @property
    def packed_numel(self) -> int:
        """Words in ``pack()``: ``n*B + len(HEADER_FIELDS)`` (independent of m)."""
        return self.num_experts * self.num_bins + len(HEADER_FIELDS)

    # ------------------------------------------------------------------ binning (per subclass)
    def _make_range(self, bias32_E: torch.Tensor):
        """Window-fixed binning parameters, a function of the bias only."""
        raise NotImplementedError

    def _bin_index_(self, r_ME: torch.Tensor) -> torch.Tensor:
        """Float (integer-valued) bin index in [0, B-1] of each r, computed in place on ``r_ME``."""
        raise NotImplementedError

    def _bounds(self, c_E: torch.Tensor):
        raise NotImplementedError

    def _finite_clamp_(self, idx: torch.Tensor) -> torch.Tensor:
        idx.nan_to_num_(nan=0.0, posinf=self.num_bins - 1.0, neginf=0.0)  # NaN is flagged apart
        return idx.clamp_(0.0, self.num_bins - 1.0)

    # ------------------------------------------------------------------ observe
    def _check_device(self, device: torch.device, name: str) -> None:
        if device != self._device:
            raise ValueError(f"{name}.device={device}; allowed: histogram device {self._device}")

    def _open_or_check_window(self, bias32: torch.Tensor) -> None:
        if self._bias_E is None:
            self._bias_E = bias32.detach().clone()
            self._range = self._make_range(self._bias_E)
            return
        self._flags[1] += (bias32 != self._bias_E).any().to(torch.int64)

    def observe(
        self,
        scores_ME: torch.Tensor,
        bias_E: torch.Tensor,
        valid_M: torch.Tensor | None = None,
        *,
        alpha_M: torch.Tensor | None = None,
    ) -> None:
        """Add one micro-batch (SPEC §4): cutoffs by top-(k+1) of fp32 ``s + b``, then one
        scatter-add of every ``r_ij = alpha_i - s_ij`` into ``counts``. ``valid_M`` masks padding;
        ``alpha_M`` may pass the cutoffs the router already computed (see ``cutoff_route``)."""
        if self._reduced is not None:
            raise ValueError("observe() after unpack_(); allowed: reset() first")
        _check_scores_bias(scores_ME, bias_E, self.topk, self.num_experts)
        m = scores_ME.shape[0]
        _check_valid(valid_M, m, scores_ME.device)
        if alpha_M is not None:
            _check_tensor("alpha_M", alpha_M, 1, (torch.float32,))
            if alpha_M.shape[0] != m or alpha_M.device != scores_ME.device:
                raise ValueError(
                    f"alpha_M.shape={tuple(alpha_M.shape)} on {alpha_M.device}; "
                    f"allowed: ({m},) on {scores_ME.device}"
                )
        self._check_device(scores_ME.device, "scores_ME")
        s32 = scores_ME.detach().float()
        b32 = bias_E.detach().float()
        # One pass over the scores: NaN propagates through min / max and fails both
        # comparisons, +-inf fails one (2 boolean passes cost 30x more at [1024, 128] on CPU).
        lo, hi = s32.aminmax() if m else (s32.new_zeros(()), s32.new_zeros(()))
        bad = ~((lo >= 0) & (hi <= 1)) | ~torch.isfinite(b32).all()
        self._flags[0] += bad.to(torch.int64)
        self._open_or_check_window(b32)
        if m == 0:
            return
        # Local overflow guard: python upper bound first, exact (syncing) check only near 2**31.
        self._token_bound += m
        if self._token_bound > INT32_MAX:
            extra = m if valid_M is None else int(valid_M.sum())
            if int(self._num_tokens) + extra > INT32_MAX:
                raise OverflowError(
                    f"local tokens in this window would reach {int(self._num_tokens) + extra}; "
                    f"allowed: <= 2**31-1 (int32 counts); solve and reset more often"
                )
        if alpha_M is None:
            _, alpha_M = cutoff_route(s32, b32, self.topk)
        idx_ME = self._finite_clamp_(self._bin_index_(alpha_M[:, None] - s32))  # fp32, in [0, B-1]
        # Expert-major bins, scattered along each expert's row; a token's weight (1, or 0 for
        # padding) broadcast over the experts, never materialised.
        idx_EM = idx_ME.t().to(torch.int64, memory_format=torch.contiguous_format)
        if valid_M is None:
            weight_M = torch.ones((), dtype=torch.int32, device=s32.device).expand(m)
            self._num_tokens += m
        else:
            weight_M = valid_M.to(torch.int32)
            self._num_tokens += valid_M.sum()
        self.counts.scatter_add_(1, idx_EM, weight_M.expand(self.num_experts, m))

    # ------------------------------------------------------------------ communication
    def pack(self) -> torch.Tensor:
        """1-D int32 ``[counts.flatten() (n*B), header (len(HEADER_FIELDS))]`` to be SUM-all-reduced
        over the ranks that saw different tokens (``balance_step`` concatenates all layers)."""
        if self._reduced is not None:
            raise ValueError("pack() after unpack_(); allowed: reset() first")
        dev = self._device
        tok = self._num_tokens
        header = torch.stack(
            [
                torch.ones((), dtype=torch.int64, device=dev),
                tok % _TOKEN_SPLIT,
                tok // _TOKEN_SPLIT,
                self._flags[0],
                self._flags[1],
            ]
        ).to(torch.int32)
        return torch.cat([self.counts.view(-1), header])

    def _check_buffer(self, buffer: torch.Tensor) -> None:
        _check_tensor("buffer", buffer, 1, (torch.int32,))
        if buffer.numel() != self.packed_numel:
            raise ValueError(
                f"buffer.numel()={buffer.numel()}; allowed: packed_numel={self.packed_numel}"
            )
        self._check_device(buffer.device, "buffer")

    def unpack_(self, buffer: torch.Tensor) -> None:
        """Load an all-reduced ``pack()`` buffer: counts and token total become global (two host
        reads: the header, then the row check; the training step end uses :meth:`solve_packed`,
        which reads nothing). Raises on overflow, corruption (rows must sum to the token total),
        or flagged bad input."""
        self._check_buffer(buffer)
        nb_cells = self.num_experts * self.num_bins
        head = dict(zip(HEADER_FIELDS, buffer[nb_cells:].tolist(), strict=True))
        tokens = _checked_header(head)
        counts = buffer[:nb_cells].view(self.num_experts, self.num_bins)
        if not bool((counts.sum(dim=1, dtype=torch.int64) == tokens).all()):
            raise ValueError(_ROWS_ERROR)
        self.counts.copy_(counts)
        self._num_tokens.fill_(tokens)
        self._reduced = head

    # ------------------------------------------------------------------ solve
    def _solve_bias32(self, bias_E: torch.Tensor) -> torch.Tensor:
        """``bias_E`` (shape, dtype and device checked: no host read) as fp32."""
        _check_tensor("bias_E", bias_E, 1, _BIAS_DTYPES)
        if bias_E.shape[0] != self.num_experts:
            raise ValueError(f"bias_E.shape={tuple(bias_E.shape)}; allowed: ({self.num_experts},)")
        if bias_E.device != self._device:
            raise ValueError(f"bias_E.device={bias_E.device}; allowed: {self._device}")
        return bias_E.detach().float()

    def _check_solve_bias(self, bias_E: torch.Tensor) -> torch.Tensor:
        b32 = self._solve_bias32(bias_E)
        if not bool(torch.isfinite(b32).all()):
            raise ValueError(_NONFINITE_BIAS_ERROR)
        if self._bias_E is not None and not torch.equal(b32, self._bias_E):
            raise ValueError(_CHANGED_BIAS_ERROR)
        if self._reduced is None and int(self._flags.sum()) > 0:
            f = self._flags.tolist()
            raise ValueError(
                f"{f[0]} observe() calls had bad input, {f[1]} changed the bias (deferred checks)"
            )
        return b32

    def raw_quantiles(self, bias_E: torch.Tensor) -> torch.Tensor:
        """Per-expert histogram estimate of the Q-th smallest r (fp32, NOT mean-centred)."""
        b32 = self._check_solve_bias(bias_E)
        return self._quantiles(self.counts, self._num_tokens, b32)

    def _quantiles(self, counts_EB, tokens, b32):
        """The raw quantiles from ``counts_EB`` [n, B] int32 and the 0-d int64 token total ``m``
        (``b32`` itself where m = 0). Tensor ops only: no host read."""
        if self._range is None:  # a rank that only unpacked: the range follows from the bias
            self._range = self._make_range(b32)
        big_q = (tokens * self.topk + self.num_experts - 1) // self.num_experts  # ceil(q), exact
        # int32 is exact: a row sums to m <= 2**31-1 (observe / unpack_ check it). No int64 copy
        # of the counts and no [n, B] mask (on one CPU thread at n=128, B=1000: 0.2-0.35 ms a
        # solve instead of 0.25-1.4, the same bias bit for bit).
        cum_EB = counts_EB.cumsum(dim=1, dtype=torch.int32)
        big_q_E1 = big_q.to(torch.int32).expand(self.num_experts, 1).contiguous()
        c_E = torch.searchsorted(cum_EB, big_q_E1).squeeze(1)  # first bin with cum >= Q
        c_E.clamp_(max=self.num_bins - 1)
        in_bin_E = counts_EB.gather(1, c_E[:, None]).squeeze(1).to(torch.int64)
        before_E = cum_EB.gather(1, c_E[:, None]).squeeze(1).to(torch.int64) - in_bin_E
        frac_E = (
            ((big_q - before_E).double() / in_bin_E.clamp(min=1).double()).clamp_(0.0, 1.0).float()
        )
        edge_E, width_E = self._bounds(c_E)
        return torch.where(tokens == 0, b32, edge_E + frac_E * width_E)

    @staticmethod
    def _centred(q_E, tokens):
        """The new bias: ``q_E`` minus its mean; an empty histogram leaves the bias unchanged."""
        return torch.where(tokens == 0, q_E, q_E - q_E.mean())

    def solve(self, bias_E: torch.Tensor) -> torch.Tensor:
        """New bias (SPEC §4 steps 2-3): histogram quantile per expert, minus the mean; fp32 [n].
        Empty histogram -> ``bias_E`` unchanged. Call ``reset()`` afterwards."""
        return self._centred(self.raw_quantiles(bias_E), self._num_tokens)

    # ------------------------------------------------------------------ step end, deferred checks
    def solve_packed(
        self, buffer: torch.Tensor, bias_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``unpack_(buffer)`` then ``solve(bias_E)`` without a host read: the new bias (fp32
        [n]) and the checks (int64 [``len(HEADER_FIELDS) + 3``]: the header words, then counts
        rows not summing to the token total, a non-finite bias, a bias other than the window's)
        that ``unpack_`` and ``solve`` make eagerly. The caller reads the checks (with whatever
        else it reads at the step end) and passes them to :meth:`check_packed` before using the
        bias. The histogram itself is left as it was (``reset()`` it afterwards)."""
        if self._reduced is not None:
            raise ValueError("solve_packed() after unpack_(); allowed: reset() first")
        self._check_buffer(buffer)
        b32 = self._solve_bias32(bias_E)
        nb_cells = self.num_experts * self.num_bins
        head = buffer[nb_cells:].to(torch.int64)
        tokens = head[HEADER_FIELDS.index("tokens_hi")] * _TOKEN_SPLIT
        tokens = tokens + head[HEADER_FIELDS.index("tokens_lo")]
        counts_EB = buffer[:nb_cells].view(self.num_experts, self.num_bins)
        rows_bad = (counts_EB.sum(dim=1, dtype=torch.int64) != tokens).any()
        nonfinite = ~torch.isfinite(b32).all()
        changed = (
            (b32 != self._bias_E).any() if self._bias_E is not None else rows_bad.new_zeros(())
        )
        checks = torch.cat([head, torch.stack([rows_bad, nonfinite, changed]).to(torch.int64)])
        return self._centred(self._quantiles(counts_EB, tokens, b32), tokens), checks

    @staticmethod
    def check_packed(checks: list[int]) -> None:
        """Raise what ``unpack_`` and ``solve`` would have raised, from the host values of
        :meth:`solve_packed`'s checks."""
        n_head = len(HEADER_FIELDS)
        _checked_header(dict(zip(HEADER_FIELDS, checks[:n_head], strict=True)))
        rows_bad, nonfinite, changed = checks[n_head:]
        if rows_bad:
            raise ValueError(_ROWS_ERROR)
        if nonfinite:
            raise ValueError(_NONFINITE_BIAS_ERROR)
        if changed:
            raise ValueError(_CHANGED_BIAS_ERROR)


_ROWS_ERROR = "every counts row must sum to the token total; buffer is corrupt or misaligned"
_NONFINITE_BIAS_ERROR = "bias_E contains NaN or inf; allowed: finite values"
_CHANGED_BIAS_ERROR = (
    "bias_E differs from the bias of the accumulation window; allowed: the same bias"
)


def _checked_header(head: dict) -> int:
    """The global token total of an all-reduced header (host values); raises on a bad rank
    count, an int32 overflow or flagged bad input."""
    if not 1 <= head["ranks"] <= MAX_RANKS:
        raise ValueError(f"buffer header {head}; allowed: 1 <= ranks <= {MAX_RANKS}")
    tokens = head["tokens_hi"] * _TOKEN_SPLIT + head["tokens_lo"]
    if tokens > INT32_MAX:
        raise OverflowError(
            f"global tokens this step = {tokens}; allowed: <= 2**31-1 (int32 counts wrapped); "
            "use fewer tokens per step"
        )
    if head["bad_inputs"] or head["bias_changes"]:
        raise ValueError(
            f"{head['bad_inputs']} observe() calls had NaN/inf or scores outside [0, 1], "
            f"{head['bias_changes']} used a bias other than the window's (deferred checks)"
        )
    return tokens


class QuantileHistogram(_QuantileHistogramBase):
    """SPEC §4 histogram: B uniform bins over ``[min(b) - 1, max(b) + 1]`` (the range that holds
    every r, SPEC §4); the estimate is within one bin width of ``exact_quantiles``."""

    def _make_range(self, bias32_E):
        lo = bias32_E.min() - 1.0
        hi = bias32_E.max() + 1.0
        return lo, self.num_bins / (hi - lo), (hi - lo) / self.num_bins

    def _bin_index_(self, r_ME):
        lo, inv_w, _ = self._range
        return r_ME.sub_(lo).mul_(inv_w).floor_()

    def _bounds(self, c_E):
        lo, _, width = self._range
        return lo + c_E.float() * width, width.expand(c_E.shape).clone()


class CenteredQuantileHistogram(_QuantileHistogramBase):
    """Same API and traffic as ``QuantileHistogram``; bins centred on each expert's bias in force.

    Expert j's B bins (B even) are uniform in ``u = asinh((r - b_j) / sigma)`` over ``[-U, U]``,
    ``U = asinh((max b - min b + 1) / sigma)``: they still cover every possible r (no overflow bin,
    no lost information) but are finest where the answer lies once balancing has settled, near
    the current ``b_j`` (width ``~ 2 sigma U / B``, about 10-20x finer than the uniform bins),
    and coarser far away (a few x, only during the first steps from a bad start). ``b_j`` is a bin
    edge, so the atom of tokens whose (k+1)-th choice is j (``r_ij = b_j`` in exact arithmetic;
    ``fl(fl(s + b) - s)`` may miss ``b_j`` by an ulp and put some of them one bin lower, within
    a bin of the answer) starts a bin.
    Every rank derives the bins from the bias alone.

    Measured (benchmarks/bench_balancing.py, benchmarks/results/bench_balancing.json: 896 experts
    top-16, 4032 tokens a step, 50 drifting steps; mean over experts of |bias - the exact Q-th
    smallest r| every 5 steps): ~6x closer to the exact quantile than the uniform bins at equal
    B, 1.06e-4 against 6.63e-4 at B = 1000 (4.3x at 250, 8.0x at 4000). The other mentions of
    this figure (``--moe-qb-binning``'s help, the README) point here.
    """

    def __init__(
        self,
        num_experts: int,
        topk: int,
        num_bins: int = _DEFAULT_NUM_BINS,
        device=None,
        *,
        sigma: float = 0.005,
    ):
        if isinstance(num_bins, int) and num_bins % 2:
            raise ValueError(f"num_bins={num_bins!r}; allowed: even int >= 2")
        if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and 0 < sigma <= 1):
            raise ValueError(f"sigma={sigma!r}; allowed: float in (0, 1]")
        self.sigma = float(sigma)
        super().__init__(num_experts, topk, num_bins, device)

    def _make_range(self, bias32_E):
        u_max = torch.asinh((bias32_E.max() - bias32_E.min() + 1.0) / self.sigma)
        return bias32_E.clone(), self.num_bins / (2.0 * u_max), 2.0 * u_max / self.num_bins

    def _bin_index_(self, r_ME):
        centre_E, inv_du, _ = self._range
        y_ME = r_ME.sub_(centre_E).mul_(1.0 / self.sigma)
        # asinh(y) = sign(y) log(|y| + sqrt(y^2 + 1)), within 5e-7 of torch.asinh (bins are
        # ~0.02 wide in u). torch.asinh is elementwise scalar code on CPU: 1.1-4.0 ms at [1024, 128]
        # against 0.4-0.6 ms for this form (torch.asinh was the largest part of QB's cost per step).
        a_ME = y_ME.abs()
        u_ME = a_ME.mul(a_ME).add_(1.0).sqrt_().add_(a_ME).log_().copysign_(y_ME)
        return u_ME.mul_(inv_du).floor_().add_(self.num_bins // 2)

    def _bounds(self, c_E):
        centre_E, _, du = self._range
        u_lo = (c_E.double() - self.num_bins // 2) * du.double()
        lower = centre_E.double() + self.sigma * torch.sinh(u_lo)
        upper = centre_E.double() + self.sigma * torch.sinh(u_lo + du.double())
        return lower.float(), (upper - lower).float()
