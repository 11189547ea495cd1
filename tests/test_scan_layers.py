"""Scanned layers (`ModelConfig.scan_layers`, `jaxinfer.model.layers`): the segments of a layer
pattern, the option's resolution, and the two layouts giving the same outputs on every family
(toy Llama / Qwen3-style / Gemma 3-style hybrid with a leftover group / a mixture with a dense
layer, f32 and int8 / int4 weights, the Qwen3 toy fixture, the first layers of the real
SmolLM2 and Gemma 3 270M), through the engine (self speculation, forks, a data x model mesh
with an int8 pool), and a scanned decode step compiled for CPU with its donated pool aliased
and never copied."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import sharding
from jaxinfer.checkpoint import weights
from jaxinfer.checkpoint.loading import load_model
from jaxinfer.config import (
    CacheConfig,
    EngineConfig,
    RopeConfig,
    RunConfig,
    SamplingConfig,
    resolve_scan_layers,
)
from jaxinfer.engine import steps
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.engine.llm import LLM
from jaxinfer.model import CHUNK, Llama, StepBatch, init_params
from jaxinfer.model.layers import Segment, layer_kinds, layer_slots, local_layers, segments
from jaxinfer.proof.hlo_scan import array_shapes, shape_moves
from tests.helpers import TOLERANCE, assert_close, rel_err, toy_config

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
GREEDY = SamplingConfig(max_new_tokens=10, ignore_eos=True)
# The engine tests' pool and buckets, one for all: each compiled step variant costs as much as
# the rest of a toy test, so one chunk bucket and pages of 16 (page buckets 1 and 2 for the
# longest sequence, 28 tokens: 4 variants of the plain step, where pages of 4 and chunk buckets
# 8 and 16 make 7; a 5-token prompt forked copies its part-filled page).
CACHE = CacheConfig(page_size=16, max_seq_len=32)
ENGINE = EngineConfig(max_slots=4, prefill_buckets=(16,))
# Gemma 3's block at 8 layers of period 3 (two local, one global): a scan of 2 repetitions and
# 2 leftover local layers (a scan of their own), hybrid pools.
HYBRID = dict(arch="gemma3", num_layers=8, tie_embeddings=True, qk_norm=True, post_norms=True,
              norm_plus_one=True, scale_embeddings=True, activation="gelu_tanh",
              query_pre_attn_scalar=8.0, sliding_window=6, sliding_window_pattern=3,
              rope_local=RopeConfig(theta=100.0))
# A mixture (Qwen3-MoE's dense first layer, mlp_only_layers): a dense layer unrolled, then a
# scan over the three mixture layers' stack.
MIXTURE = dict(arch="qwen3_moe", num_layers=4, qk_norm=True, num_experts=4, experts_per_token=2,
               expert_ffn_dim=32, dense_layers=(0,))
TOYS = {"llama": dict(num_layers=5), "qwen3": dict(arch="qwen3", num_layers=3, qk_norm=True),
        "hybrid": HYBRID, "mixture": MIXTURE}


def _layouts(config, params):
    return [Llama(dataclasses.replace(config, scan_layers=s), params) for s in (False, True)]


@jax.jit
def _prefill(model, ids):
    """f32[T, V]: one prompt chunk of ids i32[T] through the paged cache (hybrid pools for a
    model with sliding-window layers)."""
    t = ids.shape[0]
    cache_config = CacheConfig(page_size=4, max_seq_len=t)
    cache = create_cache(model.config, cache_config, 1)
    positions = jnp.arange(t)[None]
    batch = StepBatch.per_slot(ids[None], positions, positions < t, cache.page_table,
                               jnp.asarray([t]), num_pages_read=cache_config.pages_per_seq,
                               kind=CHUNK, local_page_table=cache.local_page_table)
    return model(batch, cache.k_pages, cache.v_pages)[0]


# ----- the plan -------------------------------------------------------------------------------
def test_segments_of_layer_patterns():
    assert segments("a" * 30) == (Segment(0, 1, 30),)
    # Gemma 3: five local then one global, 18 and 26 layers (two leftover locals: a scan)
    gemma = ("l" * 5 + "g") * 4 + "ll"
    assert segments(gemma[:18]) == (Segment(0, 6, 3),)
    assert segments(gemma) == (Segment(0, 6, 4), Segment(24, 1, 2))
    # dense first layers then experts (Qwen3-MoE's mlp_only_layers): unrolled, then a scan
    assert segments("dm" + "m" * 6) == (Segment(0, 1, 1), Segment(1, 1, 7))
    kinds = layer_kinds(toy_config(**MIXTURE))
    assert [k.name for k in kinds] == ["global", "global_moe", "global_moe", "global_moe"]
    assert segments(kinds) == (Segment(0, 1, 1), Segment(1, 1, 3))
    # no repetition at all: one unrolled segment
    assert segments("abcd") == (Segment(0, 4, 1),)
    assert segments("") == ()


def test_layer_slots_rows_advance_by_a_fixed_step_within_a_segment():
    config = toy_config(**HYBRID)
    kinds = layer_kinds(config)
    assert [k.name for k in kinds] == ["local", "local", "global"] * 2 + ["local", "local"]
    for hybrid in (False, True):
        slots = layer_slots(config, local_layers(config, hybrid), stacked=True)
        assert len({s.pool for s in slots}) == (2 if hybrid else 1)
        for seg in segments(kinds):
            for i in range(seg.start, seg.start + seg.period):
                rows = [slots[i + r * seg.period] for r in range(seg.repeats)]
                for field in ("weight", "pool_index"):
                    steps_ = {getattr(b, field) - getattr(a, field)
                              for a, b in zip(rows, rows[1:])}
                    assert len(steps_) <= 1, (field, i)


def test_scan_layers_option_resolves_per_platform():
    assert resolve_scan_layers("auto", "tpu")
    assert not resolve_scan_layers("auto", "cpu") and not resolve_scan_layers("auto", "cuda")
    assert resolve_scan_layers("true", "cpu") and not resolve_scan_layers("false", "tpu")
    with pytest.raises(ValueError, match=r"scan_layers='yes' is not one of \('auto', 'true'"):
        resolve_scan_layers("yes", "cpu")
    with pytest.raises(ValueError, match="scan_layers='yes'"):
        RunConfig(scan_layers="yes")


def test_yaml_boolean_and_flag_set_the_layout(tmp_path):
    from absl import flags

    from jaxinfer.cli.flags import define_flags, resolve_config

    path = tmp_path / "run.yaml"
    path.write_text("scan_layers: true\n")
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["prog", f"--config={path}"])
    assert resolve_config(fv).scan_layers == "true"
    fv(["prog", f"--config={path}", "--scan_layers=false"])
    assert resolve_config(fv).scan_layers == "false"


# ----- both layouts give the same outputs ------------------------------------------------------
@pytest.mark.parametrize("family", sorted(TOYS))
def test_toy_logits_match_across_layouts(family):
    config = toy_config(**TOYS[family])
    params = init_params(config, seed=1, scale=0.3)
    ids = jnp.asarray([3, 17, 9, 44, 5, 60, 2, 31, 8, 12, 50, 7, 1, 19], jnp.int32)
    unrolled, scanned = (np.asarray(_prefill(m, ids)) for m in _layouts(config, params))
    print(f"rel err {rel_err(scanned, unrolled):.1e}")
    # f32 rounding only (XLA fuses a loop's body differently from straight-line layers), grown
    # over 8 layers of the toy's large random weights: rel err ~2e-6, a few small logits 4e-5 off
    assert rel_err(scanned, unrolled) < TOLERANCE["float32"][1]
    assert_close(scanned, unrolled, scale=10)


@pytest.mark.parametrize("weight_dtype", ["int8", "int4"])
def test_quantized_load_matches_across_layouts(weight_dtype, tmp_path):
    """Quantized while read (`load_checkpoint(weight_dtype=...)`: per-layer QTensors, stacked
    field by field) on the hybrid toy: greedy tokens equal, logits within f32 rounding."""
    config = toy_config(**{**HYBRID, "ffn_dim": 64})
    params = init_params(config, seed=2, scale=0.3)
    weights.save_hf(weights.Checkpoint(config=config, params=params, path="toy", format="hf",
                                       metadata={}), str(tmp_path))
    models = [load_model(RunConfig(model_path=str(tmp_path), dtype="float32",
                                   weight_dtype=weight_dtype, scan_layers=s))[0]
              for s in ("false", "true")]
    assert [m.config.scan_layers for m in models] == [False, True]
    _assert_same_weights(*models)
    ids = jnp.asarray([3, 17, 9, 44, 5, 60, 2, 31, 8, 12, 50, 7], jnp.int32)
    unrolled, scanned = (np.asarray(_prefill(m, ids)) for m in models)
    print(f"rel err {rel_err(scanned, unrolled):.1e}")
    assert rel_err(scanned, unrolled) < TOLERANCE["float32"][1]
    assert_close(scanned, unrolled, scale=10)  # f32 rounding, as in the float toys
    outs = [[c.token_ids for c in LLM(m, None, cache=CACHE, engine=ENGINE).generate(
        [[5, 9, 2, 7], list(range(3, 16))], GREEDY, use_tqdm=False)] for m in models]
    assert outs[0] == outs[1]


def _assert_same_weights(unrolled: Llama, scanned: Llama) -> None:
    """Row r of every stacked array of kind k is the unrolled model's array of the kind's r-th
    layer, bit for bit (quantized fields included)."""
    from flax import nnx

    stacks = nnx.to_pure_dict(nnx.split(scanned)[1])["layers"]
    layers = nnx.to_pure_dict(nnx.split(unrolled)[1])["layers"]
    slots = layer_slots(unrolled.config, (), stacked=True)
    for i, slot in enumerate(slots):
        jax.tree.map(lambda stack, one, r=slot.weight: np.testing.assert_array_equal(
            np.asarray(stack)[r], np.asarray(one)), stacks[slot.kind], layers[i])


def _engine_tokens(model, *, mesh=None, kv_dtype=None, **engine):
    """Greedy tokens (and with fork n=2 sampled ones) of a few prompts through `Engine`, and
    the number of pages the forks copied."""
    eng = Engine(model, None, cache=dataclasses.replace(CACHE, dtype=kv_dtype),
                 engine=dataclasses.replace(ENGINE, **engine), mesh=mesh)
    copied, copy_pages = [], eng.runner.copy_pages

    def counted(pairs, local_pairs=()):
        copied.extend(pairs)
        copy_pages(pairs, local_pairs)

    eng.runner.copy_pages = counted
    prompts = [[1, 2, 3], list(range(1, 19)), [7, 5, 3, 9, 11]]
    for i, p in enumerate(prompts):
        eng.add_request(p, GREEDY, request_id=f"g{i}")
    eng.add_request([4, 8, 15, 16, 23], SamplingConfig(max_new_tokens=8, temperature=0.8, n=2,
                                                       seed=3), request_id="fork")
    out: dict[str, list[int]] = {}
    for event in eng.stream():
        out.setdefault(event.request_id, []).append(event.token_id)
    return out, len(copied)


@pytest.mark.parametrize("case", [
    dict(family="llama", speculative_method="self", self_spec_layers=2),
    dict(family="hybrid", speculative_method="self", self_spec_layers=4),
    dict(family="hybrid", mesh="data:2,model:2", kv_dtype="int8"),
])
def test_engine_outputs_match_across_layouts(case):
    """The serving engine in both layouts: the same tokens, with the self-speculative drafter
    (the target's first layers: a scanned target's stacks shared whole, its scan shorter),
    forked samples (the page copy of a stacked pool: as many pages copied in both) and a
    data x model mesh with an int8 pool (stacked pools split over "data" and "model")."""
    case = dict(case)
    config = toy_config(**TOYS[case.pop("family")])
    params = init_params(config, seed=4, scale=0.3)
    mesh = sharding.make_mesh(case.pop("mesh")) if "mesh" in case else None
    (unrolled, copied), (scanned, copied_too) = (_engine_tokens(m, mesh=mesh, **case)
                                                 for m in _layouts(config, params))
    assert unrolled == scanned
    assert copied == copied_too > 0


# ----- the scanned step in place ---------------------------------------------------------------
def test_scanned_decode_step_updates_the_pool_in_place_on_cpu():
    """The scanned decode forward compiled for CPU: the donated stacked pool is aliased to the
    output (alias bytes >= the pool) and no copy of it, nor of one layer's row of it, is made
    (the pool is the scan's carry, written by a scatter and gathered from at the layer's row)."""
    config = dataclasses.replace(toy_config(**HYBRID), scan_layers=True)
    model = Llama(config, init_params(config, seed=0))
    graph, params = steps.split_model(model)
    cache = create_cache(config, CacheConfig(page_size=4, max_seq_len=64), 4)
    batch = steps.MixedBatch.idle(4, 2 * cache.pages_per_seq)
    compiled = steps.mixed_forward.trace(graph, params, cache, jnp.zeros((4,), jnp.int32),
                                         jax.tree.map(np.asarray, batch),
                                         num_pages_read=4).lower().compile()
    pool = sum(x.nbytes for x in jax.tree.leaves((cache.k_pages, cache.v_pages)))
    assert compiled.memory_analysis().alias_size_in_bytes >= pool
    shapes = array_shapes(jax.eval_shape(lambda c: (c.k_pages, c.v_pages), cache), "KV pool",
                          rows=True)
    assert shape_moves(compiled.as_text(), shapes) == []


# ----- the real models -------------------------------------------------------------------------
# The real checkpoints' layout equivalence is checked on their first layers: the layout is what
# is tested (the scan, the stacking of real weights, RoPE and windows per kind), not the depth,
# and each unrolled layer adds to the compile (the full-depth models' outputs are checked against
# Hugging Face in tests/test_hf_reference.py and tests/test_gemma3.py).
def _first_layers(ckpt, keep: int) -> tuple:
    """(ModelConfig, params) of `ckpt`'s first `keep` layers in f32: the embedding, final norm
    and LM head whole, layers `keep`.. dropped."""
    params = {k: v for k, v in ckpt.params.items()
              if not k.startswith("layers.") or int(k.split(".")[1]) < keep}
    return dataclasses.replace(ckpt.config, num_layers=keep, dtype="float32"), params


def test_smollm2_logits_and_greedy_match_across_layouts(smollm2_checkpoint):
    """SmolLM2's first 4 layers (its real weights, one scan of 4 layers): the scanned model's
    logits are the unrolled model's within f32 rounding, and its greedy tokens the same."""
    ckpt = smollm2_checkpoint
    unrolled, scanned = _layouts(*_first_layers(ckpt, 4))
    assert not unrolled.config.scan_layers and scanned.config.scan_layers
    ids = jnp.asarray(_ids(ckpt, "The capital of France is Paris, and the capital of Italy is"),
                      jnp.int32)
    unrolled_logits, scanned_logits = (np.asarray(_prefill(m, ids)) for m in (unrolled, scanned))
    print(f"rel err {rel_err(scanned_logits, unrolled_logits):.1e}")
    assert_close(scanned_logits, unrolled_logits, scale=10)  # f32 rounding over the layers
    engine = EngineConfig(max_slots=2, prefill_buckets=(16,), max_num_batched_tokens=32)
    cache = CacheConfig(page_size=16, max_seq_len=64)
    prompts = ["What is the capital of France?", "Name three colors."]
    outs = [[c.token_ids for c in LLM(m, None, cache=cache, engine=engine).generate(
        [_ids(ckpt, p) for p in prompts], GREEDY, use_tqdm=False)]
        for m in (unrolled, scanned)]
    assert outs[0] == outs[1]


