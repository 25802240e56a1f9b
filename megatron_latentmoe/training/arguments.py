"""Command-line flags of the Stable LatentMoE pretraining entry point, and their validation: this
module's one job (the checks and defaults of the data flags are :mod:`.data_args`').

Megatron's own parser (``megatron.training.arguments``) stays the source of every flag it already
has; :func:`add_stable_latentmoe_args` (Megatron's ``extra_args_provider`` hook) only

* adds one flag per field the model adds to Megatron's config (the ``added`` rows of
  ``megatron_latentmoe.fields.FIELDS``: flag, default and help come from there), and the entry
  point's own: ``--balance-log-file PATH``, ``--balance-log-loads-interval N``,
  ``--no-default-data``;

* teaches Megatron's ``--moe-router-load-balancing-type`` the value ``quantile_histogram``;
* changes a few defaults to what this model is (RoPE, RMSNorm, no linear biases) and makes
  ``--transformer-impl`` and ``--moe-router-score-function`` default to "decide from the rest"
  (TE when it is installed next to a GPU, else local; sigmoid under QB, else Megatron's softmax).

Reused Megatron names: ``--num-experts``, ``--moe-latent-size``, ``--moe-router-topk``,
``--moe-router-score-function``, ``--moe-router-topk-scaling-factor`` (= routed_scaling_factor),
``--moe-ffn-hidden-size``, ``--moe-shared-expert-intermediate-size``, ``--transformer-impl``
(the layer-spec backend: ``local`` or ``transformer_engine``), ``--fp8-format``/``--fp8-recipe``.

:func:`validate_stable_latentmoe_args` runs right after parsing, before Megatron's
``validate_args`` and before any process group, model or dataset exists. It checks what only the
command line can get wrong (flags this entry point does not support, backend, the data flags with
:mod:`.data_args`) and runs the model config's own rules (``fields.check_stable_latentmoe``) on
the parsed flags, so every wrong combination raises :class:`FlagError` naming the flags, in one
line. The flags that set a config field are named here too (:func:`flag_for_field`,
:func:`flag_message`); :mod:`.megatron_refusals` names them so in the one line it makes of
Megatron's own checks (``validate_args``' bare asserts, ``TransformerConfig``'s).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex

from megatron_latentmoe.cli_errors import FlagError, one_line_errors
from megatron_latentmoe.data import DEFAULT_TOKENIZER_DIR, is_shipped_tokenizer
from megatron_latentmoe.data.hf_tokenizer import TOKENIZER_FLAGS_NOT_HONOURED
from megatron_latentmoe.fields import (
    ADDED,
    BY_NAME,
    QUANTILE_HISTOGRAM,
    ConfigError,
    balancer_list,
    check_hf_exportable,
    check_stable_latentmoe,
)
from megatron_latentmoe.training.console import PROG
from megatron_latentmoe.training.data_args import (
    check_data_paths,
    check_split,
    uses_default_data,
)

BACKENDS = {"local": "local", "transformer_engine": "te"}

_LAYER_PATTERN_DESTS = (
    "heterogeneous_layers_config_path",
    "heterogeneous_layers_config_encoded_json",
    # Mamba/hybrid models' patterns: megatron-core 0.19.2's validate_args sets --num-layers to
    # the pattern's length, and GPTModel ignores the layer kinds ("M*-" trained 3 layers of
    # attention + MoE instead of tiny.sh's 4, silently)
    "hybrid_layer_pattern",
    "hybrid_override_pattern",
)
"""Megatron flags that set the layers some other way than this model's flags: refused."""


# ------------------------------------------------------------------------------------ parser
def _find_action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    for action in parser._actions:
        if action.dest == dest:
            return action
    raise KeyError(f"Megatron's parser has no argument with dest {dest!r}")


