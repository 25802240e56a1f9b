"""Bad flag combinations fail before any heavy work, with a message naming the flag.

Every case goes through ``megatron_latentmoe.training.pretrain.main`` -- what the entry point
script runs -- in ONE subprocess (so megatron is imported once: ~5 s of CPU), timed per case;
one case also runs through ``examples/pretrain_stable_latentmoe.py`` itself to check the process
exit status. "Before any heavy work": exit status 2, no process group initialised, no dataset
tokenized (the data cache folder given to the run stays empty), no model built, no checkpoint
folder created. The seconds each case took are printed, not asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import time

import pytest

from . import (
    ENTRY,
    PYTHON,
    REPO,
    args_file_args,
    environment,
    error_lines,
    run_entry,
    scratch_dir,
    tiny_args,
    write_dataset,
)

PLAIN_GPT_CHECKPOINT = "<plain GPT checkpoint>"  # _argv: the one _plain_gpt_checkpoint writes
WORLD_SIZE = "2"  # what examples/run_torchrun.sh gives its flag check (tiny.sh is EP2)
SMALL_CORPUS = scratch_dir() / "small_corpus"  # 50 documents, made by the `outcomes` fixture
# ids up to 4999, as another tokenizer writes them (the shipped one has 4096): `outcomes` too
OTHER_TOKENIZERS_CORPUS = scratch_dir() / "other_tokenizers_corpus"

CASES = {
    "latent_not_divisible_by_tp": (
        ["--moe-latent-size", "63", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--moe-latent-size 63", "--tensor-model-parallel-size 2"],
    ),
    "zero_centered_norm": (  # refused by the model rules (fields.py) in our flag check
        ["--apply-layernorm-1p", "--save-interval", "1000"],
        ["--apply-layernorm-1p", "layernorm_zero_centered_gamma=True"],
    ),
    "fp8_without_te_or_gpu": (
        ["--fp8-format", "e4m3", "--fp8-recipe", "delayed"],
        ["--fp8-format e4m3"],
    ),
    "fp4_without_te_or_gpu": (  # else Megatron's validate_args: a ValueError traceback
        ["--fp4-format", "e2m1"],
        ["--fp4-format e2m1: FP8/FP4 training needs"],
    ),
    "missing_data_path": (
        ["--data-path", "/nonexistent/corpus_text_document"],
        ["--data-path /nonexistent/corpus_text_document", ".bin", ".idx"],
    ),
    "ep_comm_overlap": (  # Megatron's combined 1F1B: forward_step cannot build its plan
        ["--overlap-moe-expert-parallel-comm"],
        ["--overlap-moe-expert-parallel-comm is not supported"],
    ),
    "data_path_of_weights_only": (
        ["--data-path", "0.5"],
        ["--data-path '0.5' has no dataset prefix", "WEIGHT PREFIX"],
    ),
    "balance_loads_interval_below_one": (
        ["--balance-log-loads-interval", "0"],
        ["--balance-log-loads-interval 0 is not allowed", ">= 1"],
    ),
    "no_default_data_and_no_data_path": (
        ["--no-default-data"],
        ["--data-path is required"],
    ),
    "unknown_hidden_act": (
        ["--hidden-act", "gelu"],
        ["--hidden-act", "gelu", "situ", "swiglu"],
    ),
    "qat_expert_width_not_a_multiple_of_32": (  # refused by the config, naming the flag
        [
            "--moe-expert-weight-qat",
            "mxfp4",
            "--moe-ffn-hidden-size",
            "48",
            "--moe-shared-expert-intermediate-size",
            "96",
            "--save-interval",
            "1000",
        ],
        ["--moe-ffn-hidden-size 48", "multiple of 32", "--moe-expert-weight-qat mxfp4"],
    ),
    "megatron_qb_with_eod_mask_loss": (  # refused at start-up, not mid-run by the router
        ["--moe-router-load-balancing-type", "quantile_balancing", "--eod-mask-loss"],
        ["--moe-router-load-balancing-type quantile_balancing", "--eod-mask-loss"],
    ),
    "qb_aux_coeff_not_zero": (  # QB with an aux loss: QB's own coefficient must be 0
        [
            "--moe-router-load-balancing-type",
            "quantile_histogram",
            "seq_aux_loss",
            "--moe-aux-loss-coeff",
            "0.1",
            "0.1",
        ],
        ["--moe-aux-loss-coeff", "0 for 'quantile_histogram'"],
    ),
    "absorb_loss_without_qb": (  # the absorption loss teaches the router QB's bias: QB only
        [
            "--moe-router-load-balancing-type",
            "aux_loss",
            "--moe-aux-loss-coeff",
            "1e-2",
            "--moe-qb-absorb-coeff",
            "0.3",
        ],
        ["--moe-qb-absorb-coeff 0.3", "quantile_histogram"],
    ),
    "rescore_without_qb": (  # the rescoring pass re-solves QB's bias: QB only
        ["--moe-router-load-balancing-type", "none", "--moe-qb-rescore-iters", "50"],
        ["--moe-qb-rescore-iters 50", "quantile_histogram"],
    ),
    "rescore_solves_without_rescoring": (  # the extra solves run inside rescored steps
        ["--moe-qb-rescore-solves", "4"],
        ["--moe-qb-rescore-solves 4", "moe_qb_rescore_iters > 0"],
    ),
    "calibration_without_qb": (  # calibration solves QB's bias: QB only
        ["--moe-router-load-balancing-type", "none", "--moe-qb-calibrate-batches", "4"],
        ["--moe-qb-calibrate-batches 4", "quantile_histogram"],
    ),
    "calibration_pool_reaches_iteration_1": (  # the pool is the run's last N batches
        ["--train-iters", "10", "--moe-qb-calibrate-batches", "10"],
        ["--moe-qb-calibrate-batches 10", "--train-iters - 1 = 9"],
    ),
    "megatron_assert_without_a_message": (  # validate_args' bare assert, as one line
        ["--fp16", "--bf16"],
        [
            "Megatron's validate_args refused these flags",
            "`assert not args.bf16`); this run: --bf16",  # the flag, not only the attribute
        ],
    ),
    "megatron_assert_names_the_flag_not_given": (  # --save alone: the flag it needs, by name
        ["--save", "runs/never_written_by_test_bad_flags"],
        ["`assert args.save_interval is not None`); this run: --save-interval not given"],
    ),
    "megatron_assert_names_both_flags_it_compares": (
        ["--lr", "0.001", "--min-lr", "0.01"],
        ["`assert args.min_lr <= args.lr`); this run: --min-lr 0.01, --lr 0.001"],
    ),
    "topk_plus_one_exceeds_experts": (
        ["--num-experts", "8", "--moe-router-topk", "8"],
        ["--moe-router-topk 8", "--num-experts 8"],
    ),
    "expert_parallel_does_not_divide_the_processes": (  # else each rank fails in Megatron
        ["--expert-model-parallel-size", "4"],
        [f"WORLD_SIZE={WORLD_SIZE}", "--expert-model-parallel-size 4", "a multiple of 4"],
    ),
    "global_batch_not_a_multiple_of_micro_times_data_parallel": (
        ["--global-batch-size", "6", "--micro-batch-size", "4"],
        ["--global-batch-size 6", "--micro-batch-size 4 x 2 data-parallel", "a multiple of 8"],
    ),
    "too_few_centered_qb_bins": (  # QB would balance worse than without it
        ["--moe-qb-binning", "centered", "--moe-qb-num-bins", "2"],
        ["--moe-qb-num-bins 2", ">= 64", "--moe-qb-binning centered"],
    ),
    "more_qb_bins_than_int32_counts_hold": (  # else a traceback when the model is built
        ["--moe-qb-num-bins", "300000000"],
        ["--moe-qb-num-bins 300000000 is not allowed", "<= 268435455", "--num-experts 8"],
    ),
    "grouped_gemm_shared_expert_with_situ": (  # its fused kernel is SwiGLU, not SiTU-GLU
        ["--use-grouped-gemm-for-shared-expert"],
        ["--use-grouped-gemm-for-shared-expert is not allowed", "--hidden-act situ"],
    ),
    "glu_clamp_with_situ": (  # Megatron's GLU clamp: SiTU-GLU would silently ignore it
        ["--activation-func-clamp-value", "7"],
        ["--activation-func-clamp-value 7.0 is not allowed", "--hidden-act situ"],
    ),
    "expert_width_not_a_multiple_of_expert_tp": (  # else Megatron's bare divide assert
        [
            "--moe-ffn-hidden-size",
            "63",
            "--expert-tensor-parallel-size",
            "2",
            "--expert-model-parallel-size",
            "1",
        ],
        [
            "--moe-ffn-hidden-size 63 is not allowed",
            "a multiple of --expert-tensor-parallel-size 2",
        ],
    ),
    "shared_width_not_a_multiple_of_tp": (
        [
            "--moe-shared-expert-intermediate-size",
            "63",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--expert-model-parallel-size",
            "1",
        ],
        [
            "--moe-shared-expert-intermediate-size 63 is not allowed",
            "a multiple of --tensor-model-parallel-size 2",
        ],
    ),
    "full_validation_alone": (  # megatron-core 0.19.2: a TypeError at the first evaluation
        ["--full-validation"],
        ["--full-validation needs --multiple-validation-sets", "both, or neither"],
    ),
    "multiple_validation_sets_alone": (  # megatron-core 0.19.2: NotImplementedError there
        ["--multiple-validation-sets"],
        ["--multiple-validation-sets needs --full-validation", "both, or neither"],
    ),
    "pre_softmax_with_qb": (  # else silently ignored by the sigmoid router
        ["--moe-router-pre-softmax"],
        [
            "--moe-router-pre-softmax is not allowed",
            "False with --moe-router-score-function sigmoid",
        ],
    ),
    "query_groups_not_dividing_heads": (  # else a RuntimeError in the first forward
        ["--num-query-groups", "3"],
        ["--num-query-groups 3 is not allowed", "a divisor of --num-attention-heads 4"],
    ),
    "num_layers_zero": (  # else a ZeroDivisionError in Megatron's weight init
        ["--num-layers", "0", "--first-k-dense-replace", "0"],
        ["--num-layers 0 is not allowed", "a positive integer"],
    ),
    "expert_width_zero": (  # else trains experts of width 0: a routed branch of zeros
        ["--moe-ffn-hidden-size", "0"],
        ["--moe-ffn-hidden-size 0 is not allowed", "a positive integer"],
    ),
    "latent_size_zero": (
        ["--moe-latent-size", "0"],
        ["--moe-latent-size 0", "a positive integer"],
    ),
    "balancer_that_megatron_drops_in_a_list": (  # its router ignores sinkhorn in a list
        [
            "--moe-router-load-balancing-type",
            "aux_loss",
            "sinkhorn",
            "--moe-aux-loss-coeff",
            "0.01",
            "0",
        ],
        ["aux_loss", "sinkhorn", "distinct aux losses"],
    ),
    "yaml_config": (  # megatron.training reads the file right after parsing: a traceback
        ["--yaml-cfg", "/nonexistent/config.yaml"],
        [
            "argument --yaml-cfg: /nonexistent/config.yaml is not allowed: this entry point takes "
            "no YAML config; allowed: the settings as flags (all flags: --help)"
        ],
    ),
    "layer_spec_module": (
        ["--spec", "my.specs", "layer_spec"],
        [
            "--spec my.specs layer_spec is not allowed: the layer spec is Stable LatentMoE's own "
            "(choose its backend with --transformer-impl local or transformer_engine)"
        ],
    ),
    "heterogeneous_layers": (
        ["--heterogeneous-layers-config-path", "/nonexistent/layers.json"],
        [
            "--heterogeneous-layers-config-path /nonexistent/layers.json is not allowed: this "
            "model's layers are set by its flags; allowed: none"
        ],
    ),
    "heterogeneous_layers_as_json": (
        ["--heterogeneous-layers-config-encoded-json", "{}"],
        [
            "--heterogeneous-layers-config-encoded-json {} is not allowed: this model's layers "
            "are set by its flags; allowed: none"
        ],
    ),
    "hybrid_layer_pattern": (  # else --num-layers becomes its length, its layer kinds ignored
        ["--hybrid-override-pattern", "M*-"],
        [
            "--hybrid-override-pattern M*- is not allowed: this model's layers are set by its "
            "flags; allowed: none"
        ],
    ),
    "multi_token_prediction": (
        ["--mtp-num-layers", "1"],
        [
            "--mtp-num-layers 1 is not allowed: this entry point trains no multi-token "
            "prediction; allowed: 0"
        ],
    ),
    "partial_rope": (
        ["--rotary-percent", "0.5"],
        [
            "--rotary-percent 0.5 is not allowed: this model rotates every head dimension; "
            "allowed: 1.0"
        ],
    ),
    "rope_scaling": (
        ["--use-rope-scaling"],
        ["--use-rope-scaling is not allowed: this model's RoPE is unscaled"],
    ),
    "qkv_bias": (
        ["--add-qkv-bias"],
        ["--add-qkv-bias is not allowed: this model has no linear biases"],
    ),
    "squared_relu": (
        ["--squared-relu"],
        ["--squared-relu is not allowed: the activation is --hidden-act situ or swiglu"],
    ),
    "quick_geglu": (
        ["--quick-geglu"],
        ["--quick-geglu is not allowed: the activation is --hidden-act situ or swiglu"],
    ),
    "checkpoint_args_without_a_checkpoint": (  # else silently ignored: no checkpoint to read
        ["--use-checkpoint-args"],
        [
            "--use-checkpoint-args reads the model flags from a checkpoint: give it with --load "
            "(or --pretrained-checkpoint)"
        ],
    ),
    "checkpoint_args_with_local_checkpoints": (  # Megatron's bare assert: a traceback
        ["--use-checkpoint-args", "--load", "/nonexistent/ckpt"]
        + ["--non-persistent-ckpt-type", "local"],
        [
            "--use-checkpoint-args with --non-persistent-ckpt-type local: not supported by "
            "megatron-core 0.19.2 (all flags must be known before its local checkpoint manager "
            "starts); give the model flags instead"
        ],
    ),
    "multi_latent_attention": (
        ["--multi-latent-attention"],
        [
            "--multi-latent-attention is not supported: attention is Megatron's GQA "
            "self-attention with RoPE (--group-query-attention --num-query-groups N)"
        ],
    ),
    "learned_position_embeddings": (
        ["--position-embedding-type", "learned_absolute"],
        [
            "--position-embedding-type learned_absolute is not allowed: this model's positions "
            "are rotary; allowed: rope"
        ],
    ),
    "inference_optimized_backend": (  # one of Megatron's choices, not a spec of ours
        ["--transformer-impl", "inference_optimized"],
        ["--transformer-impl inference_optimized: this model supports local or transformer_engine"],
    ),
    "transformer_engine_not_installed": (
        ["--transformer-impl", "transformer_engine"],
        [
            "--transformer-impl transformer_engine: Transformer Engine is not installed "
            "(pip install 'megatron-latentmoe[te]' on a CUDA machine), use --transformer-impl local"
        ],
    ),
    "grouped_gemm_with_local_layers": (
        ["--moe-grouped-gemm"],
        ["--moe-grouped-gemm needs --transformer-impl transformer_engine"],
    ),
    "local_attention_backend": (  # else validate_args' TypeError (args.spec is None)
        ["--attention-backend", "local"],
        [
            "--attention-backend local is not allowed with --transformer-impl local: "
            "megatron-core 0.19.2 takes it only with --spec local",
            "allowed: auto or unfused",
        ],
    ),
    "flash_attention_backend_with_local_layers": (  # else silently Megatron's own attention
        ["--attention-backend", "flash"],
        [
            "--attention-backend flash is not allowed with --transformer-impl local: it picks a "
            "Transformer Engine kernel, and the local layers run Megatron's own unfused "
            "attention; allowed: auto or unfused"
        ],
    ),
    "wandb_without_a_run_name": (  # else Megatron's ValueError traceback, last rank
        ["--wandb-project", "proj"],
        ["--wandb-project proj needs --wandb-exp-name NAME (the W&B run's name)"],
    ),
    "wandb_not_installed": (  # else a ModuleNotFoundError traceback, last rank
        ["--wandb-project", "proj", "--wandb-exp-name", "run1"],
        ["--wandb-project proj needs the wandb package, which is not installed"],
    ),
    "precision_aware_optimizer_without_te": (  # else a ModuleNotFoundError, every rank
        ["--use-precision-aware-optimizer", "--use-distributed-optimizer"],
        [
            "--use-precision-aware-optimizer needs Transformer Engine (megatron-core 0.19.2 takes "
            "its FusedAdam), which is not installed; allowed without TE: off"
        ],
    ),
    "flex_dispatcher_without_gpus": (
        ["--moe-token-dispatcher-type", "flex"],
        ["--moe-token-dispatcher-type flex needs GPUs (DeepEP); use alltoall"],
    ),
    # megatron-core 0.19.2 falls back to it where --load holds no checkpoint: before, after
    # building the model, "FileNotFoundError: No checkpoint found in load directory or
    # pretrained directory" on every rank
    "pretrained_checkpoint_holding_none": (
        ["--pretrained-checkpoint", "/nonexistent/pretrained", "--save-interval", "1000"],
        [
            "--pretrained-checkpoint /nonexistent/pretrained: no checkpoint there "
            "(latest_checkpointed_iteration.txt is not there) and no --load is given; give it "
            "the folder a Megatron save or the HF import wrote (SAVE_ROOT)"
        ],
    ),
    # before: the first non-persistent save deleted --save's persistent checkpoint of the
    # iteration before it (Megatron's retention reads the non-persistent tracker)
    "save_retain_with_global_non_persistent": (
        [
            "--save-retain-interval",
            "20",
            "--non-persistent-save-interval",
            "2",
            "--non-persistent-ckpt-type",
            "global",
        ],
        ["--save-retain-interval 20 is not allowed with --non-persistent-ckpt-type global"],
    ),
    # before: Megatron loads a global non-persistent checkpoint only as torch_dist; a torch_dcp
    # one failed the resume ("... is not a distributed checkpoint"); on CPU validate_args'
    # "--ckpt-format torch_dcp is only tested with FSDP" came first (with a GPU and FSDP2: none)
    "global_non_persistent_saves_in_torch_dcp": (
        ["--ckpt-format", "torch_dcp", "--save-interval", "4"]
        + ["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"],
        [
            "--non-persistent-save-interval 2 with --non-persistent-ckpt-type global is not "
            "allowed with --ckpt-format torch_dcp: megatron-core 0.19.2 saves them in torch_dcp "
            "and loads them only as torch_dist, so a resume from one fails; allowed: "
            "--ckpt-format torch_dist, or no --non-persistent-save-interval"
        ],
    ),
    "global_non_persistent_saves_in_torch": (  # else an AssertionError at that save, mid-run
        ["--ckpt-format", "torch", "--save-interval", "4"]
        + ["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"],
        [
            "--non-persistent-save-interval 2 with --non-persistent-ckpt-type global is not "
            "allowed with --ckpt-format torch: megatron-core 0.19.2 fails at its first "
            "non-persistent save; allowed: --ckpt-format torch_dist, or no "
            "--non-persistent-save-interval"
        ],
    ),
    # before: Megatron's "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than
    # one"; with it set, a TypeError traceback at the model's FSDP2 wrapping
    "torch_fsdp2_without_a_gpu": (
        ["--use-torch-fsdp2", "--expert-model-parallel-size", "1"],
        [
            "--use-torch-fsdp2 needs a CUDA GPU: torch's FSDP2 takes its device from CUDA; "
            "allowed without a GPU: no --use-torch-fsdp2 (--use-distributed-optimizer shards the "
            "optimizer state)"
        ],
    ),
    # before: Megatron's "FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset"; with it and
    # --ckpt-format fsdp_dtensor, a traceback at the model's wrapping ("Invalid device string:
    # 'cuda:cpu'", or "einops is not installed" first without einops)
    "megatron_fsdp_without_a_gpu": (
        ["--use-megatron-fsdp", "--expert-model-parallel-size", "1"],
        [
            "--use-megatron-fsdp needs a CUDA GPU: Megatron-FSDP puts its buffers on the CUDA "
            "device; allowed without a GPU: no --use-megatron-fsdp (--use-distributed-optimizer "
            "shards the optimizer state)"
        ],
    ),
    # before: "KeyError: 'reserved_bytes.all.current'" (torch.cuda.memory_stats() is empty
    # without a GPU) at the first TensorBoard write, on the last rank
    "memory_logging_without_a_gpu": (
        ["--log-memory-to-tensorboard", "--tensorboard-dir", str(scratch_dir() / "tb_memory")]
        + ["--save-interval", "1000", "--train-iters", "2"],
        [
            "--log-memory-to-tensorboard needs a CUDA GPU: megatron-core 0.19.2 logs the CUDA "
            "memory allocator's statistics, which a run without a GPU does not have; allowed "
            "without a GPU: off"
        ],
    ),
    # before: it trained, and the attention was what it would have been without it
    "tensor_parallel_without_sequence_parallel": (
        ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "1"],
        ["--tensor-model-parallel-size 2 with MoE needs --sequence-parallel (Megatron)"],
    ),
    "missing_tokenizer_model": (
        ["--tokenizer-model", "/nonexistent/tokenizer"],
        ["--tokenizer-model /nonexistent/tokenizer: no such file or folder"],
    ),
    "data_path_made_with_another_tokenizer": (  # else an IndexError traceback on every rank
        ["--data-path", str(OTHER_TOKENIZERS_CORPUS), "--split", "100,0,0"]
        + ["--save-interval", "1000"],
        [
            f"--data-path {OTHER_TOKENIZERS_CORPUS}: {OTHER_TOKENIZERS_CORPUS}.bin, in its first "
            "1 MiB, holds token id 4999, but this run's tokenizer (HuggingFaceTokenizer "
            f"{REPO / 'megatron_latentmoe' / 'data' / 'assets' / 'tokenizer'}) has 4096 ids "
            "(allowed: 0..4095): the dataset was made with another tokenizer. Remake it with "
            "tools/preprocess_data.py --tokenizer ",
        ],
    ),
    "shipped_corpus_with_a_tokenizer_type_it_cannot_use": (  # the shipped ids, silently
        ["--tokenizer-type", "NullTokenizer", "--vocab-size", "5000", "--save-interval", "1000"],
        [
            "--tokenizer-type NullTokenizer without --data-path: the shipped corpus is tokenized "
            "only with a HuggingFaceTokenizer (the shipped one, or --tokenizer-model DIR); "
            "allowed: --data-path PREFIX of a dataset made with this tokenizer (Megatron's "
            "tools/preprocess_data.py), or --tokenizer-type HuggingFaceTokenizer"
        ],
    ),
    "missing_data_args_file": (
        ["--data-args-path", "/nonexistent/data_args.txt"],
        ["--data-args-path /nonexistent/data_args.txt: no such file"],
    ),
    "calibration_with_a_batch_size_schedule": (  # the pool is N batches of one size
        ["--moe-qb-calibrate-batches", "4", "--step-batch-size-schedule", "0:8"],
        [
            "--moe-qb-calibrate-batches 4 does not support --step-batch-size-schedule (the pool "
            "is N batches of one fixed global batch size)"
        ],
    ),
    "batch_rampup": (  # megatron-core 0.19.2 parses it and never ramps: silently ignored
        ["--rampup-batch-size", "8", "8", "32"],
        [
            "--rampup-batch-size 8 8 32 is not allowed: megatron-core 0.19.2 parses it but never "
            "ramps (every step would train --global-batch-size); allowed: "
            "--step-batch-size-schedule 'THRESHOLD:BATCH ...' without --global-batch-size"
        ],
    ),
    "both_schedule_flags": (  # OptimizerParamScheduler's assert once the model is built
        ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
        [
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are not "
            "allowed together (megatron-core 0.19.2 fails on them after building the model); "
            "allowed: one of the two (the first trains on with this run's learning-rate "
            "schedule, the second with the checkpoint's)"
        ],
    ),
    "megatron_value_error": (  # validate_args' ValueError, as one line (a traceback before)
        ["--step-batch-size-schedule", "0:8 4096:16"],
        [
            "Megatron's validate_args refused these flags: Cannot specify both "
            "--step-batch-size-schedule and --global-batch-size"
        ],
    ),
    "async_save_of_legacy_checkpoints": (  # else NotImplementedError at the first save
        ["--async-save", "--ckpt-format", "torch", "--save-interval", "1000"],
        [
            "--async-save is not allowed with --ckpt-format torch: megatron-core 0.19.2 has no "
            "asynchronous save of the legacy format (NotImplementedError at the first save); "
            "allowed: --ckpt-format torch_dist or torch_dcp"
        ],
    ),
    "persistent_checkpoint_worker_without_a_gpu": (  # else the run hangs at its first save
        ["--async-save", "--use-persistent-ckpt-worker", "--save-interval", "1000"],
        [
            "--async-save --use-persistent-ckpt-worker needs a CUDA GPU: megatron-core 0.19.2's "
            "checkpoint worker process selects one, dies without, and the run hangs at its first "
            "save; allowed without a GPU: no --use-persistent-ckpt-worker (synchronous saves)"
        ],
    ),
    "calibration_with_a_cyclic_loader": (
        ["--moe-qb-calibrate-batches", "4", "--dataloader-type", "cyclic"],
        [
            "--moe-qb-calibrate-batches 4 with --dataloader-type cyclic: allowed: single (the "
            "pool is the last N global batches of the run's sample order)"
        ],
    ),
    "megatron_assert_with_a_message": (  # validate_args' assert, as one line with its text
        ["--fp16-lm-cross-entropy", "--save-interval", "1000"],
        [
            "Megatron's validate_args refused these flags",
            "(arguments.py:1333 `assert args.fp16`): lm cross entropy in fp16 only support in "
            "fp16 mode.; this run: --fp16 not given",  # the message once, not also in the line
        ],
    ),
    "checkpoint_arg_named_as_the_checkpoints": (  # not as a flag the user typed
        ["--use-checkpoint-args", "--load", PLAIN_GPT_CHECKPOINT, "--ckpt-format", "torch"],
        [
            "--position-embedding-type learned_absolute is not allowed: this model's positions "
            "are rotary; allowed: rope "
            "(--position-embedding-type: from the checkpoint's args, --use-checkpoint-args)"
        ],
    ),
    "megatron_config_value_error": (  # TransformerConfig's ValueError, as one line
        ["--moe-single-grouped-weight", "--save-interval", "1000"],
        [
            "moe_single_grouped_weight and moe_single_grouped_bias require moe_grouped_gemm=True. "
            "(moe_single_grouped_weight: --moe-single-grouped-weight; moe_single_grouped_bias: "
            "--moe-single-grouped-bias not given; moe_grouped_gemm: --moe-grouped-gemm not given)"
        ],
    ),
    "misspelt_flag": (  # argparse's error line alone, without its ~800-line usage
        ["--moe-qb-bins", "10"],
        ["unrecognized arguments: --moe-qb-bins 10", "--help"],
    ),
    "seq_length_not_divisible_by_tp_under_sp": (  # else a reduce-scatter assert per rank
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--expert-model-parallel-size",
            "1",
            "--seq-length",
            "127",
        ],
        ["--seq-length 127 is not allowed", "--tensor-model-parallel-size 2", "a multiple of 2"],
    ),
    "layernorm_recompute_without_te": (  # else a NameError (TE's FP8 state) in the forward
        ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "layernorm"],
        ["--recompute-modules layernorm needs Transformer Engine", "core_attn, mlp, moe"],
    ),
    "moe_act_recompute_without_te": (  # else refused for --moe-grouped-gemm, then for TE
        ["--recompute-granularity", "selective", "--recompute-modules", "moe_act"],
        ["--recompute-modules moe_act needs --moe-grouped-gemm", "needs Transformer Engine"],
    ),
    "context_parallel_with_local_attention": (  # else an assert while the model is built
        ["--context-parallel-size", "2", "--expert-model-parallel-size", "1"],
        ["--context-parallel-size 2 needs --transformer-impl transformer_engine", "local: 1"],
    ),
    "default_split_leaves_a_part_without_data": (  # Megatron would hang building it
        [
            "--data-path",
            str(SMALL_CORPUS),
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            os.path.join(REPO, "megatron_latentmoe", "data", "assets", "tokenizer"),
        ],
        ["Megatron's default 969,30,1", "test part none of the 50 sequences", "98,2,0"],
    ),
    "blend_with_an_unsampled_validation_part": (  # else 'no sample to consume: 0', every rank
        ["--data-path", "0.5", str(SMALL_CORPUS), "0.5", str(SMALL_CORPUS), "--split", "98,2,0"]
        + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model"]
        + [os.path.join(REPO, "megatron_latentmoe", "data", "assets", "tokenizer")],
        [
            "--data-path with 2 datasets (a blend), --eval-iters 0 and a validation part in "
            "--split 98,2,0",
            "--eval-iters N > 0, or a --split with no validation or test part (e.g. 100,0,0)",
        ],
    ),
    "pipeline_layout_with_the_wrong_layer_count": (  # Megatron's bare assert: a traceback
        ["--expert-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
        + ["--pipeline-model-parallel-layout", "Et|tL", "--save-interval", "1000"],
        ["--num-layers 4", "--pipeline-model-parallel-layout 'Et|tL'", "decoder layers 2"],
    ),
    "uneven_pipeline_stage_past_the_last_layer": (  # else stage 2 silently builds no layer
        ["--expert-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
        + ["--decoder-first-pipeline-num-layers", "5", "--save-interval", "1000"],
        ["--decoder-first-pipeline-num-layers 5 is not allowed", "5 of the 4 layers", "at most 3"],
    ),
    "virtual_stages_with_fewer_micro_batches_than_stages": (  # else a ValueError at step 1
        ["--expert-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
        + ["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4"]
        + ["--save-interval", "1000"],
        [
            "--global-batch-size 4 is not allowed with 2 virtual pipeline stages",
            "--microbatch-group-size-per-virtual-pipeline-stage 2",
            "at least 8",
        ],
    ),
    "log_interval_zero": (  # else a ZeroDivisionError traceback after iteration 1, every rank
        ["--log-interval", "0"],
        [
            "--log-interval 0 is not allowed: megatron-core 0.19.2 divides by it after the first "
            "iteration; allowed: an integer >= 1"
        ],
    ),
    "eval_interval_zero": (  # else a ZeroDivisionError traceback sizing the datasets, every rank
        ["--eval-interval", "0", "--eval-iters", "1"],
        [
            "--eval-interval 0 is not allowed: megatron-core 0.19.2 divides by it while it sizes "
            "the validation data; allowed: an integer >= 1 (no evaluation: --eval-iters 0)"
        ],
    ),
    # else, without TE, a RuntimeError traceback on every rank ("needs 'yaml' and
    # 'transformer_engine' packages"); with TE, megatron-core's local layers ignore it
    "tp_comm_overlap_with_local_layers": (
        ["--transformer-impl", "local", "--tp-comm-overlap", "--sequence-parallel"]
        + ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "1"],
        [
            "--tp-comm-overlap needs --transformer-impl transformer_engine (Transformer Engine's "
            "userbuffers, on CUDA GPUs; megatron-core 0.19.2's local layers do not overlap); "
            "allowed with --transformer-impl local: off"
        ],
    ),
    "deprecated_flag_named_as_given": (  # not as the field it sets, "not given"
        ["--moe-router-padding-for-fp8", "--save-interval", "1000"],
        [
            "fp8/fp4 must be specified when moe_router_padding_for_quantization is True. "
            "(moe_router_padding_for_quantization: --moe-router-padding-for-fp8)"
        ],
    ),
    # the same check on the shipped corpus (1404 documents): 1 in 10000 is 0.14 of a sequence
    "split_leaves_the_shipped_corpus_a_part_without_data": (  # Megatron would hang building it
        ["--split", "9999,1,0"],
        ["--split 9999,1,0 gives the validation part none of the 1404 sequences of the shipped"],
    ),
}
# refusals only on a machine without Transformer Engine (FP8: or without a GPU); with TE the run
# would go on into heavy work, so these are not run there
WITHOUT_TE = {
    "fp8_without_te_or_gpu",
    "fp4_without_te_or_gpu",
    "transformer_engine_not_installed",
    "flash_attention_backend_with_local_layers",
    "precision_aware_optimizer_without_te",
    "moe_act_recompute_without_te",
    "layernorm_recompute_without_te",
}
HAS_TE = importlib.util.find_spec("transformer_engine") is not None
WITHOUT_GPU = {  # refusals only without a GPU
    "persistent_checkpoint_worker_without_a_gpu",
    "torch_fsdp2_without_a_gpu",
    "megatron_fsdp_without_a_gpu",
    "memory_logging_without_a_gpu",
}


HAS_WANDB = importlib.util.find_spec("wandb") is not None
WITHOUT_WANDB = {"wandb_not_installed"}


def _runs_here(name: str) -> bool:
    import torch

    return not (
        HAS_TE
        and name in WITHOUT_TE
        or torch.cuda.is_available()
        and name in WITHOUT_GPU
        or HAS_WANDB
        and name in WITHOUT_WANDB
    )


HEAVY_MARKERS = (
    "initializing torch distributed",
    "building train, validation, and test datasets",
    "number of parameters",
    "[pretrain_stable_latentmoe] data:",
    "Traceback",
)


DRIVER = r"""
import contextlib, io, json, sys, time
sys.path.insert(0, sys.argv[1])
from megatron_latentmoe.compat import apply_python311_compat
apply_python311_compat()
import megatron.training.arguments  # the imports are not what is timed per case
import megatron_latentmoe.training.model_provider
from megatron_latentmoe.training.pretrain import main
for name, argv in json.loads(open(sys.argv[2]).read()).items():
    out, err = io.StringIO(), io.StringIO()
    start = time.time()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:  # argparse errors exit(2)
        code = exc.code
    print("CASE " + json.dumps(dict(name=name, code=code, seconds=time.time() - start,
                                   output=out.getvalue() + err.getvalue())), flush=True)
