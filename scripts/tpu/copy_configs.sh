#!/usr/bin/env bash
# Copy configs/ and a prompts file to every worker of TPU_NAME (into ~/jaxinfer-run/, where
# run.sh runs), so that edited configs need no reinstall.
#
#   PROMPTS_FILE  one prompt per line, or JSONL {"prompt": ...} (default scripts/tpu/prompts.txt);
#                 it arrives as ~/jaxinfer-run/prompts.txt
#   CONFIGS_DIR   default: configs/ of this checkout
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

: "${PROMPTS_FILE:=$REPO_ROOT/scripts/tpu/prompts.txt}"
: "${CONFIGS_DIR:=$REPO_ROOT/configs}"
[[ -f "$PROMPTS_FILE" ]] || die "no such prompts file: $PROMPTS_FILE"
[[ -d "$CONFIGS_DIR" ]] || die "no such directory: $CONFIGS_DIR"

run_dir="\$HOME/$(printf '%q' "$RUN_DIR")"
# The old configs/ goes first: scp -r DIR onto a path that does not exist creates it as a copy
# of DIR (onto an existing directory it would nest DIR inside).
tpu_ssh all "mkdir -p $run_dir/outputs && rm -rf $run_dir/configs"
tpu_scp all --recurse "$CONFIGS_DIR" "$TPU_NAME:$RUN_DIR/configs"
tpu_scp all "$PROMPTS_FILE" "$TPU_NAME:$RUN_DIR/prompts.txt"
