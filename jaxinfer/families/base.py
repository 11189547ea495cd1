"""What an architecture family is, and the config readers its modules share.

A `Family` is everything jaxinfer knows about one architecture that a checkpoint names: how its
Hugging Face `config.json` and its GGUF metadata become a `ModelConfig` (whose block-variant
features the one model class honours, `jaxinfer.config.ModelConfig`), how its checkpoints name
the per-layer norms, how llama.cpp's GGUF names map onto Hugging Face's, and the chat template
to use when a checkpoint carries none. The registry of families is `jaxinfer.families`.

Canonical weight names and shapes are `jaxinfer.model.params`; the projection names (q/k/v/o,
gate/up/down) are the same in every family, the norms differ (Llama's `post_attention_layernorm`
is its pre-MLP norm, Gemma's is the post-attention norm), so each family names its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from jaxinfer.config import ModelConfig, RopeConfig

# GGUF per-layer tensor suffix -> Hugging Face per-layer name, shared by every family.
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Canonical per-layer norm -> Hugging Face per-layer name (without ".weight"), Llama's naming.
LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
               "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One registered architecture.

    name: `ModelConfig.arch`.  hf_classes / hf_model_types: the `architectures[0]` and
    `model_type` values of a Hugging Face config.json that select it.  gguf_arch: the GGUF
    `general.architecture` that selects it (None: no GGUF of its own).
    from_hf(config.json dict) / from_gguf(metadata, tensor names, rope_freqs or None) ->
    ModelConfig;  to_hf(ModelConfig) -> a config.json dict transformers reads.
    norms: canonical per-layer norm -> its Hugging Face name.  gguf_layer_names: GGUF per-layer
    suffix -> Hugging Face per-layer name.  gguf_permuted_qk: llama.cpp permuted q/k rows for
    interleaved RoPE (undone on load).  gguf_norm_shift: llama.cpp stored every norm weight
    plus this (Gemma's (1 + w) norms are stored as 1 + w); subtracted on load.
    chat_template: the Jinja template used when the checkpoint carries none.
    """

    name: str
    hf_classes: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    gguf_arch: str | None
    from_hf: Callable[[dict], ModelConfig]
    from_gguf: Callable[[dict, set, np.ndarray | None], ModelConfig] | None
    to_hf: Callable[[ModelConfig], dict]
    norms: dict[str, str] = dataclasses.field(default_factory=lambda: dict(LLAMA_NORMS))
    gguf_layer_names: dict[str, str] = dataclasses.field(
        default_factory=lambda: dict(GGUF_LAYER_NAMES))
    gguf_permuted_qk: bool = False
    gguf_norm_shift: float = 0.0
    chat_template: str | None = None


# ----- Hugging Face config.json --------------------------------------------------------------
def rope_from_hf(params: dict, theta: float) -> RopeConfig:
    """One rope parameter dict (legacy `rope_scaling`, or one entry of transformers-5
    `rope_parameters`) with its base `theta` -> RopeConfig."""
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind == "linear":
        return RopeConfig(theta=float(theta), type="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(theta=float(theta), type="llama3", factor=float(params["factor"]),
                          low_freq_factor=float(params["low_freq_factor"]),
                          high_freq_factor=float(params["high_freq_factor"]),
                          original_max_position=int(params["original_max_position_embeddings"]))
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")


def hf_rope(cfg: dict) -> RopeConfig:
    """rope_theta + rope_scaling (legacy) or transformers-5 `rope_parameters` -> RopeConfig."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    return rope_from_hf(scaling, cfg.get("rope_theta", params.get("rope_theta", 10000.0)))


def hf_shapes(cfg: dict, *, tie_default: bool = False) -> dict:
    """The ModelConfig fields every family reads alike from a config.json dict."""
    num_q_heads = int(cfg["num_attention_heads"])
    return dict(
        vocab_size=int(cfg["vocab_size"]),
        embed_dim=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_q_heads=num_q_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_q_heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_q_heads),
        ffn_dim=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", tie_default)),
    )


def rope_to_hf(rope: RopeConfig) -> dict | None:
    """A RopeConfig's scaling as a `rope_scaling` dict (None: plain RoPE)."""
    if rope.type == "linear":
        return {"rope_type": "linear", "factor": rope.factor}
    if rope.type == "llama3":
        return {"rope_type": "llama3", "factor": rope.factor,
                "low_freq_factor": rope.low_freq_factor,
                "high_freq_factor": rope.high_freq_factor,
                "original_max_position_embeddings": rope.original_max_position}
    return None


def hf_shapes_to_hf(config: ModelConfig, hf_class: str, model_type: str) -> dict:
    """The config.json keys every family writes alike."""
    c = config
    return {
        "architectures": [hf_class], "model_type": model_type,
        "vocab_size": c.vocab_size, "hidden_size": c.embed_dim, "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_q_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope.theta, "rope_scaling": rope_to_hf(c.rope),
        "tie_word_embeddings": c.tie_embeddings,
    }


