#!/usr/bin/env bash
# Creates .venv and installs what a command needs, one level at a time:
#   bash scripts/setup.sh              runtime: requirements.txt (the main job; no torch, no libtpu)
#   bash scripts/setup.sh tpu-compile  + requirements-tpu-compile.txt (python -m bpo_jax.compile)
#   bash scripts/setup.sh test         + requirements-dev.txt and the tpu-compile extra (the tests)
# Idempotent: a level reinstalls only when one of its files changed (a stamp per level in .venv).
# Prints one line per stage and, at the end, the versions installed.
set -euo pipefail
cd "$(dirname "$0")/.."
level="${1:-runtime}"
files_of() {  # The requirements files of a level.
  case "$1" in
    runtime) echo requirements.txt requirements-nodeps.txt ;;
    tpu-compile) echo requirements.txt requirements-nodeps.txt requirements-tpu-compile.txt ;;
    test) echo requirements.txt requirements-nodeps.txt requirements-dev.txt \
      requirements-tpu-compile.txt ;;
    *) return 1 ;;
  esac
}
if ! files_of "$level" >/dev/null; then
  echo "setup: unknown level '$level'; use runtime (default), tpu-compile or test." >&2
  exit 2
fi
read -r -a files <<<"$(files_of "$level")"
# The levels a level's install includes: their stamps are written with its own.
case "$level" in
  runtime) covers=(runtime) ;;
  tpu-compile) covers=(runtime tpu-compile) ;;
  test) covers=(runtime tpu-compile test) ;;
esac
stamp_of() {  # The hash of a level's files and pyproject.toml: its stamp once installed.
  local f
  read -r -a f <<<"$(files_of "$1")"
  cat "${f[@]}" pyproject.toml | sha256sum | cut -d' ' -f1
}
PY="${PYTHON:-python3}"
say() { echo "setup: $* [${SECONDS}s]"; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv ($("$PY" --version))"
  "$PY" -m venv .venv
fi
stamp=".venv/.requirements-$level.sha256"
if [ "$(cat "$stamp" 2>/dev/null)" != "$(stamp_of "$level")" ]; then
  say "upgrading pip"
  .venv/bin/python -m pip install --quiet --upgrade pip
  say "installing ${files[*]} (level $level; a fresh runtime install takes minutes)"
  reqs=()
  for f in "${files[@]}"; do [ "$f" = requirements-nodeps.txt ] || reqs+=(-r "$f"); done
  .venv/bin/python -m pip install --quiet "${reqs[@]}"
  say "installing requirements-nodeps.txt without their dependencies"
  .venv/bin/python -m pip install --quiet --no-deps -r requirements-nodeps.txt
  say "installing bpo_jax itself (editable)"
  # Its build backend's notes (setuptools' editable-install banner) only when it fails.
  if ! log=$(.venv/bin/python -m pip install --quiet --no-deps -e . 2>&1); then
    echo "$log" >&2
    exit 1
  fi
  for c in "${covers[@]}"; do stamp_of "$c" > ".venv/.requirements-$c.sha256"; done
  say "installed level $level; .venv is $(du -sh .venv | cut -f1)"
else
  say "level $level up to date (its requirements unchanged since it was installed)"
fi
# The versions in .venv, read from package metadata (importing jax would cost seconds).
.venv/bin/python - "$level" <<'EOF'
import importlib.metadata as md
import platform
import sys

names = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "alfworld", "textworld"]
extras = {"test": ["pytest", "torch", "transformers", "ruff"], "tpu-compile": ["libtpu"]}
found, absent = [f"python {platform.python_version()}"], []
for name in names + [n for ns in extras.values() for n in ns]:
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        absent.append(name)
print(f"setup: .venv ready ({sys.argv[1]}): {', '.join(found)}")
if absent:
    print(f"setup: not installed: {', '.join(absent)} (bash scripts/setup.sh test adds them)")
EOF
