#!/usr/bin/env bash
# llama.cpp on the embedded model's weights, the reference point of scripts/benchmark.py's
# quantized runs: builds llama-bench, llama-batched-bench and llama-quantize (CPU only, native
# ISA) from the llama.cpp vendored in the llama-cpp-python sdist on PyPI, requantizes the
# shipped SmolLM2-135M Q4_1 GGUF to F32, Q8_0 and Q4_1, and measures each:
#   prefill: llama-bench -p 512 -n 0 (tok/s of one 512-token prompt)
#   decode:  llama-batched-bench, B sequences of their own 16-token prompt, 64 generated tokens
#            each, B = 1, 8, 32 (S_TG = B * 64 / time of the decode steps)
# with 2 threads, flash attention off and on (llama.cpp's default is auto = on for CPU);
# FA, THREADS, POLL and NTG (environment) change those.
#
#   scripts/experiments/llamacpp_bench.sh [WORKDIR]   # default /work/llamacpp, outside the repo
#
# Needs cmake >= 3.14 (`pip install cmake` if the system lacks it) and a C++17 compiler. The
# build is `nice -n 15`, -j2 (about 30 minutes on 2 shared cores); later runs reuse it.
# Results: WORKDIR/results/*.jsonl, and a summary table on stdout.
# Reproduces docs/benchmarks.md, "Against llama.cpp": the llama.cpp rows (FA=off NTG=32).
set -euo pipefail
WORK=${1:-/work/llamacpp}
PY=${PYTHON:-python}
VERSION=0.3.36
THREADS=${THREADS:-2}
FA=${FA:-off on}      # flash attention settings to run
POLL=${POLL:-50}      # llama.cpp's busy-wait between ops (0: yield; for a shared machine)
NTG=${NTG:-64}        # generated tokens per sequence in the decode runs
REPO=$(cd "$(dirname "$0")/../.." && pwd)

mkdir -p "$WORK/results" && cd "$WORK"
[ -f "llama_cpp_python-$VERSION.tar.gz" ] ||
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
[ -d "llama_cpp_python-$VERSION" ] || tar xzf "llama_cpp_python-$VERSION.tar.gz"
SRC="llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -x build/bin/llama-quantize ] || [ ! -x build/bin/llama-bench ] ||
   [ ! -x build/bin/llama-batched-bench ]; then
  nice -n 15 cmake -S "$SRC" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF \
    -DGGML_VULKAN=OFF
  nice -n 15 cmake --build build -j2 --target llama-bench llama-batched-bench llama-quantize
fi

GGUF=$(cd "$REPO" && PYTHONPATH="$REPO" "$PY" -c \
  "from jaxinfer.checkpoint.weights import default_model_path; print(default_model_path())")
for type in F32 Q8_0 Q4_1; do
  [ -f "smollm2-$type.gguf" ] ||
    build/bin/llama-quantize --allow-requantize "$GGUF" "smollm2-$type.gguf" "$type" \
      > "results/quantize-$type.log" 2>&1
done

uptime > results/loadavg.txt
for type in F32 Q8_0 Q4_1; do
  for fa in $FA; do
    build/bin/llama-bench -m "smollm2-$type.gguf" -t "$THREADS" -p 512 -n 0 -fa "$fa" -r 3 \
      --poll "$POLL" -o jsonl > "results/bench-$type-fa$fa.jsonl" 2>/dev/null
    build/bin/llama-batched-bench -m "smollm2-$type.gguf" -t "$THREADS" -tb "$THREADS" \
      -c 4096 -b 2048 -ub 512 -npp 16 -ntg "$NTG" -npl 1,8,32 -fa "$fa" --poll "$POLL" \
      --output-format jsonl 2>/dev/null | grep '^{' > "results/batched-$type-fa$fa.jsonl"
  done
done
uptime >> results/loadavg.txt

FA="$FA" "$PY" - <<'EOF'
import json, os
print(f"{'weights':>6} {'FA':>3} {'prefill 512 tok/s':>18} {'decode B=1':>11} {'B=8':>8} {'B=32':>8}")
for t in ("F32", "Q8_0", "Q4_1"):
    for fa in os.environ["FA"].split():
        pp = [json.loads(x) for x in open(f"results/bench-{t}-fa{fa}.jsonl") if x.strip()]
        tg = {r["pl"]: r["speed_tg"] for r in map(json.loads, open(f"results/batched-{t}-fa{fa}.jsonl"))}
        print(f"{t:>6} {fa:>3} {pp[0]['avg_ts']:18.1f} {tg.get(1, 0):11.1f} {tg.get(8, 0):8.1f} "
              f"{tg.get(32, 0):8.1f}")
EOF
cat results/loadavg.txt
