"""gpt-oss (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b).

The block: q/k/v/o projections with biases; a learned sink logit per query head in every
softmax denominator; layers alternating a 128-token sliding window and full attention
(`layer_types`); YaRN RoPE (rotate-half pairing); every MLP a mixture of num_local_experts
experts whose router (with a bias) takes the top num_experts_per_tok logits then a softmax over
them; experts with biases and the clamped SwiGLU (swiglu_alpha 1.702, swiglu_limit 7). The
checkpoint stacks the experts: `mlp.experts.gate_up_proj` [E, D, 2F] with gate and up
interleaved, `down_proj` [E, F, D]. Only its Hugging Face form loads (its GGUFs store the
experts as MXFP4, which jaxinfer does not decode).
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.families import base

NAMES = base.ExpertNames(router="mlp.router", stacked="mlp.experts")
PATTERN = 2  # sliding, full, sliding, ...


def from_hf(cfg: dict) -> ModelConfig:
    base.check_moe_hf(cfg, "gpt_oss")
    shapes = base.hf_shapes(cfg)
    bias = bool(cfg.get("attention_bias", True))
    return ModelConfig(arch="gpt_oss", **shapes, rope=base.hf_rope(cfg), qkv_bias=bias,
                       o_bias=bias, attention_sinks=True,
                       sliding_window=int(cfg.get("sliding_window") or 128),
                       sliding_window_pattern=base.sliding_pattern(cfg, shapes["num_layers"],
                                                                   PATTERN),
                       activation="swiglu_clamped",
                       swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                       swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                       num_experts=int(cfg.get("num_local_experts", cfg.get("num_experts"))),
                       experts_per_token=int(cfg["num_experts_per_tok"]),
                       router="topk_softmax", router_bias=True, expert_bias=True)


def to_hf(config: ModelConfig) -> dict:
    c = config
    if not (c.attention_sinks and c.expert_bias and c.router_bias and c.qkv_bias == c.o_bias
            and c.router == "topk_softmax" and c.activation == "swiglu_clamped"
            and not c.dense_layers and not c.shared_expert_ffn_dim
            and c.moe_ffn_dim == c.ffn_dim):
        raise ValueError("a gpt_oss config.json has sinks, biased experts and router, a top-k "
                         "then softmax router and the clamped SwiGLU on every layer")
    cfg = base.hf_shapes_to_hf(c, "GptOssForCausalLM", "gpt_oss")
    cfg.update(attention_bias=c.qkv_bias, sliding_window=c.sliding_window,
               layer_types=base.layer_types(c), swiglu_alpha=c.swiglu_alpha,
               swiglu_limit=c.swiglu_limit, num_local_experts=c.num_experts,
               num_experts_per_tok=c.experts_per_token, hidden_act="silu")
    return cfg


GPT_OSS = base.Family(
    name="gpt_oss", hf_classes=("GptOssForCausalLM",), hf_model_types=("gpt_oss",),
    gguf_arch=None, from_hf=from_hf, from_gguf=None, to_hf=to_hf, experts=NAMES)
