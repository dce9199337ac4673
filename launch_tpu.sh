#!/usr/bin/env bash
# Runs bpo_jax on a Cloud TPU VM slice: one process per worker, JAX's distributed runtime
# (`--multihost`) connecting them.
#
# Usage: ./launch_tpu.sh --name NAME --zone ZONE [--project P] [--dry-run] COMMAND [options]
#   create  --accelerator-type T [--version RUNTIME] [--spot | --preemptible]
#           create the slice, or reuse it when it exists (T as gcloud names it: v5p-64,
#           v5litepod-64, v4-32, v6e-64; RUNTIME defaults to the TPU family's VM image)
#   setup   [--jax-version V]
#           ship the repo at HEAD (a git bundle: uncommitted changes are not shipped) to every
#           worker, check it out into ~/bpo_jax/releases/<sha>, run scripts/setup.sh and install
#           jax[tpu]==V (V defaults to the jax version requirements.txt names)
#   run     [--run-id ID] [--release REV] [--env KEY=VALUE]... [--wait S] -- TRAINING FLAGS
#           start `python -m bpo_jax.main --multihost TRAINING FLAGS` on every worker, in the
#           release of REV (default HEAD), logging to ~/bpo_jax/runs/<ID>/host<k>.log; KEY=VALUE
#           is exported on every worker (ALFWORLD_DATA, WEBSHOP_DATA, ...); after S seconds
#           (default 15) reports each host running or died, and exits 1 unless all are running
#   logs    [--run-id ID] [--worker K|all] [--lines N] [--follow]   (default: worker 0)
#   status  [--run-id ID]       per host: running, finished, died or stopped (exit 1 unless all run)
#   stop    [--run-id ID]       end the run's processes on every worker
#   delete  [--yes]             delete the slice (asks first unless --yes)
# ID defaults to the last run started. --dry-run prints every gcloud command, quoted so it can be
# pasted, and runs none. Nothing on the workers is ever deleted, except by `delete`.
# Example:
#   ./launch_tpu.sh --name bpo --zone us-east5-a create --accelerator-type v5p-64 --spot
#   ./launch_tpu.sh --name bpo --zone us-east5-a setup
#   ./launch_tpu.sh --name bpo --zone us-east5-a run --env ALFWORLD_DATA=/mnt/data/alfworld -- \
#     --config=experiments/alfworld.py --config.model.hf_checkpoint=/mnt/ckpt/Qwen2.5-7B-Instruct \
#     --workdir=gs://bucket/alfworld_bpo
set -euo pipefail

PROG=launch_tpu.sh
COMMANDS="create setup run logs status stop delete"
HERE=$(cd "$(dirname "$0")" && pwd)

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
usage_error() {
  echo "$PROG: error: $*" >&2
  echo "Run './$PROG --help' for the usage." >&2
  exit 2
}
fail() {
  echo "$PROG: error: $*" >&2
  exit 1
}

# ---- argument parsing -------------------------------------------------------------------------
DRY_RUN=0 NAME="" ZONE="" PROJECT="" COMMAND=""
ACCEL="" RUNTIME="" SPOT=0 PREEMPTIBLE=0 JAX_VERSION=""
RUN_ID="" RELEASE="" WAIT_S=15 WORKER=0 LINES=50 FOLLOW=0 YES=0
ENVS=() TRAIN_ARGS=() HAVE_DASHDASH=0 SEEN=()

# Which command owns each command-specific option (global ones are valid everywhere).
owner_of() {
  case "$1" in
    --accelerator-type | --version | --spot | --preemptible) echo create ;;
    --jax-version) echo setup ;;
    --release | --env | --wait) echo run ;;
    --run-id) echo "run logs status stop" ;;
    --worker | --lines | --follow) echo logs ;;
    --yes) echo delete ;;
  esac
}

looks_like_training_flag() {
  case "$1" in
    --config | --config=* | --config.* | --workdir | --workdir=* | --multihost | --nomultihost | \
      --coordinator_address* | --num_processes* | --process_id*) return 0 ;;
  esac
  return 1
}

