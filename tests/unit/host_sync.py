"""A recorder of the operations that make a CUDA device wait for the host (or the host for the
device), with the Python frame that issued each one. Used by ``test_no_host_sync.py``.

On CPU nothing really synchronises, but the same operations are issued, so the recorder works on
CPU. Recorded:

* aten ops (``TorchDispatchMode``) that read a device value on the host or size an output by
  one: ``_local_scalar_dense`` (``item``, ``bool``, ``int``, ``float`` of a tensor),
  ``nonzero`` / ``argwhere``, ``masked_select``, the ``unique`` family, ``equal``,
  ``is_nonzero``, ``allclose``, ``bincount``, ``repeat_interleave`` without ``output_size``,
  and indexing with a boolean mask (``index`` / ``index_put``: lowered to ``nonzero`` on CUDA);
* the Python-level host copies (``TorchFunctionMode``) that reach no aten op on a CPU tensor:
  ``tolist``, ``numpy``, ``cpu`` and ``to("cpu")`` (not ``to(torch.device("cpu"))``: see
  ``_names_the_host``).

Host tensors (``host_tensors``: e.g. a data loader's batch, which stays on the CPU in a CUDA
run) are not the device's: reads of them, and of anything computed from host tensors only, are
not syncs. ``DEVICE`` stands in for the accelerator: a copy ``.to(DEVICE)`` makes a device
tensor (:func:`batches_to_device`).

Each record names the innermost frame outside torch: ``ours`` (under ``megatron_latentmoe/``),
``megatron`` (megatron-core or megatron.training; then ``via`` names our nearest frame, if
any), or ``other``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

import megatron_latentmoe.compat.cpu

DEVICE = torch.device("cpu", 0)  # the accelerator's stand-in (a distinct device object)
_HOST = torch.device("cpu")

_aten = torch.ops.aten
_ALWAYS = {
    getattr(_aten, name)
    for name in (
        "_local_scalar_dense",
        "nonzero",
        "nonzero_numpy",
        "argwhere",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "equal",
        "is_nonzero",
        "allclose",
        "bincount",
    )
    if hasattr(_aten, name)
}
_INDEXING = {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}
_HOST_COPIES = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.to}

_PACKAGE = os.sep + "megatron_latentmoe" + os.sep
_MEGATRON = os.sep + "megatron" + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_THIS = os.path.abspath(__file__)
# megatron_latentmoe/compat/cpu.py: the CPU run's torch-function shim, a pass-through (absent on
# CUDA): an op it forwards is its caller's
_CPU_SHIM = os.path.abspath(megatron_latentmoe.compat.cpu.__file__)
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _skipped(path: str) -> bool:
    """torch's frames, the standard library's and this file's."""
    return (
        path.startswith(_TORCH)
        or (path.startswith(_STDLIB) and "site-packages" not in path)
        or path in (_THIS, _CPU_SHIM)
    )


@dataclass(frozen=True, order=True)
class Sync:
    owner: str  # "ours", "megatron" or "other"
    op: str
    site: str  # path:line (function) of the innermost frame outside torch
    via: str = ""  # for Megatron's: our nearest frame, if any

    def __str__(self) -> str:
        return f"{self.owner}: {self.op} at {self.site}" + (f" via {self.via}" if self.via else "")


def _site(frame) -> str:
    path = frame.f_code.co_filename
    for marker in (_PACKAGE, _MEGATRON):
        if marker in path:
            path = marker.strip(os.sep) + "/" + path.split(marker, 1)[1]
            break
    else:
        path = os.path.basename(path)
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


