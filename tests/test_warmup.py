"""Warm-up (`jaxinfer.engine.warmup`, `jaxinfer.engine.precompile`): the concurrent warm-up
compiles the executables the serial one does, each once, and serving then compiles nothing; a
server answers a request that arrives while its warm-up still compiles the variant it needs; a
second process with the same config reads every executable back from the persistent
compilation cache; the common variants are what one request on an idle engine uses."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
from jaxinfer.engine import precompile, steps
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.llm import load_llm
from jaxinfer.engine.warmup import common_variants, plan, planned_variants, step_variants
from jaxinfer.model import Llama, init_params
from tests.helpers import count_compiles, serving, tiny_smollm_dir, toy_config

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 64


@pytest.fixture(scope="module")
def model() -> Llama:
    config = toy_config(vocab_size=VOCAB, max_position=64)
    return Llama(config, init_params(config, seed=3, scale=0.3))


def build(model, method: str = "none", max_seq_len: int = 16,
          min_bucket_pages: int | None = None) -> Engine:
    """3 chunk buckets (0, 8, 16) x 2 page buckets (1, 2 at 16 tokens) of mixed_step; with a
    drafter, R = 2. The toy's weights are small beside its KV: the automatic page-bucket floor
    is 1 page."""
    return Engine(model, None, cache=CacheConfig(page_size=8, max_seq_len=max_seq_len,
                                                 min_bucket_pages=min_bucket_pages),
                  engine=EngineConfig(max_slots=2, prefill_buckets=(8, 16),
                                      max_num_batched_tokens=18, speculative_method=method,
                                      num_speculative_tokens=2))


def requests():
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, k)] for k in (5, 12, 3)]
    configs = [SamplingConfig(max_new_tokens=9, ignore_eos=True),
               SamplingConfig(max_new_tokens=4, ignore_eos=True, temperature=0.9, seed=2, n=2),
               SamplingConfig(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.2)]
    return prompts, configs


def test_precompiler_compiles_each_executable_once_whoever_asks():
    pc = precompile.Precompiler()
    double = jax.jit(lambda x: x * 2)
    device = jax.devices()[0]
    spec = jax.ShapeDtypeStruct((5,), jnp.float32,
                                sharding=jax.sharding.SingleDeviceSharding(device))
    with count_compiles() as compiles:
        threads = [threading.Thread(target=pc.compile, args=(double, spec)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        x = jax.device_put(np.arange(5, dtype=np.float32), device)
        np.testing.assert_array_equal(pc.guarded(double, x), np.arange(5) * 2)
    assert len(compiles) == 1 and pc.compiled == ["<lambda>"], (compiles, pc.compiled)


def test_a_step_waits_for_the_executable_another_thread_is_compiling():
    """A warm-up thread is inside the compile of an executable (held in its trace); the
    engine's guarded call for the same executable waits for it instead of compiling it again,
    and runs once it is compiled."""
    pc = precompile.Precompiler()
    tracing, release = threading.Event(), threading.Event()

    def slow_double(x):
        tracing.set()
        release.wait()
        return x * 2

    f = jax.jit(slow_double)
    device = jax.devices()[0]
    x = jax.device_put(np.arange(4, dtype=np.float32), device)
    out = []
    with count_compiles() as compiles:
        warm = threading.Thread(target=pc.compile, args=(f, precompile.abstract(x)))
        warm.start()
        assert tracing.wait(60)
        step = threading.Thread(target=lambda: out.append(pc.guarded(f, x)))
        step.start()
        step.join(0.5)
        assert step.is_alive() and not out  # waiting for the warm-up thread's compile
        release.set()
        warm.join(60)
        step.join(60)
    np.testing.assert_array_equal(out[0], np.arange(4) * 2)
    assert len(compiles) == 1 and pc.compiled == ["slow_double"], (compiles, pc.compiled)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_cancelled_warmup_stops_and_the_rest_compiles_when_used(model, workers):
    """`cancelled` turning true after the first asks stops warm-up there (fewer variants than
    the plan; a concurrent one reports itself not ready, skips the rest and calls no
    `on_done`); the skipped variants compile when a request first needs them, and the tokens
    are those of an engine warmed up fully."""
    jax.clear_caches()
    asked = []

    def cancelled():
        asked.append(1)
        return len(asked) > 2

    eng, done = build(model), []
    total = len(step_variants(eng))
    if workers == 1:
        assert eng.warmup(workers=1, cancelled=cancelled) == 2 < total
    else:
        warm = eng.start_warmup(common_len=16, workers=workers, cancelled=cancelled,
                                on_done=lambda: done.append(1))
        assert warm.wait() is False and warm.skipped > 0 and warm.done
        assert warm.num_compiled_variants < warm.num_variants and done == []
        assert eng.runner.call is steps.run  # nothing left to wait for
    prompts, configs = requests()
    ids = [eng.add_request(p, sc) for p, sc in zip(prompts, configs)]
    eng.run()
    full = build(model)
    full.warmup(workers=1)
    full_ids = [full.add_request(p, sc) for p, sc in zip(prompts, configs)]
    full.run()
    assert ([c.token_ids for i in ids for c in eng.results(i)]
            == [c.token_ids for i in full_ids for c in full.results(i)])


def test_a_page_bucket_floor_drops_small_decode_variants_but_no_token(model):
    """min_bucket_pages=2: every decode step reads 2 pages however short its rows, so the
    1-page decode variant is gone; a prompt chunk keeps its own bucket (its rows attend over
    it); serving compiles nothing past the warm-up and gives the tokens of the floorless
    engine."""
    floorless, floored = build(model), build(model, min_bucket_pages=2)
    assert floorless.cache_config.min_bucket_pages == 1  # the automatic floor of the toy
    assert step_variants(floorless) == [(0, 1), (0, 2), (8, 1), (8, 2), (16, 2)]
    assert step_variants(floored) == [(0, 2), (8, 1), (8, 2), (16, 2)]
    prompts, configs = requests()
    tokens = []
    for eng in (floorless, floored):
        eng.warmup(workers=1)
        with count_compiles() as compiles:
            ids = [eng.add_request(p, sc) for p, sc in zip(prompts, configs)]
            eng.run()
        assert not compiles, compiles
        tokens.append([c.token_ids for i in ids for c in eng.results(i)])
    assert tokens[0] == tokens[1]


def test_a_known_workload_compiles_the_page_copy_only_if_it_forks(model):
    """The forks' page copy (a sample of n > 1 copies its parent's partial page) is in the
    plan of every workload, unless a known one never forks."""
    eng = build(model)
    alone = [([1, 2, 3], SamplingConfig(max_new_tokens=4))]
    forked = [([1, 2, 3], SamplingConfig(max_new_tokens=4, n=2))]
    assert not plan(eng, workload=alone).copies
    assert plan(eng, workload=forked).copies and plan(eng).copies


def _name(fun_name: str) -> str:
    return fun_name.removeprefix("jit(").removesuffix(")")


EXIT_WHILE_COMPILING = """
import threading, time
import jax, jax.numpy as jnp
from jaxinfer.engine.precompile import Precompiler, Warmup

