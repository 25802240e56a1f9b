#!/usr/bin/env bash
# One prepared script for a lent GPU machine (< 8 min): the TE / FP8 / CUDA tests and the GPU
# benchmarks. Writes logs and JSON to ${OUT:-runs/gpu_checks}.
# Usage: bash tools/gpu_checks.sh
# The lent H200 image (torch 2.11 + CUDA 13, Python 3.12) has neither megatron-core nor
# Transformer Engine and reaches no registry. megatron-core travels as a wheel (2.3 MB):
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#     --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2
# and `carry: [".whl"]`; this script installs whatever .whl/ holds. TE does not fit (measured
# 2026-11-30, TE 2.20.2): transformer_engine_cu13 is a 276 MB wheel (262 MB under zstd -19)
# against the 64 MiB a call may carry, and transformer_engine_torch exists only as an sdist that
# must be compiled against the image's torch with nvcc. Without TE the tests/gpu checks skip with
# a reason and the rest (the CUDA tests without TE, the CUDA bf16 benchmarks) still runs.
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
# tests/gpu: the local spec on CUDA == the reference, verify on CUDA, TE spec == local, FP8.
# (The CPU suite is CI's job: with CUDA visible, Megatron takes its CUDA paths, not the CPU shims.)
timeout 300 "$py" -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$out/pytest.log" || status=1
timeout 90 "$py" benchmarks/bench_block.py --dtype bf16 --tokens 16384 --hidden 2048 \
  --latent 1024 --expert-ffn 768 --experts 64 --topk 8 --shared-ffn 1536 \
  --out "$out/bench_block_gpu.json" 2>&1 | tee "$out/bench_block.log" || status=1
timeout 60 "$py" benchmarks/bench_situ.py --out "$out/bench_situ_gpu.json" 2>&1 \
  | tee "$out/bench_situ.log" || status=1
exit $status
