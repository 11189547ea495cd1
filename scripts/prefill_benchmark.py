"""Prompt chunks through the ragged flash kernel against the XLA path: the prefill half of
`scripts/kernel_benchmark.py` (`--mode=prefill` / `--mode=deviceless`; its flags).

prefill: per (--chunks x --contexts) shape, one sequence whose last `chunk` tokens are new
(queries) over a `context`-token paged cache (pages permuted), K/V and the chunk already written.
Timed as kernel_benchmark's decode points (one warm-up, median of --repeats):
* pallas: `pallas_kernels.ragged_attention.ragged_paged_attention` (backend-dispatched; with
  --interpret the Triton kernel in interpret mode),
* xla: the engine's chunk path, `jaxinfer.model.attention.paged_attention_reference`,
* shipped: jax's own kernel where one applies, on the same values re-laid out before timing
  (`shipped_prefill`): on TPU `jax.experimental.pallas.ops.tpu.ragged_paged_attention` over the
  pool interleaved as its [pages, page_size, 2K, H] layout; on GPU (or --interpret) the Triton
  flash `ops.gpu.attention.mha`, which takes dense K/V with as many heads as q, so only a chunk
  that is the whole context (no paged prefix) with K/V gathered and repeated G times. Otherwise
  skipped with the reason.
FLOPs = 4 H N (attended (query, key) pairs: chunk (context - chunk) + chunk (chunk + 1) / 2),
bytes = the live K/V read once plus q and the output; both against the device's roofline.

deviceless: one layer's attention of a mixed step (`steps._mixed_descriptor` +
`attention.write_and_attend`: the K/V write and the attention of --batches[0] decode rows beside
a --chunks[0]-token chunk, every slot's table covering each --contexts length) compiled for
--topology (kv heads split over its chips, as the engine's tensor parallelism) with the XLA path
and with the Pallas kernels, and jax's own TPU ragged kernel for the same rows on its interleaved
pool (`_shipped_deviceless`); reports XLA's per-chip temporary bytes and cost analysis. XLA cannot
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


def shipped_prefill(chunk: int, context: int, interpret: bool):
    """(prep, fn, None) or (None, None, skip reason) for jax's shipped kernel at one shape.
    `prep(q, k_pages, v_pages, table)` re-lays the inputs out once, outside the timed calls;
    `fn(*prep(...))` -> the output in [chunk, K, G, H] order (maybe with K, G merged). jax's TPU
    ragged kernel does not run in interpret mode (its Mosaic DMA transforms fail in jax's TPU
    interpreter), so on CPU only the GPU one runs."""
    backend = jax.default_backend()
    if backend == "tpu" and not interpret:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            ragged_paged_attention as tpu_ragged,
        )

        def prep(q, k, v, table):
            kv = jnp.stack([k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3)], axis=3)
            return q, kv.reshape(kv.shape[:2] + (-1, kv.shape[-1])), table

        def fn(q, kv, table):
            n, nk, g, h = q.shape
            out = tpu_ragged(q.reshape(n, nk * g, h), kv, jnp.asarray([context], jnp.int32),
                             table, jnp.asarray([0, n], jnp.int32), jnp.asarray([1], jnp.int32),
                             sm_scale=h ** -0.5)
            return out.reshape(q.shape)
        return jax.jit(prep), jax.jit(fn), None
    if backend not in ("gpu", "cuda") and not interpret:
        return None, None, f"no shipped prefill kernel for backend {backend!r}"
    if chunk != context:
        return None, None, ("jax's GPU flash attention (ops.gpu.attention.mha) takes dense K/V "
                            "without a paged prefix: it applies only when chunk == context")
    from jax.experimental.pallas.ops.gpu.attention import mha

    def prep_dense(q, k, v, table):
        def dense(pages):  # [K, P, page, H] -> [1, context, K * G, H] in q's head order
            x = pages[:, table[0]].reshape(pages.shape[0], -1, pages.shape[-1])[:, :context]
            return jnp.repeat(x.transpose(1, 0, 2), q.shape[2], axis=1)[None]
        return q.reshape((1, q.shape[0], -1, q.shape[-1])), dense(k), dense(v)

    def fn_dense(q, k, v):
        return mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True,
                   interpret=interpret)[0]  # [chunk, K * G, H]
    return jax.jit(prep_dense), jax.jit(fn_dense), None


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

    return {"xla": jax.jit(xla), "pallas": jax.jit(pallas)}


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
            fns = {impl: (fn, args) for impl, fn in prefill_fns(chunk, context,
                                                                flags_.interpret).items()}
            prep, shipped, skip = shipped_prefill(chunk, context, flags_.interpret)
            if skip:
                results.append(dict(shape, impl="shipped", skipped=skip))
            else:
                fns["shipped"] = (shipped, jax.block_until_ready(prep(*args)))
            ref = None
            for impl, (fn, fn_args) in fns.items():  # xla first: the reference
                bench.log(f"chunk={chunk} ctx={context} {impl} ...")
                first, secs, out = bench.time_fn(fn, fn_args, flags_.repeats)
                out = out.reshape(args[0].shape).astype(jnp.float32)
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
        results.append(_shipped_deviceless(mesh, sds, b=b, chunk=chunk, context=context, k=k,
                                           g=g, h=h, page=page, dt=dt, bench=bench))
    return dict(mode="deviceless", topology=flags_.topology, jax_version=jax.__version__,
                num_kv_heads=k, q_per_kv=g, head_dim=h, page_size=page, dtype=dt.name,
                results=results)


def _shipped_deviceless(mesh, sds, *, b, chunk, context, k, g, h, page, dt, bench) -> dict:
    """jax's TPU ragged kernel compiled for the same rows (b decodes + one chunk, each over
    `context`) on its interleaved [pages, page, 2K, H] pool, kv heads split over the chips as
    ours (shard_map over the combined-heads axis: each chip keeps its K/V pairs together)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ragged_paged_attention as tpu_ragged,
    )
    from jax.sharding import PartitionSpec as P

    pages, n = context // page, b + chunk
    lens = [1] * b + [chunk]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)

    def kernel(q, kv, kv_lens, table, cu_q_lens, num_seqs):
        # Its untuned default blocks, given explicitly: its tuned-table lookup reads the local
        # device's kind, which a deviceless compile does not have.
        return tpu_ragged(q, kv, kv_lens, table, cu_q_lens, num_seqs, sm_scale=h ** -0.5,
                          num_kv_pages_per_block=min(pages, 128),
                          num_queries_per_block=min(n, 32))

    def f(q, kv, kv_lens, table):
        return jax.shard_map(kernel, in_specs=(P(None, "model"), P(None, None, "model")) +
                             (P(),) * 4, out_specs=P(None, "model"), check_vma=False)(
            q, kv, kv_lens, table, jnp.asarray(cu), jnp.asarray([b + 1], jnp.int32))

    args = (sds((n, k * g, h), dt, P(None, "model")),
            sds(((b + 1) * pages + 1, page, 2 * k, h), dt, P(None, None, "model")),
            sds((b + 1,), jnp.int32), sds((b + 1, pages), jnp.int32))
    bench.log(f"deviceless ctx={context} shipped (jax's TPU ragged_paged_attention) ...")
    try:
        with jax.set_mesh(mesh):
            c = jax.jit(f).trace(*args).lower().compile()
    except Exception as e:  # noqa: BLE001 - report why, do not fail the sweep
        return dict(impl="shipped", context=context, skipped=f"{type(e).__name__}: {e}"[:300])
    mem = c.memory_analysis()
    return dict(impl="shipped", context=context, decode_rows=b, chunk=chunk,
                temp_bytes=mem.temp_size_in_bytes, argument_bytes=mem.argument_size_in_bytes,
                kv_bytes=2 * (b + 1) * context * k * h * dt.itemsize // mesh.size)


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
