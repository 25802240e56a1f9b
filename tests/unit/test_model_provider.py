"""The training entry point's model provider (``training/model_provider.py``): the flags of
``examples/args/tiny.sh`` (and variations) go through the entry point's flag checks, then the
provider's ``transformer_config_from_args`` / ``model_config_from_args`` and its builder, in ONE
single-rank gloo process (megatron is imported once); the tests read what each run built."""

from __future__ import annotations

import sys

import pytest

from tests.parallel.launcher import run_distributed
from tests.training import tiny_args

SINGLE_RANK = ["--expert-model-parallel-size", "1"]  # tiny.sh is EP2; the fixture has 1 rank
RUNS = {
    "tiny": {},
    "plain_moe": {"--moe-latent-size": None, "--moe-latent-norm": None},
    "no_qb": {
        "--moe-router-load-balancing-type": "aux_loss",
        "--moe-aux-loss-coeff": "0.01",
        "--moe-router-score-function": None,
    },
    "qb_defaults": {"--moe-router-score-function": None, "--moe-qb-num-bins": None},
    "qb_flags": {
        "--moe-qb-num-bins": "96",
        "--moe-qb-binning": "centered",
        "--moe-qb-absorb-coeff": "0.25",
        "--moe-qb-rescore-iters": "3",
        "--moe-qb-rescore-solves": "2",
        "--moe-qb-calibrate-batches": "5",
        "--hidden-act": "swiglu",
        "--moe-latent-norm": None,
        "--no-moe-latent-norm": True,
    },
    "situ_flags": {"--activation-situ-beta": "2.5", "--activation-situ-linear-beta": "12.0"},
    "query_groups_without_gqa": {"--group-query-attention": None, "--num-query-groups": "3"},
}
"""Run name -> changes to tiny.sh's flags: ``{FLAG: VALUE}`` sets the flag's value, ``{FLAG:
True}`` adds the flag alone, ``{FLAG: None}`` removes the flag (and its value)."""

CONFIG_FIELDS = (
    "num_moe_experts",
    "num_query_groups",
    "moe_latent_size",
    "latent_moe_use_norm",
    "hidden_act",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "moe_router_load_balancing_type",
    "moe_router_score_function",
    "moe_qb_num_bins",
    "moe_qb_binning",
    "moe_qb_absorb_coeff",
    "moe_qb_rescore_iters",
    "moe_qb_rescore_solves",
    "moe_qb_calibrate_batches",
    "first_k_dense_replace",
    "gated_linear_unit",
)


def _flags(changes: dict) -> list[str]:
    """tiny.sh's flags with ``changes`` (see RUNS) applied, on one rank."""
    argv = [*tiny_args(), *SINGLE_RANK]
    for flag, value in changes.items():
        if flag in argv:
            at = argv.index(flag)
            has_value = at + 1 < len(argv) and not argv[at + 1].startswith("--")
            del argv[at : at + 1 + has_value]
        if value is True:
            argv.append(flag)
        elif value is not None:
            argv += [flag, value]
    return argv


NORM_KEY = "decoder.layers.1.mlp.{}.weight"
RESUMES = {  # what a resumed run loads: (--ckpt-format, --ckpt-step)
    "tracked": ("torch_dist", None),  # the tracker's iteration 2: the old norm name
    "ckpt_step_0": ("torch_dist", 0),  # 0 is no --ckpt-step to Megatron: the tracker's
    "ckpt_step_1": ("torch_dist", 1),  # --ckpt-step overrides the tracker: today's name
    "ckpt_step_3": ("torch_dist", 3),  # no such checkpoint: nothing to read, today's name
    "torch_format": ("torch", None),  # not a torch_dist checkpoint: its keys are not read
    "pretrained": ("torch_dist", None),  # given as --pretrained-checkpoint, no --load: the same
}


