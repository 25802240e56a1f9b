"""torchrun, ending in one line when a rank fails: ``python -m megatron_latentmoe.training.launch``
takes torchrun's arguments (``examples/run_torchrun.sh`` and ``slurm_multinode.sbatch`` use it).

A rank that refuses its input (a checkpoint whose LR schedule differs from the flags, say) prints
its one-line error and exits 2; plain torchrun then adds a Python traceback and a table of
``ChildFailedError``. Here that becomes one line naming the first failed rank and its exit code,
and the launcher exits with that code (128 + N for a rank killed by signal N, as a shell does).
"""

from __future__ import annotations

import sys

PROG = "launch"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode  # torchrun's -N: killed by signal N
        how = f"exited with code {code}" if code > 0 else f"was killed by signal {-code}"
        print(f"[{PROG}] rank {rank} {how} (its output is above)", file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code
    return 0


if __name__ == "__main__":
    sys.exit(main())
