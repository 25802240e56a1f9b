"""What token dispatch and combine actually move under EP2 (SPEC §1: l-wide, not d-wide).

Every collective a rank issues during one forward + backward of the MoE layer is recorded at the
torch.distributed level (Megatron's own ``mappings`` call sites included). The hidden-state
traffic is every floating 2-D tensor whose width is d or l (d=64, l=32 and n=8 are distinct, so
router probabilities cannot be mistaken for hidden rows). Megatron's plain (full-width) MoE
layer is measured the same way as a control: the measurement sees d-wide rows when they exist.
"""

import pytest
import torch

from .launcher import run_distributed

D, LATENT, EXPERTS, TOPK, SEQ, BATCH = 64, 32, 8, 2, 16, 2
COLLECTIVES = (
    "all_to_all_single",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
)


def _record_collectives(log):
    """Wrap torch.distributed collectives (and Megatron's captured aliases) to log input shapes."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            lists = [a for a in args if isinstance(a, (list, tuple))]
            # input = last tensor argument for (output, input) signatures, else the list's items
            if name.startswith("all_gather") and lists:
                src = [args[1]] if isinstance(args[1], torch.Tensor) else []
            elif name == "reduce_scatter" and lists:
                src = list(args[1])
            else:
                src = tensors[-1:] if len(tensors) > 1 else tensors
            for t in src:
                log.append((name, tuple(t.shape), t.is_floating_point()))
            return fn(*args, **kwargs)

        return recorded

    originals = {}
    for name in COLLECTIVES:
        if hasattr(dist, name):
            originals[name] = getattr(dist, name)
            setattr(dist, name, wrap(name, originals[name]))
    mappings.dist_all_gather_func = wrap("all_gather_into_tensor", mappings.dist_all_gather_func)
    mappings.dist_reduce_scatter_func = wrap(
        "reduce_scatter_tensor", mappings.dist_reduce_scatter_func
    )


def _measure(rank, world_size, dispatcher, latent):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.specs import get_stable_latentmoe_mlp_spec

    initialize_parallel_cpu(expert_model_parallel_size=2)
    if latent:
        cfg = tiny_config(
            expert_model_parallel_size=2,
            moe_token_dispatcher_type=dispatcher,
            moe_shared_expert_intermediate_size=None,
        )
        layer = get_stable_latentmoe_mlp_spec(cfg)(config=cfg, layer_number=1)
    else:  # Megatron's own full-width MoE layer, as the control
        cfg = tiny_config(
            expert_model_parallel_size=2,
            moe_token_dispatcher_type=dispatcher,
            moe_latent_size=None,
            latent_moe_use_norm=False,
            hidden_act="swiglu",
            moe_router_load_balancing_type="none",
            moe_shared_expert_intermediate_size=None,
        )
        builder = get_moe_module_spec(use_te=False, num_experts=EXPERTS)
        layer = builder(config=cfg, layer_number=1)
    torch.manual_seed(100 + rank)
    x = torch.randn(SEQ, BATCH, D, requires_grad=True)
    log = []
    _record_collectives(log)
    out, _ = layer(x)
    out.sum().backward()
    hidden = [
        (op, shape)
        for op, shape, is_float in log
        if is_float and len(shape) == 2 and shape[-1] in (D, LATENT)
    ]
    return hidden


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_dispatch_and_combine_move_latent_rows_under_ep2(dispatcher):
    tokens_per_rank = SEQ * BATCH
    per_rank = run_distributed(_measure, 2, dispatcher, True)
    for hidden in per_rank:
        assert hidden, "no hidden-state collective was recorded"
        widths = {shape[-1] for _, shape in hidden}
        assert widths == {LATENT}, f"{dispatcher}: hidden traffic widths {widths}, expected l only"
    total_rows = sum(shape[0] for hidden in per_rank for _, shape in hidden)
    if dispatcher == "alltoall":
        # dispatch + combine in forward, and their gradients in backward: each moves every routed
        # (token, expert) copy exactly once, l wide.
        assert total_rows == 4 * 2 * tokens_per_rank * TOPK
    else:
        # all-gather of the local tokens (l wide) in forward and its reduce-scatter in backward;
        # combine is a reduce-scatter of all EP tokens and its all-gather in backward.
        assert total_rows == 2 * (2 * tokens_per_rank) + 2 * (2 * 2 * tokens_per_rank)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_control_full_width_moe_moves_d_wide_rows(dispatcher):
    per_rank = run_distributed(_measure, 2, dispatcher, False)
    for hidden in per_rank:
        assert {shape[-1] for _, shape in hidden} == {D}
