"""Structured-output costs on the default model: host mask filling per step at several batch
sizes, and decode throughput with and without constrained requests (the synchronous step).

    python scripts/constraint_benchmark.py --batches=1,8 --mask_batches=1,8,32

Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import time

import numpy as np
from absl import app, flags

from jaxinfer import CacheConfig, EngineConfig, RunConfig, SamplingConfig, load_llm
from jaxinfer.engine.constraints import ConstraintCompiler, all_allowed

flags.DEFINE_list("batches", ["1", "8"], "Decode batch sizes for the sync-cost runs.")
flags.DEFINE_list("mask_batches", ["1", "8", "32"], "Batch sizes for mask filling.")
flags.DEFINE_integer("decode_tokens", 48, "Tokens per request in the decode runs.")
FLAGS = flags.FLAGS
SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
    "score": {"type": "number"}}, "required": ["name", "tags", "score"]})
ANY = r"[\s\S]*"  # allows every text: isolates the synchronous step from the model's choices


def mask_fill_ms(compiler: ConstraintCompiler, batch: int, steps: int = 40) -> float:
    """Median ms to fill `batch` JSON-schema masks, the matchers advanced along a real output."""
    factory = compiler.compile(SamplingConfig(json_schema=SCHEMA))
    text = '{"name":"Ada Lovelace","tags":["a","b","c","a"],"score":12.5}'
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    cons = [factory() for _ in range(batch)]
    out = all_allowed((batch,), compiler.vocab_size)
    times = []
    for t in ids[:steps]:
        start = time.perf_counter()
        compiler.fill([(c, i) for i, c in enumerate(cons)], out)
        times.append(time.perf_counter() - start)
        for c in cons:
            c.advance(t)
    return 1e3 * float(np.median(times))


def decode_ms(llm, batch: int, constrained: bool) -> tuple[float, dict]:
    """ms per decode step of `batch` requests (greedy, `decode_tokens` each)."""
    sc = SamplingConfig(max_new_tokens=FLAGS.decode_tokens, regex=ANY if constrained else None)
    prompts = [f"Count from {i} to one hundred." for i in range(batch)]
    llm.generate(prompts, sc, chat=True, use_tqdm=False)  # compile
    before = llm.engine.stats()
    start = time.perf_counter()
    llm.generate(prompts, sc, chat=True, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.engine.stats()
    steps = after["steps"] - before["steps"]
    return 1e3 * elapsed / steps, {k: after[k] - before[k] for k in ("sync_steps", "steps")}


def main(_):
    rows = {}
    llm = load_llm(RunConfig(cache=CacheConfig(max_seq_len=256),
                             engine=EngineConfig(max_slots=max(map(int, FLAGS.batches)))))
    compiler = llm.engine.constraints
    for b in map(int, FLAGS.mask_batches):
        rows[f"mask_fill_ms_b{b}"] = mask_fill_ms(compiler, b)
    for b in map(int, FLAGS.batches):
        free, _ = decode_ms(llm, b, False)
        cons, _ = decode_ms(llm, b, True)
        rows[f"step_ms_b{b}_overlap"] = free
        rows[f"step_ms_b{b}_sync"] = cons
    for k, v in rows.items():
        print(f"{k:28s} {v:9.3f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    app.run(main)
