#!/usr/bin/env python
"""Pretrain Stable LatentMoE with Megatron's training loop (Megatron-LM's pretrain_gpt.py, for
this model).

    bash examples/run_torchrun.sh examples/args/tiny.sh [extra flags]
    source examples/args/tiny.sh &&
        torchrun --nproc-per-node 2 examples/pretrain_stable_latentmoe.py "${ARGS[@]}" ...

Every Megatron flag works as with pretrain_gpt.py; the flags Stable LatentMoE adds are listed by
``--help`` under "Stable LatentMoE" (megatron_latentmoe/training/arguments.py). Without
--data-path it trains on the shipped corpus with the shipped tokenizer.

``--check-flags`` (first argument): only check the flags, exit 0 or 2 with a one-line error
(run_torchrun.sh and slurm_multinode.sbatch do this once before starting the ranks).

Without CUDA, megatron-core's import-time warnings that Transformer Engine / Apex are missing
(about 20 lines, from each rank) are hidden: the CPU path never uses either.
"""

import os
import sys
import warnings

if __name__ == "__main__":  # the guard matters: torch_dist checkpoint saving spawns processes
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch

    if not torch.cuda.is_available():
        warnings.filterwarnings(
            "ignore",
            r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed|"
            r"Only transformer-engine>=",
            UserWarning,
        )
    from megatron_latentmoe.training.pretrain import process_main

    check_only = sys.argv[1:2] == ["--check-flags"]
    sys.exit(process_main(sys.argv[2:] if check_only else None, check_only=check_only))
