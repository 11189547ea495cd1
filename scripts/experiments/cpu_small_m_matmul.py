"""What M query rows cost on this CPU: the weight matmuls of a SmolLM2-135M-shaped stack.

A speculative verification step feeds R + 1 rows per sequence where a decode step feeds one,
and on TPU/GPU both are bound by reading the weights once. This script measures how XLA CPU
does: 30 layers of SmolLM2-135M's weight shapes (qkv 576x960, o 576x576, gate/up 576x3072,
down 1536x576: 420 MB of f32, more than any cache, so every step streams them from memory),
multiplied by M rows, for M = 1..8, as

* one matmul per weight ([M, K] @ [K, N]: a GEMV for M = 1, a GEMM for M > 1), what the model
  does, and
* M matrix-vector products per weight (each row on its own, interleaved weight by weight).

  python scripts/experiments/cpu_small_m_matmul.py   # about a minute; one core: taskset -c 0 ...

Prints ms per pass and the ratio to M = 1.

Reproduces docs/benchmarks.md, "Speculative decoding": what M query rows cost on CPU.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS = 30
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # qkv, o, gate|up, down


def _seconds(f, *args, repeats: int = 15) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _layer(x, weights, matmul):
    qkv, o, gate_up, down = weights
    h = matmul(x, qkv)
    x = x + matmul(h[:, :576], o)
    g = matmul(x, gate_up)
    return x + matmul(jax.nn.silu(g[:, :1536]) * g[:, 1536:], down)


def _gemm(x, w):
    return x @ w


def _gemvs(x, w):
    return jnp.concatenate([x[i:i + 1] @ w for i in range(x.shape[0])])


def main() -> None:
    rng = np.random.default_rng(0)
    stack = [tuple(jnp.asarray(rng.standard_normal(s, np.float32) * 0.03) for s in SHAPES)
             for _ in range(LAYERS)]
    mb = sum(w.nbytes for layer in stack for w in layer) / 1e6
    runs = {}
    for name, matmul in (("gemm", _gemm), ("gemvs", _gemvs)):
        def forward(x, stack, matmul=matmul):
            for weights in stack:
                x = _layer(x, weights, matmul)
            return x
        runs[name] = jax.jit(forward)
    print(f"{LAYERS} layers, {mb:.0f} MB of f32 weights, backend {jax.default_backend()}")
    print(f"{'M':>2} {'one matmul (ms)':>16} {'vs M=1':>7} {'M GEMVs (ms)':>13} {'vs M=1':>7}")
    base = None
    for m in range(1, 9):
        x = jnp.ones((m, 576), jnp.float32)
        gemm = _seconds(runs["gemm"], x, stack) * 1e3
        gemvs = _seconds(runs["gemvs"], x, stack) * 1e3
        base = base or gemm
        print(f"{m:2d} {gemm:16.1f} {gemm / base:6.2f}x {gemvs:13.1f} {gemvs / base:6.2f}x")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
