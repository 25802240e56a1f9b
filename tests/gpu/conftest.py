"""A 1-rank NCCL world with Megatron's parallel state, for the GPU tests (CUDA only)."""

import os
import tempfile

import pytest
import torch


@pytest.fixture(scope="module")
def megatron_world():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