def heavy(x):
    for i in range(60):
        x = jnp.sin(x @ x.T)[: x.shape[0]] * (i + 1) + jnp.cos(x)
    return x

pc, f = Precompiler(), jax.jit(heavy)
tasks = [lambda n=n: pc.compile(f, jax.ShapeDtypeStruct((n, n), jnp.float32))
         for n in range(8, 11)]
starter = threading.Thread(daemon=True, target=lambda: print(
    "daemons:", any(t.daemon for t in Warmup(tasks, precompiler=pc, runners=[],
                                             workers=2)._threads), flush=True))
starter.start()
starter.join()
time.sleep(0.3)
"""


def test_an_exit_while_compiling_waits_for_the_compiles_under_way():
    """A warm-up started by a daemon thread (a server's engine thread) runs on threads that
    are not daemons, so an interpreter exit while XLA compiles waits for those compiles (an
    exit that tears jax down under them aborts the process)."""
    proc = subprocess.run([sys.executable, "-c", EXIT_WHILE_COMPILING], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "daemons: False" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("method", ["none", "self"])
def test_concurrent_warmup_compiles_what_serial_does_once_each(model, method):
    """The same executables (by function, counted) and the same variant count, serially and on
    3 threads, one `mixed_sample` for all 3 chunk buckets; then a workload with forks,
    penalties and (with the self-drafter) verification and drafts compiles nothing, and gives
    the serially warmed engine's tokens."""
    made, tokens = {}, {}
    prompts, configs = requests()
    for workers in (1, 3):
        jax.clear_caches()  # the second warm-up must compile again (or read the disk cache)
        eng = build(model, method)
        with count_compiles() as compiles:
            n = eng.warmup(workers=workers)
        made[workers] = (n, collections.Counter(map(_name, compiles)))
        # every executable compiled has also run once (jit's fast path holds it), so the
        # first request does not pay a first run's costs
        assert steps.mixed_forward._cache_size() == made[workers][1]["mixed_forward"], workers
        with count_compiles() as after:
            ids = [eng.add_request(p, sc) for p, sc in zip(prompts, configs)]
            eng.run()
        assert after == [], f"{workers} workers: compiled {after} after warm-up"
        tokens[workers] = [c.token_ids for i in ids for c in eng.results(i)]
    assert made[1] == made[3], made
    # each variant once: 3 chunk x 2 page buckets but (16, 1) (a 16-token chunk holds 9+
    # tokens: 2 pages); the self-drafter's target decodes in verify_step, so only the 3 chunk
    # variants, and its draft model mirrors them
    assert made[1][1]["mixed_forward"] == {"none": 5, "self": 6}[method], made
    # the sampling takes no input of the chunk's length: one executable for every chunk bucket
    assert made[1][1]["mixed_sample"] == 1, made
    assert tokens[1] == tokens[3]


def test_common_variants_are_what_one_request_uses(model):
    """Every variant a lone request of up to 24 tokens uses (the scheduler's dry run) is
    common, and nothing else is."""
    eng = build(model, max_seq_len=32)
    used = set()
    for prompt_len in range(1, 24):
        for total in range(prompt_len + 1, 25):
            used |= set(planned_variants(eng, [(
                [1] * prompt_len,
                SamplingConfig(max_new_tokens=total - prompt_len, ignore_eos=True))]))
    assert used == set(common_variants(eng, 24)), (used, common_variants(eng, 24))


def test_step_variants_cover_every_workload_and_no_impossible_chunk(model):
    """Random batches of requests (shared prefixes, forks, any lengths) use only variants
    `step_variants` lists; it lists no chunk bucket at a page bucket too small for a chunk
    that needs that bucket."""
    eng = build(model, max_seq_len=32)
    listed = set(step_variants(eng))
    rng = np.random.default_rng(5)
    for _ in range(40):
        workload = []
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(1, 30))
            workload.append(([int(t) for t in rng.integers(0, 4, n)], SamplingConfig(
                max_new_tokens=int(rng.integers(1, 33 - n)), ignore_eos=True,
                n=int(rng.integers(1, 3)), temperature=1.0)))
        assert set(planned_variants(eng, workload)) <= listed
    assert (16, 1) not in listed and (8, 1) in listed and (16, 2) in listed  # 9+ tokens: 2 pages


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return tiny_smollm_dir(str(tmp_path_factory.mktemp("tiny-smollm")))


