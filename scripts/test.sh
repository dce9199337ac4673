#!/usr/bin/env bash
# Installs the runtime, test and compile-tool requirements (`scripts/setup.sh test`) and runs the
# default test suite: every test not marked `slow` or `full_compile`. Extra arguments go to
# pytest: a file, or `-m "slow and not full_compile"` for the minutes-long tests
# (`full_compile`: the 7B/8B compile proofs, 3-5 min each, `-m full_compile`).
#
# The tests run in pytest-xdist workers, a test module per worker at a time (`--dist loadscope`:
# a module's fixtures are built once; the Docker modules take turns, tests/conftest.py): one
# worker per core, at most one per 8 GiB of available memory (the SmolLM2 and two-process tests
# take 3-5 GiB each). BPO_TEST_WORKERS=N sets the count; 0 runs in this process (for a
# debugger, or `-x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
source scripts/_data_env.sh
workers="${BPO_TEST_WORKERS:-}"
if [[ -z "$workers" ]]; then
  avail_kb=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo 2>/dev/null || true)
  avail_kb=${avail_kb:-0}
  by_memory=$((avail_kb / (8 * 1024 * 1024)))
  cores=$(nproc)
  workers=$((by_memory < cores ? by_memory : cores))
  ((workers >= 1)) || workers=1
fi
parallel=()
if ((workers > 1)); then
  parallel=(-n "$workers" --dist loadscope)
fi
exec .venv/bin/python -m pytest ${parallel[@]+"${parallel[@]}"} "$@"
