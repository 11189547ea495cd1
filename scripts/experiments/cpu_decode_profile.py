"""Where an f32 decode step of the default model goes on XLA:CPU: the engine at batch 1 (one
slot) is warmed up, then 16 steps run under `jax.profiler.trace` with XLA's per-op trace
annotations on (`--xla_cpu_enable_xprof_traceme=true`, set here before jax starts); prints
each HLO op kind's share of the traced op time (e.g. `dot`: the layers' GEMVs, `ynn_fusion`:
YNNPACK fusions).

  python scripts/experiments/cpu_decode_profile.py
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_xprof_traceme=true").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxinfer.checkpoint.loading import load_model  # noqa: E402
from jaxinfer.checkpoint.weights import load_checkpoint  # noqa: E402
from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig  # noqa: E402
from jaxinfer.engine.engine import Engine  # noqa: E402

STEPS = 16


def op_times(trace_dir: str) -> collections.Counter:
    """Microseconds per (module, HLO op kind) from the trace's per-op events."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    out = collections.Counter()
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_op" in args and not e["name"].startswith("end:") \
                and e["name"] != "ThunkExecutor::Execute":
            out[(args.get("hlo_module", ""), re.sub(r"\.\d+$", "", e["name"]))] += e["dur"]
    return out


def main() -> None:
    model = load_model(RunConfig(dtype="float32"), load_checkpoint(None))[0]
    engine = Engine(model, None, cache=CacheConfig(page_size=16, max_seq_len=256),
                    engine=EngineConfig(max_slots=1, enable_prefix_caching=False,
                                        max_num_batched_tokens=512))
    sampling = SamplingConfig(max_new_tokens=150, ignore_eos=True)
    engine.add_request(list(range(100, 116)), sampling)  # warm-up: every page bucket compiles
    engine.run()
    engine.add_request(list(range(100, 116)), sampling)
    for _ in range(4):
        engine.step()
    engine.runner.block_until_ready()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(STEPS):
                engine.step()
            engine.runner.block_until_ready()
        times = op_times(trace_dir)
    total = sum(times.values())
    print(f"{'ms/step':>8} {'share':>6}  module / op")
    for (module, op), us in times.most_common(12):
        print(f"{us / STEPS / 1e3:8.2f} {100 * us / total:5.1f}%  {module} / {op}")


if __name__ == "__main__":
    main()
