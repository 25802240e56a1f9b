# The balance race's K3-shaped sparse model (k3_sparse_tiny.sh) at four times its global batch:
# 64 x 128 tokens, 256 per expert and step at perfect balance instead of 64, still one
# micro-batch per rank. At the race's batch no bias learnt from other batches keeps every batch
# at MaxVio <= 1.0; at this one it can (benchmarks/BALANCE_RACE.md, "four times the batch").
# Source it: defines ARGS.
# shellcheck shell=bash source-path=SCRIPTDIR
# shellcheck source=k3_sparse_tiny.sh
source "$(dirname "${BASH_SOURCE[0]}")/k3_sparse_tiny.sh"
ARGS+=(--global-batch-size 64 --micro-batch-size 32)
