# K3-shaped sparse tiny Stable LatentMoE for CPU (2 processes, EP2): the balance race's model
# (benchmarks/bench_training_balance.py). Source it: defines ARGS.
# Kimi K3: 896 routed experts top-16 (1.8 % active), latent d/2, 1 shared expert. Here, as sparse
# as 2 CPU cores allow: 128 routed experts top-4 (3.1 % active), d=128, latent 64 (d/2), 1 shared
# expert, 3 layers (layer 1 dense, 2 MoE layers), GQA 4/2 + RoPE, SiTU-GLU, Quantile Balancing.
# A global batch of 16 x 128 tokens gives each expert 64 tokens per step at perfect balance; one
# micro-batch of 8 per rank (two of 4 cost ~2x: the 64 local experts run one by one per micro-batch).
# shellcheck shell=bash source-path=SCRIPTDIR
# shellcheck source=tiny.sh
source "$(dirname "${BASH_SOURCE[0]}")/tiny.sh"
ARGS+=(
  --num-layers 3
  --num-experts 128 --moe-router-topk 4
  --moe-ffn-hidden-size 32
  --moe-latent-size 64
  --moe-shared-expert-intermediate-size 64
  --micro-batch-size 8
)
