"""The serving engine end to end on toy models: a 300-request randomized load (shared prefixes,
aborts, page pressure that forces preemption) where every greedy output equals the same
request's on an engine that can neither share nor preempt; prefix caching on == off; any chunk
size == one-shot prefill; nothing compiles after warm-up; aborts free pages at once; bad
requests fail alone; seeded sampling and penalties under preemption equal each request run
alone; streaming adds up. (The real default model runs on the engine in
tests/test_hf_reference.py.)
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import numpy as np
import pytest

from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.llm import LLM
from jaxinfer.model import Llama, init_params
from tests import reference_llama
from tests.helpers import count_compiles, toy_config

VOCAB = 96
# One pool for every engine here (so they all run the same compiled steps): 40 pages of 4
# tokens, small enough that requests running together get preempted, and each request alone
# fits (at most 96 tokens = 24 pages).
CACHE = CacheConfig(page_size=4, max_seq_len=96, num_pages=40)
BUCKETS = (8, 16, 32)


def engine_config(**kw) -> EngineConfig:
    base = dict(max_slots=4, prefill_buckets=BUCKETS, max_num_batched_tokens=40,
                prefill_chunk_size=16)
    base.update(kw)
    return EngineConfig(**base)


CONFIG = toy_config(vocab_size=VOCAB, max_position=128)


@pytest.fixture(scope="module")
def params() -> dict:
    params = init_params(CONFIG, seed=5, scale=0.3)
    # Sharper logits (a larger head) keep greedy choices far from ties, so the ~1e-6 float
    # differences between batch shapes never flip an argmax.
    params["lm_head"] *= 8.0
    return params


@pytest.fixture(scope="module")
def model(params) -> Llama:
    return Llama(CONFIG, params)


def greedy(n: int, **kw) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=n, ignore_eos=True, **kw)


def run_alone(model, requests, *, results: bool = False) -> list:
    """Each (prompt, sampling) by itself on a fresh-state engine: no sharing, no preemption.
    Token ids, or with `results` the whole Completions."""
    eng = Engine(model, None, cache=CACHE, engine=engine_config(enable_prefix_caching=False))
    out = []
    for prompt, sc in requests:
        rid = eng.add_request(prompt, sc)
        eng.run()
        out.append(eng.result(rid) if results else eng.result(rid).token_ids)
        eng.forget(rid)
    return out


def run_unshared(model, requests) -> list[list[int]]:
    """The (prompt, sampling) requests on a fresh engine that can neither share pages (prefix
    caching off) nor preempt: in waves of at most 4 whose pages fit the pool together. Greedy
    outputs that sharing, preemption and aborts elsewhere must not change."""
    llm = LLM(model, None, cache=CACHE, engine=engine_config(enable_prefix_caching=False))
    waves, wave, pages = [], [], 0
    for i, (prompt, sc) in enumerate(requests):
        need = -(-(len(prompt) + sc.max_new_tokens) // CACHE.page_size)
        if len(wave) == 4 or pages + need > CACHE.num_pages:
            waves.append(wave)
            wave, pages = [], 0
        wave.append(i)
        pages += need
    waves.append(wave)
    out = [None] * len(requests)
    for wave in waves:
        results = llm.generate([requests[i][0] for i in wave], [requests[i][1] for i in wave],
                               use_tqdm=False)
        for i, r in zip(wave, results):
            out[i] = r.token_ids
    assert llm.engine.stats()["preemptions"] == 0
    return out


def make_workload(seed: int, n: int):
    rng = np.random.default_rng(seed)
    prefixes = [list(rng.integers(0, VOCAB, int(k))) for k in (8, 13, 24, 40)]
    requests = []
    for _ in range(n):
        prompt = []
        if rng.random() < 0.6:
            prompt = list(prefixes[rng.integers(len(prefixes))])
        prompt += list(rng.integers(0, VOCAB, int(rng.integers(1, 30))))
        requests.append(([int(t) for t in prompt], greedy(int(rng.integers(1, 25)))))
    return requests


def test_randomized_load_300_requests(model):
    requests = make_workload(seed=1, n=300)
    eng = Engine(model, None, cache=CACHE, engine=engine_config())
    eng.warmup()
    rng = np.random.default_rng(2)
    ids, aborted, pending = [], set(), list(range(len(requests)))
    with count_compiles() as compiles:
        while pending or eng.has_unfinished():
            for _ in range(int(rng.poisson(1.2))):  # arrivals
                if pending:
                    prompt, sc = requests[pending.pop(0)]
                    ids.append(eng.add_request(prompt, sc))
            if ids and rng.random() < 0.03:  # an abort of a random request, in any state
                victim = ids[int(rng.integers(len(ids)))]
                if not eng.scheduler.requests[victim].finished:
                    eng.abort(victim)
                    aborted.add(victim)
            eng.step()
            eng.scheduler.check_invariants()
    assert len(compiles) == 0, f"{len(compiles)} compiles after warm-up"
    stats = eng.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0, stats
    assert stats["running"] == stats["waiting"] == 0
    sched = eng.scheduler
    assert sched.pool.num_available() == sched.config.num_pages  # no page leaked
    assert sorted(sched.free_slots) == list(range(4))
    assert len(ids) == 300 and len(aborted) >= 5
    results = [eng.result(rid) for rid in ids]
    unshared = run_unshared(model, requests)
    for rid, res, (_, sc), want in zip(ids, results, requests, unshared):
        if rid in aborted:
            assert res.finish_reason == "abort"
            assert res.token_ids == want[:len(res.token_ids)]
        else:
            assert res.finish_reason == "length" and len(res.token_ids) == sc.max_new_tokens
            assert res.token_ids == want, rid
    assert sum(r.metrics.num_preemptions for r in results) == stats["preemptions"]
    # Preemptions per request: admission leaves the running requests their pages, so none
    # thrashes (here 25 preemptions among the 300 requests, at most two of one request).
    preempted = collections.Counter(r.metrics.num_preemptions for r in results)
    assert max(preempted) <= 2 and stats["preemptions"] <= 40, preempted
    assert sum(r.metrics.prompt_reused for r in results) > 0


def test_prefix_caching_on_equals_off_and_is_hit(model):
    requests = make_workload(seed=3, n=24)
    outs, computed = {}, {}
    for on in (False, True):
        llm = LLM(model, None, cache=CACHE, engine=engine_config(enable_prefix_caching=on))
        res = llm.generate([p for p, _ in requests], [sc for _, sc in requests], use_tqdm=False)
        outs[on] = [r.token_ids for r in res]
        stats = llm.engine.stats()
        if on:
            assert stats["prefix_hits"] > 0 and stats["reused_tokens"] > 0
            assert stats["computed_tokens"] < computed[False]
            # Rows reused on recompute after a preemption may be earlier outputs, not prompt.
            assert 0 < sum(r.metrics.prompt_reused for r in res) <= stats["reused_tokens"]
        else:
            assert stats["prefix_hits"] == 0
        computed[on] = stats["computed_tokens"]
    assert outs[True] == outs[False]


@pytest.mark.parametrize("chunk", [1, 3, 8, 16])
def test_any_chunk_size_equals_one_shot_prefill(model, chunk):
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, n)] for n in (1, 5, 17, 31, 32)]
    want = run_alone(model, [(p, greedy(6)) for p in prompts])  # chunk 16: a 32 prompt = 2
    one_shot = LLM(model, None, cache=CACHE,
                   engine=engine_config(prefill_chunk_size=32, max_num_batched_tokens=64))
    assert [r.token_ids for r in one_shot.generate(prompts, greedy(6), use_tqdm=False)] == want
    llm = LLM(model, None, cache=CACHE, engine=engine_config(prefill_chunk_size=chunk))
    got = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert [r.token_ids for r in got] == want
    assert llm.engine.num_calls >= sum(-(-len(p) // chunk) for p in prompts)


def test_chunks_ride_with_decodes_under_the_budget(model):
    """A long prompt arriving while others decode is computed in chunks beside their decodes."""
    eng = Engine(model, None, cache=CACHE,
                 engine=engine_config(prefill_chunk_size=8, max_num_batched_tokens=12))
    for _ in range(3):
        eng.add_request([1, 2, 3], greedy(20))
    for _ in range(3):
        eng.step()
    eng.add_request(list(range(40)), greedy(2))
    mixed = 0
    while eng.has_unfinished():
        eng.step()
        if eng._inflight is not None:  # the schedule of the step just dispatched
            s = eng._inflight.schedule
            assert s.num_tokens <= 12
            assert all(c.num_tokens <= 8 for c in s.chunks)
            mixed += bool(s.decodes and s.prefills)
    assert mixed >= 3


def test_abort_frees_pages_at_once_and_others_continue(model):
    eng = Engine(model, None, cache=CACHE, engine=engine_config())
    a = eng.add_request(list(range(30)), greedy(40))
    b = eng.add_request(list(range(5, 25)), greedy(10))
    for _ in range(4):
        eng.step()
    used = eng.scheduler.pool.num_used()
    held = len(eng.scheduler.requests[a].pages)
    assert held > 0
    eng.abort(a)
    assert eng.scheduler.pool.num_used() == used - held
    eng.run()
    assert eng.result(a).finish_reason == "abort"
    assert eng.result(b).finish_reason == "length"
    assert eng.result(b).token_ids == run_alone(model, [(list(range(5, 25)), greedy(10))])[0]
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        eng.abort("nope")


def test_bad_requests_are_rejected_at_add_and_fail_alone(model):
    small = Engine(model, None, cache=dataclasses.replace(CACHE, num_pages=10),
                   engine=engine_config())
    with pytest.raises(ValueError, match="can never fit.*40 tokens.*at most 40"):
        small.add_request(list(range(40)), greedy(2))  # 41 rows > 10 pages x 4
    eng = Engine(model, None, cache=CACHE, engine=engine_config())
    good = eng.add_request([1, 2, 3], greedy(5))
    with pytest.raises(ValueError, match="exceeds the context of 96"):
        eng.add_request(list(range(90)), greedy(10))
    with pytest.raises(ValueError, match=f"token id {VOCAB} out of range"):
        eng.add_request([1, VOCAB], greedy(2))
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request([], greedy(2))
    with pytest.raises(ValueError, match="text prompt needs a tokenizer"):
        eng.add_request("hello", greedy(2))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([4], greedy(2), request_id=good)

    class Exploding:
        def push(self, token):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

        def flush(self):
            return ""

    bad = eng.add_request([7, 8], greedy(5))
    eng.scheduler.requests[bad].detokenizer = Exploding()
    eng.run()
    assert eng.result(good).finish_reason == "length"
    assert len(eng.result(good).token_ids) == 5
    res = eng.result(bad)
    assert res.finish_reason == "error" and "UnicodeDecodeError" in res.error
    assert eng.scheduler.pool.num_used() == 0


def test_llm_generate_reports_bad_prompts_per_request(model):
    llm = LLM(model, None, cache=CACHE, engine=engine_config())
    res = llm.generate([[1, 2], [VOCAB + 5], [3]], greedy(3), use_tqdm=False,
                       raise_on_error=False)
    assert [r.finish_reason for r in res] == ["length", "error", "length"]
    assert "out of range" in res[1].error
    with pytest.raises(ValueError, match="prompt 1: token id"):
        llm.generate([[1, 2], [VOCAB + 5]], greedy(3), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_sampling_and_penalties_under_preemption_equal_each_request_alone(model):
    """Per-row seeds, top-k/p and penalties (which bypass the prefix cache), six requests
    sharing a pool small enough to preempt (preemption recomputes penalty state), give each
    request's tokens run alone on a fresh engine."""
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, n)] for n in (3, 12, 20, 7, 26, 9)]
    configs = [
        greedy(32, temperature=0.9, seed=1, logprobs=True),
        greedy(32, temperature=1.0, top_k=8, seed=2),
        greedy(32, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3),
        greedy(32, temperature=0.7, top_p=0.8, seed=3, frequency_penalty=1.0),
        greedy(32),
        greedy(32, temperature=1.3, min_p=0.05, seed=4, repetition_penalty=1.2),
    ]
    want = run_alone(model, list(zip(prompts, configs)), results=True)
    llm = LLM(model, None, cache=CACHE, engine=engine_config(prefill_chunk_size=8))
    got = llm.generate(prompts, configs, use_tqdm=False)
    assert llm.engine.stats()["preemptions"] > 0
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    np.testing.assert_allclose(got[0].logprobs, want[0].logprobs, rtol=1e-4, atol=1e-5)


