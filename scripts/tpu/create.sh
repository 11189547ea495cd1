#!/usr/bin/env bash
# Create the TPU VM (one host) or slice (several hosts) named TPU_NAME.
#
#   scripts/tpu/create.sh                 on demand: gcloud compute tpus tpu-vm create
#   scripts/tpu/create.sh --queued        as a queued resource (waits until ACTIVE)
#   scripts/tpu/create.sh --spot          queued resource, Spot tier (preemptible, cheaper)
#   scripts/tpu/create.sh --best-effort   queued resource, best-effort tier (gcloud alpha only)
#
# DATA_DISK=<disk name> attaches an existing disk (model_disk.sh) with DATA_DISK_MODE (default
# read-only on a multi-host slice, read-write on one host). Waiting for a queued resource polls
# every POLL_SECONDS (default 30); WAIT=0 returns at once. Other settings: common.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

mode=on-demand
case "${1:-}" in
  "") ;;
  --queued) mode=queued ;;
  --spot) mode=spot ;;
  --best-effort) mode=best-effort ;;
  *) die "unknown argument ${1}; usage: $0 [--queued | --spot | --best-effort]" ;;
esac

disk_args=()
if [[ -n "${DATA_DISK:-}" ]]; then
  if is_multihost; then : "${DATA_DISK_MODE:=read-only}"; else : "${DATA_DISK_MODE:=read-write}"; fi
  disk_args=(--data-disk="source=projects/$PROJECT/zones/$ZONE/disks/$DATA_DISK,mode=$DATA_DISK_MODE")
fi

echo "creating $TPU_NAME: $ACCELERATOR_TYPE, runtime $RUNTIME_VERSION, zone $ZONE," \
  "project $PROJECT ($mode)" >&2

if [[ "$mode" == on-demand ]]; then
  gc compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" \
    --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" \
    ${disk_args[@]+"${disk_args[@]}"}
  exit 0
fi

# Queued resources take --runtime-version (not --version) and name the node with --node-id.
# The GA command has --spot; the best-effort tier exists only in the alpha command.
release=()
tier=()
case "$mode" in
  spot) tier=(--spot) ;;
  best-effort) release=(alpha) tier=(--best-effort) ;;
esac
gc ${release[@]+"${release[@]}"} compute tpus queued-resources create "$QUEUED_RESOURCE" \
  --node-id="$TPU_NAME" --zone="$ZONE" --project="$PROJECT" \
  --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" \
  ${tier[@]+"${tier[@]}"} ${disk_args[@]+"${disk_args[@]}"}

if [[ "${WAIT:-1}" != 1 || "${DRY_RUN:-0}" == 1 ]]; then
  exit 0
fi
last=""
while true; do
  state=$(gcloud compute tpus queued-resources describe "$QUEUED_RESOURCE" --zone="$ZONE" \
    --project="$PROJECT" --format='value(state.state)')
  if [[ "$state" != "$last" ]]; then
    echo "$(date +%H:%M:%S) $QUEUED_RESOURCE: $state" >&2
    last=$state
  fi
  case "$state" in
    ACTIVE) exit 0 ;;
    FAILED | SUSPENDED | SUSPENDING)
      gcloud compute tpus queued-resources describe "$QUEUED_RESOURCE" --zone="$ZONE" \
        --project="$PROJECT" >&2
      die "$QUEUED_RESOURCE is $state; delete it with scripts/tpu/delete.sh" ;;
  esac
  sleep "${POLL_SECONDS:-30}"
done
