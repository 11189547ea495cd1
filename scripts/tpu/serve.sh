#!/usr/bin/env bash
# Start jaxinfer-serve on every worker of TPU_NAME at once (--worker=all): on a multi-host slice
# every host runs the same command with --multihost; process 0 (worker 0) serves HTTP and sends
# each step's device calls to the others (jaxinfer/serve/multihost.py). The server listens on
# worker 0's port PORT; reach it with an SSH tunnel, e.g.
#   gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=0 -- -L 8000:127.0.0.1:8000
#
#   CONFIG=llama-3.1-8b-v5e-8.yaml scripts/tpu/serve.sh [more jaxinfer-serve flags]
#
#   CONFIG    a file in ~/jaxinfer-run/configs (copy_configs.sh); default smollm2-135m.yaml
#   PORT      the port on worker 0 (default 8000; the server binds 127.0.0.1, use the tunnel)
#   RUN_NAME  log name (default: serve- + config name + UTC time): outputs/RUN_NAME.<hostname>.log
# Ctrl-C here ends it on every worker (process 0 shuts down, then the others follow).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

: "${CONFIG:=smollm2-135m.yaml}"
: "${PORT:=8000}"
: "${RUN_NAME:=serve-${CONFIG%.yaml}-$(date -u +%Y%m%d-%H%M%S)}"

args=(--config="configs/$CONFIG" --port="$PORT")
is_multihost && args+=(--multihost)
args+=("$@")

quoted=$(printf ' %q' "${args[@]}")
log="outputs/$(printf '%q' "$RUN_NAME").\$(hostname).log"
command="set -o pipefail; cd \"\$HOME\"/$(printf '%q' "$RUN_DIR") && mkdir -p outputs &&"
command+=" \"\$HOME\"/$(printf '%q' "$VENV")/bin/jaxinfer-serve$quoted 2>&1 | tee $log"

echo "serving on all workers of $TPU_NAME (worker 0 listens on 127.0.0.1:$PORT): $command" >&2
tpu_ssh all "$command"
