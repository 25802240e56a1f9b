"""QB calibration's solver and trigger (``training/qb_calibrate.py``); the passes through
Megatron's schedule on every layout are ``tests/parallel/test_qb_calibrate.py``'s, a whole run
``tests/training/test_pretrain.py``'s."""

from __future__ import annotations

import pytest
import torch

from megatron_latentmoe.balancing import CenteredQuantileHistogram, cutoff_route
from megatron_latentmoe.training.qb_calibrate import (
    QB_CALIBRATION_ITERS,
    QBCalibration,
    calibrate_bias,
)

N, K, TOKENS = 16, 2, 4096


def _scores(seed: int) -> torch.Tensor:
    """Sigmoid scores of a router that prefers a few experts (a fixed offset per expert)."""
    offset_E = torch.linspace(-1.0, 1.0, N) ** 3
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(TOKENS, N, generator=g) * 0.5 + offset_E)


def _max_vio(scores_ME, bias_E, valid_M=None) -> float:
    idx_MK, _ = cutoff_route(scores_ME, bias_E, K)
    if valid_M is not None:
        idx_MK = idx_MK[valid_M]
    loads = torch.bincount(idx_MK.reshape(-1), minlength=N).double()
    return ((loads.max() - loads.mean()) / loads.mean()).item()


def test_calibrated_bias_balances_the_pool_and_a_batch_outside_it():
    pool = [(_scores(seed), None) for seed in (1, 2)]
    zero = torch.zeros(N)
    hist = CenteredQuantileHistogram(N, K, num_bins=1000)
    bias, history = calibrate_bias(hist, zero, pool)
    assert len(history) == QB_CALIBRATION_ITERS + 1
    assert history[0] == _max_vio(torch.cat([s for s, _ in pool]), zero)  # recount, bias 0
    pooled = _max_vio(torch.cat([s for s, _ in pool]), bias)
    assert pooled == min(history)  # the iterate kept is the best one, recounted
    outside = _scores(3)
    print(
        f"MaxVio pool {history[0]:.3f} -> {pooled:.3f}; outside "
        f"{_max_vio(outside, zero):.3f} -> {_max_vio(outside, bias):.3f}"
    )
    assert history[0] > 1.0 and pooled < 0.05
    assert _max_vio(outside, zero) > 1.0 and _max_vio(outside, bias) < 0.15
    assert abs(bias.mean().item()) < 1e-6  # QB's bias stays mean-free


def test_padding_is_not_counted():
    scores = _scores(1)
    valid_M = torch.ones(TOKENS, dtype=torch.bool)
    valid_M[::3] = False
    # the padded tokens all prefer expert 0: counted, they would drive its bias down
    padded = scores.clone()
    padded[~valid_M, 0] = 1.0
    hist = CenteredQuantileHistogram(N, K, num_bins=1000)
    got, history = calibrate_bias(hist, torch.zeros(N), [(padded, valid_M)])
    want, _ = calibrate_bias(hist, torch.zeros(N), [(scores[valid_M], None)])
    assert torch.equal(got, want)
    assert history[0] == _max_vio(padded, torch.zeros(N), valid_M)


def _calibrated_iterations(start: int, kept_bias: str | None = None) -> list[int]:
    """The iterations a :class:`QBCalibration` (its ``calibrate`` a spy) calibrates at, its
    wrapped train step run at iterations ``start`` and ``start + 1``."""

    def train_step(
        forward_step_func, data_iterator, model, config, forward_backward_func, iteration=None
    ):
        return iteration

    cal = QBCalibration(
        2,
        train_iters=10,
        global_batch_size=8,
        seq_length=4,
        micro_batch_size=1,
        num_microbatches=lambda: 1,
        kept_bias=kept_bias,
    )
    seen = []
    cal.calibrate = lambda call: seen.append(call["iteration"])
    step = cal.wrap_train_step(train_step)
    assert [step(None, None, None, None, None, iteration=i) for i in (start, start + 1)] == [
        start,
        start + 1,
    ]
    return seen


