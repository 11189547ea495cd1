"""What one speculative verification costs against one plain decode step, on the real model.

Batch 1 (a 1-slot engine), the default model (SmolLM2-135M-Instruct, f32), a row at context
`--pos`: the engine's `mixed_step` decoding one token, then `verify_step` at every width the
n-gram drafter can use for R = `--num_spec` (1, 2, 4, ..., R: the step's longest draft picks the
smallest that covers it). Each is timed end to end (dispatch to host result), median of
`--repeats` calls after two warm ones, round-robin over the steps.

  python scripts/verify_cost.py                    # R = 5: widths 1, 2, 4, 5
  python scripts/verify_cost.py --num_spec=7 --pos=100
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import app, flags

from jaxinfer import flags as jflags
from jaxinfer import steps
from jaxinfer.config import CacheConfig, EngineConfig, RunConfig
from jaxinfer.engine import LLM, _batch
from jaxinfer.kv_cache import pages_bucket
from jaxinfer.loading import load_model

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_spec", 5, "R: the widest verification.")
flags.DEFINE_integer("pos", 300, "Context length of the row (its newest token's position).")
flags.DEFINE_integer("repeats", 30, "Timed calls per step (the median is reported).")
jflags.define_compilation_cache_flag()


def _median_ms(steps_: dict, repeats: int) -> dict:
    """Median ms per call of each step, timed round-robin (one call of each in turn, so that
    this shared machine's load drifts affect all of them alike), after two warm calls each."""
    for f in steps_.values():
        jax.block_until_ready(f())
        jax.block_until_ready(f())
    times = {name: [] for name in steps_}
    for _ in range(repeats):
        for name, f in steps_.items():
            t0 = time.perf_counter()
            jax.device_get(f())
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) * 1e3 for name, t in times.items()}


def main(argv):
    del argv
    jflags.use_compilation_cache(0.5)
    model, _ = load_model(RunConfig(dtype="float32"))
    r, pos = FLAGS.num_spec, FLAGS.pos
    eng = LLM(model, None, cache=CacheConfig(max_seq_len=max(1024, pos + r + 1)),
              engine=EngineConfig(max_slots=1, speculative_method="ngram",
                                  num_speculative_tokens=r)).engine
    c = eng.cache_config
    pages = pages_bucket(pos + r + 1, c.page_size, c.pages_per_seq)
    table = np.zeros((1, c.pages_per_seq), np.int32)
    table[0, :pages] = np.arange(pages)
    one = np.ones((1,), bool)
    at = np.full((1,), pos, np.int32)

    def plain():
        return eng._run_step(_batch(table, one, at, np.zeros((0,), np.int32), 0, 0, 0, False,
                                    False, 0), pages)

    def verify(width):
        vb = steps.VerifyBatch(page_table=table, active=one, pos=at,
                               draft_ids=np.ones((1, width), np.int32),
                               num_draft=np.full((1,), width, np.int32))
        eng.kv, eng.state, out = steps.verify_step(
            eng.graph, eng.params, eng.kv, eng.state, eng._sampling, vb, None,
            num_pages_read=pages, num_top_logprobs=eng.engine_config.max_top_logprobs,
            attention_impl=eng.attention_impl)
        return out

    kinds = {"plain decode": plain}
    for width in eng.spec_widths():
        kinds[f"verify, width {width}"] = lambda w=width: verify(w)
    ms = _median_ms(kinds, FLAGS.repeats)
    print(f"batch 1, context {pos}, {jax.default_backend()}")
    print(f"{'step':>20} {'ms':>7} {'vs decode':>9}")
    for name, t in ms.items():
        print(f"{name:>20} {t:7.1f} {t / ms['plain decode']:8.2f}x")


if __name__ == "__main__":
    app.run(main)