def add_stable_latentmoe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: our flags, QB as a load-balancing type, our defaults."""
    group = parser.add_argument_group(
        "Stable LatentMoE", "Kimi-K3-style Stable LatentMoE with Quantile Balancing (SPEC.md)"
    )
    for f in ADDED:
        kwargs = dict(default=f.default, help=f"{f.help} (default: {f.default})")
        if f.kind == "bool":  # latent_moe_use_norm: None = on iff --moe-latent-size is given
            kwargs.update(
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{f.help} (default: on when --moe-latent-size is given)",
            )
        elif isinstance(f.kind, tuple):
            kwargs.update(choices=f.kind)
        else:
            kwargs.update(type=f.python_type)
        group.add_argument(f.flag, dest=f.name, **kwargs)
    group.add_argument(
        "--balance-log-file",
        default=None,
        help="JSONL written by the logging rank: one record per iteration (loss, tokens/s, "
        "MaxVio...) with per-layer expert loads. Default: <--save>/balance.jsonl when --save is "
        "given; 'none' disables it.",
    )
    group.add_argument(
        "--balance-log-loads-interval",
        type=int,
        default=1,
        help="Record per-layer per-expert loads in the JSONL every N iterations (default 1).",
    )
    group.add_argument(
        "--no-default-data",
        action="store_true",
        help="Without --data-path, fail instead of training on the shipped corpus.",
    )

    # Megatron's flags we extend or re-default.
    lb = _find_action(parser, "moe_router_load_balancing_type")
    lb.choices = list(lb.choices) + [QUANTILE_HISTOGRAM]
    lb.help = (lb.help or "") + (
        f' "{QUANTILE_HISTOGRAM}": Stable LatentMoE Quantile Balancing (SPEC §4): the per-expert '
        "bias is set each step from a global histogram of routing margins."
    )
    _find_action(parser, "yaml_cfg").type = _refuse_yaml_cfg
    parser.set_defaults(
        transformer_impl=None,  # resolved in validate: TE if installed and a GPU is present
        moe_router_score_function=None,  # resolved: sigmoid under QB, Megatron's softmax else
        position_embedding_type="rope",
        normalization="RMSNorm",
        add_bias_linear=False,
    )
    _escape_unformattable_help(parser)
    one_line_errors(parser)
    return parser


def _refuse_yaml_cfg(value: str):
    """``--yaml-cfg``'s type: refused while parsing, as megatron.training 0.19.2 reads the file
    right after parsing, before any check of ours (a missing file: a traceback)."""
    raise argparse.ArgumentTypeError(
        f"{value} is not allowed: this entry point takes no YAML config; allowed: the settings "
        "as flags"
    )


def _escape_unformattable_help(parser: argparse.ArgumentParser) -> None:
    """Make ``--help`` work: argparse %-formats every help string, and megatron-core 0.19.2 has
    one with a bare ``%`` ("1.10 = 10%)", --moe-paged-stash-buffer-size-factor-cuda) that makes
    ``--help`` crash. Such strings get their ``%`` doubled; formattable ones are left alone."""
    for action in parser._actions:
        if not isinstance(action.help, str) or "%" not in action.help:
            continue
        try:
            action.help % dict(vars(action), prog=parser.prog)
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")


# ------------------------------------------------------------------------------------ checks
def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _have_te() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception:  # noqa: BLE001 - a broken TE install counts as absent
        return False
    return bool(HAVE_TE)


def validate_stable_latentmoe_args(
    args, *, has_cuda: bool | None = None, have_te: bool | None = None
) -> None:
    """Check and resolve our flags on the freshly parsed namespace (no side effects besides
    filling the 'auto' defaults). Raises :class:`FlagError` naming the flag: the first refusal
    of these steps, in this order."""
    has_cuda = _has_cuda() if has_cuda is None else has_cuda
    have_te = _have_te() if have_te is None else have_te
    _refuse_unsupported_flags(args)
    _check_model_config(args)
    _check_backend(args, has_cuda, have_te)
    _check_data(args)
    _check_sequence_length(args)
    _check_pipeline_split(args)
    _check_checkpointing_and_schedule(args, has_cuda)
    _check_intervals(args)
    _check_qb_calibration(args)
    _check_wandb(args)


def _refuse_unsupported_flags(args) -> None:
    """Things Megatron's parser accepts but this model cannot be."""
    if args.spec:
        raise FlagError(
            f"--spec {' '.join(map(str, args.spec))} is not allowed: the layer spec is Stable "
            "LatentMoE's own (choose its backend with --transformer-impl "
            f"{' or '.join(BACKENDS)})"
        )
    if args.multi_latent_attention:
        raise FlagError(
            "--multi-latent-attention is not supported: attention is Megatron's GQA "
            "self-attention with RoPE (--group-query-attention --num-query-groups N)"
        )
    for dest in _LAYER_PATTERN_DESTS:
        if getattr(args, dest, None):
            raise FlagError(
                f"--{dest.replace('_', '-')} {getattr(args, dest)} is not allowed: this model's "
                "layers are set by its flags; allowed: none"
            )
    if args.mtp_num_layers:
        raise FlagError(
            f"--mtp-num-layers {args.mtp_num_layers} is not allowed: this entry point trains no "
            "multi-token prediction; allowed: 0"
        )
    if args.position_embedding_type != "rope":
        raise FlagError(
            f"--position-embedding-type {args.position_embedding_type} is not allowed: this "
            "model's positions are rotary; allowed: rope"
        )
    if args.rotary_percent != 1.0:
        raise FlagError(
            f"--rotary-percent {args.rotary_percent} is not allowed: this model rotates every "
            "head dimension; allowed: 1.0"
        )
    if args.use_rope_scaling:
        raise FlagError("--use-rope-scaling is not allowed: this model's RoPE is unscaled")
    if args.add_qkv_bias:
        raise FlagError("--add-qkv-bias is not allowed: this model has no linear biases")
    if args.add_bias_linear:  # no flag turns it on: a checkpoint's args (--use-checkpoint-args)
        raise FlagError(
            "add_bias_linear=True (from the checkpoint's args) is not allowed: this model has no "
            "linear biases; allowed: --disable-bias-linear, the default"
        )
    for dest in ("squared_relu", "quick_geglu"):
        if getattr(args, dest):
            raise FlagError(
                f"--{dest.replace('_', '-')} is not allowed: the activation is "
                f"--hidden-act {' or '.join(BY_NAME['hidden_act'].kind)}"
            )


