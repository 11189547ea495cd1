"""A request as the scheduler sees it, what one step computes for it (`Chunk`, `SchedulerOutput`),
and what one sampled token does to it (`accept_token`). Host-only: imports no jax.

Accepting a token touches only the request (its output, text and finish reason); freeing the
pages and slot of a request that finished is the scheduler's part (`jaxinfer.engine.scheduler`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxinfer.config import SamplingConfig

WAITING, RUNNING, FORKING, FINISHED = "waiting", "running", "forking", "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """A request as the scheduler sees it. `params` is opaque here (the engine's sampling config).

    Token accounting: `num_tokens` counts prompt + output + `num_pending` (tokens sampled by
    dispatched steps whose values have not reached the host yet); `num_computed` counts tokens
    whose K/V is in the cache or being written by a dispatched step.
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    params: Any = None
    eos_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    detokenizer: Any = None  # .push(token) -> new text, .flush() -> held-back text
    # Structured output: .advance(token) -> None, or why the constraint forbids the token
    # (`jaxinfer.engine.constraints.Constraint`); None = unconstrained.
    constraint: Any = None
    cacheable: bool = True  # may start from cached prefix pages (False: compute from token 0)
    # The LoRA adapter it runs with (`jaxinfer.engine.adapters`: its key, unique per load; None:
    # the base model), and the adapter's pool slot while it holds an engine slot (-1: none).
    lora: str | None = None
    lora_slot: int = -1
    arrival: float = dataclasses.field(default_factory=time.perf_counter)

    status: str = WAITING
    finish_reason: str | None = None  # eos | stop | length | abort | error
    error: str | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    # Characters of `text` the stream has been given (`TokenEvent.text`); the rest is held back
    # while it may still begin a stop string (`accept_token`).
    streamed: int = 0
    num_pending: int = 0
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    # Hybrid pools: the local-layer page of each of `pages` (None: behind the window, released).
    local_pages: list[int | None] = dataclasses.field(default_factory=list)
    slot: int | None = None
    shard: int | None = None  # the data shard of its slot and pages (while it holds them)
    device_token: bool = False  # the slot's device state holds this request's newest token
    num_cached_blocks: int = 0  # leading full pages already registered in the prefix cache
    # Metrics.
    token_times: list[float] = dataclasses.field(default_factory=list)
    prompt_computed: int = 0  # prompt token rows computed (recomputation after preemption too)
    prompt_reused: int = 0  # prompt token rows taken from the prefix cache
    num_preemptions: int = 0
    spec_drafted: int = 0  # speculative draft tokens verified / accepted
    spec_accepted: int = 0
    # Logprobs of the sampled tokens (and the top-n), when the request asks for them.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # Prompt logprobs (`SamplingConfig.prompt_logprobs`), one entry per prompt position as its
    # chunks are collected; position 0 has none (None).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # n samples of one prompt (`jaxinfer.engine.scheduler` module docstring, "Forks"): a
    # prefill-only parent computes the prompt once; each child starts from its pages.
    prefill_only: bool = False
    fork_of: Request | None = None
    children_left: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def known_tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def done_sampling(self) -> bool:
        return len(self.output_ids) + self.num_pending >= self.max_new_tokens


@dataclasses.dataclass
class Chunk:
    """Tokens [start, start + num_tokens) of `request`, computed this step in slot `slot`.
    tokens: their ids, or None for a decode row whose one token is on the device.
    samples: the chunk ends at the request's newest token, so the step samples the next one."""

    request: Request
    slot: int
    start: int
    num_tokens: int
    tokens: list[int] | None
    samples: bool

    @property
    def is_decode(self) -> bool:
        return self.tokens is None


@dataclasses.dataclass
class SchedulerOutput:
    chunks: list[Chunk] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)
    # (source page, destination page): copy-on-write of a fork's partial last page, to run on
    # the device before this step's chunks ...
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # ... and after them (the source is written by this step: a fanned-out child's).
    post_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # The same two, of a hybrid cache's local pool (its local layers' pages).
    local_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    local_post_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # (child, parent): the child samples its first token from the logits of the parent's last
    # prompt position, computed by the parent's chunk in this step; the child computes nothing.
    fanouts: list[tuple[Request, Request]] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def decodes(self) -> list[Chunk]:
        return [c for c in self.chunks if c.is_decode]

    @property
    def prefills(self) -> list[Chunk]:
        return [c for c in self.chunks if not c.is_decode]


@dataclasses.dataclass
class TokenEvent:
    """What one sampled token did to its request (the engine's streaming unit)."""

    request: Request
    token: int
    text: str  # the text this token releases to the stream (see `accept_token`)
    finished: bool


