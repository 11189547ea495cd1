"""Expert parallelism on 8 fake CPU devices (`jaxinfer.sharding`, `jaxinfer.model.moe`).

The mixture toys from Hugging Face (tests/fixtures/hf_*_toy: qwen3_moe with a dense layer,
mixtral, gpt_oss) on `expert:2`, `expert:4` and `data:2,expert:2,model:2`: every chip holds only
its experts (and its slice of their FFN), attention and the KV pool split over expert x model,
the logits are the one-device logits within f32 rounding, the engine's 32 greedy tokens are
transformers' (as on one device), and nothing compiles after warm-up. A mixture the mesh cannot
hold fails before any weight is read. The engine compiles deviceless for a v5e 2x2 slice on
expert:2,model:2 with no expert weight gathered.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxinfer import sharding
from jaxinfer.checkpoint import weights
from jaxinfer.checkpoint.loading import load_model
from jaxinfer.checkpoint.weights import load_checkpoint
from jaxinfer.config import CacheConfig, EngineConfig, RunConfig, SamplingConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.warmup import warmup
from jaxinfer.model import CHUNK, Llama, StepBatch, moe
from jaxinfer.proof import aot
from jaxinfer.proof.hlo_scan import array_shapes
from tests.helpers import count_compiles, rel_err, toy_config

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
MESHES = ("expert:2", "expert:4", "data:2,expert:2,model:2")
PROMPTS = ("a", "b")
# One chunk bucket and pages of 32: the two prompts (13 and 20 tokens) and their 32 greedy
# tokens need 3 step variants (a chunk at 1 page, decodes at 1 and 2), each compiled per mesh.
CACHE = CacheConfig(page_size=32, max_seq_len=64)
ENGINE = EngineConfig(max_slots=2, prefill_buckets=(32,))
SAME_LOGITS = 1e-5  # f32: the mesh only reorders the sums
MAX_REL_ERR = 1e-4  # f32 against transformers' f32 (as tests/test_moe_families.py)


@functools.partial(jax.jit, static_argnums=0)
def _logits_fn(graph, params, cache, ids):
    model = nnx.merge(graph.graphdef, params)
    t = ids.shape[0]
    batch = StepBatch.per_slot(ids[None], jnp.arange(t)[None], jnp.ones((1, t), bool),
                               cache.page_table[:1], jnp.array([t], jnp.int32),
                               num_pages_read=CACHE.pages_per_seq, kind=CHUNK)
    return model(batch, cache.k_pages, cache.v_pages)[0]


def _logits(engine: Engine, ids) -> np.ndarray:
    """f32[T, V] logits of one prompt through the engine's own graph and placed params, over a
    pool split as the engine splits it."""
    runner = engine.runner
    cache = create_cache(engine.config, CACHE, engine.data_shards, mesh=engine.mesh)
    with sharding.mesh_context(engine.mesh):
        return np.asarray(_logits_fn(runner.graph, runner.params, cache,
                                     jnp.asarray(ids, jnp.int32)))


@pytest.fixture(scope="module", params=FAMILIES)
def toy(request):
    """(model, HF reference, one-device logits per prompt)."""
    ckpt = load_checkpoint(os.path.join(FIXTURES, f"hf_{request.param}_toy"))
    ref = np.load(os.path.join(FIXTURES, f"hf_{request.param}_toy_reference.npz"))
    model = Llama(ckpt.config, ckpt.params)
    one = Engine(model, None, cache=CACHE, engine=ENGINE)
    return model, ref, {n: _logits(one, ref[n + "_prompt"]) for n in PROMPTS}


def _check_layout(engine: Engine, mesh) -> None:
    """Each chip holds E / expert experts with F / model of their FFN; the router is whole;
    attention's kv heads and the pool split over expert x model (duplicated up to it)."""
    c, shape = engine.config, dict(mesh.shape)
    e, m = shape.get("expert", 1), shape["model"]
    layer = next(p for i, p in engine.runner.params["layers"].items() if c.is_moe(int(i)))
    gate_up, down, router = layer["experts_gate_up"], layer["experts_down"], layer["router"]
    d, f = c.embed_dim, c.moe_ffn_dim
    assert gate_up.sharding.shard_shape(gate_up.shape) == (c.num_experts // e, 2, d, f // m)
    assert down.sharding.shard_shape(down.shape) == (c.num_experts // e, f // m, d)
    assert router.sharding.shard_shape(router.shape) == router.shape
    tensor = e * m
    assert c.num_kv_heads == tensor  # 2 kv heads stored twice for a 4-way tensor axis
    pool = engine.runner.kv.k_pages[0]
    assert pool.sharding.shard_shape(pool.shape)[0] == 1
    assert pool.sharding.shard_shape(pool.shape)[1] == pool.shape[1] // shape["data"]


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_expert_mesh_serves_the_one_device_output(toy, mesh_spec):
    model, ref, single = toy
    mesh = sharding.make_mesh(mesh_spec)
    llm = LLM(model, None, cache=CACHE, engine=ENGINE, mesh=mesh)
    eng = llm.engine
    _check_layout(eng, mesh)
    for name in PROMPTS:
        got = _logits(eng, ref[name + "_prompt"])
        assert rel_err(got, single[name]) <= SAME_LOGITS, (name, rel_err(got, single[name]))
        assert rel_err(got, ref[name + "_logits"]) <= MAX_REL_ERR, name
    prompts = [ref[n + "_prompt"].tolist() for n in PROMPTS]
    sc = SamplingConfig(max_new_tokens=32, ignore_eos=True)
    eng.warmup(workload=[(p, sc) for p in prompts])
    with count_compiles() as compiles:
        outs = llm.generate(prompts, sc, use_tqdm=False)
    assert len(compiles) == 0, f"{len(compiles)} compiles after warm-up on {mesh_spec}"
    for name, out in zip(PROMPTS, outs):
        assert out.token_ids == ref[name + "_greedy"].tolist(), name


def test_mesh_parsing_with_an_expert_axis():
    assert sharding.parse_mesh("data:2,expert:2,model:2", 8) == {"data": 2, "expert": 2,
                                                                  "model": 2}
    assert sharding.parse_mesh("expert:4", 8) == {"data": 1, "expert": 4, "model": 1}
    assert sharding.parse_mesh("model:2,data:2", 8) == {"data": 2, "model": 2}  # no expert axis
    mesh = sharding.make_mesh("model:2,expert:2,data:2")
    assert mesh.axis_names == ("data", "expert", "model")
    assert dict(mesh.shape) == {"data": 2, "expert": 2, "model": 2}
    with pytest.raises(ValueError, match=r"needs 16 devices.*data x expert x model <= 8"):
        sharding.parse_mesh("data:2,expert:4,model:2", 8)
    with pytest.raises(ValueError, match="bad part 'experts:2'.*'data:D,expert:E,model:M'"):
        sharding.parse_mesh("experts:2", 8)


def test_rules_split_experts_and_fold_the_expert_axis_into_tensor_parallelism():
    mesh = sharding.make_mesh("data:2,expert:2,model:2")
    spec = functools.partial(sharding.spec_for, "w", mesh=mesh)
    assert spec(moe.WEIGHTS["experts_gate_up"][0], (8, 2, 32, 16)) == P("expert", None, None,
                                                                         "model")
    assert spec(moe.WEIGHTS["experts_down"][0], (8, 16, 32)) == P("expert", "model", None)
    assert spec(moe.WEIGHTS["router"][0], (32, 8)) == P(None, None)
    tensor = ("expert", "model")
    assert spec(("embed", "kv_heads", "qkv", "head_dim"), (32, 4, 3, 8)) == P(
        None, tensor, None, None)
    assert spec(("ffn", "embed"), (64, 32)) == P(tensor, None)
    # a dimension expert x model does not divide is whole (logged), as on one axis
    assert spec(("embed", "kv_heads", "qkv", "head_dim"), (32, 2, 3, 8)) == P(None, None, None,
                                                                              None)
    # without an expert axis the rules are the model axis's alone
    plain = sharding.make_mesh("data:2,model:4")
    assert sharding.spec_for("w", ("ffn", "embed"), (64, 32), plain) == P("model", None)
    assert sharding.spec_for("w", moe.WEIGHTS["experts_down"][0], (8, 16, 32), plain) == P(
        None, "model", None)
    assert sharding.rule_shards("kv_heads", mesh) == 4
    assert sharding.rule_shards("kv_heads", plain) == 4
    assert sharding.rule_shards("expert", plain) == 1


def _mixtral_dir() -> str:
    return os.path.join(FIXTURES, "hf_mixtral_toy")


def test_an_expert_axis_that_does_not_divide_the_experts_fails_before_weights_load(monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the mesh was checked")

    monkeypatch.setattr(weights, "from_hf_tensors", no_weights)
    run = RunConfig(model_path=_mixtral_dir(), mesh="expert:3")
    with pytest.raises(ValueError, match=r"expert axis expert:3 does not divide the model's "
                                         r"num_experts=8; valid expert axis sizes: \[1, 2, 4, 8\]"):
        load_model(run)
    monkeypatch.undo()
    ckpt = load_checkpoint(_mixtral_dir())
    with pytest.raises(ValueError, match="expert:3 does not divide .* num_experts=8"):
        LLM(Llama(ckpt.config, ckpt.params), None, cache=CACHE, engine=ENGINE,
            mesh=sharding.make_mesh("expert:3"))


def test_grouped_quantized_experts_must_split_at_group_boundaries():
    config = toy_config(num_experts=8, experts_per_token=2, expert_ffn_dim=64,
                        weight_dtype="int4", int4_group_size=32)
    config.check_mesh({"data": 1, "expert": 4, "model": 2})  # 2 groups over model:2
    with pytest.raises(ValueError, match=r"int4 experts in groups of 32 along their FFN of 64 "
                                         r"\(2 groups\) cannot split over model:4"):
        config.check_mesh({"data": 1, "expert": 2, "model": 4})
    per_channel = dataclasses.replace(config, weight_dtype="int8", int8_group_size=0)
    per_channel.check_mesh({"data": 1, "expert": 2, "model": 4})


# ----- deviceless: a TPU slice ------------------------------------------------------------------
def test_expert_mesh_compiles_for_tpu_without_gathering_experts():
    """The engine's warm-up compiled for v5e 2x2 on expert:2,model:2 (bf16, a dense layer
    beside two mixture layers): each chip's program holds its 4 of 8 experts and half their
    FFN, and no expert (or any other weight) is gathered or copied in any step."""
    target = aot.resolve_target("v5e:2x2")
    mesh = aot.target_mesh(target, "expert:2,model:2")
    assert dict(mesh.shape) == {"data": 1, "expert": 2, "model": 2}
    config = toy_config(vocab_size=1024, embed_dim=256, num_layers=3, num_q_heads=8,
                        num_kv_heads=4, head_dim=64, ffn_dim=512, num_experts=8,
                        experts_per_token=2, expert_ffn_dim=384, dense_layers=(1,),
                        router="softmax_topk_norm", dtype="bfloat16", scan_layers=False)
    compiler = aot.Compiler(weight_bytes=0, log=lambda _: None)
    engine = Engine(Llama.abstract(config), None,
                    cache=CacheConfig(page_size=16, max_seq_len=64),
                    engine=EngineConfig(max_slots=4, prefill_buckets=(16,),
                                        max_num_batched_tokens=32, attention_impl="xla"),
                    mesh=mesh, call=compiler)
    params = engine.runner.params
    compiler.weight_bytes = aot.smallest_weight_bytes(params)
    compiler.shapes = {**array_shapes(engine.runner.kv.k_pages, "KV pool"),
                       **array_shapes(params, "weight")}
    assert warmup(engine, 16) > 0 and compiler.executables
    gate_up = params["layers"][0]["experts_gate_up"]
    assert gate_up.sharding.shard_shape(gate_up.shape) == (4, 2, 256, 192)
    moves = sorted({m for e in compiler.executables for m in e.moves})
    assert not moves, moves
