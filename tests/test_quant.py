"""Quantized weights: the host quantizers against a plain numpy reference, GGUF block
requantization against gguf-py's `dequantize`, the model's in-step dequantization against the
same model built from the dequantized weights, sharding, loading, and bad input."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as ref

from jaxinfer import sharding
from jaxinfer.checkpoint import requant, weights
from jaxinfer.config import CacheConfig, RunConfig
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.model import Llama, init_params, quant
from tests.helpers import toy_config
from tests.test_model import CACHE, run_rows
from tests.test_quants import _random_blocks
from tests.test_weights import TINY, _hf_tensors, _write_gguf

Q = GGMLQuantizationType


def _reference_int8(w, contract):
    """Written plainly: per output channel, scale = max |w| / 127, q = round(w / scale)."""
    w64 = np.asarray(w, np.float64)
    amax = np.abs(w64).max(axis=contract, keepdims=True)
    scale = np.where(amax > 0, amax / 127, 1.0)
    return np.clip(np.round(w64 / scale), -127, 127) * scale


def _reference_int4(w, axis, group):
    """Per group of `group` along `axis`: 16 levels from the group's min to its max."""
    moved = np.moveaxis(np.asarray(w, np.float64), axis, -1)
    g = moved.reshape(moved.shape[:-1] + (-1, group))
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scale = np.where(hi > lo, (hi - lo) / 15, 1.0)
    out = (np.clip(np.round((g - lo) / scale), 0, 15) * scale + lo).reshape(moved.shape)
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("shape,contract", [((64, 3, 5), (0,)), ((4, 32, 7), (0, 1)),
                                            ((9, 96), (1,))])
def test_int8_round_trip_matches_reference(shape, contract):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    t = quant.quantize(w, contract, "int8")
    assert t.q.dtype == np.int8 and t.q.shape == shape
    assert t.scale.shape == tuple(1 if i in contract else d for i, d in enumerate(shape))
    got = quant.dequantize_host(t)
    np.testing.assert_allclose(got, _reference_int8(w, contract), rtol=1e-6, atol=1e-7)
    step = np.abs(w).max(axis=contract, keepdims=True) / 127
    assert np.all(np.abs(got - w) <= step / 2 + 1e-7)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("shape,contract", [((128, 3, 5), (0,)), ((4, 128, 7), (0, 1)),
                                            ((9, 128), (1,))])
def test_int4_round_trip_matches_reference(shape, contract, group):
    w = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    t = quant.quantize(w, contract, "int4", group)
    axis = contract[-1]
    assert t.q.dtype == np.uint8 and t.q.shape[axis] == shape[axis] // 2  # two per byte
    assert t.scale.shape[axis] == shape[axis] // group == t.zero.shape[axis]
    np.testing.assert_allclose(quant.dequantize_host(t), _reference_int4(w, axis, group),
                               rtol=1e-5, atol=1e-6)


def test_int4_packing_is_ggml_order_within_a_group():
    q = np.tile(np.arange(16, dtype=np.uint8), 4).reshape(2, 32)
    packed = quant.pack_int4(q, 1, 16)  # groups of 16: byte j = element j | element j + 8
    assert packed.shape == (2, 16) and packed[0, 0] == 0x80 and packed[0, 15] == 0xF7
    np.testing.assert_array_equal(quant.unpack_int4(packed, 1, 16), q)


def _gguf_reference(raw, qtype, shape):
    return ref.dequantize(raw, qtype).reshape(shape).astype(np.float32)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_gguf_requantization_matches_gguf_dequantize(qtype, kind):
    """From the file's blocks to our layout, chunk by chunk, against gguf-py: 4-bit blocks of 32
    (Q4_0, Q4_1, Q4_K) to int4 groups of 32 bit-exactly; every other pair equals our numpy
    quantizer applied to gguf-py's dequantized tensor, bit for bit."""
    block, _ = GGML_QUANT_SIZES[qtype]
    rows, cols = 6, 2 * max(block, 256)
    raw = _random_blocks(qtype, rows=rows, blocks_per_row=cols // block,
                         rng=np.random.default_rng(int(qtype)))
    want = _gguf_reference(raw, qtype, (rows, cols))
    got = requant.from_gguf(raw, qtype, (rows, cols), kind, 32)
    if kind == "int4" and qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
        np.testing.assert_array_equal(quant.dequantize_host(got), want)
        return
    expect = quant.quantize(want, (1,), kind, 32)
    for name, value in expect.fields().items():
        np.testing.assert_array_equal(got.fields()[name], value, err_msg=name)


