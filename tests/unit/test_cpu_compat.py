"""Each shim of megatron_latentmoe.compat does its job, and megatron-core fails without it.

The shims are applied in this process only for the duration of a test (``compat`` fixture) and
reverted afterwards, so other tests see torch as it was. The two-rank checks (uneven all-gather,
``initialize_parallel_cpu``) run in one spawned gloo world.
"""

from __future__ import annotations

import subprocess
import sys
import typing
import warnings
from pathlib import Path

import pytest
import torch

from megatron_latentmoe.compat import cpu, registry

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU shims are inert when CUDA is available"
)


@pytest.fixture
def compat():
    """Shims applied for this test only (re-applied afterwards if they were on before)."""
    was_applied = registry.is_applied("cpu")
    cpu.revert_cpu_compat()
    assert cpu.apply_cpu_compat()
    yield cpu
    cpu.revert_cpu_compat()
    if was_applied:
        cpu.apply_cpu_compat()


@pytest.fixture
def no_compat():
    """Shims off for this test (re-applied afterwards if they were on before)."""
    was_applied = registry.is_applied("cpu")
    cpu.revert_cpu_compat()
    yield
    if was_applied:
        cpu.apply_cpu_compat()


def _mode_on():
    from torch.overrides import _get_current_function_mode_stack

    return sum(isinstance(m, cpu.CudaToCpuDeviceMode) for m in _get_current_function_mode_stack())


# ------------------------------------------------------------------ apply / version / revert
def test_apply_is_idempotent(compat):
    patched = registry.patched()
    assert cpu.apply_cpu_compat() and cpu.apply_cpu_compat()
    assert registry.patched() == patched and _mode_on() == 1


def test_noop_when_cuda_is_available(no_compat, monkeypatch):
    original_current_device = torch.cuda.current_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu.apply_cpu_compat() is False
    assert not registry.patched("cpu") and not registry.patched("core") and _mode_on() == 0
    assert torch.cuda.current_device is original_current_device


def test_revert_restores_torch(no_compat):
    originals = (torch.cuda.Stream, torch.cuda.current_device, torch.autograd._engine_run_backward)
    cpu.apply_cpu_compat()
    cpu.revert_cpu_compat()
    assert (
        torch.cuda.Stream,
        torch.cuda.current_device,
        torch.autograd._engine_run_backward,
    ) == originals
    assert not registry.patched("cpu") and not registry.patched("core") and _mode_on() == 0


def test_version_check(no_compat, monkeypatch):
    import megatron.core

    monkeypatch.delenv(registry.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(megatron.core, "__version__", "0.19.2+abc1234")  # git suffix: fine
    assert registry.check_megatron_core_version() == "0.19.2"
    monkeypatch.setattr(megatron.core, "__version__", "0.18.0")
    with pytest.raises(RuntimeError, match="0.19.2, found 0.18.0"):
        registry.check_megatron_core_version()
    with pytest.raises(RuntimeError, match="MEGATRON_LATENTMOE_ALLOW_UNTESTED_MCORE"):
        cpu.apply_cpu_compat()
    assert not registry.patched("cpu") and not registry.patched("core")  # refused before patching
    monkeypatch.setenv(registry.ALLOW_UNTESTED_ENV, "0")  # only "1" allows
    with pytest.raises(RuntimeError, match="found 0.18.0"):
        registry.check_megatron_core_version()
    monkeypatch.setenv(registry.ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(RuntimeWarning, match="found 0.18.0"):
        assert registry.check_megatron_core_version() == "0.18.0"


def test_version_check_wants_the_tested_release_exactly(no_compat, monkeypatch):
    """A neighbouring patch release or a pre-release is refused too (the patched functions are
    0.19.2's), and a refused apply leaves its groups unapplied: the next apply refuses again
    instead of returning as if the shims were on."""
    import re

    import megatron.core

    monkeypatch.delenv(registry.ALLOW_UNTESTED_ENV, raising=False)
    for version in ("0.19.1", "0.19.3", "0.19.2rc1"):
        monkeypatch.setattr(megatron.core, "__version__", version)
        message = (
            f"megatron_latentmoe's compat shims were written for megatron-core 0.19.2, found "
            f"{version}: the patched functions may have moved or changed. Install "
            "megatron-core==0.19.2 or set MEGATRON_LATENTMOE_ALLOW_UNTESTED_MCORE=1 to try anyway."
        )
        with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
            registry.check_megatron_core_version()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="found 0.19.2rc1"):
            cpu.apply_cpu_compat()
        assert not registry.is_applied("cpu") and not registry.is_applied("core")
        assert not registry.patched("cpu") and not registry.patched("core") and _mode_on() == 0


def test_tested_version_is_pyprojects_pin():
    """The install scripts read the pin from pyproject.toml; the version check must agree."""
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "pyproject_requirements.py"), "megatron-core"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == f"megatron-core=={registry.TESTED_MEGATRON_CORE_VERSION}\n"


