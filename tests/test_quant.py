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
from tests.helpers import TOLERANCE, count_compiles, rel_err, toy_config
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


def _reference_grouped(w, axis, group, top):
    """Per group of `group` along `axis`: top + 1 levels from the group's min to its max."""
    moved = np.moveaxis(np.asarray(w, np.float64), axis, -1)
    g = moved.reshape(moved.shape[:-1] + (-1, group))
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scale = np.where(hi > lo, (hi - lo) / top, 1.0)
    out = (np.clip(np.round((g - lo) / scale), 0, top) * scale + lo).reshape(moved.shape)
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
    np.testing.assert_allclose(quant.dequantize_host(t), _reference_grouped(w, axis, group, 15),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape,contract", [((64, 3, 5), (0,)), ((4, 32, 7), (0, 1)),
                                            ((9, 96), (1,))])
def test_grouped_int8_round_trip_matches_reference(shape, contract):
    w = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    t = quant.quantize(w, contract, "int8", 32)
    axis = contract[-1]
    assert t.q.dtype == np.uint8 and t.q.shape == shape  # one value per byte
    assert t.scale.shape[axis] == shape[axis] // 32 == t.zero.shape[axis]
    np.testing.assert_allclose(quant.dequantize_host(t), _reference_grouped(w, axis, 32, 255),
                               rtol=1e-5, atol=1e-6)


def test_int4_packing_is_ggml_order_within_a_group():
    q = np.tile(np.arange(16, dtype=np.uint8), 4).reshape(2, 32)
    packed = quant.pack_int4(q, 1, 16)  # groups of 16: byte j = element j | element j + 8
    assert packed.shape == (2, 16) and packed[0, 0] == 0x80 and packed[0, 15] == 0xF7
    np.testing.assert_array_equal(quant.unpack_int4(packed, 1, 16), q)


def _gguf_reference(raw, qtype, shape):
    return ref.dequantize(raw, qtype).reshape(shape).astype(np.float32)


_EXACT = {"int4": (Q.Q4_0, Q.Q4_1, Q.Q4_K),
          "int8": (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1)}


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q6_K],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_gguf_requantization_matches_gguf_dequantize(qtype, kind):
    """From the file's blocks to our grouped layout (groups of 32), chunk by chunk, against
    gguf-py: blocks whose integers fit (`_EXACT`) bit-exactly; every other pair (Q6_K's 16-wide
    sub-blocks, 8-bit blocks to int4) equals our numpy quantizer applied to gguf-py's
    dequantized tensor, bit for bit."""
    block, _ = GGML_QUANT_SIZES[qtype]
    rows, cols = 6, 2 * max(block, 256)
    raw = _random_blocks(qtype, rows=rows, blocks_per_row=cols // block,
                         rng=np.random.default_rng(int(qtype)))
    want = _gguf_reference(raw, qtype, (rows, cols))
    got = requant.from_gguf(raw, qtype, (rows, cols), kind, 32)
    assert got.group == 32 and got.q.dtype == np.uint8
    if qtype in _EXACT[kind]:  # equal values (Q8_0's 0 * d < 0 is -0.0 there, +0.0 here)
        np.testing.assert_array_equal(quant.dequantize_host(got), want)
        return
    expect = quant.quantize(want, (1,), kind, 32)
    for name, value in expect.fields().items():
        np.testing.assert_array_equal(got.fields()[name], value, err_msg=name)


def test_gguf_requantization_is_chunked_consistently(monkeypatch):
    raw = _random_blocks(Q.Q8_0, rows=40, blocks_per_row=4, rng=np.random.default_rng(3))
    for kind, group in (("int8", 0), ("int8", 32), ("int4", 32)):  # requantized, exact, RTN
        whole = requant.from_gguf(raw, Q.Q8_0, (40, 128), kind, group)
        with monkeypatch.context() as m:
            m.setattr(requant, "CHUNK_ELEMENTS", 3 * 128)  # 3 rows per chunk
            chunked = requant.from_gguf(raw, Q.Q8_0, (40, 128), kind, group)
        for name, value in whole.fields().items():
            np.testing.assert_array_equal(chunked.fields()[name], value)


