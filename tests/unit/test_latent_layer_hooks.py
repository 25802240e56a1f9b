"""StableLatentMoELayer keeps Megatron's MoELayer hooks working for the latent projections."""

from tests.parallel.launcher import run_distributed


def _backward_dw_calls(rank, world_size):
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu()
    cfg = tiny_config()
    layer = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1)
    calls = []
    for name in ("fc1_latent_proj", "fc2_latent_proj", "experts", "shared_experts"):
        getattr(layer, name).backward_dw = lambda name=name: calls.append(name)
    # what Megatron's EP-overlap schedule does with deferred weight gradients (TE linears)
    layer.config.overlap_moe_expert_parallel_comm = True
    layer.backward_dw(routed_experts=True, shared_experts=False)
    layer.backward_dw(routed_experts=False, shared_experts=True)
    return calls


def test_deferred_weight_gradients_reach_the_latent_projections():
    """Under Megatron's EP-overlap schedule, TELinear computes its weight gradient only in
    backward_dw: the layer's hook must reach W_up with the routed experts and W_down with the
    shared experts, as Megatron's own latent MoE does."""
    (calls,) = run_distributed(_backward_dw_calls, 1)
    assert calls == ["experts", "fc2_latent_proj", "shared_experts", "fc1_latent_proj"]


def _old_norm_name_state_dict(rank, world_size):
    import torch

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu()
    cfg = tiny_config()
    old, new = (get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1) for _ in range(2))
    with torch.no_grad():
        old.routed_expert_norm.weight.uniform_(0.5, 1.5)
    # loaded into a parent module, as a whole model loads it: the keys carry the layer's prefix
    state = {
        "decoder.mlp." + k.replace("routed_expert_norm.", "latent_norm."): v
        for k, v in old.state_dict().items()
    }
    parent = torch.nn.ModuleDict({"decoder": torch.nn.ModuleDict({"mlp": new})})
    result = parent.load_state_dict(state, strict=True)
    return (
        sorted(k for k in state if "norm" in k),
        list(result.missing_keys),
        torch.equal(new.routed_expert_norm.weight, old.routed_expert_norm.weight),
    )


def test_a_state_dict_with_the_old_norm_name_loads():
    """Plain state dicts saved before mlp.latent_norm was renamed routed_expert_norm load as is,
    the layer inside a model (its keys prefixed)."""
    (result,) = run_distributed(_old_norm_name_state_dict, 1)
    assert result == (["decoder.mlp.latent_norm.weight"], [], True)


def _latent_projection_tags(rank, world_size):
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu()
    cfg = tiny_config()
    layer = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1)
    tags = []
    for name in ("fc1_latent_proj", "fc2_latent_proj"):
        w = getattr(layer, name).weight
        tags.append((name, w.allreduce, w.tensor_model_parallel, w.sequence_parallel))
    return tags


def test_latent_projections_are_tagged_as_replicated_dense_weights():
    """What Megatron reads off a parameter to reduce its gradient: ``allreduce`` True (a dense
    weight, reduced over the whole data-parallel group; False would make DDP treat W_down / W_up
    as expert weights), ``tensor_model_parallel`` False (replicated, never sliced across TP), and
    ``sequence_parallel`` as configured (here off: one process, no TP)."""
    (tags,) = run_distributed(_latent_projection_tags, 1)
    assert tags == [
        ("fc1_latent_proj", True, False, False),
        ("fc2_latent_proj", True, False, False),
    ]


def _sharded_norm_keys(rank, world_size):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.moe.layer import use_legacy_names_of
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu()
    cfg = tiny_config()
    layer = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1)

    def norm_keys():
        sharded = layer.sharded_state_dict(prefix="decoder.layers.0.mlp.")
        keys = sorted(v.key for v in sharded.values() if isinstance(v, ShardedTensor))
        return [k for k in keys if "norm" in k], len(keys)

    found = [norm_keys()]
    # a checkpoint's keys: the norm's among the others
    others = ["decoder.layers.3.mlp.router.weight", "decoder.layers.3.mlp.fc1_latent_proj.weight"]
    found.append(use_legacy_names_of(layer, [*others, "decoder.layers.3.mlp.latent_norm.weight"]))
    found.append(norm_keys())
    found.append(
        use_legacy_names_of(layer, [*others, "decoder.layers.3.mlp.routed_expert_norm.weight"])
    )
    found.append(norm_keys())
    return found


def test_a_torch_dist_checkpoint_with_the_old_norm_name_is_read_under_it():
    """``use_legacy_names_of`` a checkpoint's keys: with the old ``latent_norm`` key the layer's
    sharded state dict asks for (and saves) that key, every other key unchanged; with today's
    keys it asks for ``routed_expert_norm`` again."""
    (found,) = run_distributed(_sharded_norm_keys, 1)
    new = ["decoder.layers.0.mlp.routed_expert_norm.weight"]
    old = ["decoder.layers.0.mlp.latent_norm.weight"]
    (new_keys, n), legacy, (old_keys, n_old), current, (again, n_again) = found
    assert (new_keys, legacy, old_keys, current, again) == (new, True, old, False, new)
    assert n == n_old == n_again


def _latent_projection_init_stds(rank, world_size):
    import torch

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu()
    cfg = tiny_config(num_layers=8, init_method_std=0.02)
    torch.manual_seed(0)
    layer = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1)
    return [getattr(layer, n).weight.std().item() for n in ("fc1_latent_proj", "fc2_latent_proj")]


def test_latent_projections_take_megatrons_input_and_output_layer_init():
    """W_down is drawn like Megatron's input-side weights (init_method: std 0.02), W_up like its
    output-side ones (output_layer_init_method: 0.02 / sqrt(2 * 8 layers) = 0.005), as
    Megatron's own latent MoE does. 2048 draws each: the sample std is within 10 %."""
    (stds,) = run_distributed(_latent_projection_init_stds, 1)
    for got, want in zip(stds, (0.02, 0.02 / (2 * 8) ** 0.5), strict=True):
        assert abs(got / want - 1) < 0.1, (stds, want)


def test_a_latent_projection_follows_sequence_parallel_and_refuses_a_bias():
    """Built directly (no process group): the ``sequence_parallel`` tag is the config's (True
    here: Megatron's finalize_model_grads then sums W_down / W_up's gradient over the TP ranks,
    each of which projected its own sequence slice), and ``bias=True`` is one line naming it."""
    from types import SimpleNamespace

    import pytest
    import torch

    from megatron_latentmoe.moe.latent_projection import LatentProjection

    cfg = SimpleNamespace(
        params_dtype=torch.float32, perform_initialization=False, sequence_parallel=True
    )
    proj = LatentProjection(8, 4, config=cfg, init_method=None)
    assert proj.weight.sequence_parallel is True and proj.weight.shape == (4, 8)
    with pytest.raises(ValueError, match=r"^bias=True is not allowed: False \(the latent"):
        LatentProjection(8, 4, config=cfg, init_method=None, bias=True)
