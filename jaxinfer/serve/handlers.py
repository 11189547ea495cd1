"""`POST /v1/completions` and `POST /v1/chat/completions`: parse, map onto the engine, answer
(one JSON body, or server-sent events with `"stream": true`).

Prompts are tokenized here, on the event loop (the tokenizer is thread-safe and fast), so the
handler knows prompt lengths (usage, the default max_tokens, echo) and the engine thread gets
token ids. A client that disconnects aborts its engine requests: while streaming (Starlette
cancels the stream, whose `finally` aborts) or while waiting for a whole response
(`Generation.results` listens for the disconnect).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from jaxinfer.config import SamplingConfig
from jaxinfer.engine.prompts import encode_messages, encode_prompt
from jaxinfer.serve import effort as effort_mode
from jaxinfer.serve import protocol
from jaxinfer.serve.engine_loop import Done
from jaxinfer.serve.generation import ClientGone, EngineFailed, Generation
from jaxinfer.serve.server import APIError, Server, parse_body

# The status nginx logs for a client that closed the connection before the answer: nobody
# reads it, it only marks the request in access logs.
CLIENT_CLOSED = 499


def engine_error(e: Exception, param: str | None = None) -> APIError:
    """A ValueError from the engine or the sampling config, as a 400 in OpenAI's names."""
    message = str(e).replace("max_new_tokens", "max_tokens")
    if param is None:
        param = next((p for p in ("max_tokens", "top_logprobs", "seed", "stop", "prompt")
                      if p in message), None)
    return APIError(400, message, param=param, code="invalid_value")


