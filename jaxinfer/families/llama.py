"""The Llama family: Llama 2/3.x, SmolLM/SmolLM2 and Mistral (arch "llama", "mistral") and Qwen2
/ Qwen2.5 ("qwen2"): pre-norm GQA attention with RoPE, SwiGLU, RMSNorm. Qwen2 adds q/k/v
biases; Mistral (and Qwen2 with `use_sliding_window`) a sliding window on every layer.
Chat templates come with their checkpoints."""

from __future__ import annotations

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.families import base, mixtral


def _from_hf(arch: str):
    def from_hf(cfg: dict) -> ModelConfig:
        window = None
        if arch == "mistral" or (arch == "qwen2" and cfg.get("use_sliding_window")):
            window = cfg.get("sliding_window")
        return ModelConfig(arch=arch, **base.hf_shapes(cfg), rope=base.hf_rope(cfg),
                           qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
                           sliding_window=None if window is None else int(window))
    return from_hf


def _from_gguf(arch: str):
    def from_gguf(md: dict, tensor_names: set, rope_freqs: np.ndarray | None) -> ModelConfig:
        if base.gguf_get(md, arch, "expert_count"):  # Mixtral's GGUFs say "llama"
            return mixtral.from_gguf(md, tensor_names, rope_freqs)
        return ModelConfig(arch=arch, **base.gguf_shapes(md, arch, tensor_names, rope_freqs),
                           qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names)
    return from_gguf


def _to_hf(hf_class: str):
    def to_hf(config: ModelConfig) -> dict:
        cfg = base.hf_shapes_to_hf(config, hf_class, config.arch)
        cfg["hidden_act"] = "silu"
        if config.arch == "llama":
            cfg.update(attention_bias=config.qkv_bias, mlp_bias=False)
        elif config.arch == "mistral":
            cfg["sliding_window"] = config.sliding_window
        else:
            cfg.update(use_sliding_window=config.sliding_window is not None,
                       sliding_window=config.sliding_window)
        return cfg
    return to_hf


LLAMA = base.Family(name="llama", hf_classes=("LlamaForCausalLM",), hf_model_types=("llama",),
                    gguf_arch="llama", from_hf=_from_hf("llama"), from_gguf=_from_gguf("llama"),
                    to_hf=_to_hf("LlamaForCausalLM"), gguf_permuted_qk=True)
# Mistral GGUFs say "llama": they load as LLAMA (the window is not in llama.cpp's metadata).
MISTRAL = base.Family(name="mistral", hf_classes=("MistralForCausalLM",),
                      hf_model_types=("mistral",), gguf_arch=None, from_hf=_from_hf("mistral"),
                      from_gguf=None, to_hf=_to_hf("MistralForCausalLM"))
QWEN2 = base.Family(name="qwen2", hf_classes=("Qwen2ForCausalLM",), hf_model_types=("qwen2",),
                    gguf_arch="qwen2", from_hf=_from_hf("qwen2"), from_gguf=_from_gguf("qwen2"),
                    to_hf=_to_hf("Qwen2ForCausalLM"))
