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


def engine(model, *, hybrid=True, page_size=4, max_seq_len=64, num_pages=None,
           num_local_pages=None, max_slots=2, chunk=8, mesh=None, **engine_kw) -> LLM:
    cache = CacheConfig(page_size=page_size, max_seq_len=max_seq_len, num_pages=num_pages,
                        hybrid=hybrid, num_local_pages=num_local_pages)
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


# (window, prompt, page size, chunk): a prompt of several windows in CI; the 1,500
# tokens at Gemma 3's window of 512 in the slow set (~70 s of compiles and prefill on 2 cores).
LONG = [(64, 300, 8, 64), pytest.param(512, 1500, 16, 256, marks=pytest.mark.slow)]


@pytest.mark.parametrize("window, prompt_len, page_size, chunk", LONG)
def test_prompt_longer_than_the_window_equals_full_length_pages(window, prompt_len, page_size,
                                                                chunk):
    """The same greedy tokens as full-length pages for every layer, and the local pool the
    engine sizes holds each sequence's window only: at most ceil((window - 1 + chunk) /
    page_size) + 1 pages while prefilling (1,500 at 512: 49 of the 95 pages it spans; 300 at
    64: 17 of 40), ceil(window / page_size) + 1 while decoding."""
    model = gemma_toy(window=window)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, prompt_len)], [5, 6, 7]]
    max_seq_len = prompt_len + 20
    outs = {}
    for hybrid in (False, True):
        llm = engine(model, hybrid=hybrid, page_size=page_size, max_seq_len=max_seq_len,
                     chunk=chunk)
        outs[hybrid], held = run(llm, prompts, [GREEDY] * 2)
        assert_no_leaks(llm)
    assert outs[True] == outs[False]
    cache = llm.engine.cache_config
    bound = local_pages_bound(window, page_size, chunk)
    assert cache.num_local_pages == 2 * bound < cache.num_pages == 2 * cache.pages_per_seq
    assert local_pages_bound(window, page_size, 1) < held <= bound


@pytest.fixture(scope="module")
def reference(small_window) -> LLM:
    """Full-length pages, no prefix caching: each request run on it alone is a solo run."""
    return engine(small_window, hybrid=False, max_slots=4, num_pages=64,
                  enable_prefix_caching=False)


def solo(reference: LLM, prompt, sampling) -> list[list[int]]:
    """The request alone on the reference engine."""
    return run(reference, [prompt], [sampling])[0][0]


def load(rng) -> tuple[list[list[int]], list[SamplingConfig]]:
    """Shared prefixes longer than the window, a forked request (n = 2, seeded), a prompt past
    the window, short ones."""
    shared = [int(t) for t in rng.integers(0, VOCAB, 20)]
    prompts = [shared + [int(t) for t in rng.integers(0, VOCAB, k)] for k in (3, 6, 1)]
    prompts += [[int(t) for t in rng.integers(0, VOCAB, 50)], shared[:9], [7, 8, 9]]
    samplings = [GREEDY] * 6
    samplings[1] = SamplingConfig(max_new_tokens=10, ignore_eos=True, temperature=0.8, seed=5,
                                  n=2)
    return prompts, samplings


def test_load_equals_solo_runs_and_frees_both_pools(small_window, reference):
    """Shared prefixes, a fork, preemption (a global pool of 16 pages for four slots: the
    longest request needs all of them) and an abort on the hybrid pool: every output equals its
    solo run (the aborted one a prefix of it), and both pools are whole again at the end."""
    prompts, samplings = load(np.random.default_rng(2))
    llm = engine(small_window, max_slots=4, num_pages=16)
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
    """One slot and the fewest local pages a sequence needs (5, window 8, page 4): a 24-token
    prompt's first block loses its local page to its own later ones. A prompt sharing its first
    5 blocks uses all 20 tokens (the window of position 20, blocks 3-4, is cached; blocks 0-2
    need only their global pages); then one sharing 2 blocks can use none of them (the window
    of position 8 covers block 0, whose local page is gone). Both equal their solo runs."""
    rng = np.random.default_rng(3)
    first = [int(t) for t in rng.integers(0, VOCAB, 24)]
    llm = engine(small_window, max_slots=1, num_local_pages=5)
    eng = llm.engine
    run(llm, [first], [SamplingConfig(max_new_tokens=1, ignore_eos=True)])
    cache = eng.scheduler.cache
    _, local = cache.match_local(first)
    assert local[0] is None and None not in local[3:5]
    for shared, reused in ((20, 20), (8, 0)):
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
    span = [int(t) for t in rng.integers(0, VOCAB, 5)]
    prompts = [span * 5 + [1, 2], [int(t) for t in rng.integers(0, VOCAB, 30)] + span * 2]
    plain, _ = run(reference, prompts, [GREEDY] * 2)
    llm = engine(small_window, speculative_method="ngram", num_speculative_tokens=3)
    spec, _ = run(llm, prompts, [GREEDY] * 2)
    assert spec == plain
    stats = llm.engine.stats()
    assert stats["spec_verify_calls"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    assert_no_leaks(llm)


@pytest.mark.parametrize("mesh_spec", ["none", "data:2"])
def test_nothing_compiles_after_warmup(small_window, reference, mesh_spec):
    """The load workload on the hybrid pool, on one device and with the pools split over two
    data shards, compiles nothing after `warmup(workload=...)` and gives the outputs of one
    device with full-length pages."""
    prompts, samplings = load(np.random.default_rng(5))
    mesh = None if mesh_spec == "none" else sharding.make_mesh(mesh_spec)
    llm = engine(small_window, max_slots=4, num_pages=32, mesh=mesh)
    llm.engine.warmup(workload=list(zip(prompts, samplings)))
    with count_compiles() as compiles:
        got, _ = run(llm, prompts, samplings)
    assert len(compiles) == 0, f"{len(compiles)} compiles after warm-up"
    assert got == run(reference, prompts, samplings)[0]