def test_registry_revert_restores_the_owners_own_entries():
    """A staticmethod comes back as one (the norm shim patches ``WrappedTorchNorm.__new__``), and
    an inherited attribute is deleted again, not copied onto the subclass."""

    class Base:
        def inherited(self):
            return "base"

    class Owner(Base):
        @staticmethod
        def build(x):
            return x + 1

    try:
        registry.apply_group(
            "test-own",
            [
                lambda: registry.patch("test-own", Owner, "build", staticmethod(lambda x: x)),
                lambda: registry.patch("test-own", Owner, "inherited", lambda self: "patched"),
            ],
        )
        assert (Owner.build(1), Owner().inherited()) == (1, "patched")
    finally:
        registry.revert("test-own")
    assert type(vars(Owner)["build"]) is staticmethod and Owner().build(1) == 2
    assert "inherited" not in vars(Owner) and Owner().inherited() == "base"


def test_registry_reverts_one_group_and_refuses_to_reapply():
    class Owner:
        a, b = 1, 2

    try:
        assert registry.apply_group("test-a", [lambda: registry.patch("test-a", Owner, "a", 10)])
        assert not registry.apply_group(
            "test-a", [lambda: registry.patch("test-a", Owner, "a", 11)]
        )
        registry.apply_group("test-b", [lambda: registry.patch("test-b", Owner, "b", 20)])
        assert (Owner.a, Owner.b) == (10, 20) and registry.patched("test-a") == [(Owner, "a", 1)]
        assert registry.patched()[-2:] == [(Owner, "a", 1), (Owner, "b", 2)]  # every group
        registry.revert("test-a")
        assert (Owner.a, Owner.b) == (1, 20) and not registry.is_applied("test-a")
        with pytest.raises(ZeroDivisionError):  # a failing shim leaves nothing of its group
            registry.apply_group(
                "test-a", [lambda: registry.patch("test-a", Owner, "a", 12), lambda: 1 / 0]
            )
        assert Owner.a == 1 and not registry.is_applied("test-a")
    finally:
        registry.revert("test-a")
        registry.revert("test-b")
    assert Owner.b == 2


def test_registry_revert_of_every_group(monkeypatch):
    class Owner:
        a = 1

    monkeypatch.setattr(registry, "_patched", [])  # the live groups stay out of this
    monkeypatch.setattr(registry, "_groups", set())
    registry.apply_group("test-a", [lambda: registry.patch("test-a", Owner, "a", 10)])
    registry.revert()
    assert Owner.a == 1 and not registry.is_applied("test-a") and not registry.patched()


def test_compile_nothing_gives_the_function_back():
    """megatron-core's import-time ``torch.compile`` call forms (CPU imports)."""

    def fn(x):
        return x

    assert registry._compile_nothing(fn) is fn  # @torch.compile
    assert registry._compile_nothing(fn, dynamic=True) is fn  # torch.compile(fn, ...)
    assert registry._compile_nothing(dynamic=True)(fn) is fn  # torch.compile(...)(fn)


# ------------------------------------------------------------------ streams and device queries
def test_streams(compat):
    stream, current = torch.cuda.Stream(), torch.cuda.current_stream()
    assert stream != current and torch.cuda.current_stream() is current
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        event = stream.record_event()
    event.synchronize()
    assert event.query()


def test_streams_fail_without_shim(no_compat):
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.Stream()


def test_device_queries(compat):
    from megatron.core.parallel_state import GlobalMemoryBuffer

    assert torch.cuda.current_device() == torch.device("cpu")
    torch.cuda.synchronize()
    buffer = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "test")  # uses current_device
    assert buffer.device.type == "cpu" and buffer.shape == (2, 3)


