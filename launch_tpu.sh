#!/usr/bin/env bash
# Starts the same training command on every worker of a TPU VM slice.
#
# Usage:
#   ./launch_tpu.sh TPU_NAME ZONE [--project P] -- --config=experiments/alfworld.py \
#       --config.model.hf_checkpoint=/mnt/ckpt/Qwen2.5-7B-Instruct --workdir=gs://bucket/run1
#
# What it does, on all workers at once (gcloud ... ssh --worker=all):
#   1. syncs this repository to ~/bpo_jax on each worker (git bundle of HEAD, so uncommitted
#      changes are not shipped by accident);
#   2. runs scripts/setup.sh there (venv + pinned requirements; add jax[tpu] via JAX_EXTRA);
#   3. starts `python -m bpo_jax.main --multihost ...` under nohup, logging to ~/bpo_jax/run.log.
# Every host runs its own sandbox pool for its share of the tasks; JAX's distributed runtime
# (jax.distributed.initialize, called by --multihost) connects the hosts.
set -euo pipefail

if [ $# -lt 3 ]; then
  sed -n '2,14p' "$0"; exit 2
fi
TPU_NAME=$1; ZONE=$2; shift 2
GCLOUD_EXTRA=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do GCLOUD_EXTRA+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
TRAIN_ARGS=("$@")
JAX_EXTRA=${JAX_EXTRA:-"jax[tpu]"}

cd "$(dirname "$0")"
bundle=$(mktemp -d)/bpo_jax.bundle
git bundle create "$bundle" HEAD >/dev/null
gcloud compute tpus tpu-vm scp "$bundle" "$TPU_NAME":/tmp/bpo_jax.bundle --zone "$ZONE" \
  --worker=all "${GCLOUD_EXTRA[@]}"

printf -v args_q '%q ' "${TRAIN_ARGS[@]}"
remote="set -e
rm -rf ~/bpo_jax && git clone -q /tmp/bpo_jax.bundle ~/bpo_jax && cd ~/bpo_jax
bash scripts/setup.sh && .venv/bin/pip install -q '$JAX_EXTRA'
nohup .venv/bin/python -m bpo_jax.main --multihost $args_q > run.log 2>&1 &
echo \"started on \$(hostname)\""
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all "${GCLOUD_EXTRA[@]}" \
  --command "$remote"
