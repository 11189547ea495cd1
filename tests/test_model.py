"""Model invariants on toy configs against the independent numpy reference.

prefill + k decodes == one full forward; chunked prefill == one-shot prefill; batch invariance;
unused pages are never read (poisoned with NaN); RoPE scalings, biases, sliding window, GQA.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer import steps
from jaxinfer.config import CacheConfig, RopeConfig
from jaxinfer.kv_cache import create_cache, pages_bucket
from jaxinfer.sampling import SamplingParams
from tests import reference_llama
from tests.helpers import TOLERANCE, assert_close, rel_err, toy_config, toy_model

CACHE = CacheConfig(page_size=4, max_seq_len=64)


def _run_prefill(model, ids, *, slot=0, max_slots=2, chunk=None, cache=None, state=None,
                 bucket=16):
    """Prefills `ids` into `slot` in chunks of `chunk`; returns (cache, state, last logits)."""
    graphdef, params = steps.split_model(model)
    c = model.config
    cache = cache or create_cache(c, CACHE, max_slots, fill=np.nan)
    state = state or steps.create_slot_state(max_slots, c.vocab_size)
    sp = SamplingParams.from_configs([None] * max_slots)
    chunk = chunk or len(ids)
    start = 0
    while start < len(ids):
        n = min(chunk, len(ids) - start)
        toks = np.zeros((bucket,), np.int32)
        toks[:n] = ids[start:start + n]
        cache, state, out = steps.prefill_step(
            graphdef, params, cache, state, sp, toks, np.int32(slot), np.int32(start),
            np.int32(n), np.bool_(start + n == len(ids)),
            num_pages_read=pages_bucket(start + bucket, 4, CACHE.pages_per_seq))
        start += n
    return cache, state, out


@pytest.mark.parametrize("variant", ["plain", "gqa1", "bias_untied", "llama3", "linear", "window"])
def test_prefill_matches_reference(variant):
    overrides = {
        "plain": {},
        "gqa1": dict(num_q_heads=4, num_kv_heads=4),
        "bias_untied": dict(qkv_bias=True, tie_embeddings=False),
        "llama3": dict(rope=RopeConfig(theta=500000.0, type="llama3", factor=8.0,
                                       original_max_position=16)),
        "linear": dict(rope=RopeConfig(type="linear", factor=4.0)),
        "window": dict(sliding_window=5),
    }[variant]
    config = toy_config(tie_embeddings=overrides.pop("tie_embeddings", True), **overrides)
    model, params = toy_model(config)
    ids = list(np.random.default_rng(1).integers(0, config.vocab_size, 13))
    ref = reference_llama.forward(config, params, ids)
    graphdef, p = nnx.split(model)
    cache = create_cache(config, CACHE, 1, fill=np.nan)
    logits, _, _ = nnx.merge(graphdef, p)(
        jnp.asarray(ids)[None], jnp.arange(13)[None], jnp.ones((1, 13), bool),
        cache.k_pages, cache.v_pages, cache.page_table, jnp.array([13]), None,
        num_pages_read=4)
    assert_close(logits[0], ref, scale=10)


def test_prefill_plus_decodes_equals_full_forward():
    model, params = toy_model()
    c = model.config
    ids = list(np.random.default_rng(2).integers(0, c.vocab_size, 20))
    ref = reference_llama.forward(c, params, ids)
    cache, state, out = _run_prefill(model, ids[:7])
    graphdef, p = steps.split_model(model)
    sp = SamplingParams.from_configs([None, None])
    # Teacher-force the remaining ids through decode_step by overwriting the slot's input token.
    for t in range(7, 20):
        state = state.replace(tokens=state.tokens.at[0].set(ids[t]))
        cache, state, out = steps.decode_step(graphdef, p, cache, state, sp,
                                              num_pages_read=pages_bucket(t + 1, 4, 16),
                                              num_top_logprobs=3)
        np.testing.assert_array_equal(out.top_ids[0, 0], np.argmax(ref[t]))
        assert_close(out.logprobs[0], jax.nn.log_softmax(ref[t])[out.tokens[0]], scale=10)
    assert int(cache.lengths[0]) == 20 and int(cache.lengths[1]) == 0


def test_chunked_prefill_equals_one_shot():
    model, _ = toy_model()
    ids = list(np.random.default_rng(3).integers(0, 64, 30))
    cache1, _, out1 = _run_prefill(model, ids, bucket=32)
    cache2, _, out2 = _run_prefill(model, ids, chunk=7, bucket=8)
    np.testing.assert_array_equal(out1.tokens, out2.tokens)
    assert_close(out1.logprobs, out2.logprobs)
    live = np.asarray(cache1.k_pages)[:, :, :8]  # slot 0 owns pages 0..15; 30 tokens = 8 pages
    got = np.asarray(cache2.k_pages)[:, :, :8]
    assert_close(got.reshape(2, 2, -1, 8)[:, :, :30], live.reshape(2, 2, -1, 8)[:, :, :30])


def test_batch_invariance_and_slot_independence():
    """A row's greedy tokens and logprobs do not depend on its slot or on the other rows."""
    model, _ = toy_model()
    graphdef, p = steps.split_model(model)
    rng = np.random.default_rng(4)
    a = list(rng.integers(0, 64, 9))
    others = [list(rng.integers(0, 64, n)) for n in (3, 14, 6)]

    def run(slot_of_a, fill_others):
        cache = create_cache(model.config, CACHE, 4, fill=np.nan)
        state = steps.create_slot_state(4, 64)
        cache, state, _ = _run_prefill(model, a, slot=slot_of_a, max_slots=4, cache=cache,
                                       state=state)
        if fill_others:
            free = [s for s in range(4) if s != slot_of_a]
            for s, ids in zip(free, others):
                cache, state, _ = _run_prefill(model, ids, slot=s, max_slots=4, cache=cache,
                                               state=state)
        sp = SamplingParams.from_configs([None] * 4)
        toks, lps = [], []
        for _ in range(8):
            cache, state, out = steps.decode_step(graphdef, p, cache, state, sp,
                                                  num_pages_read=8)
            toks.append(int(out.tokens[slot_of_a]))
            lps.append(float(out.logprobs[slot_of_a]))
        return toks, np.array(lps)

    base_toks, base_lps = run(0, False)
    for slot, fill in [(2, False), (3, True), (0, True)]:
        toks, lps = run(slot, fill)
        assert toks == base_toks
        # Bitwise on this backend: rows never mix in any reduction.
        np.testing.assert_array_equal(lps, base_lps)