def test_device_queries_fail_without_shim(no_compat):
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


# ------------------------------------------------------------------ device="cuda" literals
def test_mode_maps_cuda_to_cpu(compat):
    from megatron.core.transformer.utils import get_default_causal_mask

    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device="cuda:1").device.type == "cpu"
    assert torch.ones(2).to(device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"  # what megatron's optimizers check
    assert torch.ones(2).type(torch.float64).dtype == torch.float64
    assert torch.ones(2).type(dtype=torch.float64).dtype == torch.float64
    mask = get_default_causal_mask(4)  # builds with device="cuda"
    assert torch.equal(mask, torch.ones(4, 4).triu(1).bool())


def test_mode_fails_without_shim(no_compat):
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")


def test_mode_stays_on_in_backward(compat):
    """Activation recompute re-runs the forward (with its device="cuda" mask) inside backward."""
    from megatron.core.tensor_parallel import checkpoint
    from megatron.core.transformer.utils import get_default_causal_mask

    def attention_like(x):
        return x.masked_fill(get_default_causal_mask(x.shape[-1]), 0.0).sum(-1)

    x = torch.randn(3, 3, requires_grad=True)
    checkpoint(attention_like, False, x).sum().backward()
    assert torch.equal(x.grad, (~get_default_causal_mask(3)).float())


def test_mode_in_backward_only_on_threads_that_entered_it(compat):
    """The backward re-enters the mode only on a thread that applied the shims: another thread
    (which never called apply_cpu_compat) runs its backward without it."""
    import threading

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(_mode_on())
            return grad

    def backward():
        Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()

    backward()
    thread = threading.Thread(target=backward)
    thread.start()
    thread.join()
    assert seen == [1, 0]


# ------------------------------------------------------------------ RNG
def test_rng_tracker_fork(compat):
    from megatron.core.tensor_parallel import random as mrandom

    def draws(tracker, name, n=2):
        out = []
        for _ in range(n):
            with tracker.fork(name):
                out.append(torch.rand(4))
        return out

    before = torch.get_rng_state()
    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("a", 11)
    tracker.add("b", 12)
    a1, a2 = draws(tracker, "a")
    (b1,) = draws(tracker, "b", 1)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default generator"
    assert not torch.equal(a1, a2) and not torch.equal(a1, b1), "streams advance and differ"
    again = mrandom.CudaRNGStatesTracker()
    again.add("a", 11)
    assert all(map(torch.equal, draws(again, "a"), [a1, a2])), "same seed, same stream"
    with tracker.fork("a"), tracker.fork("b"):  # nested: each name keeps its own stream
        b2 = torch.rand(4)
    with tracker.fork("a"):
        a3 = torch.rand(4)
    twin = mrandom.CudaRNGStatesTracker()
    twin.add("a", 11)
    twin.add("b", 12)
    ta, tb = draws(twin, "a", 3), draws(twin, "b", 2)
    assert torch.equal(a3, ta[2]) and torch.equal(b2, tb[1])
    with pytest.raises(Exception, match="seed 11 already exists"):
        tracker.add("c", 11)
    with pytest.raises(Exception, match="cpu rng state a already exists"):
        tracker.add("a", 13)
    with pytest.raises(Exception, match="cpu rng state c is not added"), tracker.fork("c"):
        pass
    assert tracker.is_initialized() and not mrandom.CudaRNGStatesTracker().is_initialized()


def test_rng_tracker_fork_back_into_an_outer_name(compat):
    """a -> b -> a: the innermost fork continues a's stream where the outer one left it, and a's
    stream continues after b past both."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker, twin = mrandom.CudaRNGStatesTracker(), mrandom.CudaRNGStatesTracker()
    for t in (tracker, twin):
        t.add("a", 11)
        t.add("b", 12)
    with tracker.fork("a"):
        x1 = torch.rand(2)
        with tracker.fork("b"):
            y1 = torch.rand(2)
            with tracker.fork("a"):
                x2 = torch.rand(2)
            y2 = torch.rand(2)
        x3 = torch.rand(2)
    with twin.fork("a"):
        a_stream = torch.rand(6).view(3, 2)
    with twin.fork("b"):
        b_stream = torch.rand(4).view(2, 2)
    assert torch.equal(torch.stack([x1, x2, x3]), a_stream)
    assert torch.equal(torch.stack([y1, y2]), b_stream)


def test_rng_tracker_made_before_the_shim_is_replaced(no_compat, monkeypatch):
    """A tracker Megatron created before the shims (CUDA-backed) is replaced by a CPU one."""
    from megatron.core.tensor_parallel import random as mrandom

    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", mrandom.CudaRNGStatesTracker())
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    try:
        cpu.apply_cpu_compat()
        assert isinstance(mrandom.get_cuda_rng_tracker(), cpu._cpu_rng_tracker_class())
    finally:
        cpu.revert_cpu_compat()


def test_model_parallel_seed_uses_cpu_tracker(compat):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel import random as mrandom

    def expert_draw(ep_rank):
        model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=ep_rank, etp_rank=0)
        with get_cuda_rng_tracker().fork(mrandom.get_expert_parallel_rng_tracker_name()):
            return torch.rand(4)

    assert torch.equal(expert_draw(0), expert_draw(0))
    assert not torch.equal(expert_draw(0), expert_draw(1)), "EP ranks get distinct streams"
    assert isinstance(get_cuda_rng_tracker(), cpu._cpu_rng_tracker_class())


def test_recompute_replays_dropout_mask(compat):
    """CheckpointFunction saves/restores the "CUDA" RNG state: the recomputed mask must match."""
    from megatron.core.tensor_parallel import checkpoint, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    x = torch.ones(64, requires_grad=True)
    out = checkpoint(lambda t: torch.nn.functional.dropout(t, 0.5, training=True), False, x)
    out.sum().backward()
    assert 0 < int((out == 0).sum()) < 64
    assert torch.equal(x.grad, out.detach()), "recompute drew a different dropout mask"


def test_cuda_rng_state_functions_use_cpu_generator(compat):
    """torch.cuda.{get,set}_rng_state (megatron.training checkpointing, rerun state machine) and
    megatron's _get/_set_cuda_rng_state (activation recompute) save and restore the CPU stream."""
    from megatron.core.tensor_parallel import random as mrandom

    for get, set_ in [
        (torch.cuda.get_rng_state, torch.cuda.set_rng_state),
        (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state),
    ]:
        state = get()
        first = torch.rand(3)
        set_(state)
        assert torch.equal(torch.rand(3), first)


def test_rng_fails_without_shim(no_compat):
    from megatron.core.tensor_parallel import random as mrandom

    with pytest.raises((RuntimeError, AssertionError)):
        mrandom.CudaRNGStatesTracker().add("x", 1)


# ------------------------------------------------------------------ MoE dispatch / norm
def test_alltoall_split_sizes_become_numpy(compat):
    import numpy as np
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    splits = torch.tensor([3, 5])
    assert torch.is_tensor(moe_utils.maybe_move_tensor_to_cpu(splits, as_numpy=True))  # unpatched
    converted = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    assert isinstance(converted, np.ndarray) and converted.tolist() == [3, 5]
    assert token_dispatcher.maybe_move_tensor_to_cpu(splits) is splits


def _sp_config(**kwargs):
    from megatron.core.transformer import TransformerConfig

    kwargs = {"sequence_parallel": True, **kwargs}
    return TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        tensor_model_parallel_size=2,
        normalization="RMSNorm",
        **kwargs,
    )


