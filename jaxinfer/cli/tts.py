"""`jaxinfer-tts`: test-time scaling on the serving engine (docs/architecture.md, decision 7).

  jaxinfer-tts --strategy=self_consistency --n=8 --task=arithmetic --num_problems=20
  jaxinfer-tts --strategy=repeated_sampling --n=16 --task=string --output=samples.jsonl
  jaxinfer-tts --strategy=best_of_n --n=16 --stop_on_first_pass --batch=4 --task=probs.jsonl
  jaxinfer-tts --strategy=self_consistency --n=4 --reasoning_effort=low
  jaxinfer-tts --strategy=self_consistency --n=8 --answer_format=schema

Every sample of every problem is drawn through `tts.EngineSampler` (sample j of a problem has
seed `--seed + j`; all problems x n requests go to the engine in one call). Best-of-n scores
samples with the task's own checker (an oracle verifier). Writes one JSONL line per sample
(`--output`) and prints a strategy-specific summary table, the compute cost, then one JSON line.
The model and engine flags are `jaxinfer-generate`'s (`jaxinfer/cli/flags.py`); unlike it, an unset
`--temperature` means 0.7 here (n greedy samples would all be the same).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags, logging

from jaxinfer.cli import flags as jflags
from jaxinfer.tts import (
    ANSWER_FORMATS,
    Problem,
    Sample,
    answer_of,
    best_of_n,
    is_correct,
    majority_vote,
    mean_pass_at_k,
    repeated_sampling,
    self_consistency,
    summary_table,
    verify,
)

STRATEGIES = ("self_consistency", "best_of_n", "repeated_sampling")
DEFAULT_TEMPERATURE = 0.7

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defines this CLI's flags and the model/engine table (`jaxinfer.cli.flags`); idempotent. Not
    done at import, so scripts can import the summaries below beside flags of their own."""
    if "strategy" in FLAGS:
        return
    flags.DEFINE_enum("strategy", "self_consistency", STRATEGIES, "Test-time scaling strategy.")
    flags.DEFINE_integer("n", 8, "Samples per problem (best-of-n: at most).")
    flags.DEFINE_string("task", "arithmetic", "Built-in task (arithmetic|string|choice) or a JSONL "
                        "file of {prompt, answer, id?, extractor?}.")
    flags.DEFINE_integer("num_problems", 10, "Problems (a file: its first N; unset = all).")
    flags.DEFINE_integer("task_seed", 0, "Seed of the built-in task generator.")
    flags.DEFINE_integer("level", 1, "Built-in task difficulty, 1..3.")
    flags.DEFINE_enum("answer_format", "text", ANSWER_FORMATS, "How replies state the answer: "
                      "text ('Final answer: ...', extracted), json (asked as {\"answer\": ...}, "
                      "parsed), schema (json enforced by the engine's JSON-schema constraint), "
                      "reasoning_schema (schema with a bounded 'reasoning' string first).")
    flags.DEFINE_enum("reasoning_effort", "none", ["none", "low", "medium", "high"],
                      "Thinking budget (a 'Reasoning: <level>' system line + budget forcing).")
    flags.DEFINE_integer("thinking_budget", None, "Override the effort level's thinking budget.")
    flags.DEFINE_integer("answer_budget", 32, "Tokens after 'Final answer:' (with an effort).")
    flags.DEFINE_bool("stop_on_first_pass", False, "best_of_n: stop a problem at its first pass.")
    flags.DEFINE_integer("batch", 4, "best_of_n with --stop_on_first_pass: samples per round.")
    flags.DEFINE_bool("prime_prefix", False, "Prefill each prompt once so the n samples share its "
                      "full pages through the prefix cache.")
    flags.DEFINE_string("output", None, "Write one JSON line per sample here.")
    jflags.define_run_flags(chat_default=True,
                            system_help="System message (with an effort: after its line).")


# -- summaries (pure: tested without an engine) -----------------------------------------------