def penalized_greedy_reference(params, prompt: list[int], n: int, *, repetition: float,
                               presence: float, prompt_seen: int | None = None) -> list[int]:
    """`n` greedy tokens of a plain loop: the float64 numpy forward over the whole sequence
    (`tests.reference_llama`), then the penalties applied in numpy: seen tokens (the outputs
    and the first `prompt_seen` prompt tokens, None: all) x repetition if < 0 else
    / repetition; every generated token - presence."""
    seq, out = list(prompt), []
    for _ in range(n):
        logits = reference_llama.forward(CONFIG, params, seq)[-1]
        seen = np.zeros(VOCAB, bool)
        seen[prompt[:prompt_seen] + out] = True
        logits = np.where(seen, np.where(logits < 0, logits * repetition, logits / repetition),
                          logits)
        logits = logits - presence * np.isin(np.arange(VOCAB), out)
        out.append(int(np.argmax(logits)))
        seq.append(out[-1])
    return out


def test_penalties_over_a_prompt_in_chunks_of_two_buckets_equal_a_numpy_reference(
        model, params):
    """Repetition and presence penalties on a prompt prefilled as a 16-token and a 5-token
    chunk (buckets 16 and 8; a chunk's tokens enter its slot's penalty state through the
    forward's `ChunkPenalty`): the engine's greedy tokens equal a numpy loop applying the
    penalties itself, and differ from the loop without penalties, or with no prompt token or
    only the first chunk's seen."""
    # Random but for token 18, the unpenalized first sample (67): seen only through the
    # second chunk.
    prompt = [45, 49, 72, 91, 3, 13, 79, 91, 23, 29, 83, 40, 26, 79, 24, 39, 18, 1, 67, 2, 83]
    eng = Engine(model, None, cache=CACHE, engine=engine_config(enable_prefix_caching=False))
    rid = eng.add_request(prompt, greedy(12, repetition_penalty=3.0, presence_penalty=2.0))
    eng.run()
    got = eng.result(rid).token_ids
    reference = functools.partial(penalized_greedy_reference, params, prompt, 12)
    assert got == reference(repetition=3.0, presence=2.0)
    for other in (reference(repetition=1.0, presence=0.0),
                  reference(repetition=3.0, presence=2.0, prompt_seen=0),
                  reference(repetition=3.0, presence=2.0, prompt_seen=16)):
        assert got[0] != other[0], (got, other)  # the second chunk's sample already differs


