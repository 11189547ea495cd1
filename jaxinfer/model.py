"""The Llama-family decoder as a Flax NNX module (Llama 2/3.x, SmolLM/SmolLM2, Mistral, Qwen2).

Weights are stored einsum-native and stacked over layers (leading `L` axis) so the forward pass is
one `lax.scan`; two projections are fused at load, which XLA runs as one larger matmul:

    qkv:     [L, D, K, G + 2, H]  per kv head: its G query heads, then its key, then its value
    gate_up: [L, D, 2, F]         gate, up

The fused qkv keeps each kv head's queries beside it, so sharding over `kv_heads` (tensor
parallelism) splits it cleanly. Query head n = k * G + g uses kv head k, as in Hugging Face.
Norms, RoPE, softmax and logits are computed in f32 whatever the weight dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.attention import apply_rope, paged_attention_reference, rope_inv_freq, write_kv
from jaxinfer.config import ModelConfig


def _param(value, axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(jnp.asarray(value), out_sharding=axes, eager_sharding=False)


def fuse_params(config: ModelConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Canonical per-layer checkpoint params (see `jaxinfer.weights`) -> stacked, fused arrays."""
    c = config
    num_k, g, h = c.num_kv_heads, c.q_per_kv, c.head_dim

    def stack(fn):
        return np.stack([fn(i) for i in range(c.num_layers)])

    def qkv(i):
        q = params[f"layers.{i}.q"].reshape(c.embed_dim, num_k, g, h)
        k = params[f"layers.{i}.k"][:, :, None, :]
        v = params[f"layers.{i}.v"][:, :, None, :]
        return np.concatenate([q, k, v], axis=2)

    out = {
        "embed": params["embed"],
        "final_norm": params["final_norm"],
        "attn_norm": stack(lambda i: params[f"layers.{i}.attn_norm"]),
        "mlp_norm": stack(lambda i: params[f"layers.{i}.mlp_norm"]),
        "qkv": stack(qkv),
        "o": stack(lambda i: params[f"layers.{i}.o"]),
        "gate_up": stack(lambda i: np.stack([params[f"layers.{i}.gate"],
                                             params[f"layers.{i}.up"]], axis=1)),
        "down": stack(lambda i: params[f"layers.{i}.down"]),
    }
    if c.qkv_bias:
        out["qkv_bias"] = stack(lambda i: np.concatenate([
            params[f"layers.{i}.q_bias"].reshape(num_k, g, h),
            params[f"layers.{i}.k_bias"][:, None, :],
            params[f"layers.{i}.v_bias"][:, None, :]], axis=1))
    if not c.tie_embeddings:
        out["lm_head"] = params["lm_head"]
    return out


def init_params(config: ModelConfig, seed: int = 0, scale: float = 0.05) -> dict[str, np.ndarray]:
    """Random canonical params for tests on toy configs (normal(0, scale), norms near 1)."""
    from jaxinfer.weights import expected_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


