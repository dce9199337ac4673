# Sourced by the scripts: points ALFWORLD_DATA at ../shared/data/alfworld when it is unset and
# that folder exists (the layout of this project's CI); otherwise alfworld's own cache is used.
if [ -z "${ALFWORLD_DATA:-}" ] && [ -d "$(pwd)/../shared/data/alfworld/json_2.1.1" ]; then
  ALFWORLD_DATA="$(cd ../shared/data/alfworld && pwd)"
  export ALFWORLD_DATA
fi
# WebShop's files: ../shared/data/webshop likewise (the CPU variant itself uses the fixture catalog).
if [ -z "${WEBSHOP_DATA:-}" ] && [ -d "$(pwd)/../shared/data/webshop" ]; then
  WEBSHOP_DATA="$(cd ../shared/data/webshop && pwd)"
  export WEBSHOP_DATA
fi
