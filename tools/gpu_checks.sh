#!/usr/bin/env bash
# One prepared script for a lent GPU machine (< 8 min): the TE / FP8 / CUDA tests and the GPU
# benchmarks. Writes logs and JSON to ${OUT:-runs/gpu_checks}.
# Usage: bash tools/gpu_checks.sh
# The lent H200 image has torch/transformers/safetensors but neither megatron-core nor
# Transformer Engine, and reaches no registry: carry them as wheels in .whl/ (ignored by git),
# e.g. `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2` plus TE's wheels for the image's CUDA;
# this script installs whatever .whl/ holds. Without TE the tests/gpu checks skip with a reason.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$repo/runs/gpu_checks}"
mkdir -p "$out"
cd "$repo"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 NO_VCS_VERSION=1 CUDA_DEVICE_MAX_CONNECTIONS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"  # the project itself, without a build step
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
"$py" -c "import megatron.core as m; print('megatron-core', m.__version__)" | tee -a "$out/gpu.txt"
"$py" -c "import transformer_engine as te; print('TE', te.__version__)" 2>&1 | tail -1 | tee -a "$out/gpu.txt"
status=0
timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_situ.py \
  tests/unit/test_block_vs_reference.py 2>&1 | tee "$out/pytest.log" || status=1
timeout 90 "$py" benchmarks/bench_block.py --dtype bf16 --tokens 16384 --hidden 2048 \
  --latent 1024 --expert-ffn 768 --experts 64 --topk 8 --shared-ffn 1536 \
  --out "$out/bench_block_gpu.json" 2>&1 | tee "$out/bench_block.log" || status=1
timeout 60 "$py" benchmarks/bench_situ.py --out "$out/bench_situ_gpu.json" 2>&1 \
  | tee "$out/bench_situ.log" || status=1
exit $status