def _issuer(op: str) -> Sync:
    frame = sys._getframe(1)
    while frame is not None and _skipped(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return Sync("other", op, "?")
    path = frame.f_code.co_filename
    if _PACKAGE in path:
        return Sync("ours", op, _site(frame))
    if _MEGATRON in path:
        via = frame.f_back
        while via is not None and _PACKAGE not in via.f_code.co_filename:
            via = via.f_back
        return Sync("megatron", op, _site(frame), _site(via) if via is not None else "")
    return Sync("other", op, _site(frame))


def _tensors(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _Dispatch(TorchDispatchMode):
    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.recorder
        inputs = _tensors((args, kwargs))
        on_host = bool(inputs) and all(rec.is_host(t) for t in inputs)
        packet = func.overloadpacket
        name = None
        if packet in _ALWAYS:
            name = str(packet).removeprefix("aten.")
        elif packet is _aten.repeat_interleave and kwargs.get("output_size") is None:
            name = "repeat_interleave (no output_size)"
        elif packet in _INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                name = f"{str(packet).removeprefix('aten.')} with a boolean mask (nonzero)"
        if name is not None and not on_host:
            rec.record(name)
        out = func(*args, **kwargs)
        to_device = packet is _aten._to_copy and kwargs.get("device") not in (None, _HOST)
        if on_host and not to_device:
            for t in _tensors(out):
                rec.host[t] = True
        return out


def _names_the_host(args, kwargs) -> bool:
    """``Tensor.to``'s target is the host named by a string (``"cpu"``). A ``torch.device``
    target is not recorded: on a CPU run ``.to(torch.device("cpu"))`` (a host copy on CUDA) and
    ``.to(t.device)`` (none) cannot be told apart."""
    device = kwargs.get("device", args[0] if args else None)
    return isinstance(device, str) and torch.device(device) == _HOST


class _Function(TorchFunctionMode):
    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.recorder
        if func not in _HOST_COPIES or not args or rec.is_host(args[0]):
            return func(*args, **kwargs)
        if func is torch.Tensor.to and not _names_the_host(args[1:], kwargs):
            return func(*args, **kwargs)
        rec.record(func.__name__)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):  # a host copy: on CPU the same tensor, so copy it
            if out is args[0]:
                out = out.clone()
            rec.host[out] = True
        return out


class SyncRecorder:
    """``with recorder:`` records every sync (see the module docstring) into ``records``."""

    def __init__(self, host_tensors=()):
        self.host = WeakTensorKeyDictionary()
        for t in host_tensors:
            self.host[t] = True
        self.records: list[Sync] = []
        self._modes = None

    def is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.host

    def record(self, op: str) -> None:
        self.records.append(_issuer(op))

    def __enter__(self):
        self._modes = contextlib.ExitStack()
        self._modes.enter_context(_Function(self))
        self._modes.enter_context(_Dispatch(self))
        return self

    def __exit__(self, *exc):
        self._modes.close()
        return False

    def ours(self) -> list[str]:
        return sorted(str(s) for s in set(self.records) if s.owner != "megatron")

    def ours_all(self) -> list[str]:
        """Every record not Megatron's, repeats included, in order."""
        return [str(s) for s in self.records if s.owner != "megatron"]

    def megatron(self) -> list[str]:
        return sorted(str(s) for s in set(self.records) if s.owner == "megatron")

    def counts(self) -> Counter:
        return Counter(self.records)


@contextlib.contextmanager
def as_on_cuda():
    """Run megatron-core's alltoall dispatcher as on CUDA: it copies its split sizes to the host
    (``maybe_move_tensor_to_cpu`` skips CPU tensors, so on a CPU run they would stay "device"
    tensors that the experts then read)."""
    from unittest import mock

    from megatron.core.transformer.moe import token_dispatcher

    def move_to_cpu(tensor, as_numpy=False, record_stream=False):
        if not torch.is_tensor(tensor):
            return tensor
        tensor = tensor.to("cpu", non_blocking=True)
        return tensor.numpy() if as_numpy else tensor

    with mock.patch.object(token_dispatcher, "maybe_move_tensor_to_cpu", move_to_cpu):
        yield


@contextlib.contextmanager
def batches_to_device():
    """``megatron_device()`` names ``DEVICE``: ``training.forward_step.get_batch`` copies the
    loader's host batch to it (on CPU a real copy, so host and device tensors stay distinct).
    Only around forwards: modules built under it would hold ``cpu:0`` buffers."""
    from unittest import mock

    with mock.patch("megatron_latentmoe.moe.router.megatron_device", lambda: DEVICE):
        yield
