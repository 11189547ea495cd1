"""`--attention_impl=pallas`: decode rows run the paged kernel (Triton in interpret mode on CPU)
and give the same greedy tokens as the XLA path, on a toy model and on the real default model."""

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


def test_pallas_decode_matches_hf_greedy_on_default_model(smollm2):
    with open(os.path.join(os.path.dirname(__file__), "fixtures",
                           "hf_smollm2_greedy.json")) as f:
        case = json.load(f)["cases"][0]
    model, _ = smollm2
    llm = _llm(model, "pallas", max_slots=1, max_seq_len=32)
    [out] = llm.generate([case["prompt_ids"]], SamplingConfig(max_new_tokens=8, ignore_eos=True),
                         use_tqdm=False)
    assert out.token_ids == case["greedy_ids"][:8]


def test_pallas_impl_traces_a_pallas_call_and_xla_does_not():
    from jaxinfer.engine import steps

    model, _ = toy_model(toy_config(head_dim=16))
    jaxprs = {}
    for impl in ("xla", "pallas"):
        r = _llm(model, impl).engine.runner
        batch = dataclasses.replace(steps.MixedBatch.idle(3, 4), decode=np.ones((3,), bool))
        jaxprs[impl] = str(steps.mixed_forward.trace(
            r.graph, r.params, r.kv, r.state.tokens, batch, num_pages_read=1,
            attention_impl=r.attention_impl).jaxpr)
    assert "pallas_call" in jaxprs["pallas"] and "pallas_call" not in jaxprs["xla"]
