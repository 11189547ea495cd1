"""Decode throughput with LoRA adapters as rows, on the embedded SmolLM2-135M (CPU by default).

At each batch size B (--batches), B requests decode together on one engine with a pool of
--slots adapters of rank --rank on all seven projections (random factors, written as PEFT
directories), in four cases: an engine without a pool ("no pool"), the pooled engine's rows all
on the base model ("base rows"), all on one adapter ("1 adapter"), spread round robin over
--adapters adapters. Each case times --steps decode steps (every request past its prompt) and
repeats --repeats times, the cases interleaved, median reported: wall-clock on a shared machine,
so read the ratios. Beside each: the bytes a decode step must read, weights plus the adapters
its rows use (float32: 4 bytes an element), counted from the shapes.

  python scripts/lora_benchmark.py --batches=8,32 --slots=8 --rank=16
  python scripts/lora_benchmark.py --batches=8 --scan_layers=true   # the scanned layout

Results: docs/benchmarks.md, "LoRA adapters".
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from jaxinfer.checkpoint.hf import write_safetensors
from jaxinfer.checkpoint.loading import load_model
from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.model.lora import TARGETS, canonical_shapes

FLAGS = flags.FLAGS
flags.DEFINE_list("batches", ["8", "32"], "Decoding requests B.")
flags.DEFINE_integer("slots", 8, "Adapter pool slots (max_loras).")
flags.DEFINE_integer("rank", 16, "LoRA rank of every adapter (and max_lora_rank).")
flags.DEFINE_integer("adapters", 8, "Distinct adapters the spread case uses (<= slots).")
flags.DEFINE_integer("steps", 16, "Decode steps timed per run.")
flags.DEFINE_integer("repeats", 3, "Timed runs per case (median).")
flags.DEFINE_enum("scan_layers", "auto", ["auto", "true", "false"],
                  "Layer stack layout (`RunConfig.scan_layers`): true scanned, false unrolled, "
                  "auto per platform (unrolled on CPU).")


def write_adapter(path: str, config, rank: int, seed: int) -> str:
    """A random PEFT adapter of `rank` on all seven projections of every layer."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target in TARGETS:
            a_shape, b_shape = canonical_shapes(config, target, rank)
            parent = "self_attn" if target in "qkvo" else "mlp"
            name = f"base_model.model.model.layers.{layer}.{parent}.{target}_proj"
            tensors[f"{name}.lora_A.weight"] = (0.02 * rng.standard_normal(
                (rank, int(np.prod(a_shape[:-1]))))).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (0.02 * rng.standard_normal(
                (int(np.prod(b_shape[1:])), rank))).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "adapter_model.safetensors"), tensors)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                   "target_modules": [f"{t}_proj" for t in TARGETS]}, f)
    return path


def adapter_bytes(config, rank: int) -> int:
    """Bytes of one adapter's factors in the pool (all projections, every layer, float32)."""
    per_layer = sum(int(np.prod(a)) + int(np.prod(b)) for a, b in
                    (canonical_shapes(config, t, rank) for t in TARGETS))
    return 4 * config.num_layers * per_layer


def weight_bytes(config) -> int:
    d, f, v = config.embed_dim, config.ffn_dim, config.vocab_size
    qkv = d * (config.num_q_heads + 2 * config.num_kv_heads) * config.head_dim
    o = config.num_q_heads * config.head_dim * d
    return 4 * (config.num_layers * (qkv + o + 3 * d * f) + d * v)


def time_decode(engine: Engine, b: int, names: list, steps: int) -> float:
    """Seconds per decode step of b requests (adapter names[i % len] each) once all decode."""
    prompt = list(range(1, 9))
    for i in range(b):
        engine.add_request(prompt, SamplingConfig(max_new_tokens=steps + 8, ignore_eos=True,
                                                  lora=names[i % len(names)]))
    while any(r.num_computed < len(r.prompt_ids) for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    for _ in range(2):
        engine.step()
    engine.runner.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine.runner.block_until_ready()
    elapsed = (time.perf_counter() - t0) / steps
    engine.run()
    return elapsed


def main(argv):
    del argv
    model, _ = load_model(RunConfig(scan_layers=FLAGS.scan_layers))
    c, r = model.config, FLAGS.rank
    tmp = tempfile.mkdtemp(prefix="lora_benchmark_")
    paths = {f"a{i}": write_adapter(os.path.join(tmp, f"a{i}"), c, r, i)
             for i in range(FLAGS.adapters)}
    rows = []
    for b in map(int, FLAGS.batches):
        cache = CacheConfig(page_size=16, max_seq_len=FLAGS.steps + 32)
        base_cfg = EngineConfig(max_slots=b, prefill_buckets=(16,), max_num_batched_tokens=512)
        plain = Engine(model, None, cache=cache, engine=base_cfg)
        pooled = Engine(model, None, cache=cache, engine=EngineConfig(
            max_slots=b, prefill_buckets=(16,), max_num_batched_tokens=512,
            max_loras=FLAGS.slots, max_lora_rank=r))
        for name, path in paths.items():
            pooled.add_lora(name, path)
        cases = {"no pool": (plain, [None], 0), "base rows": (pooled, [None], 0),
                 "1 adapter": (pooled, ["a0"], 1),
                 f"{FLAGS.adapters} adapters": (pooled, list(paths), FLAGS.adapters)}
        times = {k: [] for k in cases}
        for engine, names, _ in cases.values():  # compile and page in
            time_decode(engine, b, names, 2)
        for _ in range(FLAGS.repeats):
            for k, (engine, names, _) in cases.items():
                times[k].append(time_decode(engine, b, names, FLAGS.steps))
        base = statistics.median(times["no pool"])
        for k, (_, _, used) in cases.items():
            ms = statistics.median(times[k]) * 1e3
            rows.append(dict(batch=b, case=k, ms_per_step=round(ms, 2),
                             tok_s=round(b / ms * 1e3, 1),
                             vs_no_pool=round(base * 1e3 / ms, 3),
                             mb_per_step=round((weight_bytes(c) + used * adapter_bytes(c, r))
                                               / 2**20, 1)))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{'B':>3} {'case':<12} {'ms/step':>8} {'tok/s':>8} {'vs no pool':>10} "
          f"{'MiB read/step':>14}")
    for row in rows:
        print(f"{row['batch']:>3} {row['case']:<12} {row['ms_per_step']:>8} {row['tok_s']:>8} "
              f"{row['vs_no_pool']:>10} {row['mb_per_step']:>14}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