def test_streaming_yields_every_token_in_order(model):
    eng = Engine(model, None, cache=CACHE, engine=engine_config())
    ids = [eng.add_request([1 + i, 2, 3], greedy(5 + i)) for i in range(6)]
    seen = {rid: [] for rid in ids}
    finished = []
    for out in eng.stream():
        seen[out.request_id].append(out.token_id)
        if out.finished:
            finished.append(out.request_id)
            assert out.finish_reason == "length"
    assert sorted(finished) == sorted(ids)
    for rid in ids:
        assert seen[rid] == eng.result(rid).token_ids


def test_metrics_are_recorded(model):
    llm = LLM(model, None, cache=CACHE, engine=engine_config())
    res = llm.generate([[1, 2, 3], list(range(20))], greedy(6), use_tqdm=False)
    for r in res:
        m = r.metrics
        assert len(m.token_times) == 6 and m.ttft > 0 and m.e2e >= m.ttft
        assert len(m.itl) == 5 and m.tpot > 0
    assert res[1].metrics.prompt_computed == 20
    stats = llm.engine.stats()
    assert stats["input_tokens"] == 23 and stats["output_tokens"] == 12
    assert stats["output_throughput"] > 0
    from jaxinfer.perf.metrics import serving_summary

    s = serving_summary([r.metrics for r in res], [3, 20], duration_s=1.0)
    assert s["completed"] == 2 and s["total_output_tokens"] == 12
    assert s["p50_ttft_ms"] <= s["p99_ttft_ms"] and s["output_throughput"] == 12.0


