"""`--attention_impl=pallas`: decode steps run the paged kernel (Triton in interpret mode on CPU)
and give the same greedy tokens as the XLA path, on a toy model and on the real default model."""

import json
import os

import numpy as np
import pytest

from jaxinfer.attention import resolve_impl
from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
from jaxinfer.generate import Generator
from jaxinfer.loading import load_model
from tests.helpers import toy_config, toy_model

GREEDY = SamplingConfig(max_new_tokens=6, ignore_eos=True, logprobs=True)


def _generator(model, impl, max_slots=3, max_seq_len=64):
    return Generator(model, None, cache=CacheConfig(page_size=16, max_seq_len=max_seq_len),
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
    xla = _generator(model, "xla").generate(prompts, GREEDY)
    pallas = _generator(model, "pallas").generate(prompts, GREEDY)
    for a, b in zip(xla, pallas):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_pallas_decode_matches_hf_greedy_on_default_model():
    with open(os.path.join(os.path.dirname(__file__), "fixtures",
                           "hf_smollm2_greedy.json")) as f:
        case = json.load(f)["cases"][0]
    model, _ = load_model(RunConfig(dtype="float32"))
    gen = _generator(model, "pallas", max_slots=1, max_seq_len=32)
    [out] = gen.generate([case["prompt_ids"]], SamplingConfig(max_new_tokens=8, ignore_eos=True))
    assert out.token_ids == case["greedy_ids"][:8]


def test_pallas_impl_traces_a_pallas_call_and_xla_does_not():
    from jaxinfer import steps

    model, _ = toy_model(toy_config(head_dim=16))
    jaxprs = {}
    for impl in ("xla", "pallas"):
        gen = _generator(model, impl)
        jaxprs[impl] = str(steps.decode_step.trace(
            gen.graph, gen.params, gen.cache, gen.state, gen._sampling, num_pages_read=1,
            attention_impl=gen.attention_impl).jaxpr)
    assert "pallas_call" in jaxprs["pallas"] and "pallas_call" not in jaxprs["xla"]