def test_only_a_run_that_starts_at_iteration_0_calibrates_once():
    assert _calibrated_iterations(0) == [0]  # a fresh run (or --finetune): once, before step 1
    assert _calibrated_iterations(5) == []  # resumed: the checkpoint's bias


def test_wrappers_refuse_a_train_step_without_megatrons_argument_names():
    """Both train-step wrappers read Megatron's argument names from each call: a step taking
    other names is refused when wrapped (it used to fail with KeyError after its first step)."""
    import pytest

    from megatron_latentmoe.training.qb_rescore import QBRescore

    def natural(model, optimizer, data_iterator, iteration):
        return None

    def megatron_like(
        forward_step_func,
        data_iterator,
        model,
        optimizer,
        scheduler,
        config,
        forward_backward_func,
        iteration=0,
    ):
        return None

    shape = dict(seq_length=8, micro_batch_size=1)
    wrappers = {
        "QBRescore": QBRescore(2, lambda *a, **k: None, **shape).wrap_train_step,
        "QBCalibration": QBCalibration(
            2, train_iters=10, global_batch_size=2, log=lambda line: None, **shape
        ).wrap_train_step,
    }
    for who, wrap in wrappers.items():
        with pytest.raises(TypeError, match=f"{who}.wrap_train_step: .*missing forward_step_func"):
            wrap(natural)
        assert callable(wrap(megatron_like))


class _FakeQBRouter:
    """What QBRescore touches of a QB router: its histogram, its last mean router input (NaN:
    unknown) and the drift reference."""

    def __init__(self, events, name, mean_input_known=True):
        self.events, self.name = events, name
        self.qb_mean_input = torch.zeros(3) if mean_input_known else torch.full((3,), float("nan"))
        self.qb_rescoring = False
        self.qb_histogram = self

    def reset(self):
        self.events.append(("histogram reset", self.name, self.qb_rescoring))

    def set_drift_reference(self):
        self.events.append(("drift reference", self.name))


def _rescore_setup(monkeypatch, iters=2, solves=1, mean_inputs_known=(True, False)):
    from megatron_latentmoe.training import forward_step
    from megatron_latentmoe.training.qb_rescore import QBRescore

    events = []
    routers = [_FakeQBRouter(events, n, k) for n, k in enumerate(mean_inputs_known)]
    monkeypatch.setattr(QBRescore, "_qb_routers", staticmethod(lambda model: routers))
    monkeypatch.setattr(QBRescore, "_solve", staticmethod(lambda model: events.append("solve")))

    def forward_only_pass(call, data_iterator, num_microbatches, schedule):
        batches = [None if d is None else list(d) for d in data_iterator]
        rescoring = [r.qb_rescoring for r in routers]
        events.append(("pass", batches, num_microbatches, schedule, rescoring))
        assert not torch.is_grad_enabled()

    monkeypatch.setattr(forward_step, "forward_only_pass", forward_only_pass)
    rescore = QBRescore(
        iters,
        lambda model, **kwargs: events.append(("step end", model, kwargs)),
        **({} if solves is None else dict(solves=solves)),  # None: the default
        seq_length=8,
        micro_batch_size=1,
        num_microbatches=lambda: 2,
    )

    def train_step(
        forward_step_func, data_iterator, model, config, forward_backward_func, iteration
    ):
        events.append(("train", iteration, rescore.deferring))
        for batch in ("a", "b"):  # the training forward's micro-batches of the first chunk
            rescore.record(data_iterator[0], f"{batch}{iteration}")
        if rescore.deferring:  # the finalize hook's part
            rescore.before_optimizer_step(model)
        return f"step {iteration}"

    step = rescore.wrap_train_step(train_step)

    def run(iteration):
        data = [iter(()), None]  # virtual pipeline: a chunk without data on this stage
        return step(None, data, "model", None, None, iteration=iteration)

    return rescore, routers, events, run


