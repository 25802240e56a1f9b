"""Shims that let megatron-core 0.19.2 run on CPU-only machines with the gloo backend.

Megatron-Core assumes CUDA: it creates CUDA streams, asks ``torch.cuda.current_device()`` for
allocation devices, writes ``device="cuda"`` literals, keeps its model-parallel RNG states in the
CUDA generator, and hands collectives inputs that gloo refuses. :func:`apply_cpu_compat` installs
one small named shim per wall (each docstring names the megatron-core code it works around and
why); with CUDA available it does nothing. :func:`initialize_parallel_cpu` then builds Megatron's
parallel groups and seeds its RNG tracker in an initialised gloo world -- the step
``megatron.training.initialize`` skips when there is no GPU.

Patches go through :mod:`.registry` (version-checked, revertible) and include :mod:`.core`'s,
except :class:`CudaToCpuDeviceMode`: a ``TorchFunctionMode`` is per thread, so it is entered on
the thread that calls :func:`apply_cpu_compat` (call it again on any other thread that runs
Megatron code).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from . import core, registry

_CPU = torch.device("cpu")
_GROUP = "cpu"
_modes: dict[int, CudaToCpuDeviceMode] = {}  # thread id -> the mode entered on that thread


def _patch(owner: object, name: str, value: object) -> None:
    registry.patch(_GROUP, owner, name, value)


# ----------------------------------------------------------------- CUDA streams and device queries
class _InertEvent:
    """A CUDA event stand-in: on CPU every operation has already completed."""

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _InertStream:
    """A CUDA stream stand-in: on CPU all work is synchronous, so ordering is a no-op."""

    device = _CPU

    def __init__(self, device=None, priority=0, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _InertEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


_DEFAULT_STREAM = _InertStream()


def _shim_streams() -> None:
    """Inert ``torch.cuda.Stream`` and ``torch.cuda.current_stream``.

    ``MoEAlltoAllTokenDispatcher.__init__`` (transformer/moe/token_dispatcher.py) creates a
    ``torch.cuda.Stream`` for its device-to-host copies, which a CPU build of torch refuses; its
    ``_maybe_dtoh_and_synchronize`` compares it with ``torch.cuda.current_stream()``, waits on
    it, enters ``torch.cuda.stream(it)`` (already a no-op without CUDA) and synchronises on the
    event returned by ``record_event()``. CPU work is synchronous, so inert objects suffice.
    """
    _patch(torch.cuda, "Stream", _InertStream)
    _patch(torch.cuda, "current_stream", lambda device=None: _DEFAULT_STREAM)


def _shim_device_queries() -> None:
    """``torch.cuda.current_device()`` returns the CPU device; ``torch.cuda.synchronize`` no-ops.

    ``current_device()`` is megatron-core's allocation device nearly everywhere:
    ``tensor_parallel/mappings.py`` (gather / all-to-all buffers), ``transformer/moe/router.py``,
    RoPE and attention (``transformer/attention.py``), ``parallel_state.GlobalMemoryBuffer``,
    the p2p buffers of ``pipeline_parallel/p2p_communication.py`` and DDP's
    ``distributed/param_and_grad_buffer.py``. ``synchronize()`` is called by every
    ``megatron.core.timers`` start/stop (the training loop times each step) and after batched
    p2p ops in ``p2p_communication._batched_p2p_ops``.
    """
    _patch(torch.cuda, "current_device", lambda: _CPU)
    _patch(torch.cuda, "synchronize", lambda device=None: None)


# -------------------------------------------------------------------------- device="cuda" literals
def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuDeviceMode(TorchFunctionMode):
    """Run torch calls that name a CUDA device on the CPU; report CPU tensors as CUDA types.

    * A ``device=`` keyword naming CUDA (factory functions, ``Tensor.to``) becomes the CPU.
      Megatron-core writes ``device="cuda"`` where nothing narrower than copying its code can
      change it: ``pipeline_parallel/schedules.py`` (``total_num_tokens`` in every
      forward-backward schedule), ``optimizer/optimizer.py`` (``FP32Optimizer._scale``),
      ``transformer/utils.py`` (``get_default_causal_mask`` of the local
      ``DotProductAttention``); ``megatron/training/training.py`` has a dozen more.
    * ``Tensor.cuda()`` returns the tensor (``nn.Module.cuda`` goes through it): used by
      ``megatron/training`` (``get_batch``, model set-up), ``language_module`` for tied
      embeddings across pipeline stages, and optimizer/grad-scaler state loading.
    * ``Tensor.type()`` answers ``torch.cuda.<X>Tensor``: the optimizers tell fp32 from fp16 /
      bf16 parameters by CUDA type names (``optimizer/clip_grads.py``
      ``clip_grad_by_total_norm_fp32`` asserts ``'torch.cuda.FloatTensor'``;
      ``Float16OptimizerWithFloat16Params`` and ``DistributedOptimizer`` raise on other names).

    A mode is used because the ``device="cuda"`` literals sit inside long functions. It costs one
    Python call per torch call: fwd+bwd of a GPT-MoE with hidden 64 / seq 32 took 1.35x as long
    (7.9 vs 5.8 ms), with hidden 256 / seq 256 or more no difference was measurable. The maths is
    untouched.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and "dtype" not in kwargs:
            return func(*args, **kwargs).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _enter_cuda_to_cpu_mode() -> None:
    """Enter :class:`CudaToCpuDeviceMode` on the calling thread (once per thread)."""
    tid = threading.get_ident()
    if tid not in _modes:
        mode = CudaToCpuDeviceMode()
        mode.__enter__()
        _modes[tid] = mode