class Llama(nnx.Module):
    """Decoder-only transformer over the paged KV cache. Build with `Llama(config, params)`."""

    def __init__(self, config: ModelConfig, params: dict[str, np.ndarray]):
        self.config = config
        dt = np.dtype(jnp.dtype(config.dtype))
        f = fuse_params(config, params)
        self.embed = _param(f["embed"].astype(dt), ("vocab", "embed"))
        self.final_norm = _param(f["final_norm"].astype(np.float32), ("norm",))
        self.attn_norm = _param(f["attn_norm"].astype(np.float32), ("layers", "norm"))
        self.mlp_norm = _param(f["mlp_norm"].astype(np.float32), ("layers", "norm"))
        self.qkv = _param(f["qkv"].astype(dt),
                          ("layers", "embed", "kv_heads", "qkv", "head_dim"))
        self.o = _param(f["o"].astype(dt), ("layers", "q_heads", "head_dim", "embed"))
        self.gate_up = _param(f["gate_up"].astype(dt), ("layers", "embed", "gate_up", "ffn"))
        self.down = _param(f["down"].astype(dt), ("layers", "ffn", "embed"))
        if config.qkv_bias:
            self.qkv_bias = _param(f["qkv_bias"].astype(dt),
                                   ("layers", "kv_heads", "qkv", "head_dim"))
        if not config.tie_embeddings:
            self.lm_head = _param(f["lm_head"].astype(dt), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array, positions: jax.Array, valid: jax.Array,
                 k_pages: jax.Array, v_pages: jax.Array, page_rows: jax.Array,
                 kv_lens: jax.Array, logits_index: jax.Array | None, *, num_pages_read: int):
        """One forward pass of B rows x T tokens that also writes their K/V into the pool.

        Args:
          tokens: i32[B, T] token ids; positions: i32[B, T]; valid: bool[B, T] (False = padding).
          k_pages, v_pages: [L, K, num_pages, page_size, H] the pool (donated by the caller).
          page_rows: i32[B, P] page table rows; kv_lens: i32[B] cache length after this step.
          logits_index: i32[B] which token of each row to project to logits, or None for all.
          num_pages_read: static page bucket covering max(kv_lens).
        Returns:
          (logits f32[B, V] (or [B, T, V] when logits_index is None), k_pages, v_pages).
        """
        c = self.config
        x = self.embed[...][tokens]  # [B, T, D]
        inv_freq = rope_inv_freq(c.rope, c.head_dim)
        layers = dict(attn_norm=self.attn_norm[...], mlp_norm=self.mlp_norm[...],
                      qkv=self.qkv[...], o=self.o[...], gate_up=self.gate_up[...],
                      down=self.down[...])
        if c.qkv_bias:
            layers["qkv_bias"] = self.qkv_bias[...]

        def layer(carry, lp):
            x, k_pages, v_pages, i = carry
            with jax.named_scope("attn"):
                h = rms_norm(x, lp["attn_norm"], c.rms_norm_eps).astype(x.dtype)
                qkv = jnp.einsum("BTD,DKCH->BTKCH", h, lp["qkv"])
                if c.qkv_bias:
                    qkv = qkv + lp["qkv_bias"]
                g = c.q_per_kv
                q = apply_rope(qkv[:, :, :, :g], positions, inv_freq)  # [B, T, K, G, H]
                k = apply_rope(qkv[:, :, :, g], positions, inv_freq)  # [B, T, K, H]
                v = qkv[:, :, :, g + 1]
                k_pages, v_pages = write_kv(k_pages, v_pages, i, k, v, page_rows, positions,
                                            valid)
                attn = paged_attention_reference(
                    q, k_pages, v_pages, i, page_rows, positions, kv_lens,
                    num_pages_read=num_pages_read, sliding_window=c.sliding_window)
                attn = attn.reshape(attn.shape[:2] + (c.num_q_heads, c.head_dim))
                x = x + jnp.einsum("BTNH,NHD->BTD", attn, lp["o"])
            with jax.named_scope("mlp"):
                h = rms_norm(x, lp["mlp_norm"], c.rms_norm_eps).astype(x.dtype)
                gu = jnp.einsum("BTD,DCF->BTCF", h, lp["gate_up"])
                act = jax.nn.silu(gu[:, :, 0].astype(jnp.float32)) * gu[:, :, 1]
                x = x + jnp.einsum("BTF,FD->BTD", act.astype(x.dtype), lp["down"])
            return (x, k_pages, v_pages, i + 1), None

        (x, k_pages, v_pages, _), _ = jax.lax.scan(
            layer, (x, k_pages, v_pages, jnp.int32(0)), layers)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]  # [B, D]
        x = rms_norm(x, self.final_norm[...], c.rms_norm_eps).astype(x.dtype)
        with jax.named_scope("lm_head"):
            if c.tie_embeddings:
                logits = jnp.einsum("...D,VD->...V", x, self.embed[...],
                                    preferred_element_type=jnp.float32)
            else:
                logits = jnp.einsum("...D,DV->...V", x, self.lm_head[...],
                                    preferred_element_type=jnp.float32)
        return logits.astype(jnp.float32), k_pages, v_pages


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """f32 RMSNorm of x [..., D] with weight [D]; returns f32 (callers cast)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return xf * weight.astype(jnp.float32)
