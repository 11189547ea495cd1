"""What the engine gives back: a `RequestOutput` per streamed token, a `Completion` per request."""

from __future__ import annotations

import collections
import dataclasses

from jaxinfer.engine.request import TokenEvent
from jaxinfer.perf.metrics import RequestMetrics


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One streamed token: its request, id, the text it releases, and whether the request
    ended; with its logprob (and top logprobs) when the request asked for them, and on a
    request's first token its prompt logprobs (`Completion.prompt_logprobs`) when it asked for
    those. A request's outputs' texts add up to its `Completion.text`, and none shows text
    that the final text lacks: text that may still begin a stop string is held back until it
    cannot (`jaxinfer.engine.request.accept_token`). token_id None: the output of an abort
    (`Engine.abort`), which releases what was held back."""

    request_id: str
    token_id: int | None
    text: str
    finished: bool
    finish_reason: str | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclasses.dataclass
class Completion:
    """One finished sample. finish_reason: "eos" (an end-of-sequence token, which is the last
    of `token_ids`), "stop" (a stop string completed; `text` ends before it), "length"
    (max_new_tokens reached), "abort" (`Engine.abort`) or "error" (`error` says why: bad input
    to `LLM.generate(raise_on_error=False)`, or the detokenizer failed).

    prompt_logprobs / prompt_top_logprobs (with `SamplingConfig.prompt_logprobs`): per prompt
    position, the raw logprob of that prompt token given the ones before it, and the top
    alternatives; position 0 has none (None), as in vLLM."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    error: str | None = None
    metrics: RequestMetrics = dataclasses.field(default_factory=RequestMetrics)


def request_outputs(events: list[TokenEvent]) -> list[RequestOutput]:
    """The `RequestOutput` of each `TokenEvent` of a step, with the token's logprobs when its
    request records them (and its prompt's, on its first token)."""
    # A request's events of one step are its newest tokens, in order (several with
    # speculation): event j of k is output token len(output_ids) - k + j.
    left = collections.Counter(e.request.request_id for e in events)
    outs = []
    for e in events:
        req = e.request
        left[req.request_id] -= 1
        i = len(req.output_ids) - 1 - left[req.request_id]
        logprob = req.logprobs[i] if req.logprobs and i < len(req.logprobs) else None
        top = req.top_logprobs[i] if req.top_logprobs and i < len(req.top_logprobs) else None
        first = i == 0 and req.prompt_logprobs is not None
        outs.append(RequestOutput(
            req.request_id, e.token, e.text, e.finished, req.finish_reason, logprob=logprob,
            top_logprobs=top, prompt_logprobs=req.prompt_logprobs if first else None,
            prompt_top_logprobs=req.prompt_top_logprobs if first else None))
    return outs


def completion_of(req) -> Completion:
    """The `Completion` of a finished `jaxinfer.engine.request.Request`."""
    return Completion(
        prompt_ids=req.prompt_ids, token_ids=list(req.output_ids), text=req.text,
        finish_reason=req.finish_reason, logprobs=req.logprobs, top_logprobs=req.top_logprobs,
        prompt_logprobs=req.prompt_logprobs, prompt_top_logprobs=req.prompt_top_logprobs,
        error=req.error,
        metrics=RequestMetrics(arrival=req.arrival, token_times=list(req.token_times),
                               prompt_computed=req.prompt_computed,
                               prompt_reused=req.prompt_reused,
                               num_preemptions=req.num_preemptions,
                               spec_drafted=req.spec_drafted, spec_accepted=req.spec_accepted))


def record_logprobs(req, out, row) -> None:
    """Appends the logprobs of one sampled token to `req` (a `jaxinfer.engine.request.Request`),
    if it asked for them and is still running. `out`: a host `SampleOutput` or `VerifyOutput`;
    `row`: the token's index in it."""
    if req.finished:
        return
    if req.logprobs is not None:
        req.logprobs.append(float(out.logprobs[row]))
    if req.top_logprobs is not None:
        n = req.params.top_logprobs
        req.top_logprobs.append([(int(t), float(lp)) for t, lp in zip(
            out.top_ids[row][:n], out.top_logprobs[row][:n])])


def record_prompt_logprobs(req, out, start: int, num_tokens: int) -> None:
    """Appends the prompt logprobs one prompt chunk (`num_tokens` tokens from position `start`)
    computed to `req`. `out`: the host `SampleOutput` of the chunk's rows (`steps.mixed_step`
    with `prompt_logprobs`), row i scoring the token at position start + i + 1. Positions
    already recorded (a chunk computed again after a preemption) and those past the prompt are
    skipped."""
    if req.finished or req.prompt_logprobs is None:
        return
    n = req.params.prompt_logprobs
    end = min(start + num_tokens, len(req.prompt_ids) - 1)  # last position this chunk scores
    for pos in range(max(len(req.prompt_logprobs), start + 1), end + 1):
        i = pos - start - 1
        req.prompt_logprobs.append(float(out.logprobs[i]))
        req.prompt_top_logprobs.append([(int(t), float(lp)) for t, lp in zip(
            out.top_ids[i][:n], out.top_logprobs[i][:n])])
