"""Compile the whole engine for a TPU slice or an H100/H200 without one, and check it.

  python scripts/aot_check.py --model=llama-3.1-70b --target=v5e:4x4 \\
      --config=configs/llama-3.1-70b-v5e-16.yaml [--speculative_method=ngram] [--pages=ends]

Builds the model from abstract weights, runs the engine's warm-up with every step compiled by
the real XLA:TPU (libtpu) or XLA:GPU (sm_90a, the jax CUDA plugin) compiler for the target's
chips on the config's mesh, and checks what XLA reports against the planner
(`jaxinfer.proof.aot` module doc: what is measured, what XLA's bytes accessed counts, the
checks). Prints one row per executable, the checks, then one JSON line. Exit 1 when a check
fails, 2 on bad input (an unknown target, a mesh that does not cover the topology, ...).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compile-only devices come from topologies
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from absl import app, flags  # noqa: E402

from jaxinfer.perf import planner  # noqa: E402
from jaxinfer.proof import aot

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, f"Preset: {', '.join(planner.MODEL_PRESETS)}.")
flags.DEFINE_string("target", None, "TPU topology (v5e:2x2, v5e:4x4, v6e:2x4, ...) or "
                    "gpu:h100 / gpu:h200.")
flags.DEFINE_string("config", None, "YAML run config (configs/*.yaml); default: the defaults.")
flags.DEFINE_string("mesh", None, "Override the config's mesh: data:D,model:M or auto.")
flags.DEFINE_integer("max_slots", None, "Override engine.max_slots.")
flags.DEFINE_integer("max_seq_len", None, "Override cache.max_seq_len.")
flags.DEFINE_string("speculative_method", None, "Override: none or ngram (adds verify_step).")
flags.DEFINE_string("weight_dtype", None, "Override: bfloat16, int8, int4.")
flags.DEFINE_integer("max_loras", None, "Override engine.max_loras (a LoRA adapter pool).")
flags.DEFINE_integer("max_lora_rank", None, "Override engine.max_lora_rank.")
flags.DEFINE_enum("scan_layers", None, ["auto", "true", "false"],
                  "Override the layer stack's layout (auto: scanned on TPU, unrolled on GPU).")
flags.DEFINE_enum("pages", "all", list(aot.PAGE_CHOICES), "Compile every page bucket, only "
                  "the smallest and largest of each shape (ends: faster at 70B), or only the "
                  "largest.")
flags.DEFINE_integer("max_len", None, "The warm-up's max_len (default: the whole context).")
flags.DEFINE_integer("num_layers", None, "Compile only this many of the preset's layers (a "
                     "quick check: memory and traffic are then those of the shallower model, "
                     "and the planner's prediction is made for it too).")
flags.DEFINE_bool("decode_only", False, "Compile no prompt-chunk variant of mixed_step.")
flags.DEFINE_list("chunks", None, "Compile only these prompt-chunk buckets of mixed_step "
                  "(e.g. 512, the production chunk); default: all.")


def format_report(r: aot.Report) -> str:
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    lines = [f"{r.aot.model} on {r.target.name}: {r.target.num_chips} chips on "
             f"{r.target.num_hosts} host(s), compiled as one program; mesh {r.mesh}; "
             f"{r.variants} warm-up variants, {len(r.executables)} executables compiled, "
             f"{r.skipped} calls reused", "",
             "| executable | static | compile s | CPU s | args MiB | out MiB | alias MiB | "
             "temp MiB | code MiB | peak MiB | GFLOP | GB accessed | moves |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| --- |"]
    for e in r.executables:
        static = ", ".join(f"{k}={v}" for k, v in e.static.items() if k != "attention_impl")
        lines.append(f"| {e.name} | {static} | {e.compile_s:.1f} | {e.compile_cpu_s:.1f} | "
                     f"{mib(e.argument_bytes)} | "
                     f"{mib(e.output_bytes)} | {mib(e.alias_bytes)} | {mib(e.temp_bytes)} | "
                     f"{mib(e.code_bytes)} | {mib(e.peak_bytes)} | {e.flops / 1e9:,.1f} | "
                     f"{e.bytes_accessed / 1e9:.3f} | {len(e.moves)} |")
    total = sum(e.compile_s for e in r.executables)
    cpu = sum(e.compile_cpu_s for e in r.executables)
    p = r.planner_bytes
    lines += ["", f"total compile {total:.1f} s ({cpu:.1f} CPU s); resident per chip "
              f"{mib(r.resident_bytes)} MiB "
              f"(KV pool {mib(r.pool_bytes)} MiB); engine peak per chip {mib(r.peak_bytes)} MiB "
              f"of {mib(r.hbm_bytes)} MiB HBM; planner {mib(p['total_bytes'])} MiB (weights "
              f"{mib(p['weight_bytes'])}, KV {mib(p['kv_bytes'])}, activations "
              f"{mib(p['activation_bytes'])}, acceptance {mib(p['acceptance_bytes'])})", "",
              "| check | result | detail |",
              "| --- | --- | --- |"]
    verdict = {True: "ok", False: "FAIL", None: "n/a"}
    lines += [f"| {name} | {verdict[ok]} | {detail} |" for name, ok, detail in r.checks]
    moves = sorted({m for e in r.executables for m in e.moves})
    if moves:
        lines += ["", "weight-sized moves:"] + [f"  {m}" for m in moves[:20]]
    return "\n".join(lines)


def summary(r: aot.Report) -> dict:
    return {"model": r.aot.model, "target": r.target.name, "mesh": r.mesh, "ok": r.ok,
            "peak_bytes": r.peak_bytes, "planner_bytes": r.planner_bytes["total_bytes"],
            "hbm_bytes": r.hbm_bytes, "compile_s": sum(e.compile_s for e in r.executables),
            "compile_cpu_s": sum(e.compile_cpu_s for e in r.executables),
            "executables": len(r.executables),
            "checks": {name: ok for name, ok, _ in r.checks}}


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    overrides = {key: getattr(FLAGS, name) for key, name in (
        ("mesh", "mesh"), ("engine.max_slots", "max_slots"), ("cache.max_seq_len", "max_seq_len"),
        ("engine.speculative_method", "speculative_method"), ("weight_dtype", "weight_dtype"),
        ("engine.max_loras", "max_loras"), ("engine.max_lora_rank", "max_lora_rank"),
        ("scan_layers", "scan_layers"))
        if getattr(FLAGS, name) is not None}
    try:
        if FLAGS.model is None or FLAGS.target is None:
            raise ValueError(f"--model and --target are required; models: "
                             f"{', '.join(planner.MODEL_PRESETS)}; targets: e.g. v5e:2x2, "
                             "v6e:2x4, gpu:h100")
        run = aot.run_config(FLAGS.config, **overrides)
        report = aot.check(aot.AotConfig(model=FLAGS.model, target=FLAGS.target, run=run,
                                         pages=FLAGS.pages, max_len=FLAGS.max_len,
                                         num_layers=FLAGS.num_layers,
                                         decode_only=FLAGS.decode_only,
                                         chunks=(tuple(int(c) for c in FLAGS.chunks)
                                                 if FLAGS.chunks else None)),
                           log=lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"aot_check: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    print(json.dumps(summary(report)))
    return 0 if report.ok else 1


if __name__ == "__main__":
    app.run(main)
