"""The engine's features on a mixture of experts: the Qwen3-MoE toy's shape
(tests/fixtures/hf_qwen3_moe_toy: 16 experts, top 4, one dense layer among three) with random
weights and SmolLM2's vocabulary and tokenizer, saved as a Hugging Face directory and loaded
through the qwen3_moe family.

Greedy output is the same token for token with n-gram and self-speculative drafts, under
prefix-cache hits and preemption (a pool too small for the batch), as on an engine that neither
speculates, shares nor preempts; forked JSON-schema samples validate; the OpenAI server answers
a completion with the offline engine's text. One reference engine and one engine per drafter,
built once for the module; every sequence fits 64 tokens (few compiled variants)."""

from __future__ import annotations

import dataclasses
import json
import os

import httpx
import jsonschema
import pytest

from jaxinfer.checkpoint.loading import load_model, load_tokenizer
from jaxinfer.checkpoint.tokenizer import Tokenizer
from jaxinfer.checkpoint.weights import Checkpoint, default_model_path, load_checkpoint, save_hf
from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.model import Llama, init_params
from tests.helpers import serving

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_qwen3_moe_toy")
PREFIX = "Repeat after me: one two three four, one two three four, "
PROMPTS = [PREFIX + "five.", PREFIX + "six.", "Count: 1 2 3 1 2 3 1 2", "Hello there.",
           PREFIX + "seven.", "Name a color."]
GREEDY = SamplingConfig(max_new_tokens=32, ignore_eos=True)
SCHEMA = {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 9}},
          "required": ["c", "n"], "additionalProperties": False}
ENGINE = EngineConfig(max_slots=6, prefill_buckets=(32,), max_num_batched_tokens=64,
                      prefill_chunk_size=32)
# 6 requests of about 48 tokens need 36 pages of 8 at once: 12 (two such requests) preempt.
SMALL_POOL = CacheConfig(page_size=8, max_seq_len=64, num_pages=12)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """The Qwen3-MoE toy's config at SmolLM2's vocabulary, random weights (sharp logits: no
    near-ties for float noise to flip), with SmolLM2's tokenizer."""
    path = str(tmp_path_factory.mktemp("qwen3-moe-toy"))
    config = dataclasses.replace(load_checkpoint(FIXTURE).config, vocab_size=49152,
                                 dtype="float32")
    assert config.num_experts == 16 and not config.is_moe(1)
    params = init_params(config, seed=3, scale=0.3)
    params["lm_head"] *= 8.0
    # The layers past the self-speculative draft's one add less to the residual stream, so the
    # draft agrees with the target often but not always: both accepted and rejected drafts.
    for name in params:
        if name.startswith(("layers.1.", "layers.2.")) and name.endswith(("o", "down")):
            params[name] *= 0.3
    save_hf(Checkpoint(config, params, path, "hf", {}), path)
    Tokenizer.from_gguf_file(default_model_path()).save_hf(path)
    return path


@pytest.fixture(scope="module")
def loaded(moe_dir) -> tuple[Llama, Tokenizer]:
    model, ckpt = load_model(RunConfig(model_path=moe_dir))
    return model, load_tokenizer(ckpt)


@pytest.fixture(scope="module")
def reference(loaded) -> LLM:
    """Neither speculates, shares pages nor preempts (a pool for every slot's whole context)."""
    return LLM(*loaded, cache=CacheConfig(page_size=8, max_seq_len=64),
               engine=dataclasses.replace(ENGINE, enable_prefix_caching=False))


@pytest.fixture(scope="module")
def expected(reference) -> list[list[int]]:
    outs = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = reference.engine.stats()
    assert stats["preemptions"] == 0 and stats["prefix_hits"] == 0, stats
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module", params=["ngram", "self"])
def speculative(request, loaded) -> LLM:
    return LLM(*loaded, cache=SMALL_POOL, engine=dataclasses.replace(
        ENGINE, speculative_method=request.param, num_speculative_tokens=3, self_spec_layers=1,
        enable_prefix_caching=True))


def test_the_checkpoint_loads_as_a_mixture(reference):
    config = reference.engine.config
    assert config.arch == "qwen3_moe" and config.num_experts == 16
    assert config.experts_per_token == 4 and config.vocab_size == 49152


def test_greedy_with_drafts_prefix_hits_and_preemption_equals_plain_greedy(speculative,
                                                                           expected):
    # Twice: the second round's prompts hit the prefix cache the first round filled.
    for _ in range(2):
        outs = speculative.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == expected
    stats = speculative.engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0, stats
    assert stats["spec_verify_calls"] > 0 and stats["spec_accepted_tokens"] > 0, stats


def test_forked_samples_follow_a_json_schema(reference):
    outs = reference.generate(["Give one record as JSON."], SamplingConfig(
        n=6, temperature=1.0, seed=11, max_new_tokens=24, json_schema=json.dumps(SCHEMA)),
        use_tqdm=False)
    assert len(outs) == 6
    for out in outs:
        assert out.finish_reason == "eos", out
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_the_openai_server_answers_with_the_offline_text(reference, expected):
    text = reference.engine.tokenizer.decode(expected[0])
    with serving(reference.engine) as (url, _):
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "test", "prompt": PROMPTS[0], "max_tokens": GREEDY.max_new_tokens,
            "temperature": 0.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
