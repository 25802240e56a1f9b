"""Multi-process test harness for megatron-core on CPU + gloo, and a state-dict sharding helper.

``run_distributed(fn, world_size, *args, **kwargs)`` spawns ``world_size`` processes, forms a
gloo world (FileStore in a temporary directory: no ports), applies
:func:`megatron_latentmoe.compat.apply_cpu_compat` in each, runs ``fn(rank, world_size, *args,
**kwargs)`` and returns the per-rank results ordered by rank. ``fn`` must be importable
(module-level) and its result picklable; CPU tensors are fine. A child's exception fails the
call with the child's traceback in the message; hung ranks are killed after ``timeout``, and the
message then holds the Python stack of every thread of each hung rank (``faulthandler``, on
SIGUSR1) at the moment it was given up: where a rare hang waited.

This module imports only the standard library and torch at top level so that children start
fast; megatron is imported when first needed (by the shims or by ``fn``'s module).

``shard_state_dict_for_rank(full_state_dict, model)`` turns a single-process (TP=EP=PP=1)
state dict into the one the calling rank's ``model`` expects under the current
``parallel_state`` layout; see its docstring.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue as queue_module
import re
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

__all__ = ["DistributedTestError", "run_distributed", "shard_state_dict_for_rank"]

# Set in the children before torch initialises its thread pools; also what megatron expects.
CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "NO_VCS_VERSION": "1",  # megatron.core.package_info otherwise runs `git rev-parse`
}
_GRACE_S = 10.0  # how long the other ranks may still report after one failed
_STACK_WAIT_S = 2.0  # how long a hung rank gets to write its stacks before it is killed


class DistributedTestError(RuntimeError):
    """A rank raised, died or timed out; the message carries the ranks' tracebacks."""


def _stack_path(store_path: str, rank: int) -> str:
    return f"{store_path}.stacks.{rank}"


def _child(rank, world_size, store_path, timeout, fn, args, kwargs, results):
    stacks = open(_stack_path(store_path, rank), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        from megatron_latentmoe.compat import apply_cpu_compat

        apply_cpu_compat()
        payload = ("ok", pickle.dumps(fn(rank, world_size, *args, **kwargs)))
    except BaseException:  # noqa: BLE001 - everything goes to the parent
        payload = ("error", traceback.format_exc())
    try:
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None:
            parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    finally:
        results.put((rank, *payload))


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Returns the ranks' return values, ordered by rank. Raises :class:`DistributedTestError` if
    any rank raises (the message holds its traceback), exits without reporting, or the run
    exceeds ``timeout`` seconds; after a failure the other ranks get a short grace period before
    they are killed. Process groups are destroyed in every child, whatever happened.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = []
    try:
        with tempfile.TemporaryDirectory(prefix="mlm_dist_") as tmp:
            saved_env = {k: os.environ.get(k) for k in CHILD_ENV}
            os.environ.update(CHILD_ENV)  # inherited by the children when they start
            try:
                for rank in range(world_size):
                    procs.append(
                        ctx.Process(
                            target=_child,
                            args=(
                                rank,
                                world_size,
                                os.path.join(tmp, "store"),
                                timeout,
                                fn,
                                args,
                                kwargs,
                                results,
                            ),
                            name=f"rank{rank}",
                            daemon=False,  # ranks may start processes (DataLoader, ckpt writer)
                        )
                    )
                    procs[-1].start()
            finally:
                for key, value in saved_env.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
            outcome = _collect(procs, results, timeout, os.path.join(tmp, "store"))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        results.close()
    errors = [f"rank {r}: {msg}" for r, (ok, msg) in outcome.items() if not ok]
    if errors:
        raise DistributedTestError(
            f"{fn.__qualname__} on {world_size} ranks failed:\n" + "\n".join(errors)
        )
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]


def _collect(procs, results, timeout, store_path):
    """{rank: (ok, pickled result or error text)} for every rank, in the order they ended; a rank
    given up on carries its threads' stacks (:func:`_hung_stacks`)."""
    deadline = time.monotonic() + timeout
    outcome, dead_since = {}, {}
    while len(outcome) < len(procs):
        try:
            rank, status, payload = results.get(timeout=0.2)
            outcome[rank] = (status == "ok", payload if status == "ok" else f"raised\n{payload}")
        except queue_module.Empty:
            now = time.monotonic()
            for r, proc in enumerate(procs):  # died without a word (segfault, os._exit, OOM)?
                if r not in outcome and proc.exitcode is not None:
                    if now - dead_since.setdefault(r, now) > 1.0:  # its result is not in flight
                        outcome[r] = (False, f"exited with code {proc.exitcode} and no result")
            if now > deadline:
                hung = [r for r in range(len(procs)) if r not in outcome]
                stacks = _hung_stacks([procs[r] for r in hung], store_path, hung)
                for r in hung:
                    outcome[r] = (
                        False,
                        "killed: no result before the timeout, or within the grace period "
                        f"after a failure; its threads then:\n{stacks[r]}",
                    )
        if not all(ok for ok, _ in outcome.values()):  # others may hang in a collective now
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    return outcome


