"""What XLA:CPU's compile settings cost and save on the default model's serving steps: the
workload of `tests/test_hf_reference.py`'s serving test (8 prompts, 48 greedy tokens each,
32-token chunks beside decodes, a pool that preempts) run twice on one engine, so the first
run holds the compile and the second is the steps alone. `--model=toy`: the same engine and
workload on the test suite's toy model (tests/helpers.py's `toy_config`, random weights, the
prompts' ids folded into its 64-token vocabulary), whose steps most of the suite compiles.
Section "The test suite" of docs/benchmarks.md.

Each setting runs in its own process (XLA reads its flags once):

    python scripts/experiments/cpu_compile_settings.py                      # every setting
    python scripts/experiments/cpu_compile_settings.py --scan_layers=false
    python scripts/experiments/cpu_compile_settings.py --model=toy

Settings: XLA's optimisations on or off (`jax_disable_most_optimizations`, what the test suite
sets for its toy programs) x XLA:CPU's fusion emitters on or off
(`--xla_cpu_use_fusion_emitters=false`, which the suite sets for every program); and the
suite's whole setting, which also generates each program's LLVM code as one module
(`--xla_cpu_parallel_codegen_split_count=1`; XLA:CPU splits it into 32 to compile the parts on
parallel threads). The first run's CPU seconds are printed beside its wall seconds: the suite
runs two workers on two cores, so a compile's CPU time, not its wall time, is what it waits for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("scan_layers", "true", "The model's layer layout: true or false.")
flags.DEFINE_enum("model", "smollm2", ["smollm2", "toy"], "The default model or the suite's "
                  "toy model.")
flags.DEFINE_bool("child", False, "Run one setting in this process (internal).")

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures",
                       "hf_smollm2_greedy.json")
NO_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
ONE_MODULE = "--xla_cpu_parallel_codegen_split_count=1"
SETTINGS = [("optimised", ""), ("optimised", NO_FUSION_EMITTERS),
            ("unoptimised", ""), ("unoptimised", NO_FUSION_EMITTERS),
            ("unoptimised", f"{NO_FUSION_EMITTERS} {ONE_MODULE}")]


def _run_workload() -> dict:
    import jax

    from jaxinfer.checkpoint.loading import load_model, load_tokenizer
    from jaxinfer.checkpoint.weights import load_checkpoint
    from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
    from jaxinfer.engine.llm import LLM

    jax.config.update("jax_default_matmul_precision", "highest")
    with open(FIXTURE) as f:
        cases = json.load(f)["cases"]
    if FLAGS.model == "toy":
        from jaxinfer.config import ModelConfig, RopeConfig
        from jaxinfer.model import Llama, init_params

        config = ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_q_heads=4,
                             num_kv_heads=2, head_dim=8, ffn_dim=48, max_position=256,
                             rope=RopeConfig(theta=10000.0),
                             scan_layers=FLAGS.scan_layers == "true")
        model, tokenizer = Llama(config, init_params(config, seed=0, scale=0.3)), None
        cases = [dict(c, prompt_ids=[t % 64 for t in c["prompt_ids"]], greedy_ids=None)
                 for c in cases]
    else:
        model, ckpt = load_model(RunConfig(dtype="float32", scan_layers=FLAGS.scan_layers),
                                 load_checkpoint(None))
        tokenizer = load_tokenizer(ckpt)
    llm = LLM(model, tokenizer,
              cache=CacheConfig(page_size=16, max_seq_len=176, num_pages=32),
              engine=EngineConfig(max_slots=8, prefill_buckets=(32,), prefill_chunk_size=32,
                                  max_num_batched_tokens=40))
    prompts = [c["prompt_ids"] for c in cases]
    sampling = SamplingConfig(max_new_tokens=48, ignore_eos=True)
    times, cpu = [], []
    for _ in range(2):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = llm.generate(prompts, sampling, use_tqdm=False)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"first_s": times[0], "first_cpu_s": cpu[0], "second_s": times[1],
            "hf_tokens": (all(o.token_ids == c["greedy_ids"] for o, c in zip(out, cases))
                          if FLAGS.model == "smollm2" else "n/a")}


def main(argv) -> None:
    del argv
    if FLAGS.child:
        print(json.dumps(_run_workload()))
        return
    print(f"model={FLAGS.model}, scan_layers={FLAGS.scan_layers}; seconds for the workload, "
          "its first run (compile + steps: wall, CPU) and its second (steps)")
    print("| XLA optimisations | fusion emitters | code modules | first run | first run CPU | "
          "second run | HF's tokens |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- |")
    for opt, xla_flags in SETTINGS:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags,
               "JAX_DISABLE_MOST_OPTIMIZATIONS": "1" if opt == "unoptimised" else "0"}
        out = subprocess.run([sys.executable, __file__, "--child",
                              f"--scan_layers={FLAGS.scan_layers}", f"--model={FLAGS.model}"],
                             env=env, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {opt} | {'off' if NO_FUSION_EMITTERS in xla_flags else 'on'} | "
              f"{'1' if ONE_MODULE in xla_flags else '32'} | {r['first_s']:.1f} | "
              f"{r['first_cpu_s']:.1f} | {r['second_s']:.1f} | {r['hf_tokens']} |", flush=True)


if __name__ == "__main__":
    app.run(main)
