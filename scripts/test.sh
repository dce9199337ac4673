#!/usr/bin/env bash
# Installs everything and runs the test suite. Extra arguments go to pytest
# (e.g. `-m "not slow"` for the quick suite, or a test file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/_data_env.sh
exec .venv/bin/python -m pytest "$@"
