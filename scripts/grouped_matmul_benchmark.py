"""Grouped-matmul benchmark (`pallas_kernels.grouped_matmul`): XLA's forms against the dense
every-expert computation on this machine's CPU, and the TPU kernel's bytes accessed compiled
for a TPU without one against the experts a step touches.

--mode=cpu: for each M in --rows (token→expert rows; M / k tokens each routed to k distinct
experts of E drawn at random, the rows sorted by expert), the median time of --repeats calls,
interleaved round by round so the variants see the same machine load, of:
  * tiles:      `grouped_matmul_xla(form="tiles")` at its default row tile (`tile_rows`),
  * rows:       `grouped_matmul_xla(form="rows")` (XLA:GPU's decode form; XLA:CPU
                materialises the gathered [M, K, N] weights),
  * dense:      `grouped_matmul_reference` (every expert on every row, the tests' oracle),
  * ragged_dot: `jax.lax.ragged_dot` (what this jax lowers densely on CPU);
with --sweep also the tile loop at every tm in --tms. Weights [E, K, N] in --dtype. The
relative error is against the reference (above --dense_max_rows: the tile loop at tm 1).

--mode=tpu: `grouped_matmul` compiled (libtpu, no TPU) for --topology at Qwen3-30B-A3B's expert
shapes (E 128, k 8, D 2048, F 768; gate and up one [D, 2F] weight, down [F, D]) for each batch
in --batches (M = B k rows) and --weights: XLA's bytes accessed for the two matmuls against
the expert-touch model, E (1 - (1 - k / E)^B) experts' weights and scales (the kernel's
declared cost is told that count, `cost_groups`), plus x and the output.

A table, then one JSON line (the last line of stdout).

  python scripts/grouped_matmul_benchmark.py --mode=cpu
  python scripts/grouped_matmul_benchmark.py --mode=cpu --sweep --rows=64,256,2048,16384
  JAX_PLATFORMS=cpu python scripts/grouped_matmul_benchmark.py --mode=tpu --topology=v6e:2x2
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference  # noqa: E402
from pallas_kernels.grouped_matmul.xla import grouped_matmul_xla, tile_rows  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "cpu", ["cpu", "tpu"], "cpu: time XLA's forms; tpu: deviceless bytes.")
flags.DEFINE_list("rows", ["8", "16", "32", "64", "2048"], "cpu: M, token→expert rows.")
flags.DEFINE_integer("experts", 64, "cpu: E.")
flags.DEFINE_integer("top_k", 8, "cpu: experts per token k.")
flags.DEFINE_integer("k", 1024, "cpu: contraction K.")
flags.DEFINE_integer("n", 512, "cpu: output columns N.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "cpu: x and w dtype.")
flags.DEFINE_integer("repeats", 5, "cpu: timed rounds (each variant once per round).")
flags.DEFINE_integer("dense_max_rows", 2048, "cpu: skip rows, dense and ragged_dot above this "
                     "M (and check against the tile loop at tm 1 instead of the reference).")
flags.DEFINE_bool("sweep", False, "cpu: also the tile loop at every tm in --tms.")
flags.DEFINE_list("tms", ["1", "2", "4", "8", "16", "32", "64", "128"], "cpu: swept tm.")
flags.DEFINE_string("topology", "v5e:2x2", "tpu: TPU topology compiled for.")
flags.DEFINE_list("batches", ["1", "8", "64"], "tpu: decode batch B (M = B k).")
flags.DEFINE_list("weights", ["bfloat16", "int8", "int4"], "tpu: expert storage.")


def routed_sizes(m: int, e: int, k: int, rng) -> np.ndarray:
    """i32[E]: M rows of ceil(M / k) tokens each routed to k distinct experts (the last token's
    experts cut at M)."""
    tokens = -(-m // k)
    picks = np.concatenate([rng.choice(e, k, replace=False) for _ in range(tokens)])[:m]
    return np.bincount(picks, minlength=e).astype(np.int32)


def _seconds(fn, args) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t


def cpu_rows() -> list[dict]:
    e, k, n, dtype = FLAGS.experts, FLAGS.k, FLAGS.n, jnp.dtype(FLAGS.dtype)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(0, 0.05, (e, k, n)), dtype)
    out = []
    for m in map(int, FLAGS.rows):
        x = jnp.asarray(rng.normal(size=(m, k)), dtype)
        sizes = jnp.asarray(routed_sizes(m, e, FLAGS.top_k, rng))
        fns = {f"tiles (tm {tile_rows(m)})": functools.partial(grouped_matmul_xla)}
        if FLAGS.sweep:
            fns.update({f"tiles tm {tm}": functools.partial(grouped_matmul_xla, tm=int(tm))
                        for tm in FLAGS.tms if int(tm) <= m})
        if m <= FLAGS.dense_max_rows:  # these hold [M, K, N] or [E, M, K] temporaries
            fns["rows"] = functools.partial(grouped_matmul_xla, form="rows")
            fns["dense"] = grouped_matmul_reference
            fns["ragged_dot"] = functools.partial(jax.lax.ragged_dot,
                                                  preferred_element_type=jnp.float32)
        fns = {name: jax.jit(fn) for name, fn in fns.items()}
        # against the reference where it runs, else against the tile loop at tm 1
        oracle = grouped_matmul_reference if m <= FLAGS.dense_max_rows else functools.partial(
            grouped_matmul_xla, tm=1)
        want = jax.jit(oracle)(x, w, sizes).astype(jnp.float32)
        times = {name: [] for name in fns}
        errors = {}
        for name, fn in fns.items():  # compile and check outside the timed rounds
            got = fn(x, w, sizes).astype(jnp.float32)
            errors[name] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        for _ in range(FLAGS.repeats):
            for name, fn in fns.items():
                times[name].append(_seconds(fn, (x, w, sizes)))
        touched = int((sizes > 0).sum())
        for name in fns:
            out.append({"M": m, "tokens": -(-m // FLAGS.top_k), "experts_touched": touched,
                        "variant": name, "ms": 1e3 * statistics.median(times[name]),
                        "min_ms": 1e3 * min(times[name]), "rel_err": errors[name]})
            print(f"M {m}: {name} {out[-1]['ms']:.2f} ms", file=sys.stderr)
    return out


def _tpu_bytes(device, m: int, kind: str, shape: tuple[int, int], cost_groups: int) -> float:
    e = 128
    k, n = shape
    dtype = {"bfloat16": jnp.bfloat16, "int8": jnp.int8, "int4": jnp.int4}[kind]
    group = 128 if kind == "int4" else 0
    fields = [] if kind == "bfloat16" else [(e, k // group if group else 1, n)] * (
        2 if group else 1)
    sds = functools.partial(jax.ShapeDtypeStruct,
                            sharding=jax.sharding.SingleDeviceSharding(device))
    args = [sds((m, k), jnp.bfloat16), sds((e, k, n), dtype), sds((e,), jnp.int32)] + [
        sds(s, jnp.float32) for s in fields]

    def fn(x, w, sizes, *sz):
        return grouped_matmul(x, w, sizes, scale=sz[0] if sz else None,
                              zero=sz[1] if group else None, group=group,
                              offset=8 if group else 0, cost_groups=cost_groups)

    with jax.set_mesh(jax.sharding.Mesh(np.array([device]), ("x",))):
        compiled = jax.jit(fn).trace(*args).lower().compile()
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


def tpu_rows() -> list[dict]:
    from jax.experimental import topologies

    device = topologies.get_topology_desc(FLAGS.topology, platform="tpu").devices[0]
    e, k, d, f = 128, 8, 2048, 768
    out = []
    for b in map(int, FLAGS.batches):
        m = b * k
        touched = e * (1 - (1 - k / e) ** b)
        for kind in FLAGS.weights:
            bits = {"bfloat16": 16, "int8": 8, "int4": 4}[kind]
            measured = expected = 0.0
            for rows_k, n in ((d, 2 * f), (f, d)):  # gate/up, then down
                measured += _tpu_bytes(device, m, kind, (rows_k, n), round(touched))
                scales = 4 * n * {"bfloat16": 0, "int8": 1, "int4": 2 * rows_k // 128}[kind]
                expected += touched * (rows_k * n * bits / 8 + scales) + 2 * m * (rows_k + n)
            out.append({"topology": FLAGS.topology, "B": b, "M": m, "weights": kind,
                        "experts_touched": touched, "expected_bytes": expected,
                        "xla_bytes": measured, "ratio": measured / expected})
            print(f"B {b} {kind}: {measured / 1e6:.1f} MB vs {expected / 1e6:.1f} MB",
                  file=sys.stderr)
    return out


def main(argv):
    del argv
    rows = cpu_rows() if FLAGS.mode == "cpu" else tpu_rows()
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v)
                                for v in r.values()) + " |")
    meta = {"mode": FLAGS.mode, "backend": jax.default_backend(), "jax": jax.__version__}
    if FLAGS.mode == "cpu":
        meta.update(E=FLAGS.experts, k=FLAGS.top_k, K=FLAGS.k, N=FLAGS.n, dtype=FLAGS.dtype,
                    repeats=FLAGS.repeats, cpus=os.cpu_count())
    print(json.dumps({**meta, "rows": rows}))


if __name__ == "__main__":
    app.run(main)
