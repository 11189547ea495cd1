"""The server under load, bad input, overload and authentication, on a tiny random model with
the real tokenizer (`tests.helpers.tiny_smollm_dir`: fast compiles). Outputs are compared with
the same engine's offline `LLM.generate` runs, made before the server starts."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
from jaxinfer.engine.llm import load_llm
from tests.helpers import serving, tiny_smollm_dir

PREFIX = "You are a helpful assistant. Answer briefly and precisely. "
QUESTIONS = ["Hi.", "What is two plus two?", "Name three colors of the rainbow, please.",
             "Why is the sky blue during the day but dark at night?", "Count to five.",
             "Tell me about the moon and the tides in one sentence."]
PROMPTS = [PREFIX + q for q in QUESTIONS] + QUESTIONS  # shared prefixes and not
LENGTHS = (3, 6, 12)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tiny_smollm_dir(str(tmp_path_factory.mktemp("tiny-smollm")))
    return load_llm(RunConfig(
        model_path=path, cache=CacheConfig(max_seq_len=192, page_size=16),
        engine=EngineConfig(max_slots=8, prefill_buckets=(32,), max_num_batched_tokens=64,
                            max_top_logprobs=2)))


@pytest.fixture(scope="module")
def expected(llm):
    """(prompt, max_tokens) -> greedy offline text."""
    pairs = [(p, n) for p in PROMPTS for n in LENGTHS]
    outs = llm.generate([p for p, _ in pairs],
                        [SamplingConfig(max_new_tokens=n, ignore_eos=True) for _, n in pairs],
                        use_tqdm=False)
    return {pair: c.text for pair, c in zip(pairs, outs)}


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def _finished(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items()
               if k.startswith("jaxinfer_requests_finished_total{"))


async def _idle(server, timeout: float = 20.0) -> None:
    """Waits until the engine thread holds no request."""
    for _ in range(int(timeout / 0.05)):
        stats = server.engine_loop.stats
        if server.unfinished == 0 and stats["running"] == 0 and stats["waiting"] == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the server did not drain: {server.engine_loop.stats}, "
                         f"{server.unfinished=}, {server.engine_loop.error=}")


# ----- load: 200 requests, 20 % of them disconnecting --------------------------------------------
async def _one(client: httpx.AsyncClient, rng: random.Random, expected, results: list) -> None:
    prompt, n = rng.choice(PROMPTS), rng.choice(LENGTHS)
    body = {"model": "test", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True}
    disconnect = rng.random() < 0.2
    if not rng.random() < 0.5 and not disconnect:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        results.append(r.json()["choices"][0]["text"] == expected[prompt, n])
        return
    leave_after = rng.randrange(0, n) if disconnect else None  # chunks read before leaving
    text, chunks = "", 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if chunks == leave_after:
                results.append(None)  # leaves mid-stream (or while queued: 0 chunks read)
                return
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text += json.loads(line[6:])["choices"][0]["text"]
            chunks += 1
    results.append(text == expected[prompt, n])


async def _load(url: str, server, expected, num_requests: int, num_clients: int) -> dict:
    rng = random.Random(0)
    results: list = []
    health: list[int] = []
    done = asyncio.Event()

    async def client_task(k: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            for i in range(k, num_requests, num_clients):
                await _one(client, random.Random(rng.random() + i), expected, results)

    async def probe() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            while not done.is_set():
                health.append((await client.get("/health")).status_code)
                await asyncio.sleep(0.05)

    prober = asyncio.ensure_future(probe())
    await asyncio.gather(*(client_task(k) for k in range(num_clients)))
    done.set()
    await prober
    await _idle(server)
    return {"results": results, "health": health}


def test_load_with_disconnects(llm, expected):
    with serving(llm.engine) as (url, server):
        before = _metrics(url)
        out = asyncio.run(_load(url, server, expected, num_requests=200, num_clients=16))
        after = _metrics(url)
    results = out["results"]
    assert len(results) == 200
    completed = [r for r in results if r is not None]
    assert all(completed), f"{completed.count(False)} responses differ from their offline run"
    assert 20 <= results.count(None) <= 60
    assert out["health"] and set(out["health"]) == {200}
    stats = server.engine_loop.stats
    assert stats["pages_used"] == 0 and stats["running"] == stats["waiting"] == 0
    received = after["jaxinfer_requests_received_total"] - before.get(
        "jaxinfer_requests_received_total", 0)
    assert received == 200
    assert _finished(after) - _finished(before) == received
    assert after.get("jaxinfer_requests_finished_total{finish_reason=abort}", 0) > 0


# ----- bad input ---------------------------------------------------------------------------------
GOOD = {"model": "test", "prompt": "Hello", "max_tokens": 2}
BAD = [  # (path, body, status, param or None)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'{"model": "test", "prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {**GOOD, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "stop": ""}, 400, "stop"),
    ("/v1/completions", {**GOOD, "logprobs": 3}, 400, "top_logprobs"),
    ("/v1/completions", {**GOOD, "colour": "red"}, 400, "colour"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [99999999]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": "word " * 250}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hello"}, 400, "model"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"model": "test", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "test", "messages": [{"role": "user"}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {"model": "test", "messages": [{"role": "robot", "content": "x"}]},
     400, "messages.0.role"),
    ("/v1/chat/completions", {"model": "test", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "test", "messages": [{"role": "user", "content": "x"}],
                              "reasoning_effort": "extreme"}, 400, "reasoning_effort"),
    ("/v1/chat/completions", {"model": "test", "messages": [{"role": "user", "content": "x"}],
                              "reasoning_effort": "high", "stream": True}, 400,
     "reasoning_effort"),  # the high budget (1024 tokens) does not fit the context
    ("/v1/chat/completions", {"model": "test", "messages": [{"role": "user",
                                                             "content": "word " * 250}]},
     400, "messages"),  # over the context: the chat's prompt is its messages
    ("/v1/nothing", GOOD, 404, None),
]


def test_bad_input_gets_its_error_and_the_server_keeps_serving(llm, expected):
    with serving(llm.engine) as (url, server), httpx.Client(base_url=url, timeout=30) as client:
        for path, body, status, param in BAD:
            if isinstance(body, bytes):
                r = client.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = client.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert error["message"] and error["type"], r.text
            assert error["param"] == param, (body, error)
        r = client.post("/v1/completions", json={**GOOD, "prompt": PROMPTS[0], "max_tokens": 3,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == expected[PROMPTS[0], 3]
        assert client.get("/health").status_code == 200
        assert server.engine_loop.stats["pages_used"] == 0


def test_api_key(llm):
    with serving(llm.engine, api_key="sesame") as (url, _), httpx.Client(base_url=url) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = client.post("/v1/completions", json=GOOD, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert client.get("/v1/models", headers=headers).status_code == 401
        ok = client.post("/v1/completions", json=GOOD, headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200
        assert client.get("/health").status_code == 200  # probes need no key


def test_overload_gets_429_with_retry_after(llm, expected):
    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {**GOOD, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body)
                                          for _ in range(50)))

    with serving(llm.engine, max_waiting_requests=4) as (url, server):
        responses = asyncio.run(burst(url))
        rejected = [r for r in responses if r.status_code == 429]
        ok = [r for r in responses if r.status_code == 200]
        assert len(ok) + len(rejected) == 50
        assert len(ok) >= 8 + 4 and len(rejected) >= 20  # slots + waiting admitted at once
        assert all(r.headers["Retry-After"] == "1" for r in rejected)
        assert all(r.json()["error"]["type"] == "rate_limit_error" for r in rejected)
        assert all(r.json()["choices"][0]["text"] == expected[PROMPTS[1], 12] for r in ok)
        assert _metrics(url)["jaxinfer_requests_rejected_total{status=429}"] == len(rejected)


def test_reasoning_effort_runs_the_budget_streamed_or_not(llm):
    """The thinking phase stays within the low budget; the answer follows the marker; the
    streamed content and usage equal the whole response's (same seed, n=2 sampled)."""
    body = {"model": "test", "messages": [{"role": "user", "content": "2+2?"}],
            "reasoning_effort": "low", "max_tokens": 4, "temperature": 0.8, "seed": 7, "n": 2}
    with serving(llm.engine) as (url, server), httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/chat/completions", json=body)
        streamed, usage, reasons = ["", ""], None, [None, None]
        with client.stream("POST", "/v1/chat/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk["usage"] or usage
                    for c in chunk["choices"]:
                        streamed[c["index"]] += c["delta"].get("content", "")
                        reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
        pages_after = server.engine_loop.stats["pages_used"]
    assert r.status_code == 200, r.text
    whole = r.json()
    details = whole["usage"]["completion_tokens_details"]
    assert 0 < details["reasoning_tokens"] <= 2 * 64  # the low budget, per sample
    contents = [c["message"]["content"] for c in whole["choices"]]
    assert all("Final answer:" in c for c in contents)
    assert streamed == contents
    assert reasons == [c["finish_reason"] for c in whole["choices"]]
    assert usage == whole["usage"]
    assert pages_after == 0


# ----- aborted streams (the shutdown's deadline) -------------------------------------------------
ABORTED_STREAMS = [  # (path, body): each runs long enough to be aborted mid-way
    ("/v1/completions", {"prompt": "Tell me a story.", "max_tokens": 170, "n": 2}),
    ("/v1/completions", {"prompt": ["Once upon a time", "Hello"], "max_tokens": 170,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}],
                              "max_tokens": 140, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "2+2?"}],
                              "reasoning_effort": "low", "max_tokens": 60}),
]


