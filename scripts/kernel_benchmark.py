"""Paged decode attention micro-benchmark: our Pallas kernel vs jax's shipped kernel vs XLA.

For each shape (B x context from --batches x --contexts; every row at the full context, pages in a
random permuted order) it times, after one untimed warm-up call and with block_until_ready, the
median of --repeats calls of:

* pallas:  `pallas_kernels.paged_attention.paged_decode_attention` (backend-dispatched; with
  --interpret, `paged_decode_attention_gpu(..., interpret=True)` so CPU runs the kernel body),
* shipped: jax's own kernel for the backend (GPU: jax.experimental.pallas.ops.gpu.paged_attention,
  TPU: jax.experimental.pallas.ops.tpu.paged_attention; q as [B, K*G, H] kv-major, pre-scaled by
  1/sqrt(H) since those kernels do not scale). Skipped with a reason when T > 1 or unavailable,
* xla:     `paged_decode_attention_reference` under jax.jit.

Reported per shape and impl: bytes of live KV read (2 * B * context * K * H * itemsize), time
(us), achieved GB/s, fraction of the device's HBM bandwidth (jaxinfer.perf.roofline chips; on CPU
the quickly measured host bandwidth) and max abs error vs the reference. A table, then exactly one
JSON line (the last line of stdout). Progress goes to stderr.

  python scripts/kernel_benchmark.py                                   # GPU / TPU defaults
  python scripts/kernel_benchmark.py --interpret --batches=2 --contexts=256 --num_kv_heads=2 \\
      --q_per_kv=2 --head_dim=64 --repeats=2 --dtype=float32          # CPU smoke (timings moot)

`--mode=prefill` and `--mode=deviceless` (prompt chunks through the ragged flash kernel against
the XLA path, timed or compiled for a TPU topology) are in `scripts/prefill_benchmark.py`.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxinfer.perf import roofline
from pallas_kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from pallas_kernels.paged_attention.gpu import paged_decode_attention_gpu

FLAGS = flags.FLAGS
flags.DEFINE_enum("mode", "decode", ["decode", "prefill", "deviceless"],
                  "decode: the paged decode kernels (below); prefill: one prompt chunk of each "
                  "--chunks length ending each --contexts prefix, through the ragged flash kernel "
                  "and the XLA path; deviceless: compile one layer's mixed-step attention for "
                  "--topology without a device and compare XLA's memory and cost analyses.")
flags.DEFINE_list("chunks", ["512"], "Prefill: prompt-chunk lengths.")
flags.DEFINE_string("topology", "v5e:2x2", "Deviceless: TPU topology compiled for.")
flags.DEFINE_list("batches", ["8", "32"], "Batch sizes B.")
flags.DEFINE_list("contexts", ["2048", "8192"], "Context lengths (every row at full length).")
flags.DEFINE_integer("num_kv_heads", 8, "KV heads K.")
flags.DEFINE_integer("q_per_kv", 4, "Query heads per KV head G.")
flags.DEFINE_integer("head_dim", 128, "Head dim H.")
flags.DEFINE_integer("page_size", 16, "Tokens per page.")
flags.DEFINE_string("dtype", "bfloat16", "q / KV dtype.")
flags.DEFINE_integer("repeats", 20, "Timed calls per point (median reported).")
flags.DEFINE_integer("query_len", 1, "New tokens T per row (1 = decode).")
flags.DEFINE_list("impls", ["pallas", "shipped", "xla"], "Implementations: pallas,shipped,xla.")
flags.DEFINE_bool("interpret", False, "Run kernels in Pallas interpret mode (CPU smoke runs).")
flags.DEFINE_float("max_seconds", None, "Stop starting new shapes after this many seconds.")
flags.DEFINE_integer("seed", 0, "RNG seed.")

IMPLS = ("pallas", "shipped", "xla")

# Substring of jax.devices()[0].device_kind (lower-cased) -> roofline.CHIPS entry.
_KIND_TO_CHIP = (("h200", "h200"), ("h100", "h100-sxm"), ("v5 lite", "tpu-v5e"),
                 ("v5e", "tpu-v5e"), ("v5p", "tpu-v5p"), ("v6", "tpu-v6e"), ("v4", "tpu-v4"))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def device_bandwidth() -> tuple[str, float | None, str]:
    """(device kind, HBM bytes/s or None, where the number came from)."""
    dev = jax.devices()[0]
    kind = dev.device_kind
    if dev.platform == "cpu":
        bw = roofline.measure_host_cpu(quick=True)["hbm_bytes_per_s"]
        return kind, bw, "measure_host_cpu(quick=True)"
    low = kind.lower()
    for sub, name in _KIND_TO_CHIP:
        if sub in low:
            return kind, roofline.chip(name).hbm_bytes_per_s, f"roofline.CHIPS[{name!r}]"
    return kind, None, "unknown device kind"


def make_inputs(batch, context, *, num_kv_heads, q_per_kv, head_dim, page_size, query_len,
                dtype, seed):
    """Random q / pages; every row at `context` tokens; a random permutation of pages."""
    if context % page_size:
        raise ValueError(f"context {context} must be a multiple of page_size {page_size}")
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq
    rng = np.random.default_rng(seed)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, query_len, num_kv_heads, q_per_kv, head_dim), dtype)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages = jax.random.normal(kk, shape, dtype)
    v_pages = jax.random.normal(kv, shape, dtype)
    table = rng.permutation(num_pages).reshape(batch, pages_per_seq).astype(np.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    return q, k_pages, v_pages, lengths, jnp.asarray(table)


def shipped_fn(backend: str, interpret: bool, query_len: int):
    """(fn taking our layout and returning [B, T, K, G, H], None) or (None, skip reason)."""
    if query_len != 1:
        return None, f"shipped kernels are decode-only (T=1); got T={query_len}"
    try:
        if backend == "tpu" and not interpret:
            from jax.experimental.pallas.ops.tpu import paged_attention as mod

            def call(q, k, v, lengths, table, ppcb):
                return mod.paged_attention(q, k, v, lengths, table,
                                           pages_per_compute_block=ppcb)
        elif backend in ("gpu", "cuda") or interpret:
            from jax.experimental.pallas.ops.gpu import paged_attention as mod

            def call(q, k, v, lengths, table, ppcb):
                return mod.paged_attention(q, k, v, table, lengths,
                                           pages_per_compute_block=ppcb, interpret=interpret)
        else:
            return None, f"no shipped paged attention kernel for backend {backend!r}"
    except Exception as e:  # noqa: BLE001 - report why, do not fail the run
        return None, f"shipped kernel unavailable: {type(e).__name__}: {e}"

    def fn(q, k_pages, v_pages, lengths, page_table):
        b, t, nk, g, h = q.shape
        q2 = (q.reshape(b, nk * g, h).astype(jnp.float32) / np.sqrt(h)).astype(q.dtype)
        ppcb = next(c for c in (8, 4, 2, 1) if page_table.shape[1] % c == 0)
        return call(q2, k_pages, v_pages, lengths, page_table, ppcb).reshape(b, t, nk, g, h)

    return fn, None


def time_fn(fn, args, repeats: int) -> tuple[float, float, jax.Array]:
    """(compile+first call seconds, median seconds of `repeats` calls, output)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), out


