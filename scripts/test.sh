#!/usr/bin/env bash
# Installs everything and runs the default test suite (every test not marked `slow` or
# `full_compile`). Extra arguments go to pytest: `-m slow` for the minutes-long tests, a file.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/_data_env.sh
exec .venv/bin/python -m pytest "$@"
