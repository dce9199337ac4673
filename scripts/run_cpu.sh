#!/usr/bin/env bash
# Installs the runtime requirements (scripts/setup.sh: no test or compile-tool extras) and runs the
# main job on the small CPU default (tiny policy, ALFWorld).
# Extra arguments are passed to bpo_jax.main (e.g. --config.train.iterations=2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/_data_env.sh
exec .venv/bin/python -m bpo_jax.main --config=experiments/alfworld.py:cpu \
  --workdir="${WORKDIR:-runs/alfworld_cpu}" "$@"
