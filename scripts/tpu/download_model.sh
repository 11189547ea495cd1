#!/usr/bin/env bash
# Download a Hugging Face checkpoint into MODEL_ROOT/MODEL_NAME (/mnt/disks/models/<repo name>)
# on every worker (each host of a slice reads its own copy), with the venv's `hf download`.
# Run it after install.sh (and mount_disk.sh when the model goes on a read-write data disk).
#
#   HF_REPO     default meta-llama/Llama-3.1-8B-Instruct (gated: accept the licence on its
#               Hugging Face page, then give a token)
#   HF_TOKEN    a Hugging Face token; default: the one `hf auth login` saved on this machine.
#               It is copied to the workers by scp (mode 600), never put on a command line.
#   MODEL_NAME  default: the repo name, e.g. Llama-3.1-8B-Instruct
#   WORKER      default all; 0 for one host
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

: "${HF_REPO:=meta-llama/Llama-3.1-8B-Instruct}"
: "${MODEL_NAME:=${HF_REPO##*/}}"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
token=$(hf_token)
if [[ -n "$token" ]]; then
  (umask 077 && printf '%s' "$token" >"$tmp/token")
  tpu_scp "${WORKER:-all}" --scp-flag=-p "$tmp/token" "$TPU_NAME:jaxinfer-hf-token"
else
  echo "note: no Hugging Face token (HF_TOKEN or ${HF_HOME:-$HOME/.cache/huggingface}/token); gated models will fail" >&2
fi
remote_script="$REMOTE_SRC/scripts/tpu/remote/download_model.sh"
tpu_ssh "${WORKER:-all}" "$(env_prefix HF_REPO MODEL_NAME MODEL_ROOT VENV)bash $remote_script"
