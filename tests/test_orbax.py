"""Orbax checkpoints (jaxinfer.checkpoint.orbax, which scripts/convert_checkpoint.py runs) on 8
fake CPU devices.

A toy HF directory (f32 llama; bf16 qwen2 with qkv bias and tied embeddings; Gemma 3's block;
mixtures of experts: a bf16 qwen2_moe, an f32 gpt_oss) and the embedded
SmolLM2 GGUF (f32) are written with `save_orbax`; each is restored on one device,
on model:4 and on data:2,model:4 (the mixtures also on data:2,expert:2,model:2, one expert per
stored chunk). Every restored array must already be in the sharding the rules give the original
model (`sharding.param_shardings`), hold exactly the original's values, and
give the original's logits: bitwise on the same device layout, within the f32 (bf16) tolerance
against the single-device original. `Llama.abstract` matches a real model; the CLI path
(`load_llm` with --model_path=<orbax dir> --mesh=...) serves the original's greedy tokens; bad
directories fail clearly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxinfer import sharding
from jaxinfer.checkpoint import orbax as orbax_ckpt
from jaxinfer.checkpoint import weights
from jaxinfer.config import CacheConfig, EngineConfig, RopeConfig, RunConfig, SamplingConfig
from jaxinfer.engine import steps
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.engine.llm import LLM, load_llm
from jaxinfer.model import CHUNK, Llama, StepBatch, init_params
from tests.helpers import TOLERANCE, rel_err, toy_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = [None, pytest.param("model:4", marks=pytest.mark.slow), "data:2,model:4"]
CACHE = CacheConfig(page_size=16, max_seq_len=64)


@functools.partial(jax.jit, static_argnums=0)
def _logits_fn(graph, params, cache, ids):
    model = nnx.merge(graph.graphdef, params)
    t = ids.shape[0]
    batch = StepBatch.per_slot(ids[None], jnp.arange(t)[None], jnp.ones((1, t), bool),
                               cache.page_table[:1], jnp.array([t], jnp.int32),
                               num_pages_read=CACHE.pages_per_seq, kind=CHUNK)
    logits, _, _ = model(batch, cache.k_pages, cache.v_pages)
    return logits


def _all_logits(model, ids, mesh=None) -> np.ndarray:
    """f32[T, V] logits of one sequence; with a mesh, the params in their rule shardings and
    the pool split as the engine splits it (one slot per data shard)."""
    graph, params = steps.split_model(model, mesh)
    slots = sharding.data_shards(mesh) if mesh is not None else 1
    cache = create_cache(model.config, CACHE, slots, mesh=mesh)
    with sharding.mesh_context(mesh):
        return np.asarray(_logits_fn(graph, params, cache, jnp.asarray(ids, jnp.int32)))


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_restored(restored: Llama, original: Llama, mesh_spec: str | None) -> None:
    """Every restored leaf: a jax.Array already in the sharding the rules give the original
    model (or on the default device), with exactly the original's values and dtype; and
    `split_model` (what the engine runs) hands those very arrays to the steps (no copy, no
    re-placement)."""
    mesh = sharding.make_mesh(mesh_spec) if mesh_spec else None
    got = nnx.to_pure_dict(nnx.split(restored)[1])
    want = nnx.to_pure_dict(nnx.split(original)[1])
    if mesh is None:
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                                 want)
    else:
        shardings = sharding.param_shardings(original, mesh)
    got, want, shardings = _flat(got), _flat(want), _flat(shardings)
    assert got.keys() == want.keys() == shardings.keys()
    split = 0
    for name, arr in got.items():
        assert isinstance(arr, jax.Array), name
        assert arr.sharding.is_equivalent_to(shardings[name], arr.ndim), (
            name, arr.sharding, shardings[name])
        assert arr.dtype == want[name].dtype, name
        np.testing.assert_array_equal(np.asarray(arr), want[name], err_msg=name)
        split += any(s is not None for s in getattr(shardings[name], "spec", ()))
    if mesh is not None:
        assert split >= len(got) // 3, "the rules should split a good part of the model"
    _, params = steps.split_model(restored, mesh)
    placed = _flat(params)
    for name, arr in _flat(nnx.to_pure_dict(nnx.split(restored)[1])).items():
        assert placed[name] is arr, name


# ----- the toy models --------------------------------------------------------------------------
TOYS = {
    # 4 kv heads x 2, FFN 64, vocab 128: a 4-way model axis splits every head/ffn/vocab axis.
    "llama_f32": (dict(vocab_size=128, num_q_heads=8, num_kv_heads=4, ffn_dim=64), "float32"),
    "qwen2_bias_tied_bf16": (dict(arch="qwen2", vocab_size=128, num_q_heads=8, num_kv_heads=4,
                                  ffn_dim=64, qkv_bias=True, tie_embeddings=True), "bfloat16"),
    # Gemma 3's block: a local (window 4, its own RoPE) then a global layer, QK-norm, post-norms.
    "gemma3_features_f32": (dict(arch="gemma3", vocab_size=128, num_q_heads=8, num_kv_heads=4,
                                 ffn_dim=64, tie_embeddings=True, qk_norm=True, post_norms=True,
                                 norm_plus_one=True, scale_embeddings=True,
                                 activation="gelu_tanh", query_pre_attn_scalar=4.0,
                                 sliding_window=4, sliding_window_pattern=2,
                                 rope_local=RopeConfig(theta=100.0)), "float32"),
    # Mixtures of experts: 8 experts (top 2) beside a dense layer and a shared expert; gpt-oss's
    # sinks, biases, clamped SwiGLU and YaRN, its window on layer 0.
    "qwen2_moe_bf16": (dict(arch="qwen2_moe", vocab_size=128, num_q_heads=8, num_kv_heads=4,
                            ffn_dim=64, qkv_bias=True, num_experts=8, experts_per_token=2,
                            expert_ffn_dim=32, shared_expert_ffn_dim=64, dense_layers=(1,),
                            router="softmax_topk"), "bfloat16"),
    "gpt_oss_f32": (dict(arch="gpt_oss", vocab_size=128, num_q_heads=8, num_kv_heads=4,
                         ffn_dim=64, qkv_bias=True, o_bias=True, attention_sinks=True,
                         sliding_window=4, sliding_window_pattern=2, activation="swiglu_clamped",
                         num_experts=8, experts_per_token=2, router="topk_softmax",
                         router_bias=True, expert_bias=True,
                         rope=RopeConfig(theta=1e4, type="yarn", factor=8.0,
                                         original_max_position=32)), "float32"),
}


@pytest.fixture(scope="module", params=sorted(TOYS))
def toy(request, tmp_path_factory):
    """(source Checkpoint, original Llama, orbax dir) for a toy HF directory."""
    overrides, dtype = TOYS[request.param]
    config = toy_config(scan_layers=False, **overrides)  # an HF directory's per-layer arrays
    params = init_params(config, seed=3, scale=0.3)
    params["embed"] *= 4.0  # sharp logits
    root = tmp_path_factory.mktemp(request.param)
    hf_dir, orbax_dir = str(root / "hf"), str(root / "orbax")
    weights.save_hf(weights.Checkpoint(config=config, params=params, path="toy", format="hf",
                                       metadata={}), hf_dir, dtype=dtype)
    ckpt = weights.load_checkpoint(hf_dir)
    info = orbax_ckpt.save_orbax(ckpt, orbax_dir)  # default dtype: the source's
    assert info["dtype"] == dtype and not info["tokenizer"]
    assert info["num_arrays"] == len(jax.tree.leaves(nnx.split(Llama.abstract(config))[1]))
    original = Llama(dataclasses.replace(ckpt.config, dtype=dtype), ckpt.params)
    return ckpt, original, orbax_dir


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_toy_round_trip_shardings_values_and_logits(toy, mesh_spec):
    ckpt, original, path = toy
    mesh = sharding.make_mesh(mesh_spec) if mesh_spec else None
    restored, config, tokenizer = orbax_ckpt.load_orbax(path, mesh=mesh)
    assert config == original.config and tokenizer is None
    _check_restored(restored, original, mesh_spec)
    ids = [5, 99, 17, 3, 64, 21, 8, 127, 42, 0, 77]
    want = _all_logits(original, ids)
    got = _all_logits(restored, ids, mesh)
    if mesh is None:
        np.testing.assert_array_equal(got, want)
    else:
        # Same device layout as the original placed on the mesh: bitwise; against the
        # single-device original: within the dtype's tolerance (reduction order differs).
        np.testing.assert_array_equal(got, _all_logits(original, ids, mesh))
        assert rel_err(got, want) < TOLERANCE[config.dtype][0], rel_err(got, want)


def test_toy_stacked_checkpoint_round_trips_and_relays(toy, tmp_path):
    """A checkpoint of the scanned layout (each kind's layers stacked): restored on
    data:2,model:4 straight into the shardings the rules give the stacked original, with its
    values and the unrolled original's logits; restored into the unrolled layout (each stack
    split on the devices) it is the unrolled original, and the unrolled checkpoint restored
    stacked is the stacked original."""
    ckpt, original, path = toy
    stacked_path = str(tmp_path / "stacked")
    orbax_ckpt.save_orbax(ckpt, stacked_path, scan_layers=True)
    config = original.config
    stacked_original = Llama(dataclasses.replace(config, scan_layers=True), ckpt.params)
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(os.path.join(stacked_path, "state")).item_metadata.tree
    assert sorted(stored["layers"]) == sorted({k.name for k in map(config.layer_kind,
                                                                   range(config.num_layers))})
    mesh_spec = "data:2,model:4"
    restored, got_config, _ = orbax_ckpt.load_orbax(stacked_path, mesh=sharding.make_mesh(
        mesh_spec))
    assert got_config == stacked_original.config
    _check_restored(restored, stacked_original, mesh_spec)
    ids = [5, 99, 17, 3, 64, 21, 8, 127, 42, 0, 77]
    want = _all_logits(original, ids)
    got = _all_logits(restored, ids, sharding.make_mesh(mesh_spec))
    assert rel_err(got, want) < TOLERANCE[config.dtype][0], rel_err(got, want)
    unrolled, got_config, _ = orbax_ckpt.load_orbax(stacked_path, mesh=sharding.make_mesh(
        mesh_spec), scan_layers=False)
    assert got_config == config
    _check_restored(unrolled, original, mesh_spec)
    relaid, got_config, _ = orbax_ckpt.load_orbax(path, scan_layers=True)
    assert got_config == stacked_original.config
    _check_restored(relaid, stacked_original, None)


def test_toy_storage_dtype_cast_and_chunks(toy):
    ckpt, original, path = toy
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(os.path.join(path, "state")).item_metadata.tree
    layer = stored["layers"]["0"]
    # one kv head / q head per stored chunk: a model shard reads only its own chunks
    assert layer["qkv"].storage.chunk_shape[1] == 1 and layer["o"].storage.chunk_shape[0] == 1
    assert layer["attn_norm"].dtype == np.float32
    # dtype= casts while reading; norms stay f32
    restored, config, _ = orbax_ckpt.load_orbax(path, dtype="float32")
    assert config.dtype == "float32"
    got = restored.layers[0].qkv[...]
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(original.layers[0].qkv[...]).astype(np.float32))
    assert restored.layers[0].attn_norm[...].dtype == jnp.float32


def test_abstract_model_matches_the_real_one(toy):
    _, original, _ = toy
    abstract = Llama.abstract(original.config)
    g1, s1 = nnx.split(original)
    g2, s2 = nnx.split(abstract)
    assert g1 == g2 and hash(g1) == hash(g2)
    real, ab = nnx.to_pure_dict(s1), nnx.to_pure_dict(s2)
    assert jax.tree.structure(real) == jax.tree.structure(ab)
    for a, b in zip(jax.tree.leaves(real), jax.tree.leaves(ab), strict=True):
        assert isinstance(b, jax.ShapeDtypeStruct)
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    mesh = sharding.make_mesh("data:2,model:4")
    assert sharding.param_shardings(abstract, mesh) == sharding.param_shardings(original, mesh)


@pytest.mark.parametrize("toy", ["gpt_oss_f32", "qwen2_moe_bf16"], indirect=True)
def test_moe_toys_restore_split_over_the_expert_axis(toy):
    """On data:2,expert:2,model:2 every expert array restores straight into its shards (4 of 8
    experts per chip, half their FFN), read from chunks of one expert each, and gives the
    original's logits; an expert axis that does not divide the experts fails before any array
    is read."""
    ckpt, original, path = toy
    mesh_spec = "data:2,expert:2,model:2"
    mesh = sharding.make_mesh(mesh_spec)
    restored, config, _ = orbax_ckpt.load_orbax(path, mesh=mesh)
    _check_restored(restored, original, mesh_spec)
    gate_up = restored.layers[0].experts_gate_up[...]
    assert gate_up.sharding.shard_shape(gate_up.shape) == (4, 2, 32, config.moe_ffn_dim // 2)
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(os.path.join(path, "state")).item_metadata.tree
    assert stored["layers"]["0"]["experts_gate_up"].storage.chunk_shape[0] == 1
    ids = [5, 99, 17, 3, 64, 21, 8, 127, 42, 0, 77]
    got = _all_logits(restored, ids, mesh)
    np.testing.assert_array_equal(got, _all_logits(original, ids, mesh))
    assert rel_err(got, _all_logits(original, ids)) < TOLERANCE[config.dtype][0]
    with pytest.raises(ValueError, match="expert:3 does not divide .* num_experts=8"):
        orbax_ckpt.load_orbax(path, mesh=sharding.make_mesh("expert:3"))
    with pytest.raises(ValueError, match="expert:6 does not divide .* num_experts=8"):
        load_llm(RunConfig(model_path=path, mesh="expert:6"))


@pytest.mark.parametrize("toy", ["llama_f32"], indirect=True)
def test_cli_path_load_llm_serves_the_original_tokens(toy):
    """`load_llm(RunConfig(model_path=<orbax dir>, mesh=...))`, what --model_path/--mesh run
    (f32 toy only: the engine compiles a dozen step variants per layout)."""
    ckpt, original, path = toy
    engine = EngineConfig(max_slots=2, prefill_buckets=(8, 16), max_num_batched_tokens=16,
                          prefill_chunk_size=8)
    sc = SamplingConfig(max_new_tokens=6, ignore_eos=True, logprobs=True)
    prompts = [[5, 9, 2], list(range(3, 13))]
    want = LLM(original, None, cache=CACHE, engine=engine).generate(prompts, sc, use_tqdm=False)
    run = RunConfig(model_path=path, mesh="data:2,model:4", dtype=original.config.dtype,
                    cache=CACHE, engine=engine)
    llm = load_llm(run)
    mesh = sharding.make_mesh(run.mesh)
    assert llm.engine.tokenizer is None
    for arr, s in zip(jax.tree.leaves(llm.engine.runner.params),
                      jax.tree.leaves(sharding.param_shardings(original, mesh)), strict=True):
        assert arr.sharding.is_equivalent_to(s, arr.ndim)
    got = llm.generate(prompts, sc, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)


def test_errors(toy, tmp_path):
    ckpt, _, path = toy
    with pytest.raises(FileNotFoundError, match="does not exist"):
        orbax_ckpt.load_orbax(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="not a jaxinfer orbax checkpoint"):
        orbax_ckpt.load_orbax(str(tmp_path))
    with pytest.raises(ValueError, match="not a jaxinfer orbax checkpoint"):
        orbax_ckpt.load_orbax(ckpt.path)  # the HF source directory
    with pytest.raises(ValueError, match="is an orbax checkpoint"):
        weights.load_checkpoint(path)
    # the HF dir is not ours: never replaced; ours: only with overwrite
    with pytest.raises(FileExistsError, match="never replaced"):
        orbax_ckpt.save_orbax(ckpt, ckpt.path, overwrite=True)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        orbax_ckpt.save_orbax(ckpt, path)
    broken = str(tmp_path / "broken")
    shutil.copytree(path, broken)
    os.remove(os.path.join(broken, "config.json"))
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        orbax_ckpt.load_orbax(broken)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(broken, "config.json"), "w") as f:
        json.dump({**config, "num_layers": 3}, f)
    with pytest.raises(ValueError, match=r"does not match its config.json: missing arrays "
                                         r"\['layers.2"):
        orbax_ckpt.load_orbax(broken)
    with open(os.path.join(broken, "config.json"), "w") as f:
        json.dump({**config, "ffn_dim": 32}, f)
    with pytest.raises(ValueError, match="has shape"):
        orbax_ckpt.load_orbax(broken)
    with open(os.path.join(broken, "config.json"), "w") as f:
        json.dump({**config, "experts": 8}, f)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['experts'\]"):
        orbax_ckpt.load_orbax(broken)
    os.remove(os.path.join(broken, orbax_ckpt.MARKER))
    with pytest.raises(ValueError, match="interrupted conversion"):
        orbax_ckpt.load_orbax(broken)
    # overwrite replaces a checkpoint of ours
    info = orbax_ckpt.save_orbax(ckpt, broken, overwrite=True)
    assert orbax_ckpt.read_config(broken) == dataclasses.replace(
        ckpt.config, dtype=info["dtype"])


def test_config_dict_round_trip():
    config = toy_config(arch="qwen2", qkv_bias=True, sliding_window=32, dtype="bfloat16")
    config = dataclasses.replace(config, rope=dataclasses.replace(
        config.rope, type="llama3", factor=8.0, original_max_position=128))
    data = json.loads(json.dumps(orbax_ckpt.config_to_dict(config)))
    assert orbax_ckpt.config_from_dict(data) == config


# ----- the real default model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_orbax(smollm2, tmp_path_factory):
    """(source Checkpoint, original f32 Llama, orbax dir) for the embedded SmolLM2 GGUF."""
    path = str(tmp_path_factory.mktemp("smollm2") / "orbax")
    model, ckpt = smollm2
    info = orbax_ckpt.save_orbax(ckpt, path, dtype="float32")
    assert info["tokenizer"] and info["source_format"] == "gguf"
    return ckpt, model, path


@pytest.fixture(scope="module")
def smollm2_ids(smollm2_orbax):
    from jaxinfer.checkpoint.loading import load_tokenizer

    tok = load_tokenizer(smollm2_orbax[0])
    return tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]),
        add_special_tokens=False)


@pytest.fixture(scope="module")
def smollm2_logits(smollm2_orbax, smollm2_ids):
    return _all_logits(smollm2_orbax[1], smollm2_ids)


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_smollm2_round_trip(smollm2_orbax, smollm2_ids, smollm2_logits, mesh_spec):
    ckpt, original, path = smollm2_orbax
    mesh = sharding.make_mesh(mesh_spec) if mesh_spec else None
    restored, config, tokenizer = orbax_ckpt.load_orbax(path, mesh=mesh)
    assert config == original.config
    _check_restored(restored, original, mesh_spec)
    got = _all_logits(restored, smollm2_ids, mesh)
    if mesh is None:
        np.testing.assert_array_equal(got, smollm2_logits)
    else:
        err = rel_err(got, smollm2_logits)
        print(f"{mesh_spec}: rel err {err:.1e}")
        assert err < TOLERANCE["float32"][0]
        np.testing.assert_array_equal(got.argmax(-1), smollm2_logits.argmax(-1))
    # the tokenizer travels with the checkpoint
    from jaxinfer.checkpoint.loading import load_tokenizer

    source = load_tokenizer(ckpt)
    text = "Hello, wörld! 😀 <|im_start|>"
    assert tokenizer.encode(text) == source.encode(text)
    assert (tokenizer.eos_ids, tokenizer.bos_id, tokenizer.chat_template) == (
        source.eos_ids, source.bos_id, source.chat_template)


def test_bf16_source_keeps_bf16_by_default():
    params = {"embed": np.zeros((4, 2), ml_dtypes.bfloat16)}
    ckpt = weights.Checkpoint(config=None, params=params, path="x", format="hf", metadata={})
    assert orbax_ckpt.source_dtype(ckpt) == "bfloat16"
    ckpt.params = {"embed": np.zeros((4, 2), np.float16)}
    assert orbax_ckpt.source_dtype(ckpt) == "float32"