def test_gguf_requantization_is_chunked_consistently(monkeypatch):
    raw = _random_blocks(Q.Q8_0, rows=40, blocks_per_row=4, rng=np.random.default_rng(3))
    whole = requant.from_gguf(raw, Q.Q8_0, (40, 128), "int8", 32)
    monkeypatch.setattr(requant, "CHUNK_ELEMENTS", 3 * 128)  # 3 rows per chunk
    chunked = requant.from_gguf(raw, Q.Q8_0, (40, 128), "int8", 32)
    for name, value in whole.fields().items():
        np.testing.assert_array_equal(chunked.fields()[name], value)


def test_unsupported_gguf_type_names_it():
    with pytest.raises(ValueError, match=r"unsupported GGML tensor type IQ2_XXS; supported: "
                                         r"F32, F16, BF16, Q8_0.*Q6_K"):
        requant.from_gguf(np.zeros((2, 66), np.uint8), Q.IQ2_XXS, (2, 256), "int8", 32)


def test_bad_dtypes_are_refused():
    with pytest.raises(ValueError, match=r"weight_dtype='int2' is not one of \('float32', "
                                         r"'bfloat16', 'int8', 'int4'\)"):
        toy_config(weight_dtype="int2")
    with pytest.raises(ValueError, match=r"weight_dtype 'fp8' is not one of"):
        RunConfig(weight_dtype="fp8")
    with pytest.raises(ValueError, match="contraction dim 48 .* group size 32"):
        quant.quantize(np.zeros((48, 4), np.float32), (0,), "int4", 32)


def _dequantized(params: dict, kind: str, group: int) -> dict:
    """Canonical float params with every matrix quantized and dequantized on the host (numpy),
    the embedding and LM head as int8: the weights a quantized model must compute with."""
    out = {}
    for name, w in params.items():
        if name.endswith(("norm", "_bias")):
            out[name] = w
            continue
        k = "int8" if name in ("embed", "lm_head") else kind
        out[name] = quant.dequantize_host(quant.quantize(w, weights._contract(name), k, group))
    return out


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("tied", [True, False])
def test_model_dequantizes_in_step_like_the_host_reference(kind, tied):
    config = toy_config(tie_embeddings=tied, weight_dtype=kind, int4_group_size=8,
                        qkv_bias=not tied)
    float_config = dataclasses.replace(config, weight_dtype=None)
    params = init_params(float_config, scale=0.3)
    model = Llama(config, params)
    assert isinstance(model.layers[0].qkv, quant.QuantWeight)
    assert model.embed.kind == "int8"  # the embedding / head rule
    twin = Llama(float_config, _dequantized(params, kind, 8))
    ids = list(np.random.default_rng(1).integers(0, config.vocab_size, 13))
    _, got = run_rows(model, create_cache(config, CACHE, 1, fill=np.nan), ids, 0)
    _, want = run_rows(twin, create_cache(config, CACHE, 1, fill=np.nan), ids, 0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind,spec,shape,contract,view", [
    ("int8", "ND,DKCH->NKCH", (24, 3, 5, 8), (0,), None),  # qkv: contraction first
    ("int8", "NX,XD->ND", (4, 6, 40), (0, 1), (24, 40)),  # o: 2 contraction axes, as 2-D
    ("int8", "...D,VD->...V", (70, 24), (1,), None),  # tied LM head: contraction last
    ("int4", "ND,DKCH->NKCH", (24, 3, 5, 8), (0,), None),
    ("int4", "NX,XD->ND", (4, 8, 40), (0, 1), (32, 40)),  # groups of 8 within each head
])
def test_cpu_chunked_einsum_equals_the_reference(monkeypatch, kind, spec, shape, contract, view):
    """On one CPU device int8 and int4 run as a loop over output chunks (here 10, 8 or 5
    columns of a 1 KiB temporary; the last chunk clamped): the same product as the dequantized
    weight's."""
    monkeypatch.setattr(quant, "CPU_CHUNK_BYTES", 1024)
    rng = np.random.default_rng(3)
    t = quant.quantize(rng.standard_normal(shape).astype(np.float32), contract, kind, 8)
    w = quant.QuantWeight(t, ("a",) * len(shape), lambda v, axes: nnx.Param(jax.numpy.asarray(v)))
    x = rng.standard_normal((2, 5, view[0] if view else shape[contract[-1]])).astype(np.float32)
    x = x[0] if spec.startswith("N") else x
    fn = jax.jit(lambda x: quant.einsum(spec, x, w, shape=view))
    assert "while" in fn.lower(x).as_text()  # the chunked path, not the fused one
    deq = quant.dequantize_host(t)
    want = np.einsum(spec, x, deq if view is None else deq.reshape(view))
    np.testing.assert_allclose(np.asarray(fn(x)), want, rtol=1e-5, atol=1e-5)


