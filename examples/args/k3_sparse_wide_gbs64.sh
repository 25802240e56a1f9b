# The d 512 race model (k3_sparse_wide.sh) at four times its global batch: 64 x 128 tokens, 256
# per expert and step at perfect balance instead of 64, still one micro-batch per rank
# (benchmarks/BALANCE_RACE.md, d 512 section). Source it: defines ARGS.
# shellcheck shell=bash source-path=SCRIPTDIR
# shellcheck source=k3_sparse_wide.sh
source "$(dirname "${BASH_SOURCE[0]}")/k3_sparse_wide.sh"
ARGS+=(--global-batch-size 64 --micro-batch-size 32)
