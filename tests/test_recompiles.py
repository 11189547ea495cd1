"""Nothing compiles after warm-up, on one device and on every kind of mesh (model:2 splits the kv
heads, model:4 duplicates them to one per chip, data:2 x model:4 and data:8 split the pool by
pages; a mixture of experts on data:2 x expert:2 x model:2): a workload with prefix-cache hits,
forked samples (n > 1), penalties and a pool small enough to force preemption runs with zero
XLA compiles after `warmup(workload=...)`, on the plain engine and with the n-gram drafter.
Every array a step hands to the next comes back in the sharding it was placed in, so placing it
again moves nothing."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxinfer import sharding
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine.kv_cache import cache_specs
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.steps import state_specs
from jaxinfer.model import Llama, init_params
from tests.helpers import count_compiles, toy_config

VOCAB = 64
# model:2 (split kv heads) and data:8 (pages only) are slow: model:4 (duplicated kv heads) and
# data:2 x model:4 keep both kinds of split in CI; tests/test_sharding.py runs data:2 x model:2
# and data:8.
MESHES = ["none", pytest.param("model:2", marks=pytest.mark.slow), "model:4", "data:2,model:4",
          pytest.param("data:8", marks=pytest.mark.slow)]


def _model(scan_layers: bool = False) -> Llama:
    config = toy_config(vocab_size=VOCAB, max_position=64,  # 2 kv heads: model:4 replicates
                        scan_layers=scan_layers)
    return Llama(config, init_params(config, seed=7, scale=0.3))


@pytest.fixture(scope="module")
def model() -> Llama:
    return _model()


def workload() -> list[tuple[list[int], SamplingConfig]]:
    """Prompts sharing an 8-token page (prefix hits), chunked (chunk 8), forks (n = 2 and 3,
    seeded), a repetition penalty, repeated spans for the n-gram drafter; up to 16 tokens."""
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(0, VOCAB, 8)]
    span = [int(t) for t in rng.integers(0, VOCAB, 3)]
    prompts = [shared + [int(t) for t in rng.integers(0, VOCAB, k)] for k in (2, 1, 3)]
    prompts += [span * 3, [int(t) for t in rng.integers(0, VOCAB, 6)], span * 2 + [1, 2]]
    configs = [SamplingConfig(max_new_tokens=6, ignore_eos=True),
               SamplingConfig(max_new_tokens=6, ignore_eos=True, temperature=0.8, seed=1, n=2),
               SamplingConfig(max_new_tokens=5, ignore_eos=True, repetition_penalty=1.3),
               SamplingConfig(max_new_tokens=7, ignore_eos=True),
               SamplingConfig(max_new_tokens=9, ignore_eos=True, temperature=1.0, seed=4, n=3),
               SamplingConfig(max_new_tokens=8, ignore_eos=True)]
    return list(zip(prompts, configs))


def build(model, mesh_spec: str, method: str) -> LLM:
    """Two slots and 3 pages of 8 tokens per data shard: a request needs up to 2 pages, so two
    in one shard preempt each other; 2 page buckets, 1 chunk bucket, 1 draft: few variants."""
    mesh = None if mesh_spec == "none" else sharding.make_mesh(mesh_spec)
    shards = mesh.shape["data"] if mesh is not None else 1
    slots = 2 * shards
    cache = CacheConfig(page_size=8, max_seq_len=16, num_pages=3 * shards)
    engine = EngineConfig(max_slots=slots, prefill_buckets=(8,), prefill_chunk_size=8,
                          max_num_batched_tokens=max(16, slots + 8), speculative_method=method,
                          num_speculative_tokens=1)
    return LLM(model, None, cache=cache, engine=engine, mesh=mesh)


@pytest.fixture(scope="module")
def moe_model() -> Llama:
    """A mixture: 8 experts (top 2) with a shared expert, beside a dense layer; unrolled (the
    scanned one is the last test's)."""
    config = toy_config(vocab_size=VOCAB, max_position=64, num_layers=2, num_experts=8,
                        experts_per_token=2, expert_ffn_dim=32, shared_expert_ffn_dim=16,
                        dense_layers=(1,), scan_layers=False)
    return Llama(config, init_params(config, seed=7, scale=0.3))


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_nothing_compiles_after_warmup(model, mesh_spec):
    _check_nothing_compiles(model, mesh_spec)


def test_nothing_compiles_after_warmup_on_an_expert_mesh(moe_model):
    """The experts under shard_map over expert and model, attention over both, pages over
    data: the same workload, the same zero."""
    _check_nothing_compiles(moe_model, "data:2,expert:2,model:2")


@pytest.mark.parametrize("mesh_spec", ["none", "data:2,model:4"])
def test_nothing_compiles_after_warmup_with_scanned_layers(mesh_spec):
    """The same with the layers scanned (the stacked pool, threaded through the scan, comes
    back in its sharding too)."""
    _check_nothing_compiles(_model(scan_layers=True), mesh_spec)


def test_nothing_compiles_after_warmup_with_scanned_mixture_layers(moe_model):
    """A scanned mixture (a mixture layer and a dense one: two kinds, two stacks) on the expert
    mesh."""
    scanned = Llama(dataclasses.replace(moe_model.config, scan_layers=True),
                    init_params(moe_model.config, seed=7, scale=0.3))
    _check_nothing_compiles(scanned, "data:2,expert:2,model:2")


def _check_nothing_compiles(model, mesh_spec: str) -> None:
    for method in ("none", "ngram"):
        llm = build(model, mesh_spec, method)
        eng = llm.engine
        requests = workload() * min(eng.data_shards, 2)  # more sequences than slots
        eng.warmup(workload=requests)
        with count_compiles() as compiles:
            llm.generate([p for p, _ in requests], [sc for _, sc in requests], use_tqdm=False)
        assert len(compiles) == 0, f"{method}: {len(compiles)} compiles after warm-up"
        stats = eng.stats()
        assert stats["prefix_hits"] > 0 and stats["preemptions"] > 0, (method, stats)
        if method == "ngram":
            assert stats["spec_verify_calls"] > 0 and stats["spec_drafted_tokens"] > 0, stats
        runner = eng.runner  # the pool and slot state a step returned need no moving
        for tree, specs in ((runner.kv, cache_specs), (runner.state, state_specs)):
            again = sharding.place(tree, sharding.placement(tree, specs, runner.mesh))
            assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(tree)))
