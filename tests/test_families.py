"""The architecture registry and the Qwen3 family.

Qwen3 against Hugging Face transformers on a small randomly initialised `Qwen3ForCausalLM`
saved as an HF directory (tests/fixtures/hf_qwen3_toy, made by `scripts/make_hf_fixtures.py
--model=qwen3-toy`): logits at every prompt position, and greedy tokens through the engine.
Bad input: unregistered architectures list the registered ones; a multimodal Gemma 3 checkpoint
is refused as such.
"""

from __future__ import annotations

import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import families
from jaxinfer.checkpoint import hf as ckpt_hf
from jaxinfer.checkpoint.tokenizer import Tokenizer
from jaxinfer.checkpoint.weights import Checkpoint, load_checkpoint, save_hf
from jaxinfer.config import CacheConfig, EngineConfig, RopeConfig, SamplingConfig
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.engine.llm import LLM
from jaxinfer.model import CHUNK, Llama, StepBatch, init_params
from tests.helpers import assert_close, toy_config

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
QWEN3_DIR = os.path.join(FIXTURES, "hf_qwen3_toy")
CACHE = CacheConfig(page_size=8, max_seq_len=64)


@pytest.fixture(scope="module")
def qwen3():
    ckpt = load_checkpoint(QWEN3_DIR)
    return Llama(ckpt.config, ckpt.params), np.load(os.path.join(FIXTURES,
                                                                 "hf_qwen3_toy_reference.npz"))


@jax.jit
def _forward(model, ids):
    t = ids.shape[0]
    cache = create_cache(model.config, CACHE, 1)
    positions = jnp.arange(t)[None]
    batch = StepBatch.per_slot(ids[None], positions, positions < t, cache.page_table,
                               jnp.asarray([t]), num_pages_read=CACHE.pages_per_seq, kind=CHUNK)
    return model(batch, cache.k_pages, cache.v_pages)[0]


def _prefill_logits(model, ids: list[int]) -> np.ndarray:
    """f32[T, V]: one prefill of `ids` through the paged cache."""
    return np.asarray(_forward(model, jnp.asarray(ids, jnp.int32)))


def test_qwen3_config_reads_its_features(qwen3):
    c = qwen3[0].config
    assert (c.arch, c.qk_norm, c.qkv_bias, c.tie_embeddings, c.head_dim) == (
        "qwen3", True, False, False, 32)
    assert c.rope.theta == 1e6 and c.embed_dim == 64 and c.num_q_heads * c.head_dim == 128


@pytest.mark.parametrize("name", ["a", "b"])
def test_qwen3_logits_match_hf(qwen3, name):
    model, ref = qwen3
    ours = _prefill_logits(model, ref[name + "_prompt"].tolist())
    assert_close(ours, ref[name + "_logits"], scale=10)


