#!/usr/bin/env bash
# Delete TPU_NAME: its queued resource (with --force, which deletes the node too) when one
# exists, else the TPU VM itself. DELETE_DISK=1 also deletes DATA_DISK. Billing stops only here.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  queued=${QUEUED:-0}
elif gcloud compute tpus queued-resources describe "$QUEUED_RESOURCE" --zone="$ZONE" \
  --project="$PROJECT" >/dev/null 2>&1; then
  queued=1
else
  queued=0
fi

if [[ "$queued" == 1 ]]; then
  gc compute tpus queued-resources delete "$QUEUED_RESOURCE" --zone="$ZONE" --project="$PROJECT" \
    --force --quiet
else
  gc compute tpus tpu-vm delete "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" --quiet
fi

if [[ "${DELETE_DISK:-0}" == 1 ]]; then
  [[ -n "${DATA_DISK:-}" ]] || die "DELETE_DISK=1 needs DATA_DISK=<disk name>"
  gc compute disks delete "$DATA_DISK" --zone="$ZONE" --project="$PROJECT" --quiet
fi
