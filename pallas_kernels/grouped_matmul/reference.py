"""Plain-jnp oracle of the grouped matmul, and the input validator every path shares.

A grouped matmul multiplies each group of consecutive rows of `x: [M, K]` by its own matrix:
rows `[start_e, start_e + group_sizes[e])` (start_e = group_sizes[:e].sum()) by expert e's
weight `w[e]: [K, N]`. In a mixture of experts the rows are the token→expert pairs sorted by
expert. Rows past `group_sizes.sum()` (<= M) are padding: their output is unspecified (any
value, NaN included), and nothing in them reaches a valid row.

The weight `w: [E, K, N]` is float (f32 or bf16) or stored as jaxinfer's quantized weights
store an expert stack (`jaxinfer.model.quant`: the weight's contraction axis 1), with f32
`scale` (and `zero`):

- per output channel (group 0): `w: i8[E, K, N]`, `scale: f32[E, 1, N]`, `zero` None;
  W[e, k, n] = w[e, k, n] * scale[e, 0, n].
- groups of `group` rows along K (group > 0): `w: [E, K, N]` of an integer dtype (native
  `jnp.int4` holding value - 8 with `offset` 8; or u8 values with `offset` 0), or the u8-packed
  int4 layout `u8[E, K / 2, N]` (two values per byte within each group: byte j of a group holds
  element j in its low nibble and element j + group / 2 in its high one); `scale, zero:
  f32[E, K / group, N]`; W[e, k, n] = (w[e, k, n] + offset) * scale[e, k // group, n]
  + zero[e, k // group, n].

A weight may also hold C output blocks before its contraction, `w: [E, C, K, N]` (a mixture's
gate and up, C = 2, as the model stores them), its fields `[E, C, rows, N]` following their
rows: block c's [K, N] gives output c of `[C, M, N]`, and no path reshapes or transposes the
weight.

out[m, n] = sum_k x[m, k] * W[e(m), k, n] accumulated in f32, returned in
`preferred_element_type` (default x's dtype).

The reference computes every expert on every row and keeps each row's own: the dense
computation, kept only as the tests' oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

X_DTYPES = ("float32", "bfloat16")


def packed_int4(x: jax.Array, w: jax.Array) -> bool:
    """Whether `w` is the u8-packed int4 layout (its K axis halved) for activations `x`."""
    return w.dtype == jnp.uint8 and w.ndim in (3, 4) and 2 * w.shape[-2] == x.shape[-1]


def validate_inputs(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                    scale: jax.Array | None, zero: jax.Array | None, group: int) -> None:
    """Raises ValueError naming the bad value (and what is valid) for inputs outside the layout
    of the module doc."""
    if jnp.dtype(x.dtype).name not in X_DTYPES or x.ndim != 2 or not x.shape[0]:
        raise ValueError(f"x {x.dtype}{list(x.shape)}: need a [M, K] array (M >= 1) of one of "
                         f"{X_DTYPES}")
    if group_sizes.ndim != 1 or group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes {group_sizes.dtype}{list(group_sizes.shape)}: need i32[E]")
    packed = packed_int4(x, w)
    k = x.shape[1]
    if w.ndim not in (3, 4) or (w.shape[-2] != k and not packed) \
            or w.shape[0] != group_sizes.shape[0]:
        raise ValueError(f"w {list(w.shape)} for x {list(x.shape)} and group_sizes "
                         f"{list(group_sizes.shape)}: need w [E, K, N] or [E, C, K, N] "
                         f"(u8-packed int4: K / 2) with E = {group_sizes.shape[0]}, K = {k}")
    lead, n = w.shape[:-2], w.shape[-1]
    if jnp.issubdtype(w.dtype, jnp.floating):
        if jnp.dtype(w.dtype).name not in X_DTYPES or scale is not None or zero is not None:
            raise ValueError(f"float w {w.dtype}: need one of {X_DTYPES} and no scale or zero")
        return
    if not jnp.issubdtype(w.dtype, jnp.integer):
        raise ValueError(f"w dtype {w.dtype} is neither float nor integer")
    if group == 0:
        if w.dtype != jnp.int8 or zero is not None or scale is None \
                or scale.shape != (*lead, 1, n):
            raise ValueError(f"per-channel (group 0) needs w int8, scale f32"
                             f"{[*lead, 1, n]} and "
                             f"no zero; got w {w.dtype}, scale "
                             f"{None if scale is None else list(scale.shape)}, zero "
                             f"{None if zero is None else list(zero.shape)}")
        return
    if group < 0 or k % group or (packed and group % 2):
        raise ValueError(f"group {group} must be > 0 and divide K = {k} (an even number for "
                         f"u8-packed int4), or be 0: per channel")
    want = (*lead, k // group, n)
    if scale is None or zero is None or scale.shape != want or zero.shape != want:
        raise ValueError(f"group {group}: scale and zero must both be f32{list(want)}, got "
                         f"{None if scale is None else list(scale.shape)} and "
                         f"{None if zero is None else list(zero.shape)}")


def unpack_int4(w: jax.Array, group: int) -> jax.Array:
    """u8-packed int4 [.., K / 2, N] -> u8 values [.., K, N] (module doc's packing)."""
    *lead, half, n = w.shape
    g = w.reshape(*lead, half * 2 // group, group // 2, n)
    return jnp.concatenate([g & 0x0F, g >> 4], axis=-2).reshape(*lead, half * 2, n)


def dequantize_reference(w: jax.Array, scale: jax.Array | None, zero: jax.Array | None, *,
                         k: int, group: int, offset: int) -> jax.Array:
    """The f32 weight [E, (C,) K, N] the stored fields stand for (module doc)."""
    if jnp.issubdtype(w.dtype, jnp.floating):
        return w.astype(jnp.float32)
    if w.shape[-2] != k:
        w = unpack_int4(w, group)
    values = w.astype(jnp.float32)
    if group == 0:
        return values * scale.astype(jnp.float32)
    rows = lambda a: jnp.repeat(a.astype(jnp.float32), group, axis=-2)  # noqa: E731
    return (values + offset) * rows(scale) + rows(zero)


def row_groups(group_sizes: jax.Array, m: int) -> jax.Array:
    """i32[M]: each row's group (E for padding rows past the sum), by compares over [M, E]."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(m, dtype=jnp.int32)
    return jnp.sum(ends[None, :] <= rows[:, None], axis=1, dtype=jnp.int32)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                             scale: jax.Array | None = None, zero: jax.Array | None = None,
                             group: int = 0, offset: int = 0,
                             preferred_element_type=None) -> jax.Array:
    """x [M, K], w [E, K, N] or [E, C, K, N] (module doc), group_sizes i32[E] -> [M, N] or
    [C, M, N] in `preferred_element_type` (default x.dtype), every expert computed on every row
    in f32; padding rows are 0."""
    validate_inputs(x, w, group_sizes, scale=scale, zero=zero, group=group)
    weights = dequantize_reference(w, scale, zero, k=x.shape[1], group=group, offset=offset)
    mine = row_groups(group_sizes, x.shape[0])[:, None] == jnp.arange(w.shape[0])  # [M, E]
    xs = jnp.where(mine.T[:, :, None], x.astype(jnp.float32), 0)  # [E, M, K]
    spec = "emk,ekn->mn" if w.ndim == 3 else "emk,eckn->cmn"
    out = jnp.einsum(spec, xs, weights, precision=jax.lax.Precision.HIGHEST)
    return out.astype(preferred_element_type or x.dtype)