def test_qwen3_greedy_tokens_match_hf(qwen3):
    model, ref = qwen3
    llm = LLM(model, None, cache=CACHE, engine=EngineConfig(max_slots=2, prefill_buckets=(16,)))
    prompts = [ref[n + "_prompt"].tolist() for n in ("a", "b")]
    outs = llm.generate(prompts, SamplingConfig(max_new_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    for name, out in zip(("a", "b"), outs):
        want, margins = ref[name + "_greedy"].tolist(), ref[name + "_margins"]
        tie = next((i for i, m in enumerate(margins) if m < 1e-3), len(want))
        assert out.token_ids[:tie] == want[:tie], name


def test_qwen3_directory_round_trip(qwen3, tmp_path):
    model, _ = qwen3
    ckpt = load_checkpoint(QWEN3_DIR)
    save_hf(ckpt, str(tmp_path))
    back = load_checkpoint(str(tmp_path))
    assert back.config == ckpt.config
    for name, value in ckpt.params.items():
        np.testing.assert_array_equal(back.params[name], value)


def test_qwen3_chat_template_thinking_tags():
    template = families.family("qwen3").chat_template
    tok = Tokenizer.from_gguf_metadata(_tiny_vocab(), default_chat_template=template)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhello"},
                {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(messages, enable_thinking=False)
    assert text == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
                    "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
                    "<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(messages[:1]).endswith("<|im_start|>assistant\n")


def _tiny_vocab() -> dict:
    tokens = ["<unk>", "<|im_end|>", "a", "b"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3, 1, 1], "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": 0}


def test_family_configs_round_trip_through_hf_config_json():
    for arch, extra in [("llama", {}), ("qwen2", dict(qkv_bias=True)),
                        ("mistral", dict(sliding_window=32)), ("qwen3", dict(qk_norm=True)),
                        ("gemma3", dict(qk_norm=True, post_norms=True, norm_plus_one=True,
                                        scale_embeddings=True, activation="gelu_tanh",
                                        query_pre_attn_scalar=8.0, sliding_window=16,
                                        sliding_window_pattern=3, tie_embeddings=True,
                                        rope_local=toy_config().rope)),
                        ("qwen3_moe", dict(qk_norm=True, num_experts=8, experts_per_token=2,
                                           expert_ffn_dim=16, dense_layers=(2,),
                                           moe_layer_step=1)),
                        ("qwen2_moe", dict(qkv_bias=True, num_experts=8, experts_per_token=2,
                                           expert_ffn_dim=16, router="softmax_topk",
                                           shared_expert_ffn_dim=24,
                                           moe_layer_step=2)),
                        ("mixtral", dict(num_experts=8, experts_per_token=2)),
                        ("gpt_oss", dict(qkv_bias=True, o_bias=True, attention_sinks=True,
                                         sliding_window=16, sliding_window_pattern=2,
                                         activation="swiglu_clamped", swiglu_limit=5.0,
                                         num_experts=8, experts_per_token=4,
                                         router="topk_softmax", router_bias=True,
                                         expert_bias=True,
                                         rope=RopeConfig(theta=1e4, type="yarn", factor=8.0,
                                                         original_max_position=64,
                                                         attention_factor=1.2)))]:
        config = toy_config(arch=arch, num_layers=6, scan_layers=False, **extra)  # HF's layout
        assert ckpt_hf.config_from_hf(ckpt_hf.config_to_hf(config)) == config, arch


def test_gemma3_toy_hf_directory_round_trip(tmp_path):
    """Gemma 3's norm names and (1 + w) norms survive the HF layout both ways."""
    config = toy_config(arch="gemma3", num_layers=3, qk_norm=True, post_norms=True,
                        norm_plus_one=True, scale_embeddings=True, activation="gelu_tanh",
                        query_pre_attn_scalar=8.0, sliding_window=16, sliding_window_pattern=3,
                        tie_embeddings=True, rope_local=toy_config().rope, scan_layers=False)
    params = init_params(config, seed=1)
    save_hf(Checkpoint(config, params, str(tmp_path), "hf", {}), str(tmp_path))
    names = ckpt_hf.read_safetensors(os.path.join(tmp_path, "model.safetensors"))
    assert "model.layers.2.post_feedforward_layernorm.weight" in names
    back = load_checkpoint(str(tmp_path))
    assert back.config == config
    for name, value in params.items():
        np.testing.assert_array_equal(back.params[name], value)
    assert [config.layer_window(i) for i in range(3)] == [16, 16, None]


def test_unregistered_and_multimodal_checkpoints_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unregistered architecture 'phi3'; registered: "
                                         "gemma3, gpt_oss, llama, mistral, mixtral, qwen2, "
                                         "qwen2_moe, qwen3, qwen3_moe"):
        families.family("phi3")
    multimodal = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                  "text_config": {}, "vision_config": {}}
    with pytest.raises(ValueError, match="only the Gemma 3 text decoder"):
        ckpt_hf.config_from_hf(multimodal)
    w = gguf.GGUFWriter(str(tmp_path / "mm.gguf"), "gemma3")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="only the Gemma 3 text decoder"):
        load_checkpoint(str(tmp_path / "mm.gguf"))
    qwen3 = ckpt_hf.read_json(os.path.join(QWEN3_DIR, "config.json"))
    with pytest.raises(ValueError, match="use_sliding_window=true is not supported"):
        ckpt_hf.config_from_hf({**qwen3, "use_sliding_window": True, "sliding_window": 64})
