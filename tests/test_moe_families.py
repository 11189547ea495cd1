"""The mixture-of-experts families against Hugging Face transformers.

Each family's toy (tests/fixtures/hf_{family}_toy: random weights, a few layers, 8-16 experts,
top 2-4; made by `scripts/make_hf_fixtures.py --model=moe-toys`, see
scripts/hf_moe_fixtures.py for what each exercises) loads from its HF directory: its logits at
every prompt position within 1e-4 (relative, f32) of transformers', and 32 greedy tokens through
the serving engine identical to transformers' (its KV cache). int8 / int4 experts run through
the engine. Bad input: an expert count below k and unsupported mixture variants fail before any
weight loads.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import families
from jaxinfer.checkpoint import hf as ckpt_hf
from jaxinfer.checkpoint.weights import load_checkpoint, save_hf
from jaxinfer.config import CacheConfig, EngineConfig, ModelConfig, SamplingConfig
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.engine.llm import LLM
from jaxinfer.model import CHUNK, Llama, StepBatch
from tests.helpers import rel_err

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")
PROMPTS = ("a", "b")
# tests/test_expert_parallel.py's pool and buckets: the two prompts (13 and 20 tokens) and their
# 32 greedy tokens need 3 step variants (a chunk at 1 page, decodes at 1 and 2), where pages of
# 8 and chunk buckets 16 and 32 make 4.
CACHE = CacheConfig(page_size=32, max_seq_len=64)
ENGINE = EngineConfig(max_slots=2, prefill_buckets=(32,))
MAX_REL_ERR = 1e-4  # f32 against transformers' f32


def _dir(family: str) -> str:
    return os.path.join(FIXTURES, f"hf_{family}_toy")


@pytest.fixture(scope="module", params=FAMILIES)
def toy(request):
    ckpt = load_checkpoint(_dir(request.param))
    ref = np.load(os.path.join(FIXTURES, f"hf_{request.param}_toy_reference.npz"))
    return Llama(ckpt.config, ckpt.params), ref


@jax.jit
def _forward(model, ids):
    t = ids.shape[0]
    cache = create_cache(model.config, CACHE, 1)
    positions = jnp.arange(t)[None]
    batch = StepBatch.per_slot(ids[None], positions, positions < t, cache.page_table,
                               jnp.asarray([t]), num_pages_read=CACHE.pages_per_seq, kind=CHUNK)
    return model(batch, cache.k_pages, cache.v_pages)[0]


def test_logits_match_hf(toy):
    model, ref = toy
    for name in PROMPTS:
        ours = np.asarray(_forward(model, jnp.asarray(ref[name + "_prompt"])))
        assert rel_err(ours, ref[name + "_logits"]) <= MAX_REL_ERR, name


def _generate(model, ref, new_tokens: int = 32) -> list[list[int]]:
    llm = LLM(model, None, cache=CACHE, engine=ENGINE)
    prompts = [ref[n + "_prompt"].tolist() for n in PROMPTS]
    outs = llm.generate(prompts, SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [out.token_ids for out in outs]


def test_greedy_tokens_through_the_engine_match_hf(toy):
    model, ref = toy
    for name, ids in zip(PROMPTS, _generate(model, ref)):
        assert ids == ref[name + "_greedy"].tolist(), name


def test_configs_read_their_features():
    def read(family):
        return ckpt_hf.config_from_hf(ckpt_hf.read_json(os.path.join(_dir(family),
                                                                     "config.json")))

    q3, q2, mx, oss = (read(f) for f in FAMILIES)
    assert (q3.arch, q3.num_experts, q3.experts_per_token, q3.moe_ffn_dim, q3.router,
            q3.dense_layers, q3.qk_norm) == ("qwen3_moe", 16, 4, 16, "softmax_topk_norm", (1,),
                                             True)
    assert [q3.is_moe(i) for i in range(3)] == [True, False, True]
    assert (q2.shared_expert_ffn_dim, q2.router, q2.qkv_bias, q2.moe_layer_step) == (
        48, "softmax_topk", True, 2)
    assert [q2.is_moe(i) for i in range(4)] == [False, True, False, True]
    assert (mx.num_experts, mx.experts_per_token, mx.moe_ffn_dim, mx.router) == (
        8, 2, 32, "softmax_topk_norm")
    assert (oss.router, oss.router_bias, oss.expert_bias, oss.attention_sinks, oss.o_bias,
            oss.activation, oss.swiglu_limit, oss.sliding_window) == (
        "topk_softmax", True, True, True, True, "swiglu_clamped", 2.0, 8)
    assert [oss.layer_window(i) for i in range(2)] == [8, None]
    assert (oss.rope.type, oss.rope.factor, oss.rope.original_max_position,
            oss.rope.truncate) == ("yarn", 32.0, 4096, False)
    assert oss.rope.attention_scale == pytest.approx(0.1 * np.log(32.0) + 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_directory_round_trip(family, tmp_path):
    ckpt = load_checkpoint(_dir(family))
    save_hf(ckpt, str(tmp_path))
    back = load_checkpoint(str(tmp_path))
    assert back.config == ckpt.config
    for name, value in ckpt.params.items():
        np.testing.assert_array_equal(back.params[name], value, err_msg=name)


@pytest.mark.parametrize("weight_dtype,max_err", [("int8", 0.05), ("int4", 0.5)])
def test_quantized_experts_run_through_the_engine(weight_dtype, max_err):
    """int8 / int4 experts (stored as `quant.QuantWeight`s with the expert axis): logits near
    transformers' (loose: a quantization error can change a routing decision) and greedy
    generation through the engine."""
    ckpt = load_checkpoint(_dir("qwen3_moe"), weight_dtype=weight_dtype)
    gate_up = ckpt.params["layers.0.experts_gate_up"]
    assert (gate_up.kind, gate_up.shape) == (weight_dtype, (16, 2, 32, 16))
    assert isinstance(ckpt.params["layers.0.router"], np.ndarray)  # the router stays float
    model = Llama(ckpt.config, ckpt.params)
    ref = np.load(os.path.join(FIXTURES, "hf_qwen3_moe_toy_reference.npz"))
    ours = np.asarray(_forward(model, jnp.asarray(ref["a_prompt"])))
    assert rel_err(ours, ref["a_logits"]) <= max_err
    outs = _generate(model, ref, new_tokens=8)
    assert [len(ids) for ids in outs] == [8, 8]


def _toy_cfg(family: str) -> dict:
    return ckpt_hf.read_json(os.path.join(_dir(family), "config.json"))


def test_bad_expert_counts_fail_before_weights_load(tmp_path):
    cfg = {**_toy_cfg("mixtral"), "num_experts_per_tok": 9}
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights at all
    with pytest.raises(ValueError, match=r"experts_per_token=9 must be in \[1, num_experts=8\]"):
        load_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="experts_per_token=2 needs num_experts > 0"):
        ModelConfig(vocab_size=8, embed_dim=8, num_layers=1, num_q_heads=1, num_kv_heads=1,
                    head_dim=8, ffn_dim=8, experts_per_token=2)
    with pytest.raises(ValueError, match="router='sigmoid' is not one of"):
        ModelConfig(vocab_size=8, embed_dim=8, num_layers=1, num_q_heads=1, num_kv_heads=1,
                    head_dim=8, ffn_dim=8, num_experts=4, experts_per_token=2, router="sigmoid")


@pytest.mark.parametrize("cfg,match", [
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
     "deepseek_v3 needs multi-head latent attention"),
    ({"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text"},
     "llama4_text needs interleaved chunked attention"),
    ({**_toy_cfg("qwen3_moe"), "kv_lora_rank": 512},
     r"kv_lora_rank=512: multi-head latent attention \(MLA"),
    ({**_toy_cfg("qwen3_moe"), "n_group": 8, "topk_group": 4},
     "grouped top-k routing"),
    ({**_toy_cfg("mixtral"), "scoring_func": "sigmoid"}, "a sigmoid router is not supported"),
])
def test_unsupported_moe_variants_are_named_before_weights_load(tmp_path, cfg, match):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        load_checkpoint(str(tmp_path))


def test_gpt_oss_sinks_through_the_pallas_kernels_match_hf():
    """gpt-oss's attention sinks in the Pallas kernels (`--attention_impl=pallas`; Triton in
    interpret mode on CPU): its prompt chunks through the ragged kernel, its decode steps
    through the decode kernel, on its full-attention and sliding-window layers alike, give
    transformers' 32 greedy tokens."""
    ckpt = load_checkpoint(_dir("gpt_oss"))
    ref = np.load(os.path.join(FIXTURES, "hf_gpt_oss_toy_reference.npz"))
    assert ckpt.config.attention_sinks and ckpt.config.sliding_window
    llm = LLM(Llama(ckpt.config, ckpt.params), None, cache=CACHE,
              engine=dataclasses.replace(ENGINE, attention_impl="pallas"))
    assert llm.engine.runner.attention_impl == "pallas"
    outs = llm.generate([ref[n + "_prompt"].tolist() for n in PROMPTS],
                        SamplingConfig(max_new_tokens=32, ignore_eos=True), use_tqdm=False)
    for name, out in zip(PROMPTS, outs):
        assert out.token_ids == ref[name + "_greedy"].tolist(), name


def test_registry_lists_the_moe_families():
    assert {"qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"} <= set(families.FAMILIES)
    assert families.for_gguf("qwen3moe").name == "qwen3_moe"


def test_yarn_rope_matches_hf():
    """YaRN inverse frequencies and attention scaling against transformers'
    `_compute_yarn_parameters` (tests/fixtures/hf_yarn_reference.json: gpt-oss's parameters,
    the default truncated ramp, an attention factor from mscale / mscale_all_dim), read through
    the config.json path (`families.base.rope_from_hf`)."""
    from jaxinfer.families.base import rope_from_hf
    from jaxinfer.model.rope import rope_inv_freq

    cases = ckpt_hf.read_json(os.path.join(FIXTURES, "hf_yarn_reference.json"))
    for name, case in cases.items():
        params = case["rope_parameters"]
        rope = rope_from_hf(params, params["rope_theta"])
        np.testing.assert_allclose(rope_inv_freq(rope, case["head_dim"]), case["inv_freq"],
                                   rtol=1e-6, err_msg=name)
        assert rope.attention_scale == pytest.approx(case["attention_scaling"], rel=1e-6), name