def test_int4_of_a_4bit_mix_gguf_keeps_its_wider_matrices_int8_in_every_layer(tmp_path):
    """A GGUF whose o, gate and up are Q4_0, down Q4_0 in layer 0 and Q8_0 in layer 1, q/k/v
    f32: int4 keeps qkv and down int8 in both layers (one kind per stored matrix), the Q4_0 and
    Q8_0 blocks exactly, the f32 ones rounded as a float load; o and gate_up int4, exactly.
    Files without 4-bit layer matrices have no mix to keep; a bad name is refused."""
    from tests.test_weights import _gguf_name

    config = dataclasses.replace(TINY, head_dim=32)  # o's groups (within a head) the blocks'
    hf = _hf_tensors(config)
    raw = {}
    for name, t in hf.items():
        layer_1 = ".layers.1." in name
        if any(k in name for k in (".o_proj.", ".gate_proj.", ".up_proj.", ".down_proj.")):
            qtype = Q.Q8_0 if ".down_proj." in name and layer_1 else Q.Q4_0
            raw[_gguf_name(name)] = (ref.quantize(t, qtype), qtype)
    _write_gguf(tmp_path / "mix.gguf", config, hf, raw=raw)
    path = str(tmp_path / "mix.gguf")
    floats = weights.load_checkpoint(path)
    assert floats.config.int8_matrices == ("qkv", "down")
    ck = weights.load_checkpoint(path, weight_dtype="int4", group=32)
    for name, t in ck.params.items():
        if not isinstance(t, quant.QTensor):
            continue
        kind = "int4" if name.split(".")[-1] in ("o", "gate", "up") else "int8"
        assert t.kind == kind, name
        if name.split(".")[-1] in ("q", "k", "v", "embed", "lm_head"):
            expect = quant.quantize(floats.params[name], t.contract, "int8", 32)
            np.testing.assert_array_equal(t.q, expect.q, err_msg=name)
        else:
            np.testing.assert_array_equal(quant.dequantize_host(t), floats.params[name],
                                          err_msg=name)
    model = Llama(ck.config, ck.params)
    for layer in model.layers:
        assert (layer.qkv.kind, layer.o.kind, layer.gate_up.kind, layer.down.kind) == (
            "int8", "int4", "int4", "int8")
    q4, q8, f32 = Q.Q4_K, Q.Q8_0, Q.F32
    stored_in = {"a": "qkv", "b": "o", "c": "down"}
    assert requant.int8_matrices({"a": q8, "b": q8, "c": q8}, stored_in) == ()
    assert requant.int8_matrices({"a": f32, "b": f32, "c": f32}, stored_in) == ()
    assert requant.int8_matrices({"a": f32, "b": q4, "c": Q.Q6_K}, stored_in) == ("qkv", "down")
    with pytest.raises(ValueError, match=r"int8_matrices=\('mlp',\): 'mlp' is not one of"):
        toy_config(weight_dtype="int4", int8_matrices=("mlp",))


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


def _dequantized(params: dict, kind: str, group: int, int8_group: int) -> dict:
    """Canonical float params with every matrix quantized and dequantized on the host (numpy),
    the embedding and LM head as int8: the weights a quantized model must compute with."""
    out = {}
    for name, w in params.items():
        if name.endswith(("norm", "_bias")):
            out[name] = w
            continue
        k = "int8" if name in ("embed", "lm_head") else kind
        g = group if k == "int4" else int8_group
        out[name] = quant.dequantize_host(quant.quantize(w, weights._contract(name), k, g))
    return out


