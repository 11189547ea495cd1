"""Reasoning effort as a thinking budget, enforced client-side on the engine.

The effort level is announced GPT-OSS style, as a `Reasoning: <level>` line in the system
message, and made binding by budget forcing (Muennighoff et al. 2025, "s1: Simple test-time
scaling"), done by the client in two engine calls:

1. Thinking: generate at most `budget` tokens with the stop string "Final answer:".
2. Answer: if the model reached "Final answer:" by itself, continue from prompt + thinking +
   "Final answer:"; if it hit the budget (or ended its turn without the marker) the thinking is
   cut there and the force text ("\\nFinal answer:") is appended so it must answer. Either way
   it gets `answer_budget` more tokens.

The continuation is built as token ids: the chat prompt (with its generation header) + the
thinking tokens exactly as generated (so the prefix cache serves phase 1's pages to phase 2) +
the marker's ids. The thinking therefore never exceeds the budget. (s1 also *extends* thinking
by suppressing the end and appending "Wait"; only the cap is implemented here.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jaxinfer.config import SamplingConfig
from jaxinfer.tts.strategies import Sample

if TYPE_CHECKING:  # the engine imports jax; jaxinfer.tts must import without it
    from jaxinfer.engine.outputs import Completion

LEVELS = ("low", "medium", "high")
DEFAULT_BUDGETS: Mapping[str, int] = {"low": 64, "medium": 256, "high": 1024}
MARKER = "Final answer:"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EffortConfig:
    """level: "low" | "medium" | "high"; budgets: thinking tokens per level (overrides merge
    into DEFAULT_BUDGETS); answer_budget: tokens after the marker; marker: the stop string that
    ends thinking; force_text: appended when thinking is cut (it must end with the marker)."""

    level: str = "medium"
    budgets: Mapping[str, int] = dataclasses.field(default_factory=dict)
    answer_budget: int = 32
    marker: str = MARKER
    force_text: str = "\n" + MARKER

    def __post_init__(self):
        budgets = {**DEFAULT_BUDGETS, **self.budgets}
        object.__setattr__(self, "budgets", budgets)
        if self.level not in budgets:
            raise ValueError(f"level={self.level!r}; valid: {', '.join(budgets)}")
        bad = {k: v for k, v in budgets.items() if not (isinstance(v, int) and v > 0)}
        if bad:
            raise ValueError(f"budgets {bad} must be positive integers")
        if self.answer_budget <= 0:
            raise ValueError(f"answer_budget={self.answer_budget} must be > 0")
        if not self.marker or not self.force_text.endswith(self.marker):
            raise ValueError(f"force_text={self.force_text!r} must end with "
                             f"marker={self.marker!r}")

    @property
    def budget(self) -> int:
        """Thinking tokens allowed at this level."""
        return self.budgets[self.level]


def system_prompt(level: str, base_system: str | None = None, marker: str = MARKER) -> str:
    """The system message of an effort level: "Reasoning: <level>", the base system text, and
    an instruction to think step by step and end with the marker."""
    if level not in DEFAULT_BUDGETS:
        raise ValueError(f"level={level!r}; valid: {', '.join(DEFAULT_BUDGETS)}")
    lines = [f"Reasoning: {level}"]
    if base_system:
        lines.append(base_system)
    lines.append(f"Think step by step, then give your answer after '{marker}'.")
    return "\n".join(lines)


@dataclasses.dataclass
class BudgetedCompletion:
    """A two-phase completion. text = thinking_text + joint + answer_text, where joint is the
    text appended between the phases (the marker or the force text)."""

    prompt_ids: list[int]
    thinking_ids: list[int]
    thinking_text: str
    joint: str
    answer: Completion | None  # None until phase 2 ran (`continue_after`)
    forced: bool
    phase1_finish: str
    phase1: Completion

    @property
    def text(self) -> str:
        return self.thinking_text + self.joint + self.answer.text

    def to_sample(self, seed: int) -> Sample:
        p1, p2 = self.phase1.metrics, self.answer.metrics
        thinking, answer = len(self.thinking_ids), len(self.answer.token_ids)
        start, end = p1.arrival, (p2.token_times or p1.token_times or [p1.arrival])[-1]
        return Sample(
            text=self.text, num_tokens=thinking + answer, prompt_tokens=len(self.prompt_ids),
            finish_reason=self.answer.finish_reason,
            extra={"seed": seed, "thinking_tokens": thinking, "answer_tokens": answer,
                   "forced": self.forced, "phase1_finish": self.phase1_finish,
                   "prompt_computed": p1.prompt_computed + p2.prompt_computed,
                   "prompt_reused": p1.prompt_reused + p2.prompt_reused,
                   "wall_s": end - start})


Generate = Callable[[Sequence[Any], Sequence[SamplingConfig], bool], "list[Completion]"]


def thinking_config(config: SamplingConfig, effort: EffortConfig) -> SamplingConfig:
    """Phase 1's sampling: the thinking budget, stopping at the marker."""
    return dataclasses.replace(config, max_new_tokens=effort.budget,
                               stop=(*config.stop, effort.marker))


