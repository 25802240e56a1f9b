"""Quantile Balancing math (SPEC §4): histogram vs exact, coordinate descent, convergence,
additivity / pack-unpack (the distributed test reuses these properties), masking, errors."""

import copy
import math

import pytest
import torch

from megatron_latentmoe.balancing import (
    HEADER_FIELDS,
    INT32_MAX,
    CenteredQuantileHistogram,
    QuantileHistogram,
    cutoff_route,
)
from megatron_latentmoe.balancing_reference import (
    exact_quantile_bias,
    exact_quantiles,
    max_violation,
    sign_update_bias,
    topk_loads,
)

HIST_CLASSES = [QuantileHistogram, CenteredQuantileHistogram]


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def router_scores(m, n, seed, d=16, gain=0.8, spread=0.5):
    """Sigmoid scores of a small random linear router with per-expert popularity offsets."""
    g = gen(seed)
    w = torch.randn(d, n, generator=g)
    x = torch.randn(m, d, generator=g)
    return torch.sigmoid(gain * x @ w / math.sqrt(d) + spread * torch.randn(n, generator=g) - 1.0)


def r_matrix(scores, bias, k):
    _, alpha = cutoff_route(scores, bias, k)
    return alpha[:, None] - scores.float()


def _binning(hist, bias):
    """A shallow copy of ``hist`` binning under ``bias`` (the binning is a function of the bias
    only): reading bins leaves ``hist``'s open window as it was."""
    probe = copy.copy(hist)
    probe._range = probe._make_range(bias.float())
    return probe


def bin_index(hist, r_ME, bias):
    """int64 bin of each ``r_ME`` [m, n] under ``bias``'s binning, as ``observe`` bins."""
    probe = _binning(hist, bias)
    return probe._finite_clamp_(probe._bin_index_(r_ME.float().clone())).to(torch.int64)


def bin_bounds(hist, c_E, bias):
    """(lower edge, width) [n] fp32 of bin ``c_E[j]`` of each expert j under ``bias``'s binning."""
    return _binning(hist, bias)._bounds(c_E)


def assert_within_one_bin(hist, scores, bias, k):
    """|histogram estimate - exact Q-th smallest r| <= width of the bin holding the exact answer."""
    est = hist.raw_quantiles(bias)
    ref = exact_quantiles(scores, bias, k)
    c_ref = bin_index(hist, ref[None, :], bias)[0]
    _, width = bin_bounds(hist, c_ref, bias)
    err = (est - ref).abs()
    assert torch.isfinite(est).all()
    assert bool((err <= width * (1 + 1e-3) + 1e-6).all()), (err / width).max().item()
    # centred outputs: each side shifts by its own mean, so at most two bin widths apart
    diff = hist.solve(bias) - exact_quantile_bias(scores, bias, k)
    assert diff.abs().max().item() <= 2 * width.max().item() * (1 + 1e-3) + 1e-6
    return err, width


# ----------------------------------------------------------------------------- one bin width
@pytest.mark.parametrize("cls", HIST_CLASSES)
@pytest.mark.parametrize(
    "m,n,k,seed",
    [
        (1000, 896, 16, 0),
        (333, 896, 16, 1),
        (37, 4, 1, 2),
        (1001, 64, 4, 3),
        (1, 8, 2, 4),
        (5, 896, 16, 5),
    ],
)
def test_histogram_within_one_bin_random(cls, m, n, k, seed):
    assert (m * k) % n != 0 or m == 1000  # mostly non-divisible m·k
    g = gen(seed)
    scores = router_scores(m, n, seed)
    bias = 0.3 * torch.randn(n, generator=g)
    h = cls(n, k, 1000)
    h.observe(scores, bias)
    err, width = assert_within_one_bin(h, scores, bias, k)
    if cls is QuantileHistogram:
        w = (bias.max() - bias.min() + 2).item() / 1000
        assert torch.allclose(width, torch.full_like(width, w), rtol=1e-5)
        assert err.max().item() <= w * 1.001