def _check_model_config(args) -> None:
    """The model config's rules, on the flags (resolving the "auto" defaults first)."""
    if args.num_experts is None:
        raise FlagError("--num-experts is required: Stable LatentMoE is a mixture-of-experts model")
    if args.num_layers is None:
        raise FlagError("--num-layers is required")
    args.swiglu = True  # both activations are gated (GLU); keeps Megatron's own checks consistent
    if args.latent_moe_use_norm is None:
        args.latent_moe_use_norm = args.moe_latent_size is not None
    balancers = balancer_list(args.moe_router_load_balancing_type)
    qb = QUANTILE_HISTOGRAM in balancers
    if args.moe_router_score_function is None:
        args.moe_router_score_function = "sigmoid" if qb else "softmax"

    def arg(field):
        if field == "num_query_groups" and not args.group_query_attention:
            return None  # Megatron ignores --num-query-groups without --group-query-attention
        return getattr(args, ARG_DEST.get(field, field), None)

    try:
        check_stable_latentmoe(arg)
    except ConfigError as err:
        raise FlagError(flag_message(err)) from None
    try:
        check_hf_exportable(arg)
    except ConfigError as err:
        if os.environ.get("RANK", "0") == "0":
            print(
                f"[{PROG}] warning: this model trains, but the HF converter "
                f"will refuse its checkpoints: {flag_message(err)}",
                flush=True,
            )
    if "quantile_balancing" in balancers and args.eod_mask_loss:
        raise FlagError(
            "--moe-router-load-balancing-type quantile_balancing with --eod-mask-loss is not "
            "allowed: Megatron-Core 0.19.2's per-micro-batch QB cannot skip loss-masked tokens; "
            f"use {QUANTILE_HISTOGRAM} or drop --eod-mask-loss"
        )