def answer_config(config: SamplingConfig, effort: EffortConfig) -> SamplingConfig:
    """Phase 2's sampling: the answer budget."""
    return dataclasses.replace(config, max_new_tokens=effort.answer_budget)


def continue_after(prompt_ids: Sequence[int], first: Completion, tokenizer,
                   effort: EffortConfig) -> tuple[BudgetedCompletion, list[int]]:
    """Phase 1's completion -> (the budgeted completion without its answer, phase 2's prompt:
    the prompt, the thinking ids and the joint's ids). `finish` fills in the answer."""
    thinking, text, joint, forced = _cut(first, tokenizer, set(tokenizer.eos_ids), effort)
    partial = BudgetedCompletion(prompt_ids=list(prompt_ids), thinking_ids=thinking,
                                 thinking_text=text, joint=joint, answer=None, forced=forced,
                                 phase1_finish=first.finish_reason, phase1=first)
    return partial, [*prompt_ids, *thinking, *tokenizer.encode(joint, add_special_tokens=False)]


def generate_with_budget(generate: Generate, tokenizer, vocab_size: int,
                         prompts: Sequence[str | Sequence[int]],
                         configs: Sequence[SamplingConfig], effort: EffortConfig, *,
                         system: str | None) -> list[BudgetedCompletion]:
    """Budget-forced generation of every prompt: two `generate` calls in all.

    Args:
      generate: (prompts, configs, chat) -> completions, e.g. `LLM.generate` (the sampler
        passes its cost-counting wrapper).
      tokenizer: encodes the chat prompt and the marker (required).
      prompts: user messages (chat-rendered with `system`) or token ids (used as given).
      configs: one per prompt; max_new_tokens is replaced by the budgets.
    """
    from jaxinfer.engine.prompts import encode_prompt

    if tokenizer is None:
        raise ValueError("budget forcing needs a tokenizer (to encode the marker)")
    ids = [encode_prompt(tokenizer, vocab_size, p, chat=isinstance(p, str), system=system)
           for p in prompts]
    first = generate(ids, [thinking_config(c, effort) for c in configs], False)
    partials, continuations = zip(*(continue_after(p, c, tokenizer, effort)
                                    for p, c in zip(ids, first)))
    second = generate(list(continuations), [answer_config(c, effort) for c in configs], False)
    return [dataclasses.replace(b, answer=a) for b, a in zip(partials, second)]


def _cut(c: Completion, tokenizer, eos: set[int], effort: EffortConfig
         ) -> tuple[list[int], str, str, bool]:
    """Phase 1's completion -> (thinking ids, their text, text to append, forced?).

    "stop" (the marker was reached): the thinking is the longest prefix of the generated ids
    whose text is a prefix of the text before the marker; the rest of that text and the marker
    are appended. "length" (budget hit) and "eos" (turn ended without the marker): every
    generated id but EOS is thinking, and the force text is appended.
    """
    if c.finish_reason == "error":
        raise ValueError(f"thinking phase failed: {c.error}")
    out = list(c.token_ids)
    if c.finish_reason != "stop":
        if out and out[-1] in eos:
            out = out[:-1]
        return out, tokenizer.decode(out), effort.force_text, True
    for k in range(len(out), -1, -1):
        text = tokenizer.decode(out[:k])
        if c.text.startswith(text):
            return out[:k], text, c.text[len(text):] + effort.marker, False
    raise AssertionError("unreachable: the empty prefix always matches")
