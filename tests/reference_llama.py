"""An independent, plain-numpy Llama forward (no cache, no fusion, float64) used as the oracle.

Written from the Hugging Face modeling code's definitions (rotate_half RoPE, repeat_kv GQA,
RMSNorm, SwiGLU), on the canonical unfused params of `jaxinfer.checkpoint.weights`.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model.rope import rope_inv_freq


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def forward(config: ModelConfig, params: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Logits f64[T, V] for one sequence of token ids."""
    c = config
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    t = len(ids)
    x = p["embed"][np.asarray(ids)]
    inv = rope_inv_freq(c.rope, c.head_dim).astype(np.float64)
    ang = np.arange(t)[:, None] * inv[None]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None]
    g = c.num_q_heads // c.num_kv_heads
    causal = np.tril(np.ones((t, t), bool))
    if c.sliding_window:
        causal &= ~np.tril(np.ones((t, t), bool), -c.sliding_window)
    for i in range(c.num_layers):
        lp = {k.split(".", 2)[2]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        h = _rms(x, lp["attn_norm"], c.rms_norm_eps)
        q = np.einsum("td,dnh->tnh", h, lp["q"])
        k = np.einsum("td,dkh->tkh", h, lp["k"])
        v = np.einsum("td,dkh->tkh", h, lp["v"])
        if c.qkv_bias:
            q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = np.repeat(k, g, axis=1)
        v = np.repeat(v, g, axis=1)
        s = np.einsum("tnh,snh->nts", q, k) / np.sqrt(c.head_dim)
        s = np.where(causal[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        a = np.einsum("nts,snh->tnh", s, v)
        x = x + np.einsum("tnh,nhd->td", a, lp["o"])
        h = _rms(x, lp["mlp_norm"], c.rms_norm_eps)
        gate = h @ lp["gate"]
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ lp["up"])) @ lp["down"]
    x = _rms(x, p["final_norm"], c.rms_norm_eps)
    head = p["embed"].T if c.tie_embeddings else p["lm_head"]
    return x @ head
