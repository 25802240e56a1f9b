"""The converter's ``verify`` on a GPU host: the Megatron model runs on CUDA (SPEC §6).

Megatron's router moves its weight to the current CUDA device whenever CUDA is present, so on a
GPU host the verifying forward must run there. A real ``torch_dist`` checkpoint of the converter
tests' model is saved from a 1-rank NCCL world, exported to HF, and verified: the CUDA Megatron
logits match the CPU HF logits within the verify tolerance and greedy generation is identical.
CUDA only (no TE); skipped on CPU, where ``tests/convert`` verifies the same model on the CPU.
"""

import pytest

pytestmark = pytest.mark.gpu


def test_verify_runs_megatron_on_cuda(megatron_world, tmp_path):
    from megatron_latentmoe.convert import export_checkpoint
    from megatron_latentmoe.convert.verify import verify_export
    from megatron_latentmoe.moe.router import megatron_device
    from tests.convert import _workers

    arch = _workers.arch()
    model = _workers._build(arch)
    _workers._randomise(model, _workers.SEED)
    checkpoint, hf_dir = tmp_path / "ck", tmp_path / "hf"
    _workers._save(model.cuda(), arch, str(checkpoint))
    export_checkpoint(checkpoint, hf_dir, progress=False)
    report = verify_export(checkpoint, hf_dir)
    print(report.format())
    assert megatron_device().type == "cuda"
    assert report.passed, report.format()
    assert report.cosine > 0.9999