@pytest.mark.parametrize("kind,int8_group", [("int8", 0), ("int8", 8), ("int4", 0)])
@pytest.mark.parametrize("tied", [True, False])
def test_model_dequantizes_in_step_like_the_host_reference(kind, int8_group, tied):
    config = toy_config(tie_embeddings=tied, weight_dtype=kind, int4_group_size=8,
                        int8_group_size=int8_group, qkv_bias=not tied,
                        scan_layers=False)  # reads each layer's weights
    float_config = dataclasses.replace(config, weight_dtype=None)
    params = init_params(float_config, scale=0.3)
    model = Llama(config, params)
    assert isinstance(model.layers[0].qkv, quant.QuantWeight)
    assert model.embed.kind == "int8" and model.embed.group == int8_group  # the table rule
    twin = Llama(float_config, _dequantized(params, kind, 8, int8_group))
    ids = list(np.random.default_rng(1).integers(0, config.vocab_size, 13))
    _, got = run_rows(model, create_cache(config, CACHE, 1, fill=np.nan), ids, 0)
    _, want = run_rows(twin, create_cache(config, CACHE, 1, fill=np.nan), ids, 0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind,group,spec,shape,contract,view", [
    ("int8", None, "ND,DKCH->NKCH", (24, 3, 5, 8), (0,), None),  # qkv: contraction first
    ("int8", None, "NX,XD->ND", (4, 6, 40), (0, 1), (24, 40)),  # o: 2 contraction axes, 2-D
    ("int8", None, "...D,VD->...V", (70, 24), (1,), None),  # tied LM head: contraction last
    ("int8", 8, "ND,DKCH->NKCH", (24, 3, 5, 8), (0,), None),  # grouped int8 (GGUF layout)
    ("int4", 8, "ND,DKCH->NKCH", (24, 3, 5, 8), (0,), None),
    ("int4", 8, "NX,XD->ND", (4, 8, 40), (0, 1), (32, 40)),  # groups of 8 within each head
    ("int8", None, "ND,CDF->NCF", (2, 24, 40), (1,), None),  # gate_up: an output axis first
    ("int8", 8, "ND,CDF->NCF", (2, 24, 40), (1,), None),
    ("int4", 8, "ND,CDF->NCF", (2, 24, 40), (1,), None),
])
def test_cpu_chunked_einsum_equals_the_reference(monkeypatch, kind, group, spec, shape, contract,
                                                 view):
    """On one CPU device int8 and int4 run as a loop over output chunks (here 10, 8 or 5
    columns of a 1 KiB temporary; the last chunk clamped): the same product as the dequantized
    weight's."""
    monkeypatch.setattr(quant, "CPU_CHUNK_BYTES", 1024)
    rng = np.random.default_rng(3)
    t = quant.quantize(rng.standard_normal(shape).astype(np.float32), contract, kind, group)
    w = quant.QuantWeight(t, ("a",) * len(shape), lambda v, axes: nnx.Param(jax.numpy.asarray(v)))
    x = rng.standard_normal((2, 5, view[0] if view else shape[contract[-1]])).astype(np.float32)
    x = x[0] if spec.startswith("N") else x
    fn = jax.jit(lambda x: quant.einsum(spec, x, w, shape=view))
    assert "while" in fn.lower(x).as_text()  # the chunked path, not the fused one
    deq = quant.dequantize_host(t)
    want = np.einsum(spec, x, deq if view is None else deq.reshape(view))
    np.testing.assert_allclose(np.asarray(fn(x)), want, rtol=1e-5, atol=1e-5)


def test_default_int4_group_rule():
    """128 for a float checkpoint on TPU / GPU (halved until it divides the grouped widths),
    32 on CPU and from a GGUF (its blocks)."""
    assert quant.default_int4_group("tpu", "hf", (4096, 14336)) == 128
    assert quant.default_int4_group("gpu", "hf", (576, 1536)) == 64  # SmolLM2-135M
    assert quant.default_int4_group("cuda", "hf", (4096, 14336)) == 128
    assert quant.default_int4_group("tpu", "gguf", (4096, 14336)) == 32
    assert quant.default_int4_group("cpu", "hf", (4096, 14336)) == 32


