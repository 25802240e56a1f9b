"""The README's "Using the block from Megatron-Core" snippet runs as printed (docs do not rot).

It is executed in a 1-process gloo world with Megatron's parallel state (what the README says it
needs); the model it builds must hold the README's Stable LatentMoE layers and the QB hook.
"""

import re
from pathlib import Path

from tests.parallel.launcher import run_distributed

README = Path(__file__).resolve().parents[2] / "README.md"


def _snippet() -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"## Using the block from Megatron-Core.*?```python\n(.*?)```", text, re.S)
    assert match, "README lost its usage snippet"
    return match.group(1)


def _run(rank, world_size, code):
    from megatron_latentmoe.compat import initialize_parallel_cpu
    from megatron_latentmoe.moe.balance_step import finalize_model_grads_with_quantile_balancing
    from megatron_latentmoe.moe.layer import StableLatentMoELayer
    from megatron_latentmoe.moe.router import QuantileBalancingRouter

    initialize_parallel_cpu()
    namespace = {}
    exec(compile(code, str(README), "exec"), namespace)
    model, config = namespace["model"], namespace["config"]
    layers = [m for m in model.modules() if isinstance(m, StableLatentMoELayer)]
    return dict(
        moe_layers=len(layers),
        qb_routers=sum(isinstance(layer.router, QuantileBalancingRouter) for layer in layers),
        latent=[layer.fc1_latent_proj.weight.shape for layer in layers][:1],
        hook=config.finalize_model_grads_func is finalize_model_grads_with_quantile_balancing,
    )


def test_readme_snippet_builds_the_model_it_describes():
    (out,) = run_distributed(_run, 1, _snippet(), timeout=600)
    # 4 layers, first_k_dense_replace=1 -> 3 MoE layers, each with the QB router, W_down 1024 -> 512
    assert out["moe_layers"] == 3 and out["qb_routers"] == 3
    assert tuple(out["latent"][0]) == (512, 1024)
    assert out["hook"]