def test_server_answers_a_request_that_needs_a_variant_still_to_compile(tiny_dir, monkeypatch):
    """The server is ready once one short request's variants are compiled; the background
    threads are then held before each further compile, so a longer request arriving now
    needs variants no thread has compiled: it is answered correctly (as by the warmed-up
    engine offline, afterwards), and every executable is compiled once, by whichever thread
    asked first."""
    llm = load_llm(RunConfig(model_path=tiny_dir,
                             cache=CacheConfig(max_seq_len=64, min_bucket_pages=1),
                             engine=EngineConfig(max_slots=2, prefill_buckets=(16, 32),
                                                 max_num_batched_tokens=40)))
    engine = llm.engine
    held = threading.Event()
    compile_once = precompile.Precompiler.compile

    def compile_held(self, fn, *args, **kwargs):
        if threading.current_thread().name.startswith("jaxinfer-warmup") and held.is_set():
            release.wait()
        return compile_once(self, fn, *args, **kwargs)

    release = threading.Event()
    monkeypatch.setattr(precompile.Precompiler, "compile", compile_held)
    prompt = "Count from one to twenty: one, two, three, four, five, six, seven, eight"
    with count_compiles() as compiles:
        warm = engine.start_warmup(common_len=16, workers=2)
        warm.wait(warm.ready)
        held.set()
        assert not warm.done
        with serving(engine) as (url, _):
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "test", "prompt": prompt, "max_tokens": 10, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert not warm.done  # answered while the background threads were held
            release.set()
            assert warm.wait(timeout=300)
        offline = llm.generate([prompt], SamplingConfig(max_new_tokens=10, ignore_eos=True),
                               use_tqdm=False)[0]
    assert r.json()["choices"][0]["text"] == offline.text
    steps = [_name(c) for c in compiles
             if _name(c) in {"mixed_forward", "mixed_sample", "copy_pages"}]
    assert collections.Counter(steps) == collections.Counter(warm.precompiler.compiled), (
        steps, warm.precompiler.compiled)
    # chunk buckets 0, 16, 32 x page buckets 1, 2, 4 but (32, 1) (17+ tokens: 2 pages)
    assert steps.count("mixed_forward") == 8


def _generate(tiny_dir: str, cache_dir: Path, seed: int) -> str:
    """jaxinfer-generate in a fresh process (PYTHONHASHSEED=seed) with the persistent cache
    at `cache_dir`; returns its stderr (jax logs every compile and cache hit or miss)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": str(seed),
           "JAX_LOG_COMPILES": "1", "JAX_EXPLAIN_CACHE_MISSES": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli.generate", f"--model_path={tiny_dir}",
         "--prompt=The capital of France is", "--max_new_tokens=4", "--max_seq_len=64",
         "--prefill_buckets=16", f"--compilation_cache_dir={cache_dir}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_a_second_process_compiles_nothing(tiny_dir, tmp_path):
    """The second start of the same config (another process, another hash seed) reads every
    executable, the loader's small ones included, from the persistent cache."""
    first = _generate(tiny_dir, tmp_path / "xla", seed=1)
    second = _generate(tiny_dir, tmp_path / "xla", seed=2)
    compiled = len(re.findall("Finished XLA compilation", second))
    hits = len(re.findall("Persistent compilation cache hit", second))
    assert "PERSISTENT COMPILATION CACHE MISS" not in second, second[-3000:]
    assert compiled == hits == len(re.findall("Finished XLA compilation", first)) > 0
