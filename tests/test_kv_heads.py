"""Kv heads duplicated to the model axis (`jaxinfer.model.kv_heads`): a toy with 2 kv heads on
model:4 and data:2 x model:4 stores each kv head twice, one per chip (fused qkv and pool split
over "model"), and serves exactly what one device does: greedy tokens equal, logprobs close,
with prefix hits and preemption, and with the Pallas kernels inside shard_map (slow); the
duplicated layout itself (float, int8, abstract) and the rule that picks the copies."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxinfer import sharding
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.model import Llama, init_params
from jaxinfer.model.kv_heads import duplicate_kv_heads, kv_head_copies
from tests.helpers import toy_config

# 2 kv heads x 4 query heads each: a 4-way model axis needs each kv head twice.
# Unrolled: the tests read each layer's duplicated arrays and pools.
CONFIG = toy_config(vocab_size=128, embed_dim=32, num_q_heads=8, num_kv_heads=2, head_dim=8,
                    ffn_dim=64, scan_layers=False)
CACHE = CacheConfig(page_size=4, max_seq_len=64, num_pages=24)
ENGINE = EngineConfig(max_slots=4, prefill_buckets=(8, 16), max_num_batched_tokens=24,
                      prefill_chunk_size=8)


@pytest.fixture(scope="module")
def model() -> Llama:
    params = init_params(CONFIG, seed=21, scale=0.3)
    params["lm_head"] *= 8.0  # sharp logits: no near-ties for the ~1e-6 reduction-order noise
    return Llama(CONFIG, params)


def _workload():
    """Prompts sharing a 12-token prefix (prefix hits), in a pool of 24 pages that 4 slots of
    up to ~30 tokens overrun (preemption)."""
    rng = np.random.default_rng(3)
    shared = [int(t) for t in rng.integers(0, 128, 12)]
    prompts = [shared + [int(t) for t in rng.integers(0, 128, k)] for k in (3, 9, 1, 6)]
    prompts.append([int(t) for t in rng.integers(0, 128, 14)])
    return prompts, SamplingConfig(max_new_tokens=14, ignore_eos=True, logprobs=True)


def test_copies_rule():
    assert kv_head_copies(CONFIG, 1) == 1
    assert kv_head_copies(CONFIG, 2) == 1  # the axis divides the kv heads: split as they are
    assert kv_head_copies(CONFIG, 4) == 2
    assert kv_head_copies(CONFIG, 8) == 4
    assert kv_head_copies(CONFIG, 16) == 1  # 8 query heads cannot split 16 ways: replicated
    assert kv_head_copies(CONFIG, 3) == 1


def test_duplicated_layout_keeps_each_query_head_on_its_kv_head(model):
    wide = duplicate_kv_heads(model, 2)
    assert wide.config.num_kv_heads == 4 and wide.config.q_per_kv == 2
    old, new = model.layers[0].qkv[...], wide.layers[0].qkv[...]  # [D, K, G + 2, H]
    assert new.shape == (32, 4, 4, 8)
    for n in range(8):  # query head n reads kv head n // G in both layouts
        k, g, k2, g2 = n // 4, n % 4, n // 2, n % 2
        np.testing.assert_array_equal(new[:, k2, g2], old[:, k, g])
        np.testing.assert_array_equal(new[:, k2, 2:], old[:, k, 4:])  # its key and value
    assert wide.layers[0].o is model.layers[0].o or np.array_equal(
        wide.layers[0].o[...], model.layers[0].o[...])
    with pytest.raises(ValueError, match="valid: divisors of 4"):
        duplicate_kv_heads(model, 3)


def test_duplicated_int8_and_abstract_models_have_the_wide_model_shapes():
    config = dataclasses.replace(CONFIG, weight_dtype="int8")
    wide = dataclasses.replace(config, num_kv_heads=4)
    shapes = lambda m: jax.tree.map(lambda a: (a.shape, np.dtype(a.dtype)),  # noqa: E731
                                    nnx_state(m))
    want = shapes(Llama.abstract(wide))
    assert shapes(duplicate_kv_heads(Llama.abstract(config), 2)) == want
    real = duplicate_kv_heads(Llama(config, init_params(config, seed=2)), 2)
    assert shapes(real) == want
    qkv = real.layers[1].qkv
    np.testing.assert_array_equal(qkv.scale[...][:, 0, 2:], qkv.scale[...][:, 1, 2:])


def test_duplicated_bias_and_device_arrays():
    """qkv_bias [K, G + 2, H] (Qwen2) is rearranged like the weight; device arrays (an orbax
    restore) give what host arrays give."""
    import jax.numpy as jnp

    from jaxinfer.model.kv_heads import _duplicate

    config = dataclasses.replace(CONFIG, arch="qwen2", qkv_bias=True)
    model = Llama(config, init_params(config, seed=4))
    wide = duplicate_kv_heads(model, 2)
    old, new = model.layers[0].qkv_bias[...], wide.layers[0].qkv_bias[...]
    assert new.shape == (4, 4, 8)
    np.testing.assert_array_equal(new[3, :2], old[1, 2:4])  # queries 6, 7 -> copy 1 of head 1
    np.testing.assert_array_equal(new[3, 2:], old[1, 4:])
    on_device = _duplicate(jnp.asarray(model.layers[0].qkv[...]), 2, 4)
    np.testing.assert_array_equal(np.asarray(on_device), wide.layers[0].qkv[...])


def nnx_state(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.split(model)[1])


@pytest.mark.parametrize("mesh_spec", [pytest.param("model:4", marks=pytest.mark.slow),
                                       "data:2,model:4"])
def test_engine_with_duplicated_kv_heads_matches_single_device(model, mesh_spec):
    prompts, sc = _workload()
    want_llm = LLM(model, None, cache=CACHE, engine=ENGINE)
    want = want_llm.generate(prompts, sc, use_tqdm=False)
    mesh = sharding.make_mesh(mesh_spec)
    llm = LLM(model, None, cache=CACHE, engine=ENGINE, mesh=mesh)
    eng = llm.engine
    assert eng.config.num_kv_heads == 4
    assert eng.runner.params["layers"][0]["qkv"].sharding.spec == jax.sharding.PartitionSpec(
        None, "model")
    k0 = eng.runner.kv.k_pages[0]
    assert k0.shape[0] == 4 and k0.addressable_shards[0].data.shape[0] == 1  # one kv head/chip
    got = llm.generate(prompts, sc, use_tqdm=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)
    sched = eng.scheduler
    assert sched.prefix_hits > 0 and sched.num_preemptions > 0
    if mesh.shape["data"] == 1:  # the same schedule (data shards each schedule their own pool)
        assert (sched.prefix_hits, sched.num_preemptions) == (
            want_llm.engine.scheduler.prefix_hits, want_llm.engine.scheduler.num_preemptions)


def pallas_check() -> None:
    """The Pallas path (interpret mode on CPU) on model:4 and data:2 x model:4: each model shard
    runs the kernels inside shard_map on its one (duplicated) kv head and its query heads;
    tokens equal the single-device XLA path. (The kernel needs H and page_size >= 16.)"""
    config = dataclasses.replace(CONFIG, head_dim=16)
    params = init_params(config, seed=22, scale=0.3)
    params["lm_head"] *= 8.0
    model = Llama(config, params)
    cache = CacheConfig(page_size=16, max_seq_len=64)
    prompts = [[5, 9, 2], list(range(3, 20))]
    sc = SamplingConfig(max_new_tokens=6, ignore_eos=True, logprobs=True)
    want = LLM(model, None, cache=cache, engine=ENGINE).generate(prompts, sc, use_tqdm=False)
    engine = dataclasses.replace(ENGINE, attention_impl="pallas")
    for spec in ("model:4", "data:2,model:4"):
        llm = LLM(model, None, cache=cache, engine=engine, mesh=sharding.make_mesh(spec))
        assert llm.engine.config.num_kv_heads == 4
        got = llm.generate(prompts, sc, use_tqdm=False)
        for a, b in zip(got, want):
            assert a.token_ids == b.token_ids, spec
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # interpret-mode kernels on a mesh; in a fresh process (test_sharding's reason)
def test_pallas_kernels_on_duplicated_kv_heads_match_single_device():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    code = ("import tests.conftest, tests.test_kv_heads as t; t.pallas_check(); "
            "print('CHECK OK')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "CHECK OK" in proc.stdout, proc.stderr[-3000:]


def test_orbax_restore_splits_the_narrow_kv_arrays_then_widens(model, tmp_path):
    """Restored for a mesh that duplicates its kv heads, the fused qkv is split over "model" by
    its embed axis (a fraction per chip, not whole on each), and the engine widens it into the
    duplicated layout and serves the single-device tokens."""
    from jaxinfer.checkpoint import orbax as orbax_ckpt
    from jaxinfer.checkpoint.weights import Checkpoint

    params = init_params(CONFIG, seed=21, scale=0.3)  # the `model` fixture's weights
    params["lm_head"] *= 8.0
    ckpt = Checkpoint(config=CONFIG, params=params, path="toy", format="hf", metadata={})
    orbax_ckpt.save_orbax(ckpt, str(tmp_path / "orbax"))
    mesh = sharding.make_mesh("model:4")
    restored, _ = orbax_ckpt.restore_model(str(tmp_path / "orbax"), mesh=mesh)
    qkv = restored.layers[0].qkv[...]  # [D, K, G + 2, H], narrow
    assert qkv.shape == (32, 2, 6, 8)
    assert qkv.sharding.spec == jax.sharding.PartitionSpec("model")
    assert qkv.addressable_shards[0].data.shape == (8, 2, 6, 8)
    prompts, sc = _workload()
    prompts, sc = prompts[:2], dataclasses.replace(sc, max_new_tokens=6)
    want = LLM(model, None, cache=CACHE, engine=ENGINE).generate(prompts, sc, use_tqdm=False)
    llm = LLM(restored, None, cache=CACHE, engine=ENGINE, mesh=mesh)
    assert llm.engine.runner.params["layers"][0]["qkv"].sharding.spec == (
        jax.sharding.PartitionSpec(None, "model"))
    got = llm.generate(prompts, sc, use_tqdm=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