def _shim_mode_in_backward() -> None:
    """Keep :class:`CudaToCpuDeviceMode` on during the backward pass.

    A TorchFunctionMode is off while it handles a call, and ``Tensor.backward`` /
    ``torch.autograd.backward`` / ``grad`` are such calls: the whole backward pass would run
    without the mode. Megatron's activation recompute needs it there:
    ``tensor_parallel/random.py CheckpointFunction.backward`` re-runs the forward, which builds
    the causal mask with ``device="cuda"``. ``torch.autograd._engine_run_backward`` (torch's
    step from those functions into the C++ engine) re-enters the mode on threads that entered it.
    """
    original = torch.autograd._engine_run_backward

    def _engine_run_backward(*args, **kwargs):
        on = threading.get_ident() in _modes and not any(
            isinstance(m, CudaToCpuDeviceMode) for m in _get_current_function_mode_stack()
        )
        with CudaToCpuDeviceMode() if on else contextlib.nullcontext():
            return original(*args, **kwargs)

    _patch(torch.autograd, "_engine_run_backward", _engine_run_backward)


# --------------------------------------------------------------------------------------------- RNG
def _cpu_get_rng_state(device=None, clone=False, graph_safe=False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=None, graph_safe=False) -> None:
    torch.set_rng_state(new_state)


