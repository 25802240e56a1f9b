"""torchrun's error file: where a process torchrun started leaves its one-line error, so that
torchrun's failure table shows that line (``error_file: .../error.json``, ``traceback :
pretrain_stable_latentmoe: error: ...``) instead of ``error_file: <N/A>`` and "To enable
traceback see ...". Its writers: the entry point's errors (``training.console.error``; one
that every rank has alike, a bad flag's, through :func:`say_once`) and every command line's
argparse error (:mod:`megatron_latentmoe.cli_errors`: a misspelt flag under plain torchrun); its
reader besides torchrun: ``training.launch``. An unexpected exception's traceback reaches it
through torch's ``record`` instead (``training.pretrain.process_main``). Below ``data/`` and
``training/`` (``cli_errors`` imports it): plain Python, no Megatron, no torch.

Which rank failed first: torchrun takes the smallest error-file timestamp, in whole seconds,
ties to the lowest local rank. A rank that stopped because another one did stamps its file at the
end of its second (and marks it :data:`AFTER_PEER`), a rank's own failure at the start of it (as
torch's ``ErrorHandler`` does), so that the rank that failed itself is torchrun's root cause on a
tie.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time

AFTER_PEER = "another_rank_stopped"
"""The key of the error file's ``extraInfo`` that marks a rank stopped because another one did."""


def tell_launcher(line: str, after_peer: bool = False) -> None:
    """Write this process's one-line error ``line`` (all of it, ``<prog>: error: ...``) to
    torchrun's error file for it, where torchrun set ``TORCHELASTIC_ERROR_FILE`` (atomically: a
    temporary file renamed); ``after_peer``: the rank stops because another rank did, and a line
    already in the file stays, the cause this rank said first (torch 2.13's torchrun makes each
    attempt's folder anew): rank 0's full ``--save`` disk, said before the ranks' barrier in
    which a peer then went away (``training.file_checks.stop_if_save_disk_failed``). A file that
    cannot be written leaves torchrun's ``<N/A>``: the line is printed anyway."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or (after_peer and os.path.exists(path)):
        return
    now = time.time()
    extra = {"timestamp": str(math.ceil(now) if after_peer else math.floor(now))}
    if after_peer:
        extra[AFTER_PEER] = True
    # torch's ErrorHandler layout: torchrun shows extraInfo's py_callstack, else the message
    data = {"message": {"message": line, "extraInfo": extra}}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


PEER_EXIT_WAIT_S = 30.0
"""How long a rank other than 0 waits, after an error every rank has alike (:func:`say_once`),
for torchrun to end it once rank 0 has exited with the line."""


class _Ended(Exception):
    """torchrun's SIGTERM, in :func:`say_once`'s wait."""


def _ended(signum, frame):
    raise _Ended


def say_once(line: str) -> None:
    """An error line every rank of a run has alike (a bad flag: it depends only on the flags and
    on files every rank reads; a loaded checkpoint's schedule or data offset, which every rank
    checks alike): under torchrun printed to stderr by rank 0 alone (N ranks printed it N
    times), elsewhere by each process (a tool's, which may see another launcher's ``RANK``);
    written to torchrun's error file by every rank (:func:`tell_launcher`: its table shows the
    line whichever rank it names).

    Under torchrun a rank other than 0 first waits, up to :data:`PEER_EXIT_WAIT_S`, for torchrun
    to end it (its SIGTERM ends the wait alone: the rank returns, to exit as rank 0 does):
    torchrun ends the other ranks once one exits (polling every 0.1 s), so a rank that exited
    first could end rank 0 before its line was printed (measured: rank 0 two seconds slower,
    the line printed by no rank), and the first rank's error file is the root cause torchrun
    names (``training.launch`` too): rank 0's, which printed the line. A rank whose wait runs
    out prints the line itself: rank 0 did not stop alike (e.g. a file only this node sees)."""
    torchrun_rank = os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("RANK", "0") != "0"
    if not torchrun_rank or not _ended_by_torchrun():
        print(line, file=sys.stderr, flush=True)
    tell_launcher(line)


def _ended_by_torchrun() -> bool:
    """Wait up to :data:`PEER_EXIT_WAIT_S` for torchrun's SIGTERM; whether it came."""
    previous = signal.signal(signal.SIGTERM, _ended)
    try:
        time.sleep(PEER_EXIT_WAIT_S)
        return False
    except _Ended:
        return True
    finally:
        signal.signal(signal.SIGTERM, previous)
