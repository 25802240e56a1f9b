#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv and install everything the project needs.
# Usage: bash scripts/setup_env.sh        (prints the python path of the venv on the last line)
# Env: VENV (default: <repo>/.venv), PYTHON (default: python3).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$repo/.venv}"
py="${PYTHON:-python3}"
stamp="$venv/.megatron-latentmoe-installed"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"
want="$(sha256sum "$repo/pyproject.toml" "$repo"/scripts/{setup_env.sh,pyproject_requirements.py} | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip=("$vpy" -m pip install --disable-pip-version-check -q)
  # CPU torch from the local wheel; never let pip resolve an unpinned torch (multi-GB CUDA build).
  if ! "$vpy" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      torch_req="$("$vpy" "$repo/scripts/pyproject_requirements.py" torch)"
      "${pip[@]}" "$torch_req"
    else
      "${pip[@]}" torch==2.13.0
      # Without a CPU-only wheel for this Python among pip's indexes, torch==2.13.0 is PyPI's
      # Linux wheel, which carries ~2.7 GB of CUDA libraries; it runs on a CPU as it is.
      cuda_torch="$("$vpy" -W ignore -c "import torch; print(torch.__version__ if torch.version.cuda else '')")"
      [ -z "$cuda_torch" ] || echo "setup_env: pip chose torch $cuda_torch with CUDA libraries (no CPU-only wheel for this Python on pip's indexes); it runs on the CPU as it is. For a CPU-only venv, remove $venv and rerun with PIP_EXTRA_INDEX_URL set to PyTorch's CPU wheel index." >&2
    fi
  fi
  # megatron-core (pyproject's pin) declares Python>=3.12 but runs on 3.11 (see
  # ../shared/MEGATRON_ON_CPU.md).
  core_req="$("$vpy" "$repo/scripts/pyproject_requirements.py" megatron-core)"
  "${pip[@]}" --no-deps --ignore-requires-python "$core_req"
  extras="hf,plot,test,train"
  "$vpy" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || extras="$extras,cpu"
  "${pip[@]}" -e "${repo}[$extras]"
  echo "$want" > "$stamp"
fi
echo "$vpy"
