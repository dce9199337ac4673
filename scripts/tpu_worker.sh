#!/usr/bin/env bash
# Worker side of launch_tpu.sh: runs on every TPU VM worker, from a release folder
# (~/bpo_jax/releases/<sha>, a checkout of one commit). launch_tpu.sh calls it over
# `gcloud compute tpus tpu-vm ssh`; it is not meant to be run by hand, but it can be:
#
#   bash scripts/tpu_worker.sh setup --jax-version V
#   bash scripts/tpu_worker.sh start --run-id ID [--wait S] [--env KEY=VALUE]... -- TRAINING FLAGS
#   bash scripts/tpu_worker.sh status [--run-id ID]
#   bash scripts/tpu_worker.sh logs [--run-id ID] [--lines N] [--follow]
#   bash scripts/tpu_worker.sh stop [--run-id ID]
#
# Layout on a worker (nothing here is ever deleted by these commands):
#   ~/bpo_jax/releases/<sha>/          a checkout of <sha> with its own .venv
#   ~/bpo_jax/current -> releases/<sha>  the release the last `setup` prepared
#   ~/bpo_jax/runs/<run_id>/host<k>.{log,pid,exit,stopped}, command.txt, env.txt, release
#   ~/bpo_jax/runs/LATEST               the id of the last run started on this worker
# Every status line starts with "host<k>: " (k = the worker number, as JAX reads it from the
# TPU metadata server); launch_tpu.sh counts the "host<k>: running" lines.
set -euo pipefail

ROOT="$HOME/bpo_jax"
RUNS="$ROOT/runs"

die() {
  echo "host$HOST: failed: $*"
  exit 3
}

worker_number() {
  # The same source jax.distributed uses on TPU VMs; the hostname where there is no metadata.
  local k
  k=$(curl -sf --max-time 2 -H 'Metadata-Flavor: Google' \
    http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number \
    2>/dev/null) || k=""
  if [[ "$k" =~ ^[0-9]+$ ]]; then echo "$k"; else echo "-$(hostname)"; fi
}
HOST=$(worker_number)

resolve_run() {  # sets RUN_ID and DIR from --run-id or runs/LATEST
  if [ -z "$RUN_ID" ]; then
    [ -f "$RUNS/LATEST" ] || die "no run was started on this worker (no $RUNS/LATEST)"
    RUN_ID=$(cat "$RUNS/LATEST")
  fi
  DIR="$RUNS/$RUN_ID"
  [ -d "$DIR" ] || die "run $RUN_ID not found on this worker (no $DIR)"
}

# resolve_run_option CMD ARGS...: resolve_run for a command whose only option is [--run-id ID]
resolve_run_option() {
  local cmd=$1
  shift
  RUN_ID=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --run-id) RUN_ID=$2; shift 2 ;;
      *) die "$cmd: unknown option $1" ;;
    esac
  done
  resolve_run
}

alive() {  # alive PIDFILE EXITFILE: the run's process group leader still runs
  local pid
  [ -f "$1" ] || return 1
  pid=$(cat "$1")
  [ ! -f "$2" ] && kill -0 "$pid" 2>/dev/null
}

report() {  # report: one status line for this host's process of run $RUN_ID
  local pidf="$DIR/host$HOST.pid" exitf="$DIR/host$HOST.exit" log="$DIR/host$HOST.log"
  if [ ! -f "$pidf" ]; then
    echo "host$HOST: not started (no $pidf)"
    return 1
  elif alive "$pidf" "$exitf"; then
    echo "host$HOST: running (pid $(cat "$pidf"), run $RUN_ID, log $log)"
    return 0
  elif [ -f "$exitf" ] && [ "$(cat "$exitf")" = 0 ]; then
    echo "host$HOST: finished (exit 0, run $RUN_ID, log $log)"
  elif [ -f "$exitf" ]; then
    echo "host$HOST: died (exit $(cat "$exitf"), run $RUN_ID, log $log)"
  elif [ -f "$DIR/host$HOST.stopped" ]; then
    echo "host$HOST: stopped ($(cat "$DIR/host$HOST.stopped"), run $RUN_ID, log $log)"
  else
    echo "host$HOST: died (killed, no exit code; run $RUN_ID, log $log)"
  fi
  return 1
}

tail_log() {  # tail_log N: the last N lines of this host's log, indented and tagged
  local log="$DIR/host$HOST.log"
  if [ -f "$log" ]; then
    echo "  --- last $1 lines of $log ---"
    tail -n "$1" "$log" | sed "s/^/  host$HOST| /"
  fi
}

cmd_setup() {
  local jax_version=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --jax-version) jax_version=$2; shift 2 ;;
      *) die "setup: unknown option $1" ;;
    esac
  done
  [ -n "$jax_version" ] || die "setup: --jax-version is required"
  local rel
  rel=$(cd "$(dirname "$0")/.." && pwd)
  cd "$rel"
  if [ ! -x .venv/bin/python ] && ! python3 -c 'import ensurepip' >/dev/null 2>&1; then
    echo "host$HOST: python3 has no venv support; installing python3-venv with apt"
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
  fi
  if ! bash scripts/setup.sh 2>&1 | sed "s/^/  host$HOST| /"; then
    die "scripts/setup.sh failed in $rel (its output is above)"
  fi
  if ! .venv/bin/python -m pip install --quiet "jax[tpu]==$jax_version" 2>&1 |
    sed "s/^/  host$HOST| /"; then
    die "pip install jax[tpu]==$jax_version failed in $rel (its output is above)"
  fi
  ln -sfn "$rel" "$ROOT/current"
  echo "host$HOST: ready ($rel, jax[tpu]==$jax_version)"
}

