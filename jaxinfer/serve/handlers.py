"""`POST /v1/completions` and `POST /v1/chat/completions`: parse, map onto the engine, answer
(one JSON body, or server-sent events with `"stream": true`). Every choice of a stream ends with
a chunk carrying its finish_reason ("abort" for one the shutdown's deadline aborted), then
`data: [DONE]`.

Prompts are tokenized here, on the event loop (the tokenizer is thread-safe and fast), so the
handler knows prompt lengths (usage, the default max_tokens, echo) and the engine thread gets
token ids. A client that disconnects aborts its engine requests: while streaming (Starlette
cancels the stream, whose `finally` aborts) or while waiting for a whole response
(`Generation.results` listens for the disconnect).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from jaxinfer.config import SamplingConfig
from jaxinfer.engine.adapters import UnknownAdapter
from jaxinfer.engine.outputs import Completion
from jaxinfer.engine.prompts import encode_messages, encode_prompt
from jaxinfer.serve import effort as effort_mode
from jaxinfer.serve import protocol
from jaxinfer.serve.engine_loop import Done
from jaxinfer.serve.generation import ClientGone, EngineFailed, Generation, until_disconnect
from jaxinfer.serve.server import APIError, Server, engine_error, parse_body

# The status nginx logs for a client that closed the connection before the answer: nobody
# reads it, it only marks the request in access logs.
CLIENT_CLOSED = 499


def sampling_of(server: Server, body: protocol.SamplingFields, prompt_lens: list[int],
                max_tokens: int | None, *, num_top: int, logprobs: bool,
                prompt_logprobs: int | None = None, param: str = "prompt") -> SamplingConfig:
    """The request's SamplingConfig; `param`: the field that holds the prompt ("prompt", or
    "messages" for a chat), named by a context-length error."""
    engine = server.engine
    context = engine.cache_config.max_seq_len
    if max(prompt_lens) >= context:
        raise APIError(400, f"the prompt has {max(prompt_lens)} tokens but the context holds "
                            f"{context} (prompt + max_tokens must fit)", param=param,
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = protocol.default_max_tokens(max(prompt_lens), context,
                                                 server.config.default_max_tokens)
    lora = server.check_model(body.model)
    try:
        sampling = body.sampling(max_tokens=max_tokens, num_top=num_top, logprobs=logprobs,
                                 prompt_logprobs=prompt_logprobs)
    except ValueError as e:
        raise engine_error(e) from None
    return dataclasses.replace(sampling, lora=lora)


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


async def load_lora_adapter(server: Server, request: Request) -> Response:
    """`POST /v1/load_lora_adapter` {"lora_name", "lora_path"} (vLLM's): registers a PEFT
    adapter, served from then on as model `lora_name`; 400 for a bad adapter or a taken name."""
    server.check_auth(request)
    body = await parse_body(request, protocol.LoadLoraAdapter)
    await _on_engine(server, lambda e: e.add_lora(body.lora_name, body.lora_path))
    return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "loaded": True})


async def unload_lora_adapter(server: Server, request: Request) -> Response:
    """`POST /v1/unload_lora_adapter` {"lora_name"}: unregisters an adapter; 404 for an
    unknown one, 400 while requests that use it have not finished (they are not touched)."""
    server.check_auth(request)
    body = await parse_body(request, protocol.UnloadLoraAdapter)
    await _on_engine(server, lambda e: e.remove_lora(body.lora_name))
    return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "loaded": False})


async def _on_engine(server: Server, fn: Callable[[Any], Any]) -> Any:
    """fn(engine) run on the engine thread between steps; its errors as OpenAI's."""
    server.engine  # noqa: B018 - 503 while loading or after a failure
    try:
        return await asyncio.wrap_future(server.engine_loop.call(fn))
    except UnknownAdapter as e:
        raise APIError(404, str(e), param="lora_name", code="model_not_found") from None
    except ValueError as e:
        raise APIError(400, str(e), param="lora_name", code="invalid_value") from None
    except RuntimeError as e:
        raise APIError(503, str(e), code="shutting_down",
                       retry_after=server.config.retry_after_s) from None


async def _framed(chunks: AsyncIterator[str], *, abort: Callable[[], None],
                  usage: Callable[[], dict] | None, head: dict) -> AsyncIterator[str]:
    """A stream's frame around its `chunks`: the usage chunk (`usage()` once the chunks are
    done, with `head`; None: include_usage is off), `[DONE]`; an engine failure ends it with
    OpenAI's error event; `abort` runs however the stream ends (a client that leaves
    included)."""
    try:
        async for chunk in chunks:
            yield chunk
        if usage is not None:
            yield sse({**head, "choices": [], "usage": usage()})
        yield "data: [DONE]\n\n"
    except EngineFailed as e:
        yield sse({"error": {"message": f"the engine failed: {e}", "type": "server_error",
                             "param": None, "code": "engine_failed"}})
    except APIError as e:
        yield sse({"error": {"message": e.message, "type": APIError.TYPES[e.status],
                             "param": e.param, "code": e.code}})
    finally:
        abort()


def _include_usage(body) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


# ----- /v1/completions ---------------------------------------------------------------------------
async def completions(server: Server, request: Request) -> Response:
    arrival, body = await _admit(server, request, protocol.CompletionRequest)
    engine = server.engine
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens: 0 returns just the prompt, which needs echo=true; give "
                            "max_tokens >= 1 or set echo", param="max_tokens")
    scored = body.logprobs if body.echo else None  # the prompt's logprobs: top-n width
    try:
        ids = [encode_prompt(engine.tokenizer, engine.config.vocab_size, p)
               for p in body.prompts()]
    except ValueError as e:
        raise engine_error(e, "prompt") from None
    # max_tokens 0: the engine samples one token (its prefill does), which is dropped.
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    sampling = sampling_of(server, body, [len(i) for i in ids], max_tokens,
                           num_top=body.logprobs or 0, logprobs=body.logprobs is not None,
                           prompt_logprobs=scored)
    gen = await server.start(ids, sampling, arrival)
    echo = [engine.tokenizer.decode(i) if body.echo else "" for i in ids]
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": body.model}
    if body.stream:
        return streaming(_stream_completion(engine.tokenizer, gen, body, head, ids, echo,
                                            scored))
    try:
        groups = await wait_results(gen, request)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    if body.max_tokens == 0:
        groups = [[_prompt_only(c) for c in group] for group in groups]
    choices = []
    for i, group in enumerate(groups):
        for j, c in enumerate(group):
            lp = None
            if scored is not None:
                lp = protocol.echo_logprobs(engine.tokenizer, c, scored)
            elif body.logprobs is not None:
                lp = protocol.completion_logprobs(engine.tokenizer, c.token_ids, c.logprobs,
                                                  c.top_logprobs, len(echo[i]))
            choices.append({"index": i * sampling.n + j, "text": echo[i] + c.text,
                            "logprobs": lp,
                            "finish_reason": protocol.FINISH_REASONS[c.finish_reason]})
    return JSONResponse({**head, "choices": choices,
                         "usage": protocol.usage([len(i) for i in ids], groups)})