# ----- n samples of one prompt (forks) ---------------------------------------------------------
def _independent(model, prompt, sc, n):
    """The n samples as n separate requests (seeds seed + i), each on a fresh engine."""
    out = []
    for i in range(n):
        eng = Engine(model, None, cache=CACHE, engine=engine_config(enable_prefix_caching=False))
        rid = eng.add_request(prompt, SamplingConfig(**{**sc.__dict__, "n": 1,
                                                        "seed": sc.seed + i}))
        eng.run()
        out.append(eng.result(rid).token_ids)
    return out


@pytest.mark.parametrize("prompt_len,max_slots", [(42, 8), (41, 8), (42, 4), (41, 4)])
def test_n_samples_share_one_prefill_and_equal_independent_requests(model, prompt_len,
                                                                    max_slots):
    """41 tokens fill no partial page. With 8 slots, all 6 samples fan out of the parent's last
    chunk (the prompt is computed once, nothing more); with 4, the parent holds one slot, 3 fan
    out and 3 compute their last prompt token later."""
    rng = np.random.default_rng(prompt_len)
    prompt = [int(t) for t in rng.integers(0, VOCAB, prompt_len)]
    sc = SamplingConfig(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=7, n=6)
    eng = Engine(model, None, cache=CACHE, engine=engine_config(max_slots=max_slots))
    rid = eng.add_request(prompt, sc)
    eng.run()
    samples = [eng.result(s) for s in eng.sample_ids(rid, 6)]
    assert [s.token_ids for s in samples] == _independent(model, prompt, sc, 6)
    assert len({tuple(s.token_ids) for s in samples}) > 1  # different seeds, different samples
    late = max(0, 6 - (max_slots - 1))  # samples that found no slot when the prompt was done
    s = eng.stats()
    decode_rows = sum(len(x.token_ids) - 1 for x in samples)
    assert s["computed_tokens"] - decode_rows == prompt_len + late
    assert [x.metrics.prompt_computed for x in samples] == (
        [prompt_len] + [0] * (5 - late) + [1] * late)
    assert sum(x.metrics.prompt_computed for x in samples) == prompt_len + late
    eng.scheduler.check_invariants()
    assert eng.scheduler.pool.num_available() == eng.scheduler.config.num_pages
    assert f"{rid}/prefill" not in eng.scheduler.requests  # the parent is internal


