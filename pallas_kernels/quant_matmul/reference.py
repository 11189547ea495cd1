"""Plain-jnp oracle of the quantized matmul, and the input validator the kernel shares.

Layout: activations `x: [M, K]` (bf16 or f32) times a weight `[K, N]` stored as integers `q`
with f32 scales (weight-only quantization; the matmul's contraction is K):

- per output channel (group 0): `q: i8[K, N]`, `scale: f32[1, N]`, `zero` None;
  w[k, n] = q[k, n] * scale[0, n].
- groups of `group` rows along K (group > 0): `q: [K, N]` of any integer dtype (native
  `jnp.int4` holding value - 8, `offset` 8; or u8 values, `offset` 0), `scale, zero:
  f32[K / group, N]`; w[k, n] = (q[k, n] + offset) * scale[k // group, n] + zero[k // group, n].

out[m, n] = sum_k x[m, k] * w[k, n], returned in `out_dtype` (default x's dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

X_DTYPES = ("float32", "bfloat16")


def validate_inputs(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array | None, *,
                    group: int) -> None:
    """Raises ValueError naming the bad value (and what is valid) for inputs outside the layout
    of the module doc."""
    if jnp.dtype(x.dtype).name not in X_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not one of {X_DTYPES}")
    if x.ndim != 2 or q.ndim != 2 or x.shape[1] != q.shape[0]:
        raise ValueError(f"x {x.shape} @ q {q.shape}: need x [M, K] and q [K, N]")
    if not jnp.issubdtype(q.dtype, jnp.integer):
        raise ValueError(f"q dtype {q.dtype} is not an integer dtype")
    k, n = q.shape
    if group == 0:
        if q.dtype != jnp.int8 or zero is not None or scale.shape != (1, n):
            raise ValueError(f"per-channel (group 0) needs q int8, scale [1, {n}] and no zero; "
                             f"got q {q.dtype}, scale {scale.shape}, zero "
                             f"{None if zero is None else zero.shape}")
        return
    if group < 0 or k % group:
        raise ValueError(f"group {group} must be > 0 and divide K = {k} (or be 0: per channel)")
    want = (k // group, n)
    if zero is None or scale.shape != want or zero.shape != want:
        raise ValueError(f"group {group}: scale and zero must be [{want[0]}, {n}], got "
                         f"{scale.shape} and {None if zero is None else zero.shape}")


def dequantize_reference(q: jax.Array, scale: jax.Array, zero: jax.Array | None, *, group: int,
                         offset: int) -> jax.Array:
    """The f32 weight [K, N] the quantized fields stand for (module doc)."""
    values = q.astype(jnp.float32)
    if group == 0:
        return values * scale.astype(jnp.float32)
    rows = lambda a: jnp.repeat(a.astype(jnp.float32), group, axis=0)  # noqa: E731
    return (values + offset) * rows(scale) + rows(zero)


def quantized_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array,
                               zero: jax.Array | None, *, group: int, offset: int = 0,
                               out_dtype=None) -> jax.Array:
    """x [M, K] @ the dequantized weight [K, N] in f32 -> [M, N] in `out_dtype` (default
    x.dtype)."""
    validate_inputs(x, q, scale, zero, group=group)
    w = dequantize_reference(q, scale, zero, group=group, offset=offset)
    out = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype or x.dtype)