def _prompt_only(c: Completion) -> Completion:
    """A `max_tokens: 0` answer: the completion without the one token its prefill sampled."""
    return dataclasses.replace(c, token_ids=[], text="", logprobs=[] if c.logprobs else None,
                               top_logprobs=[] if c.top_logprobs else None,
                               finish_reason="length")


def _stream_completion(tokenizer, gen: Generation, body, head: dict, ids, echo,
                       scored: int | None) -> AsyncIterator[str]:
    """The SSE stream of a completion. With echo, each choice starts with the prompt's text:
    at once, or with `scored` (echo with logprobs) once its first token brings the prompt's
    logprobs."""
    usage = _include_usage(body)
    extra = {"usage": None} if usage else {}
    offsets: dict[int, int] = {}
    groups = {}

    def echoed(index: int, lp: dict | None = None) -> str:
        offsets[index] = len(echo[index // gen.n])
        return sse({**head, "choices": [{"index": index, "text": echo[index // gen.n],
                                         "logprobs": lp, "finish_reason": None}], **extra})

    async def chunks() -> AsyncIterator[str]:
        if body.echo and scored is None:
            for index in range(len(echo) * gen.n):
                yield echoed(index)
        async for m in gen.messages():
            if isinstance(m, Done):
                groups[m.request_id] = ([_prompt_only(c) for c in m.completions]
                                        if body.max_tokens == 0 else m.completions)
                for sample, c in gen.unended(m):
                    yield sse({**head, "choices": [{
                        "index": gen.choice(m.request_id, sample), "text": "", "logprobs": None,
                        "finish_reason": protocol.FINISH_REASONS[c.finish_reason]}], **extra})
                continue
            out, index = m.output, gen.choice(m.request_id, m.sample)
            if scored is not None and index not in offsets:  # the prompt's logprobs are in
                yield echoed(index, protocol.prompt_logprobs(
                    tokenizer, ids[index // gen.n], out.prompt_logprobs,
                    out.prompt_top_logprobs, scored))
            if body.max_tokens == 0:  # just the prompt: the sampled token is dropped
                yield sse({**head, "choices": [{"index": index, "text": "", "logprobs": None,
                                                "finish_reason": "length"}], **extra})
                continue
            lp = None
            if body.logprobs is not None and out.token_id is not None:  # None: an abort's
                lp = protocol.completion_logprobs(
                    tokenizer, [out.token_id], [out.logprob],
                    [out.top_logprobs] if out.top_logprobs is not None else None,
                    offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(out.text)
            reason = protocol.FINISH_REASONS[out.finish_reason] if out.finished else None
            yield sse({**head, "choices": [{"index": index, "text": out.text, "logprobs": lp,
                                            "finish_reason": reason}], **extra})

    return _framed(chunks(), abort=gen.abort, head=head, usage=(lambda: protocol.usage(
        [len(i) for i in ids], [groups[r] for r in gen.request_ids])) if usage else None)


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
                           num_top=body.top_logprobs or 0, logprobs=body.logprobs,
                           param="messages")
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": body.model}
    if body.reasoning_effort is not None:
        return await _chat_with_effort(server, request, body, ids, sampling, head, arrival)
    gen = await server.start([ids], sampling, arrival)
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
    usage = _include_usage(body)
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
                for sample, c in gen.unended(m):
                    yield chunk(sample, {}, protocol.FINISH_REASONS[c.finish_reason])
                continue
            out = m.output
            lp = None
            if body.logprobs and out.token_id is not None:  # None: an abort's
                lp = protocol.chat_logprobs(
                    tokenizer, [out.token_id], [out.logprob],
                    [out.top_logprobs] if out.top_logprobs is not None else None)
            if out.text or lp is not None or not out.finished:
                yield chunk(m.sample, {"content": out.text}, lp=lp)
            if out.finished:
                yield chunk(m.sample, {}, protocol.FINISH_REASONS[out.finish_reason])

    return _framed(chunks(), abort=gen.abort, head=head, usage=(lambda: protocol.usage(
        [len(ids)], [groups[r] for r in gen.request_ids])) if usage else None)



async def _chat_with_effort(server: Server, request: Request, body, ids: list[int],
                            sampling: SamplingConfig, head: dict, arrival: float) -> Response:
    run = effort_mode.EffortRun(server, ids, sampling, body.reasoning_effort)
    if body.stream:
        return streaming(_stream_effort(run, body, head, arrival))

    async def collect() -> None:
        async for _ in run.deltas(arrival):
            pass

    try:
        await until_disconnect(request, collect(), run.abort)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except EngineFailed as e:
        raise APIError(503, f"the engine failed: {e}", code="engine_failed") from None
    choices = [chat_choice(server.engine.tokenizer, j, b.answer, False, text=b.text)
               for j, b in enumerate(run.completions)]
    return JSONResponse({**head, "choices": choices, "usage": run.usage()})


def _stream_effort(run: effort_mode.EffortRun, body, head: dict, arrival: float
                   ) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if _include_usage(body) else {}

    async def chunks() -> AsyncIterator[str]:
        for j in range(run.sampling.n):
            yield sse({**head, "choices": [{"index": j, "delta": {"role": "assistant",
                                                                  "content": ""},
                                            "logprobs": None, "finish_reason": None}], **extra})
        async for j, text, reason in run.deltas(arrival):
            if text:
                yield sse({**head, "choices": [{"index": j, "delta": {"content": text},
                                                "logprobs": None, "finish_reason": None}],
                           **extra})
            if reason is not None:
                yield sse({**head, "choices": [{"index": j, "delta": {}, "logprobs": None,
                                                "finish_reason": reason}], **extra})

    return _framed(chunks(), abort=run.abort, head=head,
                   usage=run.usage if _include_usage(body) else None)
