"""The server through the real `openai` client on the real default model (SmolLM2-135M): greedy
completions and chats, streamed and not, equal `LLM.generate` token for token; n seeded samples
equal their offline runs; logprobs, usage (with prefix-cache hits), /v1/models and /health.

Prompt logprobs (`echo` with `logprobs`, lm-eval's loglikelihood requests) are checked against
an independent reference: a log_softmax of a plain forward of the model over the whole prompt,
one chunk, on its own cache (`plain_logprobs`). The scored prompt is longer than the engine's
prefill chunk (64 tokens), and its first 64 tokens are in the prefix cache when it is scored.

One module-scoped server; the offline runs go first on the same engine (so the server compiles
nothing new) and outputs are short (max_tokens 8). The model's layers are scanned
(`smollm2_scanned`): the many short-lived step variants here cost less to compile than the
scanned steps' slower runs."""

from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.proof import accuracy
from tests.helpers import serving

# Hundreds of real-model steps: compiled with XLA's optimisations (tests/conftest.py).
pytestmark = pytest.mark.optimized
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
CHATS = ["What is 2 + 2?", "Name a color."]
MAX_TOKENS = 8
SEEDED = SamplingConfig(max_new_tokens=MAX_TOKENS, temperature=0.8, seed=7, n=4)
# Longer than the 64-token prefill chunk; its first 64 tokens are cached by an earlier request.
SCORED = ("The history of astronomy begins with the first people who watched the sky and "
          "kept track of the moon, the sun and the planets. Over many centuries they built "
          "calendars, instruments and theories, and in the end a science that explains how "
          "the stars shine and how the universe grew. Ancient observers in Babylon, China "
          "and Greece recorded eclipses and comets, and their tables let later astronomers "
          "predict where each planet would appear on any night.")
SCORED_TOP = 3
ATOL = 1e-4  # f32 logprobs of two f32 forwards that sum in different orders


def plain_logprobs(model, ids: list[int]) -> np.ndarray:
    """f64[T, V] log_softmax of the model's logits over `ids` in one plain forward (one chunk,
    a fresh cache of its own: no engine, scheduler, chunking or prefix cache)."""
    logits = np.asarray(accuracy._Stream(model, len(ids), 16, None).logits(np.asarray(ids), 0),
                        np.float64)
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def _stop_across_tokens(tokenizer, completion) -> str:
    """A stop string of two characters that begins with the last character of one token's text
    and ends with the first of the next, at their first occurrence in the completion's text."""
    text, ids = completion.text, completion.token_ids
    for k in range(1, len(ids)):
        b = len(tokenizer.decode(ids[:k]))
        stop = text[b - 1:b + 1]
        if 0 < b < len(text) and len(stop) == 2 and text.find(stop) == b - 1:
            return stop
    raise AssertionError(f"no stop string across two tokens in {text!r}")


@pytest.fixture(scope="module")
def served(smollm2_scanned):
    model, ckpt = smollm2_scanned
    from jaxinfer.checkpoint.loading import load_tokenizer

    llm = LLM(model, load_tokenizer(ckpt), cache=CacheConfig(max_seq_len=256),
              engine=EngineConfig(max_slots=4, prefill_buckets=(16, 64),
                                  max_num_batched_tokens=64, max_top_logprobs=5))
    greedy = SamplingConfig(max_new_tokens=MAX_TOKENS)
    expected = {
        "plain": llm.generate(PROMPTS, greedy, use_tqdm=False),
        "chat": llm.generate(CHATS, greedy, chat=True, use_tqdm=False),
        "seeded": llm.generate(PROMPTS[:1], SEEDED, use_tqdm=False),
    }
    ids = llm.engine.tokenizer.encode(SCORED)
    assert len(ids) > 64 + 16
    # Scored beside an ordinary request (mixed steps). It takes no prefix-cache hit but fills
    # the cache, so the HTTP tests score a prompt whose prefix an earlier request cached.
    expected["scored"] = llm.generate(
        [ids, PROMPTS[0]], [SamplingConfig(max_new_tokens=2, prompt_logprobs=SCORED_TOP),
                            greedy], use_tqdm=False)[0]
    expected["cached_tokens"] = len(llm.engine.scheduler.cache.match(ids)) * 16
    stop = _stop_across_tokens(llm.engine.tokenizer, expected["chat"][0])
    expected["stop"] = stop, llm.generate(CHATS[:1], SamplingConfig(
        max_new_tokens=MAX_TOKENS, stop=(stop,)), chat=True, use_tqdm=False)[0]
    expected["reference"] = plain_logprobs(model, ids)
    with serving(llm.engine, served_model_name="smollm2") as (url, server):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield client, url, expected, server