def sampling_of(server: Server, body: protocol.SamplingFields, prompt_lens: list[int],
                max_tokens: int | None, *, num_top: int, logprobs: bool) -> SamplingConfig:
    engine = server.engine
    context = engine.cache_config.max_seq_len
    if max(prompt_lens) >= context:
        raise APIError(400, f"the prompt has {max(prompt_lens)} tokens but the context holds "
                            f"{context} (prompt + max_tokens must fit)", param="prompt",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = protocol.default_max_tokens(max(prompt_lens), context,
                                                 server.config.default_max_tokens)
    try:
        return body.sampling(max_tokens=max_tokens, num_top=num_top, logprobs=logprobs)
    except ValueError as e:
        raise engine_error(e) from None


async def start(server: Server, prompts: list[list[int]], sampling: SamplingConfig,
                arrival: float) -> Generation:
    """Admits and submits the engine requests of one HTTP request."""
    num = sampling.n * len(prompts)
    server.admit(num)
    gen = server.generation()
    try:
        await gen.submit(prompts, sampling, arrival)
    except BaseException as e:
        server.unfinished -= sampling.n * (len(prompts) - len(gen.request_ids))
        if isinstance(e, ValueError):
            raise engine_error(e) from None
        if isinstance(e, RuntimeError):
            raise APIError(503, str(e), code="shutting_down",
                           retry_after=server.config.retry_after_s) from None
        raise
    server.metrics.received.inc(num)
    return gen


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def streaming(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def wait_results(gen: Generation, request: Request):
    try:
        return await gen.results(request)
    except EngineFailed as e:
        raise APIError(503, f"the engine failed: {e}", code="engine_failed") from None


async def _admit(server: Server, request: Request, model: type) -> tuple[float, Any]:
    """(arrival time, parsed body) of an endpoint's request once its key and model check."""
    arrival = time.perf_counter()
    server.check_auth(request)
    body = await parse_body(request, model)
    server.check_model(body.model)
    return arrival, body


async def _framed(gen: Generation, chunks: AsyncIterator[str], groups: dict, *,
                  usage_head: dict | None, prompt_lens: list[int]) -> AsyncIterator[str]:
    """A stream's frame around its `chunks` (which fill `groups` with each request's
    completions): the usage chunk (with `usage_head`, for include_usage), `[DONE]`; an engine
    failure ends it with OpenAI's error event; the request is aborted however the stream ends
    (a client that leaves included)."""
    try:
        async for chunk in chunks:
            yield chunk
        if usage_head is not None:
            yield sse({**usage_head, "choices": [], "usage": protocol.usage(
                prompt_lens, [groups[r] for r in gen.request_ids])})
        yield "data: [DONE]\n\n"
    except EngineFailed as e:
        yield sse({"error": {"message": f"the engine failed: {e}", "type": "server_error",
                             "param": None, "code": "engine_failed"}})
    finally:
        gen.abort()


# ----- /v1/completions ---------------------------------------------------------------------------
async def completions(server: Server, request: Request) -> Response:
    arrival, body = await _admit(server, request, protocol.CompletionRequest)
    engine = server.engine
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs needs the prompt's logprobs, which this server "
                            "does not compute: use one or the other", param="echo")
    try:
        ids = [encode_prompt(engine.tokenizer, engine.config.vocab_size, p)
               for p in body.prompts()]
    except ValueError as e:
        raise engine_error(e, "prompt") from None
    sampling = sampling_of(server, body, [len(i) for i in ids], body.max_tokens,
                           num_top=body.logprobs or 0, logprobs=body.logprobs is not None)
    gen = await start(server, ids, sampling, arrival)
    echo = [engine.tokenizer.decode(i) if body.echo else "" for i in ids]
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": body.model}
    if body.stream:
        return streaming(_stream_completion(engine.tokenizer, gen, body, head, ids, echo))
    try:
        groups = await wait_results(gen, request)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for i, group in enumerate(groups):
        for j, c in enumerate(group):
            lp = None
            if body.logprobs is not None:
                lp = protocol.completion_logprobs(engine.tokenizer, c.token_ids, c.logprobs,
                                                  c.top_logprobs, len(echo[i]))
            choices.append({"index": i * sampling.n + j, "text": echo[i] + c.text,
                            "logprobs": lp,
                            "finish_reason": protocol.FINISH_REASONS[c.finish_reason]})
    return JSONResponse({**head, "choices": choices,
                         "usage": protocol.usage([len(i) for i in ids], groups)})


def _stream_completion(tokenizer, gen: Generation, body, head: dict, ids, echo
                       ) -> AsyncIterator[str]:
    usage = body.stream_options is not None and body.stream_options.include_usage
    extra = {"usage": None} if usage else {}
    offsets: dict[int, int] = {}
    groups = {}

    async def chunks() -> AsyncIterator[str]:
        if body.echo:
            for i, text in enumerate(echo):
                for j in range(gen.n):
                    offsets[i * gen.n + j] = len(text)
                    yield sse({**head, "choices": [{"index": i * gen.n + j, "text": text,
                                                    "logprobs": None, "finish_reason": None}],
                               **extra})
        async for m in gen.messages():
            if isinstance(m, Done):
                groups[m.request_id] = m.completions
                continue
            out, index = m.output, gen.choice(m.request_id, m.sample)
            lp = None
            if body.logprobs is not None:
                lp = protocol.completion_logprobs(
                    tokenizer, [out.token_id], [out.logprob],
                    [out.top_logprobs] if out.top_logprobs is not None else None,
                    offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(out.text)
            reason = protocol.FINISH_REASONS[out.finish_reason] if out.finished else None
            yield sse({**head, "choices": [{"index": index, "text": out.text, "logprobs": lp,
                                            "finish_reason": reason}], **extra})

    return _framed(gen, chunks(), groups, usage_head=head if usage else None,
                   prompt_lens=[len(i) for i in ids])


# ----- /v1/chat/completions ----------------------------------------------------------------------
async def chat_completions(server: Server, request: Request) -> Response:
    arrival, body = await _admit(server, request, protocol.ChatCompletionRequest)
    engine = server.engine
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    try:
        conversation = body.conversation()
        if body.reasoning_effort is not None:
            conversation = effort_mode.with_effort_system(conversation, body.reasoning_effort)
        ids = encode_messages(engine.tokenizer, engine.config.vocab_size, conversation)
    except ValueError as e:
        raise engine_error(e, "messages") from None
    max_tokens = body.max_completion_tokens or body.max_tokens
    sampling = sampling_of(server, body, [len(ids)], max_tokens,
                           num_top=body.top_logprobs or 0, logprobs=body.logprobs)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": body.model}
    if body.reasoning_effort is not None:
        return await effort_mode.chat_with_effort(server, request, body, ids, sampling, head)
    gen = await start(server, [ids], sampling, arrival)
    if body.stream:
        return streaming(_stream_chat(engine.tokenizer, gen, body, head, ids))
    try:
        groups = await wait_results(gen, request)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    choices = [chat_choice(engine.tokenizer, j, c, body.logprobs)
               for j, c in enumerate(groups[0])]
    return JSONResponse({**head, "choices": choices,
                         "usage": protocol.usage([len(ids)], groups)})


def chat_choice(tokenizer, index: int, c, logprobs: bool, text: str | None = None) -> dict:
    lp = (protocol.chat_logprobs(tokenizer, c.token_ids, c.logprobs, c.top_logprobs)
          if logprobs else None)
    return {"index": index, "message": {"role": "assistant",
                                        "content": c.text if text is None else text},
            "logprobs": lp, "finish_reason": protocol.FINISH_REASONS[c.finish_reason]}


def _stream_chat(tokenizer, gen: Generation, body, head: dict, ids) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    usage = body.stream_options is not None and body.stream_options.include_usage
    extra = {"usage": None} if usage else {}

    def chunk(index: int, delta: dict, reason: str | None = None, lp=None) -> str:
        return sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                         "finish_reason": reason}], **extra})

    groups = {}

    async def chunks() -> AsyncIterator[str]:
        for j in range(gen.n):
            yield chunk(j, {"role": "assistant", "content": ""})
        async for m in gen.messages():
            if isinstance(m, Done):
                groups[m.request_id] = m.completions
                continue
            out = m.output
            lp = None
            if body.logprobs:
                lp = protocol.chat_logprobs(
                    tokenizer, [out.token_id], [out.logprob],
                    [out.top_logprobs] if out.top_logprobs is not None else None)
            if out.text or lp is not None or not out.finished:
                yield chunk(m.sample, {"content": out.text}, lp=lp)
            if out.finished:
                yield chunk(m.sample, {}, protocol.FINISH_REASONS[out.finish_reason])

    return _framed(gen, chunks(), groups, usage_head=head if usage else None,
                   prompt_lens=[len(ids)])