def test_a_rescored_step_ends_after_forward_passes_of_its_own_batch(monkeypatch):
    """Iterations 1..iters (0-based < iters): the training step's step end deferred; the QB
    routers with a known mean input armed before the optimizer step; ``solves`` forward-only
    passes of the recorded micro-batches (histograms reset, ``qb_rescoring`` on, no grad), an
    extra solve between two; then the step end without drift correction. Later steps: plain."""
    rescore, routers, events, run = _rescore_setup(monkeypatch, solves=2)
    schedule = dict(seq_length=8, micro_batch_size=1, decoder_seq_length=None)
    passed = ("pass", [["a1", "b1"], None], 2, schedule, [True, True])
    resets = [("histogram reset", 0, False), ("histogram reset", 1, False)]
    assert run(1) == "step 1"
    assert events == [
        ("train", 1, True),
        ("drift reference", 0),  # router 1's mean input is unknown (NaN): not armed
        *resets,
        passed,
        "solve",
        *resets,
        passed,
        ("step end", "model", dict(drift_correction=False)),
    ]
    assert not rescore.deferring and [r.qb_rescoring for r in routers] == [False, False]
    assert rescore._batches == {}  # the step's batches are let go
    events.clear()
    assert run(2) == "step 2"  # past --moe-qb-rescore-iters 2
    assert events == [("train", 2, False)]


def test_a_run_resumed_inside_the_rescoring_window_warns_once(monkeypatch, capsys):
    _, _, _, run = _rescore_setup(monkeypatch, iters=5)
    run(3)
    run(4)
    assert capsys.readouterr().out == (
        "WARNING: resumed at iteration 3, inside --moe-qb-rescore-iters 5, from a checkpoint "
        "without the QB routers' mean router input (router.qb_mean_input: written without "
        "--moe-qb-rescore-iters, or by a version of this package from before it was "
        "checkpointed): the first rescored step runs without the armed drift "
        "correction\n"
    )
    _, _, _, run = _rescore_setup(monkeypatch, iters=5, mean_inputs_known=(True, True))
    run(3)
    assert capsys.readouterr().out == ""
    _, _, _, run = _rescore_setup(monkeypatch, iters=5)
    run(0)  # a fresh run: no mean input before its first step end, and nothing to warn about
    assert capsys.readouterr().out == ""
    _, _, _, run = _rescore_setup(monkeypatch, iters=5)
    run(1)
    assert capsys.readouterr().out.startswith("WARNING: resumed at iteration 1, inside")


def test_a_failed_rescored_step_leaves_no_batch_to_the_next(monkeypatch):
    """A rescored step whose training step raised (its rescoring never ran) hands none of its
    recorded micro-batches to the next rescored step's pass, even over the same iterator."""
    rescore, _, events, _ = _rescore_setup(monkeypatch)
    data = [iter(()), None]

    def train_step(
        forward_step_func, data_iterator, model, config, forward_backward_func, iteration
    ):
        rescore.record(data_iterator[0], f"x{iteration}")
        if iteration == 0:
            raise RuntimeError("out of memory")

    step = rescore.wrap_train_step(train_step)
    with pytest.raises(RuntimeError, match="out of memory"):
        step(None, data, "model", None, None, iteration=0)
    assert not rescore.deferring
    events.clear()
    step(None, data, "model", None, None, iteration=1)
    assert [e[1] for e in events if e[0] == "pass"] == [[["x1"], None]]