def test_torch_norm_accepts_sequence_parallel(compat):  # compat.core, applied by apply_cpu_compat
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _sp_config()
    norm = WrappedTorchNorm(config=config, hidden_size=8, eps=0.5)  # not the default 1e-5
    assert isinstance(norm, torch.nn.RMSNorm) and config.sequence_parallel
    assert all(p.sequence_parallel for p in norm.parameters())  # grads all-reduced over TP
    x = torch.randn(3, 8)
    assert norm.eps == 0.5
    assert torch.allclose(norm(x), torch.nn.functional.rms_norm(x, (8,), norm.weight, 0.5))
    # megatron.training's default --persist-layer-norm (an apex kernel choice) is accepted too
    config = _sp_config(sequence_parallel=False, persist_layer_norm=True)
    norm = WrappedTorchNorm(config=config, hidden_size=8, eps=1e-5)
    assert not any(p.sequence_parallel for p in norm.parameters()) and config.persist_layer_norm


def test_torch_norm_refuses_sequence_parallel_without_shim(no_compat):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(config=_sp_config(), hidden_size=8)
    with pytest.raises(AssertionError, match="persist_layer_norm"):
        WrappedTorchNorm(
            config=_sp_config(sequence_parallel=False, persist_layer_norm=True), hidden_size=8
        )