while [ $# -gt 0 ]; do
  arg=$1
  shift
  if [ "$arg" = "--" ]; then
    HAVE_DASHDASH=1
    TRAIN_ARGS=("$@")
    break
  fi
  opt=${arg%%=*} inline=0 val=""
  if [[ "$arg" == --*=* ]]; then inline=1 val=${arg#*=}; fi
  case "$opt" in
    -h | --help) usage; exit 0 ;;
    --dry-run | --spot | --preemptible | --follow | --yes)
      [ "$inline" = 0 ] || usage_error "$opt takes no value (got '$arg')"
      case "$opt" in
        --dry-run) DRY_RUN=1 ;;
        --spot) SPOT=1 ;;
        --preemptible) PREEMPTIBLE=1 ;;
        --follow) FOLLOW=1 ;;
        --yes) YES=1 ;;
      esac
      SEEN+=("$opt")
      ;;
    --name | --zone | --project | --accelerator-type | --version | --jax-version | --run-id | \
      --release | --env | --wait | --worker | --lines)
      if [ "$inline" = 0 ]; then
        if [ $# -eq 0 ] || [ "$1" = "--" ]; then usage_error "$opt needs a value"; fi
        val=$1
        shift
      fi
      [ -n "$val" ] || usage_error "$opt needs a value"
      case "$opt" in
        --name) NAME=$val ;;
        --zone) ZONE=$val ;;
        --project) PROJECT=$val ;;
        --accelerator-type) ACCEL=$val ;;
        --version) RUNTIME=$val ;;
        --jax-version) JAX_VERSION=$val ;;
        --run-id) RUN_ID=$val ;;
        --release) RELEASE=$val ;;
        --env) ENVS+=("$val") ;;
        --wait) WAIT_S=$val ;;
        --worker) WORKER=$val ;;
        --lines) LINES=$val ;;
      esac
      SEEN+=("$opt")
      ;;
    -*)
      if looks_like_training_flag "$arg"; then
        usage_error "'$arg' looks like a training flag: put training flags after '--'," \
          "e.g. ./$PROG --name N --zone Z run -- $arg"
      fi
      usage_error "unknown option '$arg'${COMMAND:+ for $COMMAND}"
      ;;
    *)
      if [ -n "$COMMAND" ]; then
        usage_error "unexpected argument '$arg' after command '$COMMAND'" \
          "(training flags go after '--')"
      fi
      case " $COMMANDS " in
        *" $arg "*) COMMAND=$arg ;;
        *)
          usage_error "unknown command '$arg' (expected one of: $COMMANDS);" \
            "the old form './$PROG NAME ZONE -- FLAGS' is now" \
            "'./$PROG --name NAME --zone ZONE run -- FLAGS'"
          ;;
      esac
      ;;
  esac
done

[ -n "$COMMAND" ] || usage_error "missing command (one of: $COMMANDS)"
for opt in ${SEEN[@]+"${SEEN[@]}"}; do
  owners=$(owner_of "$opt")
  if [ -n "$owners" ] && [[ " $owners " != *" $COMMAND "* ]]; then
    usage_error "$opt is an option of '${owners// /, }', not of '$COMMAND'"
  fi