def test_calibration_keeps_the_training_dataset_and_reports_each_layer():
    """The pool starts at sample (train_iters - N) x global batch; the datasets provider hands
    Megatron its datasets (and its ``is_distributed``) and keeps the training one; the report
    names each layer's MaxVio before / after, the update kept and the tokens."""
    from megatron_latentmoe.training.qb_calibrate import LayerCalibration

    lines = []
    cal = QBCalibration(
        3,
        train_iters=10,
        global_batch_size=8,
        seq_length=4,
        micro_batch_size=1,
        num_microbatches=lambda: 2,
        log=lines.append,
    )
    assert cal.first_sample == 56

    def provider(sizes):
        return f"train {sizes[0]}", "valid", "test"

    provider.is_distributed = True
    wrapped = cal.wrap_datasets_provider(provider)
    assert wrapped([5, 1, 1]) == ("train 5", "valid", "test") and cal.train_datasets == ["train 5"]
    assert wrapped.is_distributed is True and wrapped.__name__ == "provider"
    chunks = QBCalibration._iterators([iter(()), None], ["a", "b"])  # virtual pipeline
    assert list(chunks[0]) == ["a", "b"] and chunks[1] is None
    cal._report([LayerCalibration(2, 100, 1.5, 0.25, 7)], 2.04, None)
    assert lines == [
        "[QB calibration] layer 2: MaxVio on the pool 1.500 (bias before) -> 0.250 (update 7 of "
        f"{QB_CALIBRATION_ITERS}), 100 local tokens",
        "[QB calibration] 1 layers on 3 global batches (samples from 56: the run's last "
        "iterations) in 2.0 s",
    ]


def test_a_layers_solve_sets_its_bias_and_counts_its_unpadded_tokens():
    from types import SimpleNamespace

    scores = _scores(1)
    valid_M = torch.ones(TOKENS, dtype=torch.bool)
    valid_M[:96] = False
    pool = [(scores, valid_M), (_scores(2), None)]
    hist = CenteredQuantileHistogram(N, K, num_bins=1000)
    hist.observe(_scores(5), torch.zeros(N))  # training's histogram: not touched
    packed = hist.pack().clone()
    router = SimpleNamespace(layer_number=3, qb_histogram=hist, expert_bias=torch.zeros(N))
    result = QBCalibration._solve(router, pool, None)
    assert torch.equal(hist.pack(), packed)
    want, history = calibrate_bias(
        CenteredQuantileHistogram(N, K, num_bins=1000), torch.zeros(N), pool
    )
    assert torch.equal(router.expert_bias, want)
    assert (result.layer_number, result.tokens) == (3, 2 * TOKENS - 96)
    assert (result.max_vio_before, result.max_vio_after) == (history[0], min(history))
    assert result.best_iter == history.index(min(history)) > 0


def test_the_best_iterate_is_kept_and_reported_not_the_last():
    """On one batch the damped updates reach their lowest MaxVio before the last update and
    route worse after it: the layer keeps that best iterate's bias and reports its MaxVio and
    update number, not the last iterate's (nor the last that beat the start)."""
    from types import SimpleNamespace

    scores = _scores(1)
    hist = CenteredQuantileHistogram(N, K, num_bins=1000)
    router = SimpleNamespace(layer_number=1, qb_histogram=hist, expert_bias=torch.zeros(N))
    result = QBCalibration._solve(router, [(scores, None)], None)
    _, history = calibrate_bias(
        CenteredQuantileHistogram(N, K, num_bins=1000), torch.zeros(N), [(scores, None)]
    )
    assert min(history) < history[-1] < history[0]  # the premise: the last is not the best
    assert result.max_vio_after == min(history) == _max_vio(scores, router.expert_bias)
    assert result.best_iter == history.index(min(history)) < QB_CALIBRATION_ITERS