"""


def _plain_gpt_checkpoint() -> str:
    """A Megatron torch-format checkpoint whose saved args are a plain GPT's (learned absolute
    position embeddings); no weights: ``--use-checkpoint-args`` reads only the args."""
    import argparse

    import torch

    path = scratch_dir() / "plain_gpt_checkpoint"
    (path / "iter_0000001" / "mp_rank_00").mkdir(parents=True, exist_ok=True)
    (path / "latest_checkpointed_iteration.txt").write_text("1")
    saved = argparse.Namespace(position_embedding_type="learned_absolute")
    state = {"args": saved, "iteration": 1, "checkpoint_version": 3.0}
    torch.save(state, path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    return str(path)


def _argv(name):
    flags = [_plain_gpt_checkpoint() if f == PLAIN_GPT_CHECKPOINT else f for f in CASES[name][0]]
    return [
        *tiny_args(),
        "--data-cache-path",
        str(scratch_dir() / f"bad_flags_cache_{name}"),
        "--save",
        str(scratch_dir() / f"bad_flags_ckpt_{name}"),
        *flags,
    ]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repository root, stdout and stderr together."""
    return subprocess.run(
        [PYTHON, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=dict(environment(), WORLD_SIZE=WORLD_SIZE),
        timeout=300,
    )


@pytest.fixture(scope="module")
def outcomes():
    """{name: (returncode, output, seconds)} of every case, run by main() in one process."""
    from megatron_latentmoe.data.indexed import preprocess_jsonl

    run = [name for name in CASES if _runs_here(name)]
    for name in run:
        (scratch_dir() / f"bad_flags_cache_{name}").mkdir(exist_ok=True)
    docs = scratch_dir() / "small_corpus.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(50)))
    preprocess_jsonl(docs, SMALL_CORPUS, progress=False)
    write_dataset(OTHER_TOKENIZERS_CORPUS, [range(i * 100, i * 100 + 100) for i in range(50)])
    cases = {name: _argv(name) for name in run}
    # in a file: on the command line the cases passed Linux's 128 KiB limit of one argument
    cases_file = scratch_dir() / "bad_flags_cases.json"
    cases_file.write_text(json.dumps(cases))
    proc = _run(["-c", DRIVER, str(REPO), str(cases_file)])
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            case = json.loads(line[5:])
            results[case["name"]] = (case["code"], case["output"], case["seconds"])
    assert sorted(results) == sorted(run), proc.stdout[-5000:]
    return results


@pytest.mark.parametrize("name", sorted(CASES))
def test_fails_fast_naming_the_flag(outcomes, name):
    if name not in outcomes:
        pytest.skip("Transformer Engine or a GPU is here: the flag is accepted")
    returncode, output, seconds = outcomes[name]
    _check(name, returncode, output, seconds)


def test_entry_point_process_exits_2_before_heavy_work():
    name = "latent_not_divisible_by_tp"
    # its --data-cache-path (the outcomes fixture makes it for all cases; this test runs alone too)
    (scratch_dir() / f"bad_flags_cache_{name}").mkdir(exist_ok=True)
    start = time.time()
    proc = _run([str(ENTRY), *_argv(name)])
    _check(name, proc.returncode, proc.stdout, time.time() - start)


def test_plain_torchrun_shows_a_misspelt_flags_one_line():
    """Megatron's parser, with ours (``cli_errors.one_line_errors``), under plain torchrun: its
    table showed ``error_file: <N/A>`` for argparse's one line."""
    run = run_entry(["--train-itres", "3"], nproc=1)
    root = run.output[run.output.index("Root Cause (first observed failure):") :]
    assert "  exitcode  : 2 " in root, run.output[-3000:]
    assert (
        "  traceback : pretrain_stable_latentmoe.py: error: unrecognized arguments: "
        "--train-itres 3 (all flags: --help)"
    ) in root, run.output[-3000:]


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            CASES["latent_not_divisible_by_tp"][0],
            "pretrain_stable_latentmoe: error: --moe-latent-size 63 is not allowed: a multiple of "
            "--tensor-model-parallel-size 2",
        ),
        (
            ["--train-itres", "3"],
            "pretrain_stable_latentmoe.py: error: unrecognized arguments: --train-itres 3 (all "
            "flags: --help)",
        ),
    ],
)
def test_two_ranks_print_a_bad_flags_line_once(flags, line):
    """A bad flag (our check's FlagError, argparse's error) is refused alike by every rank before
    any collective: under torchrun with 2 ranks the line is printed once, by rank 0 (each rank
    printed it: 1024 times at scale), and both ranks exit 2 with it in their error files
    (torchrun's table shows it for each, rank 0 the root cause)."""
    run = run_entry(flags)
    assert error_lines(run.output) == [line], run.output[-3000:]
    assert re.findall(r"^\s+exitcode\s+: (\S+)", run.output, re.M) == ["2", "2"], run.output
    assert run.output.count(f"  traceback : {line}\n") == 2, run.output[-3000:]
    root = run.output[run.output.index("Root Cause (first observed failure):") :]
    assert "  rank      : 0 (local_rank: 0)" in root, run.output[-3000:]


