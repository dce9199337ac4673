#!/usr/bin/env bash
# Installs the runtime, test and compile-tool requirements (`scripts/setup.sh test`) and runs the
# default test suite: every test not marked `slow` or `full_compile`. Extra arguments go to
# pytest: a file, or `-m "slow and not full_compile"` for the minutes-long tests
# (`full_compile`: the 7B/8B compile proofs, 3-5 min each, `-m full_compile`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
source scripts/_data_env.sh
exec .venv/bin/python -m pytest "$@"
