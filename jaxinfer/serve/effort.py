"""`reasoning_effort` on `/v1/chat/completions`: the thinking budgets of `jaxinfer.tts.effort`.

The level becomes the `Reasoning: <level>` system line (merged into the request's own system
message) and is made binding by budget forcing (`jaxinfer.tts.effort`): phase 1 thinks for at
most the level's budget (`tts.effort.DEFAULT_BUDGETS`: low 64, medium 256, high 1024 tokens),
stopping at "Final answer:"; phase 2 answers in at most `max_tokens` (or
`max_completion_tokens`) more, continuing from the prompt + the thinking ids + the marker (so
the prefix cache serves phase 1's pages). The n samples think as one engine request (one
prefill; sample j uses seed + j) and answer as n requests (each its own continuation, seed + j).

The content is thinking + marker + answer; `EffortRun.deltas` yields it as it grows (phase 1's
text, then the marker, or the force text where the budget cut the thinking, then the answer),
which the handler streams or collects. usage counts both phases' tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from jaxinfer.config import SamplingConfig
from jaxinfer.engine.outputs import Completion
from jaxinfer.serve import protocol
from jaxinfer.serve.engine_loop import Done
from jaxinfer.serve.generation import Generation
from jaxinfer.serve.server import APIError, Server, engine_error
from jaxinfer.tts.effort import (
    BudgetedCompletion,
    EffortConfig,
    answer_config,
    continue_after,
    system_prompt,
    thinking_config,
)


def with_effort_system(conversation: list[dict], level: str) -> list[dict]:
    """The conversation with its system message (if any) led by the effort's lines."""
    if conversation and conversation[0]["role"] == "system":
        return [{"role": "system", "content": system_prompt(level, conversation[0]["content"])},
                *conversation[1:]]
    return [{"role": "system", "content": system_prompt(level)}, *conversation]


class EffortRun:
    """The two phases of one chat request with `reasoning_effort`.

    Args:
      server: admits and submits the engine requests.
      ids: the chat prompt (with the effort's system line).
      sampling: the request's sampling (`max_new_tokens` is the answer's budget; n samples).
      level: "low" | "medium" | "high".
    """

    def __init__(self, server: Server, ids: list[int], sampling: SamplingConfig, level: str):
        self.server, self.ids, self.sampling = server, ids, sampling
        self.effort = EffortConfig(level=level, answer_budget=sampling.max_new_tokens)
        self.tokenizer = server.engine.tokenizer
        context = server.engine.cache_config.max_seq_len
        joint = len(self.tokenizer.encode(self.effort.force_text, add_special_tokens=False))
        if len(ids) + self.effort.budget + joint >= context:
            raise APIError(400, f"the prompt ({len(ids)} tokens) and reasoning_effort={level!r}'s "
                                f"thinking budget ({self.effort.budget} tokens) do not fit the "
                                f"context ({context}); use a lower effort or a shorter prompt",
                           param="reasoning_effort", code="context_length_exceeded")
        self.gens: list[Generation] = []
        self.completions: list[BudgetedCompletion | None] = [None] * sampling.n

    def abort(self) -> None:
        for gen in self.gens:
            gen.abort()

    async def deltas(self, arrival: float) -> AsyncIterator[tuple[int, str, str | None]]:
        """(choice, text, OpenAI finish reason or None) as each sample's content grows; at the
        end `completions` holds every sample's `BudgetedCompletion`."""
        gen = await self.server.start([self.ids], thinking_config(self.sampling, self.effort),
                                      arrival)
        self.gens.append(gen)
        first = []
        async for m in gen.messages():
            if isinstance(m, Done):
                first = m.completions
            elif m.output.text:
                yield m.sample, m.output.text, None
        if any(c.finish_reason == "abort" for c in first):  # aborted: no answer phase
            for j, c in enumerate(first):
                self.completions[j] = _aborted(self.ids, c)
                yield j, "", protocol.FINISH_REASONS["abort"]
            return
        partials, continuations = [], []
        for j, c in enumerate(first):
            try:
                partial, continuation = continue_after(self.ids, c, self.tokenizer, self.effort)
            except ValueError as e:  # the thinking phase ended in an error
                raise engine_error(e, "messages") from None
            partials.append(partial)
            continuations.append(continuation)
            # Phase 1 streamed c.text; the content continues with the rest up to the answer.
            upto_answer = partial.thinking_text + partial.joint
            yield j, (upto_answer[len(c.text):] if upto_answer.startswith(c.text)
                      else partial.joint), None
        configs = [answer_config(dataclasses.replace(self.sampling, n=1,
                                                     seed=self.sampling.seed + j), self.effort)
                   for j in range(len(first))]
        gen = await self.server.start(continuations, configs, arrival, admitted=True)
        self.gens.append(gen)
        async for m in gen.messages():
            j = gen.choice(m.request_id, 0)
            if isinstance(m, Done):
                self.completions[j] = dataclasses.replace(partials[j], answer=m.completions[0])
                for _, c in gen.unended(m):
                    yield j, "", protocol.FINISH_REASONS[c.finish_reason]
            elif m.output.text or m.output.finished:
                reason = (protocol.FINISH_REASONS[m.output.finish_reason]
                          if m.output.finished else None)
                yield j, m.output.text, reason

    def usage(self) -> dict:
        outs = [b for b in self.completions if b is not None]
        thinking = sum(len(b.thinking_ids) for b in outs)
        completion = thinking + sum(len(b.answer.token_ids) for b in outs)
        cached = max((b.phase1.metrics.prompt_reused for b in outs), default=0)
        return {"prompt_tokens": len(self.ids), "completion_tokens": completion,
                "total_tokens": len(self.ids) + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
                "completion_tokens_details": {"reasoning_tokens": thinking}}


def _aborted(ids: list[int], first: Completion) -> BudgetedCompletion:
    """A sample whose thinking phase was aborted: its thinking so far, no answer phase."""
    return BudgetedCompletion(
        prompt_ids=ids, thinking_ids=list(first.token_ids), thinking_text=first.text, joint="",
        answer=Completion(prompt_ids=[], token_ids=[], text="", finish_reason="abort"),
        forced=False, phase1_finish="abort", phase1=first)