def test_a_shared_width_the_export_refuses_trains_with_a_warning():
    """The flag check passes (Megatron trains any shared width) and says, once, that the HF
    converter will refuse this model's checkpoints."""
    flags = ["--moe-shared-expert-intermediate-size", "96"]  # tiny.sh's experts: 64 wide
    proc = _run([str(ENTRY), "--check-flags", *tiny_args(), *flags])
    assert proc.returncode == 0, proc.stdout[-3000:]
    warning = (
        "warning: this model trains, but the HF converter will refuse its checkpoints: "
        "--moe-shared-expert-intermediate-size 96 is not allowed: a multiple of "
        "--moe-ffn-hidden-size 64"
    )
    assert proc.stdout.count(warning) == 1, proc.stdout[-3000:]


def test_qb_as_a_drop_in_for_a_megatron_moe_trains_with_a_warning():
    """Without --moe-latent-size the MoE layers are Megatron's MoELayer (README: QB is a drop-in):
    it trains, and says at start-up, once, that the converter will refuse its checkpoints (it
    said nothing: the refusal came only at export)."""
    args = list(tiny_args())
    at = args.index("--moe-latent-size")
    assert args[at : at + 3] == ["--moe-latent-size", "64", "--moe-latent-norm"]
    del args[at : at + 3]
    proc = _run([str(ENTRY), "--check-flags", *args])
    assert proc.returncode == 0, proc.stdout[-3000:]
    warning = (
        "warning: this model trains, but the HF converter will refuse its checkpoints: "
        "--moe-latent-size None is not allowed: a positive integer (the HF model is the Stable "
        "LatentMoE block, its routed experts in a latent of this width); unset, the MoE layers "
        "are Megatron's MoELayer (QB as a drop-in), which the HF model does not implement"
    )
    assert proc.stdout.count(warning) == 1, proc.stdout[-3000:]


