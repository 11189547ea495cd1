"""What libtpu takes to compile one small program: single operations of an 8B decode step (one
v5e chip, deviceless, bf16 weights, batch 64, Llama 3.1's 4,096 hidden and 128,256 vocabulary),
each compiled on its own. docs/benchmarks.md, "Scanned layers": the compile a program pays
whatever it computes, beside which the decode set's depth-independent programs are measured.

    python scripts/experiments/tpu_compile_floor.py [--target=v6e:2x4] [--repeats=3]
"""

import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compile-only devices come from topologies

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.experimental import topologies  # noqa: E402

_TARGET = flags.DEFINE_string("target", "v5e:2x2", "TPU topology; one of its chips compiles.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Compiles per program (a fresh jit each); the "
                                "median is reported.")

B, D, F, V = 64, 4096, 14336, 128256
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32

PROGRAMS = {
    "elementwise add, [64, 4096]": (lambda x: x + 1, [((B, D), BF16)]),
    "embedding gather": (lambda t, e: e[t], [((B,), I32), ((V, D), BF16)]),
    "LM head matmul": (lambda x, w: jnp.dot(x, w, preferred_element_type=F32),
                       [((B, D), BF16), ((D, V), BF16)]),
    "gated MLP": (lambda x, a, b, c: (jax.nn.silu(x @ a) * (x @ b)) @ c,
                  [((B, D), BF16), ((D, F), BF16), ((D, F), BF16), ((F, D), BF16)]),
    "softmax over the vocabulary": (lambda logits: jax.nn.softmax(logits, -1), [((B, V), F32)]),
    "argmax over the vocabulary": (lambda logits: jnp.argmax(logits, -1), [((B, V), F32)]),
    "lax.top_k, k = 64": (lambda logits: jax.lax.top_k(logits, 64), [((B, V), F32)]),
    "cumsum over the vocabulary": (lambda logits: jnp.cumsum(logits, -1), [((B, V), F32)]),
}


def compile_seconds(fn, shapes, sharding) -> float:
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    lowered = jax.jit(lambda *a: fn(*a)).lower(*args)
    start = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - start


def main(argv):
    del argv
    chip = topologies.get_topology_desc(_TARGET.value, platform="tpu").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(chip)
    print(f"one {_TARGET.value} chip, median of {_REPEATS.value} compiles\n")
    print("| program | compile s |\n| --- | ---: |")
    for name, (fn, shapes) in PROGRAMS.items():
        times = [compile_seconds(fn, shapes, sharding) for _ in range(_REPEATS.value)]
        print(f"| {name} | {statistics.median(times):.2f} |")


if __name__ == "__main__":
    app.run(main)
