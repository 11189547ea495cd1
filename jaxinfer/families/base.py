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
# A mixture layer's router and shared expert in llama.cpp's names (Qwen-MoE's Hugging Face names;
# `Family.gguf_layer_names` of the mixture families). The stacked experts, ffn_{gate,up,down}_exps,
# are read through `ExpertNames`.
GGUF_MOE_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
GGUF_EXPERT_PARTS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up",
                     "ffn_down_exps.weight": "down"}
# Canonical per-layer norm -> Hugging Face per-layer name (without ".weight"), Llama's naming.
LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
               "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertNames:
    """How a family's Hugging Face checkpoints name a mixture layer's tensors (after
    `model.layers.{i}.`; a Linear's name without ".weight" / ".bias").

    router: the router Linear (weight [E, D]).  expert: one expert's Linear of a part, with
    "{e}" for the expert and "{part}" for `parts[part]` ([out, in] weights: gate and up [F, D],
    down [D, F]); None when the experts are stacked (`stacked`).  stacked: the module holding
    gpt-oss's stacked experts: `gate_up_proj` [E, D, 2F] with gate and up interleaved
    (columns 2j and 2j + 1), `down_proj` [E, F, D], and their `_bias` [E, 2F], [E, D].
    shared: the shared expert's Linear of a part ("{part}"); shared_gate: its sigmoid gate's
    Linear (weight [1, D]).
    """

    router: str
    expert: str | None = None
    parts: dict[str, str] = dataclasses.field(
        default_factory=lambda: {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    stacked: str | None = None
    shared: str = "mlp.shared_expert.{part}"
    shared_gate: str = "mlp.shared_expert_gate"

    def expert_name(self, layer: int, e: int, part: str) -> str:
        """The HF weight name of expert `e`'s `part` ("gate", "up", "down") in `layer`."""
        return f"model.layers.{layer}.{self.expert.format(e=e, part=self.parts[part])}.weight"


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
    experts: the names of a mixture layer's tensors (None: no mixture layers).
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
    experts: ExpertNames | None = None


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
    if kind == "yarn":
        return _yarn_from_hf(params, theta)
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, "
                     "llama3, yarn")


def _yarn_from_hf(params: dict, theta: float) -> RopeConfig:
    """Hugging Face's yarn parameters (`_compute_yarn_parameters`): the attention factor given,
    or from mscale / mscale_all_dim when both are set, else None (0.1 ln(factor) + 1)."""
    if params.get("factor") is None:
        raise ValueError("yarn rope scaling without a factor is not supported")
    factor = float(params["factor"])
    attention = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and mscale_all:
        def scale(m):
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
        attention = scale(float(mscale)) / scale(float(mscale_all))
    return RopeConfig(theta=float(theta), type="yarn", factor=factor,
                      original_max_position=int(params["original_max_position_embeddings"]),
                      beta_fast=float(params.get("beta_fast") or 32.0),
                      beta_slow=float(params.get("beta_slow") or 1.0),
                      truncate=bool(params.get("truncate", True)),
                      attention_factor=None if attention is None else float(attention))


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
    if rope.type == "yarn":
        out = {"rope_type": "yarn", "factor": rope.factor, "beta_fast": rope.beta_fast,
               "beta_slow": rope.beta_slow, "truncate": rope.truncate,
               "original_max_position_embeddings": rope.original_max_position}
        if rope.attention_factor is not None:
            out["attention_factor"] = rope.attention_factor
        return out
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


# ----- mixtures of experts -------------------------------------------------------------------
# Config keys of mixture variants no registered family computes, and what they are.
UNSUPPORTED_MOE_KEYS = {
    "kv_lora_rank": "multi-head latent attention (MLA, DeepSeek-V2/V3)",
    "q_lora_rank": "multi-head latent attention (MLA, DeepSeek-V2/V3)",
    "topk_group": "grouped top-k routing (experts chosen within the best groups, DeepSeek-V3)",
    "n_group": "grouped top-k routing (experts chosen within the best groups, DeepSeek-V3)",
    "n_shared_experts": "DeepSeek-style ungated shared experts",
    "first_k_dense_replace": "DeepSeek-style leading dense layers",
}


def check_moe_hf(cfg: dict, family: str) -> None:
    """Raises naming the first mixture variant in config.json dict `cfg` that `family` does not
    compute (`UNSUPPORTED_MOE_KEYS`; a router other than softmax), before any weight loads."""
    for key, what in UNSUPPORTED_MOE_KEYS.items():
        one_group = key in ("n_group", "topk_group") and cfg.get(key) == 1  # plain top-k
        if cfg.get(key) and not one_group:
            raise ValueError(f"{key}={cfg[key]!r}: {what} is not supported ({family} "
                             "computes a softmax router over plain experts)")
    scoring = cfg.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise ValueError(f"scoring_func={scoring!r}: a {scoring} router is not supported "
                         f"({family} routes by softmax)")


def sliding_pattern(cfg: dict, num_layers: int, default: int | None) -> int | None:
    """`layer_types` (or the older `sliding_window_pattern`, else `default`) -> the ModelConfig
    `sliding_window_pattern`: n = every n-th layer full attention, the others sliding."""
    types = cfg.get("layer_types")
    if not types:
        return int(cfg.get("sliding_window_pattern") or default) if default else None
    if "full_attention" not in types:
        return None
    n = types.index("full_attention") + 1
    expect = ["full_attention" if (i + 1) % n == 0 else "sliding_attention"
              for i in range(num_layers)]
    if list(types) != expect:
        raise ValueError(f"layer_types={types} is not a repeating pattern of sliding layers "
                         "then one full-attention layer")
    return n


def layer_types(config: ModelConfig) -> list[str]:
    """The config.json `layer_types` of `config`."""
    return ["sliding_attention" if config.is_local(i) else "full_attention"
            for i in range(config.num_layers)]