def test_n_samples_under_preemption_with_other_requests(model):
    """Forks beside ordinary requests in a pool that forces preemption; every output equals its
    independent run, and the pool is whole again at the end."""
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, k)] for k in (30, 23, 37)]
    scs = [SamplingConfig(max_new_tokens=40, ignore_eos=True, temperature=0.8, seed=3, n=5),
           SamplingConfig(max_new_tokens=32, ignore_eos=True),
           SamplingConfig(max_new_tokens=28, ignore_eos=True, temperature=1.1, seed=9, n=3)]
    llm = LLM(model, None, cache=CACHE, engine=engine_config())
    got = [r.token_ids for r in llm.generate(prompts, scs, use_tqdm=False)]
    expected = []
    for p, sc in zip(prompts, scs):
        expected += _independent(model, p, sc, sc.n)
    assert got == expected
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    sched.check_invariants()
    assert sched.pool.num_available() == CACHE.num_pages and not sched.forking


def test_the_id_add_request_returns_names_every_sample(model):
    eng = Engine(model, None, cache=CACHE, engine=engine_config())
    rid = eng.add_request(list(range(1, 20)), SamplingConfig(max_new_tokens=6, n=3))
    other = eng.add_request([5, 6, 7], greedy(4))
    eng.step()
    with pytest.raises(ValueError, match="has not finished"):
        eng.results(rid)
    with pytest.raises(ValueError, match="has not finished"):
        eng.result(other)
    with pytest.raises(ValueError, match="3 samples: results"):
        eng.result(rid)
    eng.abort(rid)  # every sample and the prefill parent
    eng.run()
    assert [c.finish_reason for c in eng.results(rid)] == ["abort"] * 3
    assert eng.result(f"{rid}/1").finish_reason == "abort"
    assert eng.result(other).finish_reason == "length"
    assert eng.scheduler.pool.num_available() == CACHE.num_pages
    eng.forget(rid)
    with pytest.raises(ValueError, match="unknown request id"):
        eng.results(rid)
    with pytest.raises(ValueError, match="unknown request id"):
        eng.result(f"{rid}/0")
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([1, 2], greedy(2), request_id=f"{other}")
    with pytest.raises(ValueError, match="request_id=3 must be a non-empty string"):
        eng.add_request([1, 2], greedy(2), request_id=3)


