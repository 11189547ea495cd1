"""`reasoning_effort` on `/v1/chat/completions`: the thinking budgets of `jaxinfer.tts.effort`.

The level becomes the `Reasoning: <level>` system line (merged into the request's own system
message) and is made binding by budget forcing (`tts.effort.generate_with_budget`): the model
thinks for at most the level's budget (`tts.effort.DEFAULT_BUDGETS`: low 64, medium 256, high
1024 tokens), then answers after "Final answer:" in at most `max_tokens` (or
`max_completion_tokens`) more. The returned content is thinking + marker + answer; usage counts
both phases' tokens. Two engine requests per sample, one after the other, so such a request
cannot stream (`stream: true` is a 400). The phases run on a worker thread that submits to the
engine thread and blocks on its answers; a disconnect aborts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from jaxinfer.config import SamplingConfig
from jaxinfer.engine.outputs import Completion
from jaxinfer.serve import protocol
from jaxinfer.serve.engine_loop import Done, EngineLoop, Failed
from jaxinfer.serve.generation import ClientGone, EngineFailed, wait_disconnect
from jaxinfer.serve.server import APIError, Server
from jaxinfer.tts.effort import EffortConfig, generate_with_budget, system_prompt


def with_effort_system(conversation: list[dict], level: str) -> list[dict]:
    """The conversation with its system message (if any) led by the effort's lines."""
    if conversation and conversation[0]["role"] == "system":
        return [{"role": "system", "content": system_prompt(level, conversation[0]["content"])},
                *conversation[1:]]
    return [{"role": "system", "content": system_prompt(level)}, *conversation]


class _BlockingGenerate:
    """`generate_with_budget`'s `generate` on the engine thread, for a worker thread."""

    def __init__(self, engine_loop: EngineLoop, count):
        self.engine_loop = engine_loop
        self.count = count  # called with the number of engine requests submitted
        self.cancelled = threading.Event()
        self.request_ids: list[str] = []
        self._lock = threading.Lock()

    def cancel(self) -> None:
        self.cancelled.set()
        with self._lock:
            for rid in self.request_ids:
                self.engine_loop.abort(rid)

    def __call__(self, prompts, configs, chat: bool) -> list[Completion]:
        answers: queue.SimpleQueue = queue.SimpleQueue()
        rids = []
        for p, c in zip(prompts, configs):
            rid = self.engine_loop.submit(p, c, answers.put).result()
            with self._lock:
                self.request_ids.append(rid)
            rids.append(rid)
            if self.cancelled.is_set():
                self.cancel()
        self.count(len(rids))
        done: dict[str, Completion] = {}
        while len(done) < len(rids):
            for m in answers.get():
                if isinstance(m, Failed):
                    raise EngineFailed(m.message)
                if isinstance(m, Done):
                    done[m.request_id] = m.completions[0]
        if self.cancelled.is_set():
            raise ClientGone
        return [done[r] for r in rids]


async def chat_with_effort(server: Server, request: Request, body, ids: list[int],
                           sampling: SamplingConfig, head: dict) -> Response:
    if body.stream:
        raise APIError(400, "reasoning_effort cannot stream: budget forcing runs thinking and "
                            "answer as two engine requests; use stream=false", param="stream")
    engine = server.engine
    effort = EffortConfig(level=body.reasoning_effort, answer_budget=sampling.max_new_tokens)
    configs = [dataclasses.replace(sampling, n=1, seed=sampling.seed + i)
               for i in range(sampling.n)]
    server.admit(sampling.n)
    generate = _BlockingGenerate(server.engine_loop, server.metrics.received.inc)
    work = asyncio.ensure_future(asyncio.to_thread(
        generate_with_budget, generate, engine.tokenizer, engine.config.vocab_size,
        [ids] * sampling.n, configs, effort, system=None))
    listener = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not work.done():
            generate.cancel()
            with contextlib.suppress(ClientGone, EngineFailed):
                await work
        server.unfinished -= sampling.n
    if listener.done() and not listener.cancelled():
        return Response(status_code=499)
    try:
        outs = work.result()
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    except EngineFailed as e:
        raise APIError(503, f"the engine failed: {e}", code="engine_failed") from None
    choices = []
    for j, b in enumerate(outs):
        choice = {"index": j, "message": {"role": "assistant", "content": b.text},
                  "logprobs": None,
                  "finish_reason": protocol.FINISH_REASONS[b.answer.finish_reason]}
        choices.append(choice)
    completion = sum(len(b.thinking_ids) + len(b.answer.token_ids) for b in outs)
    cached = max(b.phase1.metrics.prompt_reused for b in outs)
    return JSONResponse({**head, "choices": choices, "usage": {
        "prompt_tokens": len(ids), "completion_tokens": completion,
        "total_tokens": len(ids) + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": sum(len(b.thinking_ids)
                                                              for b in outs)}}})