def _ids(ckpt, prompt: str) -> list[int]:
    from jaxinfer.checkpoint.loading import load_tokenizer

    return load_tokenizer(ckpt).encode(prompt)


def test_qwen3_fixture_matches_across_layouts():
    ckpt = weights.load_checkpoint(os.path.join(FIXTURES, "hf_qwen3_toy"))
    ref = np.load(os.path.join(FIXTURES, "hf_qwen3_toy_reference.npz"))
    unrolled, scanned = _layouts(dataclasses.replace(ckpt.config, dtype="float32"), ckpt.params)
    ids = jnp.asarray(ref["a_prompt"], jnp.int32)
    assert_close(np.asarray(_prefill(scanned, ids)), np.asarray(_prefill(unrolled, ids)))


def test_gemma3_logits_past_the_window_and_greedy_match_across_layouts(gemma3_checkpoint):
    """Gemma 3 270M's first 12 layers (its real weights: 2 repetitions of 5 local + 1 global, a
    scan of 2 groups, windows and RoPE per kind) scanned: 600 prompt tokens (past the 512-token
    window) give the unrolled model's logits within f32 rounding, and the same greedy tokens."""
    from jaxinfer.checkpoint.loading import load_tokenizer

    tokenizer = load_tokenizer(gemma3_checkpoint)
    unrolled, scanned = _layouts(*_first_layers(gemma3_checkpoint, 12))
    assert segments(layer_kinds(scanned.config)) == (Segment(0, 6, 2),)
    ids = jnp.asarray((tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * 60)
                      [:600], jnp.int32)
    unrolled_logits, scanned_logits = (np.asarray(_prefill(m, ids)[-8:])
                                       for m in (unrolled, scanned))
    print(f"rel err {rel_err(scanned_logits, unrolled_logits):.1e}")
    assert rel_err(scanned_logits, unrolled_logits) < TOLERANCE["float32"][0] * 10
    engine = EngineConfig(max_slots=2, prefill_buckets=(32,), max_num_batched_tokens=64)
    cache = CacheConfig(page_size=16, max_seq_len=96)
    prompts = [tokenizer.encode("Write a haiku about rain."), tokenizer.encode("2 + 2 =")]
    outs = [[c.token_ids for c in LLM(m, None, cache=cache, engine=engine).generate(
        prompts, GREEDY, use_tqdm=False)] for m in (unrolled, scanned)]
    assert outs[0] == outs[1]
