"""What the engine gives back: a `RequestOutput` per streamed token, a `Completion` per request."""

from __future__ import annotations

import dataclasses

from jaxinfer.perf.metrics import RequestMetrics


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One streamed token: its request, id, the text it added, and whether the request ended;
    with its logprob (and top logprobs) when the request asked for them."""

    request_id: str
    token_id: int
    text: str
    finished: bool
    finish_reason: str | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclasses.dataclass
class Completion:
    """One finished sample. finish_reason: "eos" (an end-of-sequence token, which is the last
    of `token_ids`), "stop" (a stop string completed; `text` ends before it), "length"
    (max_new_tokens reached), "abort" (`Engine.abort`) or "error" (`error` says why: bad input
    to `LLM.generate(raise_on_error=False)`, or the detokenizer failed)."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None
    metrics: RequestMetrics = dataclasses.field(default_factory=RequestMetrics)


def completion_of(req) -> Completion:
    """The `Completion` of a finished `jaxinfer.engine.request.Request`."""
    return Completion(
        prompt_ids=req.prompt_ids, token_ids=list(req.output_ids), text=req.text,
        finish_reason=req.finish_reason, logprobs=req.logprobs, top_logprobs=req.top_logprobs,
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
