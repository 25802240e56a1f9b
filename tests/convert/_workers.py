"""Rank functions for the converter tests (run in spawned gloo worlds by tests.parallel.launcher).

They must be importable at module level. Each builds the real Megatron model with
``build_gpt_model`` under a parallel layout and saves / loads REAL ``torch_dist`` checkpoints with
``megatron.core.dist_checkpointing`` -- exactly what ``megatron.training`` does.
"""

from __future__ import annotations

import os

import torch

from megatron_latentmoe.convert.arch import ModelArch, arch_common_state

# A small model that still exercises every mapping: GQA (4 heads, 2 groups: the fused-QKV
# de-interleave is per group), one dense first layer (non-homogeneous checkpoint keys), 8 experts
# top-2, latent l=32 with the latent norm, 2 shared experts, vocab = the shipped tokenizer's 4096.
TEST_ARCH = dict(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    vocab_size=4096,
    num_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_latent_size=32,
    latent_moe_use_norm=True,
    moe_shared_expert_intermediate_size=64,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    rotary_base=10000.0,
    layernorm_epsilon=1e-5,
    activation_situ_beta=4.0,
    activation_situ_linear_beta=25.0,
)

# Homogeneous variant (no dense layer: Megatron stacks the layers on one checkpoint axis), with
# tied embeddings and SwiGLU, to cover the other key layout and config paths.
HOMOGENEOUS_ARCH = dict(
    TEST_ARCH,
    num_layers=2,
    first_k_dense_replace=0,
    tie_embeddings=True,
    hidden_act="swiglu",
    moe_router_topk_scaling_factor=2.5,
)

SEED = 1234
INIT_STD = 0.12
"""Weights ~ N(0, 0.12^2), untrained. Chosen (with SEED) so that greedy generation on the verify
prompts is varied (27 and 31 distinct tokens out of 32) and far from near-ties: the smallest
top-1/top-2 logit margin over the 64 greedy steps is 5.8e-3, vs ~5e-6 max |delta logits| between
Megatron and HF. (Measured alternatives: std 0.08 gave a 3e-4 margin; a few Adam steps on the
corpus made the model repeat one token.) The verify test asserts margin > 100 x delta."""


# The main model as trained with an aux loss alone: its routers have no expert_bias tensor.
NO_BIAS_ARCH = dict(TEST_ARCH, moe_router_load_balancing_type="aux_loss")

ARCHS = {"main": TEST_ARCH, "homogeneous": HOMOGENEOUS_ARCH, "no_bias": NO_BIAS_ARCH}


def arch(kind: str = "main") -> ModelArch:
    return ModelArch(**ARCHS[kind])


