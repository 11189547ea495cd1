#!/usr/bin/env bash
# Run the SAME jaxinfer-generate command on every worker of TPU_NAME at once (--worker=all):
# a multi-host slice is one JAX program over all hosts, so each host must start it. On a
# multi-host slice the command gets --multihost: jaxinfer calls jax.distributed.initialize(),
# which on TPU VMs finds the coordinator and process ids by itself, and only process 0 writes
# the outputs.
#
#   CONFIG=llama-3.1-8b-v5e-8.yaml scripts/tpu/run.sh [more jaxinfer-generate flags]
#
#   CONFIG    a file in ~/jaxinfer-run/configs (copy_configs.sh); default smollm2-135m.yaml
#   PROMPTS   prompts file in ~/jaxinfer-run (default prompts.txt, from copy_configs.sh)
#   RUN_NAME  output name (default: config name + UTC time); writes outputs/RUN_NAME.jsonl and
#             a log per worker, outputs/RUN_NAME.<hostname>.log
#   CHAT=0    send the prompts without the chat template
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

: "${CONFIG:=smollm2-135m.yaml}"
: "${PROMPTS:=prompts.txt}"
: "${RUN_NAME:=${CONFIG%.yaml}-$(date -u +%Y%m%d-%H%M%S)}"

args=(--config="configs/$CONFIG" --prompts_file="$PROMPTS" --output_jsonl="outputs/$RUN_NAME.jsonl")
[[ "${CHAT:-1}" == 1 ]] && args+=(--chat)
is_multihost && args+=(--multihost)
args+=("$@")

quoted=$(printf ' %q' "${args[@]}")
log="outputs/$(printf '%q' "$RUN_NAME").\$(hostname).log"
command="set -o pipefail; cd \"\$HOME\"/$(printf '%q' "$RUN_DIR") && mkdir -p outputs &&"
command+=" \"\$HOME\"/$(printf '%q' "$VENV")/bin/jaxinfer-generate$quoted 2>&1 | tee $log"

echo "running on all workers of $TPU_NAME: $command" >&2
tpu_ssh all "$command"
echo "outputs: scripts/tpu/collect.sh (outputs/$RUN_NAME.jsonl on worker 0)" >&2
