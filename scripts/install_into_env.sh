#!/usr/bin/env bash
# Install megatron-latentmoe into an EXISTING CUDA Python environment (an NVIDIA PyTorch
# container with torch + Transformer Engine + apex, or your own CUDA env) without replacing its
# torch, Transformer Engine, apex, triton or NVIDIA libraries. (scripts/setup_env.sh makes a
# fresh venv instead, for CPU machines.)
#
#   bash scripts/install_into_env.sh            # editable install + megatron-core + [hf]
#
# Env: PYTHON (default python3); OFFLINE=1 (pip --no-index: only what is installed or on
# PYTHONPATH counts, as on the offline GPU machine of tools/gpu_checks.sh); DRY_RUN=1 (pip
# --dry-run: resolve and report, install nothing).
# Step 1 installs the package with --no-deps: NVIDIA's containers carry torch as e.g.
# "2.8.0a0+5228986c39", a pre-release that pyproject's "torch>=2.10" does not accept, so letting
# pip resolve torch would try to replace it. Step 2 installs the other dependencies under a
# constraint file that pins every torch / TE / apex / triton / nvidia-* package already there:
# pip then either keeps them or fails, never swaps them. Step 3 checks they did not change.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
opts=(--disable-pip-version-check)
[ "${OFFLINE:-0}" = 1 ] && opts+=(--no-index)
[ "${DRY_RUN:-0}" = 1 ] && opts+=(--dry-run)
pins="$(mktemp)"
trap 'rm -f "$pins"' EXIT
frozen() {
  "$py" -m pip list --format=freeze 2>/dev/null \
    | grep -iE '^(torch|transformer[-_]engine[-_a-z0-9]*|apex|triton|nvidia-[-_a-z0-9]+)==' || true
}
frozen > "$pins"
echo "keeping (pinned): $(tr '\n' ' ' < "$pins")"
"$py" -m pip install "${opts[@]}" --no-deps --no-build-isolation -e "$repo"
# pyproject.toml's requirements (torch aside) and its [hf] extra, read from it, not restated here.
core="$("$py" "$repo/scripts/pyproject_requirements.py" megatron-core)"
rest="$("$py" "$repo/scripts/pyproject_requirements.py" runtime hf)"
mapfile -t reqs <<< "$core"$'\n'"$rest"
"$py" -m pip install "${opts[@]}" --constraint "$pins" "${reqs[@]}"
if ! diff <(frozen) "$pins" >/dev/null; then
  echo "ERROR: the environment's torch / TE / NVIDIA packages changed:" >&2
  diff <(frozen) "$pins" >&2 || true
  exit 1
fi
[ "${DRY_RUN:-0}" = 1 ] && { echo "dry run: nothing installed"; exit 0; }
"$py" - <<'PY'
import torch, megatron.core, megatron_latentmoe
try:
    import transformer_engine as te
    te_version = te.__version__
except ImportError:
    te_version = "not installed (the local spec only)"
print(f"megatron-latentmoe from {megatron_latentmoe.__file__}; torch {torch.__version__}, "
      f"megatron-core {megatron.core.__version__}, Transformer Engine {te_version}")
PY