def _check_backend(args, has_cuda: bool, have_te: bool) -> None:
    """Backend and precision: what this machine (a CUDA GPU, Transformer Engine) can run of the
    layers, kernels and parallelism the flags ask for; resolves ``--transformer-impl``."""
    impl = args.transformer_impl
    if impl is None:
        impl = "transformer_engine" if (have_te and has_cuda) else "local"
        args.transformer_impl = impl
    if impl not in BACKENDS:
        raise FlagError(f"--transformer-impl {impl}: this model supports {' or '.join(BACKENDS)}")
    if impl == "transformer_engine" and not have_te:
        raise FlagError(
            "--transformer-impl transformer_engine: Transformer Engine is not installed "
            "(pip install 'megatron-latentmoe[te]' on a CUDA machine), use --transformer-impl local"
        )
    if impl == "transformer_engine" and not has_cuda:
        raise FlagError("--transformer-impl transformer_engine needs a CUDA GPU; use local")
    _check_attention_backend(args.attention_backend, impl)
    if args.fp8 is not None or args.fp4 is not None:
        flag = "--fp8-format" if args.fp8 is not None else "--fp4-format"
        value = args.fp8 if args.fp8 is not None else args.fp4
        if not has_cuda:
            raise FlagError(
                f"{flag} {value}: FP8/FP4 training needs a CUDA GPU with Transformer Engine; "
                "no GPU is visible here. Drop the flag to train in fp32/bf16."
            )
        if not have_te:
            raise FlagError(
                f"{flag} {value}: FP8/FP4 training needs Transformer Engine, which is not "
                "installed (pip install 'megatron-latentmoe[te]')"
            )
        if impl != "transformer_engine":
            raise FlagError(
                f"{flag} {value} is not allowed with --transformer-impl {impl}: FP8/FP4 "
                "training needs --transformer-impl transformer_engine"
            )
    if not (have_te and has_cuda):
        args.apply_rope_fusion = False  # Megatron's default-on RoPE fusion is a TE CUDA kernel
    if args.gradient_accumulation_fusion and impl == "local":
        try:  # the local linears fuse wgrad accumulation only with apex's CUDA extension
            import fused_weight_gradient_mlp_cuda  # noqa: F401
        except ImportError:
            args.gradient_accumulation_fusion = False
    recompute = getattr(args, "recompute_modules", None) or []
    selective = args.recompute_granularity == "selective"
    if selective and "moe_act" in recompute and impl != "transformer_engine":
        # megatron-core 0.19.2's TransformerConfig takes it only with moe_grouped_gemm, which
        # needs TE's layers (below): one refusal naming all it needs, not one flag at a time
        needs, allowed = (
            (
                "--transformer-impl transformer_engine (TE's layers, on a CUDA GPU)",
                f"with --transformer-impl {impl}",
            )
            if have_te
            else ("Transformer Engine, which is not installed", "without TE")
        )
        raise FlagError(
            "--recompute-modules moe_act needs --moe-grouped-gemm (megatron-core 0.19.2 "
            f"recomputes the activation of grouped-GEMM experts only), which needs {needs}; "
            f"allowed {allowed}: core_attn, mlp, moe, shared_experts, or "
            "--recompute-granularity full"
        )
    if args.moe_grouped_gemm and impl != "transformer_engine":
        raise FlagError("--moe-grouped-gemm needs --transformer-impl transformer_engine")
    args.moe_grouped_gemm = impl == "transformer_engine"  # the TE spec uses grouped-GEMM experts
    if args.moe_router_fusion and not (have_te and has_cuda):
        # else megatron-core 0.19.2's router raises at the first forward, on every rank
        raise FlagError(
            "--moe-router-fusion needs Transformer Engine and a CUDA GPU (its fused top-k "
            "routing kernels); allowed without them: off"
        )
    if args.tp_comm_overlap and impl != "transformer_engine":
        # megatron-core 0.19.2: only TE's layers read it (its userbuffers), and initialize()
        # imports TE for them: without TE a RuntimeError traceback on every rank before the model
        raise FlagError(
            "--tp-comm-overlap needs --transformer-impl transformer_engine (Transformer Engine's "
            "userbuffers, on CUDA GPUs; megatron-core 0.19.2's local layers do not overlap); "
            f"allowed with --transformer-impl {impl}: off"
        )
    if args.use_precision_aware_optimizer and not have_te and not args.optimizer_cpu_offload:
        # else megatron-core 0.19.2's OptimizerConfig imports TE's FusedAdam while the optimizer
        # is built: a ModuleNotFoundError traceback on every rank, after the model is built
        raise FlagError(
            "--use-precision-aware-optimizer needs Transformer Engine (megatron-core 0.19.2 "
            "takes its FusedAdam), which is not installed; allowed without TE: off"
        )
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        # Megatron's combined 1F1B schedule asks forward_step for a schedule plan that splits
        # the MoE layer into its own nodes: ours returns the model output and the Stable
        # LatentMoE block's shared W↓ / latent norm + W↑ have no node there.
        raise FlagError(
            "--overlap-moe-expert-parallel-comm is not supported by this entry point (Megatron's "
            "combined 1F1B schedule plan); allowed: off"
        )
    cp = args.context_parallel_size
    if cp > 1 and impl != "transformer_engine":
        # else an assert of Megatron's DotProductAttention while the model is built, every rank
        raise FlagError(
            f"--context-parallel-size {cp} needs --transformer-impl transformer_engine "
            "(Megatron's local attention has no context parallelism); allowed with "
            f"--transformer-impl {impl}: 1"
        )
    if selective and "layernorm" in recompute and not have_te:
        # megatron-core 0.19.2's CheckpointWithoutOutput sets fp8 = (fp8 is not None), True
        # for its default fp8=False, and then reads TE's FP8GlobalStateManager: a NameError
        # in the first forward without TE
        raise FlagError(
            "--recompute-modules layernorm needs Transformer Engine (megatron-core 0.19.2's "
            "layernorm recompute reads TE's FP8 state), which is not installed; allowed "
            "without TE: core_attn, mlp, moe, shared_experts, or --recompute-granularity full"
        )
    if args.moe_token_dispatcher_type == "flex" and not has_cuda:
        raise FlagError("--moe-token-dispatcher-type flex needs GPUs (DeepEP); use alltoall")
    if getattr(args, "use_torch_fsdp2", False) and not has_cuda:
        # else torch's fully_shard at the model's wrapping, every rank: "TypeError: device():
        # argument 'index' (position 2) must be int, not torch.device" (CPU, measured)
        raise FlagError(
            "--use-torch-fsdp2 needs a CUDA GPU: torch's FSDP2 takes its device from CUDA; "
            "allowed without a GPU: no --use-torch-fsdp2 (--use-distributed-optimizer shards "
            "the optimizer state)"
        )
    if getattr(args, "use_megatron_fsdp", False) and not has_cuda:
        # else Megatron's validate_args asks for CUDA_DEVICE_MAX_CONNECTIONS > 1 (the entry point
        # sets 1) and --ckpt-format fsdp_dtensor; with both, at the model's wrapping, every rank:
        # "AssertionError: einops is not installed" (this venv), with einops "RuntimeError:
        # Invalid device string: 'cuda:cpu'" (CPU, measured)
        raise FlagError(
            "--use-megatron-fsdp needs a CUDA GPU: Megatron-FSDP puts its buffers on the CUDA "
            "device; allowed without a GPU: no --use-megatron-fsdp (--use-distributed-optimizer "
            "shards the optimizer state)"
        )
    if args.log_memory_to_tensorboard and not has_cuda:
        # else megatron-core 0.19.2's training_log reads torch.cuda.memory_stats(), empty without
        # a GPU: "KeyError: 'reserved_bytes.all.current'" at the first TensorBoard write, on the
        # last rank (CPU, 1 rank, measured)
        raise FlagError(
            "--log-memory-to-tensorboard needs a CUDA GPU: megatron-core 0.19.2 logs the CUDA "
            "memory allocator's statistics, which a run without a GPU does not have; allowed "
            "without a GPU: off"
        )
    tp = args.tensor_model_parallel_size
    if tp > 1 and not args.sequence_parallel:
        raise FlagError(
            f"--tensor-model-parallel-size {tp} with MoE needs --sequence-parallel (Megatron)"
        )
    if not has_cuda and args.distributed_backend == "nccl":
        args.distributed_backend = "gloo"  # no GPU: gloo is the only backend that works


