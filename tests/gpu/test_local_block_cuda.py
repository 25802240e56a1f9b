"""The local (pure PyTorch) spec on CUDA == the reference block on the CPU (SPEC §1-§3).

CUDA twin of ``tests/unit/test_block_vs_reference.py``: the same cases, the Megatron layer on
the GPU in fp32 (TF32 off) with NCCL, Megatron's CUDA RNG tracker and the dispatchers' CUDA
paths; output, input gradient and every parameter gradient within 1e-5 of the largest reference
value. Needs CUDA only (no Transformer Engine); skipped on CPU, where the twin runs.
"""

import pytest
import torch

from tests.unit.test_block_vs_reference import CASES, TOL, compare_with_reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report(megatron_world):
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return compare_with_reference(CASES, device="cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


@pytest.mark.parametrize("case", sorted(CASES))
def test_local_spec_on_cuda_equals_reference(report, case):
    r = report[case]
    print(case, r)
    assert r["out"] < TOL and r["dx"] < TOL and r["params"] < TOL, r
    assert r["bias_changed_selection"], "the bias should change some selections in this test"