def _native(t: quant.QTensor) -> quant.QuantWeight:
    """An int4 QuantWeight whose q is native 4-bit, as `quant.native_int4_params` places it."""
    w = quant.QuantWeight(t, ("a",) * len(t.shape), lambda v, axes: nnx.Param(jax.numpy.asarray(v)))
    w.q = nnx.Param(quant._to_native(w.q[...], t.contract[-1], t.group))
    return w


@pytest.mark.parametrize("rows,after", [(3, True), (40, False)])
@pytest.mark.parametrize("spec,shape,contract,view", [
    ("ND,DKCH->NKCH", (64, 3, 5, 8), (0,), None),  # qkv
    ("NX,XD->ND", (4, 16, 40), (0, 1), (64, 40)),  # o: groups of 16 within each head
    ("NF,FD->ND", (64, 24), (0,), None),  # down
    ("ND,CDF->NCF", (2, 64, 24), (1,), None),  # gate_up: an output axis first
])
def test_native_int4_einsum_equals_the_reference(spec, shape, contract, view, rows, after):
    """Native 4-bit int4 (`jnp.int4` of the weight's shape, q - 8, from the u8 packing):
    the scales-after-dot form (3 rows <= 2 x group 16) and the dequantize-before form (40
    rows) give the dequantized weight's product; the program reads the s4 values. gate_up's
    leading 2 runs the after form once per matrix (3 dots each) and the before form as one dot
    batched over the 2."""
    rng = np.random.default_rng(4)
    t = quant.quantize(rng.standard_normal(shape).astype(np.float32), contract, "int4", 16)
    w = _native(t)
    assert w.native and w.shape == shape and w.q.dtype == jax.numpy.int4
    np.testing.assert_array_equal(np.asarray(w.q[...]).astype(np.int8) + 8,
                                  quant.unpack_int4(t.q, contract[-1], t.group))
    x = rng.standard_normal((rows, view[0] if view else shape[contract[0]])).astype(np.float32)
    fn = jax.jit(lambda x: quant.einsum(spec, x, w, shape=view))
    text = fn.lower(x).as_text()
    assert "xi4>" in text
    if spec.startswith("ND,CDF"):
        assert text.count("stablehlo.dot_general") == (6 if after else 1)
    else:
        assert ("batching_dims" in text) == after  # the dot batched over the groups
    deq = quant.dequantize_host(t)
    want = np.einsum(spec, x, deq if view is None else deq.reshape(view))
    np.testing.assert_allclose(np.asarray(fn(x)), want, rtol=1e-5, atol=1e-5)


def test_native_int4_engine_compiles_nothing_after_warmup(monkeypatch):
    """The engine with int4 placed as native 4-bit (as on a TPU / GPU; forced here on the CPU):
    after warm-up the workload of tests/test_recompiles.py (prefix hits, forks, preemption)
    compiles nothing: which form an einsum takes depends only on static shapes."""
    from tests.test_recompiles import VOCAB, build, workload

    config = toy_config(vocab_size=VOCAB, max_position=64, weight_dtype="int4",
                        int4_group_size=8, scan_layers=False)  # reads layer 0's weights
    model = Llama(config, init_params(dataclasses.replace(config, weight_dtype=None), seed=7,
                                      scale=0.3))
    monkeypatch.setattr(quant, "native_int4", lambda platform: True)
    llm = build(model, "none", "none")
    assert llm.engine.runner.params["layers"][0]["qkv"]["q"].dtype == jax.numpy.int4
    requests = workload()
    llm.engine.warmup(workload=requests)
    with count_compiles() as compiles:
        llm.generate([p for p, _ in requests], [sc for _, sc in requests], use_tqdm=False)
    assert len(compiles) == 0, f"{len(compiles)} compiles after warm-up"
    stats = llm.engine.stats()
    assert stats["prefix_hits"] > 0 and stats["preemptions"] > 0, stats


