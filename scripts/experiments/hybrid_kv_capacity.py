"""How many 8k-token sequences of a Gemma-3-shaped model fit a fixed KV pool, with a hybrid pool
(sliding-window layers hold only their window's pages) and with full-length pages for every
layer. No weights, no device: the pools' bytes come from `kv_cache.create_cache` under
`jax.eval_shape` (the arrays the engine would allocate), and the sequences are run through the
engine's real host allocator (`Scheduler`, one `PagePool` per pool) on a simulated device.

The budget is the pool of --budget_seqs full-length sequences. The hybrid pools take the largest
number of slots whose global pool (a full-length page table per slot) plus local pool (the
engine's default, `local_pages_bound(window, page_size, chunk)` per slot) fit those bytes. Then
2x that many requests of --seq_len tokens are served with twice the slots and a token budget
that lets every running request prefill a chunk each step (the pool, not the budget, stops
them: a request is admitted once its prompt fits beside the running ones', and with no
admission watermark, so the whole pool counts), and the most that sit at full length at once
(all their prompt in the cache, decoding) is the measured capacity.

  python scripts/experiments/hybrid_kv_capacity.py --model=gemma3-270m

Reproduces docs/benchmarks.md, "Hybrid KV pool": 8k-token sequences at once, hybrid against
full-length pages, at prefill chunks 256 and 16.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jaxinfer.config import CacheConfig, local_pages_bound  # noqa: E402
from jaxinfer.engine.kv_cache import create_cache  # noqa: E402
from jaxinfer.engine.request import Request  # noqa: E402
from jaxinfer.engine.sched_state import SchedulerConfig
from jaxinfer.engine.scheduler import Scheduler  # noqa: E402
from jaxinfer.perf import planner  # noqa: E402

flags.DEFINE_string("model", "gemma3-270m", "Planner preset (a Gemma-3-shaped one).")
flags.DEFINE_integer("seq_len", 8192, "Tokens per sequence (prompt + generated).")
flags.DEFINE_integer("decode_tokens", 64, "Of them generated (the rest is the prompt).")
flags.DEFINE_integer("page_size", 16, "KV page size.")
flags.DEFINE_integer("chunk", 256, "Prefill chunk (the engine's default).")
flags.DEFINE_integer("budget_seqs", 16, "Pool bytes = this many full-length sequences.")
FLAGS = flags.FLAGS


def pool_bytes(model, cache: CacheConfig, slots: int) -> int:
    """Bytes of the device pool `create_cache` allocates (abstractly: nothing is allocated)."""
    shapes = jax.eval_shape(lambda: create_cache(model, cache, slots))
    return sum(math.prod(a.shape) * a.dtype.itemsize
               for a in jax.tree.leaves((shapes.k_pages, shapes.v_pages)))


def caches(model) -> dict[str, tuple[CacheConfig, int]]:
    """The full-length pool of the budget, and the hybrid one of the most slots in its bytes."""
    base = CacheConfig(page_size=FLAGS.page_size, max_seq_len=FLAGS.seq_len)
    per_seq = base.pages_per_seq
    full = CacheConfig(page_size=FLAGS.page_size, max_seq_len=FLAGS.seq_len, hybrid=False,
                       num_pages=FLAGS.budget_seqs * per_seq)
    budget = pool_bytes(model, full, 1)
    local = local_pages_bound(base.local_window(model), FLAGS.page_size, FLAGS.chunk)

    def hybrid(slots: int) -> CacheConfig:
        return CacheConfig(page_size=FLAGS.page_size, max_seq_len=FLAGS.seq_len,
                           num_pages=slots * per_seq, num_local_pages=slots * local)

    slots = planner.largest_fitting(lambda s: pool_bytes(model, hybrid(s), 1) <= budget)
    return {"full-length": (full, FLAGS.budget_seqs), "hybrid": (hybrid(slots), slots)}


def serve(model, cache: CacheConfig, slots: int) -> dict:
    """2 x `slots` requests through the real allocator; the most at full length at once."""
    window = cache.local_window(model)
    sched = Scheduler(SchedulerConfig(
        max_slots=2 * slots, token_budget=2 * slots * FLAGS.chunk, chunk_size=FLAGS.chunk,
        page_size=cache.page_size, num_pages=cache.num_pages, pages_per_seq=cache.pages_per_seq,
        enable_prefix_caching=False, window=window, watermark=0.0,
        num_local_pages=cache.num_local_pages if window is not None else 0))
    prompt_len = FLAGS.seq_len - FLAGS.decode_tokens
    for i in range(2 * slots):
        sched.add(Request(request_id=str(i), prompt_ids=[i % 50000] * prompt_len,
                          max_new_tokens=FLAGS.decode_tokens))
    at_full, most_local, steps = 0, 0, 0
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update([(c.request, 0) for c in out.chunks if c.samples])
        steps += 1
        at_full = max(at_full, sum(r.num_computed >= prompt_len for r in sched.running))
        most_local = max([most_local] + [sum(p is not None for p in r.local_pages)
                                         for r in sched.running])
    sched.check_invariants()
    return {"at_full_length": at_full, "preemptions": sched.num_preemptions, "steps": steps,
            "most_local_pages_per_seq": most_local, "pages_per_seq": cache.pages_per_seq}


def main(argv):
    del argv
    model = planner.model_preset(FLAGS.model)
    local = sum(model.is_local(i) for i in range(model.num_layers))
    print(f"{FLAGS.model}: {model.num_layers} layers ({local} local, window "
          f"{model.sliding_window}), {FLAGS.seq_len}-token sequences, page {FLAGS.page_size}")
    rows = {}
    for name, (cache, slots) in caches(model).items():
        t = time.perf_counter()
        rows[name] = {"slots_sized": slots, "pool_bytes": pool_bytes(model, cache, 1),
                      "num_pages": cache.num_pages, "num_local_pages": cache.num_local_pages,
                      **serve(model, cache, slots), "seconds": time.perf_counter() - t}
    print(f"{'pool':>12} {'GiB':>7} {'global pages':>12} {'local pages':>11} "
          f"{'8k seqs at once':>15} {'preemptions':>11} {'local pages/seq':>15}")
    for name, r in rows.items():
        print(f"{name:>12} {r['pool_bytes'] / 2**30:7.3f} {r['num_pages']:12d} "
              f"{r['num_local_pages'] or 0:11d} {r['at_full_length']:15d} "
              f"{r['preemptions']:11d} {r['most_local_pages_per_seq']:15d}")
    ratio = rows["hybrid"]["at_full_length"] / rows["full-length"]["at_full_length"]
    print(f"hybrid / full-length: {ratio:.2f}x")
    print(json.dumps({"model": FLAGS.model, "seq_len": FLAGS.seq_len,
                      "page_size": FLAGS.page_size, "ratio": ratio, **rows}))


if __name__ == "__main__":
    app.run(main)
