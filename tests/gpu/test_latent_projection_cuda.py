"""The local spec's latent projections on CUDA are initialized on the GPU from Megatron's
data-parallel RNG stream, as its TELinear's duplicated weights are: the same values on every
tensor-parallel rank whatever the CPU RNG did. Allocated on the CPU (before), the init drew from
the CPU RNG, which the tracker's fork does not swap on CUDA. CPU twin: the TP2 runs of
``tests/parallel`` (equal to one rank), where the tracker is the CPU RNG's.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_latent_projection_is_drawn_on_the_gpu_from_the_data_parallel_stream(megatron_world):
    from megatron.core import tensor_parallel

    from megatron_latentmoe.config import tiny_config
    from megatron_latentmoe.moe.latent_projection import LatentProjection

    cfg = tiny_config(use_cpu_initialization=False)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()

    def build(cpu_seed: int) -> torch.Tensor:
        tracker.set_states(states)
        torch.manual_seed(cpu_seed)
        cpu_rng = torch.get_rng_state()
        proj = LatentProjection(64, 32, config=cfg, init_method=torch.nn.init.normal_)
        assert torch.equal(torch.get_rng_state(), cpu_rng)  # the CPU RNG is not drawn from
        return proj.weight.detach()

    first, second = build(1), build(2)
    assert first.device.type == "cuda" and first.std() > 0
    assert torch.equal(first, second)  # the data-parallel stream's values, not the CPU RNG's