cmd_start() {
  local wait_s=15 envs=() a
  RUN_ID=""
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case "$1" in
      --run-id) RUN_ID=$2; shift 2 ;;
      --wait) wait_s=$2; shift 2 ;;
      --env) envs+=("$2"); shift 2 ;;
      *) die "start: unknown option $1" ;;
    esac
  done
  [ "${1:-}" = "--" ] && shift
  [ -n "$RUN_ID" ] || die "start: --run-id is required"
  local rel
  rel=$(cd "$(dirname "$0")/.." && pwd)
  [ -x "$rel/.venv/bin/python" ] || die "$rel has no .venv: run ./launch_tpu.sh setup first"
  DIR="$RUNS/$RUN_ID"
  mkdir -p "$RUNS"
  local log="$DIR/host$HOST.log" pidf="$DIR/host$HOST.pid" exitf="$DIR/host$HOST.exit"
  # Never overwrite an earlier run's files: an existing log means this id was used here.
  if [ -e "$log" ] || [ -e "$pidf" ]; then
    die "run $RUN_ID already exists on this worker ($log); choose another --run-id"
  fi
  # One trainer per worker: a second one would find the TPU chips taken.
  if [ -f "$RUNS/LATEST" ]; then
    local last
    last=$(cat "$RUNS/LATEST")
    if alive "$RUNS/$last/host$HOST.pid" "$RUNS/$last/host$HOST.exit"; then
      die "run $last is still running here (pid $(cat "$RUNS/$last/host$HOST.pid")): stop it first"
    fi
  fi
  mkdir -p "$DIR"
  for a in "${envs[@]}"; do
    export "${a?}"
  done
  basename "$rel" > "$DIR/release"
  printf '%s\n' "${envs[@]}" > "$DIR/env.txt"
  printf '%q ' .venv/bin/python -m bpo_jax.main --multihost "$@" > "$DIR/command.txt"
  echo >> "$DIR/command.txt"
  echo "$RUN_ID" > "$RUNS/LATEST"
  cd "$rel"
  # setsid + nohup: the run survives the ssh session; its own process group lets `stop` end
  # the trainer and every sandbox process it started. The wrapper records the exit code.
  # shellcheck disable=SC2016  # $$, $1.. expand in the wrapper shell, not here.
  setsid nohup bash -c 'echo $$ > "$1"; log=$2; exitf=$3; shift 3
    "$@" > "$log" 2>&1 < /dev/null; echo $? > "$exitf"' \
    bpo_run "$pidf" "$log" "$exitf" .venv/bin/python -m bpo_jax.main --multihost "$@" \
    > /dev/null 2>&1 < /dev/null &
  local i
  for ((i = 0; i < 50; i++)); do
    [ -s "$pidf" ] && break
    sleep 0.1
  done
  sleep "$wait_s"
  if report; then
    return 0
  fi
  tail_log 20
  return 1
}

cmd_status() {
  resolve_run_option status "$@"
  report
}

cmd_logs() {
  local lines=50 follow=0
  RUN_ID=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --run-id) RUN_ID=$2; shift 2 ;;
      --lines) lines=$2; shift 2 ;;
      --follow) follow=1; shift ;;
      *) die "logs: unknown option $1" ;;
    esac
  done
  resolve_run
  local log="$DIR/host$HOST.log"
  [ -f "$log" ] || die "run $RUN_ID has no log on this worker ($log)"
  if [ "$follow" = 1 ]; then
    tail -n "$lines" -F "$log" | sed -u "s/^/host$HOST| /"
  else
    echo "host$HOST: last $lines lines of $log"
    tail -n "$lines" "$log" | sed "s/^/host$HOST| /"
  fi
}

cmd_stop() {
  resolve_run_option stop "$@"
  local pidf="$DIR/host$HOST.pid" exitf="$DIR/host$HOST.exit" pid i
  if ! alive "$pidf" "$exitf"; then
    report || true
    return 0
  fi
  pid=$(cat "$pidf")
  date -u +"by stop at %Y-%m-%dT%H:%M:%SZ" > "$DIR/host$HOST.stopped"
  kill -TERM -- "-$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL -- "-$pid" 2>/dev/null || true
    echo "host$HOST: stopped (pid $pid did not end on SIGTERM within 10 s: sent SIGKILL)"
  else
    echo "host$HOST: stopped (pid $pid, run $RUN_ID)"
  fi
}

[ $# -gt 0 ] || die "missing command (setup, start, status, logs, stop)"
command=$1
shift
case "$command" in
  setup) cmd_setup "$@" ;;
  start) cmd_start "$@" ;;
  status) cmd_status "$@" ;;
  logs) cmd_logs "$@" ;;
  stop) cmd_stop "$@" ;;
  *) die "unknown command $command" ;;
esac
