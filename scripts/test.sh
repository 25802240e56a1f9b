#!/usr/bin/env bash
# Set up (or reuse) the virtualenv and run the whole test suite: the README's test command.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/unit -x`; `-n 0`: one process).
# Two pytest-xdist workers: the tests run with one torch thread each (bit-reproducible), and the
# single-process ones otherwise leave a core idle (tests/conftest.py groups the files).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$(bash "$repo/scripts/setup_env.sh" | tail -n 1)"
cd "$repo"
# torchao is the MXFP4 tests' bit-exact reference. It lives outside site-packages, on the tests'
# PYTHONPATH only: installed in the venv, transformers imports it on every model load (its
# quantizer registry), and it prints failed CUDA-kernel loads and torch deprecation warnings into
# the main job's export and generation output.
ao="$(dirname "$(dirname "$vpy")")/test-only"
if ! PYTHONPATH="$ao" "$vpy" -c "import importlib.metadata as m, sys; sys.exit(m.version('torchao') != '0.18.0')" 2>/dev/null; then
  "$vpy" -m pip install --disable-pip-version-check -q --no-deps --upgrade --target "$ao" torchao==0.18.0
fi
export PYTHONPATH="$ao${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
# Lint and format first (a second each): the style is part of the test.
"$vpy" -m ruff check -q .
"$vpy" -m ruff format --check -q .
# The shell scripts: shellcheck's errors and warnings (the args files are sourced: see their
# directives).
"$(dirname "$vpy")/shellcheck" -x --severity=warning \
  .ci/run examples/*.sh examples/*.sbatch examples/args/*.sh scripts/*.sh tools/*.sh
exec "$vpy" -m pytest -q -p no:cacheprovider -n 2 "${@:-tests}"