def test_quantized_gguf_load_streams_into_the_same_model(tmp_path):
    """A GGUF read straight into int8 / int4 (int8 in groups of 32, its tables too): Q8_0-stored
    matrices keep the file's values exactly in int8; f32-stored ones equal quantizing the float
    load; Q8_0 to int4 lands within half an int4 step."""
    hf = _hf_tensors(TINY)
    q8 = {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.q_proj.weight",
          "model.embed_tokens.weight"}
    stored_q8 = {name for hf_name, name, _, _ in weights.hf_layout(TINY) if hf_name in q8}
    _write_gguf(tmp_path / "t.gguf", TINY, hf, quantized=q8)
    path = str(tmp_path / "t.gguf")
    floats = weights.load_checkpoint(path)
    for kind in ("int8", "int4"):
        ck = weights.load_checkpoint(path, weight_dtype=kind, group=32)
        assert ck.config.weight_dtype == kind and ck.config.int8_group_size == 32
        for name, t in ck.params.items():
            if not isinstance(t, quant.QTensor):
                np.testing.assert_array_equal(t, floats.params[name])
                continue
            want = floats.params[name]
            int8 = kind == "int8" or name in ("embed", "lm_head")
            assert t.kind == ("int8" if int8 else kind) and t.zero is not None, name
            if name in stored_q8 and int8:
                np.testing.assert_array_equal(quant.dequantize_host(t), want, err_msg=name)
            elif name in stored_q8:
                err = np.abs(quant.dequantize_host(t) - want)
                assert err.max() <= 0.5 * np.abs(want).max() / 7, name
            else:
                expect = quant.quantize(want, t.contract, t.kind, t.group)
                np.testing.assert_array_equal(t.q, expect.q, err_msg=name)


def test_sharded_quantized_model_equals_one_device():
    """model:4 (and data:2 x model:4 for grouped int8 and int4): q, scales and zero points
    split by the weight's own rules, int4 also as native 4-bit (scales after the dot: 9 rows);
    the logits equal the single-device ones."""
    from jaxinfer.engine.steps import split_model

    for kind, int8_group, spec, native in (
            ("int8", 0, "model:4", False), ("int8", 8, "data:2,model:4", False),
            ("int4", 0, "data:2,model:4", False), ("int4", 0, "model:4", True),
            ("int4", 0, "data:2,model:4", True)):
        config = toy_config(weight_dtype=kind, int4_group_size=8, int8_group_size=int8_group,
                            num_kv_heads=4, ffn_dim=64, scan_layers=False)  # reads layer 0's
        model = Llama(config, init_params(dataclasses.replace(config, weight_dtype=None)))
        ids = list(np.random.default_rng(2).integers(0, config.vocab_size, 9))
        _, want = run_rows(model, create_cache(config, CACHE, 1), ids, 0)
        mesh = sharding.make_mesh(spec)
        graph, params = split_model(model, mesh)
        if native:  # as on a TPU / GPU: s4 of the weight's shape, in the same shardings
            params = quant.native_int4_params(model, params)
            assert params["layers"][0]["down"]["q"].dtype == jax.numpy.int4
            assert params["layers"][0]["down"]["q"].shape == (64, config.embed_dim)
        layer = params["layers"][0]
        assert layer["down"]["q"].sharding.spec[0] == "model"  # ffn split, packed or not
        assert layer["gate_up"]["scale"].sharding.spec[2] == "model"  # scales split like q
        if kind == "int4" or int8_group:  # groups along the split ffn axis: split with it
            assert layer["down"]["scale"].sharding.spec[0] == "model"
            assert layer["down"]["zero"].sharding.spec[0] == "model"
        sharded = nnx.merge(graph.graphdef, params)
        cache = CacheConfig(page_size=4, max_seq_len=64)
        kv = create_cache(config, cache, sharding.data_shards(mesh), mesh=mesh)
        with jax.set_mesh(mesh):
            _, got = run_rows(sharded, kv, ids, 0)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,source", [("int8", "hf"), ("int8", "gguf"), ("int4", "hf")])