def _measure(row: dict, fn, skip: str | None, *, args, ref, repeats: int, bw) -> dict:
    """`row` (one shape and impl) with fn's timing, bandwidth and error against `ref`, or the
    reason it was skipped (fn None: `skip`; or the exception it raised)."""
    if fn is None:
        log(f"  skipped ({skip})")
        return dict(row, skipped=skip)
    try:
        first, secs, out = time_fn(fn, args, repeats)
    except Exception as e:  # noqa: BLE001 - one failing impl must not end the sweep
        log(f"  failed: {type(e).__name__}")
        return dict(row, skipped=f"failed: {type(e).__name__}: {str(e)[:300]}")
    kv_bytes = row["kv_bytes"]
    return dict(row, first_call_s=first, time_us=secs * 1e6, gb_per_s=kv_bytes / secs / 1e9,
                bw_fraction=(roofline.bandwidth_fraction(kv_bytes, secs, bw) if bw else None),
                max_abs_err=(None if row["impl"] == "xla" else float(
                    jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))))


def run(*, batches, contexts, num_kv_heads, q_per_kv, head_dim, page_size, dtype, repeats,
        query_len, impls, interpret, max_seconds=None, seed=0) -> dict:
    """Runs the sweep; returns the JSON-able summary (shapes, results, device, bandwidth)."""
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise ValueError(f"unknown impls {unknown}; valid: {list(IMPLS)}")
    backend = jax.default_backend()
    kind, bw, bw_source = device_bandwidth()
    dt = jnp.dtype(dtype)
    if interpret:
        pallas = jax.jit(functools.partial(paged_decode_attention_gpu, interpret=True))
    else:
        pallas = jax.jit(paged_decode_attention)
    shipped, shipped_skip = shipped_fn(backend, interpret, query_len)
    if shipped is not None:
        shipped = jax.jit(shipped)
    xla = jax.jit(paged_decode_attention_reference)
    fns = {"pallas": (pallas, None), "shipped": (shipped, shipped_skip), "xla": (xla, None)}

    start = time.perf_counter()
    shapes, results = [], []
    for batch in batches:
        for context in contexts:
            if max_seconds is not None and time.perf_counter() - start > max_seconds:
                log(f"--max_seconds={max_seconds} reached; skipping B={batch} ctx={context}")
                continue
            shape = dict(batch=batch, context=context, num_kv_heads=num_kv_heads,
                         q_per_kv=q_per_kv, head_dim=head_dim, page_size=page_size,
                         query_len=query_len, dtype=dt.name)
            shapes.append(shape)
            args = make_inputs(batch, context, num_kv_heads=num_kv_heads, q_per_kv=q_per_kv,
                               head_dim=head_dim, page_size=page_size, query_len=query_len,
                               dtype=dt, seed=seed)
            kv_bytes = 2 * batch * context * num_kv_heads * head_dim * dt.itemsize
            ref = jax.block_until_ready(xla(*args)).astype(jnp.float32)
            for impl in impls:
                log(f"B={batch} ctx={context} {impl} ...")
                results.append(_measure(dict(shape, impl=impl, kv_bytes=kv_bytes), *fns[impl],
                                        args=args, ref=ref, repeats=repeats, bw=bw))
    return dict(device_kind=kind, backend=backend, hbm_bytes_per_s=bw,
                hbm_bytes_per_s_source=bw_source, jax_version=jax.__version__,
                interpret=interpret, shapes=shapes, results=results,
                note=("interpret mode / CPU: timings are meaningless, only errors count"
                      if interpret or backend == "cpu" else None))


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(summary: dict) -> None:
    print(f"device: {summary['device_kind']} ({summary['backend']}), HBM "
          f"{_fmt(summary['hbm_bytes_per_s'] and summary['hbm_bytes_per_s'] / 1e9, '.0f')} GB/s "
          f"from {summary['hbm_bytes_per_s_source']}, jax {summary['jax_version']}")
    if summary["note"]:
        print(f"NOTE: {summary['note']}")
    hdr = (f"{'B':>4} {'ctx':>6} {'impl':>8} {'KV MiB':>9} {'time us':>10} {'GB/s':>8} "
           f"{'frac':>6} {'max|err|':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in summary["results"]:
        head = f"{r['batch']:>4} {r['context']:>6} {r['impl']:>8} {r['kv_bytes'] / 2**20:>9.2f}"
        if "skipped" in r:
            print(f"{head}  skipped: {r['skipped']}")
            continue
        print(f"{head} {r['time_us']:>10.1f} {r['gb_per_s']:>8.1f} "
              f"{_fmt(r['bw_fraction'], '.3f'):>6} {_fmt(r['max_abs_err'], '.2e'):>9}")


def main(argv):
    del argv
    if FLAGS.mode != "decode":
        from prefill_benchmark import main_prefill  # scripts/ is on sys.path

        return main_prefill(FLAGS, sys.modules[__name__])
    summary = run(batches=[int(b) for b in FLAGS.batches],
                  contexts=[int(c) for c in FLAGS.contexts],
                  num_kv_heads=FLAGS.num_kv_heads, q_per_kv=FLAGS.q_per_kv,
                  head_dim=FLAGS.head_dim, page_size=FLAGS.page_size, dtype=FLAGS.dtype,
                  repeats=FLAGS.repeats, query_len=FLAGS.query_len, impls=FLAGS.impls,
                  interpret=FLAGS.interpret, max_seconds=FLAGS.max_seconds, seed=FLAGS.seed)
    print_table(summary)
    summary["argv"] = sys.argv
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    app.run(main)
