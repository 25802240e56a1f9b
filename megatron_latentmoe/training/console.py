"""The entry point's name and its rank-0 printing, for :mod:`.pretrain` and the modules that
speak for it (:mod:`.resume`, :mod:`.checkpoint_repair`, :mod:`.file_checks`): every line a run
prints starts with ``[pretrain_stable_latentmoe]`` or ``pretrain_stable_latentmoe: error:``
(:func:`error`, :func:`error_once`, which also give the line to torchrun). Plain Python."""

from __future__ import annotations

import os
import sys

from megatron_latentmoe.error_file import say_once, tell_launcher

PROG = "pretrain_stable_latentmoe"


def rank() -> int:
    """This process's global rank, as torchrun sets it (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def print0(*parts) -> None:
    """``print`` on rank 0 only, flushed."""
    if rank() == 0:
        print(*parts, flush=True)


def error(line: str, after_peer: bool = False) -> None:
    """Print ``pretrain_stable_latentmoe: error: <line>`` to stderr, flushed, and hand it to
    torchrun's error file (:func:`megatron_latentmoe.error_file.tell_launcher`; ``after_peer``:
    this rank stops because another rank did)."""
    full = f"{PROG}: error: {line}"
    print(full, file=sys.stderr, flush=True)
    tell_launcher(full, after_peer=after_peer)


def error_once(line: str) -> None:
    """:func:`error` for a refusal every rank makes alike (a bad flag, a checkpoint's schedule):
    printed by rank 0 alone, written to torchrun's error file by every rank
    (:func:`megatron_latentmoe.error_file.say_once`)."""
    say_once(f"{PROG}: error: {line}")


def peer_stopped_error(err: BaseException) -> str | None:
    """The line (after ``error: ``) for a rank whose collective failed because another rank's
    process went away (:func:`..compat.gloo_peer.gloo_peer_lost`); None for any other error.
    The other rank said why itself (its one-line error), or it was killed, which the launcher's
    summary says: this rank's traceback would only bury that line."""
    from megatron_latentmoe.compat.gloo_peer import gloo_peer_lost

    observed = gloo_peer_lost(err)
    if observed is None:
        return None
    return (
        f"rank {rank()}: another rank of this run stopped (gloo: {observed}); its own error is "
        "above, or the launcher's summary names it if it was killed"
    )


def startup_peer_error(err: BaseException) -> str | None:
    """The line (after ``error: ``) for a rank whose process groups could not be built because
    another rank's process went away during start-up, or never joined
    (:func:`..compat.gloo_peer.gloo_startup_peer_lost`); None for any other error."""
    from megatron_latentmoe.compat.gloo_peer import gloo_startup_peer_lost

    observed = gloo_startup_peer_lost(err)
    if observed is None:
        return None
    return (
        f"rank {rank()}: another rank of this run stopped while the process groups were built, "
        f"or never joined them ({observed}); its own error is above, or the launcher's summary "
        "names it if it was killed"
    )