def test_completions_equal_offline(served):
    client, _, expected, _ = served
    out = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                    temperature=0)
    assert [c.text for c in out.choices] == [c.text for c in expected["plain"]]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in expected["plain"])
    assert out.usage.prompt_tokens == sum(len(c.prompt_ids) for c in expected["plain"])


def test_streamed_completion_equals_offline(served):
    client, _, expected, _ = served
    stream = client.completions.create(model="smollm2", prompt=PROMPTS[1],
                                       max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected["plain"][1].text
    assert chunks[-1].usage.completion_tokens == len(expected["plain"][1].token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_offline(served, stream):
    client, _, expected, _ = served
    for prompt, want in zip(CHATS, expected["chat"]):
        kwargs = dict(model="smollm2", messages=[{"role": "user", "content": prompt}],
                      max_tokens=MAX_TOKENS, temperature=0)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        assert text == want.text


@pytest.mark.parametrize("chat", [False, True])
def test_streams_at_a_stop_string_equal_offline(served, chat):
    """A stop string that begins in one token's text and ends in the next: the stream holds its
    first character back and drops it with the stop, so it adds up to the offline text."""
    client, _, expected, _ = served
    stop, want = expected["stop"]
    assert want.finish_reason == "stop" and stop not in want.text
    kwargs = dict(model="smollm2", max_tokens=MAX_TOKENS, temperature=0, stop=stop, stream=True)
    if chat:
        chunks = list(client.chat.completions.create(
            messages=[{"role": "user", "content": CHATS[0]}], **kwargs))
        texts = [c.choices[0].delta.content or "" for c in chunks]
    else:
        chunks = list(client.completions.create(prompt=want.prompt_ids, **kwargs))
        texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_seeded_samples_equal_offline(served):
    client, _, expected, _ = served
    out = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                    temperature=0.8, seed=7, n=4)
    assert [c.text for c in out.choices] == [c.text for c in expected["seeded"]]
    assert len({c.text for c in out.choices}) > 1  # distinct seeds, distinct samples
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": CHATS[0]}], n=4, seed=3,
        temperature=0.8, max_tokens=MAX_TOKENS)
    again = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": CHATS[0]}], n=4, seed=3,
        temperature=0.8, max_tokens=MAX_TOKENS)
    assert [c.message.content for c in chat.choices] == [c.message.content
                                                         for c in again.choices]


def test_logprobs(served):
    client, _, expected, _ = served
    out = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": CHATS[1]}],
        max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:  # greedy: the chosen token is the top one
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0
    text = client.completions.create(model="smollm2", prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                     temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == expected["plain"][2].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS


def test_prefix_cache_hits_show_in_usage(served):
    client, _, _, _ = served
    prompt = "Here is a long shared preamble about the history of astronomy. " * 4
    first = client.completions.create(model="smollm2", prompt=prompt, max_tokens=2,
                                      temperature=0)
    second = client.completions.create(model="smollm2", prompt=prompt + "More.", max_tokens=2,
                                       temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 32


def test_models_and_health(served):
    client, url, _, _ = served
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)


def test_response_format_json_schema_is_enforced(served):
    client, _, _, _ = served
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "rank": {"type": "integer", "minimum": 1,
                                                        "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    out = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name a big city as JSON."}],
        max_tokens=40, temperature=0.7, seed=3, n=2, response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema"})


