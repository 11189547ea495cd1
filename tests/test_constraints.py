"""Structured output on the real default model (SmolLM2-135M-Instruct): sampled outputs under a
nested JSON schema, a date regex and a choice list all validate; greedy under a constraint the
unconstrained greedy output already satisfies is unchanged; unconstrained requests batched with
constrained ones are unchanged token for token, under preemption and prefix hits; n-gram
speculation under a constraint equals plain constrained greedy; bad constraints fail alone at
add_request; a constrained request cut by max_new_tokens finishes with "length".

Sample counts fit the CI budget on 2 cores: 16 JSON samples (n = 16, forked: each sample has
its own grammar state) and 16 each for the regex and the choice list by default; the 200-sample
JSON case is marked slow.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxinfer.checkpoint.loading import load_tokenizer
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine import steps
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.sampling import apply_token_mask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                   "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "scores", "address"],
    "additionalProperties": False,
}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
COLORS = ("red", "green", "blue", "dark purple")
# Few compiled variants (each costs ~8 s of XLA compile for this model on 2 cores): one chunk
# bucket and three page buckets. 32 pages of 32 tokens for 16 slots: the 32 JSON samples and the
# mixed batch below run out of pages and preempt.
CACHE = CacheConfig(page_size=32, max_seq_len=128, num_pages=32)
ENGINE = EngineConfig(max_slots=16, prefill_buckets=(64,))


@pytest.fixture(scope="module")
def llm(smollm2) -> LLM:
    model, ckpt = smollm2
    return LLM(model, load_tokenizer(ckpt), cache=CACHE, engine=ENGINE)


def _sampled(n: int, max_new_tokens: int = 80, **constraint) -> SamplingConfig:
    return SamplingConfig(n=n, temperature=1.0, seed=7, max_new_tokens=max_new_tokens,
                          **constraint)


def test_token_mask_keeps_exactly_the_allowed_tokens():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 70)).astype(np.float32)
    keep = rng.random((3, 70)) < 0.3
    keep[2] = False  # a row that allows nothing stays unmasked (an error state the host ends)
    bits = np.zeros((3, 96), np.uint8)
    bits[:, :70] = keep
    packed = np.packbits(bits, axis=-1, bitorder="little").view(np.int32)
    out = np.asarray(apply_token_mask(jnp.asarray(logits), jnp.asarray(packed)))
    np.testing.assert_array_equal(out[:2], np.where(keep[:2], logits[:2], -np.inf))
    np.testing.assert_array_equal(out[2], logits[2])
    ones = np.full((3, 3), -1, np.int32)
    np.testing.assert_array_equal(apply_token_mask(jnp.asarray(logits), ones), logits)


def test_config_rejects_conflicting_or_malformed_constraints():
    with pytest.raises(ValueError, match="regex and choice are both set"):
        SamplingConfig(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        SamplingConfig(json_schema="{'type': 'object'}")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingConfig(regex="a+", ignore_eos=True)
    with pytest.raises(ValueError, match="choice must not be empty"):
        SamplingConfig(choice=("a", ""))


@pytest.mark.parametrize("n", [16, pytest.param(200, marks=pytest.mark.slow)])
def test_sampled_json_validates_against_the_schema(llm, n):
    outs = llm.generate(["Give one user record as JSON."], _sampled(n, json_schema=json.dumps(
        SCHEMA)), chat=True, use_tqdm=False)
    assert len(outs) == n
    for out in outs:
        assert out.finish_reason == "eos", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > n // 2  # the samples differ: each has its own state


def test_sampled_regex_and_choice_outputs_match(llm):
    outs = llm.generate(
        ["When was the Eiffel Tower finished? Answer with a date.", "Name a color."],
        [_sampled(16, 24, regex=DATE), _sampled(16, 24, choice=COLORS)], chat=True,
        use_tqdm=False)
    dates, colors = outs[:16], outs[16:]
    for out in dates:
        assert out.finish_reason == "eos" and re.fullmatch(DATE, out.text), out
    for out in colors:
        assert out.finish_reason == "eos" and out.text in COLORS, out
    assert len({o.text for o in dates}) > 1


def test_greedy_already_satisfying_the_constraint_is_unchanged(llm):
    prompt = "What is the capital of France? Answer in one sentence."
    free = llm.generate([prompt], SamplingConfig(max_new_tokens=32), chat=True, use_tqdm=False)[0]
    assert free.finish_reason == "eos" and re.fullmatch(r"[A-Z][^\n]*\.", free.text), free
    variants = steps.mixed_sample._cache_size()
    got = llm.generate([prompt] * 2, [
        SamplingConfig(max_new_tokens=32, regex=r"[A-Z][^\n]*\."),
        SamplingConfig(max_new_tokens=32, choice=(free.text, "Paris."))],
        chat=True, use_tqdm=False)
    assert [g.token_ids for g in got] == [free.token_ids] * 2
    assert steps.mixed_sample._cache_size() == variants  # masks add no compiled variant


@pytest.mark.slow  # ~60 s on two cores: the long case of this module
def test_unconstrained_requests_are_unchanged_beside_constrained_ones(llm):
    # 8 x 4 pages at the end fill the pool by themselves: the constrained samples force
    # preemptions; the shared system prompt's page is a prefix hit.
    prompts = [f"Write a poem about the number {i}." for i in range(8)]
    free = [SamplingConfig(max_new_tokens=80, temperature=0.8 * (i % 2), seed=i)
            for i in range(8)]
    alone = llm.generate(prompts, free, chat=True, use_tqdm=False)
    engine = llm.engine
    before = engine.stats()
    mixed = llm.generate(prompts + ["Give one user record as JSON."] * 2, free + [
        _sampled(5, json_schema=json.dumps(SCHEMA)), _sampled(5, regex=DATE)],
        chat=True, use_tqdm=False)
    after = engine.stats()
    assert [m.token_ids for m in mixed[:8]] == [a.token_ids for a in alone]
    assert after["preemptions"] > before["preemptions"]
    assert after["prefix_hits"] > before["prefix_hits"]
    for out in mixed[8:13]:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_bad_constraints_fail_alone_at_add_request(llm):
    engine = llm.engine
    rid = engine.add_request("Say hi.", SamplingConfig(max_new_tokens=4), chat=True)
    bad = {
        "json_schema": (json.dumps({"type": "integer", "minimum": 5, "maximum": 2}),
                        "not a valid JSON schema"),
        "regex": ("(abc", "not a valid regex"),
        "grammar": ("start: undefined_rule", "not a valid Lark grammar"),
    }
    for field, (value, message) in bad.items():
        with pytest.raises(ValueError, match=f"{field}=.*{message}"):
            engine.add_request("x", SamplingConfig(max_new_tokens=8, **{field: value}))
    with pytest.raises(ValueError, match="admits no"):
        engine.add_request("x", SamplingConfig(max_new_tokens=8, regex=r"[^\s\S]"))
    engine.run()
    assert engine.result(rid).finish_reason == "length"


def test_a_constrained_request_cut_by_max_new_tokens_finishes_with_length(llm):
    out = llm.generate(["Give one user record as JSON."], SamplingConfig(
        max_new_tokens=5, json_schema=json.dumps(SCHEMA)), chat=True, use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_ngram_speculation_under_a_constraint_equals_plain_constrained_greedy(smollm2, llm):
    model, ckpt = smollm2
    prompt = "Repeat exactly: 2019-03-12, 2019-03-12, 2019-03-12."
    sampling = SamplingConfig(max_new_tokens=12, regex=r"([0-9]{4}-[0-9]{2}-[0-9]{2}, ){2}done")
    want = llm.generate([prompt], sampling, chat=True, use_tqdm=False)[0]
    spec = LLM(model, llm.engine.tokenizer, cache=CACHE, engine=dataclasses.replace(
        ENGINE, speculative_method="ngram", num_speculative_tokens=2, ngram_min=1))
    got = spec.generate([prompt], sampling, chat=True, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids
    assert spec.engine.stats()["spec_drafted_tokens"] > 0