def test_distributed_optimizer_saves_twice_before_its_first_step(compat):
    """An ``--fp16`` run whose steps were all skipped by the loss scaler (it starts at 2**32,
    halved per overflow) saves a distributed optimizer whose torch Adam never stepped. Saving
    reads each parameter's state through ``optimizer.state[param]``, a defaultdict that leaves
    an empty entry behind, so the second such save met entries without a step: KeyError
    ``'step'`` (the entry point with ``--fp16 --use-distributed-optimizer --save-interval 2``
    died at iteration 4's save). Each save gives the fresh optimizer's step-0 param groups."""
    import types

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))]
    opt = DistributedOptimizer.__new__(DistributedOptimizer)  # only what state_dict reads
    opt.optimizer = torch.optim.Adam(params, lr=1e-3)
    opt.grad_scaler = None
    opt.config = types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    opt.model_param_group_index_map = {p: (0, i) for i, p in enumerate(params)}
    for _ in range(2):  # one save: the non-tensor state, then every parameter's tensors
        state = opt.state_dict()
        assert [g["step"] for g in state["optimizer"]["param_groups"]] == [0.0]
        for p in params:
            assert set(opt._get_main_param_and_optimizer_states(p)) == {"param"}
    assert len(opt.optimizer.state) == 2  # the empty entries the reads left behind


def test_dataset_helpers_need_no_make(compat):
    import megatron.core.datasets.utils as dutils

    assert dutils.compile_helpers is not registry.patched("core")[-1][2]
    dutils.compile_helpers()  # Megatron's runs `make` (no Makefile in the wheel) and sys.exit(1)
    from megatron.core.datasets import helpers

    assert hasattr(helpers, "build_sample_idx")


def test_dataset_helpers_missing_extension_is_named(compat, monkeypatch):
    import megatron.core.datasets.utils as dutils

    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)  # import fails
    with pytest.raises(RuntimeError, match=r"megatron.core.datasets.helpers_cpp .* reinstall"):
        dutils.compile_helpers()


def test_dataset_helpers_source_checkout_keeps_megatrons_build(no_compat, monkeypatch):
    """With a Makefile beside the helpers (a source checkout) Megatron's ``make`` stays."""
    import os

    import megatron.core.datasets.utils as dutils

    megatrons = dutils.compile_helpers
    makefile = os.path.join(os.path.dirname(dutils.__file__), "Makefile")
    isfile = os.path.isfile
    monkeypatch.setattr(os.path, "isfile", lambda path: path == makefile or isfile(path))
    try:
        cpu.apply_cpu_compat()
        assert dutils.compile_helpers is megatrons
    finally:
        cpu.revert_cpu_compat()


def test_dataset_helpers_make_fails_without_shim(no_compat, capfd):
    import megatron.core.datasets.utils as dutils

    with pytest.raises(SystemExit):
        dutils.compile_helpers()


# ------------------------------------------------------------------ initialize_parallel_cpu
@pytest.mark.parametrize("dp_random_init, seed", [(False, 1100), (True, 1120)])
def test_initialize_parallel_cpu_seeds_like_megatron(compat, monkeypatch, dp_random_init, seed):
    """Megatron's sizes go to initialize_model_parallel as given; the seed is ``seed + 100 *
    pp_rank`` (``+ 10 * dp_rank`` with data_parallel_random_init) for random, numpy, torch and
    the model-parallel tracker (here pipeline rank 1, data-parallel rank 2)."""
    import random

    import numpy as np
    from megatron.core import parallel_state, tensor_parallel

    calls = {}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(
        parallel_state, "initialize_model_parallel", lambda **kw: calls.setdefault("groups", kw)
    )
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_data_parallel_rank", lambda: 2)
    monkeypatch.setattr(
        tensor_parallel, "model_parallel_cuda_manual_seed", lambda s: calls.setdefault("mp", s)
    )
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        cpu.initialize_parallel_cpu(2, 3, 4, 5, 6, 1000, dp_random_init, order="tp-cp-ep-pp-dp")
        draws = random.random(), np.random.rand(), torch.rand(1).item()
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
    assert calls["groups"] == dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=3,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=5,
        context_parallel_size=6,
        order="tp-cp-ep-pp-dp",
    )
    assert calls["mp"] == seed
    assert draws == (
        random.Random(seed).random(),
        np.random.RandomState(seed).rand(),
        torch.rand(1, generator=torch.Generator().manual_seed(seed)).item(),
    )


