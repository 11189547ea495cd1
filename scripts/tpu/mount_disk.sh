#!/usr/bin/env bash
# Mount the data disk that create.sh attached (DATA_DISK) at MODEL_ROOT (/mnt/disks/models) on
# every worker; run it after install.sh. DATA_DISK_MODE must match the attachment: read-only
# on a multi-host slice (the default there), read-write on one host (formats an empty disk).
# DISK_DEVICE overrides the device (default: the one unpartitioned non-boot disk).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if is_multihost; then : "${DATA_DISK_MODE:=read-only}"; else : "${DATA_DISK_MODE:=read-write}"; fi
env_names=(DATA_DISK_MODE MODEL_ROOT)
[[ -z "${DISK_DEVICE:-}" ]] || env_names+=(DISK_DEVICE)
tpu_ssh all "$(env_prefix "${env_names[@]}")bash $REMOTE_SRC/scripts/tpu/remote/mount_disk.sh"