def _check_data(args) -> None:
    """The data flags: the shipped corpus or ``--data-path`` (with :mod:`.data_args`), the
    validation sets and the tokenizer folder."""
    if uses_default_data(args):
        if args.no_default_data:
            raise FlagError(
                "--data-path is required with --no-default-data (a Megatron .bin/.idx prefix)"
            )
        if args.tokenizer_type not in (None, "HuggingFaceTokenizer"):
            # the shipped corpus is tokenized with the run's tokenizer (data.corpus): here only
            # a Hugging Face one can; the shipped ids would not be this tokenizer's
            raise FlagError(
                f"--tokenizer-type {args.tokenizer_type} without --data-path: the shipped corpus "
                "is tokenized only with a HuggingFaceTokenizer (the shipped one, or "
                "--tokenizer-model DIR); allowed: --data-path PREFIX of a dataset made with this "
                "tokenizer (Megatron's tools/preprocess_data.py), or --tokenizer-type "
                "HuggingFaceTokenizer"
            )
        for flag, (dest, why) in TOKENIZER_FLAGS_NOT_HONOURED.items():
            if getattr(args, dest, None):  # else a dataset of other ids than the run's
                raise FlagError(
                    f"{flag_text(flag, getattr(args, dest))} without --data-path: the shipped "
                    f"corpus is tokenized with the tokenizer folder as it is ({why}); allowed: "
                    "leave it out, or --data-path PREFIX of a dataset made with this tokenizer "
                    "(Megatron's tools/preprocess_data.py)"
                )
        if args.split is not None:  # counted from the corpus: nothing is tokenized yet
            from megatron_latentmoe.data.corpus import default_corpus_sequences

            check_split(args, [("the shipped corpus", default_corpus_sequences())])
    else:
        check_data_paths(args)
        if args.data_path:
            check_split(args)
    full, multiple = args.full_validation, args.multiple_validation_sets
    if bool(full) != bool(multiple):
        # megatron-core 0.19.2: --multiple-validation-sets alone raises NotImplementedError at
        # the first evaluation; --full-validation alone indexes an int (TypeError) there
        given, missing = (
            ("--full-validation", "--multiple-validation-sets")
            if full
            else ("--multiple-validation-sets", "--full-validation")
        )
        raise FlagError(
            f"{given} needs {missing} (megatron-core 0.19.2 evaluates one of them without the "
            "other only by failing at the first evaluation); allowed: both, or neither"
        )
    if args.tokenizer_model is not None and args.tokenizer_type in (None, "HuggingFaceTokenizer"):
        if not os.path.exists(args.tokenizer_model) and is_shipped_tokenizer(args.tokenizer_model):
            # e.g. a checkpoint's args (--use-checkpoint-args) from a clone moved or deleted since
            args.tokenizer_model = str(DEFAULT_TOKENIZER_DIR)
        if not os.path.exists(args.tokenizer_model):
            raise FlagError(f"--tokenizer-model {args.tokenizer_model}: no such file or folder")


