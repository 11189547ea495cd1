"""One 8B-shaped projection (x bf16[8, 4096] @ w[4096, 14336], the ffn axis split over 4 chips)
compiled for TPU v5e without one, for each way of storing and applying its weight: what XLA's
cost analysis counts as bytes accessed, and the arguments and temporaries per chip.

  python scripts/experiments/int4_tpu_dot.py --groups=32,128

Rows: bf16; int8 per output channel (convert, scale after the dot: `quant.einsum`); int8 in
groups (u8, scale and offset per group before the dot: the GGUF layout); 4-bit as
JAX's native `jnp.int4` / `jnp.uint4` (XLA packs s4/u4 two per byte in HBM), with
(a) the dequantization (convert, times scale, plus offset) before the dot, (b) the scale and
offset before the dot in f32, (c) only the scale before the dot, the offset after, (d) a
convert only (no scales: the lower bound), and (e) the scale and offset after a dot batched
over the groups: y[b, n, f] = x[b, n, :] . q[n, :, f], out = sum_n y * scale + (sum_g x) . zero.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from absl import app, flags  # noqa: E402
from tpu_costs import costs  # noqa: E402  (this directory)

FLAGS = flags.FLAGS
flags.DEFINE_list("groups", ["32", "128"], "Group sizes along the input dimension.")
flags.DEFINE_string("target", "v5e:2x2", "TPU topology (4 chips).")
flags.DEFINE_integer("rows", 8, "Activation rows (a decode batch).")

D, F = 4096, 14336


def variants(g: int, b: int):
    """name -> (function, argument specs as (shape, dtype, sharded axis or None))."""
    import jax.numpy as jnp

    n = D // g
    x = ((b, D), jnp.bfloat16, None)
    scales = [((n, 1, F), jnp.float32, 2)] * 2

    def before(x, q, s, z):
        return x @ (q.astype(x.dtype) * s.astype(x.dtype) + z.astype(x.dtype)).reshape(D, F)

    def before_f32(x, q, s, z):
        return x @ (q.astype(jnp.float32) * s + z).astype(x.dtype).reshape(D, F)

    def scale_before(x, q, s, z):
        sums = x.reshape(b, n, g).sum(-1)
        return x @ (q.astype(x.dtype) * s.astype(x.dtype)).reshape(D, F) + sums @ z[:, 0].astype(
            x.dtype)

    def after(x, q, s, z):
        xg = x.reshape(b, n, g)
        y = jnp.einsum("bng,ngf->bnf", xg, q.astype(x.dtype), preferred_element_type=jnp.float32)
        sums = xg.sum(-1).astype(jnp.float32)
        return (jnp.einsum("bnf,nf->bf", y, s[:, 0]) + sums @ z[:, 0]).astype(x.dtype)

    out = {"bf16": (lambda x, w: x @ w, [x, ((D, F), jnp.bfloat16, 1)]),
           "int8 per channel": (lambda x, q, s: (x @ q.astype(x.dtype)) * s.astype(x.dtype),
                                [x, ((D, F), jnp.int8, 1), ((F,), jnp.float32, 0)])}
    out[f"int8 g{g} (a) dequantize before"] = (before, [x, ((n, g, F), jnp.uint8, 2), *scales])
    for dt in (jnp.int4, jnp.uint4):
        q = ((n, g, F), dt, 2)
        name = f"{jnp.dtype(dt).name} g{g}"
        out[f"{name} (a) dequantize before"] = (before, [x, q, *scales])
        out[f"{name} (e) scales after"] = (after, [x, q, *scales])
    q = ((n, g, F), jnp.int4, 2)
    out[f"int4 g{g} (b) f32 before"] = (before_f32, [x, q, *scales])
    out[f"int4 g{g} (c) scale before"] = (scale_before, [x, q, *scales])
    out["int4 (d) convert only"] = (lambda x, q: x @ q.astype(x.dtype),
                                    [x, ((D, F), jnp.int4, 1)])
    return out


def compile_one(mesh, fn, specs) -> dict:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def sds(shape, dtype, axis):
        spec = [None] * len(shape)
        if axis is not None:
            spec[axis] = "model"
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))

    return costs(jax.jit(fn).lower(*(sds(*s) for s in specs)).compile())


def main(argv) -> int:
    del argv
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(FLAGS.target, platform="tpu")
    mesh = topologies.make_mesh(topo, (4,), ("model",))
    rows = {}
    for g in (int(v) for v in FLAGS.groups):
        for name, (fn, specs) in variants(g, FLAGS.rows).items():
            if name not in rows:
                rows[name] = compile_one(mesh, fn, specs)
    base = rows["bf16"]["bytes_accessed"]
    print("| weights | bytes accessed MB | vs bf16 | args MB | temp MB |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['bytes_accessed'] / 1e6:.1f} | {base / r['bytes_accessed']:.2f}x | "
              f"{r['argument_bytes'] / 1e6:.1f} | {r['temp_bytes'] / 1e6:.1f} |")
    print(json.dumps({"target": FLAGS.target, "rows_x": FLAGS.rows, "results": rows}))
    return 0


if __name__ == "__main__":
    app.run(main)
