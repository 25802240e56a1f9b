# k3_sparse_tiny_gbs64.sh (the balance race's K3-shaped model at four times its batch) at a tenth
# of its peak learning rate: 1e-4, cosine to 1e-5, the same 15-iteration warm-up. How far the model
# moves per step sets how stale a bias solved under the previous step's model is; here the
# recommended QB flags keep every iteration of 3 seeds at MaxVio <= 1.0 (benchmarks/BALANCE_RACE.md,
# "four times the batch"). Source it: defines ARGS.
# shellcheck shell=bash source-path=SCRIPTDIR
# shellcheck source=k3_sparse_tiny_gbs64.sh
source "$(dirname "${BASH_SOURCE[0]}")/k3_sparse_tiny_gbs64.sh"
ARGS+=(--lr 1e-4 --min-lr 1e-5)