def test_orbax_stores_and_restores_quantized_arrays_sharded(kind, source, tmp_path):
    """An HF directory (a GGUF: int8 in groups of 32) read into int8/int4, saved with orbax,
    restored into model:4 shards: every q/scale/zero array in its rule sharding with its stored
    values, same logits."""
    from jaxinfer.checkpoint import orbax as orbax_ckpt
    from tests.test_orbax import _all_logits, _check_restored

    config = toy_config(vocab_size=128, num_q_heads=8, num_kv_heads=4, ffn_dim=64)
    if source == "gguf":
        config = dataclasses.replace(TINY, num_q_heads=8, num_kv_heads=4, head_dim=8)
        _write_gguf(tmp_path / "t.gguf", config, _hf_tensors(config))
        path = str(tmp_path / "t.gguf")
    else:
        params = init_params(config, seed=3, scale=0.3)
        weights.save_hf(weights.Checkpoint(config=config, params=params, path="toy",
                                           format="hf", metadata={}), str(tmp_path / "hf"))
        path = str(tmp_path / "hf")
    ckpt = weights.load_checkpoint(path, weight_dtype=kind, group=8)
    assert ckpt.config.int8_group_size == (32 if source == "gguf" else 0)
    ckpt = dataclasses.replace(ckpt, format="hf")  # the toy GGUF has no tokenizer to convert
    orbax_ckpt.save_orbax(ckpt, str(tmp_path / "orbax"))
    original = Llama(ckpt.config, ckpt.params)
    restored, restored_config, _ = orbax_ckpt.load_orbax(str(tmp_path / "orbax"),
                                                         mesh=sharding.make_mesh("model:4"))
    assert restored_config == original.config and restored_config.weight_dtype == kind
    _check_restored(restored, original, "model:4")
    ids = [5, 99, 17, 3, 64, 21, 8, 127]
    mesh = sharding.make_mesh("model:4")
    got = _all_logits(restored, ids, mesh)
    # The original placed on the same mesh: bitwise; on one device: within f32 rounding (the
    # sharded projections sum their shards' partial products in another order).
    np.testing.assert_array_equal(got, _all_logits(original, ids, mesh))
    assert rel_err(got, _all_logits(original, ids)) < TOLERANCE["float32"][0]
    with pytest.raises(ValueError, match=f"stores {kind} weights; weight_dtype='float32'"):
        from jaxinfer.checkpoint.loading import load_model

        load_model(RunConfig(model_path=str(tmp_path / "orbax"), weight_dtype="float32"))


def test_gate_up_multiplies_in_place_on_cpu():
    """gate_up [2, D, F] (SmolLM2-135M's, f32) multiplies as a dot batched over its 2 (x
    broadcast): XLA:CPU's program holds no temporary near the weight's size (as a plain dot
    "ND,CDF->NCF" it transposed the weight into a [D, 2 x F] copy every step), and the product
    is the einsum's. The weight is an argument, as in a step (a constant would be folded).
    Quantized weights on one CPU device take the chunked form
    (`test_cpu_chunked_einsum_equals_the_reference`)."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((2, 576, 1536)).astype(np.float32)
    x = rng.standard_normal((8, 576)).astype(np.float32)
    step = jax.jit(lambda x, w: quant.einsum("ND,CDF->NCF", x, w))
    temp = step.lower(x, w).compile().memory_analysis().temp_size_in_bytes
    assert temp < w.nbytes // 8, temp
    np.testing.assert_allclose(np.asarray(step(x, w)), np.einsum("ND,CDF->NCF", x, w),
                               rtol=1e-4, atol=1e-3)