def test_idle_slots_write_nothing():
    model, _ = toy_model()
    cache, state, _ = _run_prefill(model, [1, 2, 3], slot=0, max_slots=2)
    graphdef, p = steps.split_model(model)
    before = np.asarray(cache.k_pages)[:, :, 16:32]  # slot 1's pages, still NaN
    cache, state, _ = steps.decode_step(graphdef, p, cache, state,
                                        SamplingParams.from_configs([None, None]),
                                        num_pages_read=2)
    assert np.isnan(before).all() and np.isnan(np.asarray(cache.k_pages)[:, :, 16:32]).all()
    assert list(np.asarray(cache.lengths)) == [4, 0]


def test_bf16_model_matches_f32_reference_within_bf16_tolerance():
    """bf16 weights/activations; norms, softmax and logits in f32 (tolerance table: 2e-2)."""
    config = toy_config(dtype="bfloat16")
    model, params = toy_model(config)
    ids = list(np.random.default_rng(5).integers(0, config.vocab_size, 11))
    ref = reference_llama.forward(config, params, ids)
    cache = create_cache(config, CACHE, 1)
    assert cache.k_pages[0].dtype == jnp.bfloat16
    graphdef, p = nnx.split(model)
    logits, _, _ = nnx.merge(graphdef, p)(
        jnp.asarray(ids)[None], jnp.arange(11)[None], jnp.ones((1, 11), bool),
        cache.k_pages, cache.v_pages, cache.page_table, jnp.array([11]), None,
        num_pages_read=4)
    assert logits.dtype == jnp.float32
    assert rel_err(logits[0], ref) < TOLERANCE["bfloat16"][0]


@pytest.mark.parametrize("window", [None, 5])
def test_query_blocked_prefill_matches_reference(monkeypatch, window):
    """Chunks longer than attention.Q_BLOCK attend block by block (last block partial)."""
    from jaxinfer import attention

    monkeypatch.setattr(attention, "Q_BLOCK", 4)
    config = toy_config(sliding_window=window)
    model, params = toy_model(config)
    ids = list(np.random.default_rng(6).integers(0, config.vocab_size, 13))
    ref = reference_llama.forward(config, params, ids)
    cache = create_cache(config, CACHE, 1, fill=np.nan)
    graphdef, p = nnx.split(model)
    logits, _, _ = nnx.merge(graphdef, p)(
        jnp.asarray(ids)[None], jnp.arange(13)[None], jnp.ones((1, 13), bool),
        cache.k_pages, cache.v_pages, cache.page_table, jnp.array([13]), None,
        num_pages_read=4)
    assert_close(logits[0], ref, scale=10)
