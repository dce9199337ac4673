# Sourced by the scripts: points ALFWORLD_DATA at ../shared/data/alfworld when it is unset and
# that folder exists (the layout of this project's CI); otherwise alfworld's own cache is used.
if [ -z "${ALFWORLD_DATA:-}" ] && [ -d "$(pwd)/../shared/data/alfworld/json_2.1.1" ]; then
  ALFWORLD_DATA="$(cd ../shared/data/alfworld && pwd)"
  export ALFWORLD_DATA
fi