def test_prompt_logprobs_equal_a_plain_forward(served):
    """Offline: every prompt position's logprob and top alternatives equal the plain forward's,
    across two prefill chunks, beside an ordinary request."""
    _, _, expected, _ = served
    scored, ref = expected["scored"], expected["reference"]
    ids = scored.prompt_ids
    assert scored.metrics.prompt_reused == 0
    assert scored.prompt_logprobs[0] is None and scored.prompt_top_logprobs[0] is None
    assert len(scored.prompt_logprobs) == len(ids)
    want = [ref[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(scored.prompt_logprobs[1:], want, atol=ATOL, rtol=0)
    for i in range(1, len(ids)):
        top = scored.prompt_top_logprobs[i]
        assert len(top) == SCORED_TOP
        np.testing.assert_allclose([lp for _, lp in top], np.sort(ref[i - 1])[::-1][:SCORED_TOP],
                                   atol=ATOL, rtol=0)
        np.testing.assert_allclose([ref[i - 1, t] for t, _ in top], [lp for _, lp in top],
                                   atol=ATOL, rtol=0)
    assert scored.token_ids[0] == int(np.argmax(ref[-1]))  # the greedy sample is unchanged


def test_echo_logprobs_in_lm_eval_shape(served):
    """lm-eval's local-completions loglikelihood request (context + continuation as token ids,
    echo, logprobs=1, max_tokens 1, temperature 0) read as lm-eval reads it: token_logprobs
    and top_logprobs over the prompt (the first null), then the generated token's. The
    prompt's first 64 tokens are in the prefix cache (the offline run put them there), and
    are computed again."""
    client, _, expected, _ = served
    scored, ref = expected["scored"], expected["reference"]
    ids = scored.prompt_ids
    out = client.completions.create(model="smollm2", prompt=ids, max_tokens=1, echo=True,
                                    logprobs=1, temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref[i - 1, ids[i]] for i in range(1, len(ids))]
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], want, atol=ATOL, rtol=0)
    assert "".join(lp.tokens) == choice.text and choice.text.startswith(SCORED)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert expected["cached_tokens"] >= 64
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    # lm-eval: the continuation's logprob is the sum over [ctxlen:-1]; greedy where each token
    # is its position's top one.
    ctxlen = 40
    greedy = [ids[i] == int(np.argmax(ref[i - 1])) for i in range(ctxlen, len(ids))]
    assert sum(lp.token_logprobs[ctxlen:-1]) == pytest.approx(sum(want[ctxlen - 1:]), abs=1e-3)
    assert [tok == max(top.values()) for tok, top in zip(lp.token_logprobs[ctxlen:-1],
                                                         lp.top_logprobs[ctxlen:-1])] == greedy
    # Streamed: the echo chunk carries the prompt's logprobs, then each token its own.
    chunks = list(client.completions.create(model="smollm2", prompt=ids, max_tokens=1,
                                            echo=True, logprobs=1, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(c.choices[0].logprobs, key) for c in chunks), []) == getattr(lp, key)
    # max_tokens 0: just the prompt, scored.
    only = client.completions.create(model="smollm2", prompt=SCORED, max_tokens=0, echo=True,
                                     logprobs=0, temperature=0)
    assert only.choices[0].text == SCORED and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.top_logprobs is None
    np.testing.assert_allclose(only.choices[0].logprobs.token_logprobs[1:], want, atol=ATOL,
                               rtol=0)


def test_prompt_logprobs_refused_where_they_do_not_exist(served):
    client, _, _, _ = served
    chat = dict(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    for field in ("prompt_logprobs", "echo"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(extra_body={field: 1}, **chat)
        assert e.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
