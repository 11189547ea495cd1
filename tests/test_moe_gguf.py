"""Mixture-of-experts GGUFs: llama.cpp's stacked expert tensors (`ffn_{gate,up,down}_exps`,
`ffn_gate_inp`), written here from the Hugging Face toys (tests/fixtures/hf_*_toy) the way
llama.cpp's converter lays them out: a Mixtral as a "llama" GGUF with `llama.expert_count`
(q/k rows permuted), a Qwen3-MoE as `qwen3moe` (its dense layer without a router). The f32
GGUFs must give transformers' logits; a Q8_0 one loads with its blocks kept as int8 groups."""

from __future__ import annotations

import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoint import hf as ckpt_hf
from jaxinfer.checkpoint.weights import load_checkpoint
from jaxinfer.model import Llama
from jaxinfer.model.quant import dequantize_host
from tests.helpers import rel_err
from tests.test_moe_families import FIXTURES, _forward

Q8_0 = gguf.GGMLQuantizationType.Q8_0
ATTN = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
        "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
        "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
        "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
        "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
        "mlp.down_proj.weight": "ffn_down"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (rotate-half pairs -> interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _write_gguf(family: str, arch: str, path: str, *, expert_type=None) -> None:
    folder = os.path.join(FIXTURES, f"hf_{family}_toy")
    cfg = ckpt_hf.read_json(os.path.join(folder, "config.json"))
    hf = {k: np.asarray(v, np.float32)
          for k, v in ckpt_hf.read_safetensors(os.path.join(folder, "model.safetensors")).items()}
    e, d = cfg.get("num_local_experts", cfg.get("num_experts")), cfg["hidden_size"]
    w = gguf.GGUFWriter(path, arch)
    for key, value in [("block_count", cfg["num_hidden_layers"]), ("embedding_length", d),
                       ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", cfg["num_attention_heads"]),
                       ("attention.head_count_kv", cfg["num_key_value_heads"]),
                       ("attention.key_length", cfg.get("head_dim") or d
                        // cfg["num_attention_heads"]),
                       ("context_length", cfg["max_position_embeddings"]),
                       ("vocab_size", cfg["vocab_size"]), ("expert_count", e),
                       ("expert_used_count", cfg["num_experts_per_tok"])]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    if "moe_intermediate_size" in cfg:
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    w.add_tensor("output.weight", hf["lm_head.weight"])
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf_name, name in ATTN.items():
            if p + hf_name in hf:
                t = hf[p + hf_name]
                w.add_tensor(f"blk.{i}.{name}.weight",
                             _permute(t, heads[name]) if arch == "llama" and name in heads else t)
        experts = "block_sparse_moe" if arch == "llama" else "mlp"
        if p + f"{experts}.gate.weight" not in hf:
            continue  # a dense layer
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", hf[p + f"{experts}.gate.weight"])
        names = ({"gate": "w1", "up": "w3", "down": "w2"} if arch == "llama" else
                 {part: f"{part}_proj" for part in ("gate", "up", "down")})
        for part, hf_part in names.items():
            stacked = np.stack([hf[f"{p}{experts}.experts.{x}.{hf_part}.weight"]
                                for x in range(e)])
            if expert_type is None:
                w.add_tensor(f"blk.{i}.ffn_{part}_exps.weight", stacked)
            else:
                w.add_tensor(f"blk.{i}.ffn_{part}_exps.weight",
                             gguf.quants.quantize(stacked, expert_type), raw_dtype=expert_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family,arch", [("mixtral", "llama"), ("qwen3_moe", "qwen3moe")])
def test_f32_gguf_experts_give_hf_logits(family, arch, tmp_path):
    path = str(tmp_path / f"{family}.gguf")
    _write_gguf(family, arch, path)
    ckpt = load_checkpoint(path)
    hf = load_checkpoint(os.path.join(FIXTURES, f"hf_{family}_toy")).config
    assert ckpt.config.arch == family
    assert (ckpt.config.num_experts, ckpt.config.experts_per_token, ckpt.config.moe_ffn_dim,
            ckpt.config.dense_layers, ckpt.config.router) == (
        hf.num_experts, hf.experts_per_token, hf.moe_ffn_dim, hf.dense_layers, hf.router)
    ref = np.load(os.path.join(FIXTURES, f"hf_{family}_toy_reference.npz"))
    ours = np.asarray(_forward(Llama(ckpt.config, ckpt.params), jnp.asarray(ref["a_prompt"])))
    assert rel_err(ours, ref["a_logits"]) <= 1e-4


def test_q8_0_experts_keep_their_blocks_as_int8_groups(tmp_path):
    path = str(tmp_path / "mixtral_q8.gguf")
    _write_gguf("mixtral", "llama", path, expert_type=Q8_0)
    dense = load_checkpoint(path)  # the Q8_0 blocks decoded to f32
    ckpt = load_checkpoint(path, weight_dtype="int8")
    gate_up = ckpt.params["layers.0.experts_gate_up"]
    assert (gate_up.kind, gate_up.group, gate_up.shape) == ("int8", 32, (8, 2, 32, 32))
    # exact: the file's integers and block scales, as its f32 decoding
    np.testing.assert_array_equal(dequantize_host(gate_up),
                                  dense.params["layers.0.experts_gate_up"])
    ref = np.load(os.path.join(FIXTURES, "hf_mixtral_toy_reference.npz"))
    ours = np.asarray(_forward(Llama(ckpt.config, ckpt.params), jnp.asarray(ref["a_prompt"])))
    assert rel_err(ours, ref["a_logits"]) <= 5e-2  # the f32 attention is requantized


def test_unsupported_gguf_mixture_is_named_before_weights_load(tmp_path):
    path = str(tmp_path / "ds.gguf")
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'deepseek2' \(deepseek2 "
                                         "needs multi-head latent attention"):
        load_checkpoint(path)
