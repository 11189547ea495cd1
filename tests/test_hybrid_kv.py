"""Hybrid KV pools on a Gemma-3-shaped toy (sliding-window layers with their own bounded pool,
`CacheConfig.hybrid`): the engine's outputs equal those with full-length pages for every layer
and those of solo runs, under prompts longer than the window, shared prefixes, forks,
preemption, aborts and speculative verification; the local pages a sequence holds stay bounded;
neither pool leaks; nothing compiles after warm-up. The scheduler's side of the rule (which
pages are released, how much of a cached prefix is usable) is unit-tested on a simulated device
in test_scheduler.py."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import sharding
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig, local_pages_bound
from jaxinfer.engine.llm import LLM
from jaxinfer.model import Llama, init_params
from tests.helpers import count_compiles, toy_config

VOCAB = 64
GREEDY = SamplingConfig(max_new_tokens=12, ignore_eos=True)


def gemma_toy(window: int) -> Llama:
    """Gemma 3's block (QK-norm, post-norms, (1 + w) norms, GeGLU, scaled embeddings, local
    layers interleaved with a global one) at toy width, with two local layers per global one
    instead of five: half the layers to compile, the same code paths."""
    config = toy_config(arch="gemma3", num_layers=3, qk_norm=True, post_norms=True,
                        norm_plus_one=True, scale_embeddings=True, activation="gelu_tanh",
                        query_pre_attn_scalar=8.0, sliding_window=window,
                        sliding_window_pattern=3, tie_embeddings=True, vocab_size=VOCAB,
                        max_position=2048)
    return Llama(config, init_params(config, seed=3, scale=0.3))


@pytest.fixture(scope="module")
def small_window() -> Llama:
    return gemma_toy(window=8)


def engine(model, *, hybrid=True, page_size=4, max_seq_len=32, num_pages=8,
           num_local_pages=6, max_slots=4, chunk=8, mesh=None, **engine_kw) -> LLM:
    """By default the shapes every CI test here shares (so each step variant compiles once per
    module): 4 slots, pages of 4, 8 pages per sequence and in the global pool (the longest
    request fills it: preemption), 6 local pages (a window of 8 needs at most 5 per sequence:
    the local pool preempts and evicts too)."""
    cache = CacheConfig(page_size=page_size, max_seq_len=max_seq_len, num_pages=num_pages,
                        hybrid=hybrid, num_local_pages=num_local_pages if hybrid else None)
    config = EngineConfig(max_slots=max_slots, prefill_buckets=(chunk,),
                          prefill_chunk_size=chunk,
                          max_num_batched_tokens=max(chunk, max_slots) + max_slots,
                          **engine_kw)
    return LLM(model, None, cache=cache, engine=config, mesh=mesh)


def run(llm: LLM, prompts, samplings) -> tuple[list[list[int]], int]:
    """Greedy/seeded outputs, stepping the engine by hand; returns them and the most local
    pages any running sequence held after a step."""
    eng = llm.engine
    ids = [eng.add_request(p, s) for p, s in zip(prompts, samplings)]
    held = 0
    while eng.has_unfinished():
        eng.step()
        held = max([held] + [sum(p is not None for p in r.local_pages)
                             for r in eng.scheduler.running])
    return [[c.token_ids for c in eng.results(i)] for i in ids], held


def assert_no_leaks(llm: LLM) -> None:
    """Every page of both pools is free or cached, none held (`check_invariants` agrees)."""
    sched = llm.engine.scheduler
    sched.check_invariants()
    for pool in sched.pools + sched.local_pools:
        assert not any(pool.refcount) and pool.num_available() == pool.num_pages


def test_prompt_longer_than_the_window_equals_full_length_pages(small_window, reference):
    """A 28-token prompt at window 8 (beside a short one, preempting it): the same greedy
    tokens as full-length pages for every layer, and the sequence holds at most
    ceil((8 - 1 + 8) / 4) + 1 = 5 local pages of the 8 blocks it spans."""
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, 28)], [5, 6, 7]]
    samplings = [SamplingConfig(max_new_tokens=4, ignore_eos=True)] * 2
    llm = engine(small_window)
    got, held = run(llm, prompts, samplings)
    assert_no_leaks(llm)
    assert got == run(reference, prompts, samplings)[0]
    assert local_pages_bound(8, 4, 1) < held <= local_pages_bound(8, 4, 8) == 5


@pytest.mark.slow
def test_gemma_window_prompt_of_1500_tokens():
    """Gemma 3's own window: 1,500 tokens at a window of 512 (page 16, chunks of 256), the
    local pool the engine sizes by default: 49 pages per slot (ceil((512 - 1 + 256) / 16) + 1)
    of the 95 the sequence spans; the same greedy tokens as full-length pages (~70 s)."""
    model = gemma_toy(window=512)
    prompts = [[int(t) for t in np.random.default_rng(1).integers(0, VOCAB, 1500)], [5, 6, 7]]
    outs = {}
    for hybrid in (False, True):
        llm = engine(model, hybrid=hybrid, page_size=16, max_seq_len=1520, chunk=256,
                     max_slots=2, num_pages=None, num_local_pages=None)
        outs[hybrid], held = run(llm, prompts, [GREEDY] * 2)
        assert_no_leaks(llm)
    assert outs[True] == outs[False]
    cache = llm.engine.cache_config
    assert (cache.num_local_pages, cache.num_pages) == (2 * 49, 2 * 95)
    assert local_pages_bound(512, 16, 1) == 33 < held <= 49


def test_default_local_pool_is_a_window_per_slot():
    """`CacheConfig.with_pools`: each slot can prefill a chunk inside its window (with the
    speculative rows), never more than the full length or the global pool."""
    model = gemma_toy(window=512).config
    cache = CacheConfig(page_size=16, max_seq_len=2048)
    assert cache.with_pools(model, max_slots=8, chunk_size=256).num_local_pages == 8 * 49
    assert cache.with_pools(model, max_slots=8, chunk_size=256,
                            extra_tokens=4).num_local_pages == 8 * 50
    assert cache.with_pools(model, max_slots=8, chunk_size=1).num_local_pages == 8 * 33
    short = CacheConfig(page_size=16, max_seq_len=256)
    assert short.with_pools(model, max_slots=2, chunk_size=256).num_local_pages == 2 * 16
    off = CacheConfig(page_size=16, max_seq_len=2048, hybrid=False)
    assert off.with_pools(model, max_slots=8, chunk_size=256).num_local_pages is None


@pytest.fixture(scope="module")
def reference(small_window) -> LLM:
    """Full-length pages, no prefix caching: each request run on it alone is a solo run."""
    return engine(small_window, hybrid=False, num_pages=32, enable_prefix_caching=False)


def solo(reference: LLM, prompt, sampling) -> list[list[int]]:
    """The request alone on the reference engine."""
    return run(reference, [prompt], [sampling])[0][0]


def load(rng) -> tuple[list[list[int]], list[SamplingConfig]]:
    """Shared prefixes longer than the window, a forked request (n = 2, seeded), a prompt past
    the window, short ones."""
    shared = [int(t) for t in rng.integers(0, VOCAB, 12)]
    prompts = [shared + [int(t) for t in rng.integers(0, VOCAB, k)] for k in (3, 6, 1)]
    prompts += [[int(t) for t in rng.integers(0, VOCAB, 20)], shared[:9], [7, 8, 9]]
    samplings = [GREEDY] * 6
    samplings[1] = SamplingConfig(max_new_tokens=10, ignore_eos=True, temperature=0.8, seed=5,
                                  n=2)
    return prompts, samplings


def test_load_equals_solo_runs_and_frees_both_pools(small_window, reference):
    """Shared prefixes, a fork, preemption (a global pool of 8 pages for four slots: the
    longest request needs all of them) and an abort on the hybrid pool: every output equals its
    solo run (the aborted one a prefix of it), and both pools are whole again at the end."""
    prompts, samplings = load(np.random.default_rng(2))
    llm = engine(small_window)
    eng = llm.engine
    ids = [eng.add_request(p, s) for p, s in zip(prompts, samplings)]
    for step in range(1000):
        if not eng.has_unfinished():
            break
        if step == 6:
            eng.abort(ids[3])
        eng.step()
        eng.scheduler.check_invariants()
    stats = eng.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0, stats
    assert_no_leaks(llm)
    for rid, prompt, sampling in zip(ids, prompts, samplings):
        got = [c.token_ids for c in eng.results(rid)]
        want = solo(reference, prompt, sampling)
        if rid == ids[3]:
            assert eng.results(rid)[0].finish_reason == "abort"
            assert got[0] == want[0][:len(got[0])]
        else:
            assert got == want, rid


def test_prefix_hit_is_used_only_as_far_as_its_window_is_cached(small_window, reference):
    """6 local pages (window 8, page 4): a 20-token prompt decoding to position 28 needs a
    local page for each of its 8 blocks, and its first two blocks' are evicted for its last.
    A prompt sharing its first 4 blocks uses all 16 tokens (the window of position 16, blocks
    2-3, is cached; blocks 0-1 need only their global pages); then one sharing 2 blocks can use
    none of them (the window of position 8 covers blocks 0-1, whose local pages are gone).
    Both equal their solo runs."""
    rng = np.random.default_rng(3)
    first = [int(t) for t in rng.integers(0, VOCAB, 20)]
    llm = engine(small_window)
    eng = llm.engine
    run(llm, [first], [SamplingConfig(max_new_tokens=10, ignore_eos=True)])
    cache = eng.scheduler.cache
    _, local = cache.match_local(first)
    assert local[:2] == [None, None] and None not in local[2:4], local
    for shared, reused in ((16, 16), (8, 0)):
        prompt = first[:shared] + [int(t) for t in rng.integers(0, VOCAB, 3)]
        assert len(cache.match(prompt)) == shared // 4  # the global tree has every block
        before = eng.scheduler.reused_tokens
        got, _ = run(llm, [prompt], [GREEDY])
        assert eng.scheduler.reused_tokens - before == reused
        assert got == [solo(reference, prompt, GREEDY)]
    assert_no_leaks(llm)


def test_ngram_speculation_on_the_hybrid_pool_equals_plain_greedy(small_window, reference):
    """Verification writes R + 1 rows into the window and rolls back by length: greedy output
    with the n-gram drafter equals greedy output without it."""
    rng = np.random.default_rng(4)
    span = [int(t) for t in rng.integers(0, VOCAB, 4)]
    prompts = [span * 4 + [1, 2], [int(t) for t in rng.integers(0, VOCAB, 10)] + span * 2]
    plain, _ = run(reference, prompts, [GREEDY] * 2)
    llm = engine(small_window, speculative_method="ngram", num_speculative_tokens=3)
    spec, _ = run(llm, prompts, [GREEDY] * 2)
    assert spec == plain
    stats = llm.engine.stats()
    assert stats["spec_verify_calls"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    assert_no_leaks(llm)


# data:2 (both pools split over two data shards: each shard's local table rows may start at
# its trash page) costs ~45 s of sharded compiles: slow set.
@pytest.mark.parametrize("mesh_spec", ["none", pytest.param("data:2", marks=pytest.mark.slow)])
def test_nothing_compiles_after_warmup(small_window, reference, mesh_spec):
    """The load workload on the hybrid pool, on one device and with the pools split over two
    data shards, compiles nothing after `warmup(workload=...)` and gives the outputs of one
    device with full-length pages."""
    prompts, samplings = load(np.random.default_rng(5))
    mesh = None if mesh_spec == "none" else sharding.make_mesh(mesh_spec)
    shards = 1 if mesh is None else mesh.shape["data"]  # each shard: the one-device pools
    llm = engine(small_window, mesh=mesh, num_pages=8 * shards, num_local_pages=6 * shards)
    llm.engine.warmup(workload=list(zip(prompts, samplings)))
    with count_compiles() as compiles:
        got, _ = run(llm, prompts, samplings)
    assert len(compiles) == 0, f"{len(compiles)} compiles after warm-up"
    assert got == run(reference, prompts, samplings)[0]
