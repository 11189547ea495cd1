"""Does XLA:CPU read a scanned layer's weights in place, or copy them out of the stack first?
(docs/benchmarks.md, "Scanned layers")

The weight traffic of a decode step on SmolLM2-135M's shapes (30 layers, D 576, the fused qkv
[D, 15 x 64], o [576, D], gate_up [D, 2 x 1536], down [1536, D], f32), attention left out: one
matmul chain per layer over B rows, for each way of laying the layers out:

  unrolled         one array per weight per layer, a Python loop (jaxinfer's unrolled layout)
  scan xs          weights stacked [L, ...], `jax.lax.scan` over them as xs
  scan index       the stacks closed over and indexed with the scan's counter (jaxinfer's
                   scanned layout: `Llama._scanned`)
  scan batched dot the matmul formulated on the stack: a dot batched over a one-layer dynamic
                   slice of it
  scan xs unroll=2 / unroll=5   the scan's `unroll` factor
  static slices    the stacks indexed with Python ints in a Python loop (what an unrolled
                   segment of the scanned layout does)

For each: compile seconds, ms per step (median of --repeats runs of --steps steps), and the
weight-sized copies in the optimised HLO: fusions outside the matmuls whose result is one
layer's weight (a slice or dynamic slice of a stack). Prints a table, then one JSON line.

  python scripts/experiments/cpu_scan_layers.py --batches=1,8,32
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("batches", ["1", "8", "32"], "Rows B per step.")
flags.DEFINE_integer("layers", 30, "Layers.")
flags.DEFINE_integer("steps", 20, "Steps per timed run.")
flags.DEFINE_integer("repeats", 5, "Timed runs per variant (median reported).")

D, QKV, ATTN, F = 576, 15 * 64, 9 * 64, 1536  # SmolLM2-135M


def layer(x, p, mm=jnp.matmul):
    """One layer's matmuls (the activations' arithmetic is negligible beside the weights);
    mm(x, name) multiplies by weight `name` (default: p[name] is the weight)."""
    def w(v, name):
        return mm(v, name) if mm is not jnp.matmul else v @ p[name]

    qkv = w(x, "qkv")
    x = x + w(qkv[:, :ATTN], "o")
    gu = w(x, "gate_up")
    return x + w(jax.nn.silu(gu[:, :F]) * gu[:, F:], "down")


def variants(num_layers: int) -> dict:
    def unrolled(x, layers):
        for p in layers:
            x = layer(x, p)
        return x

    def scan_xs(unroll):
        def f(x, stack):
            return jax.lax.scan(lambda x, p: (layer(x, p), None), x, stack, unroll=unroll)[0]
        return f

    def scan_index(x, stack):
        def body(x, i):
            return layer(x, jax.tree.map(lambda a: a[i], stack)), None
        return jax.lax.scan(body, x, jnp.arange(num_layers))[0]

    def scan_dot(x, stack):
        def body(x, i):
            def mm(v, name):  # a batched dot over a one-layer dynamic slice of the stack
                w = jax.lax.dynamic_slice_in_dim(stack[name], i, 1, axis=0)  # [1, K, N]
                return jax.lax.dot_general(v[None], w, (((2,), (1,)), ((0,), (0,))))[0]
            return layer(x, stack, mm), None
        return jax.lax.scan(body, x, jnp.arange(num_layers))[0]

    def static_slices(x, stack):
        for i in range(num_layers):
            x = layer(x, jax.tree.map(lambda a, i=i: a[i], stack))
        return x

    return {"unrolled": (unrolled, False), "scan xs": (scan_xs(1), True),
            "scan index": (scan_index, True), "scan batched dot": (scan_dot, True),
            "scan xs unroll=2": (scan_xs(2), True),
            "scan xs unroll=5": (scan_xs(5), True), "static slices": (static_slices, True)}


def weights(num_layers: int, stacked: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = {"qkv": (D, QKV), "o": (ATTN, D), "gate_up": (D, 2 * F), "down": (F, D)}
    stack = {k: jnp.asarray(0.02 * rng.standard_normal((num_layers, *s), np.float32))
             for k, s in shapes.items()}
    if stacked:
        return stack
    return [{k: jnp.array(v[i]) for k, v in stack.items()} for i in range(num_layers)]


def weight_copies(hlo: str) -> int:
    """Fusions (outside the matmuls) whose result is one layer's weight: a copy of it."""
    shapes = {(D, QKV), (ATTN, D), (D, 2 * F), (F, D)}
    count = 0
    for line in hlo.splitlines():
        m = re.match(r"\s*%[\w.\-]+ = f32\[([\d,]+)\]\S* fusion\(", line)
        if m:
            dims = tuple(int(d) for d in m.group(1).split(",") if d != "1")
            count += dims in shapes
    return count


def measure(fn, params, batch: int) -> dict:
    x = jnp.ones((batch, D), jnp.float32)
    jitted = jax.jit(fn)
    t0 = time.perf_counter()
    compiled = jitted.lower(x, params).compile()
    compile_s = time.perf_counter() - t0
    compiled(x, params).block_until_ready()
    runs = []
    for _ in range(FLAGS.repeats):
        t0 = time.perf_counter()
        for _ in range(FLAGS.steps):
            y = compiled(x, params)
        y.block_until_ready()
        runs.append((time.perf_counter() - t0) / FLAGS.steps * 1e3)
    return {"compile_s": compile_s, "ms": statistics.median(runs), "ms_min": min(runs),
            "weight_copies": weight_copies(compiled.as_text())}


def main(argv):
    del argv
    n = FLAGS.layers
    params = {False: weights(n, False), True: weights(n, True)}
    rows = []
    for batch in (int(b) for b in FLAGS.batches):
        for name, (fn, stacked) in variants(n).items():
            r = {"batch": batch, "variant": name, **measure(fn, params[stacked], batch)}
            print(f"[cpu_scan_layers] {r}", file=sys.stderr, flush=True)
            rows.append(r)
    print(f"{'B':>3} {'variant':>18} {'compile s':>9} {'ms/step':>8} {'min ms':>7} "
          f"{'weight copies':>13}")
    for r in rows:
        print(f"{r['batch']:>3} {r['variant']:>18} {r['compile_s']:9.2f} {r['ms']:8.2f} "
              f"{r['ms_min']:7.2f} {r['weight_copies']:13d}")
    print(json.dumps({"experiment": "cpu_scan_layers", "layers": n, "steps": FLAGS.steps,
                      "repeats": FLAGS.repeats, "jax": jax.__version__, "rows": rows}))


if __name__ == "__main__":
    app.run(main)
