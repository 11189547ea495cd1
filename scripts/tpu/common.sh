# shellcheck shell=bash
# Sourced by every scripts/tpu/*.sh that runs on your machine: the defaults (each one
# overridable from the environment) and the gcloud helpers. Nothing here runs gcloud except
# the PROJECT look-up when PROJECT is unset.
#
#   ACCELERATOR_TYPE  v5litepod-8 | v5litepod-16 | v6e-8 | ...   (default v5litepod-8)
#   TPU_NAME          the TPU VM / slice (node) name             (default jaxinfer-$ACCELERATOR_TYPE)
#   ZONE              default from ACCELERATOR_TYPE: v5e us-west4-a, v6e us-east5-b, v5p us-east5-a
#   RUNTIME_VERSION   default from ACCELERATOR_TYPE: v5e v2-alpha-tpuv5-lite, v6e v2-alpha-tpuv6e,
#                     v5p v2-alpha-tpuv5 (https://cloud.google.com/tpu/docs/runtimes)
#   PROJECT           default: `gcloud config get-value project`
#   QUEUED_RESOURCE   queued-resource id for create.sh --queued/--spot/--best-effort
#   MULTIHOST         1/0 forces multi-host on/off; default: more than 8 in the accelerator type
#   DRY_RUN=1         print every gcloud command instead of running it
set -euo pipefail

# shellcheck disable=SC2034  # used by the scripts that source this file
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

die() {
  echo "${0##*/}: error: $*" >&2
  exit 1
}

: "${ACCELERATOR_TYPE:=v5litepod-8}"
: "${TPU_NAME:=jaxinfer-${ACCELERATOR_TYPE}}"
case "$ACCELERATOR_TYPE" in
  v6e-*) _default_zone=us-east5-b _default_runtime=v2-alpha-tpuv6e ;;
  v5litepod-*) _default_zone=us-west4-a _default_runtime=v2-alpha-tpuv5-lite ;;
  v5p-*) _default_zone=us-east5-a _default_runtime=v2-alpha-tpuv5 ;;
  *) _default_zone="" _default_runtime=tpu-ubuntu2204-base ;;
esac
: "${ZONE:=$_default_zone}"
: "${RUNTIME_VERSION:=$_default_runtime}"
if [[ -z "${PROJECT:-}" ]]; then
  PROJECT=$(gcloud config get-value project 2>/dev/null || true)
fi
[[ -n "$PROJECT" ]] || die "set PROJECT=<your project id> (or run: gcloud config set project ID)"
[[ -n "$ZONE" ]] || die "set ZONE for ACCELERATOR_TYPE=$ACCELERATOR_TYPE"
: "${QUEUED_RESOURCE:=${TPU_NAME}-qr}"

# Paths on the TPU VM workers, relative to the remote home directory.
: "${REMOTE_SRC:=jaxinfer}"        # the repo copy install.sh unpacks
: "${VENV:=jaxinfer-venv}"         # the virtual environment install.sh builds
: "${RUN_DIR:=jaxinfer-run}"       # configs/, prompts.txt and outputs/ of the runs
# Absolute, so that one YAML model_path is valid on every worker; also the mount point of a
# data disk (mount_disk.sh).
: "${MODEL_ROOT:=/mnt/disks/models}"

# gcloud, or its command line on stdout under DRY_RUN=1.
gc() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '+ gcloud'
    printf ' %q' "$@"
    printf '\n'
  else
    gcloud "$@"
  fi
}

# tpu_ssh WORKER COMMAND: run COMMAND on one worker (0, 1, ...) or on all of them at once.
tpu_ssh() {
  gc compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --project="$PROJECT" \
    --worker="$1" --command="$2"
}

# tpu_scp WORKER SRC... DEST: gcloud compute tpus tpu-vm scp (remote paths are TPU_NAME:PATH).
tpu_scp() {
  local worker=$1
  shift
  gc compute tpus tpu-vm scp "$@" --zone="$ZONE" --project="$PROJECT" --worker="$worker"
}

# Chips (v5e/v6e) or TensorCores (v4/v5p) in the slice: the number after the last '-'.
num_chips() {
  echo "${ACCELERATOR_TYPE##*-}"
}

# True when the slice spans more than one TPU VM. Every accelerator type up to -8 is one host
# (v5litepod-8, v6e-8, v5p-8, v4-8); larger ones are several hosts running the same program.
is_multihost() {
  if [[ -n "${MULTIHOST:-}" ]]; then
    [[ "$MULTIHOST" == 1 ]]
  else
    (($(num_chips) > 8))
  fi
}

# env_prefix NAME...: "NAME=value ..." for a remote command line, each value shell-quoted.
env_prefix() {
  local name out=""
  for name in "$@"; do
    out+="$name=$(printf '%q' "${!name-}") "
  done
  printf '%s' "$out"
}

# The Hugging Face token: $HF_TOKEN, else the one `hf auth login` saved; empty if neither.
hf_token() {
  local file=${HF_HOME:-$HOME/.cache/huggingface}/token
  if [[ -n "${HF_TOKEN:-}" ]]; then
    printf '%s' "$HF_TOKEN"
  elif [[ -f "$file" ]]; then
    cat "$file"
  fi
}
