"""Gemma 3 270M (real weights, f32, its layers scanned: tests/test_scan_layers.py checks the
scanned layout against the unrolled one) against Hugging Face transformers' `Gemma3ForCausalLM`.

Fixtures (tests/fixtures/hf_gemma3_270m.json, `scripts/make_hf_fixtures.py --model=gemma3-270m`):
transformers dequantizes the same GGUF itself and runs its own Gemma 3 code; per prompt (two
plain, two chat-templated, one of 700 tokens past the 512-token sliding window) the prompt ids,
12 greedy ids with their top-1 minus top-2 logit margins, and the last prompt position's logits
at its top 32 ids and at 256 fixed vocabulary ids.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import sharding
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.engine.llm import LLM
from jaxinfer.model import CHUNK, StepBatch

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_gemma3_270m.json")
# Worst |our logit - HF's| over the compared ids, on logits of magnitude up to ~40 (f32 both
# sides, summed in different orders over 18 layers; measured at most 3e-5).
MAX_ABS_LOGIT_DIFF = 2e-4
NEAR_TIE = 0.05  # top-1 minus top-2 margin under which either token is a correct greedy pick


@pytest.fixture(scope="module")
def hf():
    with open(FIXTURE, encoding="utf-8") as f:
        return json.load(f)


def _short(hf):
    return [c for c in hf["cases"] if not c["name"].startswith("long")]


@jax.jit
def _last_logits(model, ids, n):
    """f32[V] logits at position n - 1 of ids (padded), one prefill through the paged cache."""
    cache_config = CacheConfig(page_size=16, max_seq_len=ids.shape[0])
    cache = create_cache(model.config, cache_config, 1)
    positions = jnp.arange(ids.shape[0])[None]
    batch = StepBatch.per_slot(ids[None], positions, positions < n, cache.page_table, n[None],
                               num_pages_read=cache_config.pages_per_seq, kind=CHUNK)
    return model(batch, cache.k_pages, cache.v_pages)[0][n - 1]


def _compare(model, case, sample_ids, pad):
    ids = np.zeros((pad,), np.int32)
    ids[:len(case["prompt_ids"])] = case["prompt_ids"]
    ours = np.asarray(_last_logits(model, ids, np.int32(len(case["prompt_ids"]))))
    idx = np.concatenate([case["top_ids"], sample_ids])
    ref = np.concatenate([case["top_logits"], case["sample_logits"]])
    diff = np.abs(ours[idx] - ref)
    rel = np.linalg.norm(ours[idx] - ref) / np.linalg.norm(ref)
    print(f"{case['name']}: max |dlogit| {diff.max():.2e}, rel {rel:.2e}, "
          f"max |logit| {np.abs(ref).max():.1f}")
    assert diff.max() < MAX_ABS_LOGIT_DIFF, case["name"]
    assert int(np.argmax(ours)) == case["top_ids"][0], case["name"]


def test_tokenizer_and_chat_template_match_hf(gemma3_scanned, hf):
    _, tok = gemma3_scanned
    assert tok.bos_id == 2 and tok.add_bos
    for case in hf["cases"]:
        if case["messages"]:
            assert tok.apply_chat_template(case["messages"]) == case["prompt_text"]
            ids = tok.encode(case["prompt_text"], add_special_tokens=False)
        else:
            ids = tok.encode(case["prompt_text"])
        assert ids == case["prompt_ids"], case["name"]
    assert tok.decode(hf["cases"][0]["greedy_ids"]) == hf["cases"][0]["greedy_text"]


def test_next_token_logits_match_hf(gemma3_scanned, hf):
    model, _ = gemma3_scanned
    for case in _short(hf):
        _compare(model, case, hf["sample_ids"], pad=32)


def test_logits_past_the_sliding_window_match_hf(gemma3_scanned, hf):
    """700 tokens: every local layer's window (512) cuts off the first keys."""
    model, _ = gemma3_scanned
    (case,) = [c for c in hf["cases"] if c["name"].startswith("long")]
    _compare(model, case, hf["sample_ids"], pad=704)


def _greedy_prefix(ids, case):
    """The fixture's greedy ids up to (not including) the first near-tie, and ours as long."""
    tie = next((i for i, m in enumerate(case["margins"]) if m < NEAR_TIE), len(case["margins"]))
    return ids[:tie], case["greedy_ids"][:tie]


# Each mesh compiles the engine's steps of the real model again: slow.
# tests/test_sharding.py checks sharded == one device on toy models in CI.
@pytest.mark.parametrize("mesh_spec", [None, pytest.param("model:4", marks=pytest.mark.slow),
                                       pytest.param("data:2,model:4", marks=pytest.mark.slow)])
def test_greedy_tokens_match_hf(gemma3_scanned, hf, mesh_spec):
    """Plain and chat prompts through the serving engine: HF's greedy tokens up to the first
    near-tie, on one device and sharded (Gemma 3 270M's 4 query heads and MLP split over
    "model"; its one kv head, and so the pages, replicated)."""
    model, tok = gemma3_scanned
    cases = _short(hf)
    llm = LLM(model, tok, cache=CacheConfig(page_size=16, max_seq_len=64),
              engine=EngineConfig(max_slots=4, prefill_buckets=(32,)),
              mesh=sharding.make_mesh(mesh_spec) if mesh_spec else None)
    outs = llm.generate([c["prompt_ids"] for c in cases],
                        SamplingConfig(max_new_tokens=hf["new_tokens"], ignore_eos=True),
                        use_tqdm=False)
    for case, out in zip(cases, outs):
        ours, want = _greedy_prefix(out.token_ids, case)
        assert len(want) >= 4 and ours == want, case["name"]
