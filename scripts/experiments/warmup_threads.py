"""The default server's warm-up (every step variant of `jaxinfer-serve`'s engine) on 1 thread
(each variant run on dummy rows) and on N threads (compiled ahead of time,
`jaxinfer.engine.precompile`), each in a fresh process with the persistent compilation cache
off: wall and CPU seconds, step variants, XLA executables made (by function). Prints a table,
then one JSON line.

  python scripts/experiments/warmup_threads.py --workers=1,2 --repeats=2
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time

from absl import app, flags

flags.DEFINE_list("workers", ["1", "2"], "Warm-up threads to compare.")
flags.DEFINE_integer("repeats", 2, "Runs of each, interleaved.")
flags.DEFINE_integer("child", 0, "Internal: run one warm-up on this many threads.")
FLAGS = flags.FLAGS


def one(workers: int) -> dict:
    """Loads the default model as `jaxinfer-serve` does and warms it up on `workers` threads."""
    import jax
    from jax._src import dispatch

    from jaxinfer.cli.serve import DEFAULT_TOP_LOGPROBS
    from jaxinfer.config import EngineConfig, RunConfig
    from jaxinfer.engine.llm import load_llm

    engine = load_llm(RunConfig(engine=EngineConfig(
        max_top_logprobs=DEFAULT_TOP_LOGPROBS))).engine
    made: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _, fun_name="", **__: made.append(fun_name)
        if event == dispatch.BACKEND_COMPILE_EVENT else None)
    wall, cpu = time.perf_counter(), time.process_time()
    variants = engine.warmup(workers=workers)
    return {"workers": workers, "variants": variants,
            "wall_s": round(time.perf_counter() - wall, 1),
            "cpu_s": round(time.process_time() - cpu, 1),
            "executables": dict(collections.Counter(made)),
            "load": round(os.getloadavg()[0], 1)}


def main(argv) -> None:
    del argv
    if FLAGS.child:
        print(json.dumps(one(FLAGS.child)))
        return
    rows = []
    for _ in range(FLAGS.repeats):
        for w in FLAGS.workers:
            out = subprocess.run([sys.executable, __file__, f"--child={w}"], check=True,
                                 capture_output=True, text=True,
                                 env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"workers {r['workers']}: {r['variants']} variants, "
                  f"{sum(r['executables'].values())} executables, {r['wall_s']:.1f} s wall, "
                  f"{r['cpu_s']:.1f} s CPU (load {r['load']})", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    app.run(main)
