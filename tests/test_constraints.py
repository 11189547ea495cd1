"""Structured output on the real default model (SmolLM2-135M-Instruct): samples at temperature
1 under a nested JSON schema, a date regex and a choice list all validate (24 of each in CI, 200
of each in the slow set);
greedy under a constraint the unconstrained greedy output already satisfies is unchanged;
unconstrained requests batched with constrained ones are unchanged token for token, under
preemption and prefix hits; speculation (n-gram and a draft model) under a constraint equals
plain constrained greedy; bad constraints fail alone at add_request; a constrained request cut by
max_new_tokens finishes with "length"; self-consistency with a schema always extracts an answer.

Cheap enough for CI on 2 cores: the samples are forks of one prompt (one prefill), up to 32 at a
time, and their valid outputs are short (a nested object of at most 21 tokens, a 10-token
date); every sequence fits 64 tokens, so few step variants compile.
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
from jaxinfer.checkpoint.tokenizer import Tokenizer
from jaxinfer.checkpoint.weights import default_model_path
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine import steps
from jaxinfer.engine.constraints import ConstraintCompiler, mask_words
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.sampling import apply_token_mask
from jaxinfer.model import Llama
from jaxinfer.tts import EngineSampler, answer_of, answer_schema, load_tasks, with_answer_format

# Nested but short (at most 21 tokens): 200 samples of it stay cheap. An object with an enum, an
# array of bounded integers and a nested object, every field required.
SCHEMA = {
    "type": "object",
    "properties": {
        "c": {"enum": ["red", "green", "blue"]},
        "n": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": 1, "maxItems": 2},
        "p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                     "maximum": 9}},
              "required": ["x"], "additionalProperties": False},
    },
    "required": ["c", "n", "p"],
    "additionalProperties": False,
}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
COLORS = ("red", "green", "blue", "dark purple")
# Few compiled variants (each costs ~8 s of XLA compile for this model on 2 cores): every
# sequence here is 33..64 tokens long (prompt + output), so every step reads the same 4 pages of
# 16, and every prompt fits one 64-token chunk. 32 slots decode many forked samples at once; the
# pool (56 pages, 32 x 4 would be 128) is small enough for the mixed batch to preempt. The chat
# template's first 16 tokens are one page every chat prompt shares.
CACHE = CacheConfig(page_size=16, max_seq_len=64, num_pages=56)
ENGINE = EngineConfig(max_slots=32, prefill_buckets=(64,))
# Hundreds of real-model steps: compiled with XLA's optimisations (tests/conftest.py).
pytestmark = pytest.mark.optimized


@pytest.fixture(scope="module")
def llm(smollm2_scanned) -> LLM:
    model, ckpt = smollm2_scanned
    return LLM(model, load_tokenizer(ckpt), cache=CACHE, engine=ENGINE)


def _sampled(n: int, max_new_tokens: int = 24, **constraint) -> SamplingConfig:
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


# 200 samples of each cost ~190 s on 2 quiet cores (docs/benchmarks.md): CI draws 24 of each.
@pytest.mark.parametrize("n", [24, pytest.param(200, marks=pytest.mark.slow)])
def test_samples_validate_against_a_json_schema_a_regex_and_a_choice_list(llm, n):
    # n forked samples of one prompt each: one prefill, each sample its own grammar state.
    outs = llm.generate(["Give one record as JSON.", "When was the Eiffel Tower finished? "
                         "Answer with a date.", "Name a color."],
                        [_sampled(n, 28, json_schema=json.dumps(SCHEMA)),
                         _sampled(n, 12, regex=DATE), _sampled(n, 8, choice=COLORS)],
                        chat=True, use_tqdm=False)
    records, dates, colors = outs[:n], outs[n:2 * n], outs[2 * n:]
    for out in records:
        assert out.finish_reason == "eos", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    for out in dates:
        assert out.finish_reason == "eos" and re.fullmatch(DATE, out.text), out
    for out in colors:
        assert out.finish_reason == "eos" and out.text in COLORS, out
    # The samples differ (each has its own seed and grammar state).
    assert len({o.text for o in records}) > n // 8 and len({o.text for o in dates}) > n // 8
    assert len({o.text for o in colors}) > 1


def test_greedy_already_satisfying_the_constraint_is_unchanged(llm):
    prompt = "What is the capital of France? Answer in one sentence."
    free = llm.generate([prompt], SamplingConfig(max_new_tokens=22), chat=True, use_tqdm=False)[0]
    assert free.finish_reason == "eos" and re.fullmatch(r"[A-Z][^\n]*\.", free.text), free
    variants = steps.mixed_sample._cache_size()
    got = llm.generate([prompt] * 2, [
        SamplingConfig(max_new_tokens=22, regex=r"[A-Z][^\n]*\."),
        SamplingConfig(max_new_tokens=22, choice=(free.text, "Paris."))],
        chat=True, use_tqdm=False)
    assert [g.token_ids for g in got] == [free.token_ids] * 2
    assert steps.mixed_sample._cache_size() == variants  # masks add no compiled variant


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(llm):
    # Alone, the 8 free requests hold 2 pages each beside the 2 pages of the chat template and
    # "Write a poem about the" they share. Beside 24 constrained samples (2 pages each once
    # their output passes token 48) they need more than the pool's 56: preemptions. The second
    # run finds the shared pages cached: prefix hits.
    prompts = [f"Write a poem about the number {i}." for i in range(8)]
    free = [SamplingConfig(max_new_tokens=24, temperature=0.8 * (i % 2), seed=i)
            for i in range(8)]
    alone = llm.generate(prompts, free, chat=True, use_tqdm=False)
    engine = llm.engine
    before = engine.stats()
    mixed = llm.generate(prompts + ["Give one record as JSON.", "When was the Eiffel Tower "
                                    "finished? Answer with a date."], free + [
        _sampled(16, 28, json_schema=json.dumps(SCHEMA)), _sampled(8, 12, regex=DATE)],
        chat=True, use_tqdm=False)
    after = engine.stats()
    assert [m.token_ids for m in mixed[:8]] == [a.token_ids for a in alone]
    assert after["preemptions"] > before["preemptions"]
    assert after["prefix_hits"] > before["prefix_hits"]
    for out in mixed[8:24]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    for out in mixed[24:]:
        assert re.fullmatch(DATE, out.text), out
    engine.scheduler.check_invariants()


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
    out = llm.generate(["Give one record as JSON."], SamplingConfig(
        max_new_tokens=5, json_schema=json.dumps(SCHEMA)), chat=True, use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


@pytest.fixture(scope="module")
def compiler() -> ConstraintCompiler:
    """Constraints for the default model's tokenizer, without its weights (host-only)."""
    return ConstraintCompiler(Tokenizer.from_gguf_file(default_model_path()), 49152)


