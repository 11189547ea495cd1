#!/usr/bin/env bash
# Runs ON a worker (mount_disk.sh, model_disk.sh): mounts the attached data disk DISK_DEVICE
# (default: the one whole disk that is neither the boot disk nor partitioned, /dev/sdb on a
# SCSI machine, /dev/nvme0n2 on an NVMe one) at MODEL_ROOT. DATA_DISK_MODE=read-only
# mounts it with ro,noload (no journal replay: the disk is shared by every host of a slice);
# read-write formats it as ext4 first if it holds no filesystem yet. The commands follow
# https://cloud.google.com/tpu/docs/setup-persistent-disk.
set -euo pipefail

MNT=${MODEL_ROOT:-/mnt/disks/models}
MODE=${DATA_DISK_MODE:-read-only}

data_disk() {
  local root disk candidates=()
  root=$(lsblk -no PKNAME "$(findmnt -no SOURCE /)" || true)
  for disk in $(lsblk -dpno NAME,TYPE | awk '$2 == "disk" {print $1}'); do
    [[ "$disk" == "/dev/$root" || "$disk" == /dev/zram* ]] && continue
    [[ $(lsblk -no NAME "$disk" | wc -l) == 1 ]] || continue # partitioned: not ours
    [[ -z $(lsblk -dno MOUNTPOINT "$disk") ]] || continue    # in use (mounted, swap)
    candidates+=("$disk")
  done
  [[ ${#candidates[@]} == 1 ]] || return 1
  echo "${candidates[0]}"
}

if mountpoint -q "$MNT"; then
  echo "$(hostname): $MNT is already mounted"
  exit 0
fi
DEV=${DISK_DEVICE:-$(data_disk || true)}
if [[ -z "$DEV" || ! -b "$DEV" ]]; then
  lsblk >&2
  echo "mount_disk.sh: no single data disk found on $(hostname); set DISK_DEVICE (lsblk above)" >&2
  exit 1
fi
sudo mkdir -p "$MNT"
case "$MODE" in
  read-only) sudo mount -o ro,noload "$DEV" "$MNT" ;;
  read-write)
    # blkid exits 2 when the device holds no filesystem.
    sudo blkid "$DEV" >/dev/null ||
      sudo mkfs.ext4 -m 0 -E lazy_itable_init=0,lazy_journal_init=0,discard "$DEV"
    sudo mount -o discard,defaults "$DEV" "$MNT"
    sudo chown "$(id -u):$(id -g)" "$MNT"
    ;;
  *)
    echo "mount_disk.sh: DATA_DISK_MODE=$MODE must be read-only or read-write" >&2
    exit 1
    ;;
esac
echo "$(hostname): mounted $DEV at $MNT ($MODE)"
df -h "$MNT"