def test_bad_types_fail_alone_with_a_value_error(model):
    eng = Engine(model, None, cache=CACHE, engine=engine_config())
    good = eng.add_request([1, 2, 3], greedy(4))
    for prompt, match in ((None, "prompt must be a string or a list of token ids"),
                          (42, "got int 42"), (b"hi", "got bytes"),
                          ({"prompt": "x"}, "got dict"), ([1.0, 2], "token id 1.0 .float."),
                          ([True], "token id True")):
        with pytest.raises(ValueError, match=match):
            eng.add_request(prompt, greedy(2))
    for sampling, match in (({"temperature": "hot"}, "temperature='hot' must be a number"),
                            ({"max_new_tokens": 8.7}, "max_new_tokens=8.7 must be an integer"),
                            ({"tempreature": 1}, "unknown key tempreature"),
                            ("greedy", "must be a SamplingConfig or a mapping")):
        with pytest.raises(ValueError, match=match):
            eng.add_request([1, 2], sampling)
    mapped = eng.add_request([1, 2, 3], {"max_new_tokens": 4, "stop": "x", "ignore_eos": True})
    assert eng.scheduler.requests[mapped].params == greedy(4, stop=("x",))
    eng.run()
    assert eng.result(good).token_ids == eng.result(mapped).token_ids


def test_aborting_every_sample_releases_the_parent(model):
    eng = Engine(model, None, cache=CACHE, engine=engine_config())
    rid = eng.add_request(list(range(1, 30)), SamplingConfig(max_new_tokens=8, n=4))
    eng.step()  # the parent starts its prefill
    for sid in eng.sample_ids(rid, 4):
        eng.abort(sid)
    eng.run()
    sched = eng.scheduler
    assert not sched.forking and not sched.waiting and not sched.running
    assert sched.pool.num_available() == sched.config.num_pages
    with pytest.raises(ValueError, match="n=0"):
        SamplingConfig(n=0)


def test_prompt_logprobs_equal_a_plain_forward_and_warm_up_compiles_them(model):
    """Prompt logprobs through 16-token chunks beside other requests, after the prompt's
    prefix was cached by an earlier request (the scored request must not take that hit: every
    position has its logprob) and under page pressure
    (preemption): each position's logprob and top-2 equal a log_softmax of one plain forward
    of the whole prompt; after `warmup(prompt_logprobs=True)` nothing compiles."""
    from jaxinfer.proof import accuracy

    rng = np.random.default_rng(11)
    prompt = [int(t) for t in rng.integers(0, VOCAB, 45)]
    others = [([int(t) for t in rng.integers(0, VOCAB, n)], greedy(30)) for n in (40, 30, 20)]
    llm = LLM(model, None, cache=CACHE, engine=engine_config(max_top_logprobs=2))
    llm.engine.warmup(max_len=96, prompt_logprobs=True)
    with count_compiles() as compiles:
        llm.generate([prompt[:33]], greedy(2), use_tqdm=False)  # caches the prefix's pages
        assert len(llm.engine.scheduler.cache.match(prompt)) == 8
        outs = llm.generate([prompt] + [p for p, _ in others],
                            [greedy(3, prompt_logprobs=2)] + [sc for _, sc in others],
                            use_tqdm=False)
    assert len(compiles) == 0, compiles
    assert llm.engine.stats()["preemptions"] > 0
    logits = np.asarray(accuracy._Stream(model, len(prompt), 16, None).logits(
        np.asarray(prompt), 0), np.float64)
    ref = logits - logits.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    got = outs[0]
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(prompt)
    np.testing.assert_allclose(got.prompt_logprobs[1:],
                               ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
    for pos in range(1, len(prompt)):
        top = dict(got.prompt_top_logprobs[pos])  # (token, logprob) pairs
        best = np.argsort(-ref[pos - 1])[:2]
        assert set(top) == {int(t) for t in best}, pos
        np.testing.assert_allclose([top[int(t)] for t in best], ref[pos - 1, best], atol=1e-4)