async def _aborted_stream(client, path: str, body: dict, started: asyncio.Event) -> list[dict]:
    """The stream's events, as JSON (`[DONE]` as the string); `started` is set at the first
    chunk with text."""
    events = []
    body = {"model": "test", "temperature": 0, "ignore_eos": True, "stream": True, **body}
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            if not isinstance(events[-1], str) and any(
                    c.get("text") or c.get("delta", {}).get("content")
                    for c in events[-1]["choices"]):
                started.set()
    return events


def test_aborted_streams_end_each_choice_with_abort_then_done(llm):
    """Every choice of a stream that the engine aborts (as the shutdown's deadline does) ends
    with a chunk whose finish_reason is "abort", then `[DONE]`: completions, n > 1, several
    prompts, chat, and chat with reasoning_effort."""

    async def run(url: str, server) -> list[list]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            started = [asyncio.Event() for _ in ABORTED_STREAMS]
            tasks = [asyncio.create_task(_aborted_stream(client, path, body, event))
                     for (path, body), event in zip(ABORTED_STREAMS, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            server.engine_loop.abort_all()
            return await asyncio.gather(*tasks)

    with serving(llm.engine) as (url, server):
        streams = asyncio.run(run(url, server))
        asyncio.run(_idle(server))
        assert server.engine_loop.stats["pages_used"] == 0
    for (path, body), events in zip(ABORTED_STREAMS, streams):
        assert events[-1] == "[DONE]", (path, events[-3:])
        chunks = events[:-1]
        if "stream_options" in body:
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
            chunks = chunks[:-1]
        num = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list)
                                  else 1)
        reasons = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                assert choice["index"] not in reasons, (path, choice)  # nothing after its end
                if choice["finish_reason"] is not None:
                    reasons[choice["index"]] = choice["finish_reason"]
        assert reasons == {i: "abort" for i in range(num)}, (path, body, reasons)
