#!/usr/bin/env bash
# Pretrain Stable LatentMoE on ONE machine with torchrun.
#
#   bash examples/run_torchrun.sh ARGS_FILE [extra Megatron / Stable LatentMoE flags...]
#   bash examples/run_torchrun.sh examples/args/tiny.sh --train-iters 50 --save runs/tiny --save-interval 50
#
# ARGS_FILE is a bash file that defines the array ARGS (examples/args/*.sh); extra flags are
# appended (argparse: the last occurrence of a flag wins).
# With a CUDA GPU: one process per GPU, NCCL, Transformer Engine spec when TE is installed.
# Without: NPROC processes (default 2) on CPU with gloo and the local spec, 1 thread each.
# The flags are checked once before the ranks start (bad flag: one line, exit 2).
# Env: NPROC (processes), PYTHON (default: the repo's .venv python, else python3).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "usage: $0 ARGS_FILE [extra flags...]   (ARGS_FILE: e.g. examples/args/tiny.sh)" >&2
  exit 2
fi
args_file="$1"; shift
if [ -n "${NPROC:-}" ] && ! { [[ "$NPROC" =~ ^[0-9]+$ ]] && ((10#$NPROC > 0)); }; then
  echo "$0: error: NPROC=$NPROC is not allowed: a positive integer (processes to launch)" >&2
  exit 2
fi
# shellcheck disable=SC1090
source "$args_file"
if ! declare -p ARGS >/dev/null 2>&1; then
  echo "$0: error: ARGS_FILE=$args_file defines no ARGS array (see examples/args/tiny.sh)" >&2
  exit 2
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then PYTHON="$repo/.venv/bin/python"; else PYTHON=python3; fi
fi
gpus="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "$gpus" -gt 0 ]; then
  nproc="${NPROC:-$gpus}"
  echo "[run_torchrun] $nproc process(es) on $gpus GPU(s), NCCL" >&2
else
  nproc="${NPROC:-2}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  echo "[run_torchrun] no GPU: $nproc CPU process(es), gloo, $OMP_NUM_THREADS thread(s) each" >&2
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron: needed for TP/SP comm ordering on GPUs
export NO_VCS_VERSION=1                # megatron.core.package_info: skip `git rev-parse`
export PYTHONUNBUFFERED=1
# Check the flags once, before spawning ranks: a bad flag is one line on stderr and exit 2
# (rather than one error per rank and torchrun's ChildFailedError traceback). Its stdout (the
# argument table, notes, warnings) is dropped: rank 0 prints the same once the run starts.
WORLD_SIZE="$nproc" RANK=0 LOCAL_RANK=0 \
  "$PYTHON" "$repo/examples/pretrain_stable_latentmoe.py" --check-flags "${ARGS[@]}" "$@" >/dev/null || exit $?
# torchrun through launch.py: a rank's refusal ends in one line, not torchrun's traceback
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m megatron_latentmoe.training.launch --standalone --nproc-per-node "$nproc" \
  "$repo/examples/pretrain_stable_latentmoe.py" "${ARGS[@]}" "$@"