@pytest.mark.parametrize("cls", HIST_CLASSES)
@pytest.mark.parametrize("m,n,k,seed", [(1000, 896, 16, 0), (1001, 64, 4, 3), (4000, 64, 4, 8)])
def test_quantile_is_read_by_linear_interpolation_inside_the_bin(cls, m, n, k, seed):
    """SPEC §4 / appendix D: the first bin whose cumulative count reaches Q = ceil(m k / n), then
    edge + (Q - count before the bin) / count in the bin x width. Recomputed here per expert from
    the counts and the bin edges; a reader that returns any other point of the bin fails."""
    scores = router_scores(m, n, seed)
    bias = 0.3 * torch.randn(n, generator=gen(seed))
    h = cls(n, k, 1000)
    h.observe(scores, bias)
    big_q = -(-m * k // n)
    expected = []
    for j in range(n):
        row = h.counts[j].tolist()
        before = 0
        for c, count in enumerate(row):  # noqa: B007 (c, the bin at the break, is used below)
            if before + count >= big_q:
                break
            before += count
        edge, width = bin_bounds(h, torch.tensor([c] * n), bias)
        expected.append(edge[j].item() + (big_q - before) / count * width[j].item())
    got = h.raw_quantiles(bias)
    assert torch.allclose(
        got.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6
    )
    # and interpolation is what brings the estimate close: a third of a bin on average
    _, width = assert_within_one_bin(h, scores, bias, k)
    err = (got - exact_quantiles(scores, bias, k)).abs()
    assert (err / width).mean().item() < 0.4


def adversarial_cases():
    g = gen(7)
    out = {}
    # ties: scores on a 5-level grid -> many identical r
    out["ties"] = ((torch.randint(0, 5, (777, 896), generator=g).float() / 4.0), 896, 16)
    # every token prefers expert 0 (and all others nearly indifferent)
    s = 0.2 + 0.01 * torch.rand(500, 64, generator=g)
    s[:, 0] = 0.99
    out["one_expert"] = (s, 64, 4)
    # all scores identical
    out["constant"] = (torch.full((123, 896), 0.5), 896, 16)
    # tiny n
    out["tiny"] = (torch.rand(11, 4, generator=g), 4, 1)
    # saturated sigmoid (exact 0 and 1) in bf16, a handful preferred by every token
    s = torch.rand(999, 896, generator=g) * 0.3
    s[:, :5] = 1.0
    s[:3] = 0.0
    out["saturated_bf16"] = (s.bfloat16(), 896, 16)
    return out


@pytest.mark.parametrize("cls", HIST_CLASSES)
@pytest.mark.parametrize("case", list(adversarial_cases()))
@pytest.mark.parametrize("bias_kind", ["zero", "spread"])
def test_histogram_within_one_bin_adversarial(cls, case, bias_kind):
    scores, n, k = adversarial_cases()[case]
    bias = torch.zeros(n) if bias_kind == "zero" else 0.7 * torch.randn(n, generator=gen(3))
    h = cls(n, k, 1000)
    h.observe(scores, bias)
    assert_within_one_bin(h, scores, bias, k)


def test_centred_bins_are_asinh_bins():
    """The centred binning computes asinh as log(|y| + sqrt(y^2 + 1)) with the sign of y (faster
    on CPU): every r gets torch.asinh's bin unless it lies within 1e-4 of a bin edge, over
    |r - b| from 0 (the atom at b_j: first bin above the middle) to far outside [-1, 1]."""
    n, nb, sigma = 3, 1000, 0.005
    bias = torch.tensor([-0.3, 0.0, 0.3])
    h = CenteredQuantileHistogram(n, 1, nb, sigma=sigma)
    offsets = torch.cat([-torch.logspace(-6, 1, 4001).flip(0), torch.zeros(1)])
    offsets = torch.cat([offsets, -offsets.flip(0)[1:]])
    r_ME = bias + offsets[:, None]
    u_max = math.asinh((0.6 + 1.0) / sigma)
    u_bins = torch.asinh(((r_ME - bias) / sigma).double()) * (nb / (2 * u_max))
    ref = (u_bins.floor() + nb // 2).clamp(0, nb - 1).long()
    clear = (u_bins - u_bins.round()).abs() > 1e-4
    got = bin_index(h, r_ME, bias)
    assert clear.float().mean() > 0.99
    assert bool((got[clear] == ref[clear]).all())
    assert bool((got[offsets == 0] == nb // 2).all())


def test_exact_order_statistic_definition():
    """exact = Q-th smallest r: Q-1 strictly below (no ties), >= Q at or below, Q = ceil(mk/n)."""
    m, n, k = 333, 896, 16
    scores = router_scores(m, n, 11)
    bias = 0.1 * torch.randn(n, generator=gen(11))
    r = r_matrix(scores, bias, k)
    big_q = math.ceil(m * k / n)
    assert big_q == 6  # 333*16/896 = 5.95
    ref = exact_quantiles(scores, bias, k)
    below = (r < ref).sum(0)
    at_or_below = (r <= ref).sum(0)
    assert int(below.max()) <= big_q - 1
    assert int(at_or_below.min()) >= big_q
    # Megatron-Core's qb_dual_update takes the next one, r_(Q+1): exactly Q strictly below.
    nxt = r.sort(0).values[big_q]
    assert bool((nxt >= ref).all())


# ----------------------------------------------------------------------------- coordinate descent
@pytest.mark.parametrize("cls", HIST_CLASSES)
def test_coordinate_descent_property(cls):
    """With this batch's alpha fixed, #(r_j < b'_j) = Q up to the tokens inside one bin."""
    m, n, k = 4000, 896, 16
    scores = router_scores(m, n, 21)
    bias = 0.2 * torch.randn(n, generator=gen(21))
    h = cls(n, k, 1000)
    for part in scores.split(1000):
        h.observe(part, bias)
    new = h.raw_quantiles(bias)
    r = r_matrix(scores, bias, k)
    big_q = math.ceil(m * k / n)
    below = (r < new).sum(0)
    cum = h.counts.cumsum(1)
    c = (cum < big_q).sum(1)
    in_bin = h.counts.gather(1, c[:, None]).squeeze(1)
    dev = (below - big_q).abs()
    assert bool((dev <= in_bin).all()), (dev - in_bin).max()
    # and the exact answer satisfies it to the token (ties at the answer aside)
    ref = exact_quantiles(scores, bias, k)
    assert int((r < ref).sum(0).max()) <= big_q - 1 and int((r <= ref).sum(0).min()) >= big_q
    # the bins are fine enough that the typical miss is a small part of the target load q
    assert dev.double().mean().item() < 0.1 * m * k / n


# ----------------------------------------------------------------------------- convergence
def _stationary_run(update, scores, k, steps):
    n = scores.shape[1]
    b, out = torch.zeros(n), []
    for _ in range(steps):
        out.append(max_violation(topk_loads(scores, b, k)))
        b = update(scores, b)
        assert torch.isfinite(b).all()
    out.append(max_violation(topk_loads(scores, b, k)))
    return out, b


def _hist_update(cls, k):
    def upd(s, b):
        h = cls(s.shape[1], k, 1000)
        h.observe(s, b)
        upd.last = h
        return h.solve(b)

    return upd


def test_stationary_batch_reaches_exact_level():
    """Repeated updates on one batch: histogram MaxVio goes to the exact level, up to one bin of
    tokens."""
    m, n, k = 3000, 64, 4
    g = gen(1)
    w, x = torch.randn(16, n, generator=g), torch.randn(m, 16, generator=g)
    scores = torch.sigmoid(x @ w * 0.5 + torch.randn(n, generator=g) - 1)
    mean_load = m * k / n
    exact, _ = _stationary_run(lambda s, b: exact_quantile_bias(s, b, k), scores, k, 20)
    assert exact[0] > 4.0 and exact[-1] < 0.03
    for cls in HIST_CLASSES:
        upd = _hist_update(cls, k)
        mv, b = _stationary_run(upd, scores, k, 20)
        h = upd.last
        big_q = math.ceil(m * k / n)
        c = (h.counts.cumsum(1) < big_q).sum(1)
        bin_tokens = h.counts.gather(1, c[:, None]).max().item()
        assert mv[3] < 0.3  # a few steps from MaxVio 5
        bound = exact[-1] + bin_tokens / mean_load + 1e-9
        assert mv[-1] <= bound, (cls.__name__, mv[-1], exact[-1], bin_tokens)
        if (
            cls is CenteredQuantileHistogram
        ):  # finer bins near the bias: reaches the exact level itself
            assert mv[-1] <= exact[-1] + 1e-9
            centred_final = mv[-1]
        else:
            uniform_final = mv[-1]
    assert centred_final < uniform_final


def _pathological(m, n, g):
    s = torch.rand(m, n, generator=g) * 0.6
    s[:, :4] = 0.9 + 0.1 * torch.rand(m, 4, generator=g)  # 4 experts preferred by every token
    return s


@pytest.mark.parametrize("method", ["uniform", "centred", "sign"])
def test_pathological_start_qb_vs_sign(method):
    """From 4 experts taking every token (MaxVio 15), QB is below 1 after one step; sign needs
    hundreds."""
    m, n, k = 2048, 64, 4
    g = gen(5)
    b, mvs = torch.zeros(n), []
    steps = 400 if method == "sign" else 5
    for _ in range(steps):
        s = _pathological(m, n, g)  # next step's batch: fresh tokens, same distribution
        loads = topk_loads(s, b, k)
        mvs.append(max_violation(loads))
        if method == "sign":
            b = sign_update_bias(loads, b, 1e-3)
        else:
            h = (QuantileHistogram if method == "uniform" else CenteredQuantileHistogram)(n, k)
            h.observe(s, b)
            b = h.solve(b)
    assert mvs[0] == pytest.approx(n / k - 1)
    first_below_1 = next((i for i, v in enumerate(mvs) if v < 1), None)
    if method == "sign":
        assert first_below_1 is not None and first_below_1 >= 150, first_below_1
    else:
        assert first_below_1 == 1 and max(mvs[1:]) < 1.0 and mvs[-1] < 0.4


# ----------------------------------------------------------------------------- additivity, packing
@pytest.mark.parametrize("cls", HIST_CLASSES)
def test_counts_additive_over_micro_batches(cls):
    m, n, k = 1500, 896, 16
    scores = router_scores(m, n, 31)
    bias = 0.2 * torch.randn(n, generator=gen(31))
    whole = cls(n, k)
    whole.observe(scores, bias)
    pieces = cls(n, k)
    for part in torch.split(scores, [1, 499, 700, 300]):
        pieces.observe(part, bias)
    assert pieces.counts.dtype == torch.int32 and pieces.counts.shape == (n, 1000)
    assert torch.equal(whole.counts, pieces.counts)
    assert int(pieces.num_tokens) == m
    assert bool((pieces.counts.sum(1) == m).all())  # one r per token in every expert's row
    assert torch.equal(whole.solve(bias), pieces.solve(bias))


@pytest.mark.parametrize("cls", HIST_CLASSES)
def test_pack_unpack_and_two_rank_sum(cls):
    n, k, nb = 128, 8, 500
    s_a, s_b = router_scores(700, n, 41), router_scores(555, n, 42)
    bias = 0.3 * torch.randn(n, generator=gen(41))
    rank_a, rank_b, union = cls(n, k, nb), cls(n, k, nb), cls(n, k, nb)
    rank_a.observe(s_a, bias)
    rank_b.observe(s_b[:300], bias)
    rank_b.observe(s_b[300:], bias)
    union.observe(torch.cat([s_a, s_b]), bias)
    buf_a, buf_b = rank_a.pack(), rank_b.pack()
    assert (
        buf_a.dtype == torch.int32
        and buf_a.numel() == n * nb + len(HEADER_FIELDS) == rank_a.packed_numel
    )
    # round trip on one rank
    solo = cls(n, k, nb)
    solo.unpack_(buf_a.clone())
    assert torch.equal(solo.counts, rank_a.counts) and int(solo.num_tokens) == 700
    assert torch.equal(solo.solve(bias), rank_a.solve(bias))
    # "all-reduce": sum of the two buffers == one histogram over the union of tokens
    for h in (rank_a, rank_b):
        h.unpack_(buf_a + buf_b)
        assert torch.equal(h.counts, union.counts) and int(h.num_tokens) == 1255
        assert torch.equal(h.solve(bias), union.solve(bias))
    assert rank_a._reduced["ranks"] == 2
    # a rank that saw no tokens still contributes a valid buffer and reads the global result
    idle = cls(n, k, nb)
    idle_buf = idle.pack()
    assert idle_buf.numel() == buf_a.numel() and int(idle_buf.abs().sum()) == 1
    reader = cls(n, k, nb)
    reader.unpack_(buf_a + idle_buf)
    assert reader._reduced["ranks"] == 2
    assert torch.equal(reader.solve(bias), solo.solve(bias))


def test_pack_size_independent_of_m():
    n, k, nb = 64, 4, 100
    bias = torch.zeros(n)
    sizes = set()
    for m in (1, 10, 5000):
        h = QuantileHistogram(n, k, nb)
        h.observe(router_scores(m, n, m), bias)
        sizes.add(h.pack().numel())
    assert sizes == {n * nb + len(HEADER_FIELDS)}
    with pytest.raises(ValueError, match="buffer"):
        QuantileHistogram(n, k, nb).unpack_(h.pack()[:-1])


def test_overflow_and_corruption_detected():
    n, k = 16, 2
    h = QuantileHistogram(n, k, 10)
    bias = torch.zeros(n)
    h.observe(router_scores(4, n, 0), bias)
    buf = h.pack()
    # a global token count beyond int32: the split header still recovers it exactly -> refuse
    big = buf.clone()
    big[-len(HEADER_FIELDS) + HEADER_FIELDS.index("tokens_hi")] = 40000  # 40000 * 65536 > 2**31
    with pytest.raises(OverflowError, match="2\\*\\*31"):
        QuantileHistogram(n, k, 10).unpack_(big)
    # local guard (white box: pretend the window already holds almost 2**31 tokens)
    h2 = QuantileHistogram(n, k, 10)
    h2.observe(router_scores(4, n, 0), bias)
    h2._num_tokens.fill_(INT32_MAX - 5)
    h2._token_bound = INT32_MAX - 5
    with pytest.raises(OverflowError, match="int32"):
        h2.observe(router_scores(10, n, 1), bias)
    # corrupt / misaligned counts: rows must sum to the token total
    bad = buf.clone()
    bad[0] += 1
    with pytest.raises(ValueError, match="row"):
        QuantileHistogram(n, k, 10).unpack_(bad)


def _corruptions(n):
    """(name, change to the summed buffer or the bias) pairs, each an error of unpack_ / solve."""
    head = -len(HEADER_FIELDS)
    return {
        "ranks": lambda buf, bias: buf.__setitem__(head + HEADER_FIELDS.index("ranks"), 0),
        "overflow": lambda buf, bias: buf.__setitem__(
            head + HEADER_FIELDS.index("tokens_hi"), 40000
        ),
        "bad_inputs": lambda buf, bias: buf.__setitem__(
            head + HEADER_FIELDS.index("bad_inputs"), 1
        ),
        "rows": lambda buf, bias: buf.__setitem__(0, buf[0] + 1),
        "nonfinite_bias": lambda buf, bias: bias.__setitem__(0, float("nan")),
        "changed_bias": lambda buf, bias: bias.__setitem__(n - 1, bias[n - 1] + 1e-3),
        "none": lambda buf, bias: None,
    }


@pytest.mark.parametrize("cls", HIST_CLASSES)
@pytest.mark.parametrize("case", list(_corruptions(16)))
def test_solve_packed_equals_unpack_and_solve_and_raises_the_same(cls, case):
    """The step end's sync-free ``solve_packed`` gives ``unpack_`` + ``solve``'s bias bit for
    bit, and its deferred checks raise what they raise, with the same message."""
    n, k = 16, 2
    bias = 0.1 * torch.randn(n, generator=gen(7))
    eager, packed = cls(n, k, 32), cls(n, k, 32)
    for h in (eager, packed):
        h.observe(router_scores(40, n, 8), bias)
    buf = eager.pack()
    assert torch.equal(buf, packed.pack())
    solve_bias = bias.clone()
    _corruptions(n)[case](buf, solve_bias)
    new, checks = packed.solve_packed(buf.clone(), solve_bias)
    assert checks.dtype == torch.int64 and checks.numel() == len(HEADER_FIELDS) + 3
    try:
        eager.unpack_(buf.clone())
        expected = eager.solve(solve_bias)
    except (ValueError, OverflowError) as err:
        with pytest.raises(type(err)) as got:
            packed.check_packed(checks.tolist())
        assert str(got.value) == str(err)
        assert case != "none"
        return
    assert case == "none"
    packed.check_packed(checks.tolist())
    assert torch.equal(new, expected) and new.dtype == torch.float32


# ----------------------------------------------------------------------------- masking, errors
@pytest.mark.parametrize("cls", HIST_CLASSES)
def test_valid_mask_excludes_padding(cls):
    n, k = 896, 16
    scores = router_scores(600, n, 51)
    pad = torch.rand(150, n, generator=gen(52))
    bias = 0.2 * torch.randn(n, generator=gen(51))
    padded = torch.cat([scores[:300], pad[:100], scores[300:], pad[100:]])
    valid = torch.cat([torch.ones(300), torch.zeros(100), torch.ones(300), torch.zeros(50)]).bool()
    ref, got = cls(n, k), cls(n, k)
    ref.observe(scores, bias)
    got.observe(padded, bias, valid)
    assert torch.equal(ref.counts, got.counts) and int(got.num_tokens) == 600
    assert torch.equal(ref.solve(bias), got.solve(bias))
    assert torch.equal(
        exact_quantile_bias(padded, bias, k, valid), exact_quantile_bias(scores, bias, k)
    )
    assert torch.equal(topk_loads(padded, bias, k, valid), topk_loads(scores, bias, k))
    # all padding -> nothing observed -> bias unchanged
    empty = cls(n, k)
    empty.observe(pad, bias, torch.zeros(150, dtype=torch.bool))
    assert int(empty.num_tokens) == 0 and torch.equal(empty.solve(bias), bias)


@pytest.mark.parametrize("cls", HIST_CLASSES)
def test_bad_input_raises(cls):
    n, k = 32, 4
    s = router_scores(20, n, 61)
    b = torch.zeros(n)
    h = cls(n, k)
    with pytest.raises(ValueError, match="scores_ME.dtype=torch.int64; allowed"):
        h.observe(torch.zeros(4, n, dtype=torch.long), b)
    with pytest.raises(ValueError, match="scores_ME.shape\\[1\\]=31; allowed: num_experts=32"):
        h.observe(s[:, :31], b[:31])
    with pytest.raises(ValueError, match="bias_E.shape=\\(31,\\)"):
        h.observe(s, b[:31])
    with pytest.raises(ValueError, match="bias_E.dtype=torch.bfloat16"):
        h.observe(s, b.bfloat16())
    with pytest.raises(ValueError, match="valid_M.dtype"):
        h.observe(s, b, torch.ones(20))
    with pytest.raises(ValueError, match="valid_M.shape"):
        h.observe(s, b, torch.ones(19, dtype=torch.bool))
    with pytest.raises(ValueError, match="topk=32"):
        cls(n, 32)
    with pytest.raises(ValueError, match="num_bins"):
        cls(n, k, 0)
    with pytest.raises(ValueError, match="scores_ME.*NaN"):
        exact_quantile_bias(torch.full((3, n), float("nan")), b, k)
    assert int(h.num_tokens) == 0  # nothing was counted by the failed calls
    # bad values are counted on the device (no sync) and raise at the step end
    bad = s.clone()
    bad[3, 5] = float("nan")
    for scores, bias in ((bad, b), (s, torch.full((n,), float("inf"))), (s * 3 - 1, b)):
        lazy = cls(n, k)
        lazy.observe(scores, bias)
        with pytest.raises(ValueError, match="1 observe\\(\\) calls had bad input|NaN or inf"):
            lazy.solve(bias)


@pytest.mark.parametrize("cls", HIST_CLASSES)
def test_bias_fixed_within_window(cls):
    n, k = 32, 4
    s = router_scores(50, n, 71)
    b = 0.1 * torch.randn(n, generator=gen(71))
    h = cls(n, k)
    h.observe(s, b)
    h.observe(s, b.clone())  # same values, other tensor: fine
    with pytest.raises(ValueError, match="bias_E differs"):
        h.solve(b + 1e-3)
    new = h.solve(b)
    h.reset()
    h.observe(s, new)  # new window, new bias: fine
    assert int(h.num_tokens) == 50
    # sync-free: a changed bias and NaN are counted and raised at solve / unpack
    lazy = cls(n, k)
    lazy.observe(s, b)
    lazy.observe(s, b + 1e-3)
    nan = s.clone()
    nan[0, 0] = float("nan")
    lazy.observe(nan, b)
    assert bool((lazy.counts.sum(1) == 150).all())  # NaN rows still land in a bin
    with pytest.raises(ValueError, match="1 observe\\(\\) calls had bad input, 1 changed the bias"):
        lazy.solve(b)
    with pytest.raises(ValueError, match="deferred"):
        cls(n, k).unpack_(lazy.pack())


@pytest.mark.parametrize("cls", HIST_CLASSES)
def test_update_never_nan(cls):
    n, k = 64, 4
    b = torch.zeros(n)
    empty = cls(n, k)
    assert torch.equal(empty.solve(b), b)  # empty histogram: bias unchanged
    cases = [
        torch.full((1, n), 0.5),  # one token: Q = 1
        torch.zeros(7, n),
        torch.ones(7, n),
        torch.rand(3, n, generator=gen(81)).double(),
    ]
    for s in cases:
        for bias in (b, 5.0 * torch.randn(n, generator=gen(82)), torch.linspace(-30, 30, n)):
            h = cls(n, k)
            h.observe(s, bias)
            new = h.solve(bias)
            assert new.dtype == torch.float32 and torch.isfinite(new).all()
            assert abs(new.mean().item()) < 1e-4 * max(1.0, bias.abs().max().item())
            assert torch.isfinite(exact_quantile_bias(s, bias, k)).all()


# ----------------------------------------------------------------------------- small helpers
def test_sign_update_loads_and_maxvio():
    loads = torch.tensor([10, 2, 6, 6])
    bias = torch.tensor([0.0, 0.5, -0.5, 1.0])
    new = sign_update_bias(loads, bias, 0.01)
    assert torch.allclose(new, torch.tensor([-0.01, 0.51, -0.5, 1.0]))
    assert new.dtype == torch.float32
    assert max_violation(loads) == pytest.approx((10 - 6) / 6)
    assert max_violation(torch.zeros(4)) == 0.0
    s = router_scores(200, 32, 91)
    b = 0.1 * torch.randn(32, generator=gen(91))
    ld = topk_loads(s, b, 4)
    assert ld.dtype == torch.int64 and int(ld.sum()) == 800
    idx, alpha = cutoff_route(s, b, 4)
    assert torch.equal(torch.bincount(idx.reshape(-1), minlength=32), ld)
    biased = s + b
    assert torch.all(biased.gather(1, idx) >= alpha[:, None])  # routes beat the cutoff


def test_reference_helpers_refuse_bad_input_and_keep_the_bias_of_an_empty_batch():
    """The exact reference and the sign update check what the histogram checks (an inf bias,
    logits instead of scores, a mask or loads of the wrong shape, a negative or NaN rate); a rate
    of 0 is allowed (no update), and a batch of padding only leaves the bias as it is (not
    mean-centred)."""
    n, k = 4, 2
    s = router_scores(6, n, 95)
    bias = torch.tensor([0.0, 0.5, -0.5, 1.0])
    with pytest.raises(ValueError, match="^bias_E contains NaN or inf; allowed: finite values$"):
        exact_quantile_bias(s, torch.full((n,), float("inf")), k)
    logits = s.clone()
    logits[0, 0], logits[5, 3] = -0.5, 1.5
    with pytest.raises(ValueError, match=r"^scores_ME has values in \[-0.5, 1.5\]; allowed: \[0"):
        exact_quantiles(logits, bias, k)
    with pytest.raises(ValueError, match="valid_M.shape"):
        topk_loads(s, bias, k, torch.ones(5, dtype=torch.bool))
    loads = torch.tensor([10, 2, 6, 6])
    assert torch.equal(sign_update_bias(loads, bias, 0.0), bias)
    for rate in (-0.01, float("nan")):
        with pytest.raises(ValueError, match=f"^rate={rate!r}; allowed: finite float >= 0$"):
            sign_update_bias(loads, bias, rate)
    with pytest.raises(ValueError, match=r"^loads_E.shape=\(3,\); allowed: bias_E.shape=\(4,\)$"):
        sign_update_bias(loads[:3], bias, 0.01)
    padding = torch.zeros(6, dtype=torch.bool)
    assert torch.equal(exact_quantiles(s, bias, k, padding), bias)
    assert torch.equal(exact_quantile_bias(s, bias, k, padding), bias)


# ----------------------------------------------------------------------------- mutation-audit gaps
def test_int32_bound_and_token_split_constants():
    """The int32 bound is the int32 maximum, and the split token header stays inside int32 when
    MAX_RANKS buffers are summed (each tokens_lo word is < _TOKEN_SPLIT)."""
    from megatron_latentmoe.balancing import _TOKEN_SPLIT, MAX_RANKS

    assert INT32_MAX == 2_147_483_647 == torch.iinfo(torch.int32).max
    assert _TOKEN_SPLIT == 65_536
    assert MAX_RANKS * (_TOKEN_SPLIT - 1) <= INT32_MAX
    # a global total that needs the high word is recovered exactly: 70000 = 1 * 65536 + 4464
    n, k = 8, 2
    h = QuantileHistogram(n, k, 4)
    h.observe(torch.full((1, n), 0.5), torch.zeros(n))
    buf = h.pack()
    head = buf[-len(HEADER_FIELDS) :].tolist()
    assert head == [1, 1, 0, 0, 0]  # ranks, tokens_lo, tokens_hi, bad_inputs, bias_changes
    big = buf.clone()
    big[: n * 4].view(n, 4)[:, 0] += 70000 - 1  # every row still sums to the token total
    big[-len(HEADER_FIELDS) + HEADER_FIELDS.index("tokens_lo")] = 4464
    big[-len(HEADER_FIELDS) + HEADER_FIELDS.index("tokens_hi")] = 1
    reader = QuantileHistogram(n, k, 4)
    reader.unpack_(big)
    assert int(reader.num_tokens) == 70000


@pytest.mark.parametrize("cls", HIST_CLASSES)
@pytest.mark.parametrize(
    "where", ["one_negative_score", "one_score_above_1", "one_inf_bias", "score_and_bias"]
)
def test_one_bad_value_is_flagged(cls, where):
    """A single out-of-range value is enough: scores in [0, 1] (both ends checked on their own),
    every bias entry finite (not only 'some')."""
    n, k = 32, 4
    s = router_scores(20, n, 61)
    b = torch.zeros(n)
    if where in ("one_negative_score", "score_and_bias"):
        s[4, 7] = -0.01
    elif where == "one_score_above_1":
        s[4, 7] = 1.01
    if where in ("one_inf_bias", "score_and_bias"):
        b[3] = float("inf")
    h = cls(n, k)
    h.observe(s, b)
    assert h.pack()[-len(HEADER_FIELDS) + HEADER_FIELDS.index("bad_inputs")].item() == 1
    with pytest.raises(ValueError, match="1 observe\\(\\) calls had bad input|NaN or inf"):
        h.solve(b)


@pytest.mark.parametrize("cls", HIST_CLASSES)
def test_bias_change_in_one_expert_or_in_place_is_flagged(cls):
    """The window's bias is a copy, compared exactly, entry by entry: changing ONE expert's bias
    by one fp32 ulp, or the caller's bias tensor in place, between two observe() calls is a bias
    change (counted in the header, refused by solve)."""
    n, k = 32, 4
    s = router_scores(50, n, 71)
    b = 0.1 * torch.randn(n, generator=gen(71))
    one = cls(n, k)
    one.observe(s, b)
    b1 = b.clone()
    b1[5] = torch.nextafter(b[5], torch.tensor(1.0))
    one.observe(s, b1)
    assert one.pack()[-len(HEADER_FIELDS) + HEADER_FIELDS.index("bias_changes")].item() == 1
    with pytest.raises(ValueError, match="^bias_E differs from the bias of the accumulation"):
        one.solve(b1)
    in_place = cls(n, k)
    live = b.clone()
    in_place.observe(s, live)
    live[5] += 1e-3  # e.g. a bias buffer updated in place mid-window
    in_place.observe(s, live)
    with pytest.raises(ValueError, match="bias_E differs"):
        in_place.solve(live)
    # the empty-window answer is the bias, as a new tensor (not the caller's buffer)
    empty = cls(n, k)
    out = empty.solve(live)
    assert torch.equal(out, live)
    out += 1.0
    assert torch.equal(live[5], b[5] + 1e-3)


def test_local_overflow_guard_counts_only_valid_tokens():
    """Near 2**31 local tokens the exact check adds the micro-batch's VALID tokens only."""
    n, k = 16, 2
    bias = torch.zeros(n)
    scores = router_scores(10, n, 1)
    for valid_count, raises in ((5, False), (6, True)):
        h = QuantileHistogram(n, k, 10)
        h.observe(router_scores(4, n, 0), bias)
        h._num_tokens.fill_(INT32_MAX - 5)  # white box, as test_overflow_and_corruption_detected
        h._token_bound = INT32_MAX - 5
        valid = torch.arange(10) < valid_count
        if raises:
            with pytest.raises(OverflowError, match="2147483648"):
                h.observe(scores, bias, valid)
        else:
            h.observe(scores, bias, valid)
            assert int(h.num_tokens) == INT32_MAX


@pytest.mark.parametrize("cls", HIST_CLASSES)
def test_observe_with_the_routers_cutoffs_equals_its_own(cls):
    """The router passes the cutoffs of its own top-(k+1) (``alpha_M``, 1-D fp32): the same counts
    as observe() computing them; a 2-D alpha is refused, naming the field."""
    n, k = 64, 4
    scores = router_scores(300, n, 13)
    bias = 0.2 * torch.randn(n, generator=gen(13))
    own, given = cls(n, k), cls(n, k)
    own.observe(scores, bias)
    _, alpha = cutoff_route(scores, bias, k)
    given.observe(scores, bias, alpha_M=alpha)
    assert torch.equal(own.counts, given.counts) and int(given.num_tokens) == 300
    with pytest.raises(ValueError, match="alpha_M.dim\\(\\)=2"):
        cls(n, k).observe(scores, bias, alpha_M=alpha[:, None])


def test_smallest_allowed_shapes_and_defaults():
    """n = 2 experts and B = 1 bin (uniform) are allowed; n = 1 and B = 0 are not. The centred
    bins default to sigma = 0.005: the two bins at the bias are sigma * sinh(2 U / B) wide."""
    h = QuantileHistogram(2, 1, 1)
    h.observe(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.zeros(2))
    assert h.counts.tolist() == [[2], [2]]
    # one bin [-1, 1]: Q = 1 of 2 tokens in it -> edge + 1/2 * width = 0 for both experts
    assert h.raw_quantiles(torch.zeros(2)).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="num_experts=1"):
        QuantileHistogram(1, 1, 10)
    with pytest.raises(ValueError, match="num_bins=0"):
        QuantileHistogram(2, 1, 0)
    c = CenteredQuantileHistogram(4, 1)
    assert c.sigma == 0.005 and c.num_bins == 1000
    bias = torch.tensor([0.0, 0.1, -0.1, 0.0])
    u_max = math.asinh((0.2 + 1.0) / 0.005)
    _, width = bin_bounds(c, torch.full((4,), 500), bias)
    expected = 0.005 * math.sinh(2 * u_max / 1000)
    expected_E = torch.full((4,), expected, dtype=torch.float64)
    assert torch.allclose(width.double(), expected_E, rtol=1e-4)
    idx = bin_index(c, bias[None, :], bias)
    assert idx.dtype == torch.int64 and idx.tolist() == [[500, 500, 500, 500]]


def test_cutoff_route_is_the_top_k_plus_1_of_a_full_sort():
    """SPEC §4 step 1 against a full descending sort of fp32 ``s + b``: the k routes best first
    and alpha = the (k+1)-th value. ``topk(sorted=False)`` keeps the right set of routes (on CPU
    even the right (k+1)-th value in the last slot) but not their order; on CUDA it keeps no
    order at all, so ``values[:, k]`` would be any of the top k+1 and every cutoff wrong."""
    m, n, k = 200, 64, 6
    scores = router_scores(m, n, 17)
    bias = 0.2 * torch.randn(n, generator=gen(17))
    idx, alpha = cutoff_route(scores, bias, k)
    biased = scores + bias
    ranked = biased.sort(dim=1, descending=True).values
    assert idx.shape == (m, k) and alpha.shape == (m,) and alpha.dtype == torch.float32
    assert torch.equal(biased.gather(1, idx), ranked[:, :k])  # the top k, best first
    assert torch.equal(alpha, ranked[:, k])


@pytest.mark.parametrize("m,n,k", [(256, 64, 4), (16, 4, 3)])  # partial-sort / kthvalue path
def test_exact_quantile_when_the_target_load_is_whole(m, n, k):
    """q = m k / n an integer (16 and 12 here): Q = ceil(q) = q, so the exact reference is the
    q-th smallest r of each column by a full sort, not the (q+1)-th. Elsewhere q is fractional,
    or the (q+1)-th lies within the histogram's one-bin tolerance, so a reference taking
    floor(q) + 1 went unnoticed."""
    big_q = m * k // n
    assert big_q * n == m * k
    scores = router_scores(m, n, 19)
    bias = 0.1 * torch.randn(n, generator=gen(19))
    r = r_matrix(scores, bias, k)
    expected = r.sort(dim=0).values[big_q - 1]
    assert torch.equal(exact_quantiles(scores, bias, k), expected)
    assert not torch.equal(expected, r.sort(dim=0).values[big_q])  # the two candidates differ


def test_cutoff_route_adds_the_bias_in_fp32_to_half_precision_scores():
    """The router may pass bf16 scores: the k routes and alpha are still those of fp32 ``s + b``
    (a bias of 0.3 * randn is not representable in bf16; adding it in bf16 moves the cutoffs by
    up to half a bf16 ulp of 1, ~2e-3, a third of a B = 1000 bin)."""
    m, n, k = 200, 64, 6
    scores = router_scores(m, n, 23).bfloat16()
    bias = 0.3 * torch.randn(n, generator=gen(23))
    idx, alpha = cutoff_route(scores, bias, k)
    ranked = (scores.float() + bias).sort(dim=1, descending=True)
    assert alpha.dtype == torch.float32
    assert torch.equal(alpha, ranked.values[:, k])
    assert torch.equal(idx, ranked.indices[:, :k])


def test_a_global_total_of_exactly_int32_max_tokens_is_solved_exactly():
    """2**31 - 1 global tokens is the largest total allowed (one more raises): it unpacks, and the
    int32 cumulative counts find the exact crossing bin. n = 2, k = 1, two bins [-1, 0), [0, 1]
    (zero bias): Q = 2**30; row 0 holds Q tokens in bin 0 (answer: its right edge, 0), row 1 holds
    Q - 1 (the crossing is the first token of bin 1: 0 + 1 / 2**30 of the bin)."""
    n, k, nb = 2, 1, 2
    half = 2**30
    bias = torch.zeros(n)
    buf = torch.tensor(
        [half, half - 1, half - 1, half] + [0] * len(HEADER_FIELDS), dtype=torch.int32
    )
    head = -len(HEADER_FIELDS)
    buf[head + HEADER_FIELDS.index("ranks")] = 1
    buf[head + HEADER_FIELDS.index("tokens_lo")] = INT32_MAX % 65536
    buf[head + HEADER_FIELDS.index("tokens_hi")] = INT32_MAX // 65536
    h = QuantileHistogram(n, k, nb)
    h.unpack_(buf.clone())
    assert int(h.num_tokens) == INT32_MAX
    assert h.raw_quantiles(bias).tolist() == [0.0, 2.0**-30]
    new, checks = QuantileHistogram(n, k, nb).solve_packed(buf.clone(), bias)
    QuantileHistogram.check_packed(checks.tolist())
    assert new.tolist() == [-(2.0**-31), 2.0**-31]
    buf[head + HEADER_FIELDS.index("tokens_lo")] += 1  # 2**31: refused, naming the total
    buf[1] += 1
    buf[3] += 1
    with pytest.raises(OverflowError, match="^global tokens this step = 2147483648; allowed"):
        QuantileHistogram(n, k, nb).unpack_(buf)


def test_header_rank_count_bounds():
    """The summed header's rank count is allowed in [1, MAX_RANKS] (both ends), refused outside
    with the header and the bound in the message."""
    from megatron_latentmoe.balancing import MAX_RANKS

    n, k, nb = 4, 1, 2
    h = QuantileHistogram(n, k, nb)
    h.observe(torch.full((1, n), 0.5), torch.zeros(n))
    at = -len(HEADER_FIELDS) + HEADER_FIELDS.index("ranks")
    for ranks, ok in ((1, True), (MAX_RANKS, True), (MAX_RANKS + 1, False), (0, False)):
        buf = h.pack()
        buf[at] = ranks
        reader = QuantileHistogram(n, k, nb)
        if ok:
            reader.unpack_(buf)
            assert reader._reduced["ranks"] == ranks
        else:
            with pytest.raises(
                ValueError, match=f"'ranks': {ranks},.*allowed: 1 <= ranks <= 32767"
            ):
                reader.unpack_(buf)


def test_centred_histogram_refuses_odd_bins_and_a_sigma_outside_0_1():
    """The centred bins need an even B (the bias is the edge between the two middle bins) and a
    sigma in (0, 1] (0 would divide by zero in the asinh map); both ends of (0, 1] are checked."""
    with pytest.raises(ValueError, match=r"^num_bins=999; allowed: even int >= 2$"):
        CenteredQuantileHistogram(4, 1, 999)
    for sigma in (0.0, -0.005, 1.5, float("nan")):
        with pytest.raises(ValueError, match=rf"^sigma={sigma!r}; allowed: float in \(0, 1\]$"):
            CenteredQuantileHistogram(4, 1, 10, sigma=sigma)
    assert CenteredQuantileHistogram(4, 1, 10, sigma=1.0).sigma == 1.0


def test_a_valid_mask_on_another_device_is_refused_naming_it():
    hist = QuantileHistogram(4, 1, 50)
    valid = torch.ones(3, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"^valid_M\.device=meta; allowed: scores_ME\.device=cpu"):
        hist.observe(torch.rand(3, 4), torch.zeros(4), valid_M=valid)
