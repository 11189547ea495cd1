"""Mixtral (`MixtralForCausalLM`, e.g. Mixtral-8x7B, 8x22B): the Llama/Mistral block whose every
MLP is a mixture of num_local_experts experts of width intermediate_size, a softmax router whose
top num_experts_per_tok weights are renormalised. Its GGUFs say "llama" with
`llama.expert_count` and stacked `ffn_*_exps` tensors; `jaxinfer.families.llama` hands them
here."""

from __future__ import annotations

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.families import base

NAMES = base.ExpertNames(router="block_sparse_moe.gate",
                         expert="block_sparse_moe.experts.{e}.{part}",
                         parts={"gate": "w1", "up": "w3", "down": "w2"})


def from_hf(cfg: dict) -> ModelConfig:
    base.check_moe_hf(cfg, "mixtral")
    shapes = base.hf_shapes(cfg)
    window = cfg.get("sliding_window")
    return ModelConfig(arch="mixtral", **shapes, rope=base.hf_rope(cfg),
                       sliding_window=None if window is None else int(window),
                       num_experts=int(cfg["num_local_experts"]),
                       experts_per_token=int(cfg["num_experts_per_tok"]),
                       router="softmax_topk_norm")


def from_gguf(md: dict, tensor_names: set, rope_freqs: np.ndarray | None) -> ModelConfig:
    return ModelConfig(arch="mixtral", **base.gguf_shapes(md, "llama", tensor_names, rope_freqs),
                       num_experts=int(base.gguf_get(md, "llama", "expert_count")),
                       experts_per_token=int(base.gguf_get(md, "llama", "expert_used_count")),
                       router="softmax_topk_norm")


def to_hf(config: ModelConfig) -> dict:
    c = config
    if c.router != "softmax_topk_norm" or c.dense_layers or c.moe_layer_step != 1 \
            or c.shared_expert_ffn_dim or c.moe_ffn_dim != c.ffn_dim:
        raise ValueError("a mixtral config.json has a renormalised softmax router and "
                         "intermediate_size-wide experts on every layer, nothing else")
    cfg = base.hf_shapes_to_hf(c, "MixtralForCausalLM", "mixtral")
    cfg.update(hidden_act="silu", sliding_window=c.sliding_window,
               num_local_experts=c.num_experts, num_experts_per_tok=c.experts_per_token)
    return cfg


MIXTRAL = base.Family(
    name="mixtral", hf_classes=("MixtralForCausalLM",), hf_model_types=("mixtral",),
    gguf_arch=None, from_hf=from_hf, from_gguf=from_gguf, to_hf=to_hf, gguf_permuted_qk=True,
    gguf_layer_names={**base.GGUF_LAYER_NAMES,
                      "ffn_gate_inp.weight": "block_sparse_moe.gate.weight"},
    experts=NAMES)
