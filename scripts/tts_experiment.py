"""Test-time scaling on the default model: coverage (pass@k) and self-consistency vs samples.

  python scripts/tts_experiment.py --num_problems=4 --k_max=8             # quick (minutes)
  python scripts/tts_experiment.py --num_problems=20 --k_max=64 --max_slots=32
  python scripts/tts_experiment.py --experiment=answer_format --num_problems=20 --k_max=8

Draws k_max samples of every problem in one engine call (`tts.EngineSampler`; sample j has seed
`--seed + j`, so the first n samples are exactly what an n-sample run draws) and reports, for
n = 1, 2, 4, ..., k_max:

- coverage: unbiased pass@n over the k_max samples (Brown et al. 2024), and the measured share
  of problems with a correct answer among the first n;
- self-consistency: majority-vote accuracy over the first n samples, next to one sample's;
- cost of the point: prompt token rows computed / reused (prefix cache) and tokens decoded by
  those n samples per problem (per-request counters, exact), and wall time (the run's, shared
  out by decode tokens: the requests ran together, so it is an estimate).

Then the prefill check: n=16 samples of one prompt, prompt rows computed and time to every
sample's first token vs one sample's, forked (one request, n=16) and as 16 separate requests.

`--experiment=answer_format` instead compares how replies state their answer
(`tasks.with_answer_format`): "text" (a "Final answer:" line, extracted by the task's
extractor), "json" (asked for `{"answer": ...}` and parsed) and "schema" (json enforced by the
engine's JSON-schema constraint; "reasoning_schema": a bounded "reasoning" string first), each
with the same problems and the same seeds: per n, the
share of samples without an extracted answer, one sample's accuracy and the majority vote's.

Writes <out>/tts_<task>.md (tables), .json (everything) and .png (matplotlib, if installed), or
<out>/tts_<task>_answer_format.md and .json.
Each measurement runs on a fresh engine, so no prefix cache carries over between them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from absl import app, flags

from jaxinfer.cli import flags as jflags

FLAGS = flags.FLAGS
flags.DEFINE_string("task", "arithmetic", "Built-in task: arithmetic | string | choice.")
flags.DEFINE_integer("level", 1, "Task difficulty, 1..3.")
flags.DEFINE_integer("num_problems", 4, "Problems.")
flags.DEFINE_integer("task_seed", 0, "Seed of the task generator.")
flags.DEFINE_integer("k_max", 8, "Samples per problem (the largest n).")
flags.DEFINE_integer("max_new_tokens", 96, "Tokens per sample at most.")
flags.DEFINE_float("temperature", 0.7, "Sampling temperature.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling (1 = off).")
flags.DEFINE_integer("seed", 0, "Seed of sample 0 (sample j: seed + j).")
flags.DEFINE_integer("max_slots", 32, "Engine slots (rows decoded together).")
flags.DEFINE_integer("max_seq_len", 512, "Context per sequence.")
flags.DEFINE_integer("share_n", 16, "Samples of one prompt in the prefill check (0 = skip).")
flags.DEFINE_string("out", "docs/tts", "Output directory.")
flags.DEFINE_enum("experiment", "scaling", ["scaling", "answer_format"],
                  "scaling: pass@k and self-consistency vs n; answer_format: text vs JSON "
                  "replies vs schema-constrained JSON replies.")
flags.DEFINE_list("answer_formats", ["text", "json", "schema"], "answer_format: the formats.")
jflags.define_compilation_cache_flag()


def _llm(model, tokenizer):
    from jaxinfer.config import CacheConfig, EngineConfig
    from jaxinfer.engine.llm import LLM

    return LLM(model, tokenizer, cache=CacheConfig(max_seq_len=FLAGS.max_seq_len),
               engine=EngineConfig(max_slots=FLAGS.max_slots))


def scaling(model, tokenizer, problems, sampling) -> dict:
    """The k_max run and its per-n points."""
    from jaxinfer.cli.tts import correctness, ladder, self_consistency_rows
    from jaxinfer.engine.prompts import encode_prompt
    from jaxinfer.tts import EngineSampler, mean_pass_at_k

    llm = _llm(model, tokenizer)
    workload = [(encode_prompt(tokenizer, model.config.vocab_size, p.prompt, chat=True), sampling)
                for p in problems for _ in range(FLAGS.k_max)]
    t0 = time.perf_counter()
    variants = llm.engine.warmup(workload=workload)
    compile_s = time.perf_counter() - t0
    sampler = EngineSampler(llm, sampling, use_tqdm=sys.stderr.isatty())
    samples = sampler.sample([p.prompt for p in problems], FLAGS.k_max)
    cost = sampler.cost
    correct = correctness(problems, samples)
    per_problem = [(len(c), sum(c)) for c in correct]
    sc = {r["n"]: r for r in self_consistency_rows(problems, samples)}
    points = []
    for n in ladder(FLAGS.k_max):
        first = [s for row in samples for s in row[:n]]
        decode = sum(s.num_tokens for s in first)
        points.append({
            "n": n, "pass_at_n": mean_pass_at_k(per_problem, n),
            "coverage_first_n": sc[n]["coverage"], "majority_acc": sc[n]["majority_acc"],
            "single_acc": sc[n]["single_acc"],
            "prefill_computed": sum(s.extra["prompt_computed"] for s in first),
            "prefill_reused": sum(s.extra["prompt_reused"] for s in first),
            "decode_tokens": decode, "wall_s_est": cost.wall_s * decode / cost.decode_tokens})
    return {"points": points, "pass_at_k": {k: mean_pass_at_k(per_problem, k)
                                            for k in range(1, FLAGS.k_max + 1)},
            "per_problem_correct": per_problem, "cost": cost.as_dict(),
            "compile_s": compile_s, "compiled_variants": variants,
            "finish_reasons": _count(s.finish_reason for row in samples for s in row)}


def _count(items) -> dict:
    out: dict = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def prefill_check(model, tokenizer, prompt: str, sampling, n: int) -> dict:
    """Prompt rows computed, and seconds until every sample has its first token, for 1 sample,
    n forked samples (one request with `SamplingConfig(n=n)`: one prefill), and n separate
    requests submitted together (each computes the whole prompt). Each run is done twice on a
    fresh engine and the second is reported (the first compiles)."""
    short = dataclasses.replace(sampling, max_new_tokens=8)
    runs = {"one_sample": [dataclasses.replace(short, n=1)],
            "n_forked": [dataclasses.replace(short, n=n)],
            "n_separate": [dataclasses.replace(short, seed=short.seed + i) for i in range(n)]}
    out = {}
    for name, configs in runs.items():
        for _ in range(2):
            llm = _llm(model, tokenizer)
            t0 = time.perf_counter()
            outs = llm.generate([prompt] * len(configs), configs, chat=True, use_tqdm=False)
        out[name] = {"samples": len(outs), "prompt_tokens": len(outs[0].prompt_ids),
                     "prefill_computed": sum(c.metrics.prompt_computed for c in outs),
                     "prefill_reused": sum(c.metrics.prompt_reused for c in outs),
                     "first_tokens_s": max(c.metrics.token_times[0] for c in outs) - t0}
    one = out["one_sample"]
    for name in ("n_forked", "n_separate"):
        out[name]["ratio_to_one"] = out[name]["prefill_computed"] / one["prefill_computed"]
        out[name]["time_ratio_to_one"] = out[name]["first_tokens_s"] / one["first_tokens_s"]
    out["page_size"] = _llm(model, tokenizer).engine.cache_config.page_size
    return out


def markdown(result: dict) -> str:
    from jaxinfer.tts import summary_table

    cols = ["n", "pass_at_n", "coverage_first_n", "majority_acc", "single_acc",
            "prefill_computed", "prefill_reused", "decode_tokens", "wall_s_est"]
    lines = [f"## {result['task']} level {result['level']}: {result['num_problems']} problems, "
             f"k_max={result['k_max']}", "", "```", summary_table(result["points"], cols), "```"]
    c = result["cost"]
    lines += ["", f"Run: {c['requests']} requests, {c['decode_tokens']} decode tokens in "
              f"{c['wall_s']:.1f}s ({c['decode_tokens'] / max(c['wall_s'], 1e-9):.1f} tok/s), "
              f"after compiling {result['compiled_variants']} step variants in "
              f"{result['compile_s']:.1f}s. Correct samples per problem: "
              f"{[k for _, k in result['per_problem_correct']]}."]
    share = result.get("prefill_check")
    if share:
        lines += ["", f"Prefill check (one prompt, page size {share['page_size']}):", "", "```",
                  summary_table([{"run": k, **v} for k, v in share.items() if k != "page_size"],
                                ["run", "samples", "prompt_tokens", "prefill_computed",
                                 "prefill_reused", "ratio_to_one", "first_tokens_s",
                                 "time_ratio_to_one"]), "```"]
    return "\n".join(lines) + "\n"


def answer_format(model, tokenizer, problems, sampling) -> dict:
    """Self-consistency with each of --answer_formats: same problems, same seeds, a fresh
    engine each (the compiled steps are shared: the first format's wall time has no compile)."""
    from jaxinfer.cli.tts import self_consistency_rows
    from jaxinfer.engine.prompts import encode_prompt
    from jaxinfer.tts import SCHEMA_FORMATS, EngineSampler, answer_schema, with_answer_format

    llm = _llm(model, tokenizer)
    t0 = time.perf_counter()
    llm.engine.warmup(workload=[(encode_prompt(tokenizer, model.config.vocab_size, p.prompt,
                                               chat=True), sampling) for p in problems])
    rows, costs = [], {}
    for fmt in FLAGS.answer_formats:
        asked = with_answer_format(problems, fmt)
        schemas = {p.prompt: answer_schema(p) for p in asked if fmt in SCHEMA_FORMATS}
        sampler = EngineSampler(_llm(model, tokenizer), sampling, schemas=schemas,
                                use_tqdm=sys.stderr.isatty())
        samples = sampler.sample([p.prompt for p in asked], FLAGS.k_max)
        for row in self_consistency_rows(asked, samples):
            rows.append({"answer_format": fmt, **row})
        flat = [s for row in samples for s in row]
        costs[fmt] = {**sampler.cost.as_dict(),
                      "mean_tokens": sum(s.num_tokens for s in flat) / len(flat),
                      "finish_reasons": _count(s.finish_reason for s in flat),
                      "example": flat[0].text}
    return {"rows": rows, "costs": costs, "compile_s": time.perf_counter() - t0
            - sum(c["wall_s"] for c in costs.values())}


def answer_format_markdown(result: dict) -> str:
    from jaxinfer.tts import summary_table

    cols = ["answer_format", "n", "no_answer", "single_acc", "majority_acc", "coverage"]
    cost_rows = [{"answer_format": fmt, "decode_tokens": c["decode_tokens"],
                  "mean_tokens": c["mean_tokens"], "length_cut": c["finish_reasons"].get(
                      "length", 0), "wall_s": c["wall_s"]} for fmt, c in result["costs"].items()]
    return "\n".join([
        f"## {result['task']} level {result['level']}: {result['num_problems']} problems, "
        f"n up to {result['k_max']}, T={result['temperature']}, answer formats", "", "```",
        summary_table(result["rows"], cols), "", summary_table(cost_rows, list(cost_rows[0])),
        "```", ""] + [f"- {fmt} sample 0: {c['example']!r}"
                      for fmt, c in result["costs"].items()]) + "\n"


def plot(result: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'jaxinfer[experiments]'): no plot",
              file=sys.stderr)
        return False
    curve = {int(k): v for k, v in result["pass_at_k"].items()}  # JSON keys are strings
    ks = sorted(curve)
    pts = result["points"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(ks, [curve[k] for k in ks], "o-", ms=3, label="pass@k (unbiased)")
    a.set(xscale="log", xlabel="k (samples)", ylabel="coverage",
          title="Repeated sampling: coverage vs k")
    b.plot([p["n"] for p in pts], [p["majority_acc"] for p in pts], "o-", label="majority vote")
    b.plot([p["n"] for p in pts], [p["single_acc"] for p in pts], "s--", label="one sample")
    b.set(xscale="log", xlabel="n (samples)", ylabel="accuracy", title="Self-consistency")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"SmolLM2-135M-Instruct, {result['task']} L{result['level']}, "
                 f"{result['num_problems']} problems, T={result['temperature']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str]) -> None:
    del argv

    jflags.use_compilation_cache()
    from jaxinfer.checkpoint.loading import load_model, load_tokenizer
    from jaxinfer.config import RunConfig, SamplingConfig
    from jaxinfer.tts import load_tasks

    model, ckpt = load_model(RunConfig())
    tokenizer = load_tokenizer(ckpt)
    problems = load_tasks(FLAGS.task, FLAGS.num_problems, seed=FLAGS.task_seed,
                          level=FLAGS.level)
    sampling = SamplingConfig(temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=FLAGS.seed,
                              max_new_tokens=FLAGS.max_new_tokens)
    result = {"task": FLAGS.task, "level": FLAGS.level, "num_problems": len(problems),
              "k_max": FLAGS.k_max, "temperature": FLAGS.temperature, "top_p": FLAGS.top_p,
              "max_new_tokens": FLAGS.max_new_tokens, "max_slots": FLAGS.max_slots,
              "command": " ".join(sys.argv)}
    if FLAGS.experiment == "answer_format":
        result.update(answer_format(model, tokenizer, problems, sampling))
        os.makedirs(FLAGS.out, exist_ok=True)
        stem = os.path.join(FLAGS.out, f"tts_{FLAGS.task}_answer_format")
        text = answer_format_markdown(result)
        with open(stem + ".md", "w") as f:
            f.write(text)
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=1)
        print(text)
        print(f"wrote {stem}.md, {stem}.json")
        print(json.dumps({"rows": result["rows"]}))
        return
    result.update(scaling(model, tokenizer, problems, sampling))
    if FLAGS.share_n:
        result["prefill_check"] = prefill_check(model, tokenizer, problems[0].prompt, sampling,
                                                FLAGS.share_n)
    os.makedirs(FLAGS.out, exist_ok=True)
    stem = os.path.join(FLAGS.out, f"tts_{FLAGS.task}")
    text = markdown(result)
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plotted = plot(result, stem + ".png")
    print(text)
    print(f"wrote {stem}.md, {stem}.json" + (f", {stem}.png" if plotted else ""))
    print(json.dumps({"points": result["points"], "prefill_check": result.get("prefill_check")}))


if __name__ == "__main__":
    app.run(main)