def test_the_launch_scripts_example_passes_the_flag_check():
    """examples/run_torchrun.sh's header command, as printed, passes the check the script makes
    before it starts the ranks (its ``--save`` without ``--save-interval`` was refused)."""
    header = (REPO / "examples" / "run_torchrun.sh").read_text(encoding="utf-8")
    (command,) = re.findall(
        r"^#   bash examples/run_torchrun\.sh (examples/\S+) (--.*)$", header, re.M
    )
    args_file, flags = command
    proc = _run(
        [str(ENTRY), "--check-flags", *args_file_args(REPO / args_file), *shlex.split(flags)]
    )
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_the_readmes_training_commands_pass_the_flag_check(tmp_path):
    """The README's code-block training commands, their placeholders filled in (a folder for
    SAVE_DIR), pass the same check: the MXFP4 block exports the checkpoint its run saves, and
    Megatron refuses --save without --save-interval."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    commands = [
        line.split("#")[0]
        for block in blocks
        for line in block.replace("\\\n", " ").splitlines()
        if line.startswith("bash examples/run_torchrun.sh ")
    ]
    assert commands  # the MXFP4 block's
    for command in commands:
        _, _, args_file, *flags = shlex.split(command.replace("SAVE_DIR", str(tmp_path)))
        proc = _run([str(ENTRY), "--check-flags", *args_file_args(REPO / args_file), *flags])
        assert proc.returncode == 0, (command, proc.stdout[-3000:])


def test_the_shipped_tokenizer_of_a_moved_clone_is_this_installs():
    """A checkpoint's args (``--use-checkpoint-args``) name the shipped tokenizer by the path of
    the clone that trained it; a clone moved or deleted since reads this install's copy (the
    same files, as the converter does) instead of refusing a folder that is gone."""
    from megatron_latentmoe.data import DEFAULT_TOKENIZER_DIR

    gone = "/moved/clone/megatron_latentmoe/data/assets/tokenizer"
    proc = _run([str(ENTRY), "--check-flags", *tiny_args(), "--tokenizer-model", gone])
    assert proc.returncode == 0, proc.stdout[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("  tokenizer_model ")]
    assert line.split()[-1] == str(DEFAULT_TOKENIZER_DIR), line


def test_help_lists_our_flags():
    """``--help`` works (megatron-core 0.19.2 alone crashes on a bare '%' in one help string)."""
    proc = _run([str(ENTRY), "--help"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    for flag in (
        "--hidden-act",
        "--moe-qb-num-bins",
        "--moe-qb-binning",
        "--first-k-dense-replace",
        "--balance-log-file",
        "quantile_histogram",
        "1.10 = 10%",
    ):
        assert flag in proc.stdout, flag


def _check(name, returncode, output, seconds):
    expected = CASES[name][1]
    error_lines = [line for line in output.splitlines() if "error:" in line]
    print(
        f"{name}: exit {returncode} after {seconds:.2f} s: "
        f"{error_lines[-1] if error_lines else output[-500:]}"
    )
    assert returncode == 2, output[-3000:]
    assert error_lines, output[-3000:]
    message = error_lines[-1]
    for needle in expected:
        assert needle in message, (needle, message)
    for marker in HEAVY_MARKERS:
        assert marker not in output, (marker, output[-3000:])
    assert "usage:" not in output, output[-3000:]  # one line, not argparse's usage
    cache = scratch_dir() / f"bad_flags_cache_{name}"
    assert not any(os.scandir(cache)), f"data was prepared in {cache}"
    assert not (scratch_dir() / f"bad_flags_ckpt_{name}").exists()


def test_split_check_follows_megatron_split_arithmetic(tmp_path):
    """``--split`` is refused exactly when a non-zero part gets no sequence under megatron-core's
    own split arithmetic (``round(bound * sequences)``), for every prefix of a blend."""
    import struct
    from types import SimpleNamespace

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.training.data_args import check_split

    def dataset(name: str, sequences: int) -> str:
        prefix = str(tmp_path / name)  # only the .idx header is read
        header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, sequences, sequences)
        open(prefix + ".idx", "wb").write(header)
        return prefix

    def args(split, paths, eval_iters=10):
        return SimpleNamespace(
            split=split, data_path=paths, eval_iters=eval_iters, full_validation=False
        )

    small, large = dataset("small", 400), dataset("large", 600)
    ok = [(None, [large]), ("98,2,0", [small]), ("99,1,0", [small]), ("1", [small])]
    for split, paths in ok:
        check_split(args(split, paths))
    # a blend with --eval-iters 0: only a split without validation and test parts
    check_split(args("100,0,0", ["0.5", large, "0.5", small], eval_iters=0))
    check_split(args("98,2,0", [large], eval_iters=0))  # one dataset: sized by the split
    blend = args("98,2,0", ["0.5", large, "0.5", small], eval_iters=0)
    check_split(SimpleNamespace(**{**vars(blend), "full_validation": True}))
    with pytest.raises(
        FlagError, match=r"^--data-path with 2 datasets \(a blend\), --eval-iters 0 "
    ):
        check_split(args("98,2,0", ["0.5", large, "0.5", small], eval_iters=0))
    # 969,30,1 at 400 sequences: the test part is [round(399.6), round(400)) = [400, 400)
    bad = [
        (None, [small], "test"),
        (None, ["0.5", large, "0.5", small], "test"),
        ("99.9,0.1,0", [small], "validation"),
        ("0,0,0", [small], None),
        ("x", [small], None),
    ]
    for split, paths, part in bad:
        with pytest.raises(FlagError, match=rf"gives the {part} part none" if part else "--split"):
            check_split(args(split, paths))


def test_linear_biases_from_a_checkpoint_are_refused():
    """No flag turns Megatron's ``add_bias_linear`` on (only ``--disable-bias-linear``, our
    default, exists), but ``--use-checkpoint-args`` takes it from a checkpoint: the refusal
    names the setting, not a flag that does not exist."""
    from types import SimpleNamespace

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.training.arguments import validate_stable_latentmoe_args

    args = SimpleNamespace(
        spec=None,
        multi_latent_attention=False,
        heterogeneous_layers_config_path=None,
        heterogeneous_layers_config_encoded_json=None,
        mtp_num_layers=None,
        position_embedding_type="rope",
        rotary_percent=1.0,
        use_rope_scaling=False,
        add_qkv_bias=False,
        add_bias_linear=True,
    )
    with pytest.raises(FlagError) as err:
        validate_stable_latentmoe_args(args, has_cuda=False, have_te=False)
    assert str(err.value) == (
        "add_bias_linear=True (from the checkpoint's args) is not allowed: this model has no "
        "linear biases; allowed: --disable-bias-linear, the default"
    )


def test_pipeline_split_check_leaves_each_other_stage_one_layer():
    """``--decoder-first/last-pipeline-num-layers`` may fill the model up to one layer for each
    other stage, not more."""
    from types import SimpleNamespace

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.training.arguments import _check_pipeline_split

    def split(first, last=None, pp=2):
        return SimpleNamespace(
            num_layers=4,
            pipeline_model_parallel_size=pp,
            decoder_first_pipeline_num_layers=first,
            decoder_last_pipeline_num_layers=last,
            pipeline_model_parallel_layout=None,
        )

    for ok in (split(3), split(None, 3), split(2, 1, pp=3), split(2, 2)):
        _check_pipeline_split(ok)
    with pytest.raises(FlagError) as err:
        _check_pipeline_split(split(2, 2, pp=3))
    assert str(err.value) == (
        "--num-layers 4 --pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 2 "
        "--decoder-last-pipeline-num-layers 2 is not allowed: the first and last pipeline stages "
        "would hold 4 of the 4 layers; allowed: at most 3 in those stages together (each of the "
        "other 1 stages holds at least one layer)"
    )
    with pytest.raises(FlagError, match="would hold 4 of the 4 layers; allowed: at most 3 "):
        _check_pipeline_split(split(4))


def test_interleaved_schedule_needs_a_group_of_micro_batches_per_step():
    """Virtual pipeline stages: the micro-batch group is at least the pipeline size, and every
    step (training, and evaluation when it runs) has at least one group of micro-batches."""
    from types import SimpleNamespace

    from megatron_latentmoe.training.megatron_refusals import interleaved_schedule_refusal

    def run(global_batch=2, eval_batch=2, eval_iters=0, vpp=2, schedule=None):
        return SimpleNamespace(
            num_layers=4,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=vpp,
            step_batch_size_schedule=schedule,
            data_parallel_size=1,
            global_batch_size=global_batch,
            micro_batch_size=1,
            eval_iters=eval_iters,
            eval_global_batch_size=eval_batch,
            eval_micro_batch_size=1,
        )

    for ok, group in ((run(), None), (run(eval_iters=1), 2), (run(1, vpp=None), None)):
        assert interleaved_schedule_refusal(ok, group) is None
    assert interleaved_schedule_refusal(run(1, schedule="0:1 10:2"), None) is None
    assert interleaved_schedule_refusal(run(eval_batch=1), None) is None  # no evaluation
    assert interleaved_schedule_refusal(run(), 1) == (
        "--microbatch-group-size-per-virtual-pipeline-stage 1 is not allowed with "
        "--pipeline-model-parallel-size 2 and virtual pipeline stages: at least 2"
    )
    refusal = interleaved_schedule_refusal(run(eval_batch=1, eval_iters=1), None)
    assert refusal.startswith("--eval-global-batch-size 1 is not allowed"), refusal
    assert refusal.endswith("allowed: a multiple of 1 of at least 2"), refusal


def test_a_data_path_whose_index_is_not_megatrons_is_refused(tmp_path):
    """``--split`` counts a dataset's sequences from its ``.idx`` header: a file that is not a
    Megatron index (another magic, or cut short) is refused naming it, not a struct error."""
    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.training.data_args import _sequence_count

    prefix = str(tmp_path / "corpus")
    for header in (b"NOTANIDX" + bytes(18), b"MMIDIDX\x00\x00" + bytes(10)):
        open(prefix + ".idx", "wb").write(header)
        with pytest.raises(FlagError) as err:
            _sequence_count(prefix)
        assert str(err.value) == (
            f"--data-path {prefix}: {prefix}.idx is not a Megatron index file"
        )


def test_the_shipped_corpus_and_tokenizer_are_used_only_when_none_is_given():
    """Any dataset flag (a path, an args file, --mock-data) turns the shipped corpus off; any
    tokenizer flag, the shipped tokenizer (``--tokenizer-model`` alone is a HuggingFace one;
    ``--tokenizer-type HuggingFaceTokenizer`` alone, the shipped one)."""
    from types import SimpleNamespace

    from megatron_latentmoe.training.data_args import apply_default_tokenizer, uses_default_data

    none = dict(
        mock_data=False,
        data_path=None,
        train_data_path=None,
        valid_data_path=None,
        test_data_path=None,
        data_args_path=None,
        per_split_data_args_path=None,
    )
    assert uses_default_data(SimpleNamespace(**none)) is True
    for dest, value in (
        ("mock_data", True),
        ("test_data_path", ["my_corpus"]),
        ("per_split_data_args_path", "splits.json"),
    ):
        assert uses_default_data(SimpleNamespace(**dict(none, **{dest: value}))) is False, dest
    for given, shipped, expected in (
        ((None, None), True, ("HuggingFaceTokenizer", "/shipped")),
        (("HuggingFaceTokenizer", None), True, ("HuggingFaceTokenizer", "/shipped")),
        (("NullTokenizer", None), False, ("NullTokenizer", None)),
        ((None, "/my/tokenizer"), False, ("HuggingFaceTokenizer", "/my/tokenizer")),
    ):
        args = SimpleNamespace(tokenizer_type=given[0], tokenizer_model=given[1])
        assert apply_default_tokenizer(args, "/shipped") is shipped, given
        assert (args.tokenizer_type, args.tokenizer_model) == expected, given


def test_only_the_flags_the_checkpoint_set_are_named_as_its():
    from megatron_latentmoe.training.arguments import checkpoint_origin

    message = "--num-experts 6 is not allowed: a multiple of --expert-model-parallel-size 4"
    assert checkpoint_origin(message, {"num_experts", "hidden_size"}) == (
        f"{message} (--num-experts: from the checkpoint's args, --use-checkpoint-args)"
    )
    assert checkpoint_origin(message, {"expert_model_parallel", "hidden_size"}) == message
    assert checkpoint_origin(message, set()) == message


def test_a_transformer_config_check_names_the_flags_of_its_fields():
    """Megatron's TransformerConfig checks name config fields: the refusal adds each field's
    flag and value; words that are no field, or fields without a flag here, are left alone."""
    from types import SimpleNamespace

    from megatron_latentmoe.training.megatron_refusals import megatron_config_refusal

    args = SimpleNamespace(
        num_attention_heads=4,
        tensor_model_parallel_size=3,
        num_experts=8,
        moe_layer_freq=[1, 0],
        pipeline_model_parallel_size=1,
    )
    try:
        raise ValueError(
            "num_attention_heads (4) must be a multiple of tensor_model_parallel_size (3) for "
            "num_moe_experts with moe_layer_freq and kv_channels; some_words are no field."
        )
    except ValueError as err:
        message = megatron_config_refusal(args, err)
    assert message.endswith(
        "some_words are no field. (num_attention_heads: --num-attention-heads 4; "
        "tensor_model_parallel_size: --tensor-model-parallel-size 3; num_moe_experts: "
        "--num-experts 8; moe_layer_freq: --moe-layer-freq 1 0)"
    ), message


def test_a_config_check_names_the_deprecated_flag_given_and_a_pipeline_check_the_split():
    """A TransformerConfig check naming ``moe_router_padding_for_quantization`` names
    ``--moe-router-padding-for-fp8`` where that deprecated flag set the field (megatron-core
    0.19.2's ``__post_init__``), the field's own flag where that was given; a check whose text
    is about pipeline stages (raised outside ``pipeline_parallel_layer_layout``) names the flags
    of the pipeline split."""
    from types import SimpleNamespace

    from megatron_latentmoe.training.megatron_refusals import megatron_config_refusal

    def refusal(args, text):
        try:
            raise ValueError(text)
        except ValueError as err:
            return megatron_config_refusal(args, err)

    padding = "fp8/fp4 must be specified when moe_router_padding_for_quantization is True."
    for fp8, quantization, given in (
        (True, False, "--moe-router-padding-for-fp8"),
        (False, True, "--moe-router-padding-for-quantization"),
    ):
        args = SimpleNamespace(
            moe_router_padding_for_fp8=fp8, moe_router_padding_for_quantization=quantization
        )
        assert refusal(args, padding) == (
            f"{padding} (moe_router_padding_for_quantization: {given})"
        )
    args = SimpleNamespace(num_layers=7, pipeline_model_parallel_size=4)
    args.decoder_first_pipeline_num_layers = args.decoder_last_pipeline_num_layers = 1
    middle = (  # its text, as megatron-core 0.19.2 spells it
        "number of layers at middle stage: 5 must be divisible bythe middle pipeline model "
        "parallel size 2"
    )
    assert refusal(args, middle) == (
        "--num-layers 7 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 "
        "--decoder-last-pipeline-num-layers 1: Megatron's TransformerConfig refused this "
        f"pipeline split: {middle}"
    )


def test_the_expert_grid_defaults_its_tensor_parallel_size_to_tps():
    """Megatron's ``validate_args`` sets ``--expert-tensor-parallel-size`` to the tensor-parallel
    size when it is not given: EP 4 x ETP (TP) 2 x PP 1 = 8 does not divide 4 processes."""
    from types import SimpleNamespace

    from megatron_latentmoe.training.megatron_refusals import expert_layout_refusal

    def layout(etp=None, world_size=4):
        return SimpleNamespace(
            num_experts=8,
            world_size=world_size,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=1,
            context_parallel_size=1,
            expert_model_parallel_size=4,
            expert_tensor_parallel_size=etp,
        )

    assert expert_layout_refusal(layout()) == (
        "WORLD_SIZE=4 (the processes launched) is not allowed with --expert-model-parallel-size "
        "4 x --expert-tensor-parallel-size 2 x --pipeline-model-parallel-size 1 = 8: launch a "
        "multiple of 8 processes, or a smaller --expert-model-parallel-size"
    )
    assert expert_layout_refusal(layout(etp=1)) is None
    assert expert_layout_refusal(layout(world_size=8)) is None
    assert expert_layout_refusal(layout(world_size=3)) is None  # validate_args refuses it first


@pytest.mark.parametrize(
    "flags, has_cuda, have_te, refusal",
    [
        (
            ["--fp8-format", "e4m3", "--transformer-impl", "local"],
            True,
            True,
            "--fp8-format e4m3 is not allowed with --transformer-impl local: FP8/FP4 training "
            "needs --transformer-impl transformer_engine",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"],
            True,
            False,
            "--recompute-modules layernorm needs Transformer Engine (megatron-core 0.19.2's "
            "layernorm recompute reads TE's FP8 state), which is not installed; allowed without "
            "TE: core_attn, mlp, moe, shared_experts, or --recompute-granularity full",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"],
            True,
            True,
            None,
        ),
        (  # else refused for --moe-grouped-gemm, then for TE: all it needs in one line
            ["--recompute-granularity", "selective", "--recompute-modules", "moe_act"],
            True,
            False,
            "--recompute-modules moe_act needs --moe-grouped-gemm (megatron-core 0.19.2 "
            "recomputes the activation of grouped-GEMM experts only), which needs Transformer "
            "Engine, which is not installed; allowed without TE: core_attn, mlp, moe, "
            "shared_experts, or --recompute-granularity full",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-modules", "moe_act"]
            + ["--transformer-impl", "local"],
            True,
            True,
            "--recompute-modules moe_act needs --moe-grouped-gemm (megatron-core 0.19.2 "
            "recomputes the activation of grouped-GEMM experts only), which needs "
            "--transformer-impl transformer_engine (TE's layers, on a CUDA GPU); allowed with "
            "--transformer-impl local: core_attn, mlp, moe, shared_experts, or "
            "--recompute-granularity full",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-modules", "moe_act"],
            True,
            True,
            None,
        ),
        (["--fp8-format", "e4m3"], True, True, None),  # TE chosen by default on a GPU with TE
        (["--log-memory-to-tensorboard"], True, True, None),  # a GPU has its memory statistics
        (["--attention-backend", "flash"], True, True, None),  # a TE kernel, with TE
        (["--use-precision-aware-optimizer", "--use-distributed-optimizer"], True, True, None),
        (  # megatron-core 0.19.2 takes it only with --spec local, which this entry point refuses
            ["--attention-backend", "local"],
            True,
            True,
            "--attention-backend local is not allowed with --transformer-impl transformer_engine: "
            "megatron-core 0.19.2 takes it only with --spec local, and this entry point's layer "
            "spec is chosen by --transformer-impl (local: Megatron's own attention); allowed: "
            "auto, flash, fused or unfused",
        ),
        *(  # else megatron-core 0.19.2's router raises at the first forward, on every rank
            (
                ["--moe-router-load-balancing-type", "aux_loss", "--moe-router-fusion"],
                has_cuda,
                have_te,
                "--moe-router-fusion needs Transformer Engine and a CUDA GPU (its fused top-k "
                "routing kernels); allowed without them: off",
            )
            for has_cuda, have_te in ((True, False), (False, True))
        ),
        (["--moe-router-load-balancing-type", "aux_loss", "--moe-router-fusion"], True, True, None),
        (  # where the kernels are, too: QB's own routing would silently leave them unused
            ["--moe-router-fusion"],
            True,
            True,
            "--moe-router-fusion is not allowed: False with quantile_histogram balancing: its "
            "top-(k+1) routing and cutoffs have no fused kernel (Megatron's own "
            "quantile_balancing refuses it too)",
        ),
    ],
)
def test_refusals_that_depend_on_a_gpu_with_transformer_engine(
    flags, has_cuda, have_te, refusal, monkeypatch
):
    """The flag check on machines these tests cannot be (a GPU, TE installed), in one process:
    FP8 with the local layers, the layernorm recompute and the router fusion without TE (or a
    GPU, for the fusion), are refused by name; the same flags pass where the machine allows
    them (``--attention-backend flash`` too; ``local`` is refused with TE as well)."""
    import sys
    import warnings

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.compat import apply_python311_compat
    from megatron_latentmoe.training.arguments import (
        add_stable_latentmoe_args,
        validate_stable_latentmoe_args,
    )

    apply_python311_compat()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain", *tiny_args(), *flags])
    args = parse_args(add_stable_latentmoe_args)
    if refusal is None:
        validate_stable_latentmoe_args(args, has_cuda=has_cuda, have_te=have_te)
        assert args.transformer_impl == "transformer_engine"
    else:
        with pytest.raises(FlagError) as err:
            validate_stable_latentmoe_args(args, has_cuda=has_cuda, have_te=have_te)
        assert str(err.value) == refusal


def test_async_save_with_nvrx_needs_it_installed(monkeypatch):
    """On a GPU, ``--async-strategy nvrx`` (Megatron's default) without nvidia-resiliency-ext:
    one line at start-up (else a ModuleNotFoundError traceback on every rank)."""
    from types import SimpleNamespace

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.training import arguments

    _pretend_installed(monkeypatch, "nvidia_resiliency_ext", False)
    args = SimpleNamespace(
        override_opt_param_scheduler=False,
        use_checkpoint_opt_param_scheduler=False,
        rampup_batch_size=None,
        async_save=True,
        ckpt_format="torch_dist",
        use_persistent_ckpt_worker=True,
        async_strategy="nvrx",
    )
    with pytest.raises(FlagError) as err:
        arguments._check_checkpointing_and_schedule(args, has_cuda=True)
    assert str(err.value) == (
        "--async-strategy nvrx (the default with --async-save) needs nvidia-resiliency-ext, "
        "which is not installed; allowed: --async-strategy mcore"
    )
    args.async_strategy = "mcore"
    arguments._check_checkpointing_and_schedule(args, has_cuda=True)


@pytest.mark.parametrize(
    ("override", "use_checkpoint"), [(True, True), (True, False), (False, True)]
)
def test_the_two_schedule_flags_are_refused_together_only(override, use_checkpoint):
    """--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler: together one line
    (the both_schedule_flags case); either alone is allowed (a resume with another --lr takes
    one of them)."""
    from types import SimpleNamespace

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.training import arguments

    args = SimpleNamespace(
        override_opt_param_scheduler=override,
        use_checkpoint_opt_param_scheduler=use_checkpoint,
        rampup_batch_size=None,
        async_save=False,
    )
    if override and use_checkpoint:
        with pytest.raises(FlagError, match="^--override-opt_param-scheduler and --use-checkpoint"):
            arguments._check_checkpointing_and_schedule(args, has_cuda=False)
    else:
        arguments._check_checkpointing_and_schedule(args, has_cuda=False)


def _pretend_installed(monkeypatch, package: str, installed: bool) -> None:
    """``importlib.util.find_spec(package)`` answers as if ``package`` were (not) installed."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            (object() if installed else None) if name == package else find_spec(name, *a)
        ),
    )


