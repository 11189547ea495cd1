"""Model invariants on toy configs, through the model's one forward (a step descriptor over the
paged pool), against the independent numpy reference.

prefill + k decodes == one full forward; chunked prefill == one-shot prefill; a mixed step (decode
rows beside a chunk) == each part alone; batch invariance; unused pages are never read (poisoned
with NaN); idle rows write nothing; RoPE scalings, biases, sliding window, GQA, bf16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import CacheConfig, RopeConfig
from jaxinfer.engine.kv_cache import create_cache, pages_bucket
from jaxinfer.model import CHUNK, DECODE, QueryGroup, StepBatch
from tests import reference_llama
from tests.helpers import TOLERANCE, assert_close, rel_err, toy_config, toy_model

CACHE = CacheConfig(page_size=4, max_seq_len=64)


@jax.jit
def _forward(model, batch, k_pages, v_pages):
    return model(batch, k_pages, v_pages)


def run_rows(model, cache, tokens, start, *, slot=0, kind=CHUNK, logits="all", valid=None):
    """Feeds `tokens` of one slot at positions start.. through the model (a [1, T] group);
    returns (cache with the K/V written, logits of every token or of the last)."""
    t = len(tokens)
    positions = jnp.arange(start, start + t, dtype=jnp.int32)[None]
    table = cache.page_table[slot:slot + 1]
    batch = StepBatch.per_slot(
        jnp.asarray(tokens, jnp.int32)[None], positions,
        jnp.ones((1, t), bool) if valid is None else valid, table,
        jnp.asarray([start + t], jnp.int32),
        logits_index=None if logits == "all" else jnp.asarray([t - 1], jnp.int32),
        num_pages_read=pages_bucket(start + t, CACHE.page_size, CACHE.pages_per_seq), kind=kind)
    logits, k, v = _forward(model, batch, cache.k_pages, cache.v_pages)
    return cache.replace(k_pages=k, v_pages=v), logits


def decode_rows(model, cache, tokens, positions, active):
    """One decode token per slot (a [B, 1] DECODE group), slot b at positions[b]; inactive
    slots compute but write nothing. Returns (cache, logits f32[B, V])."""
    pos = jnp.asarray(positions, jnp.int32)[:, None]
    on = jnp.asarray(active)
    batch = StepBatch.per_slot(
        jnp.asarray(tokens, jnp.int32)[:, None], pos, on[:, None], cache.page_table,
        jnp.where(on, pos[:, 0] + 1, 0),
        num_pages_read=pages_bucket(int(np.max(positions)) + 1, CACHE.page_size,
                                    CACHE.pages_per_seq))
    assert batch.groups[0].kind == DECODE
    logits, k, v = _forward(model, batch, cache.k_pages, cache.v_pages)
    return cache.replace(k_pages=k, v_pages=v), logits


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
    _, logits = run_rows(model, create_cache(config, CACHE, 1, fill=np.nan), ids, 0)
    assert_close(logits, ref, scale=10)


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_plus_decodes_equals_full_forward(window):
    model, params = toy_model(toy_config(sliding_window=window))
    c = model.config
    ids = list(np.random.default_rng(2).integers(0, c.vocab_size, 20))
    ref = reference_llama.forward(c, params, ids)
    cache, _ = run_rows(model, create_cache(c, CACHE, 2, fill=np.nan), ids[:7], 0)
    for t in range(7, 20):  # teacher-forced: slot 0 decodes ids[t], slot 1 idles
        cache, logits = decode_rows(model, cache, [ids[t], 0], [t, 0], [True, False])
        assert_close(logits[0], ref[t], scale=10)


def test_chunked_prefill_equals_one_shot():
    model, _ = toy_model()
    ids = list(np.random.default_rng(3).integers(0, 64, 30))
    one, logits_one = run_rows(model, create_cache(model.config, CACHE, 1, fill=np.nan), ids, 0,
                               logits="last")
    chunked = create_cache(model.config, CACHE, 1, fill=np.nan)
    for start in range(0, 30, 7):
        chunked, logits = run_rows(model, chunked, ids[start:start + 7], start, logits="last")
    assert_close(logits, logits_one)
    live = np.asarray(one.k_pages)[:, :, :8]  # 30 tokens = pages 0..7 of slot 0
    got = np.asarray(chunked.k_pages)[:, :, :8]
    assert_close(got.reshape(2, 2, -1, 8)[:, :, :30], live.reshape(2, 2, -1, 8)[:, :, :30])


def test_mixed_step_equals_its_parts():
    """Two decode rows and a 5-token chunk of a third slot in one step (two query groups, one
    matmul over all 7 rows) give the logits and K/V each part gives alone."""
    model, params = toy_model()
    rng = np.random.default_rng(8)
    seqs = [list(rng.integers(0, 64, n)) for n in (9, 6)]
    chunk = list(rng.integers(0, 64, 5))
    cache = create_cache(model.config, CACHE, 3, fill=np.nan)
    for slot, seq in enumerate(seqs):  # all but each sequence's last token
        cache, _ = run_rows(model, cache, seq[:-1], 0, slot=slot)
    table = cache.page_table
    b = 3
    slots = jnp.arange(b, dtype=jnp.int32)
    dpos = jnp.asarray([8, 5, 0], jnp.int32)
    dvalid = jnp.asarray([True, True, False])
    offs = jnp.arange(5, dtype=jnp.int32)
    batch = StepBatch(
        tokens=jnp.asarray([seqs[0][-1], seqs[1][-1], 0] + chunk, jnp.int32),
        positions=jnp.concatenate([dpos, offs]), valid=jnp.concatenate([dvalid, offs < 5]),
        slots=jnp.asarray([0, 1, 2] + [2] * 5, jnp.int32), page_table=table,
        groups=(QueryGroup(rows=slots[:, None], positions=dpos[:, None], slots=slots,
                           kv_lens=jnp.where(dvalid, dpos + 1, 0)),
                QueryGroup(rows=(b + offs)[None], positions=offs[None],
                           slots=jnp.asarray([2], jnp.int32), kv_lens=jnp.asarray([5]),
                           kind=CHUNK)),
        out_index=jnp.arange(8, dtype=jnp.int32),
        logits_index=jnp.asarray([0, 1, 7], jnp.int32), num_pages_read=4)
    logits, _, _ = _forward(model, batch, cache.k_pages, cache.v_pages)
    for row, seq in zip((0, 1), seqs):
        assert_close(logits[row], reference_llama.forward(model.config, params, seq)[-1],
                     scale=10)
    assert_close(logits[2], reference_llama.forward(model.config, params, chunk)[-1], scale=10)


def test_batch_invariance_and_slot_independence():
    """A row's logits do not depend on its slot or on the other rows (bitwise on this backend:
    rows never mix in any reduction)."""
    model, _ = toy_model()
    rng = np.random.default_rng(4)
    a = list(rng.integers(0, 64, 17))
    others = [list(rng.integers(0, 64, n)) for n in (3, 14, 6)]

    def run(slot_of_a, fill_others):
        cache = create_cache(model.config, CACHE, 4, fill=np.nan)
        cache, _ = run_rows(model, cache, a[:9], 0, slot=slot_of_a)
        lens = [0] * 4
        lens[slot_of_a] = 9
        free = [s for s in range(4) if s != slot_of_a]
        if fill_others:
            for s, ids in zip(free, others):
                cache, _ = run_rows(model, cache, ids, 0, slot=s)
                lens[s] = len(ids)
        rows = []
        for t in range(9, 17):
            tokens = [int(rng.integers(0, 64)) if s != slot_of_a else a[t] for s in range(4)]
            active = [s == slot_of_a or fill_others for s in range(4)]
            cache, logits = decode_rows(model, cache, tokens, [lens[s] + t - 9 for s in range(4)],
                                        active)
            rows.append(np.asarray(logits[slot_of_a]))
        return np.stack(rows)

    base = run(0, False)
    for slot, fill in [(2, False), (3, True), (0, True)]:
        np.testing.assert_array_equal(run(slot, fill), base)


def test_idle_rows_write_nothing():
    model, _ = toy_model(toy_config(scan_layers=False))  # reads each layer's pool
    cache, _ = run_rows(model, create_cache(model.config, CACHE, 2, fill=np.nan), [1, 2, 3], 0)
    before = np.asarray(cache.k_pages)[:, :, 16:32]  # slot 1's pages, still NaN
    cache, _ = decode_rows(model, cache, [4, 5], [3, 0], [True, False])
    assert np.isnan(before).all() and np.isnan(np.asarray(cache.k_pages)[:, :, 16:32]).all()
    assert not np.isnan(np.asarray(cache.k_pages)[:, :, 0, 3]).any()  # slot 0's 4th token


def test_bf16_model_matches_f32_reference_within_bf16_tolerance():
    """bf16 weights/activations; norms, softmax and logits in f32 (tolerance table: 2e-2)."""
    config = toy_config(dtype="bfloat16")
    model, params = toy_model(config)
    ids = list(np.random.default_rng(5).integers(0, config.vocab_size, 11))
    ref = reference_llama.forward(config, params, ids)
    cache = create_cache(config, CACHE, 1)
    assert cache.k_pages[0].dtype == jnp.bfloat16
    _, logits = run_rows(model, cache, ids, 0)
    assert logits.dtype == jnp.float32
    assert rel_err(logits, ref) < TOLERANCE["bfloat16"][0]


@pytest.mark.parametrize("window", [None, 5])
def test_query_blocked_prefill_matches_reference(monkeypatch, window):
    """Chunks longer than attention.Q_BLOCK attend block by block (last block partial)."""
    from jaxinfer.model import attention

    monkeypatch.setattr(attention, "Q_BLOCK", 4)
    config = toy_config(sliding_window=window, num_layers=1)
    model, params = toy_model(config)
    ids = list(np.random.default_rng(6).integers(0, config.vocab_size, 13))
    ref = reference_llama.forward(config, params, ids)
    _forward.clear_cache()  # Q_BLOCK is read at trace time
    _, logits = run_rows(model, create_cache(config, CACHE, 1, fill=np.nan), ids, 0)
    _forward.clear_cache()
    assert_close(logits, ref, scale=10)


def test_lane_packed_pool_equals_plain():
    """A pool stored lane-packed (`kv_quant.PackedPages`, the TPU layout for H under 128; here
    two H = 8 tokens to a 16-wide row), NaN-poisoned: prefill and decodes through the writes'
    scatter and the XLA reference's gather give the plain pool's logits and K/V."""
    from jaxinfer.model.kv_quant import PackedPages
    from pallas_kernels.paged_attention.reference import pack_pages, unpack_pages

    model, _ = toy_model(toy_config(scan_layers=False))  # packs each layer's pool
    c = model.config
    ids = list(np.random.default_rng(5).integers(0, c.vocab_size, 11))
    plain = create_cache(c, CACHE, 2, fill=np.nan)
    def pack(pools):
        return tuple(PackedPages(values=pack_pages(p, lanes=16), head_dim=c.head_dim)
                     for p in pools)

    packed = plain.replace(k_pages=pack(plain.k_pages), v_pages=pack(plain.v_pages))
    outs = []
    for cache in (plain, packed):
        cache, prefill = run_rows(model, cache, ids[:7], 0)
        for t in range(7, 11):
            cache, logits = decode_rows(model, cache, [ids[t], 0], [t, 0], [True, False])
        outs.append((cache, prefill, logits))
    (plain, *want), (packed, *got) = outs
    assert isinstance(packed.k_pages[0], PackedPages)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    for g, w in zip(packed.k_pages + packed.v_pages, plain.k_pages + plain.v_pages):
        np.testing.assert_array_equal(np.asarray(unpack_pages(g.values, c.head_dim)),
                                      np.asarray(w))
