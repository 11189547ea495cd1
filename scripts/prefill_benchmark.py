"""Prompt chunks through the ragged flash kernel against the XLA path: the prefill half of
`scripts/kernel_benchmark.py` (`--mode=prefill` / `--mode=deviceless`; its flags).

prefill: per (--chunks x --contexts) shape, one sequence whose last `chunk` tokens are new
(queries) over a `context`-token paged cache (pages permuted), K/V and the chunk already written.
Timed as kernel_benchmark's decode points (one warm-up, median of --repeats):
* pallas: `pallas_kernels.ragged_attention.ragged_paged_attention` (backend-dispatched; with
  --interpret the Triton kernel in interpret mode),
* xla: the engine's chunk path, `jaxinfer.model.attention.paged_attention_reference`,
* shipped: skipped with the reason: jax's flash / splash kernels take dense K/V (no paged
  prefix), and its TPU ragged_paged_attention a [pages, page_size, 2K, H] pool of interleaved
  K/V, not this layout, so none runs on the same inputs.
FLOPs = 4 H N (attended (query, key) pairs: chunk (context - chunk) + chunk (chunk + 1) / 2),
bytes = the live K/V read once plus q and the output; both against the device's roofline.

deviceless: one layer's attention of a mixed step (`steps._mixed_descriptor` +
`attention.write_and_attend`: the K/V write and the attention of --batches[0] decode rows beside
a --chunks[0]-token chunk, every slot's table covering each --contexts length) compiled for
--topology (kv heads split over its chips, as the engine's tensor parallelism) with the XLA path
and with the Pallas kernels; reports XLA's per-chip temporary bytes and cost analysis. XLA cannot
see inside a Mosaic kernel: its FLOPs and bytes for the Pallas variant cover the surrounding
program only (the kernel's own traffic is the K/V read once, printed as `kv_bytes`).

  python scripts/kernel_benchmark.py --mode=prefill --chunks=512 --contexts=4096     # GPU / TPU
  python scripts/kernel_benchmark.py --mode=deviceless --batches=8 --chunks=512 \\
      --contexts=2048,4096,8192                                                        # any host
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.attention import paged_attention_reference
from pallas_kernels.ragged_attention import ragged_paged_attention
from pallas_kernels.ragged_attention.gpu import ragged_paged_attention_gpu

SHIPPED_SKIP = ("jax's flash/splash attention take dense K/V without a paged prefix; its TPU "
                "ragged_paged_attention takes a [pages, page_size, 2K, H] interleaved pool")


def prefill_inputs(chunk, context, *, num_kv_heads, q_per_kv, head_dim, page_size, dtype, seed):
    """(q [chunk, K, G, H], k_pages, v_pages [K, pages + 1, page, H], table i32[1, pages])."""
    pages = -(-context // page_size)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (chunk, num_kv_heads, q_per_kv, head_dim), dtype)
    shape = (num_kv_heads, pages + 1, page_size, head_dim)  # + the engine's trash page
    table = np.random.default_rng(seed).permutation(pages)[None].astype(np.int32)
    return (q, jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype),
            jnp.asarray(table))


def prefill_fns(chunk, context, interpret: bool):
    """{impl: fn(q, k_pages, v_pages, table) -> [chunk, K, G, H]} for one shape."""
    lens = jnp.asarray([context], jnp.int32)
    starts, q_lens = jnp.zeros((1,), jnp.int32), jnp.asarray([chunk], jnp.int32)
    kernel = (functools.partial(ragged_paged_attention_gpu, interpret=True) if interpret
              else ragged_paged_attention)

    def pallas(q, k, v, table):
        return kernel(q, k, v, lens, table, starts, q_lens)

    def xla(q, k, v, table):
        positions = jnp.arange(context - chunk, context, dtype=jnp.int32)[None]
        return paged_attention_reference(q[None], k, v, table, positions, lens,
                                         num_pages_read=table.shape[1])[0]

    return {"pallas": jax.jit(pallas), "xla": jax.jit(xla)}


def run_prefill(flags_, bench) -> dict:
    kind, bw, bw_source = bench.device_bandwidth()
    dt = jnp.dtype(flags_.dtype)
    from jaxinfer.perf import roofline

    name = next((n for sub, n in bench._KIND_TO_CHIP if sub in kind.lower()), None)
    peak = roofline.chip(name).peak_flops(dt.name) if name else None
    k, g, h = flags_.num_kv_heads, flags_.q_per_kv, flags_.head_dim
    results = []
    for chunk in map(int, flags_.chunks):
        for context in map(int, flags_.contexts):
            args = prefill_inputs(chunk, context, num_kv_heads=k, q_per_kv=g, head_dim=h,
                                  page_size=flags_.page_size, dtype=dt, seed=flags_.seed)
            pairs = chunk * (context - chunk) + chunk * (chunk + 1) // 2
            flops = 4 * h * k * g * pairs
            nbytes = (2 * context * k * h + 2 * chunk * k * g * h) * dt.itemsize
            shape = dict(chunk=chunk, context=context, num_kv_heads=k, q_per_kv=g, head_dim=h,
                         page_size=flags_.page_size, dtype=dt.name, flops=flops, bytes=nbytes)
            results.append(dict(shape, impl="shipped", skipped=SHIPPED_SKIP))
            fns = prefill_fns(chunk, context, flags_.interpret)
            ref = None
            for impl in ("xla", "pallas"):
                bench.log(f"chunk={chunk} ctx={context} {impl} ...")
                first, secs, out = bench.time_fn(fns[impl], args, flags_.repeats)
                out = out.astype(jnp.float32)
                ref = out if ref is None else ref
                results.append(dict(
                    shape, impl=impl, first_call_s=first, time_us=secs * 1e6,
                    tflop_per_s=flops / secs / 1e12, gb_per_s=nbytes / secs / 1e9,
                    flops_fraction=flops / secs / peak if peak else None,
                    bw_fraction=nbytes / secs / bw if bw else None,
                    max_abs_err_vs_xla=float(jnp.max(jnp.abs(out - ref)))))
    return dict(mode="prefill", device_kind=kind, hbm_bytes_per_s=bw,
                hbm_bytes_per_s_source=bw_source, peak_flops=peak, jax_version=jax.__version__,
                interpret=flags_.interpret, results=results)


def _mixed_attention(impl: str, num_pages_read: int):
    """One layer's attention of a mixed step: (q, k, v, k_pages, v_pages, batch, last_tokens)
    -> (out, k_pages, v_pages), as the model runs it."""
    from jaxinfer.engine.steps import _mixed_descriptor
    from jaxinfer.model.attention import write_and_attend

    def f(q, k, v, k_pages, v_pages, batch, last_tokens):
        step = _mixed_descriptor(batch, last_tokens, num_pages_read=num_pages_read,
                                 attention_impl=impl)
        return write_and_attend(q, k, v, k_pages, v_pages, step, sliding_window=None)

    return f


def run_deviceless(flags_, bench) -> dict:
    """Compiles `_mixed_attention` for the TPU topology at each context; XLA's analyses."""
    import os

    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxinfer.engine.steps import MixedBatch

    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold it
    topo = topologies.get_topology_desc(flags_.topology, platform="tpu")
    mesh = topologies.make_mesh(topo, (len(topo.devices),), ("model",))
    b, chunk = int(flags_.batches[0]), int(flags_.chunks[0])
    k, g, h, page, dt = (flags_.num_kv_heads, flags_.q_per_kv, flags_.head_dim,
                         flags_.page_size, jnp.dtype(flags_.dtype))

    def sds(shape, dtype, spec=None):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or P()))

    results = []
    for context in map(int, flags_.contexts):
        pages = context // page
        n = b + chunk
        pool = sds((k, b * pages + 1, page, h), dt, P("model"))
        batch = jax.tree.map(lambda a: sds(np.shape(a), np.asarray(a).dtype),
                             MixedBatch.idle(b, pages, chunk))
        args = (sds((n, k, g, h), dt, P(None, "model")), sds((n, k, h), dt, P(None, "model")),
                sds((n, k, h), dt, P(None, "model")), pool, pool, batch, sds((b,), jnp.int32))
        for impl in ("xla", "pallas"):
            bench.log(f"deviceless {flags_.topology} ctx={context} {impl} ...")
            with jax.set_mesh(mesh):
                c = jax.jit(_mixed_attention(impl, pages), donate_argnums=(3, 4)).trace(
                    *args).lower().compile()
            mem, cost = c.memory_analysis(), c.cost_analysis() or {}
            if isinstance(cost, list):
                cost = cost[0]
            results.append(dict(
                impl=impl, context=context, decode_rows=b, chunk=chunk,
                temp_bytes=mem.temp_size_in_bytes, argument_bytes=mem.argument_size_in_bytes,
                flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"),
                kv_bytes=2 * (b + 1) * context * k * h * dt.itemsize // len(topo.devices)))
    return dict(mode="deviceless", topology=flags_.topology, jax_version=jax.__version__,
                num_kv_heads=k, q_per_kv=g, head_dim=h, page_size=page, dtype=dt.name,
                results=results)


def _table(summary: dict) -> None:
    rows = summary["results"]
    keys = []
    for r in rows:
        keys += [key for key in r if key not in keys and key not in (
            "num_kv_heads", "q_per_kv", "head_dim", "page_size", "dtype", "skipped")]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[key]:.4g}" if isinstance(r.get(key), float) else str(r.get(key, "-"))
                         for key in keys))


def main_prefill(flags_, bench) -> int:
    """`bench`: the running kernel_benchmark module (its flags, timer, device lookup)."""
    run = run_prefill if flags_.mode == "prefill" else run_deviceless
    summary = run(flags_, bench)
    print({k: v for k, v in summary.items() if k != "results"})
    for r in summary["results"]:
        if "skipped" in r:
            print(f"{r['impl']} skipped: {r['skipped']}")
    _table(summary)
    summary["argv"] = sys.argv
    print(json.dumps(summary), flush=True)
    return 0
