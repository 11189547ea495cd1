#!/usr/bin/env bash
# Create the data disk DATA_DISK for checkpoints larger than the TPU VM's 100 GiB boot disk
# (Llama 3.1 70B in bf16 is 141 GB), and with --fill put HF_REPO on it from a short-lived CPU
# VM, so that every host of a multi-host slice can attach it read-only.
#
#   DATA_DISK=llama-70b scripts/tpu/model_disk.sh           create an empty disk
#   DATA_DISK=llama-70b HF_REPO=meta-llama/Llama-3.1-70B-Instruct \
#     scripts/tpu/model_disk.sh --fill                     create, then fill it
#
#   DISK_SIZE  default 300GB      DISK_TYPE  default pd-balanced (v5e), hyperdisk-balanced (v6e)
#              (https://cloud.google.com/tpu/docs/setup-persistent-disk lists the types per TPU)
#   HELPER_VM / HELPER_MACHINE_TYPE  the filler VM (default DATA_DISK-filler, e2-standard-8);
#              it is deleted when this script ends, also on failure
#   HF_TOKEN, MODEL_NAME  as in download_model.sh
#
# --fill is for pd-balanced: a Balanced Persistent Disk attaches read-only to many VMs as it is.
# On v6e-8 (one host) attach the empty Hyperdisk read-write instead (create.sh with DATA_DISK)
# and fill it there with mount_disk.sh and download_model.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

fill=0
case "${1:-}" in
  "") ;;
  --fill) fill=1 ;;
  *) die "unknown argument ${1}; usage: $0 [--fill]" ;;
esac
: "${DATA_DISK:=jaxinfer-models}"
: "${DISK_SIZE:=300GB}"
case "$ACCELERATOR_TYPE" in
  v6e-*) : "${DISK_TYPE:=hyperdisk-balanced}" ;;
  *) : "${DISK_TYPE:=pd-balanced}" ;;
esac

[[ "$fill" == 0 || "$DISK_TYPE" == pd-* ]] ||
  die "--fill needs a pd-* disk (DISK_TYPE=$DISK_TYPE); see the comment at the top of $0"

if [[ "${DRY_RUN:-0}" != 1 ]] &&
  gcloud compute disks describe "$DATA_DISK" --zone="$ZONE" --project="$PROJECT" >/dev/null 2>&1; then
  echo "disk $DATA_DISK exists" >&2
else
  gc compute disks create "$DATA_DISK" --zone="$ZONE" --project="$PROJECT" \
    --size="$DISK_SIZE" --type="$DISK_TYPE"
fi
[[ "$fill" == 1 ]] || exit 0
: "${HF_REPO:?set HF_REPO, e.g. meta-llama/Llama-3.1-70B-Instruct}"
: "${MODEL_NAME:=${HF_REPO##*/}}"
: "${HELPER_VM:=${DATA_DISK}-filler}"
: "${HELPER_MACHINE_TYPE:=e2-standard-8}"
vm_flags=(--zone="$ZONE" --project="$PROJECT")

tmp=$(mktemp -d)
cleanup() {
  rm -rf "$tmp"
  gc compute instances delete "$HELPER_VM" "${vm_flags[@]}" --quiet || true
}
gc compute instances create "$HELPER_VM" "${vm_flags[@]}" --machine-type="$HELPER_MACHINE_TYPE" \
  --image-family=debian-12 --image-project=debian-cloud
trap cleanup EXIT
gc compute instances attach-disk "$HELPER_VM" "${vm_flags[@]}" --disk="$DATA_DISK" \
  --device-name=models
gc compute scp "${vm_flags[@]}" "$REPO_ROOT/scripts/tpu/remote/mount_disk.sh" \
  "$REPO_ROOT/scripts/tpu/remote/download_model.sh" "$HELPER_VM:"
token=$(hf_token)
if [[ -n "$token" ]]; then
  (umask 077 && printf '%s' "$token" >"$tmp/token")
  gc compute scp "${vm_flags[@]}" --scp-flag=-p "$tmp/token" "$HELPER_VM:jaxinfer-hf-token"
fi

# Passed to the helper VM's scripts by name (env_prefix).
# shellcheck disable=SC2034
DISK_DEVICE=/dev/disk/by-id/google-models DATA_DISK_MODE=read-write
fill_cmd="sudo apt-get update -qq && sudo apt-get install -y -qq python3-venv"
fill_cmd+=" && python3 -m venv hfenv && hfenv/bin/pip install -q huggingface_hub"
fill_cmd+=" && $(env_prefix DISK_DEVICE DATA_DISK_MODE MODEL_ROOT)bash mount_disk.sh"
fill_cmd+=" && HF_BIN=\$HOME/hfenv/bin/hf $(env_prefix HF_REPO MODEL_NAME MODEL_ROOT)bash download_model.sh"
fill_cmd+=" && sync && sudo umount $(printf '%q' "$MODEL_ROOT")"
gc compute ssh "$HELPER_VM" "${vm_flags[@]}" --command="$fill_cmd"
gc compute instances detach-disk "$HELPER_VM" "${vm_flags[@]}" --disk="$DATA_DISK"
echo "disk $DATA_DISK holds $MODEL_ROOT/$MODEL_NAME; attach it: DATA_DISK=$DATA_DISK create.sh" >&2
