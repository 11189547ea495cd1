"""Test-time scaling strategies over an abstract `Sampler` (docs/architecture.md, decision 7).

The strategies only need "n completions of each of these prompts", so they are written against
the `Sampler` protocol and tested with a fake. The engine-backed sampler (n samples of one prompt
sharing the prompt's pages: one prefill, n decodes) lives with the engine; this module imports
no jax.

- `self_consistency`: n samples, extract an answer from each, majority vote (Wang et al. 2022).
- `best_of_n`: n samples scored by a verifier; optionally stop at the first batch that passes.
- `repeated_sampling`: k_max samples per problem, verified, reported as pass@k for k = 1..k_max
  with the unbiased estimator (Brown et al. 2024, "Large Language Monkeys"; Chen et al. 2021).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from jaxinfer.tts.answers import Extractor, get_extractor
from jaxinfer.tts.passk import mean_pass_at_k
from jaxinfer.tts.tasks import Problem, verify
from jaxinfer.tts.voting import Vote, majority_vote


@dataclasses.dataclass
class Sample:
    """One completion. finish_reason: "eos" | "stop" | "length" | "error" (as `Completion`).

    num_tokens: generated tokens; prompt_tokens: tokens of the prompt; extra: anything the sampler
    wants to pass along (logprobs, metrics), never read by the strategies.
    """

    text: str
    num_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str = "eos"
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Sampler(Protocol):
    """Anything that draws n independent completions of each prompt."""

    def sample(self, prompts: Sequence[str], n: int) -> list[list[Sample]]:
        """Returns samples[i][j]: the j-th of n completions of prompts[i] ([len(prompts)][n])."""
        ...


def _draw(sampler: Sampler, prompts: Sequence[str], n: int) -> list[list[Sample]]:
    """sampler.sample, with its output's shape checked ([len(prompts)][n])."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    samples = sampler.sample(list(prompts), n)
    if len(samples) != len(prompts) or any(len(row) != n for row in samples):
        shape = [len(row) for row in samples]
        raise ValueError(f"sampler returned rows of sizes {shape}; expected {len(prompts)} x {n}")
    return samples


# -- self-consistency --------------------------------------------------------------------------


@dataclasses.dataclass
class SelfConsistencyResult:
    """answer: the vote's winner (None if no sample had an answer); answers[j] is samples[j]'s."""

    answer: str | None
    vote: Vote
    samples: list[Sample]
    answers: list[str | None]


def self_consistency(
    sampler: Sampler, prompt: str, n: int, extract_answer: Extractor | str
) -> SelfConsistencyResult:
    """Sample `prompt` n times and majority-vote the extracted answers.

    Args:
      extract_answer: text -> normalized answer or None, or an extractor's name ("number", ...).
    """
    extract = get_extractor(extract_answer) if isinstance(extract_answer, str) else extract_answer
    samples = _draw(sampler, [prompt], n)[0]
    answers = [extract(s.text) for s in samples]
    vote = majority_vote(answers)
    return SelfConsistencyResult(answer=vote.answer, vote=vote, samples=samples, answers=answers)


# -- best-of-n ---------------------------------------------------------------------------------


@dataclasses.dataclass
class BestOfNResult:
    """best = samples[index], or None (index None) when early stopping found no passing sample.

    num_drawn == len(samples) == len(passed) == len(scores): what was actually sampled.
    """

    best: Sample | None
    index: int | None
    num_drawn: int
    passed: list[bool]
    samples: list[Sample]
    scores: list[float]


def best_of_n(
    sampler: Sampler,
    prompt: str,
    n: int,
    verifier: Callable[[str], bool | float],
    stop_on_first_pass: bool = False,
    batch: int = 8,
    *,
    pass_threshold: float = 1.0,
) -> BestOfNResult:
    """Up to n samples of `prompt`, scored by `verifier`; the best one.

    The verifier returns a bool (True = 1.0, False = 0.0) or a float score; a sample passes when
    its score >= pass_threshold (so a bool verifier passes on True, a unit-test pass fraction on
    1.0).

    Without stop_on_first_pass: draws all n at once and returns the highest score (the first
    sample among equal scores). With it: draws in batches of `batch` (the last one smaller so no
    more than n are drawn) and stops after the first batch that holds a passing sample, returning
    the first passing sample and how many were drawn; `best` is None if none of the n passed.
    """
    if n < 1 or batch < 1:
        raise ValueError(f"need n >= 1 and batch >= 1, got n={n}, batch={batch}")
    samples: list[Sample] = []
    scores: list[float] = []
    step = batch if stop_on_first_pass else n
    while len(samples) < n:
        drawn = _draw(sampler, [prompt], min(step, n - len(samples)))[0]
        samples += drawn
        scores += [float(verifier(s.text)) for s in drawn]
        if stop_on_first_pass and max(scores) >= pass_threshold:
            break
    passed = [score >= pass_threshold for score in scores]
    if stop_on_first_pass:
        index = passed.index(True) if any(passed) else None
    else:
        index = max(range(len(scores)), key=scores.__getitem__)  # max keeps the first on ties
    return BestOfNResult(
        best=None if index is None else samples[index],
        index=index,
        num_drawn=len(samples),
        passed=passed,
        samples=samples,
        scores=scores,
    )


# -- repeated sampling -------------------------------------------------------------------------


@dataclasses.dataclass
class RepeatedSamplingResult:
    """per_problem[i] = (n, c): samples drawn and correct for problems[i].

    pass_at_k: {k: mean unbiased pass@k over problems} for k = 1..k_max.
    samples[i][j], correct[i][j]: the j-th sample of problems[i] and its verdict.
    """

    per_problem: list[tuple[int, int]]
    pass_at_k: dict[int, float]
    samples: list[list[Sample]]
    correct: list[list[bool]]


def repeated_sampling(
    sampler: Sampler,
    problems: Sequence[Problem],
    k_max: int,
    verifier: Callable[[Problem, str], bool] | None = None,
) -> RepeatedSamplingResult:
    """k_max samples of every problem in one sampler call, verified, summarized as pass@k.

    Args:
      verifier: (problem, text) -> correct?; default `tasks.verify` (the problem's extractor
        compared with its reference answer).
    """
    if not problems:
        raise ValueError("repeated_sampling needs at least one problem")
    check = verify if verifier is None else verifier
    samples = _draw(sampler, [p.prompt for p in problems], k_max)
    correct = [[bool(check(p, s.text)) for s in row] for p, row in zip(problems, samples)]
    per_problem = [(k_max, sum(row)) for row in correct]
    pass_at = {k: mean_pass_at_k(per_problem, k) for k in range(1, k_max + 1)}
    return RepeatedSamplingResult(per_problem, pass_at, samples, correct)


# -- reporting ---------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def summary_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A plain aligned text table: a header, a rule, one line per row.

    Numbers are right-aligned (floats with 4 decimals), other cells left-aligned; a missing or
    None value prints as "-". No trailing spaces, no final newline.
    """
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    numeric = [
        all(isinstance(row.get(c), (int, float)) or row.get(c) is None for row in rows)
        and any(isinstance(row.get(c), (int, float)) for row in rows)
        for c in columns
    ]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]

    def fmt(line: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(line, widths, numeric)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(list(columns)), rule] + [fmt(line) for line in cells])
