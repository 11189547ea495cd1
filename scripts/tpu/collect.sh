#!/usr/bin/env bash
# Copy ~/jaxinfer-run/outputs from worker 0 (the process that writes the JSONL outputs) into
# DEST (default tpu-outputs/$TPU_NAME/outputs). WORKER=N fetches another worker's logs.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

: "${DEST:=tpu-outputs/$TPU_NAME}"
mkdir -p "$DEST"
tpu_scp "${WORKER:-0}" --recurse "$TPU_NAME:$RUN_DIR/outputs" "$DEST"
echo "copied to $DEST/outputs" >&2
