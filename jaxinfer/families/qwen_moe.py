"""Qwen's mixtures of experts: Qwen3-MoE (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B,
Qwen3-235B-A22B; GGUF `qwen3moe`) and Qwen2-MoE (`Qwen2MoeForCausalLM`, e.g. Qwen1.5-MoE-A2.7B,
Qwen2-57B-A14B; GGUF `qwen2moe`).

Both: the block of their dense family (Qwen3: QK-norm; Qwen2: q/k/v biases) whose MLP is a
mixture on layer i when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
(the other layers keep a dense MLP of intermediate_size); E = num_experts experts of width
moe_intermediate_size, a softmax router over all of them, the top num_experts_per_tok kept and
renormalised when norm_topk_prob. Qwen2-MoE adds a shared expert of
shared_expert_intermediate_size, gated by sigmoid(x . shared_expert_gate).
"""

from __future__ import annotations

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.families import base, qwen3

NAMES = base.ExpertNames(router="mlp.gate", expert="mlp.experts.{e}.{part}")


def _moe_from_hf(cfg: dict, family: str) -> dict:
    """The mixture fields of a Qwen-MoE config.json dict."""
    base.check_moe_hf(cfg, family)
    if cfg.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=true is not supported for {family} (no released "
                         "checkpoint sets it); every layer attends over the whole context")
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    return dict(num_experts=int(num_experts), experts_per_token=int(cfg["num_experts_per_tok"]),
                expert_ffn_dim=int(cfg["moe_intermediate_size"]),
                router="softmax_topk_norm" if cfg.get("norm_topk_prob") else "softmax_topk",
                moe_layer_step=int(cfg.get("decoder_sparse_step") or 1),
                dense_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))


def qwen3_moe_from_hf(cfg: dict) -> ModelConfig:
    return ModelConfig(arch="qwen3_moe", **base.hf_shapes(cfg), rope=base.hf_rope(cfg),
                       qk_norm=True, qkv_bias=bool(cfg.get("attention_bias", False)),
                       **_moe_from_hf(cfg, "qwen3_moe"))


def qwen2_moe_from_hf(cfg: dict) -> ModelConfig:
    return ModelConfig(arch="qwen2_moe", **base.hf_shapes(cfg), rope=base.hf_rope(cfg),
                       qkv_bias=bool(cfg.get("qkv_bias", True)),
                       shared_expert_ffn_dim=int(cfg.get("shared_expert_intermediate_size") or 0),
                       **_moe_from_hf(cfg, "qwen2_moe"))


def _moe_from_gguf(md: dict, arch: str, tensor_names: set, renormalise: bool) -> dict:
    """llama.cpp's expert metadata; a layer without a router tensor is dense."""
    num_layers = int(base.gguf_get(md, arch, "block_count"))
    dense = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight"
                  not in tensor_names)
    norm = base.gguf_get(md, arch, "expert_weights_norm", renormalise)
    return dict(num_experts=int(base.gguf_get(md, arch, "expert_count")),
                experts_per_token=int(base.gguf_get(md, arch, "expert_used_count")),
                expert_ffn_dim=int(base.gguf_get(md, arch, "expert_feed_forward_length")),
                router="softmax_topk_norm" if norm else "softmax_topk", dense_layers=dense)


def qwen3_moe_from_gguf(md: dict, tensor_names: set, rope_freqs: np.ndarray | None
                        ) -> ModelConfig:
    """llama.cpp's qwen3moe renormalises the top-k weights (Qwen3-MoE's norm_topk_prob)."""
    return ModelConfig(arch="qwen3_moe",
                       **base.gguf_shapes(md, "qwen3moe", tensor_names, rope_freqs),
                       qk_norm=True, qkv_bias="blk.0.attn_q.bias" in tensor_names,
                       **_moe_from_gguf(md, "qwen3moe", tensor_names, True))


def qwen2_moe_from_gguf(md: dict, tensor_names: set, rope_freqs: np.ndarray | None
                        ) -> ModelConfig:
    shared = base.gguf_get(md, "qwen2moe", "expert_shared_feed_forward_length") or 0
    return ModelConfig(arch="qwen2_moe",
                       **base.gguf_shapes(md, "qwen2moe", tensor_names, rope_freqs),
                       qkv_bias="blk.0.attn_q.bias" in tensor_names,
                       shared_expert_ffn_dim=int(shared),
                       **_moe_from_gguf(md, "qwen2moe", tensor_names, False))


def _moe_to_hf(config: ModelConfig, hf_class: str, model_type: str) -> dict:
    c = config
    if c.router == "topk_softmax" or c.sliding_window is not None or c.expert_bias \
            or c.router_bias:
        raise ValueError(f"a {model_type} config.json cannot express router={c.router!r}, "
                         f"sliding_window={c.sliding_window}, expert_bias={c.expert_bias}, "
                         f"router_bias={c.router_bias}")
    cfg = base.hf_shapes_to_hf(c, hf_class, model_type)
    cfg.update(hidden_act="silu", use_sliding_window=False, sliding_window=None,
               num_experts=c.num_experts, num_experts_per_tok=c.experts_per_token,
               moe_intermediate_size=c.moe_ffn_dim,
               norm_topk_prob=c.router == "softmax_topk_norm",
               decoder_sparse_step=c.moe_layer_step, mlp_only_layers=list(c.dense_layers))
    return cfg


def qwen3_moe_to_hf(config: ModelConfig) -> dict:
    if config.shared_expert_ffn_dim:
        raise ValueError("a qwen3_moe config.json has no shared expert (qwen2_moe has)")
    cfg = _moe_to_hf(config, "Qwen3MoeForCausalLM", "qwen3_moe")
    cfg["attention_bias"] = config.qkv_bias
    return cfg


def qwen2_moe_to_hf(config: ModelConfig) -> dict:
    cfg = _moe_to_hf(config, "Qwen2MoeForCausalLM", "qwen2_moe")
    cfg.update(qkv_bias=config.qkv_bias,
               shared_expert_intermediate_size=config.shared_expert_ffn_dim)
    return cfg


QWEN3_MOE = base.Family(
    name="qwen3_moe", hf_classes=("Qwen3MoeForCausalLM",), hf_model_types=("qwen3_moe",),
    gguf_arch="qwen3moe", from_hf=qwen3_moe_from_hf, from_gguf=qwen3_moe_from_gguf,
    to_hf=qwen3_moe_to_hf, gguf_layer_names={**base.GGUF_LAYER_NAMES, **base.GGUF_MOE_NAMES},
    chat_template=qwen3.CHAT_TEMPLATE, experts=NAMES)
QWEN2_MOE = base.Family(
    name="qwen2_moe", hf_classes=("Qwen2MoeForCausalLM",), hf_model_types=("qwen2_moe",),
    gguf_arch="qwen2moe", from_hf=qwen2_moe_from_hf, from_gguf=qwen2_moe_from_gguf,
    to_hf=qwen2_moe_to_hf, gguf_layer_names={**base.GGUF_LAYER_NAMES, **base.GGUF_MOE_NAMES},
    experts=NAMES)