def _build(a: ModelArch, tp=1, pp=1, ep=1, etp=1):
    from megatron.core import parallel_state as ps

    from megatron_latentmoe.model import build_gpt_model

    config = a.to_megatron_config(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,
        init_method_std=INIT_STD,
        pipeline_dtype=torch.float32 if pp > 1 else None,
    )
    model = build_gpt_model(
        config,
        **a.builder_kwargs(),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    return model


def _randomise(model, seed: int) -> None:
    """Non-trivial weights everywhere: norms 1 + noise, expert bias N(0, 0.05) (it changes the
    selection, and a mapping error in it would show)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(
                ("layernorm.weight", "routed_expert_norm.weight", "layer_norm_weight")
            ):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(INIT_STD * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def _full_state(model) -> dict:
    return {
        k: v.clone()
        for k, v in model.state_dict().items()
        if torch.is_tensor(v) and not k.endswith("_extra_state")
    }


def _save(model, a: ModelArch, path: str, extra_common=None, metadata=None) -> None:
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # Megatron's writer collects its results through a multiprocessing.Manager queue, i.e. a
    # child process, which the launcher's daemonic ranks may not start; the writer threads only
    # put/get on it, so an in-process queue does the same job here.
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()

    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    sharded = (
        model.sharded_state_dict(metadata=metadata) if metadata else model.sharded_state_dict()
    )
    state = {"model": sharded, **arch_common_state(a), **(extra_common or {})}
    dist_checkpointing.save(state, path)
    torch.distributed.barrier()


def _load_and_diff(model, path: str, full: dict, strict: str = "assume_ok_unexpected") -> list:
    """Load ``path`` into ``model`` with Megatron's loader; names whose values differ from the
    expected shard of ``full``."""
    from megatron.core import dist_checkpointing

    from tests.parallel.launcher import shard_state_dict_for_rank

    loaded = dist_checkpointing.load(model.sharded_state_dict(), path, strict=strict)
    if isinstance(loaded, tuple):
        loaded = loaded[0]
    expected = shard_state_dict_for_rank(full, model)
    bad = []
    for k, v in expected.items():
        if k.endswith("_extra_state"):
            continue
        if k not in loaded or not torch.equal(loaded[k].to(v.dtype), v):
            bad.append(k)
    return bad


# ------------------------------------------------------------------------------------ rank fns


def make_reference(rank, world, out_dir: str) -> dict:
    """1 rank: the reference model (random weights), saved single-rank, plus its full state dict.
    Also the homogeneous variant end to end (save -> export -> import -> strict load)."""
    from megatron.core import parallel_state as ps

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.convert import export_checkpoint, import_checkpoint

    initialize_parallel_cpu(seed=SEED)
    a = arch("main")
    model = _build(a)
    _randomise(model, SEED)
    full = _full_state(model)
    torch.save(full, os.path.join(out_dir, "full.pt"))
    _save(model, a, os.path.join(out_dir, "ck_single"))
    _save(
        model, a, os.path.join(out_dir, "ck_singleton"), metadata={"singleton_local_shards": True}
    )
    # the dense+MoE model again, as a bf16 checkpoint (params bf16, the QB bias stays fp32)
    bf16 = _build(a)
    bf16.load_state_dict(
        {**full, **{k: v for k, v in bf16.state_dict().items() if k.endswith("_extra_state")}}
    )
    bf16 = bf16.to(torch.bfloat16)
    for name, buf in bf16.named_buffers():
        if name.endswith("expert_bias"):
            buf.data = full[name].float().clone()
    _save(bf16, a, os.path.join(out_dir, "ck_bf16"))
    legacy_names = _save_with_old_norm_name(model, a, os.path.join(out_dir, "ck_old_names"), full)
    # the same weights in routers without expert_bias (the model's parameters draw the same
    # numbers: the bias is a buffer, drawn after them)
    no_bias = _build(arch("no_bias"))
    _randomise(no_bias, SEED)
    assert not any(name.endswith("expert_bias") for name, _ in no_bias.named_buffers())
    _save(no_bias, arch("no_bias"), os.path.join(out_dir, "ck_no_bias"))

    # homogeneous variant: stacked-layer keys, tied embeddings, swiglu, routed scaling
    h = arch("homogeneous")
    hm = _build(h)
    _randomise(hm, SEED + 1)
    hfull = _full_state(hm)
    hpath = os.path.join(out_dir, "ck_homog")
    _save(hm, h, hpath)
    export_checkpoint(hpath, os.path.join(out_dir, "hf_homog"), progress=False)
    import_checkpoint(
        os.path.join(out_dir, "hf_homog"), os.path.join(out_dir, "mg_homog"), progress=False
    )
    fresh = _build(h)
    # raise_all: the imported checkpoint has exactly the keys Megatron asks for, no more, no less
    bad_homog = _load_and_diff(
        fresh, os.path.join(out_dir, "mg_homog", "release"), hfull, strict="raise_all"
    )
    ps.destroy_model_parallel()
    return {"bad_homog": bad_homog, **legacy_names}


def _save_with_old_norm_name(model, a: ModelArch, path: str, full: dict) -> dict:
    """A checkpoint as written before ``mlp.latent_norm`` became ``mlp.routed_expert_norm``,
    loaded back the way a resumed training run does (``use_legacy_names_of`` its keys), and
    without that (which must fail: the test would otherwise prove nothing)."""
    from megatron_latentmoe.convert.dist_reader import DistCheckpointReader
    from megatron_latentmoe.moe.checkpoint_names import NORM_NAME
    from megatron_latentmoe.moe.layer import use_legacy_names_of

    use_legacy_names_of(model, ["decoder.layers.1.mlp.latent_norm.weight"])
    _save(model, a, path)
    use_legacy_names_of(model, [])
    keys = list(DistCheckpointReader(path).metadata.state_dict_metadata)
    fresh = _build(a)
    plain = _build(a)
    legacy = use_legacy_names_of(fresh, keys)
    try:
        _load_and_diff(plain, path, full, strict="raise_all")
        plain_load = "loaded"
    except Exception as e:  # noqa: BLE001 - recorded; the test asserts it did not load
        plain_load = type(e).__name__
    return {
        "old_names_keys": sorted(k for k in keys if "latent_norm" in k or NORM_NAME in k),
        "old_names_detected": legacy,
        "bad_old_names": _load_and_diff(fresh, path, full, strict="raise_all"),
        "old_names_without_detection": plain_load,
    }


def save_and_load(rank, world, layouts: dict, checkpoints: list, out_dir: str) -> dict:
    """For each layout (one gloo world, layouts in turn): save the reference weights as
    ``ck_<layout>``, then load each of ``checkpoints`` ([(path, strictness)]) into that layout's
    model with Megatron's loader. Returns {layout: {checkpoint name: [names that differ]}}."""
    from megatron.core import parallel_state as ps

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from tests.parallel.launcher import shard_state_dict_for_rank

    full = torch.load(os.path.join(out_dir, "full.pt"))
    a = arch("main")
    out = {}
    for name, lay in layouts.items():
        initialize_parallel_cpu(
            tensor_model_parallel_size=lay["tp"],
            pipeline_model_parallel_size=lay["pp"],
            expert_model_parallel_size=lay["ep"],
            expert_tensor_parallel_size=lay["etp"],
            seed=SEED,
        )
        model = _build(a, **lay)
        missing, unexpected = model.load_state_dict(
            shard_state_dict_for_rank(full, model), strict=False
        )
        assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected, (
            missing,
            unexpected,
        )
        _save(model, a, os.path.join(out_dir, f"ck_{name}"))
        with torch.no_grad():  # make sure the loads below really overwrite the weights
            for p in model.parameters():
                p.zero_()
        out[name] = {
            os.path.basename(os.path.dirname(path)): _load_and_diff(model, path, full, strict)
            for path, strict in checkpoints
        }
        ps.destroy_model_parallel()
    return out


# The tiny model of arch() as a Megatron config file (JSON/YAML) states it, for the converter's
# --megatron-config input.
MEGATRON_CFG = dict(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    num_moe_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_latent_size=32,
    moe_shared_expert_intermediate_size=64,
    first_k_dense_replace=1,
    hidden_act="situ",
    vocab_size=4096,
    max_sequence_length=256,
)


def load_with_nan_bias(rank, world, out_dir: str) -> tuple[str, str | None]:
    """1 rank: the main model saved with NaN in one router's ``expert_bias`` (expert 3), then
    loaded as ``verify`` loads it; returns the bias's key and the ConversionError's message."""
    from megatron.core import parallel_state as ps

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.convert import ConversionError
    from megatron_latentmoe.convert.verify import load_megatron_model

    initialize_parallel_cpu(seed=SEED)
    a = arch("main")
    model = _build(a)
    _randomise(model, SEED)
    name, bias = next((n, b) for n, b in model.named_buffers() if n.endswith("expert_bias"))
    bias[3] = float("nan")
    path = os.path.join(out_dir, "ck_nan_bias")
    _save(model, a, path)
    try:
        load_megatron_model(path, a)
        error = None
    except ConversionError as err:
        error = str(err)
    ps.destroy_model_parallel()
    return name, error
