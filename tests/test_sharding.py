"""Meshes and sharding rules on 8 fake CPU devices: the engine over model:4 x data:2, model:8 and
data:8 gives the single-device greedy tokens and logprobs within tolerance (also with the Pallas
kernel in interpret mode inside shard_map), a step's weight matmuls see only their data shard's
rows (data:8, data:2 x model:4), weights and KV pages land in the shardings the rules ask for and
keep them across steps, and impossible meshes fail clearly."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer import sharding
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.engine.llm import LLM
from jaxinfer.model import Llama, init_params
from tests.helpers import count_compiles, toy_config

CACHE = CacheConfig(page_size=4, max_seq_len=64)
ENGINE = EngineConfig(max_slots=4, prefill_buckets=(8, 16), max_num_batched_tokens=24,
                      prefill_chunk_size=8)
SC = SamplingConfig(max_new_tokens=10, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def model() -> Llama:
    # 4 kv heads x 2 = 8 query heads, FFN 64, vocab 128: a 4-way model axis splits everything; an
    # 8-way one stores each kv head twice, one per chip (`jaxinfer.model.kv_heads`).
    config = toy_config(vocab_size=128, embed_dim=32, num_q_heads=8, num_kv_heads=4, head_dim=8,
                        ffn_dim=64, scan_layers=False)  # the tests read each layer's arrays
    return Llama(config, _params(config))


def _params(config) -> dict:
    params = init_params(config, seed=11, scale=0.3)
    params["lm_head"] *= 8.0  # sharp logits: no near-ties for the ~1e-6 reduction-order noise
    return params


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(0, 128, n)] for n in (3, 9, 17, 5, 12)]


@pytest.fixture(scope="module")
def single(model, prompts):
    return LLM(model, None, cache=CACHE, engine=ENGINE).generate(prompts, SC, use_tqdm=False)


def test_mesh_parsing_and_errors():
    assert sharding.parse_mesh("data:2,model:4", 8) == {"data": 2, "model": 4}
    assert sharding.parse_mesh("model:8", 8) == {"data": 1, "model": 8}
    assert sharding.parse_mesh("auto", 8) == {"data": 1, "model": 8}
    with pytest.raises(ValueError, match="needs 16 devices but only 8 exist"):
        sharding.parse_mesh("data:4,model:4", 8)
    with pytest.raises(ValueError, match="bad part 'pipe:2'"):
        sharding.parse_mesh("pipe:2", 8)
    with pytest.raises(ValueError, match="given twice"):
        sharding.parse_mesh("model:2,model:2", 8)
    with pytest.raises(ValueError, match="must be >= 1"):
        sharding.parse_mesh("model:0", 8)
    assert sharding.make_mesh("data:2,model:4").shape == {"data": 2, "model": 4}


def test_rules_replicate_indivisible_dims_and_refuse_collisions():
    mesh = sharding.make_mesh("model:4")
    assert sharding.spec_for("qkv", ("embed", "kv_heads", "qkv", "head_dim"), (32, 4, 4, 8),
                             mesh) == P(None, "model", None, None)
    # SmolLM2's 3 kv heads on 4 devices: replicated
    assert sharding.spec_for("qkv", ("embed", "kv_heads", "qkv", "head_dim"), (576, 3, 5, 64),
                             mesh) == P(None, None, None, None)
    with pytest.raises(ValueError, match="both map to mesh axis 'model'"):
        sharding.spec_for("bad", ("vocab", "ffn"), (128, 64), mesh)
    with pytest.raises(ValueError, match="logical axis 'experts' has no rule"):
        sharding.spec_for("bad", ("experts",), (8,), mesh)


def test_slots_and_pages_must_split_evenly_over_the_data_axis(model):
    mesh = sharding.make_mesh("data:2,model:2")
    with pytest.raises(ValueError, match=r"max_slots=3 and num_pages=64 must both be divisible "
                                         r"by the mesh's data axis \(2\).*max_slots=4"):
        LLM(model, None, cache=dataclasses.replace(CACHE, num_pages=64),
            engine=dataclasses.replace(ENGINE, max_slots=3), mesh=mesh)
    with pytest.raises(ValueError, match=r"num_pages=63 must both be divisible.*num_pages=64"):
        create_cache(model.config, dataclasses.replace(CACHE, num_pages=63), 4, mesh=mesh)


def test_params_and_pages_land_in_their_shardings(model):
    mesh = sharding.make_mesh("data:2,model:4")
    llm = LLM(model, None, cache=CACHE, engine=ENGINE, mesh=mesh)
    eng = llm.engine
    layer = eng.runner.params["layers"][0]
    # Specs are spelled without trailing Nones, as jax spells a jit's outputs (`sharding.named`).
    assert layer["qkv"].sharding.spec == P(None, "model")
    assert layer["gate_up"].sharding.spec == P(None, None, "model")
    assert layer["down"].sharding.spec == P("model")
    assert layer["o"].sharding.spec == P("model")
    assert eng.runner.params["lm_head"].sharding.spec == P(None, "model")
    assert layer["attn_norm"].sharding.spec == P()
    # Each device holds a quarter of the kv heads of its data shard's half of the pages: 64
    # usable pages + a trash page per data shard = 66, 33 per device.
    k0 = eng.runner.kv.k_pages[0]
    by_heads = NamedSharding(mesh, P("model", "data"))
    assert k0.sharding.is_equivalent_to(by_heads, k0.ndim)
    assert k0.shape[:2] == (4, 66) and k0.addressable_shards[0].data.shape[:2] == (1, 33)
    prompts = [[1, 2, 3], list(range(20))]
    eng.warmup(workload=[(p, SC) for p in prompts])
    with count_compiles() as compiles:
        llm.generate(prompts, SC, use_tqdm=False)
    assert len(compiles) == 0, "steps must keep the shardings (no recompiles)"
    assert eng.runner.kv.k_pages[0].sharding == k0.sharding


@pytest.mark.parametrize("mesh_spec", ["data:2,model:4", "model:8", "data:8"])
def test_sharded_engine_matches_single_device(model, prompts, single, mesh_spec):
    mesh = sharding.make_mesh(mesh_spec)
    # Each data shard serves its own slots from its own part of the pool: data:8 needs 8 slots.
    engine = dataclasses.replace(ENGINE, max_slots=max(4, mesh.shape["data"]))
    got = LLM(model, None, cache=CACHE, engine=engine, mesh=mesh).generate(prompts, SC,
                                                                          use_tqdm=False)
    for a, b in zip(got, single):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mesh_spec", ["data:2,model:4", "model:8"])
def test_scanned_layers_on_meshes(model, prompts, single, mesh_spec):
    """Scanned layers on a mesh: the stacks split as their layers' arrays are, never along the
    `layers` axis (model:8: each of the 4 kv heads stored twice, stacks included), the stacked
    pool by kv heads and pages; the unrolled single-device tokens, and nothing compiles after
    warm-up."""
    mesh = sharding.make_mesh(mesh_spec)
    scanned = Llama(dataclasses.replace(model.config, scan_layers=True), _params(model.config))
    llm = LLM(scanned, None, cache=CACHE, engine=ENGINE, mesh=mesh)
    runner = llm.engine.runner
    stack = runner.params["layers"]["global"]
    assert stack["qkv"].sharding.spec == P(None, None, "model")
    assert stack["down"].sharding.spec == P(None, "model")
    pool = runner.kv.k_pages[0]
    assert pool.ndim == 5 and pool.shape[0] == model.config.num_layers
    assert pool.sharding.is_equivalent_to(
        NamedSharding(mesh, P(None, "model", "data" if mesh.shape["data"] > 1 else None)), 5)
    llm.engine.warmup(workload=[(p, SC) for p in prompts])
    with count_compiles() as compiles:
        got = llm.generate(prompts, SC, use_tqdm=False)
    assert len(compiles) == 0
    for a, b in zip(got, single):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)


def pallas_in_shard_map_check() -> None:
    """model:4 and data:2 x model:2 with --attention_impl=pallas: the Triton kernel (interpret
    mode on CPU) runs per shard on its kv heads (and data shard's pages) inside shard_map;
    tokens equal the single-device XLA path. (The kernel needs H and page_size >= 16.)"""
    config = toy_config(vocab_size=128, embed_dim=32, num_q_heads=8, num_kv_heads=4,
                        head_dim=16, ffn_dim=64)
    params = init_params(config, seed=12, scale=0.3)
    params["lm_head"] *= 8.0
    model = Llama(config, params)
    cache = CacheConfig(page_size=16, max_seq_len=64)
    prompts = [[5, 9, 2], list(range(3, 20))]
    want = LLM(model, None, cache=cache, engine=ENGINE).generate(prompts, SC, use_tqdm=False)
    engine = dataclasses.replace(ENGINE, attention_impl="pallas")
    # data:2: per data shard, on its own pages; model:8 over 4 kv heads: each stored twice
    for spec in ("model:4", "data:2,model:2", "model:8"):
        got = LLM(model, None, cache=cache, engine=engine, mesh=sharding.make_mesh(spec)
                  ).generate(prompts, SC, use_tqdm=False)
        for a, b in zip(got, want):
            assert a.token_ids == b.token_ids, spec
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # ~30 s of interpret-mode kernels on a mesh
def test_pallas_kernel_inside_shard_map_matches_single_device():
    """Runs `pallas_in_shard_map_check` in a fresh process: in the long-lived suite process the
    XLA CPU compile of this step (interpret-mode Triton kernel inside a 4-device shard_map) once
    segfaulted, while the same test passes alone and beside its neighbours; a crash there must
    fail this test, not end the whole suite."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    code = ("import tests.conftest, tests.test_sharding as t; t.pallas_in_shard_map_check(); "
            "print('CHECK OK')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "CHECK OK" in proc.stdout, proc.stderr[-3000:]


def test_pallas_path_really_uses_shard_map(model):
    """The decode attention of a pallas step on a model:4 mesh is a shard_map around the kernel."""
    import jax.numpy as jnp

    from jaxinfer.model.attention import decode_attention

    mesh = sharding.make_mesh("model:4")
    q = jnp.zeros((2, 1, 4, 2, 16))
    pages = jnp.zeros((4, 9, 16, 16))
    table = jnp.zeros((2, 2), jnp.int32)
    lens = jnp.ones((2,), jnp.int32)
    with jax.set_mesh(mesh):
        text = str(jax.make_jaxpr(lambda q, k, v: decode_attention(
            q, k, v, table, lens[:, None] - 1, lens, num_pages_read=2, sliding_window=None,
            impl="pallas"))(q, pages, pages))
    assert "shard_map" in text and "pallas_call" in text


def _compiled_mixed_step(model, mesh_spec: str):
    """The compiled forward of a mixed step of 8 decode rows and an 8-token chunk (16 rows, 9
    logits rows) on `mesh_spec`."""
    from jaxinfer.engine import steps
    from jaxinfer.engine.engine import Engine

    mesh = sharding.make_mesh(mesh_spec)
    eng = Engine(model, None, cache=CACHE, engine=EngineConfig(max_slots=8, prefill_buckets=(8,)),
                 mesh=mesh)
    r = eng.runner
    batch = dataclasses.replace(steps.MixedBatch.idle(8, 16, 8), decode=np.ones((8,), bool),
                                chunk_len=np.int32(1), chunk_prompt_len=np.int32(1))
    with jax.set_mesh(mesh):
        return steps.mixed_forward.lower(r.graph, r.params, r.kv, r.state.tokens, batch,
                                         num_pages_read=4).compile()


def test_pure_data_mesh_splits_the_rows_of_the_weight_matmuls(model):
    """On data:8 each device multiplies only its 1/8 of a step's rows by the weights (the
    compiled step's dots have 16 / 8 = 2 rows), while tokens stay equal to one device's
    (test_sharded_engine_matches_single_device[data:8])."""
    import re

    hlo = _compiled_mixed_step(model, "data:8").as_text()
    shapes = re.findall(r"= f32\[([0-9,]+)\][^=]*? dot\(", hlo)
    # the 2-D weight matmuls; [rows, 1] is attention's softmax denominator (a dot with ones)
    rows = {int(m.split(",")[0]) for m in shapes if m.count(",") == 1 and not m.endswith(",1")}
    assert rows == {2}, shapes  # 2 of the step's 16 rows per device, never all 16


def test_data_x_model_mesh_splits_the_rows_of_the_weight_matmuls(model):
    """On data:2 x model:4 each device multiplies half of a step's rows by a quarter of each
    weight: the layer matmuls are [8, 32] dots (gate_up: two [8, 16], batched) where one
    device's are [16, 128] or [16, 32], the lm_head's 9 logits rows (padded to 10) a [5, 32]
    one, while tokens stay equal to one device's (test_sharded_engine_matches_single_device
    [data:2,model:4]). The split stays inside the model: no input or output of the step is split
    over "data" (when the split reached the slot state and sampling, XLA miscompiled a scatter
    there and tokens were wrong, see `model._rows`)."""
    import re

    step = _compiled_mixed_step(model, "data:2,model:4")
    # The weight matmuls by their einsums: qkv, o, down [8, 32]; gate_up two [8, 16] batched
    # (its FFN's quarter, 64 / 4, for gate and for up); the lm_head's [5, 32]. Attention's
    # dots see all 16 rows (each data shard attends for the rows whose pages it holds, and
    # which those are is known only at run time); the weights' never do.
    dots = [(tuple(int(d) for d in m[1].split(",")), m[2]) for m in re.finditer(
        r"= f32\[([\d,]+)\]\{[^}]*\} dot\([^\n]*?op_name=\"([^\"]*)\"", step.as_text())]
    weights = sorted(d for d, name in dots
                     if any(s in name for s in ("DKCH", "NX,XD", "NF,FD", "CDF", "lm_head/")))
    assert weights == sorted([(5, 32)] + [(8, 32)] * 6 + [(2, 8, 16)] * 2), dots
    # The KV pool is split over "data" (pages) and "model" (kv heads); nothing else that goes
    # in or out of the step is split over "data".
    (_, cache, *rest), _ = step.input_shardings
    pool = NamedSharding(step.input_shardings[0][1].k_pages[0].mesh, P("model", "data"))
    for s in jax.tree.leaves(((cache.k_pages, cache.v_pages), step.output_shardings[0].k_pages)):
        assert s.is_equivalent_to(pool, 4), s
    for s in jax.tree.leaves((cache.page_table, rest, step.output_shardings[1:])):
        assert "data" not in str(s.spec), s


@pytest.mark.parametrize("method", ["none", pytest.param("draft", marks=pytest.mark.slow)])
def test_data_shards_serve_forks_prefix_hits_and_preemption_from_their_own_pages(model, method):
    """data:2: each data shard serves its 2 slots from its half of a pool small enough to force
    preemption, with prompts that share a prefix (each shard's own prefix cache) and forked
    samples (a fork's samples stay in its parent's shard); also with a draft model, whose pool
    is split the same way. Every output equals the single-device run of the same config.
    (Under speculation the samples are greedy: a sample drawn there depends on how many drafts
    its steps verified, which depends on the free pages each shard has for lookahead.)"""
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(0, 128, 12)]
    prompts = [shared + [int(t) for t in rng.integers(0, 128, k)] for k in (3, 9, 1, 6)]
    prompts.append([int(t) for t in rng.integers(0, 128, 14)])
    scs = [SamplingConfig(max_new_tokens=14, ignore_eos=True, logprobs=True),
           SamplingConfig(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=3, n=3),
           SamplingConfig(max_new_tokens=16, ignore_eos=True, logprobs=True),
           SamplingConfig(max_new_tokens=10, ignore_eos=True, logprobs=True),
           SamplingConfig(max_new_tokens=9, ignore_eos=True, temperature=1.1, seed=8, n=2)]
    if method != "none":
        scs = [dataclasses.replace(sc, temperature=0.0) for sc in scs]
    cache = CacheConfig(page_size=4, max_seq_len=64, num_pages=24)
    engine = dataclasses.replace(ENGINE, speculative_method=method, num_speculative_tokens=3)
    draft = model if method == "draft" else None
    want = LLM(model, None, cache=cache, engine=engine, draft_model=draft).generate(
        prompts, scs, use_tqdm=False)
    llm = LLM(model, None, cache=cache, engine=engine, draft_model=draft,
              mesh=sharding.make_mesh("data:2"))
    got = llm.generate(prompts, scs, use_tqdm=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for a, b in zip(got, want):
        if b.logprobs:
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)
    sched = llm.engine.scheduler
    assert sched.prefix_hits > 0 and (sched.num_preemptions > 0 or method != "none")
    sched.check_invariants()
    assert [len(p.free) + len(p.cache) for p in sched.pools] == [12, 12]
    assert llm.engine.runner.kv.k_pages[0].addressable_shards[0].data.shape[1] == 13  # 12 + trash