def test_initialize_parallel_cpu_needs_a_process_group(compat, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="initialise the \\(gloo\\) default process group"):
        cpu.initialize_parallel_cpu()


# ------------------------------------------------------------------ two ranks
def _two_rank_checks(rank, world_size):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, mappings

    cpu.initialize_parallel_cpu(tensor_model_parallel_size=2, seed=3)
    tp_group = ps.get_tensor_model_parallel_group()
    backend = torch.distributed.get_backend(tp_group)
    states = sorted(get_cuda_rng_tracker().get_states())
    # uneven all-gather (alltoall dispatcher with TP/ETP > 1): rank r sends r + 2 rows
    sizes = [2, 3]
    local = torch.full((sizes[rank], 4), float(rank + 1))
    gathered = mappings._gather_along_first_dim(local, tp_group, output_split_sizes=sizes)
    (megatrons,) = [
        f for o, n, f in registry.patched() if o is mappings and n == "_gather_along_first_dim"
    ]
    try:
        megatrons(local, tp_group, output_split_sizes=sizes)
        unpadded_error = None
    except RuntimeError as err:
        unpadded_error = str(err)
    return backend, states, gathered, unpadded_error


@pytest.mark.slow
def test_two_ranks_initialize_and_uneven_all_gather():
    from tests.parallel.launcher import run_distributed

    for backend, states, gathered, unpadded_error in run_distributed(_two_rank_checks, 2):
        assert backend == "gloo"
        assert states == ["data-parallel-rng", "expert-parallel-rng", "model-parallel-rng"]
        expected = torch.cat([torch.full((2, 4), 1.0), torch.full((3, 4), 2.0)])
        assert torch.equal(gathered, expected)
        assert "invalid tensor size" in unpadded_error  # what gloo says without the padding


def test_python311_override_alias():
    import sys

    from megatron_latentmoe.compat import apply_python311_compat

    if sys.version_info >= (3, 12):
        assert apply_python311_compat() is False
        return
    assert apply_python311_compat() is True
    with pytest.MonkeyPatch.context() as mp:  # what 3.12 (typing.override built in) gets
        mp.setattr(sys, "version_info", (3, 12, 0))
        mp.delattr(typing, "override")
        assert apply_python311_compat() is False and not hasattr(typing, "override")
    import typing_extensions

    assert typing.override is typing_extensions.override
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.training.models.gpt  # noqa: F401  (uses `from typing import override`)


_IMPORT_PROBE = """
import sys, time, torch
import megatron_latentmoe.compat.registry as registry
compile_ = torch.compile
start = time.perf_counter()
{how}
seconds = time.perf_counter() - start
import megatron.core.jit as jit
import megatron.core.transformer.moe.router  # decorated with @torch.compile at import
fn = lambda x: x
print(
    "torch._dynamo" in sys.modules, "torch._inductor" in sys.modules,
    jit.jit_fuser(fn) is fn, torch.compile is compile_, f"{{seconds:.2f}}",
)
"""


def test_megatron_core_imports_without_its_compile_wrappers():
    """Without CUDA, compat imports megatron-core with torch.compile compiling nothing: its ~40
    import-time wrappers would import dynamo and inductor (a plain ``import megatron.core`` in
    this probe prints ``True True False True``: 4.3 s against 2.3 s, measured)."""
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE.format(how="registry.check_megatron_core_version()")],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout.split()
    print(out)
    # no dynamo / inductor; jit_fuser leaves functions alone; torch.compile itself restored
    assert out[:4] == ["False", "False", "True", "True"], out
