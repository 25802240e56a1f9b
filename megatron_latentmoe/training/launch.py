"""torchrun, ending in one line when a rank fails: ``python -m megatron_latentmoe.training.launch``
takes torchrun's arguments (``examples/run_torchrun.sh`` and ``slurm_multinode.sbatch`` use it).

A rank that refuses its input (a checkpoint whose LR schedule differs from the flags, say) prints
its one-line error and exits 2; plain torchrun then adds a Python traceback and a table of
``ChildFailedError``. Here that becomes one line naming the first failed rank and its exit code,
and the launcher exits with that code (128 + N for a rank killed by signal N, as a shell does).

Each rank's one-line error also goes to the error file torchrun names in
``TORCHELASTIC_ERROR_FILE`` (:func:`tell_launcher`), so plain torchrun's table shows that line
(``error_file: .../error.json``, ``traceback : pretrain_stable_latentmoe: error: ...``) where it
showed ``error_file: <N/A>`` and "To enable traceback see ...". Plain torchrun's own traceback
(its ``main`` re-raises ``ChildFailedError``) cannot be avoided from the ranks: use this module.

Which rank failed first: torchrun takes the smallest error-file timestamp, in whole seconds,
ties to the lowest local rank. A rank that stopped because another one did (exit 1,
:func:`.console.peer_stopped_error`) stamps its file at the end of its second, a rank's own
failure at the start of it (as torch's ``ErrorHandler`` does), so that the rank that failed itself
is torchrun's root cause on a tie; a rank killed by a signal writes no file and is stamped when
torchrun sees it, which may still tie with the rank that saw it go. This launcher names a rank
that stopped because another one did only where every failed rank did (the one that failed
first runs on another node). Plain Python.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

PROG = "launch"
_AFTER_PEER = "another_rank_stopped"  # in the error file's extraInfo: see tell_launcher


def tell_launcher(line: str, after_peer: bool = False) -> None:
    """Write this rank's one-line error ``line`` (all of it, ``pretrain_stable_latentmoe: error:
    ...``) to torchrun's error file for it, where torchrun set ``TORCHELASTIC_ERROR_FILE``
    (atomically: a temporary file renamed); ``after_peer``: the rank stops because another rank
    did. A file that cannot be written leaves torchrun's ``<N/A>``: the line is printed anyway."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    extra = {"timestamp": str(math.ceil(now) if after_peer else math.floor(now))}
    if after_peer:
        extra[_AFTER_PEER] = True
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


def _root_failure(err):
    """``(rank, failure)`` of the rank that failed first, a rank that stopped because another
    one did only where every failed rank did (torchrun's ``get_first_failure`` otherwise)."""
    failures = err.failures

    def after_peer(rank) -> bool:
        message = failures[rank].error_file_data.get("message")
        return isinstance(message, dict) and bool(message.get("extraInfo", {}).get(_AFTER_PEER))

    rank = min(failures, key=lambda r: (after_peer(r), failures[r].timestamp))
    return rank, failures[rank]


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as err:
        rank, failure = _root_failure(err)
        code = failure.exitcode  # torchrun's -N: killed by signal N
        how = f"exited with code {code}" if code > 0 else f"was killed by signal {-code}"
        print(f"[{PROG}] rank {rank} {how} (its output is above)", file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code
    return 0


if __name__ == "__main__":
    sys.exit(main())