def ladder(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else [*ks, n]


def correctness(problems: Sequence[Problem], samples: Sequence[Sequence[Sample]]
                ) -> list[list[bool]]:
    return [[verify(p, s.text) for s in row] for p, row in zip(problems, samples)]


def self_consistency_rows(problems: Sequence[Problem], samples: Sequence[Sequence[Sample]]
                          ) -> list[dict[str, Any]]:
    """Per n' in ladder(n): majority-vote accuracy over each problem's first n' samples, next
    to the mean accuracy of a single sample, the coverage (any of the n' correct) and the share
    of samples without an answer (`no_answer`: the extractor found none)."""
    answers = [[answer_of(p, s.text) for s in row] for p, row in zip(problems, samples)]
    correct = [[is_correct(p, a) for a in row] for p, row in zip(problems, answers)]
    rows = []
    for k in ladder(min(len(row) for row in samples)):
        votes = [majority_vote(row[:k]) for row in answers]
        right = [is_correct(p, v.answer) for p, v in zip(problems, votes)]
        rows.append({"n": k, "majority_acc": sum(right) / len(problems),
                     "single_acc": sum(sum(c[:k]) for c in correct) / (k * len(problems)),
                     "coverage": sum(any(c[:k]) for c in correct) / len(problems),
                     "agreement": sum(v.agreement for v in votes) / len(problems),
                     "no_answer": sum(a is None for row in answers for a in row[:k])
                     / (k * len(problems))})
    return rows


def pass_at_k_rows(problems: Sequence[Problem], samples: Sequence[Sequence[Sample]]
                   ) -> list[dict[str, Any]]:
    """Unbiased pass@k (mean over problems) for k in ladder(n), from all n samples."""
    correct = correctness(problems, samples)
    per_problem = [(len(c), sum(c)) for c in correct]
    n = min(len(c) for c in correct)
    return [{"k": k, "pass_at_k": mean_pass_at_k(per_problem, k)} for k in ladder(n)]


def best_of_n_rows(results) -> list[dict[str, Any]]:
    """One row: problems solved by the best sample, and samples drawn (mean and total)."""
    drawn = [r.num_drawn for r in results]
    passed = [r.index is not None and r.passed[r.index] for r in results]
    return [{"problems": len(results), "pass_rate": sum(passed) / len(results),
             "mean_drawn": sum(drawn) / len(results), "total_drawn": sum(drawn)}]


def sample_records(strategy: str, problems: Sequence[Problem],
                   samples: Sequence[Sequence[Sample]]) -> list[dict[str, Any]]:
    """One JSON-ready record per sample drawn."""
    records = []
    for p, row in zip(problems, samples):
        for j, s in enumerate(row):
            answer = answer_of(p, s.text)
            records.append({
                "strategy": strategy, "problem_id": p.id, "sample_index": j,
                "seed": s.extra.get("seed"), "text": s.text, "answer": answer,
                "reference": p.answer, "correct": verify(p, s.text), "num_tokens": s.num_tokens,
                "prompt_tokens": s.prompt_tokens,
                "thinking_tokens": s.extra.get("thinking_tokens", 0),
                "answer_tokens": s.extra.get("answer_tokens", s.num_tokens),
                "forced": s.extra.get("forced", False), "finish_reason": s.finish_reason})
    return records


class Replay:
    """A `Sampler` that hands out samples drawn earlier, in order, per prompt (so the
    strategies run per problem while the engine batched every problem in one call)."""

    def __init__(self, prompts: Sequence[str], samples: Sequence[Sequence[Sample]]):
        self._queue = {p: list(row) for p, row in zip(prompts, samples)}

    def sample(self, prompts: Sequence[str], n: int) -> list[list[Sample]]:
        out = []
        for p in prompts:
            row, self._queue[p] = self._queue[p][:n], self._queue[p][n:]
            out.append(row)
        return out


# -- running ----------------------------------------------------------------------------------


def draw_best_of_n(sampler, problems: Sequence[Problem], n: int, stop_on_first_pass: bool,
                   batch: int) -> list[list[Sample]]:
    """All of best-of-n's draws: n per problem in one call, or (stopping at the first pass)
    rounds of `batch` over the problems not yet solved, one engine call per round."""
    if not stop_on_first_pass:
        return sampler.sample([p.prompt for p in problems], n)
    drawn: list[list[Sample]] = [[] for _ in problems]
    active = list(range(len(problems)))
    while active:
        size = min(batch, n - len(drawn[active[0]]))
        rows = sampler.sample([problems[i].prompt for i in active], size)
        for i, row in zip(active, rows):
            drawn[i] += row
        active = [i for i in active if len(drawn[i]) < n
                  and not any(verify(problems[i], s.text) for s in drawn[i])]
    return drawn


def run_strategy(strategy: str, sampler, problems: Sequence[Problem], n: int, *,
                 stop_on_first_pass: bool = False, batch: int = 4
                 ) -> tuple[list[list[Sample]], list[dict[str, Any]], list[str]]:
    """Draws the samples and summarizes them: (samples, table rows, table columns)."""
    prompts = [p.prompt for p in problems]
    if len(set(prompts)) != len(prompts):
        raise ValueError("two problems share a prompt; give each problem its own prompt")
    if strategy == "self_consistency":
        samples = sampler.sample(prompts, n)
        replay = Replay(prompts, samples)
        for p in problems:  # the strategy itself, per problem, on the batched draws
            self_consistency(replay, p.prompt, n, lambda text, p=p: answer_of(p, text))
        rows = self_consistency_rows(problems, samples)
        return samples, rows, ["n", "majority_acc", "single_acc", "coverage", "agreement",
                               "no_answer"]
    if strategy == "repeated_sampling":
        result = repeated_sampling(sampler, problems, n)
        return result.samples, pass_at_k_rows(problems, result.samples), ["k", "pass_at_k"]
    if strategy == "best_of_n":
        samples = draw_best_of_n(sampler, problems, n, stop_on_first_pass, batch)
        replay = Replay(prompts, samples)
        results = [best_of_n(replay, p.prompt, n, lambda text, p=p: verify(p, text),
                             stop_on_first_pass=stop_on_first_pass, batch=batch)
                   for p in problems]
        rows = best_of_n_rows(results)
        return samples, rows, ["problems", "pass_rate", "mean_drawn", "total_drawn"]
    raise ValueError(f"strategy={strategy!r}; valid: {', '.join(STRATEGIES)}")


def _check_flags() -> None:
    """This CLI's own counts, checked before anything runs; errors name the flag."""
    for name in ("n", "batch", "num_problems", "thinking_budget", "answer_budget"):
        value = FLAGS[name].value
        if value is not None and value < 1:
            raise ValueError(f"--{name}={value} must be >= 1")
    if not 1 <= FLAGS.level <= 3:
        raise ValueError(f"--level={FLAGS.level} must be 1, 2 or 3")


def _resolve():
    """The RunConfig, with the TTS defaults (temperature, slots) where nothing set them."""
    run = jflags.resolve_config()
    sampling, engine = run.sampling, run.engine
    if FLAGS.temperature is None and sampling.temperature == 0:
        sampling = dataclasses.replace(sampling, temperature=DEFAULT_TEMPERATURE)
    if FLAGS.max_slots is None:
        engine = dataclasses.replace(engine, max_slots=min(32, FLAGS.num_problems * FLAGS.n))
    return dataclasses.replace(run, sampling=sampling, engine=engine)


def _effort():
    """The reasoning-effort budget the flags ask for (`EffortConfig`; None: no budget)."""
    from jaxinfer.tts import EffortConfig

    if FLAGS.reasoning_effort == "none":
        return None
    budgets = ({} if FLAGS.thinking_budget is None
               else {FLAGS.reasoning_effort: FLAGS.thinking_budget})
    return EffortConfig(level=FLAGS.reasoning_effort, budgets=budgets,
                        answer_budget=FLAGS.answer_budget)


@jflags.reporting_errors("jaxinfer-tts")
def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    _check_flags()

    jflags.skip_absent_tpu()
    from jaxinfer.engine.llm import load_llm
    from jaxinfer.tts import (
        SCHEMA_FORMATS,
        EngineSampler,
        answer_schema,
        load_tasks,
        with_answer_format,
    )

    jflags.use_compilation_cache()
    problems = load_tasks(FLAGS.task, FLAGS.num_problems, seed=FLAGS.task_seed, level=FLAGS.level)
    if FLAGS.answer_format != "text":
        problems = with_answer_format(problems, FLAGS.answer_format)
    schemas = {p.prompt: answer_schema(p) for p in problems if p.answer_format in SCHEMA_FORMATS}
    effort = _effort()
    run = _resolve()
    logging.debug("resolved config: %s", run.to_json())
    output = jflags.open_output("--output", FLAGS.output) if FLAGS.output else None
    t0 = time.perf_counter()
    llm = load_llm(run)
    print(f"[jaxinfer-tts] loaded the model in {time.perf_counter() - t0:.1f}s; "
          f"{len(problems)} problems x n={FLAGS.n}, {FLAGS.strategy}, "
          f"temperature={run.sampling.temperature}", file=sys.stderr)
    sampler = EngineSampler(llm, run.sampling, chat=FLAGS.chat, system=FLAGS.system,
                            effort=effort, prime_prefix=FLAGS.prime_prefix, use_tqdm=True,
                            schemas=schemas)
    samples, rows, columns = run_strategy(FLAGS.strategy, sampler, problems, FLAGS.n,
                                          stop_on_first_pass=FLAGS.stop_on_first_pass,
                                          batch=FLAGS.batch)
    records = sample_records(FLAGS.strategy, problems, samples)
    if output is not None:
        with output:
            for rec in records:
                output.write(json.dumps(rec, ensure_ascii=False) + "\n")
    cost = sampler.cost
    print(f"{FLAGS.strategy} on {FLAGS.task} ({len(problems)} problems, n={FLAGS.n}, "
          f"effort={FLAGS.reasoning_effort}, answer_format={FLAGS.answer_format})")
    print(summary_table(rows, columns))
    print(f"cost: {cost.requests} requests, prefill rows computed {cost.prefill_computed} / "
          f"reused {cost.prefill_reused}, decode tokens {cost.decode_tokens}, "
          f"{cost.wall_s:.1f}s ({cost.decode_tokens / max(cost.wall_s, 1e-9):.1f} tok/s)")
    if effort is not None:
        forced = sum(r["forced"] for r in records)
        thinking = sum(r["thinking_tokens"] for r in records) / len(records)
        print(f"effort {effort.level}: budget {effort.budget}, mean thinking tokens "
              f"{thinking:.1f}, forced {forced}/{len(records)}")
    print(json.dumps({"strategy": FLAGS.strategy, "task": FLAGS.task, "n": FLAGS.n,
                      "num_problems": len(problems), "rows": rows, "cost": cost.as_dict()}))
    return 0


def run() -> None:
    jflags.run_app(main, define_flags, doc=__doc__)


if __name__ == "__main__":
    run()
