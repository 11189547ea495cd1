"""Gemma 3 text decoder (`Gemma3ForCausalLM`, e.g. gemma-3-270m / 1b).

The block: interleaved local (sliding-window) and global layers, five local per global
(`sliding_window_pattern` 6), each kind with its own RoPE base (local 10k, global 1M with the
checkpoint's scaling); RMSNorm over each head's q and k; pre- and post-norms around attention
and the MLP; RMSNorm scaling by (1 + w); GeGLU with tanh-approximate GELU; embeddings times
sqrt(D); scores scaled by query_pre_attn_scalar^-1/2; tied embeddings. Multimodal checkpoints
(`Gemma3ForConditionalGeneration`) are refused: only the text decoder is supported.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.config import ModelConfig, RopeConfig
from jaxinfer.families import base

LOCAL_THETA, GLOBAL_THETA, PATTERN = 10_000.0, 1_000_000.0, 6
_FEATURES = dict(qk_norm=True, post_norms=True, norm_plus_one=True, scale_embeddings=True,
                 activation="gelu_tanh")
_TEXT_ONLY = ("only the Gemma 3 text decoder (Gemma3ForCausalLM) is supported; this is a "
              "multimodal checkpoint")

# Gemma's chat template (text turns): a system message is folded into the first user turn,
# the assistant's role is "model", turns end with <end_of_turn>.
CHAT_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set first_user_prefix = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
{{- message['content'] | trim }}
{{- '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<start_of_turn>model\\n' }}
{%- endif %}
"""


def _ropes(cfg: dict) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) RoPE from transformers-5 `rope_parameters` keyed by layer type, or the
    legacy rope_theta / rope_scaling / rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        return (base.rope_from_hf(full, full.get("rope_theta", GLOBAL_THETA)),
                base.rope_from_hf(local, local.get("rope_theta", LOCAL_THETA)))
    return (base.rope_from_hf(cfg.get("rope_scaling") or {}, cfg.get("rope_theta", GLOBAL_THETA)),
            RopeConfig(theta=float(cfg.get("rope_local_base_freq", LOCAL_THETA))))


def from_hf(cfg: dict) -> ModelConfig:
    multimodal = "Gemma3ForConditionalGeneration" in (cfg.get("architectures") or [])
    if multimodal or "text_config" in cfg or "vision_config" in cfg:
        raise ValueError(_TEXT_ONLY)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"{key}={cfg[key]!r}: logit soft-capping is not supported (Gemma 3 "
                             "checkpoints have none)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true (an encoder variant) is not supported")
    shapes = base.hf_shapes(cfg, tie_default=True)
    rope, local = _ropes(cfg)
    return ModelConfig(arch="gemma3", **shapes, rope=rope, rope_local=local, **_FEATURES,
                       query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
                       sliding_window=int(cfg.get("sliding_window") or 4096),
                       sliding_window_pattern=base.sliding_pattern(cfg, shapes["num_layers"],
                                                                   PATTERN))


def from_gguf(md: dict, tensor_names: set, rope_freqs: np.ndarray | None) -> ModelConfig:
    """llama.cpp's gemma3 metadata; the local RoPE base (10k), the 5:1 pattern and the query
    scale (head_dim) are fixed by llama.cpp's gemma3 model rather than stored."""
    if any(n.startswith(("v.", "mm.")) for n in tensor_names):
        raise ValueError(_TEXT_ONLY)
    shapes = base.gguf_shapes(md, "gemma3", tensor_names, rope_freqs)
    return ModelConfig(arch="gemma3", **shapes, rope_local=RopeConfig(theta=LOCAL_THETA),
                       **_FEATURES, query_pre_attn_scalar=float(shapes["head_dim"]),
                       sliding_window=int(base.gguf_get(md, "gemma3", "attention.sliding_window")),
                       sliding_window_pattern=PATTERN)


def to_hf(config: ModelConfig) -> dict:
    c = config
    cfg = base.hf_shapes_to_hf(c, "Gemma3ForCausalLM", "gemma3_text")
    local = c.rope_local or c.rope
    cfg["rope_parameters"] = {
        "full_attention": {"rope_type": "default", **(base.rope_to_hf(c.rope) or {}),
                           "rope_theta": c.rope.theta},
        "sliding_attention": {"rope_type": "default", **(base.rope_to_hf(local) or {}),
                              "rope_theta": local.theta},
    }
    cfg.update(
        rope_local_base_freq=local.theta, hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=c.query_pre_attn_scalar or c.head_dim,
        sliding_window=c.sliding_window, final_logit_softcapping=None,
        attn_logit_softcapping=None,
        layer_types=base.layer_types(c))
    return cfg


GEMMA3 = base.Family(
    name="gemma3", hf_classes=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    hf_model_types=("gemma3_text", "gemma3"), gguf_arch="gemma3", from_hf=from_hf,
    from_gguf=from_gguf, to_hf=to_hf,
    norms={"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
           "mlp_norm": "pre_feedforward_layernorm",
           "post_mlp_norm": "post_feedforward_layernorm",
           "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"},
    gguf_layer_names={**base.GGUF_LAYER_NAMES,
                      "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                      "post_attention_norm.weight": "post_attention_layernorm.weight",
                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    gguf_norm_shift=1.0, chat_template=CHAT_TEMPLATE)
