"""int8 KV pages: one layer's quantized pool, and the quantizer its writes go through.

A float pool is one array `[K, pages, page_size, H]`. An int8 pool is `QuantizedPages`: the
same array in int8 plus one f32 scale per stored token and kv head, `scales: f32[K, pages, 1,
W]` (W = page_size, or on TPU page_size rounded up to whole 128-lane tiles so that XLA:TPU
keeps the array row-major as the Mosaic kernels read it:
`pallas_kernels.paged_attention.reference`); token s of kv head k is `values[k, page, off, :] *
scales[k, page, 0, off]`
(symmetric, absmax: scale = max |x| / 127 over the token's H values, so every value rounds into
[-127, 127] and 0 stays exact). The pair is one pytree, so it is donated, threaded through the
jitted steps, sharded (the scales by the pages' first two axes) and copied page by page exactly
as a float pool is; `shape` and `dtype` are the values', so code that only asks a pool for its
geometry reads both kinds alike.

Why f32 scales rather than bf16: a bf16 scale carries a relative rounding error up to 2^-9, the
same size as int8's own worst-case step (1/254 of the absmax), so it would about double the
quantization error of the largest values; f32 costs 4 bytes per token and kv head against H
bytes of values (6 % at H = 64, 3 % at H = 128), and keeps the TPU kernel's scale tiles on the
plain 32-bit (8, 128) layout.

Quantization happens as the step writes its new rows (`quantize_rows`, called by
`attention.write_kv`), inside the jitted step; readers dequantize only what they read: the XLA
reference the pages it gathers (`pallas_kernels.paged_attention.reference.dequantize_pages`, the
kernels' own definition of the layout), the Pallas kernels each tile in VMEM / registers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

KV_INT8_MAX = 127.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """One layer's int8 pool (module doc)."""

    values: jax.Array  # i8[K, pages, page_size, H]
    scales: jax.Array  # f32[K, pages, 1, W] (module doc)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.values.size * self.values.dtype.itemsize + \
            self.scales.size * self.scales.dtype.itemsize


Pool = jax.Array | QuantizedPages


def split_pool(pool: Pool) -> tuple[jax.Array, jax.Array | None]:
    """(values, scales) of a pool; scales None for a float pool."""
    if isinstance(pool, QuantizedPages):
        return pool.values, pool.scales
    return pool, None


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., H] float -> (i8[..., H], f32[...]): symmetric absmax over the last axis."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / KV_INT8_MAX
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    q = jnp.clip(jnp.round(x * inv[..., None]), -KV_INT8_MAX, KV_INT8_MAX).astype(jnp.int8)
    return q, scale


def copy_pool_pages(pool: Pool, src: jax.Array, dst: jax.Array) -> Pool:
    """The pool with pages dst[i] set to pages src[i] (i32[N] each; every source read before any
    page is written). An int8 pool's scale rows go by one dynamic-update-slice per page: XLA:TPU
    would relay a scatter's whole (1, 128)-tiled scale array out to (8, 128) tiles and back, a
    copy of every layer's scales per call."""
    if not isinstance(pool, QuantizedPages):
        return pool.at[:, dst].set(pool[:, src])
    scales, n = pool.scales, src.shape[0]
    rows = jnp.zeros((scales.shape[0], n, *scales.shape[2:]), scales.dtype)
    rows = jax.lax.fori_loop(0, n, lambda i, r: jax.lax.dynamic_update_slice_in_dim(
        r, jax.lax.dynamic_slice_in_dim(scales, src[i], 1, axis=1), i, axis=1), rows)
    scales = jax.lax.fori_loop(0, n, lambda i, x: jax.lax.dynamic_update_slice_in_dim(
        x, jax.lax.dynamic_slice_in_dim(rows, i, 1, axis=1), dst[i], axis=1), scales)
    return QuantizedPages(values=pool.values.at[:, dst].set(pool.values[:, src]), scales=scales)


def make_pool(shape: tuple[int, ...], dtype: str, fill: float = 0.0, *,
              scale_width: int | None = None) -> Pool:
    """A layer's pool [K, pages, page_size, H] of `dtype` ("int8": QuantizedPages whose scales,
    [K, pages, 1, scale_width (default page_size)], hold `fill`, so a NaN fill poisons what an
    int8 pool can poison)."""
    if dtype == "int8":
        width = scale_width or shape[2]
        return QuantizedPages(values=jnp.zeros(shape, jnp.int8),
                              scales=jnp.full((*shape[:2], 1, width), fill, jnp.float32))
    return jnp.full(shape, fill, jnp.dtype(dtype))