def accept_token(req: Request, token: int, now: float) -> tuple[TokenEvent, str | None]:
    """Appends a sampled token (and its time `now`) to `req`, detokenizes it and cuts the text
    at a completed stop string. Returns the token's event and the finish reason it brings
    ("eos", "stop", "length", or "error" if the constraint forbids the token or the
    detokenizer raised), or None. The caller applies that finish: it alone knows the request's
    pages and slot.

    The events' texts add up to the request's final `text`, and no event releases text that
    the final text lacks: text that may still begin a stop string (a suffix of `text` that is
    a proper prefix of one) is held back until a later token shows it is not one (released
    then) or completes the stop (dropped with it); the event that finishes the request
    releases whatever is still held back of the final text (`release_rest`)."""
    req.output_ids.append(token)
    req.token_times.append(now)
    try:
        if token in req.eos_ids:
            return _finish_event(req, token), "eos"
        if req.constraint is not None:
            error = req.constraint.advance(token)
            if error is not None:
                req.error = error
                return _finish_event(req, token), "error"
        if req.detokenizer is not None and _extend(req, req.detokenizer.push(token)):
            return _finish_event(req, token), "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            stopped = req.detokenizer is not None and _extend(req, req.detokenizer.flush())
            return _finish_event(req, token), "stop" if stopped else "length"
    except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
        req.error = f"{type(e).__name__}: {e}"
        return _finish_event(req, token), "error"
    end = len(req.text) - held_back(req.text, req.stop, req.streamed)
    text, req.streamed = req.text[req.streamed:end], end
    return TokenEvent(req, token, text, False), None


def _extend(req: Request, new: str) -> bool:
    """Appends detokenized text to `req.text`; True if it completed a stop string (the text is
    then cut where that stop string begins)."""
    req.text += new
    cut = stop_cut(req.text, req.stop, len(new)) if req.stop and new else None
    if cut is not None:
        req.text = req.text[:cut]
    return cut is not None


def _finish_event(req: Request, token: int) -> TokenEvent:
    return TokenEvent(req, token, release_rest(req), True)


def release_rest(req: Request) -> str:
    """The text of `req` the stream has not been given yet, now given: what a request's last
    event carries (also an aborted one's, `Engine.abort`)."""
    text, req.streamed = req.text[req.streamed:], len(req.text)
    return text


def stop_cut(text: str, stops: Sequence[str], num_new: int) -> int | None:
    """Where to cut `text` for the first stop string that its newest `num_new` characters
    completed (searching only where such a match can start), or None if none did."""
    longest = max(len(s) for s in stops)
    begin = max(0, len(text) - num_new - longest + 1)
    hits = [i for i in (text.find(s, begin) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str], start: int = 0) -> int:
    """The length of the longest suffix of text[start:] that is a proper prefix of one of
    `stops`: text a stream holds back, since the next characters may complete a stop string."""
    room = len(text) - start
    for n in range(min(room, max((len(s) for s in stops), default=1) - 1), 0, -1):
        tail = text[len(text) - n:]
        if any(len(s) > n and s.startswith(tail) for s in stops):
            return n
    return 0


def make_requests(request_id: str, prompt_ids: list[int], sampling: SamplingConfig, *,
                  arrival: float, eos_ids: frozenset[int] = frozenset(),
                  detokenizer: Callable[[], Any] | None = None,
                  constraint: Callable[[], Any] | None = None,
                  lora: str | None = None) -> list[Request]:
    """The scheduler requests of one request the engine is given: itself when n = 1; else its
    n samples "<id>/0" .. "<id>/<n-1>" (sample i seeded seed + i), led by a prefill-only parent
    "<id>/prefill" that computes the prompt once for all of them (`Engine.add_request`) —
    except with penalties, prompt logprobs or a one-token prompt, where each sample computes its
    prompt itself.
    `detokenizer`: makes each request's streaming detokenizer (None: token ids only);
    `constraint`: makes each sample's own constraint state (None: unconstrained);
    `lora`: the adapter key every one of them runs with (`Request.lora`)."""

    def make(rid: str, sc: SamplingConfig, fork_of: Request | None = None) -> Request:
        return Request(
            request_id=rid, prompt_ids=prompt_ids, max_new_tokens=sc.max_new_tokens, params=sc,
            eos_ids=eos_ids, stop=sc.stop, detokenizer=detokenizer() if detokenizer else None,
            constraint=constraint() if constraint else None,
            cacheable=sc.cacheable, arrival=arrival, fork_of=fork_of, lora=lora,
            logprobs=[] if sc.logprobs else None, top_logprobs=[] if sc.top_logprobs else None,
            prompt_logprobs=None if sc.prompt_logprobs is None else [None],
            prompt_top_logprobs=None if sc.prompt_logprobs is None else [None])

    if sampling.n == 1:
        return [make(request_id, sampling)]
    parent = None
    if sampling.cacheable and len(prompt_ids) >= 2:
        parent = Request(request_id=f"{request_id}/prefill", prompt_ids=prompt_ids,
                         max_new_tokens=1, prefill_only=True, arrival=arrival,
                         children_left=sampling.n, lora=lora)
    samples = [make(sid, dataclasses.replace(sampling, n=1, seed=sampling.seed + i), parent)
               for i, sid in enumerate(sample_ids(request_id, sampling.n))]
    return [parent, *samples] if parent else samples


def sample_ids(request_id: str, n: int) -> list[str]:
    """The ids of the n samples of a request added with `SamplingConfig(n=n)`."""
    return [request_id] if n == 1 else [f"{request_id}/{i}" for i in range(n)]
