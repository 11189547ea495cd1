"""Rotary position embeddings, paired as Hugging Face's `rotate_half` (j with j + H/2).

The pairing is named here only: checkpoint loaders bring every format to it (llama.cpp's GGUF
permutes q/k rows for interleaved pairs, which `jaxinfer.checkpoint.gguf` undoes).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """f32[H/2] inverse frequencies, with llama3 / linear scaling applied (as Hugging Face does)."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * inv / rope.factor + smooth * inv
        inv = np.where(wavelen > low_wavelen, inv / rope.factor,
                       np.where(wavelen < high_wavelen, inv, smoothed))
    elif rope.type == "yarn":
        inv = _yarn(inv, rope, head_dim)
    return inv.astype(np.float32)


def _yarn(inv: np.ndarray, rope: RopeConfig, head_dim: int) -> np.ndarray:
    """YaRN's frequencies, as Hugging Face's `_compute_yarn_parameters`: dimension pair i keeps
    its frequency below the ramp (fast rotations, beta_fast turns per original context), is
    divided by `factor` past it (beta_slow turns), and blends linearly between."""
    def dim_for(rotations: float) -> float:  # the pair index turning `rotations` times
        return (head_dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = dim_for(rope.beta_fast), dim_for(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as Hugging Face: no zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: divided by factor
    return inv / rope.factor * (1 - keep) + inv * keep


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
               scale: float = 1.0) -> jax.Array:
    """Rotates `x` [*R, ..., H] at `positions` i32[*R] (R: the row axes, e.g. [N] or [B, T]);
    `scale` multiplies cos and sin (YaRN's `RopeConfig.attention_scale`)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [*R, H/2]
    shape = positions.shape + (1,) * (x.ndim - positions.ndim - 1) + angles.shape[-1:]
    cos = jnp.cos(angles).reshape(shape)
    sin = jnp.sin(angles).reshape(shape)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
