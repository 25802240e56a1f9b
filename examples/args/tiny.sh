# Tiny Stable LatentMoE for CPU (2 processes, EP2) and smoke tests. Source it: defines ARGS.
# Model: 4 layers (layer 1 dense), d=128, latent l=64, 8 experts top-2 + 1 shared, GQA 4/2 + RoPE,
# SiTU-GLU, Quantile Balancing. Data: the shipped corpus + tokenizer (no --data-path).
# shellcheck shell=bash source-path=SCRIPTDIR disable=SC2034  # ARGS: read by the sourcing script
ARGS=(
  # ---- model (SPEC §1-§4 at toy size)
  --num-layers 4
  --first-k-dense-replace 1
  --hidden-size 128
  --ffn-hidden-size 256
  --num-attention-heads 4
  --group-query-attention --num-query-groups 2
  --seq-length 128 --max-position-embeddings 128
  --position-embedding-type rope
  --normalization RMSNorm
  --untie-embeddings-and-output-weights
  --hidden-act situ --activation-situ-beta 4.0 --activation-situ-linear-beta 25.0
  --num-experts 8 --moe-router-topk 2
  --moe-ffn-hidden-size 64
  --moe-latent-size 64 --moe-latent-norm
  --moe-shared-expert-intermediate-size 64
  --moe-router-load-balancing-type quantile_histogram
  --moe-router-score-function sigmoid
  --moe-aux-loss-coeff 0
  --moe-qb-num-bins 1000
  --moe-token-dispatcher-type alltoall
  --attention-dropout 0.0 --hidden-dropout 0.0
  --init-method-std 0.02
  --use-cpu-initialization
  # ---- parallelism (EP2 over the 2 processes; DP2 for the dense part)
  --expert-model-parallel-size 2
  # ---- training
  --micro-batch-size 4 --global-batch-size 16
  --train-iters 300
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-fraction 0.05
  --weight-decay 0.01 --clip-grad 1.0
  --adam-beta1 0.9 --adam-beta2 0.95
  --seed 1234
  # batches read in the training process: a forked DataLoader worker of a process whose threads
  # are running can deadlock in CPython 3.11's after-fork (a test run hung so, the worker stuck
  # in PyOS_AfterFork_Child); on CPU a worker gains nothing (same losses to the bit, same speed)
  --num-workers 0
  # ---- evaluation, logging, checkpoints
  --eval-interval 1000 --eval-iters 0
  --log-interval 10
  --ckpt-format torch_dist
)