def test_rescoring_defaults_and_a_run_resumed_past_its_window(monkeypatch):
    """One solve per rescored step by default; a run resumed past the window neither defers the
    step end nor keeps the batches; a pipeline stage without a QB router (dense layers only)
    rescores nothing; the micro-batch count is Megatron's."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from megatron_latentmoe.training.qb_rescore import QBRescore

    rescore, _, events, run = _rescore_setup(monkeypatch, iters=2, solves=None)
    assert rescore.deferring is False
    run(7)
    assert events == [("train", 7, False)] and rescore._batches == {}
    run(1)  # one pass, no extra solve
    assert [e if isinstance(e, str) else e[0] for e in events[1:]] == [
        "train",
        "drift reference",
        *["histogram reset"] * 2,
        "pass",
        "step end",
    ]
    rescore, routers, events, run = _rescore_setup(monkeypatch, mean_inputs_known=())
    run(1)
    assert [e[0] for e in events] == ["train", "pass", "step end"]
    shape = dict(seq_length=8, micro_batch_size=1)
    assert QBRescore(2, None, **shape).num_microbatches is get_num_microbatches


def test_an_overshooting_update_keeps_the_start():
    """Damping 2.5 overshoots on this pool: every update routes worse than bias 0, so the
    iterate kept is the start."""
    pool = [(_scores(seed), None) for seed in (1, 2)]
    hist = CenteredQuantileHistogram(N, K, num_bins=1000)
    bias, history = calibrate_bias(hist, torch.zeros(N), pool, iters=4, damping=2.5)
    assert len(history) == 5 and min(history[1:]) > history[0]
    assert torch.equal(bias, torch.zeros(N))


def test_calibration_starts_from_the_bias_it_is_given():
    """A run that starts at iteration 0 from a checkpoint (``--finetune``) calibrates from the
    bias it loaded, not from 0: the first MaxVio is the pool's under that bias, and when every
    update overshoots (damping 2.5) that bias is the one kept."""
    pool = [(_scores(seed), None) for seed in (1, 2)]
    scores = torch.cat([s for s, _ in pool])
    start = -0.1 * torch.linspace(-1.0, 1.0, N) ** 3  # against _scores' offsets: mean-free
    assert _max_vio(scores, start) < _max_vio(scores, torch.zeros(N))
    hist = CenteredQuantileHistogram(N, K, num_bins=1000)
    bias, history = calibrate_bias(hist, start, pool, iters=2, damping=2.5)
    assert history[0] == _max_vio(scores, start)
    assert min(history[1:]) > history[0] and torch.equal(bias, start)


def test_a_pool_already_balanced_keeps_the_first_of_equal_iterates():
    """Every token has two clear winners, the pairs cycling over the experts: MaxVio 0 at bias 0.
    The updates move the bias (the winners' scores differ per expert) but route the pool alike,
    so every iterate ties at 0 and the first one, the start, is kept (the one the report names);
    the histogram is left reset, ready for another window."""
    m = torch.arange(8 * N)
    scores = torch.rand(8 * N, N, generator=torch.Generator().manual_seed(0)) * 0.2
    scores[m, m % N] = 0.6 + 0.02 * (m % N)
    scores[m, (m + 1) % N] = 0.5 + 0.02 * (m % N)
    hist = CenteredQuantileHistogram(N, K, num_bins=1000)
    zero = torch.zeros(N)
    hist.observe(scores, zero)
    solved = hist.solve(zero)
    assert solved.abs().max() > 0.05  # an update moves the bias
    hist.reset()
    bias, history = calibrate_bias(hist, zero, [(scores, None)], iters=3)
    assert history == [0.0] * 4 and torch.equal(bias, zero)
    hist.observe(scores, zero)  # refused after unpack_() unless reset
    assert torch.equal(hist.solve(zero), solved)  # nothing left of the calibration's counts


def test_calibration_defaults_and_a_provider_without_is_distributed():
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    lines = []
    shape = dict(seq_length=4, micro_batch_size=1, log=lines.append)
    cal = QBCalibration(2, train_iters=10, global_batch_size=4, **shape)
    assert cal.num_microbatches is get_num_microbatches

    def provider(sizes):
        return "train", None, None

    wrapped = cal.wrap_datasets_provider(provider)
    assert wrapped([1, 1, 1]) == ("train", None, None) and not hasattr(wrapped, "is_distributed")
    cal._report([], 1.0, None)  # no QB layer: nothing to report
    assert lines == []


def test_the_pool_is_the_runs_last_global_batches(monkeypatch):
    """Megatron's training sampler over the first training dataset built (a stage without one
    keeps None), from sample (train_iters - N) x global batch: N x micro-batches of them."""
    import sys
    from types import SimpleNamespace

    loaders = []

    def build_pretraining_data_loader(dataset, consumed_samples):
        loaders.append((dataset, consumed_samples))
        return (f"{dataset} sample {consumed_samples + i}" for i in range(10**6))

    samplers = SimpleNamespace(build_pretraining_data_loader=build_pretraining_data_loader)
    monkeypatch.setitem(sys.modules, "megatron.training.datasets.data_samplers", samplers)
    cal = QBCalibration(
        2, train_iters=10, global_batch_size=4, seq_length=4, micro_batch_size=2, log=print
    )
    assert cal.pool_micro_batches(3) == [] and loaders == []  # no training dataset on this rank
    cal.train_datasets += [None, "train", "other"]
    assert cal.pool_micro_batches(3) == [f"train sample {32 + i}" for i in range(6)]
    assert loaders == [("train", 32)]


class _CalibrationStage:
    """A pipeline stage's QB routers (layers ``layers``) and a fake forward-only pass: each
    micro-batch (a seed) gives every layer fixed scores shifted by the bias of the layers before
    it (they route with it), appended where the layer collects; it draws from torch's RNG and
    moves the model-parallel tracker's state, as dropout would."""

    def __init__(self, monkeypatch, layers, fail_on_pass=None, cuda=False):
        from types import SimpleNamespace

        from megatron.core import parallel_state, tensor_parallel

        from megatron_latentmoe.moe import balance_step
        from megatron_latentmoe.moe import router as router_module
        from megatron_latentmoe.training import forward_step

        class Router:
            def __init__(self, layer_number):
                self.layer_number = layer_number
                self.qb_histogram = CenteredQuantileHistogram(N, K, num_bins=500)
                self.expert_bias = torch.zeros(N)
                self.token_group = "token group"
                self.qb_calibration_scores = None

        class Tracker:
            states = {"model-parallel-rng": torch.tensor([1])}
            restored = []

            def get_states(self):
                return dict(self.states)

            def set_states(self, states):
                self.restored.append(states)

        self.routers = [Router(n) for n in layers]
        self.tracker, self.passes, self.fail_on_pass = Tracker(), [], fail_on_pass
        self.cuda = cuda  # the passes draw from the CUDA generator too
        self.collecting = []  # the layers collecting scores, at each pass
        dense = SimpleNamespace(layer_number=1)  # a load-counting router that is not QB
        model = ["chunk"]
        monkeypatch.setattr(router_module, "QuantileBalancingRouter", Router)
        monkeypatch.setattr(
            balance_step, "balance_routers", lambda m: [dense, *self.routers] if m is model else []
        )
        monkeypatch.setattr(forward_step, "forward_only_pass", self.forward_only_pass)
        monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: self.tracker)
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_group", lambda: "pp")
        self.call = dict(model=model, data_iterator=iter(()), iteration=0)

    def scores(self, seed, layer, shift_E):
        g = torch.Generator().manual_seed(1000 * layer + seed)
        offset_E = torch.linspace(-1.0, 1.0, N) ** 3 * layer / 4
        return torch.sigmoid(torch.randn(256, N, generator=g) * 0.5 + offset_E - shift_E)

    def forward_only_pass(self, call, data_iterator, num_microbatches, schedule):
        assert call is self.call and not torch.is_grad_enabled()
        batches = list(data_iterator)
        self.passes.append((batches, num_microbatches, schedule))
        self.collecting.append([r.layer_number for r in self.routers if r.qb_calibration_scores])
        if len(self.passes) == self.fail_on_pass:
            raise RuntimeError("out of memory")
        torch.rand(3)
        if self.cuda:
            torch.rand(3, device="cuda")
        self.tracker.states = {"model-parallel-rng": torch.tensor([len(self.passes) + 1])}
        for seed in batches:
            shift_E = torch.zeros(N)
            for router in sorted(self.routers, key=lambda r: r.layer_number):
                if router.qb_calibration_scores is not None:
                    scores = self.scores(seed, router.layer_number, shift_E)
                    router.qb_calibration_scores.append((scores, None))
                shift_E = shift_E + router.expert_bias

    def calibration(self, lines):
        class Calibration(QBCalibration):
            def pool_micro_batches(self, num_microbatches):
                assert num_microbatches == 2
                return [11, 12, 13, 14]  # two global batches of two micro-batches

        return Calibration(
            2,
            train_iters=10,
            global_batch_size=2,
            seq_length=4,
            micro_batch_size=1,
            num_microbatches=lambda: 2,
            log=lines.append,
        )


