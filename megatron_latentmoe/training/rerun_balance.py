"""The step-end balance state under Megatron's rerun state machine (``--rerun-mode``).

In ``validate_results`` mode (Megatron's default on GPUs) a rejected loss (NaN / Inf, a spike
with ``--check-for-spiky-loss``) makes ``train_step`` run the iteration's forward-backward again
(``while rerun_state_machine.should_run_forward_backward(...)``) to tell a transient fault from a
reproducible result; ``report_determinism_stats`` re-runs every iteration. The machine restores
the RNG states and rewinds the data between the passes, but the step end runs inside each pass
(``finalize_model_grads``: the QB solve and Megatron's own sign update, ``moe/balance_step.py``,
and the balance record, ``balance_logging.py``). Measured on CPU (tiny.sh, transient errors
injected): the re-run was routed with the bias solved from the first pass's histogram of the same
batch (spiky loss sum 4266.8745 against the first pass's 4266.9990), the bias advanced twice per
re-run iteration, and the JSONL held two records of it.

:class:`RerunBalance` hooks the machine's own ``state_save_func`` / ``state_restore_func``
(chained after Megatron's RNG-tracker ones): the routers' step-end state (``balance_step.
save_step_state``) and the balance logger's step timing and loss are saved where the machine saves
the RNG states, at the start of each iteration, and restored before a re-run (and before the
machine's checkpoint-and-exit), so a re-run reproduces the first pass and only the last pass's
step end counts; the balance record of each pass is held and written once ``train_step``
returns. A device copy of each router's bias per iteration, no host read; nothing with
``--rerun-mode disabled`` (CPU runs' default).
"""

from __future__ import annotations

import functools
from collections.abc import Callable


class RerunBalance:
    """``wrap_train_step`` installs the save / restore hooks on the machine of the run and writes
    each iteration's held balance record after ``train_step``; wrap it OUTSIDE
    ``QBRescore.wrap_train_step``, whose deferred step end writes that record."""

    def __init__(self, balance_logger=None) -> None:
        self.balance_logger = balance_logger
        self._model = None
        self._machine = None

    def save(self) -> dict:
        from megatron_latentmoe.moe.balance_step import save_step_state

        logger = self.balance_logger
        return {
            "routers": save_step_state(self._model or []),
            "logger": None if logger is None else logger.step_state(),
        }

    def restore(self, state: dict) -> None:
        from megatron_latentmoe.moe.balance_step import restore_step_state

        restore_step_state(state["routers"])
        if self.balance_logger is not None and state["logger"] is not None:
            self.balance_logger.restore_step_state(state["logger"])

    def _install(self, machine) -> None:
        if self._machine is machine:
            return
        self._machine = machine
        save, restore = machine.state_save_func, machine.state_restore_func

        def state_save_func():
            return {"megatron": save() if save else None, "balance": self.save()}

        def state_restore_func(state):
            if restore is not None and state["megatron"] is not None:
                restore(state["megatron"])
            self.restore(state["balance"])

        machine.state_save_func, machine.state_restore_func = state_save_func, state_restore_func

    def wrap_train_step(self, train_step: Callable) -> Callable:
        """``megatron.training.training.train_step`` with the hooks installed (rerun mode on)."""
        from megatron_latentmoe.training.forward_step import train_step_signature

        signature = train_step_signature(train_step, "RerunBalance.wrap_train_step")

        @functools.wraps(train_step)
        def train_step_with_rerun_balance(*args, **kwargs):
            from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

            machine = get_rerun_state_machine()
            if machine.get_mode() == RerunMode.DISABLED:
                return train_step(*args, **kwargs)
            self._model = signature.bind(*args, **kwargs).arguments["model"]
            self._install(machine)
            logger = self.balance_logger
            if logger is None:
                return train_step(*args, **kwargs)
            logger.hold_records = True
            try:
                out = train_step(*args, **kwargs)
            finally:
                logger.hold_records = False
            logger.flush()
            return out

        return train_step_with_rerun_balance
