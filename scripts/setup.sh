#!/usr/bin/env bash
# Creates .venv and installs the project with its runtime and test requirements.
# Idempotent: reinstalls only when a requirements file changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(cat requirements.txt requirements-dev.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  # torch==2.13.0 (CPU) is pinned in requirements-dev.txt; an unpinned torch pulls a CUDA build.
  .venv/bin/python -m pip install --quiet -r requirements.txt -r requirements-dev.txt
  .venv/bin/python -m pip install --quiet --no-deps -e .
  echo "$want" > "$stamp"
fi
echo "setup: .venv ready ($(.venv/bin/python -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__)'))"
