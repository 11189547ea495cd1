"""Plain-jnp oracle of the quantized matmul, and the input validator the kernel shares.

Layout: activations `x: [M, K]` (bf16 or f32) times a weight `[K, N]` stored as integers `q`
with f32 scales (weight-only quantization; the matmul's contraction is K):

- per output channel (group 0): `q: i8[K, N]`, `scale: f32[1, N]`, `zero` None;
  w[k, n] = q[k, n] * scale[0, n].
- groups of `group` rows along K (group > 0): `q: [K, N]` of any integer dtype (native
  `jnp.int4` holding value - 8, `offset` 8; or u8 values, `offset` 0), `scale, zero:
  f32[K / group, N]`; w[k, n] = (q[k, n] + offset) * scale[k // group, n] + zero[k // group, n].

out[m, n] = sum_k x[m, k] * w[k, n], returned in `out_dtype` (default x's dtype).

Batched weights: `q: [B, K, N]` with `scale` (and `zero`) `[1 or K / group, B, N]` are B
matrices multiplied by the same x: out [M, B, N] (with B = 1 the scales may also be 2-D).
Each field is in the order XLA TPU stores the model's: a weight whose output axes start with
a small one (the fused gate/up [D, 2, F]) with that axis major ([2][D][F] in memory: its
[B, K, N] view is free, a merged [K, B x N] one would be a copy), its scales [rows, 2, F]
row-major as they are.
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
    if x.ndim != 2 or q.ndim not in (2, 3) or x.shape[1] != q.shape[-2]:
        raise ValueError(f"x {x.shape} @ q {q.shape}: need x [M, K] and q [K, N] or [B, K, N]")
    if not jnp.issubdtype(q.dtype, jnp.integer):
        raise ValueError(f"q dtype {q.dtype} is not an integer dtype")
    *b, k, n = q.shape
    rows = 1 if group == 0 else k // group
    shapes = {(rows, *b, n), (rows, n)} if b in ([], [1]) else {(rows, *b, n)}
    if group == 0:
        if q.dtype != jnp.int8 or zero is not None or scale.shape not in shapes:
            raise ValueError(f"per-channel (group 0) needs q int8, scale of shape "
                             f"{' or '.join(map(str, sorted(shapes)))} and no zero; got q "
                             f"{q.dtype}, scale {scale.shape}, zero "
                             f"{None if zero is None else zero.shape}")
        return
    if group < 0 or k % group:
        raise ValueError(f"group {group} must be > 0 and divide K = {k} (or be 0: per channel)")
    if zero is None or scale.shape not in shapes or zero.shape != scale.shape:
        raise ValueError(f"group {group}: scale and zero must both be "
                         f"{' or '.join(map(str, sorted(shapes)))}, got {scale.shape} and "
                         f"{None if zero is None else zero.shape}")


def dequantize_reference(q: jax.Array, scale: jax.Array, zero: jax.Array | None, *, group: int,
                         offset: int) -> jax.Array:
    """The f32 weight [(B,) K, N] the quantized fields stand for (module doc)."""
    values = q.astype(jnp.float32)

    def rows(a):  # [rows, (B,) N] -> [(B,) K, N], each row repeated over its group
        a = a.astype(jnp.float32).reshape(a.shape[:1] + q.shape[:-2] + a.shape[-1:])
        a = jnp.moveaxis(a, 0, -2)
        return jnp.repeat(a, group, axis=-2) if group else a

    if group == 0:
        return values * rows(scale)
    return (values + offset) * rows(scale) + rows(zero)


def quantized_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array,
                               zero: jax.Array | None, *, group: int, offset: int = 0,
                               out_dtype=None) -> jax.Array:
    """x [M, K] @ the dequantized weight [K, N] ([B, K, N]) in f32 -> [M, N] ([M, B, N]) in
    `out_dtype` (default x.dtype)."""
    validate_inputs(x, q, scale, zero, group=group)
    w = dequantize_reference(q, scale, zero, group=group, offset=offset)
    out = jnp.einsum("mk,...kn->m...n", x.astype(jnp.float32), w,
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype or x.dtype)
