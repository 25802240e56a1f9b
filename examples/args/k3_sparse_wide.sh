# The balance race's K3-shaped sparse model (k3_sparse_tiny.sh) at four times its width, for CPU
# (2 processes, EP2). Source it: defines ARGS. Same experts, top-k, layers, tokens and training;
# d 128 -> 512 (latent 256, experts 128 wide, shared expert 256, 8 heads / 4 query groups). QB's
# per-step work grows far less with d than the model's: benchmarks/bench_step_balancers.py
# --args-file examples/args/k3_sparse_wide.sh prices every balancer at a less tiny width
# (benchmarks/BALANCE_RACE.md, tokens/s).
# shellcheck shell=bash source-path=SCRIPTDIR
# shellcheck source=k3_sparse_tiny.sh
source "$(dirname "${BASH_SOURCE[0]}")/k3_sparse_tiny.sh"
ARGS+=(
  --hidden-size 512 --ffn-hidden-size 1024
  --num-attention-heads 8 --num-query-groups 4
  --moe-latent-size 256 --moe-ffn-hidden-size 128
  --moe-shared-expert-intermediate-size 256
)
