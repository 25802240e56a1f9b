# Full-scale Kimi-K3-style Stable LatentMoE (SPEC §5), for GPUs with Transformer Engine. Source it: defines ARGS.
# The block numbers are the SPEC ledger's; attention is Megatron's GQA + RoPE (K3's own attention
# layers are out of scope), and the dense-layer MLP width is megatron_latentmoe.config.k3_full_scale_config's.
#
#   93 layers (layer 1 dense) | d 7168 | latent l 3584 | expert m_e 3072 | n 896 routed, top-16
#   2 shared experts = one gated MLP of 6144 | SiTU-GLU b1 4, b2 25 | QB with B = 1000 bins
#   ~2.75 T parameters, ~80 B activated per token with this GQA stand-in attention (SPEC §5's
#   2.78 T / 104 B are K3's, with its own attention layers).
#
# Parallel layout (1024 GPUs = 128 nodes x 8): experts EP 64 x PP 16 (ETP 1); dense parts TP 8 x
# PP 16 x DP 8 with sequence parallelism and the distributed optimizer. 93 layers over 16
# stages: 3 + 14 x 6 + 6 (the first and last stages also hold the embedding / output layer).
# Data and tokenizer are yours: append --data-path PREFIX --tokenizer-type ... --tokenizer-model ...
# (K3's vocabulary has 163840 tokens).
# shellcheck shell=bash source-path=SCRIPTDIR disable=SC2034  # ARGS: read by the sourcing script
ARGS=(
  # ---- model
  --num-layers 93
  --first-k-dense-replace 1
  --hidden-size 7168
  --ffn-hidden-size 32768
  --num-attention-heads 64
  --group-query-attention --num-query-groups 8
  --seq-length 4096 --max-position-embeddings 4096
  --position-embedding-type rope --rotary-base 50000
  --normalization RMSNorm --norm-epsilon 1e-5
  --untie-embeddings-and-output-weights
  --hidden-act situ --activation-situ-beta 4.0 --activation-situ-linear-beta 25.0
  --num-experts 896 --moe-router-topk 16
  --moe-ffn-hidden-size 3072
  --moe-latent-size 3584 --moe-latent-norm
  --moe-shared-expert-intermediate-size 6144
  --moe-router-load-balancing-type quantile_histogram
  --moe-router-score-function sigmoid
  --moe-router-topk-scaling-factor 1.0
  --moe-router-dtype fp32
  --moe-aux-loss-coeff 0
  --moe-qb-num-bins 1000
  --moe-token-dispatcher-type alltoall
  --attention-dropout 0.0 --hidden-dropout 0.0
  --init-method-std 0.006
  # ---- precision / kernels (GPU + Transformer Engine)
  --transformer-impl transformer_engine
  --bf16
  # FP8 (Hopper: --fp8-recipe tensorwise or delayed; Blackwell: mxfp8). Uncomment to use:
  # --fp8-format e4m3 --fp8-recipe mxfp8
  # ---- parallelism
  --tensor-model-parallel-size 8 --sequence-parallel
  --pipeline-model-parallel-size 16
  --decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 6
  --expert-model-parallel-size 64 --expert-tensor-parallel-size 1
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --recompute-granularity selective
  # ---- training
  --micro-batch-size 1 --global-batch-size 4096
  --train-iters 500000
  --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
  # ---- logging and checkpoints (add --save / --load / --tensorboard-dir)
  --log-interval 10 --eval-interval 2000 --eval-iters 20
  --save-interval 1000 --ckpt-format torch_dist --ckpt-fully-parallel-load
  --balance-log-loads-interval 100
)