def _check_sequence_length(args) -> None:
    """``--seq-length``: given, and split evenly by sequence parallelism."""
    tp = args.tensor_model_parallel_size
    if args.seq_length is None:
        raise FlagError("--seq-length is required")
    if tp > 1 and args.seq_length % tp:
        # else an assert of Megatron's reduce-scatter in the first forward, on every rank
        raise FlagError(
            f"--seq-length {args.seq_length} is not allowed with --tensor-model-parallel-size "
            f"{tp} --sequence-parallel: a multiple of {tp} (sequence parallelism splits every "
            "sequence over the tensor-parallel ranks)"
        )


def _check_intervals(args) -> None:
    """The logging and evaluation intervals: Megatron's and the balance log's."""
    for flag, value, where, allowed in (
        ("--log-interval", args.log_interval, "after the first iteration", ""),
        (
            "--eval-interval",
            args.eval_interval,
            "while it sizes the validation data",
            " (no evaluation: --eval-iters 0)",
        ),
    ):
        if value < 1:  # measured: 0 was a ZeroDivisionError traceback on every rank
            raise FlagError(
                f"{flag} {value} is not allowed: megatron-core 0.19.2 divides by it {where}; "
                f"allowed: an integer >= 1{allowed}"
            )
    if args.balance_log_loads_interval < 1:
        raise FlagError(
            f"--balance-log-loads-interval {args.balance_log_loads_interval} is not allowed: "
            "an integer >= 1"
        )


def _check_attention_backend(backend, impl: str) -> None:
    """``--attention-backend`` picks one of Transformer Engine's attention kernels (megatron-core
    0.19.2 sets TE's ``NVTE_*_ATTN`` variables from it). ``local`` (Megatron's own attention)
    it takes only with ``--spec local``: its ``validate_args`` reads ``args.spec[0]``, a
    TypeError traceback on every rank where no ``--spec`` is given, and this entry point's own
    builder would not swap the attention anyway. With ``--transformer-impl local`` the attention
    is Megatron's unfused one whatever the flag says: flash or fused would be silently ignored."""
    name = getattr(backend, "name", backend)
    if impl == "local":
        refused, allowed = ("local", "flash", "fused"), "auto or unfused"
    else:
        refused, allowed = ("local",), "auto, flash, fused or unfused"
    if name in refused:
        why = (
            "megatron-core 0.19.2 takes it only with --spec local, and this entry point's layer "
            "spec is chosen by --transformer-impl (local: Megatron's own attention)"
            if name == "local"
            else "it picks a Transformer Engine kernel, and the local layers run Megatron's own "
            "unfused attention"
        )
        raise FlagError(
            f"--attention-backend {name} is not allowed with --transformer-impl {impl}: {why}; "
            f"allowed: {allowed}"
        )


def _check_wandb(args) -> None:
    """``--wandb-project``: megatron-core 0.19.2's W&B writer (``global_vars._set_wandb_writer``,
    on the last rank, after start-up) raises a ValueError without ``--wandb-exp-name``, a
    TypeError without ``--wandb-save-dir`` or ``--save`` (its files go to ``--save``/wandb) and
    a ModuleNotFoundError where ``wandb`` is not installed: each a traceback. Refused here."""
    project = getattr(args, "wandb_project", "")
    if not project:
        return
    if not args.wandb_exp_name:
        raise FlagError(
            f"--wandb-project {project} needs --wandb-exp-name NAME (the W&B run's name); "
            "allowed without it: no --wandb-project"
        )
    if not args.wandb_save_dir and not args.save:
        raise FlagError(
            f"--wandb-project {project} needs --wandb-save-dir DIR or --save DIR (W&B's files "
            "go to --save's wandb/ folder by default)"
        )
    if not package_installed("wandb"):
        raise FlagError(
            f"--wandb-project {project} needs the wandb package, which is not installed "
            "(pip install wandb); allowed without it: no --wandb-project (TensorBoard: "
            "--tensorboard-dir)"
        )


def package_installed(package: str) -> bool:
    """Whether ``package`` can be imported (found, not imported): what a flag needs that
    megatron-core imports only later, on the ranks (nvidia-resiliency-ext, wandb, einops)."""
    import importlib.util

    return importlib.util.find_spec(package) is not None


def ignored_flag_warning(args) -> str | None:
    """The warning for ``--use-flash-attn``, which megatron-core 0.19.2 parses and reads nowhere:
    the attention stays what ``--attention-backend`` and ``--transformer-impl`` choose (measured:
    the same losses with and without it). A warning, not a refusal: Megatron's older launch
    scripts carry it, and on a GPU the default ``--attention-backend auto`` already picks
    FlashAttention where TE has it. None without the flag."""
    if not args.use_flash_attn:
        return None
    backend = args.attention_backend
    return (
        "--use-flash-attn does nothing: megatron-core 0.19.2 parses it but no code reads it; "
        f"the attention is --attention-backend {getattr(backend, 'name', backend)} with "
        f"--transformer-impl {args.transformer_impl} (FlashAttention: --attention-backend flash "
        "or auto with --transformer-impl transformer_engine on a GPU)"
    )