def _write_checkpoints(root: str) -> None:
    """``root``: iteration 1 with the latent norm's name of today, iteration 2 (the tracker's)
    with the name before the rename; one tensor each, written with torch.distributed.checkpoint
    (what Megatron's torch_dist checkpoints are)."""
    import os

    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_latentmoe.checkpoint_layout import TRACKER_FILE, iteration_dir_name
    from megatron_latentmoe.moe.checkpoint_names import LEGACY_NORM_NAME, NORM_NAME

    for step, name in ((1, NORM_NAME), (2, LEGACY_NORM_NAME)):
        path = os.path.join(root, iteration_dir_name(step))
        dcp.save({NORM_KEY.format(name): torch.zeros(2)}, checkpoint_id=path)
    with open(os.path.join(root, TRACKER_FILE), "w") as f:
        f.write("2")


def _norm_names_on_resume(args, builder, pg_collection, root: str) -> dict:
    """For each of RESUMES: the latent norm names the builder's model reads and writes, with
    ``--load root`` in Megatron's global args (as in a training run)."""
    from megatron.training import global_vars

    _write_checkpoints(root)
    names = {}
    for label, (ckpt_format, ckpt_step) in RESUMES.items():
        args.load, args.ckpt_format, args.ckpt_step = root, ckpt_format, ckpt_step
        args.pretrained_checkpoint = None
        if label == "pretrained":
            args.load, args.pretrained_checkpoint = None, root
        global_vars.set_args(args)
        model = builder.build_model(pg_collection)
        names[label] = sorted(
            {m.checkpoint_norm_name for m in model.modules() if hasattr(m, "checkpoint_norm_name")}
        )
    global_vars.set_args(None)
    return names


RESOLVED = (
    "transformer_impl",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
    "moe_grouped_gemm",
    "distributed_backend",
)
"""The flags validate_stable_latentmoe_args resolves from the machine (GPU, Transformer Engine)."""


def _resolved_on_machines(argv) -> dict:
    """RESOLVED after the flag check of ``argv``, on a CPU and on a GPU, each without and with
    Transformer Engine (no apex: this venv has none)."""
    from megatron_latentmoe.compat.training import parse_with_our_flags
    from megatron_latentmoe.training.arguments import (
        add_stable_latentmoe_args,
        validate_stable_latentmoe_args,
    )

    resolved = {}
    machines = {
        "cpu": (False, False),
        "gpu_without_te": (True, False),
        "cpu_with_te": (False, True),
        "gpu_with_te": (True, True),
    }
    for machine, (has_cuda, have_te) in machines.items():
        sys.argv = ["pretrain", *argv]
        args = parse_with_our_flags(add_stable_latentmoe_args)
        validate_stable_latentmoe_args(args, has_cuda=has_cuda, have_te=have_te)
        resolved[machine] = {k: getattr(args, k) for k in RESOLVED}
    return resolved


