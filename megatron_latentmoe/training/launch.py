"""torchrun, ending in one line when a rank fails: ``python -m megatron_latentmoe.training.launch``
takes torchrun's arguments (``examples/run_torchrun.sh`` and ``slurm_multinode.sbatch`` use it).

A rank that refuses its input (a checkpoint whose LR schedule differs from the flags, say) prints
its one-line error and exits 2; plain torchrun then adds a Python traceback and a table of
``ChildFailedError``. Here that becomes one line naming the first failed rank and its exit code,
and the launcher exits with that code (128 + N for a rank killed by signal N, as a shell does).

Each rank's one-line error also goes to torchrun's error file
(:mod:`megatron_latentmoe.error_file`), so plain torchrun's table shows that line. Plain torchrun's
own traceback (its ``main`` re-raises ``ChildFailedError``) cannot be avoided from the ranks: use
this module.

Which rank failed first: torchrun's choice (the smallest error-file timestamp, ties to the lowest
local rank; :mod:`megatron_latentmoe.error_file`), but a rank marked as stopped because another
one did is named only where every failed rank is (the one that failed first runs on another
node): a rank killed by a signal writes no file and is stamped when torchrun sees it, which may
tie with the rank that saw it go. Plain Python.
"""

from __future__ import annotations

import signal
import sys

from megatron_latentmoe.error_file import AFTER_PEER

PROG = "launch"


def _root_failure(err):
    """``(rank, failure)`` of the rank that failed first, a rank that stopped because another
    one did only where every failed rank did (torchrun's ``get_first_failure`` otherwise)."""
    failures = err.failures

    def after_peer(rank) -> bool:
        message = failures[rank].error_file_data.get("message")
        return isinstance(message, dict) and bool(message.get("extraInfo", {}).get(AFTER_PEER))

    rank = min(failures, key=lambda r: (after_peer(r), failures[r].timestamp))
    return rank, failures[rank]


def _said_and_terminated(failure) -> int | None:
    """The exit code of a rank that wrote its one-line error (its error file) and that torchrun
    then ended with SIGTERM on its way out, another rank having exited first: 1 where it stopped
    because another rank did, else 2 (the entry point's codes); None for any other failure.
    Measured: a save that filled the disk, said by rank 0 after the ranks' barrier, while rank 1
    exited 2 first (torchrun's table: rank 0, exitcode -15, with rank 0's line)."""
    message = failure.error_file_data.get("message")
    if failure.exitcode != -signal.SIGTERM or not isinstance(message, dict):
        return None
    return 1 if message.get("extraInfo", {}).get(AFTER_PEER) else 2


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as err:
        rank, failure = _root_failure(err)
        code = failure.exitcode  # torchrun's -N: killed by signal N
        how = f"exited with code {code}" if code > 0 else f"was killed by signal {-code}"
        said = _said_and_terminated(failure)
        if said is not None:
            code = said
            how = f"exited with its error, code {code} (torchrun's SIGTERM ended it on its way out)"
        print(f"[{PROG}] rank {rank} {how} (its output is above)", file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code
    return 0


if __name__ == "__main__":
    sys.exit(main())