# ----- GGUF metadata -------------------------------------------------------------------------
def gguf_get(md: dict, arch: str, key: str, default=None):
    """`{arch}.{key}` of GGUF metadata; an f32 as its shortest decimal (1e-05, not 9.99e-06)."""
    value = md.get(f"{arch}.{key}", default)
    if isinstance(value, float):
        value = float(str(np.float32(value)))
    return value


def gguf_shapes(md: dict, arch: str, tensor_names: set,
                rope_freqs: np.ndarray | None) -> dict:
    """The ModelConfig fields every family reads alike from GGUF metadata."""
    embed_dim = int(gguf_get(md, arch, "embedding_length"))
    num_q_heads = int(gguf_get(md, arch, "attention.head_count"))
    vocab = gguf_get(md, arch, "vocab_size") or len(md.get("tokenizer.ggml.tokens") or ())
    head_dim = int(gguf_get(md, arch, "attention.key_length")
                   or gguf_get(md, arch, "rope.dimension_count") or embed_dim // num_q_heads)
    theta = float(gguf_get(md, arch, "rope.freq_base", 10000.0))
    return dict(
        vocab_size=int(vocab),
        embed_dim=embed_dim,
        num_layers=int(gguf_get(md, arch, "block_count")),
        num_q_heads=num_q_heads,
        num_kv_heads=int(gguf_get(md, arch, "attention.head_count_kv") or num_q_heads),
        head_dim=head_dim,
        ffn_dim=int(gguf_get(md, arch, "feed_forward_length")),
        rms_norm_eps=float(gguf_get(md, arch, "attention.layer_norm_rms_epsilon", 1e-5)),
        rope=gguf_rope(md, arch, theta, head_dim, rope_freqs),
        max_position=int(gguf_get(md, arch, "context_length", 4096)),
        tie_embeddings="output.weight" not in tensor_names,
    )


def gguf_rope(md: dict, arch: str, theta: float, head_dim: int,
              rope_freqs: np.ndarray | None) -> RopeConfig:
    kind = gguf_get(md, arch, "rope.scaling.type", "none")
    factor = gguf_get(md, arch, "rope.scaling.factor") or gguf_get(md, arch, "rope.scale_linear")
    if rope_freqs is not None:
        return llama3_rope_from_freqs(theta, head_dim, rope_freqs)
    if kind == "linear" or (kind == "none" and factor not in (None, 1.0)):
        return RopeConfig(theta=theta, type="linear", factor=float(factor))
    if kind == "none":
        return RopeConfig(theta=theta)
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r} ({arch}.rope.scaling.type); "
                     "supported: none, linear, and llama3 via rope_freqs.weight")


def llama3_factors(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` f32[H/2] for a llama3 RopeConfig: frequency i is divided by it."""
    inv_freq = rope.theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig = rope.original_max_position
    smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor
                                                         - rope.low_freq_factor)
    mid = 1 / ((1 - smooth) / rope.factor + smooth)
    out = np.where(wavelen < orig / rope.high_freq_factor, 1.0, mid)
    return np.where(wavelen > orig / rope.low_freq_factor, rope.factor, out)


def llama3_rope_from_freqs(theta: float, head_dim: int, freqs: np.ndarray) -> RopeConfig:
    """Recover RopeConfig(type="llama3") from a GGUF `rope_freqs.weight` f32[H/2].

    Only the ratios original_max_position / {low,high}_freq_factor affect the frequencies, so we
    fix low_freq_factor = 1 (as every Llama 3.x release does) and solve the linear ramp of the
    in-between band for the other two; the result is checked by recomputing the factors.
    """
    freqs = np.asarray(freqs, np.float64).reshape(-1)
    factor = float(freqs.max())
    if np.allclose(freqs, 1.0):
        return RopeConfig(theta=theta)
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    mid = (freqs > 1 + 1e-6) & (freqs < factor * (1 - 1e-6))
    if freqs.shape != inv_freq.shape or mid.sum() < 2:
        raise ValueError("cannot derive llama3 rope parameters from GGUF tensor rope_freqs.weight "
                         f"(shape {freqs.shape}, head_dim {head_dim}, {int(mid.sum())} ramp "
                         "points); convert the model from its Hugging Face checkpoint instead")
    smooth = (1 / freqs[mid] - 1 / factor) / (1 - 1 / factor)  # = a / wavelen - b
    a, minus_b = np.polyfit(inv_freq[mid] / (2 * math.pi), smooth, 1)
    high = round(float(1 - 1 / minus_b), 4)  # b = low / (high - low) with low = 1
    rope = RopeConfig(theta=theta, type="llama3", factor=round(factor, 4), low_freq_factor=1.0,
                      high_freq_factor=high, original_max_position=round(float(a * (high - 1))))
    if not np.allclose(llama3_factors(rope, head_dim), freqs, rtol=1e-4):
        raise ValueError(f"GGUF tensor rope_freqs.weight does not match a llama3 rope ({rope})")
    return rope
