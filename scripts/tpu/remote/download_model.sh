#!/usr/bin/env bash
# Runs ON a worker or on model_disk.sh's helper VM: downloads the Hugging Face checkpoint
# HF_REPO (safetensors, config and tokenizer; not the original/ consolidated .pth copy) into
# MODEL_ROOT/MODEL_NAME with `hf download` (huggingface_hub's CLI, formerly
# `huggingface-cli download`). A token copied here as ~/jaxinfer-hf-token is moved to
# huggingface_hub's token file first (gated models such as meta-llama/* need one).
set -euo pipefail

: "${HF_REPO:?set HF_REPO, e.g. meta-llama/Llama-3.1-8B-Instruct}"
MNT=${MODEL_ROOT:-/mnt/disks/models}
NAME=${MODEL_NAME:-${HF_REPO##*/}}
HF=${HF_BIN:-$HOME/${VENV:-jaxinfer-venv}/bin/hf}

if [[ -f "$HOME/jaxinfer-hf-token" ]]; then
  mkdir -p "$HOME/.cache/huggingface"
  mv "$HOME/jaxinfer-hf-token" "$HOME/.cache/huggingface/token"
  chmod 600 "$HOME/.cache/huggingface/token"
fi
if [[ ! -d "$MNT" ]]; then
  sudo mkdir -p "$MNT"
  sudo chown "$(id -u):$(id -g)" "$MNT"
fi
if [[ ! -w "$MNT" ]]; then
  echo "download_model.sh: $MNT is not writable on $(hostname) (a read-only data disk?)" >&2
  exit 1
fi
"$HF" download "$HF_REPO" --local-dir "$MNT/$NAME" --exclude "original/*"
echo "$(hostname): $HF_REPO in $MNT/$NAME"
df -h "$MNT"
