#!/usr/bin/env bash
# Set up (or reuse) the virtualenv and run the whole test suite: the README's test command.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/unit -x`).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vpy="$(bash "$repo/scripts/setup_env.sh" | tail -n 1)"
cd "$repo"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
# Lint and format first (a second each): the style is part of the test.
"$vpy" -m ruff check -q .
"$vpy" -m ruff format --check -q .
exec "$vpy" -m pytest -q -p no:cacheprovider "${@:-tests}"