def _check_checkpointing_and_schedule(args, has_cuda: bool) -> None:
    """Megatron flags that megatron-core 0.19.2 accepts and then ignores, or fails on only once
    it has built the model, or at the first checkpoint save (after the run has trained)."""
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        # OptimizerParamScheduler asserts it once the model is built, with --load or without:
        # "AssertionError: both override and use-checkpoint are set." (CPU, 1 rank, measured)
        raise FlagError(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are not "
            "allowed together (megatron-core 0.19.2 fails on them after building the model); "
            "allowed: one of the two (the first trains on with this run's learning-rate "
            "schedule, the second with the checkpoint's)"
        )
    if args.rampup_batch_size:
        # TrainingConfig still parses it, but no code path hands it to the micro-batch
        # calculator: every step trains --global-batch-size from iteration 1
        raise FlagError(
            f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))} is not allowed: "
            "megatron-core 0.19.2 parses it but never ramps (every step would train "
            "--global-batch-size); allowed: --step-batch-size-schedule 'THRESHOLD:BATCH ...' "
            "without --global-batch-size"
        )
    retain = getattr(args, "save_retain_interval", None)
    if (
        retain
        and getattr(args, "non_persistent_save_interval", None)
        and getattr(args, "non_persistent_ckpt_type", None) == "global"
    ):
        # after a non-persistent save, megatron-core 0.19.2's retention reads the previous
        # iteration from the non-persistent folder's tracker and deletes that iteration's folder
        # in --save: a run saved 4 persistently, saved 6 non-persistently and deleted --save's
        # iter_0000004, its only persistent checkpoint (CPU, one rank, measured)
        raise FlagError(
            f"--save-retain-interval {retain} is not allowed with "
            "--non-persistent-ckpt-type global: megatron-core 0.19.2 then deletes the persistent "
            "checkpoint in --save whose iteration the last non-persistent save followed; allowed: "
            "one of the two"
        )
    interval = getattr(args, "non_persistent_save_interval", None)
    if (
        interval
        and getattr(args, "non_persistent_ckpt_type", None) == "global"
        and args.ckpt_format != "torch_dist"
    ):
        # megatron-core 0.19.2 saves a global non-persistent checkpoint in --ckpt-format and
        # loads one only as torch_dist (_load_global_dist_base_checkpoint): with torch a bare
        # AssertionError at its first non-persistent save (CPU, one rank, measured); a torch_dcp
        # one (fsdp_dtensor: the same torch DCP save) fails the resume with "CheckpointingException:
        # LOAD/non_persistent/iter_N is not a distributed checkpoint" (Megatron's load of one,
        # measured on CPU; the same folder as a persistent checkpoint loads)
        failure = (
            "fails at its first non-persistent save"
            if args.ckpt_format == "torch"
            else f"saves them in {args.ckpt_format} and loads them only as torch_dist, so a "
            "resume from one fails"
        )
        raise FlagError(
            f"--non-persistent-save-interval {interval} with --non-persistent-ckpt-type global "
            f"is not allowed with --ckpt-format {args.ckpt_format}: megatron-core 0.19.2 "
            f"{failure}; allowed: --ckpt-format torch_dist, or no --non-persistent-save-interval"
        )
    if not args.async_save:
        return
    if args.ckpt_format == "torch":
        raise FlagError(
            "--async-save is not allowed with --ckpt-format torch: megatron-core 0.19.2 has no "
            "asynchronous save of the legacy format (NotImplementedError at the first save); "
            "allowed: --ckpt-format torch_dist or torch_dcp"
        )
    if not args.use_persistent_ckpt_worker:
        return  # Megatron's validate_args warns and saves synchronously
    if not has_cuda:
        raise FlagError(
            "--async-save --use-persistent-ckpt-worker needs a CUDA GPU: megatron-core 0.19.2's "
            "checkpoint worker process selects one, dies without, and the run hangs at its "
            "first save; allowed without a GPU: no --use-persistent-ckpt-worker (synchronous "
            "saves)"
        )
    if args.async_strategy == "nvrx" and not package_installed("nvidia_resiliency_ext"):
        raise FlagError(
            "--async-strategy nvrx (the default with --async-save) needs nvidia-resiliency-ext, "
            "which is not installed; allowed: --async-strategy mcore"
        )


_PIPELINE_SPLIT = (
    "num_layers",
    "pipeline_model_parallel_size",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "pipeline_model_parallel_layout",
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
)
"""The ``args`` that split the layers over pipeline stages (Megatron's flags, named alike)."""


