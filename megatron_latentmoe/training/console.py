"""The entry point's name and its rank-0 printing, for :mod:`.pretrain` and the modules that
speak for it (:mod:`.resume`, :mod:`.file_checks`): every line a run prints starts with
``[pretrain_stable_latentmoe]`` or ``pretrain_stable_latentmoe: error:``. Plain Python."""

from __future__ import annotations

import os

PROG = "pretrain_stable_latentmoe"


def rank() -> int:
    """This process's global rank, as torchrun sets it (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def print0(*parts) -> None:
    """``print`` on rank 0 only, flushed."""
    if rank() == 0:
        print(*parts, flush=True)