def _hung_stacks(procs, store_path: str, ranks: list[int]) -> dict[int, str]:
    """{rank: the Python stacks of every thread of that (live) rank}: each gets SIGUSR1, on which
    its ``faulthandler`` writes them to its stack file, and ``_STACK_WAIT_S`` to do so."""
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(_STACK_WAIT_S)
    out = {}
    for rank, proc in zip(ranks, procs, strict=True):
        try:
            with open(_stack_path(store_path, rank)) as f:
                out[rank] = f.read().strip() or "(no stack written)"
        except OSError as err:
            out[rank] = f"(no stack file: {err})"
        if proc.exitcode is not None:
            out[rank] = f"(exited with code {proc.exitcode}) " + out[rank]
    return out


# ------------------------------------------------------------------------------------------
# Sharding a full (single-process) state dict for one rank of a parallel layout
# ------------------------------------------------------------------------------------------
_LAYER = re.compile(r"^(.*\.layers\.)(\d+)$")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def shard_state_dict_for_rank(full_state_dict: dict, model: torch.nn.Module) -> dict:
    """Cut a single-process state dict down to what ``model`` holds on this rank.

    ``full_state_dict`` comes from the same architecture built with TP = EP = PP = 1 (its
    ``state_dict()``; a ``{name: full gradient}`` dict works the same way). ``model`` is the
    calling rank's model built under the current ``megatron.core.parallel_state`` layout
    (unwrapped: pass ``ddp_model.module``). For every entry of ``model.state_dict()``:

    * name: ``...layers.<i>.`` of a module with a ``layer_number`` (TransformerLayer) becomes
      ``...layers.<layer_number - 1>.`` (pipeline stages number their layers from 0), and
      ``.local_experts.<j>.`` becomes the global expert ``local_expert_indices[0] + j`` of the
      enclosing MoE layer (SequentialMLP naming).
    * slicing: a parameter with ``tensor_model_parallel=True`` is cut along its
      ``partition_dim`` into equal parts, keeping this rank's: the expert-tensor-parallel rank
      for expert parameters (``allreduce=False``, or the name contains ``.experts.``), the
      tensor-parallel rank otherwise. The ``linear_fc1`` of a gated MLP
      (``config.gated_linear_unit``) is cut per half, [gate; up] each sharded, as Megatron lays
      it out.
    * anything else (replicated parameters, buffers, extra state) is taken as is; non-parameter
      entries missing from ``full_state_dict`` are left out (so a gradient dict works too).

    Returns a new dict for ``model.load_state_dict(..., strict=True)``.
    """
    from megatron.core import parallel_state as ps

    renames, first_expert, gated = [], {}, set()
    for name, module in model.named_modules():
        layer = _LAYER.match(name)
        if layer and hasattr(module, "layer_number"):
            renames.append((name + ".", f"{layer.group(1)}{module.layer_number - 1}."))
        if hasattr(module, "local_expert_indices"):
            first_expert[name + "."] = module.local_expert_indices[0]
        config = getattr(module, "config", None)
        if name.endswith("linear_fc1") and getattr(config, "gated_linear_unit", False):
            gated.add(name)

    def global_name(name):
        expert = _LOCAL_EXPERT.search(name)
        if expert:
            offset = max(v for k, v in first_expert.items() if name.startswith(k))
            name = (
                f"{name[: expert.start(1)]}{int(expert.group(1)) + offset}{name[expert.end(1) :]}"
            )
        for local, full in renames:
            if name.startswith(local):
                return full + name[len(local) :]
        return name

    params = dict(model.named_parameters())
    out = {}
    for name, local_value in model.state_dict().items():
        param = params.get(name)
        if param is None and global_name(name) not in full_state_dict:
            continue  # e.g. extra state, absent from a dict of gradients
        full = full_state_dict[global_name(name)]
        if param is None or not getattr(param, "tensor_model_parallel", False):
            out[name] = full
            continue
        if getattr(param, "allreduce", True) is False or ".experts." in name:
            rank = ps.get_expert_tensor_parallel_rank()
            size = ps.get_expert_tensor_parallel_world_size()
        else:
            rank = ps.get_tensor_model_parallel_rank()
            size = ps.get_tensor_model_parallel_world_size()
        dim = param.partition_dim
        if full.shape[dim] != local_value.shape[dim] * size:
            raise ValueError(
                f"{name}: full {tuple(full.shape)} is not {size} x {tuple(local_value.shape)}"
            )
        halves = 2 if name.rsplit(".", 1)[0] in gated else 1
        out[name] = torch.cat([h.chunk(size, dim)[rank] for h in full.chunk(halves, dim)], dim)
    return out