def pipeline_split_flags(args) -> str:
    """The pipeline split as given on the command line, e.g. ``--num-layers 6
    --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 7``."""
    parts = []
    for dest in _PIPELINE_SPLIT:
        value = getattr(args, dest, None)
        if value is None or value is False:
            continue
        flag = "--" + dest.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {shlex.quote(str(value))}")
    return " ".join(parts)


def _check_pipeline_split(args) -> None:
    """First and last pipeline stages given more layers than the model has: megatron-core
    0.19.2's ``TransformerConfig`` checks ``bool(rest) == bool(other stages)``, true for a
    negative rest, and the first stage then builds every layer and the others none, silently
    (``--decoder-first-pipeline-num-layers 7`` of 6 layers on PP2 trained so)."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if args.pipeline_model_parallel_layout is not None or (first is None and last is None):
        return
    given = (first or 0) + (last or 0)
    others = args.pipeline_model_parallel_size - (first is not None) - (last is not None)
    if given > args.num_layers - max(others, 0):
        raise FlagError(
            f"{pipeline_split_flags(args)} is not allowed: the first and last pipeline stages "
            f"would hold {given} of the {args.num_layers} layers; allowed: at most "
            f"{args.num_layers - max(others, 0)} in those stages together (each of the other "
            f"{max(others, 0)} stages holds at least one layer)"
        )


def _check_qb_calibration(args) -> None:
    """The calibration pool is the run's last N global batches (``training/qb_calibrate.py``)."""
    n = args.moe_qb_calibrate_batches
    if not n:
        return
    if args.train_iters is None:
        raise FlagError(
            f"--moe-qb-calibrate-batches {n} needs --train-iters (its pool is the run's last "
            "N global batches)"
        )
    if n >= args.train_iters:
        raise FlagError(
            f"--moe-qb-calibrate-batches {n}: allowed 0 to --train-iters - 1 = "
            f"{args.train_iters - 1} (iteration 1's batch must stay out of the pool)"
        )
    if args.step_batch_size_schedule:
        raise FlagError(
            f"--moe-qb-calibrate-batches {n} does not support --step-batch-size-schedule (the "
            "pool is N batches of one fixed global batch size)"
        )
    if args.dataloader_type not in (None, "single"):
        raise FlagError(
            f"--moe-qb-calibrate-batches {n} with --dataloader-type {args.dataloader_type}: "
            "allowed: single (the pool is the last N global batches of the run's sample order)"
        )


# -------------------------------------------------------------------- config fields as flags
ARG_DEST = {"num_moe_experts": "num_experts"}
"""Config fields whose ``megatron.training`` args attribute has another name."""


def flag_for_field(field: str) -> str:
    """The command-line flag that sets a config field: ours (the table's), else the one
    Megatron declares in the field's metadata (e.g. layernorm_zero_centered_gamma <-
    --apply-layernorm-1p), else the field's name with dashes."""
    if field in BY_NAME and BY_NAME[field].flag:
        return BY_NAME[field].flag
    field = ARG_DEST.get(field, field)
    import dataclasses

    from megatron_latentmoe.config import StableLatentMoETransformerConfig

    for f in dataclasses.fields(StableLatentMoETransformerConfig):
        if f.name == field:
            names = f.metadata.get("argparse_meta", {}).get("arg_names")
            if names:
                return names[0]
    return "--" + field.replace("_", "-")


def flag_text(flag: str, value) -> str:
    """``--flag value`` (``--flag`` for True; a list's items after it)."""
    if value is True:
        return flag
    if isinstance(value, (list, tuple)):
        return " ".join([flag, *map(str, value)])
    return f"{flag} {value}"


def _flag_value(field: str, value) -> str:
    """``field=value`` as the command line says it: ``--flag value`` (``--flag`` for True)."""
    flag = flag_for_field(field)
    text = flag_text(flag, value)
    ours = field in BY_NAME and flag == BY_NAME[field].flag
    return text if ours or flag == "--" + field.replace("_", "-") else f"{text} ({field}={value!r})"


def checkpoint_origin(message: str, from_checkpoint: set[str]) -> str:
    """A refusal of flags that ``--use-checkpoint-args`` took from the checkpoint says so: the
    user did not type them (e.g. ``--position-embedding-type learned_absolute`` of a plain GPT
    checkpoint). ``from_checkpoint``: the dests the checkpoint changed."""
    flags = [
        flag
        for flag in dict.fromkeys(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", message))
        if flag[2:].replace("-", "_") in from_checkpoint
    ]
    if not flags:
        return message
    return f"{message} ({', '.join(flags)}: from the checkpoint's args, --use-checkpoint-args)"


def flag_message(err) -> str:
    """A config error in flags: ``--num-experts 7 (num_moe_experts=7) is not allowed: a multiple
    of --expert-model-parallel-size 2``."""
    return err.render(_flag_value)