def _masks_after(make, tokens: list[int], drafts: list[int]) -> np.ndarray:
    """i32[len(drafts) + 1, W]: the mask after tokens + drafts[:j], from a fresh constraint."""
    out = np.zeros((len(drafts) + 1, mask_words(49152)), np.int32)
    c = make()
    for j, t in enumerate([*tokens, *drafts]):
        if j >= len(tokens):
            c.fill(out, j - len(tokens))
        assert c.advance(t) is None, (j, t)
    c.fill(out, len(drafts))
    return out


@pytest.mark.parametrize("name, value, pieces", [
    ("regex", "ab", ["a", "b"]),
    ("json_schema", json.dumps({"type": "object"}), ['{"user":{"name":"Bob","age":"3"}}']),
])
def test_checking_drafts_that_end_in_eos_leaves_the_grammar_as_found(compiler, name, value,
                                                                     pieces):
    """A draft EOS that llguidance records (or does not) leaves the state as it was: with
    regex `ab` after `a`, drafts [b, EOS] are allowed and `b` is then still accepted."""
    make = compiler.compile(SamplingConfig(max_new_tokens=8, **{name: value}))
    ids = [t for piece in pieces for t in compiler.tokenizer.encode(piece)]
    eos = compiler.tokenizer.eos_ids[0]
    for cut in range(1, len(ids)):
        tokens, drafts = ids[:-cut], [*ids[-cut:], eos]
        c = make()
        for t in tokens:
            assert c.advance(t) is None
        out = np.zeros((len(drafts) + 1, mask_words(49152)), np.int32)
        assert c.check_drafts(drafts, out) == len(drafts)
        np.testing.assert_array_equal(out[:-1], _masks_after(make, tokens, drafts[:-1]))
        for t in drafts[:-1]:
            assert c.advance(t) is None, (cut, t)
        assert c.matcher.is_accepting() and c.matcher.consume_token(eos), cut
    c = make()  # a forbidden draft is cut, the state kept
    out = np.zeros((4, mask_words(49152)), np.int32)
    assert c.check_drafts([ids[0], eos, ids[0]], out) == 1 and c.advance(ids[0]) is None


def _first_layers(smollm2_scanned, keep: int) -> Llama:
    """A draft model: the default model's first `keep` layers (same vocabulary and tokenizer)."""
    model, ckpt = smollm2_scanned
    params = {k: v for k, v in ckpt.params.items()
              if not k.startswith("layers.") or int(k.split(".")[1]) < keep}
    return Llama(dataclasses.replace(model.config, num_layers=keep), params)


