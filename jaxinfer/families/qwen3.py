"""Qwen3 (dense): the Llama block with RMSNorm over each head's q and k before RoPE (QK-norm),
no q/k/v biases, an explicit head_dim, and a ChatML template with thinking tags."""

from __future__ import annotations

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.families import base

# Qwen3's ChatML template (text turns; tool calls are not rendered): earlier assistant turns lose
# their <think>...</think> part; `enable_thinking=False` pre-fills an empty thinking block.
CHAT_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set content = message.content %}
{%- if '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""


def from_hf(cfg: dict) -> ModelConfig:
    if cfg.get("use_sliding_window"):  # windows on the layers past max_window_layers only
        raise ValueError("use_sliding_window=true is not supported for Qwen3 (no released "
                         "checkpoint sets it); every layer attends over the whole context")
    return ModelConfig(arch="qwen3", **base.hf_shapes(cfg), rope=base.hf_rope(cfg), qk_norm=True,
                       qkv_bias=bool(cfg.get("attention_bias", False)))


def from_gguf(md: dict, tensor_names: set, rope_freqs: np.ndarray | None) -> ModelConfig:
    return ModelConfig(arch="qwen3", **base.gguf_shapes(md, "qwen3", tensor_names, rope_freqs),
                       qk_norm=True, qkv_bias="blk.0.attn_q.bias" in tensor_names)


def to_hf(config: ModelConfig) -> dict:
    cfg = base.hf_shapes_to_hf(config, "Qwen3ForCausalLM", "qwen3")
    if config.sliding_window is not None:
        raise ValueError(f"sliding_window={config.sliding_window}: a Qwen3 config.json has no "
                         "sliding window on every layer")
    cfg.update(hidden_act="silu", attention_bias=config.qkv_bias, use_sliding_window=False,
               sliding_window=None)
    return cfg


QWEN3 = base.Family(name="qwen3", hf_classes=("Qwen3ForCausalLM",), hf_model_types=("qwen3",),
                    gguf_arch="qwen3", from_hf=from_hf, from_gguf=from_gguf, to_hf=to_hf,
                    chat_template=CHAT_TEMPLATE)