def test_calibration_solves_each_layer_after_the_layers_before_it(monkeypatch):
    """Layer after layer in layer order (10 after 3, whatever the model's order), one pass per
    global batch of the pool, each layer solved on its own scores with the layers before it
    routing under their calibrated bias: re-collecting every layer's scores in one pass under the
    calibrated biases and re-solving them from 0 gives each bias to the bit. The RNG streams and
    the tracker are left as they were; nothing keeps collecting."""
    stage = _CalibrationStage(monkeypatch, layers=[10, 3])
    lines, rng = [], torch.get_rng_state()
    results = stage.calibration(lines).calibrate(stage.call)
    schedule = dict(seq_length=4, micro_batch_size=1, decoder_seq_length=None)
    assert stage.passes == [([11, 12], 2, schedule), ([13, 14], 2, schedule)] * 2
    assert stage.collecting == [[], [3], [], [10]]  # one layer at a time (lists start empty)
    assert [r.layer_number for r in results] == [3, 10]
    assert [r.tokens for r in results] == [4 * 256] * 2
    assert torch.equal(torch.get_rng_state(), rng)
    assert stage.tracker.restored == [{"model-parallel-rng": torch.tensor([1])}]
    assert [r.qb_calibration_scores for r in stage.routers] == [None, None]
    for router in stage.routers:
        router.qb_calibration_scores = []
    with torch.no_grad():
        stage.forward_only_pass(stage.call, iter([11, 12, 13, 14]), 4, {})
    for router, result in zip(stage.routers, results[::-1], strict=True):
        pool, router.qb_calibration_scores = router.qb_calibration_scores, None
        want, history = calibrate_bias(
            CenteredQuantileHistogram(N, K, num_bins=500), torch.zeros(N), pool
        )
        assert torch.equal(router.expert_bias, want), router.layer_number
        assert (result.max_vio_before, result.max_vio_after) == (history[0], min(history))
        assert result.max_vio_after < 0.5 * result.max_vio_before
    assert lines[0].startswith("[QB calibration] layer 3: MaxVio on the pool ")
    assert lines[2].startswith("[QB calibration] 2 layers on 2 global batches (samples from 16")