# The draft model's case compiles a second model's steps (~30 s on 2 cores): slow. CI keeps
# constrained model drafts on toy models (tests/test_speculative.py, constrained distribution).
@pytest.mark.parametrize("method", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def test_speculation_under_a_constraint_equals_plain_constrained_greedy(smollm2_scanned, llm,
                                                                      method):
    """n-gram drafts (one-hot: a forbidden draft is cut) and a draft model's (drafting
    unconstrained: a forbidden draft is kept and rejected) give plain constrained greedy's
    tokens. The draft model is the default model's first 4 layers (cheap to compile); its
    date drafts are mostly rejected, the n-gram drafter's (copied from the prompt) accepted."""
    model, _ = smollm2_scanned
    # n-gram drafts verify as wide as their longest (one compiled verification per width): one
    # draft, one width. A draft model always drafts R: two, so the second can be cut.
    r = {"ngram": 1, "draft": 2}
    prompt = "Repeat: 2019-03-12."
    sampling = SamplingConfig(max_new_tokens=12, regex=r"([0-9]{4}-[0-9]{2}-[0-9]{2}, ){2}done")
    want = llm.generate([prompt], sampling, chat=True, use_tqdm=False)[0]
    spec = LLM(model, llm.engine.tokenizer, cache=CACHE, engine=dataclasses.replace(
        ENGINE, speculative_method=method, num_speculative_tokens=r[method], ngram_min=1),
        draft_model=_first_layers(smollm2_scanned, 4) if method == "draft" else None)
    got = spec.generate([prompt], sampling, chat=True, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids
    stats = spec.engine.stats()
    assert stats["spec_drafted_tokens"] > 0, stats
    assert method == "draft" or stats["spec_accepted_tokens"] > 0, stats


# The n-gram drafter copies this prompt's JSON: near the model's `"3"` it drafts the prompt's
# `}}` and the end-of-turn token (EOS) after it, which the grammar allows, while the model
# writes `},"user":...` instead: the request runs on after its grammar checked an EOS draft.
COPY_PROMPT = 'Give a user record like {"user":{"name":"Bob","age":"3"}}'
COPY_SAMPLING = SamplingConfig(max_new_tokens=24, json_schema=json.dumps({"type": "object"}))
COPY_CACHE = CacheConfig(page_size=16, max_seq_len=128, num_pages=32)
COPY_ENGINE = EngineConfig(max_slots=4, prefill_buckets=(64,))


@pytest.fixture(scope="module")
def copied_json(smollm2_scanned):
    model, ckpt = smollm2_scanned
    tokenizer = load_tokenizer(ckpt)
    llm = LLM(model, tokenizer, cache=COPY_CACHE, engine=COPY_ENGINE)
    out = llm.generate([COPY_PROMPT], COPY_SAMPLING, chat=True, use_tqdm=False)[0]
    assert out.text.startswith('{"user":{"name":"Bob","age":"3"},"'), out  # it writes on
    return tokenizer, out


# Each drafter compiles its own verification (~80 s on 2 cores): CI runs the n-gram width whose
# drafts reach `}}` and EOS where the model goes on; the others are slow.
@pytest.mark.parametrize("method, r", [
    pytest.param("ngram", 2, marks=pytest.mark.slow), ("ngram", 6),
    pytest.param("self", 3, marks=pytest.mark.slow),
    pytest.param("draft", 3, marks=pytest.mark.slow)])
def test_constrained_greedy_is_the_same_with_every_drafter(smollm2_scanned, copied_json, method, r):
    tokenizer, want = copied_json
    spec = LLM(smollm2_scanned[0], tokenizer, cache=COPY_CACHE, engine=dataclasses.replace(
        COPY_ENGINE, speculative_method=method, num_speculative_tokens=r),
        draft_model=_first_layers(smollm2_scanned, 4) if method == "draft" else None)
    got = spec.generate([COPY_PROMPT], COPY_SAMPLING, chat=True, use_tqdm=False)[0]
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), got
    assert spec.engine.stats()["spec_drafted_tokens"] > 0


def test_self_consistency_with_a_schema_always_extracts_an_answer(llm):
    problems = with_answer_format(load_tasks("arithmetic", num=2, seed=0), "schema")
    sampler = EngineSampler(llm, SamplingConfig(temperature=1.0, max_new_tokens=16, seed=0),
                            chat=False, schemas={p.prompt: answer_schema(p) for p in problems})
    samples = sampler.sample([p.prompt for p in problems], 4)
    for p, row in zip(problems, samples):
        for s in row:
            assert s.finish_reason == "eos", s
            jsonschema.validate(json.loads(s.text), answer_schema(p))
            assert answer_of(p, s.text) == str(json.loads(s.text)["answer"])