@functools.cache
def _cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's model-parallel RNG tracker with its named states kept for the CPU generator.

        ``add`` seeds a private generator (the global one is left alone); ``fork`` swaps the
        named state into the CPU default generator and back, like the CUDA original does with the
        CUDA generator (without its "CPU RNG state changed" warning, which would always fire).
        """

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cpu rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"cpu rng state {name} is not added")
            outer_state, outer_name = torch.get_rng_state(), self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


def _shim_rng() -> None:
    """Keep Megatron's "CUDA" RNG states in the CPU generator.

    * ``tensor_parallel/random.py``: ``initialize_rng_tracker`` (behind ``get_cuda_rng_tracker``
      and ``model_parallel_cuda_manual_seed``) instantiates the module's ``CudaRNGStatesTracker``,
      whose ``add``/``fork`` read and write the CUDA generator; it is replaced by a subclass
      working on the CPU generator. ``_get_cuda_rng_state``/``_set_cuda_rng_state`` (activation
      recompute: ``CheckpointFunction``, ``_fork_rng``) read/write the CPU generator. Megatron's
      getter raises without CUDA; its setter silently appends a lazy CUDA call that never runs to
      ``torch.cuda._queued_calls`` (one more per recomputed layer, forever).
    * ``torch.cuda.get_rng_state``/``set_rng_state``: called directly by
      ``megatron/training/checkpointing.py`` (even with ``--no-save-rng``) and
      ``rerun_state_machine.py``; they return/set the CPU state.
    * ``torch.cuda.manual_seed`` stays the lazy no-op a CPU build makes it: seed the CPU
      generator with ``torch.manual_seed`` as Megatron's ``_set_random_seed`` already does.
    """
    from megatron.core.tensor_parallel import random as mrandom

    _patch(torch.cuda, "get_rng_state", _cpu_get_rng_state)
    _patch(torch.cuda, "set_rng_state", _cpu_set_rng_state)
    _patch(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
    _patch(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
    _patch(mrandom, "CudaRNGStatesTracker", _cpu_rng_tracker_class())
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not isinstance(tracker, mrandom.CudaRNGStatesTracker):
        mrandom.initialize_rng_tracker(force_reset=True)  # made before the patch: CUDA-backed


# ------------------------------------------------------ MoE token dispatch and collectives on gloo
def _shim_alltoall_split_sizes() -> None:
    """Hand the alltoall dispatcher's split sizes to ``all_to_all_single`` as lists, not tensors.

    ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` (transformer/moe/token_dispatcher.py)
    turns ``input_splits``/``output_splits``/``output_splits_tp`` into numpy arrays with
    ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``, which only converts CUDA tensors;
    on CPU they stay tensors and ``torch.distributed.all_to_all_single`` raises a TypeError for
    tensor split sizes. The dispatcher's imported name is replaced by a version that also
    converts CPU tensors when ``as_numpy`` is asked for.
    """
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


def _shim_uneven_all_gather() -> None:
    """Pad the uneven all-gather that gloo refuses.

    ``tensor_parallel/mappings._gather_along_first_dim`` with ``output_split_sizes`` (used by
    ``gather_from_sequence_parallel_region``: the alltoall dispatcher's token gather over the
    TP/ETP group and its backward of the reduce-scatter) calls
    ``torch.distributed.all_gather`` with a list of differently sized tensors; gloo requires
    equal sizes. Here every rank's input is padded along dim 0 to the largest split, gathered,
    and trimmed back. Equal-split calls go to Megatron's function unchanged. (Uneven list
    ``reduce_scatter``, the other direction, works on gloo.)
    """
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(gathered, padded, group=group)
        return torch.cat([t[:n] for t, n in zip(gathered, output_split_sizes, strict=True)])

    _patch(mappings, "_gather_along_first_dim", _gather_along_first_dim)


_SHIMS = (
    _shim_streams,
    _shim_device_queries,
    _shim_rng,
    _shim_alltoall_split_sizes,
    _shim_uneven_all_gather,
    _shim_mode_in_backward,
)


def apply_cpu_compat() -> bool:
    """Install the CPU shims and :func:`.core.apply_core_compat` (idempotent). Returns False,
    doing nothing, when CUDA is available.

    Raises RuntimeError if megatron-core is not the tested version
    (:func:`.registry.check_megatron_core_version`).
    """
    if torch.cuda.is_available():
        return False
    core.apply_core_compat()
    registry.apply_group(_GROUP, _SHIMS)
    _enter_cuda_to_cpu_mode()
    return True


def revert_cpu_compat() -> None:
    """Undo :func:`apply_cpu_compat` (for tests): restore every patched attribute (the
    :mod:`.core` ones too), leave the mode.

    The mode can only be left on the thread that entered it; an RNG tracker already created
    stays what it is.
    """
    registry.revert(_GROUP)
    registry.revert(core.GROUP)
    mode = _modes.pop(threading.get_ident(), None)
    if mode is not None:
        mode.__exit__(None, None, None)


def initialize_parallel_cpu(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    seed: int = 1234,
    data_parallel_random_init: bool = False,
    **kwargs,
) -> None:
    """Build Megatron's model-parallel groups and seed its RNGs, in a gloo world.

    What ``megatron.training.initialize`` skips when ``torch.cuda.device_count() == 0``. Needs an
    initialised ``torch.distributed`` default group: ``parallel_state.initialize_model_parallel``
    creates its groups with the default backend (``backend=None``), i.e. gloo here. Seeds once,
    as ``megatron.training.initialize._set_random_seed`` does (``seed + 100 * pp_rank``, ``+ 10 *
    dp_rank`` with ``data_parallel_random_init``, for ``random``, numpy, torch, then
    ``model_parallel_cuda_manual_seed``), the CPU generator standing in for the CUDA one. Applies
    :func:`apply_cpu_compat` first. Extra keyword arguments go to ``initialize_model_parallel``;
    undo with ``megatron.core.parallel_state.destroy_model_parallel()``.
    """
    import random

    import numpy as np
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    apply_cpu_compat()
    if not torch.distributed.is_initialized():
        raise RuntimeError("initialise the (gloo) default process group first")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        context_parallel_size=context_parallel_size,
        **kwargs,
    )
    seed += 100 * parallel_state.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed += 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
