"""torchrun's error file: where a process torchrun started leaves its one-line error, so that
torchrun's failure table shows that line (``error_file: .../error.json``, ``traceback :
pretrain_stable_latentmoe: error: ...``) instead of ``error_file: <N/A>`` and "To enable
traceback see ...". Its writers: the entry point's errors (``training.console.error``) and every
command line's argparse error (:mod:`megatron_latentmoe.cli_errors`: a misspelt flag under plain
torchrun); its reader besides torchrun: ``training.launch``. An unexpected exception's traceback
reaches it through torch's ``record`` instead (``training.pretrain.process_main``). Below
``data/`` and ``training/`` (``cli_errors`` imports it): plain Python, no Megatron, no torch.

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
