"""`--attention_impl=pallas`: decode-only steps run the paged decode kernel, steps with a prompt
chunk run all their rows through the ragged flash kernel (both Triton in interpret mode on CPU),
and give the same greedy tokens as the XLA path, on a toy model (chunked prefill beside decode
rows; with prefix hits and preemption) and on the real default model (prompt chunks through the
ragged kernel with prefix hits and preemption, decode through the decode kernel, against Hugging
Face's greedy tokens)."""

import dataclasses
import json
import os

import numpy as np
import pytest

from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.model.attention import resolve_impl
from tests.helpers import toy_config, toy_model

GREEDY = SamplingConfig(max_new_tokens=6, ignore_eos=True, logprobs=True)


def _llm(model, impl, max_slots=3, max_seq_len=64):
    return LLM(model, None, cache=CacheConfig(page_size=16, max_seq_len=max_seq_len),
               engine=EngineConfig(max_slots=max_slots, prefill_buckets=(16,),
                                   attention_impl=impl))


def test_auto_resolves_to_xla_on_cpu():
    assert resolve_impl("auto") == "xla" and resolve_impl("pallas") == "pallas"


@pytest.mark.parametrize("window", [None, 9])
def test_pallas_decode_matches_xla_on_toy_model(window):
    model, _ = toy_model(toy_config(head_dim=16, num_q_heads=4, num_kv_heads=2,
                                    sliding_window=window))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 64, n)) for n in (3, 17, 9)]
    xla = _llm(model, "xla").generate(prompts, GREEDY, use_tqdm=False)
    pallas = _llm(model, "pallas").generate(prompts, GREEDY, use_tqdm=False)
    for a, b in zip(xla, pallas):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


@pytest.mark.optimized  # hundreds of real-model steps (tests/conftest.py)
def test_pallas_matches_hf_greedy_on_default_model_with_prefix_hits_and_preemption(
        smollm2_scanned):
    """The real model with both kernels: three chat prompts sharing the system prompt's first
    page (later ones take it from the prefix cache and their chunks start past it), chunked by
    16 beside decode rows, two at a time in 5 pages where two prompts fit but their outputs
    need a sixth (preemption and recompute): each gets Hugging Face's greedy tokens, which the
    XLA path also gives (tests/test_hf_reference.py)."""
    with open(os.path.join(os.path.dirname(__file__), "fixtures",
                           "hf_smollm2_greedy.json")) as f:
        cases = {c["name"]: c for c in json.load(f)["cases"]}
    cases = [cases[n] for n in ("chat_capital", "chat_python_reverse", "chat_photosynthesis")]
    model, _ = smollm2_scanned
    llm = LLM(model, None, cache=CacheConfig(page_size=16, max_seq_len=64, num_pages=5),
              engine=EngineConfig(max_slots=2, prefill_buckets=(16,), prefill_chunk_size=16,
                                  max_num_batched_tokens=18, attention_impl="pallas"))
    outs = llm.generate([c["prompt_ids"] for c in cases],
                        SamplingConfig(max_new_tokens=10, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["prefix_hits"] > 0 and stats["preemptions"] > 0, stats
    for case, out in zip(cases, outs):
        assert out.token_ids == case["greedy_ids"][:10], case["name"]


def test_pallas_impl_traces_a_pallas_call_and_xla_does_not():
    from jaxinfer.engine import steps

    model, _ = toy_model(toy_config(head_dim=16))
    jaxprs = {}
    for impl in ("xla", "pallas"):
        r = _llm(model, impl).engine.runner
        for chunk in (0, 16):
            batch = dataclasses.replace(steps.MixedBatch.idle(3, 4, chunk),
                                        decode=np.ones((3,), bool))
            jaxprs[impl, chunk] = str(steps.mixed_forward.trace(
                r.graph, r.params, r.kv, r.state.tokens, batch, num_pages_read=1,
                attention_impl=r.attention_impl).jaxpr)
    assert "pallas_call" not in jaxprs["xla", 0] + jaxprs["xla", 16]
    # decode-only steps: the decode kernel; a step with a chunk: the ragged kernel alone
    assert "paged_decode_attention_triton" in jaxprs["pallas", 0]
    assert "ragged" not in jaxprs["pallas", 0]
    assert "ragged_paged_attention_triton" in jaxprs["pallas", 16]
    assert "paged_decode_attention_triton" not in jaxprs["pallas", 16]


@pytest.mark.slow
def test_pallas_chunks_with_prefix_hits_and_preemption_match_xla():
    """Prompt chunks beside decode rows through the ragged kernel (one call per mixed step),
    prefix-cache hits (a chunk starting past a shared prefix) and preemption (recomputing a
    sequence's prompt and outputs): greedy tokens equal the XLA path's."""
    model, _ = toy_model(toy_config(head_dim=16))
    rng = np.random.default_rng(1)
    prefix = list(rng.integers(0, 64, 20))
    prompts = [prefix + list(rng.integers(0, 64, n)) for n in (5, 30)] + [
        list(rng.integers(0, 64, n)) for n in (37, 9)]
    stats, outs = {}, {}
    for impl in ("xla", "pallas"):
        llm = LLM(model, None, cache=CacheConfig(page_size=16, max_seq_len=80, num_pages=9),
                  engine=EngineConfig(max_slots=4, prefill_buckets=(16,), prefill_chunk_size=16,
                                      max_num_batched_tokens=24, attention_impl=impl))
        outs[impl] = llm.generate(prompts, SamplingConfig(max_new_tokens=12, ignore_eos=True),
                                  use_tqdm=False)
        stats[impl] = llm.engine.stats()
    assert stats["pallas"]["preemptions"] > 0 and stats["pallas"]["prefix_hits"] > 0, stats
    assert [o.token_ids for o in outs["pallas"]] == [o.token_ids for o in outs["xla"]]