def test_a_failed_calibration_pass_leaves_no_router_collecting(monkeypatch):
    stage = _CalibrationStage(monkeypatch, layers=[2, 3], fail_on_pass=3)
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="out of memory"):
        stage.calibration([]).calibrate(stage.call)
    assert [r.qb_calibration_scores for r in stage.routers] == [None, None]
    assert stage.tracker.restored == [{"model-parallel-rng": torch.tensor([1])}]
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.gpu
def test_calibration_leaves_the_cuda_generator_as_it_was(monkeypatch):
    """On a GPU the pool's passes draw from the CUDA generator (dropout): restored too."""
    stage = _CalibrationStage(monkeypatch, layers=[2], cuda=True)
    cuda_rng = torch.cuda.get_rng_state()
    stage.calibration([]).calibrate(stage.call)
    assert len(stage.passes) == 2 and torch.equal(torch.cuda.get_rng_state(), cuda_rng)


def test_a_later_pipeline_stage_passes_with_the_earlier_stages_layers(monkeypatch):
    """PP2, second stage (layer 3; the first holds 1 and 2): the stage joins the pool's passes
    of every layer of the model, in order, and solves its own layer only, with one all-reduce
    per update over its token group (DP2 here: the other rank's tokens); the report comes from
    the stage's first token-group rank at TP rank 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    stage = _CalibrationStage(monkeypatch, layers=[3])
    groups = []

    def all_gather_object(out, obj, group):
        groups.append(("all_gather_object", group))
        out[:] = [[1, 2], obj]

    def get_world_size(group):
        groups.append(("get_world_size", group))
        return {"pp": 2, "token group": 2}[group]

    def all_reduce(buffer, op, group):
        groups.append(("all_reduce", group, op))
        buffer.mul_(2)  # the other data-parallel rank's tokens: a copy of this rank's
        buffer[-N:] += 64  # and 64 more routes to every expert, in the loads only

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", get_world_size)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    ranks = {"token group": 0}
    monkeypatch.setattr(dist, "get_rank", lambda group: ranks[group])
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: ranks["tp"])
    loads = (
        2
        * sum(
            torch.bincount(cutoff_route(stage.scores(seed, 3, 0), torch.zeros(N), K)[0].reshape(-1))
            for seed in (11, 12, 13, 14)
        ).double()
    )
    max_vio_before = ((loads.max() - loads.mean()) / (loads.mean() + 64)).item()
    for token_rank, tp_rank, reports in ((0, 0, True), (1, 0, False), (0, 1, False)):
        ranks.update({"token group": token_rank, "tp": tp_rank})
        stage.passes.clear()
        stage.routers[0].expert_bias.zero_()
        lines = []
        groups.clear()
        results = stage.calibration(lines).calibrate(stage.call)
        assert [r.layer_number for r in results] == [3]
        assert results[0].max_vio_before == pytest.approx(max_vio_before, rel=1e-12)
        assert groups.count(("all_reduce", "token group", dist.ReduceOp.SUM)) == (
            QB_CALIBRATION_ITERS + 1
        )
        assert [batches for batches, _, _ in stage.passes] == [[11, 12], [13, 14]] * 3
        assert len(lines) == (2 if reports else 0), (token_rank, tp_rank)
    assert groups[:3] == [("get_world_size", "pp")] * 2 + [("all_gather_object", "pp")]
    assert stage.routers[0].expert_bias.abs().sum() > 0


def test_calibration_runs_once(monkeypatch):
    """Once per run: a step called again at iteration 0 does not calibrate again."""

    def train_step(
        forward_step_func, data_iterator, model, config, forward_backward_func, iteration=None
    ):
        return iteration

    cal = QBCalibration(2, train_iters=10, global_batch_size=8, seq_length=4, micro_batch_size=1)
    seen = []
    cal.calibrate = lambda call: seen.append(call["iteration"])
    step = cal.wrap_train_step(train_step)
    assert [step(None, None, None, None, None, iteration=0) for _ in range(2)] == [0, 0]
    assert seen == [0]


def test_a_release_of_a_qb_run_resumed_keeps_its_bias(capsys):
    """``--load`` of a release checkpoint (megatron-core 0.19.2: iteration 0, its model, the QB
    bias included): calibration replaced that bias. Now it is kept, and one line says so; with
    ``--finetune``, of another balancer's run, or of a non-release folder it calibrates."""
    from types import SimpleNamespace

    from megatron_latentmoe.training.qb_calibrate import kept_bias_line

    args = SimpleNamespace(finetune=False, moe_qb_calibrate_batches=2)
    qb = SimpleNamespace(moe_router_load_balancing_type=["quantile_histogram"])
    line = kept_bias_line(args, qb, "/ckpt/release", "load")
    assert line == (
        "[QB calibration] skipped (--moe-qb-calibrate-batches 2): the model loads its QB bias "
        "from the release checkpoint /ckpt/release; pass --finetune to calibrate anew"
    )
    other = SimpleNamespace(moe_router_load_balancing_type="aux_loss")
    assert kept_bias_line(args, other, "/ckpt/release", "load") is None
    assert kept_bias_line(args, qb, "/ckpt/iter_0000004", "load") is None
    assert kept_bias_line(args, qb, "/ckpt/release", "pretrained_checkpoint") is None
    args.finetune = True
    assert kept_bias_line(args, qb, "/ckpt/release", "load") is None

    assert _calibrated_iterations(0, kept_bias=line) == []
    assert capsys.readouterr().out == line + "\n"