done
[ -n "$NAME" ] || usage_error "missing --name (the TPU slice's name)"
[ -n "$ZONE" ] || usage_error "missing --zone (the slice's zone, e.g. us-east5-a)"
[[ "$NAME" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
  usage_error "--name '$NAME' is not a valid TPU name (lowercase letters, digits, '-')"
if [ "$HAVE_DASHDASH" = 1 ] && [ "$COMMAND" != run ]; then
  usage_error "training flags after '--' are only for 'run', not '$COMMAND'"
fi

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
if [ -n "$RUN_ID" ] && { ! [[ "$RUN_ID" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || [ "$RUN_ID" = LATEST ]; }; then
  usage_error "--run-id '$RUN_ID' must be letters, digits, '.', '_' or '-' (no '/'), not LATEST"
fi
case "$COMMAND" in
  create)
    [ -n "$ACCEL" ] || usage_error "create needs --accelerator-type (e.g. v5p-64, v5litepod-64, v4-32, v6e-64)"
    [[ "$ACCEL" =~ ^v[0-9]+[a-z]*-[0-9]+$ ]] ||
      usage_error "--accelerator-type '$ACCEL' is not a TPU type as gcloud names it (e.g. v5p-64)"
    [ "$SPOT" = 0 ] || [ "$PREEMPTIBLE" = 0 ] || usage_error "choose one of --spot and --preemptible"
    if [ -z "$RUNTIME" ]; then
      # The TPU VM images Google documents per family.
      case "$ACCEL" in
        v2-* | v3-* | v4-*) RUNTIME=tpu-ubuntu2204-base ;;
        v5litepod-* | v5e-*) RUNTIME=v2-alpha-tpuv5-lite ;;
        v5p-*) RUNTIME=v2-alpha-tpuv5 ;;
        v6e-*) RUNTIME=v2-alpha-tpuv6e ;;
        *) usage_error "no default runtime for '$ACCEL': pass --version (the TPU VM image)" ;;
      esac
    fi
    ;;
  run)
    if [ "$HAVE_DASHDASH" = 0 ] || [ ${#TRAIN_ARGS[@]} -eq 0 ]; then
      usage_error "run needs training flags after '--'," \
        "e.g. run -- --config=experiments/alfworld.py --workdir=gs://bucket/run1"
    fi
    is_uint "$WAIT_S" || usage_error "--wait must be a whole number of seconds, got '$WAIT_S'"
    for kv in ${ENVS[@]+"${ENVS[@]}"}; do
      [[ "$kv" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] ||
        usage_error "--env needs KEY=VALUE with KEY a shell variable name, got '$kv'"
    done
    ;;
  logs)
    [ "$WORKER" = all ] || is_uint "$WORKER" || usage_error "--worker must be a number or 'all', got '$WORKER'"
    if ! is_uint "$LINES" || [ "$LINES" -eq 0 ]; then
      usage_error "--lines must be a positive number, got '$LINES'"
    fi
    ;;
esac

# ---- gcloud -----------------------------------------------------------------------------------
LOC=(--zone="$ZONE")
[ -z "$PROJECT" ] || LOC+=(--project="$PROJECT")

# show ARGS...: the command line, each word quoted for a POSIX shell only where it needs it.
show() {
  local out="" w
  for w in "$@"; do
    if [[ "$w" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
      out+=" $w"
    else
      out+=" '${w//\'/\'\\\'\'}'"
    fi
  done
  printf '%s\n' "${out# }"
}
# run_cmd CMD...: prints it (stdout in a dry run, stderr with '+' otherwise) and runs it unless dry.
run_cmd() {
  if [ "$DRY_RUN" = 1 ]; then
    show "$@"
    return 0
  fi
  echo "+ $(show "$@")" >&2
  "$@"
}
note() { if [ "$DRY_RUN" = 1 ]; then echo "# $*"; else echo "$PROG: $*" >&2; fi; }

# describe: sets STATE, TYPE and WORKERS; returns 1 when the slice does not exist; fails on other
# errors (auth, API, quota), so that `create` never guesses.
describe() {
  local out err rc=0
  local cmd=(gcloud compute tpus tpu-vm describe "$NAME" "${LOC[@]}"
    "--format=value(state,acceleratorType,networkEndpoints.len())")
  if [ "$DRY_RUN" = 1 ]; then
    show "${cmd[@]}"
    STATE=READY TYPE=$ACCEL WORKERS=""
    return 0
  fi
  err=$(mktemp)
  out=$("${cmd[@]}" 2>"$err") || rc=$?
  if [ "$rc" != 0 ]; then
    if grep -qiE 'not.?found' "$err"; then
      rm -f "$err"
      return 1
    fi
    cat "$err" >&2
    rm -f "$err"
    fail "could not describe slice '$NAME' in $ZONE (gcloud exit $rc; see above)"
  fi
  rm -f "$err"
  IFS=$'\t' read -r STATE TYPE WORKERS <<<"$out" || true
  TYPE=${TYPE##*/}
}

require_ready() {
  if ! describe; then
    fail "slice '$NAME' not found in $ZONE${PROJECT:+ (project $PROJECT)}:" \
      "create it with ./$PROG --name $NAME --zone $ZONE create --accelerator-type TYPE"
  fi
  [ "$STATE" = READY ] || fail "slice '$NAME' is $STATE, not READY" \
    "(PREEMPTED or TERMINATED: delete it and create it again)"
}

ssh_all() {  # ssh_all WORKER COMMAND
  run_cmd gcloud compute tpus tpu-vm ssh "$NAME" "${LOC[@]}" --worker="$1" --command="$2"
}

# check_running FILE WHAT RC: 0 when FILE holds one "host<k>: running" line per worker and RC is 0.
check_running() {
  local file=$1 what=$2 n
  n=$(grep -cE '^host[^:]*: running' "$file" || true)
  if [ -n "$WORKERS" ] && [ "$n" = "$WORKERS" ] && [ "$3" = 0 ]; then
    echo "$PROG: $what: all $n hosts running"
    return 0
  fi
  echo "$PROG: $what: $n of ${WORKERS:-?} hosts running" \
    "(gcloud exit $3); the others did not start, died or did not answer (lines above)" >&2
  return 1
}

repo_sha() {  # repo_sha REV: the full commit id of REV in this repository
  git -C "$HERE" rev-parse --verify --quiet "$1^{commit}" ||
    fail "'$1' is not a commit of $HERE"
}

jax_pin() {  # the version requirements.txt names for jax (its == or lower >= bound)
  local line
  line=$(grep -E '^jax[[:space:]]*(==|>=|~=)' "$HERE/requirements.txt" | head -n1) ||
    fail "requirements.txt names no jax version: pass --jax-version"
  [[ "$line" =~ (==|>=|~=)[[:space:]]*([0-9][0-9.]*) ]] ||
    fail "cannot read the jax version from '$line': pass --jax-version"
  echo "${BASH_REMATCH[2]}"
}

# ---- commands -----------------------------------------------------------------------------------
# worker_cmd RELEASE WHY ARGS...: the remote command running scripts/tpu_worker.sh ARGS from
# ~/bpo_jax/RELEASE, or failing with one status line saying WHY when that release is not there.
# shellcheck disable=SC2016  # $w and $(hostname) are for the worker's shell to expand.
worker_cmd() {
  local w="\$HOME/bpo_jax/$1/scripts/tpu_worker.sh" why=$2
  shift 2
  printf '%s\n' "w=$w" 'if [ ! -f "$w" ]; then' \
    "  echo \"host-\$(hostname): failed: $why (run: ./$PROG setup)\"" '  exit 3' 'fi'
  printf 'bash "$w"'
  printf ' %q' "$@"
}

cmd_create() {
  if describe; then
    if [ "$DRY_RUN" = 1 ]; then
      note "if the slice does not exist:"
    else
      [ "$TYPE" = "$ACCEL" ] || fail "slice '$NAME' exists as $TYPE, not $ACCEL:" \
        "delete it first, or choose another --name"
      [ "$STATE" = READY ] || fail "slice '$NAME' exists but is $STATE, not READY" \
        "(PREEMPTED or TERMINATED: delete it and create it again)"
      note "reusing slice '$NAME' ($TYPE, $STATE, ${WORKERS:-?} workers)"
      return 0
    fi
  fi
  local cmd=(gcloud compute tpus tpu-vm create "$NAME" "${LOC[@]}" --accelerator-type="$ACCEL"
    --version="$RUNTIME")
  [ "$SPOT" = 0 ] || cmd+=(--spot)
  [ "$PREEMPTIBLE" = 0 ] || cmd+=(--preemptible)
  run_cmd "${cmd[@]}"
}

cmd_setup() {
  local sha version bundle remote
  sha=$(repo_sha HEAD)
  version=${JAX_VERSION:-$(jax_pin)}
  if [ -n "$(git -C "$HERE" status --porcelain --untracked-files=no)" ]; then
    echo "$PROG: warning: uncommitted changes are not shipped; setting up HEAD ${sha:0:12}" >&2
  fi
  require_ready
  if [ "$DRY_RUN" = 1 ]; then
    bundle="${TMPDIR:-/tmp}/bpo_jax-$sha.bundle"
  else
    BUNDLE_DIR=$(mktemp -d)
    trap 'rm -rf "$BUNDLE_DIR"' EXIT
    bundle="$BUNDLE_DIR/bpo_jax-$sha.bundle"
  fi
  run_cmd git -C "$HERE" bundle create "$bundle" HEAD
  # A relative scp destination lands in the worker's home folder.
  run_cmd gcloud compute tpus tpu-vm scp "$bundle" "$NAME:bpo_jax-$sha.bundle" "${LOC[@]}" --worker=all
  remote="set -euo pipefail
rel=\$HOME/bpo_jax/releases/$sha
mkdir -p \$HOME/bpo_jax/releases \$HOME/bpo_jax/runs
if [ ! -e \$rel/.git ]; then
  rm -rf \$rel.partial
  git clone -q --no-checkout \$HOME/bpo_jax-$sha.bundle \$rel.partial
  git -C \$rel.partial checkout -q --detach $sha
  mv \$rel.partial \$rel
fi
rm -f \$HOME/bpo_jax-$sha.bundle
bash \$rel/scripts/tpu_worker.sh setup --jax-version $(printf '%q' "$version")"
  local out rc=0
  out=$(mktemp)
  ssh_all all "$remote" | tee "$out" || rc=${PIPESTATUS[0]}
  if [ "$DRY_RUN" = 0 ]; then
    local n
    n=$(grep -cE '^host[^:]*: ready' "$out" || true)
    rm -f "$out"
    if [ "$rc" != 0 ] || [ "$n" != "$WORKERS" ]; then
      fail "setup: $n of ${WORKERS:-?} hosts ready (gcloud exit $rc; see above)"
    fi
    echo "$PROG: setup: release ${sha:0:12} ready on all $n hosts"
  fi
  rm -f "$out"
}

cmd_run() {
  local sha remote kv out rc=0
  sha=$(repo_sha "${RELEASE:-HEAD}")
  if [ -z "$RUN_ID" ]; then
    RUN_ID="$(date -u +%Y%m%d-%H%M%S)-${sha:0:7}-$(od -An -N2 -tx1 /dev/urandom | tr -d ' \n')"
  fi
  require_ready
  remote=$(worker_cmd "releases/$sha" "release ${sha:0:12} is not set up here" \
    start --run-id "$RUN_ID" --wait "$WAIT_S")
  for kv in ${ENVS[@]+"${ENVS[@]}"}; do remote+=" --env $(printf '%q' "$kv")"; done
  remote+=" --"
  for kv in "${TRAIN_ARGS[@]}"; do remote+=" $(printf '%q' "$kv")"; done
  out=$(mktemp)
  note "run $RUN_ID: release ${sha:0:12}, logs in ~/bpo_jax/runs/$RUN_ID/host<k>.log"
  ssh_all all "$remote" | tee "$out" || rc=${PIPESTATUS[0]}
  if [ "$DRY_RUN" = 0 ]; then
    if ! check_running "$out" "run $RUN_ID" "$rc"; then
      rm -f "$out"
      echo "$PROG: stop the hosts still running with: ./$PROG --name $NAME --zone $ZONE" \
        "${PROJECT:+--project $PROJECT }stop --run-id $RUN_ID" >&2
      exit 1
    fi
    echo "$PROG: follow it with: ./$PROG --name $NAME --zone $ZONE" \
      "${PROJECT:+--project $PROJECT }logs --run-id $RUN_ID --follow"
  fi
  rm -f "$out"
}


run_id_args() { if [ -n "$RUN_ID" ]; then printf '%s\n' --run-id "$RUN_ID"; fi; }

cmd_logs() {
  local args=() a
  while IFS= read -r a; do args+=("$a"); done < <(run_id_args)
  args+=(--lines "$LINES")
  [ "$FOLLOW" = 0 ] || args+=(--follow)
  ssh_all "$WORKER" "$(worker_cmd current "nothing is set up here" logs "${args[@]}")"
}

cmd_status() {
  local args=() a out rc=0
  while IFS= read -r a; do args+=("$a"); done < <(run_id_args)
  require_ready
  out=$(mktemp)
  ssh_all all "$(worker_cmd current "nothing is set up here" status "${args[@]}")" | tee "$out" || rc=${PIPESTATUS[0]}
  if [ "$DRY_RUN" = 0 ]; then
    # status reports, so a host that is not running is not a gcloud failure here.
    check_running "$out" "status${RUN_ID:+ of run $RUN_ID}" 0 || { rm -f "$out"; exit 1; }
  fi
  rm -f "$out"
}

cmd_stop() {
  local args=() a
  while IFS= read -r a; do args+=("$a"); done < <(run_id_args)
  ssh_all all "$(worker_cmd current "nothing is set up here" stop "${args[@]}")"
}

cmd_delete() {
  if [ "$DRY_RUN" = 0 ] && [ "$YES" = 0 ]; then
    printf '%s' "Delete TPU slice '$NAME' in $ZONE${PROJECT:+ (project $PROJECT)}? Its disks go with" \
      " it, including every worker's ~/bpo_jax/runs logs (gs:// workdirs are kept). [y/N] " >&2
    local answer=""
    read -r answer || true
    case "$answer" in
      y | Y | yes | YES) ;;
      *) fail "not deleted (answer '$answer'; pass --yes to skip the question)" ;;
    esac
  fi
  run_cmd gcloud compute tpus tpu-vm delete "$NAME" "${LOC[@]}" --quiet
}

"cmd_$COMMAND"