def _provide(rank, world_size, runs, checkpoint_root):
    """For each run: what the provider built from its flags (config fields, model config, the
    model's MoE layers and sizes); for tiny.sh's flags also the backend of
    ``--transformer-impl transformer_engine`` and the norm names of RESUMES."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_latentmoe.compat import (
        apply_core_compat,
        apply_python311_compat,
        initialize_parallel_cpu,
    )

    apply_python311_compat()
    apply_core_compat()
    from megatron_latentmoe.training import model_provider
    from megatron_latentmoe.training.pretrain import checked_args

    initialize_parallel_cpu()
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    hook = object()  # what the entry point installs: the builder must hand it to the config
    model_provider.install_finalize_hook(hook)
    out = {}
    for name, argv in runs.items():
        sys.argv = ["pretrain", *argv]
        args, config, _, _ = checked_args(has_cuda=False)
        args.padded_vocab_size, args.vocab_size = None, 1000  # the builder pads it
        model_cfg = model_provider.model_config_from_args(args, config)
        builder = model_provider.StableLatentMoEModelBuilder(model_cfg)
        model = builder.build_model(pg_collection)
        moe = [m for m in model.modules() if isinstance(m, MoELayer)]
        out[name] = dict(
            transformer_impl=args.transformer_impl,
            config_class=type(config).__name__,
            config={f: getattr(config, f) for f in CONFIG_FIELDS},
            backend=model_cfg.latentmoe_backend,
            should_pad_vocab=model_cfg.should_pad_vocab,
            embedding_rows=model.embedding.word_embeddings.weight.shape[0],
            output_rows=model.output_layer.weight.shape[0],
            hook_installed=config.finalize_model_grads_func is hook,
            moe_layers=[type(m).__name__ for m in moe],
            routers=[type(m.router).__name__ for m in moe],
            latent_down=[
                tuple(m.fc1_latent_proj.weight.shape) for m in moe if hasattr(m, "fc1_latent_proj")
            ],
        )
        if name == "tiny":
            out[name]["norm_names"] = _norm_names_on_resume(
                args, builder, pg_collection, checkpoint_root
            )
            args.transformer_impl = "transformer_engine"  # its config only: no TE model here
            te_cfg = model_provider.model_config_from_args(args, config)
            out[name]["te_backend"] = te_cfg.latentmoe_backend
            out[name]["machines"] = _resolved_on_machines(argv)
    model_provider.install_finalize_hook(None)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    runs = {name: _flags(changes) for name, changes in RUNS.items()}
    root = str(tmp_path_factory.mktemp("model_provider_checkpoints"))
    (out,) = run_distributed(_provide, 1, runs, root, timeout=600)
    return out


def test_tiny_flags_build_the_latent_moe_model(built):
    tiny = built["tiny"]
    assert tiny["config_class"] == "StableLatentMoETransformerConfig"
    assert tiny["transformer_impl"] == "local"  # no TE, no GPU: the local spec
    assert (tiny["backend"], tiny["te_backend"]) == ("local", "te")
    assert tiny["config"] == dict(
        num_moe_experts=8,
        num_query_groups=2,
        moe_latent_size=64,
        latent_moe_use_norm=True,
        hidden_act="situ",
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        moe_router_load_balancing_type="quantile_histogram",
        moe_router_score_function="sigmoid",
        moe_qb_num_bins=1000,
        moe_qb_binning="uniform",
        moe_qb_absorb_coeff=0.0,
        moe_qb_rescore_iters=0,
        moe_qb_rescore_solves=1,
        moe_qb_calibrate_batches=0,
        first_k_dense_replace=1,
        gated_linear_unit=True,
    )
    # layer 1 dense, layers 2-4 the Stable LatentMoE block: W_down 128 -> 64 before dispatch
    assert tiny["moe_layers"] == ["StableLatentMoELayer"] * 3
    assert tiny["routers"] == ["QuantileBalancingRouter"] * 3
    assert tiny["latent_down"] == [(64, 128)] * 3


def test_the_vocabulary_is_padded_and_the_step_end_hook_installed(built):
    """vocab 1000 -> a multiple of --make-vocab-size-divisible-by 128 (x TP 1): 1024 rows in the
    embedding and the untied output layer; the hook of install_finalize_hook on the config."""
    for run in built.values():
        assert run["should_pad_vocab"] is True
        assert (run["embedding_rows"], run["output_rows"]) == (1024, 1024)
        assert run["hook_installed"] is True


def test_without_a_latent_size_the_model_is_the_plain_moe(built):
    plain = built["plain_moe"]
    assert plain["config"]["moe_latent_size"] is None
    assert plain["config"]["latent_moe_use_norm"] is False  # default: on iff a latent size
    assert plain["moe_layers"] == ["MoELayer"] * 3
    assert plain["routers"] == ["QuantileBalancingRouter"] * 3
    assert plain["latent_down"] == []


def test_the_score_function_defaults_to_sigmoid_under_qb_and_softmax_else(built):
    assert built["qb_defaults"]["config"]["moe_router_score_function"] == "sigmoid"
    assert built["qb_defaults"]["config"]["moe_qb_num_bins"] == 1000  # the table's default
    no_qb = built["no_qb"]
    assert no_qb["config"]["moe_router_load_balancing_type"] == "aux_loss"
    assert no_qb["config"]["moe_router_score_function"] == "softmax"
    assert no_qb["routers"] == ["BalanceCountingRouter"] * 3  # Megatron's TopKRouter + counts


def test_the_qb_and_activation_flags_reach_the_config(built):
    config = built["qb_flags"]["config"]
    assert {
        k: config[k] for k in CONFIG_FIELDS if k.startswith(("moe_qb", "hidden", "latent_"))
    } == {
        "moe_qb_num_bins": 96,
        "moe_qb_binning": "centered",
        "moe_qb_absorb_coeff": 0.25,
        "moe_qb_rescore_iters": 3,
        "moe_qb_rescore_solves": 2,
        "moe_qb_calibrate_batches": 5,
        "hidden_act": "swiglu",
        "latent_moe_use_norm": False,
    }
    situ = built["situ_flags"]["config"]
    assert (situ["activation_situ_beta"], situ["activation_situ_linear_beta"]) == (2.5, 12.0)


def test_query_groups_without_gqa_are_ignored_as_megatron_ignores_them(built):
    """Without --group-query-attention Megatron ignores --num-query-groups (one group per head):
    the flag check does not refuse a value that does not divide the 4 heads."""
    assert built["query_groups_without_gqa"]["config"]["num_query_groups"] == 4


def test_a_resumed_run_builds_the_norm_under_its_checkpoints_name(built):
    """The builder reads the keys of the checkpoint ``--load`` resumes from (the tracker's
    iteration, or ``--ckpt-step``'s, torch_dist only; ``--pretrained-checkpoint``'s where no
    --load is given, which the builder did not read before: it built ``routed_expert_norm``): a
    checkpoint from before the rename is read and written under the old name ``latent_norm``."""
    assert built["tiny"]["norm_names"] == {
        "tracked": ["latent_norm"],
        "ckpt_step_0": ["latent_norm"],
        "ckpt_step_1": ["routed_expert_norm"],
        "ckpt_step_3": ["routed_expert_norm"],
        "torch_format": ["routed_expert_norm"],
        "pretrained": ["latent_norm"],
    }


def test_the_flag_check_resolves_the_backend_and_fusions_for_the_machine(built):
    """Without Transformer Engine: the local layers (no grouped GEMM), no TE RoPE fusion, no
    apex wgrad fusion; gloo on a CPU, Megatron's nccl on a GPU. TE is chosen only with a GPU
    (on a CPU it is the local layers without TE's RoPE fusion, a CUDA kernel), and then with
    grouped-GEMM experts and Megatron's wgrad fusion."""
    local = dict(
        transformer_impl="local",
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        moe_grouped_gemm=False,
    )
    assert built["tiny"]["machines"] == {
        "cpu": dict(local, distributed_backend="gloo"),
        "gpu_without_te": dict(local, distributed_backend="nccl"),
        "cpu_with_te": dict(local, distributed_backend="gloo"),
        "gpu_with_te": dict(
            transformer_impl="transformer_engine",
            apply_rope_fusion=True,
            gradient_accumulation_fusion=True,
            moe_grouped_gemm=True,
            distributed_backend="nccl",
        ),
    }


def test_the_builder_gives_each_pipeline_stage_its_ends_and_the_padded_vocabulary(monkeypatch):
    """What ``build_model`` hands ``build_gpt_model`` (faked here, in this process): the
    vocabulary padded to a multiple of --make-vocab-size-divisible-by x TP (1100 -> 1280 at
    128 x 2), the model config's sequence length, backend, tying and RoPE base, and each stage's
    ends: the embedding on the first pipeline stage's first virtual stage only, the output layer
    on the last's last. A hook already on the config is kept; none -> the installed one."""
    from types import SimpleNamespace

    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()
    from megatron_latentmoe.training import model_provider

    built = []
    monkeypatch.setattr(model_provider, "build_gpt_model", lambda t, **kw: built.append(kw) or t)
    monkeypatch.setattr(model_provider, "is_pp_first_stage", lambda pp: pp in ("only", "first"))
    monkeypatch.setattr(model_provider, "is_pp_last_stage", lambda pp: pp in ("only", "last"))
    monkeypatch.setattr(model_provider, "_resume_checkpoint_keys", lambda: [])
    monkeypatch.setattr(model_provider, "use_legacy_names_of", lambda model, keys: False)
    monkeypatch.setattr(model_provider, "_FINALIZE_HOOK", "installed hook")

    def build(pp, vp_stage=None, vp_size=None, vocab_size=1100, hook=None):
        transformer = SimpleNamespace(
            tensor_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=vp_size,
            finalize_model_grads_func=hook,
        )
        cfg = SimpleNamespace(
            transformer=transformer,
            vocab_size=vocab_size,
            should_pad_vocab=True,
            make_vocab_size_divisible_by=128,
            seq_length=96,
            latentmoe_backend="te",
            share_embeddings_and_output_weights=True,
            rotary_base=50000,
        )
        pg_collection = SimpleNamespace(pp=pp)
        builder = model_provider.StableLatentMoEModelBuilder(cfg)
        model = builder.build_model(pg_collection, vp_stage=vp_stage)
        kwargs = built.pop()
        assert kwargs.pop("pg_collection") is pg_collection and kwargs.pop("vp_stage") == vp_stage
        return kwargs, model.finalize_model_grads_func

    kwargs, hook = build("only")
    assert kwargs == dict(
        vocab_size=1280,
        max_sequence_length=96,
        backend="te",
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=True,
        rotary_base=50000,
    )
    assert hook == "installed hook"
    assert build("only", hook="the config's own")[1] == "the config's own"
    ends = {
        (pp, vp_stage): tuple(
            build(pp, vp_stage, vp_size)[0][k] for k in ("pre_process", "post_process")
        )
        for pp, vp_stage, vp_size in (
            ("first", None, None),
            ("last", None, None),
            ("first", 0, 2),
            ("first", 1, 2),
            ("last", 0, 2),
            ("last", 1, 2),
        )
    }
    assert ends == {
        ("first", None): (True, False),
        ("last", None): (False, True),
        ("first", 0): (True, False),
        ("first", 1): (False, False),
        ("last", 0): (False, False),
        ("last", 1): (False, True),
    }
    with pytest.raises(ValueError, match="^vocab_size must be set before building the model$"):
        build("only", vocab_size=None)


def test_a_config_refusal_names_the_flags(monkeypatch):
    """``transformer_config_from_args``: a rule of the model's config (``ConfigError``, itself a
    ValueError) is worded with the flags, as the flag check words it (not as one of Megatron's
    own checks, which names the fields first); a config class other than ours (Megatron swaps it
    for MLA) is refused."""
    from types import SimpleNamespace

    from megatron_latentmoe.compat import apply_python311_compat

    apply_python311_compat()
    from megatron.training import argument_utils

    from megatron_latentmoe.cli_errors import FlagError
    from megatron_latentmoe.fields import ConfigError
    from megatron_latentmoe.training import model_provider

    def refuse(args, config_class):
        raise ConfigError(
            "moe_latent_size", 63, "a multiple of {tensor_model_parallel_size}", **args.refs
        )

    monkeypatch.setattr(argument_utils, "core_transformer_config_from_args", refuse)
    args = SimpleNamespace(refs=dict(tensor_model_parallel_size=2), pipeline_model_parallel_size=1)
    with pytest.raises(FlagError) as err:
        model_provider.transformer_config_from_args(args)
    assert str(err.value) == (
        "--moe-latent-size 63 is not allowed: a multiple of --tensor-model-parallel-size 2"
    )
    monkeypatch.setattr(
        argument_utils,
        "core_transformer_config_from_args",
        lambda args, config_class: type("MLATransformerConfig", (), {})(),
    )
    with pytest.raises(FlagError) as err:
        model_provider.transformer_config_from_args(args)
    assert str(err.value) == (
        "these flags select Megatron's MLATransformerConfig, which Stable LatentMoE does not "
        "support (remove --multi-latent-attention / heterogeneous layers)"
    )