def test_quantized_gguf_load_streams_into_the_same_model(tmp_path):
    """A GGUF read straight into int8 equals quantizing its float load; int4 of Q4_0 blocks
    keeps the file's values exactly."""
    hf = _hf_tensors(TINY)
    q4 = {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.q_proj.weight"}
    _write_gguf(tmp_path / "t.gguf", TINY, hf, quantized=q4)
    path = str(tmp_path / "t.gguf")
    floats = weights.load_checkpoint(path)
    for kind in ("int8", "int4"):
        ck = weights.load_checkpoint(path, weight_dtype=kind, group=32)
        assert ck.config.weight_dtype == kind
        for name, t in ck.params.items():
            if not isinstance(t, quant.QTensor):
                np.testing.assert_array_equal(t, floats.params[name])
                continue
            table = name in ("embed", "lm_head")
            assert t.kind == ("int8" if table else kind), name
            if kind == "int8" or table:
                expect = quant.quantize(floats.params[name], t.contract, "int8")
                np.testing.assert_array_equal(t.q, expect.q, err_msg=name)
            else:  # Q8_0-stored ones land within half an int4 step of the float weights
                err = np.abs(quant.dequantize_host(t) - floats.params[name])
                assert err.max() <= 0.5 * np.abs(floats.params[name]).max() / 7, name


def test_sharded_quantized_model_equals_one_device():
    """model:4 (and data:2 x model:4 for int4): q, scales and zero points split by the weight's
    own rules; the logits equal the single-device ones."""
    from jaxinfer.engine.steps import split_model

    for kind, spec in (("int8", "model:4"), ("int4", "data:2,model:4")):
        config = toy_config(weight_dtype=kind, int4_group_size=8, num_kv_heads=4, ffn_dim=64)
        model = Llama(config, init_params(dataclasses.replace(config, weight_dtype=None)))
        ids = list(np.random.default_rng(2).integers(0, config.vocab_size, 9))
        _, want = run_rows(model, create_cache(config, CACHE, 1), ids, 0)
        mesh = sharding.make_mesh(spec)
        graph, params = split_model(model, mesh)
        layer = params["layers"][0]
        assert layer["down"]["q"].sharding.spec[0] == "model"  # ffn split, packed or not
        assert layer["gate_up"]["scale"].sharding.spec[2] == "model"  # scales split like q
        if kind == "int4":  # groups along the split ffn axis: scales and zeros split with it
            assert layer["down"]["scale"].sharding.spec[0] == "model"
            assert layer["down"]["zero"].sharding.spec[0] == "model"
        sharded = nnx.merge(graph.graphdef, params)
        cache = CacheConfig(page_size=4, max_seq_len=64)
        kv = create_cache(config, cache, sharding.data_shards(mesh), mesh=mesh)
        with jax.set_mesh(mesh):
            _, got = run_rows(sharded, kv, ids, 0)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_orbax_stores_and_restores_quantized_arrays_sharded(kind, tmp_path):
    """An HF directory read into int8/int4, saved with orbax, restored into model:4 shards:
    every q/scale/zero array in its rule sharding with its stored values, same logits."""
    from jaxinfer.checkpoint import orbax as orbax_ckpt
    from tests.test_orbax import _all_logits, _check_restored

    config = toy_config(vocab_size=128, num_q_heads=8, num_kv_heads=4, ffn_dim=64)
    params = init_params(config, seed=3, scale=0.3)
    weights.save_hf(weights.Checkpoint(config=config, params=params, path="toy", format="hf",
                                       metadata={}), str(tmp_path / "hf"))
    ckpt = weights.load_checkpoint(str(tmp_path / "hf"), weight_dtype=kind, group=8)
    orbax_ckpt.save_orbax(ckpt, str(tmp_path / "orbax"))
    original = Llama(ckpt.config, ckpt.params)
    restored, restored_config, _ = orbax_ckpt.load_orbax(str(tmp_path / "orbax"),
                                                         mesh=sharding.make_mesh("model:4"))
    assert restored_config == original.config and restored_config.weight_dtype == kind
    _check_restored(restored, original, "model:4")
    ids = [5, 99, 17, 3, 64, 21, 8, 127]
    np.testing.assert_allclose(_all_logits(restored, ids, sharding.make_mesh("model:4")),
                               _all_logits(original, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=f"stores {kind} weights; weight_dtype='float32'"):
        from jaxinfer.checkpoint.loading import load_model

        load_model(RunConfig(model_path=str(tmp_path / "orbax"), weight_dtype="float32"))