def test_wandb_needs_a_folder_for_its_files(monkeypatch):
    """``--wandb-project`` with a run name but neither ``--wandb-save-dir`` nor ``--save``:
    megatron-core 0.19.2 joins ``--save`` (None) with "wandb", a TypeError traceback on the last
    rank; one line instead. Either folder (wandb installed), or no project, passes the check."""
    from types import SimpleNamespace

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.training.arguments import _check_wandb

    _pretend_installed(monkeypatch, "wandb", True)
    args = dict(wandb_project="proj", wandb_exp_name="run1", wandb_save_dir="", save=None)
    with pytest.raises(FlagError) as err:
        _check_wandb(SimpleNamespace(**args))
    assert str(err.value) == (
        "--wandb-project proj needs --wandb-save-dir DIR or --save DIR (W&B's files go to "
        "--save's wandb/ folder by default)"
    )
    for given in ({"wandb_project": ""}, {"save": "ckpt"}, {"wandb_save_dir": "wandb"}):
        _check_wandb(SimpleNamespace(**dict(args, **given)))


@pytest.mark.parametrize(
    "world_size, ep, einops, refusal",
    [
        (
            2,
            2,
            True,
            "the experts' data-parallel size is 1, which 2 does not divide; allowed: a "
            "divisor of 1",
        ),
        (4, 4, True, "the experts' data-parallel size is 1, which 2 does not divide"),
        (3, 1, True, "the data-parallel x context-parallel size is 3, which 2 does not divide"),
        (2, 1, False, "needs the einops package"),
        (2, 1, True, None),
        (4, 2, True, None),
    ],
)
def test_distributed_optimizer_instances_divide_both_data_parallel_sizes(
    monkeypatch, world_size, ep, einops, refusal
):
    """``--num-distributed-optimizer-instances 2``: megatron-core 0.19.2's parallel state asserts
    that the instances divide the data-parallel size (x CP) and the experts' one, and imports
    einops to build their groups: an AssertionError / ImportError traceback on every rank
    (measured on tiny.sh, 2 CPU ranks); one line instead."""
    from types import SimpleNamespace

    from megatron_latentmoe.training.megatron_refusals import optimizer_instances_refusal

    _pretend_installed(monkeypatch, "einops", einops)
    args = SimpleNamespace(
        num_distributed_optimizer_instances=2,
        num_experts=8,
        world_size=world_size,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=None,
    )
    got = optimizer_instances_refusal(args)
    if refusal is None:
        assert got is None
    else:
        assert got.startswith("--num-distributed-optimizer-instances 2 ") and refusal in got, got
    assert (
        optimizer_instances_refusal(SimpleNamespace(num_distributed_optimizer_instances=1)) is None
    )
