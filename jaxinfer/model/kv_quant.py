"""int8 KV pages: one layer's quantized pool, and the quantizer its writes go through.

A float pool is one array `[K, pages, page_size, H]`. An int8 pool is `QuantizedPages`: the
same array in int8 plus one f32 scale per stored token and kv head, `scales: f32[K, pages,
page_size]`; token s of kv head k is `values[k, page, off, :] * scales[k, page, off]`: its key
or value in the pool's rotated basis (below), quantized symmetric absmax (scale = max |x| / 127
over the token's H rotated values, so every value rounds into [-127, 127]). The pair is one
pytree, so it is donated, threaded through the jitted steps, sharded (the scales by the pages'
first three axes) and copied page by page exactly as a float pool is; `shape` and `dtype` are
the values', so code that only asks a pool for its geometry reads both kinds alike.

Why f32 scales rather than bf16: a bf16 scale carries a relative rounding error up to 2^-9, the
same size as int8's own worst-case step (1/254 of the absmax), so it would about double the
quantization error of the largest values; f32 costs 4 bytes per token and kv head against H
bytes of values (6 % at H = 64, 3 % at H = 128), and keeps the TPU kernel's scale tiles on the
plain 32-bit (8, 128) layout.

Why rotated: a row's int8 error scales with its absmax, and keys carry a few large channels (median
absmax / rms 3.5-5.7 per layer on SmolLM2; 2.3-2.6 once rotated), so one scale per row rounds the
many small channels coarsely. An orthonormal Hadamard rotation (`rotation`) spreads each row's
energy over its H values before the scale is taken (as QuaRot does for its KV cache). Attention is
unchanged in exact arithmetic: the queries are rotated alike (q.k = Rq.Rk) and the output rotated
back (sum_s p_s R v_s = R sum_s p_s v_s); the rotation is symmetric and orthonormal, so `rotate` is
its own inverse and one function does all three. On SmolLM2-135M over 2304 positions of text
(docs/benchmarks.md, "Quantized KV cache (int8)") it takes int8 KV from KL 0.0022 / top-1 97.96 %
to 0.0007 / 98.7 % against f32 (plain absmax: the keys cause ~90 % of that KL; rotating the keys
alone gives 0.0008, the values too 0.0007 for one more H x H matmul per layer).

Quantization happens as the step writes its new rows (`quantize_rows`, called by
`attention.write_kv`), inside the jitted step; readers dequantize only what they read: the XLA
reference the pages it gathers (`pallas_kernels.paged_attention.reference.dequantize_pages`, the
kernels' own definition of the layout), the Pallas kernels each tile in VMEM / registers. The
kernels see rotated queries and rotated pages and know nothing of the rotation
(`attention.write_and_attend` rotates the queries in and the output back out).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

KV_INT8_MAX = 127.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """One layer's int8 pool (module doc)."""

    values: jax.Array  # i8[K, pages, page_size, H]
    scales: jax.Array  # f32[K, pages, page_size]

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


def rotation(head_dim: int) -> np.ndarray:
    """f32[H, H]: the orthonormal, symmetric rotation an int8 pool stores rows in (module doc):
    a Sylvester-Hadamard matrix scaled by 1/sqrt(block), block-diagonal with blocks of the
    largest power of two dividing `head_dim` (the whole of it for H = 64, 128, 256)."""
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    block = head_dim & -head_dim
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(head_dim // block), h / np.sqrt(block)).astype(np.float32)


def rotate(x: jax.Array) -> jax.Array:
    """x [..., H] into the int8 pool's basis, in x.dtype; also the way back (the rotation is its
    own inverse). An f32 matmul at full precision: TPU's default would round x to bf16."""
    r = jnp.asarray(rotation(x.shape[-1]))
    y = jnp.matmul(x.astype(jnp.float32), r, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., H] float -> (i8[..., H], f32[...]): `rotate(x)`, quantized symmetric absmax over
    the last axis (module doc)."""
    x = rotate(x.astype(jnp.float32))
    scale = jnp.max(jnp.abs(x), axis=-1) / KV_INT8_MAX
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    q = jnp.clip(jnp.round(x * inv[..., None]), -KV_INT8_MAX, KV_INT8_MAX).astype(jnp.int8)
    return q, scale


def make_pool(shape: tuple[int, ...], dtype: str, fill: float = 0.0) -> Pool:
    """A layer's pool [K, pages, page_size, H] of `dtype` ("int8": QuantizedPages whose scales
    hold `fill`, so a NaN fill poisons what an int8 pool can poison)."""
    if dtype == "int8":
        return QuantizedPages(values=jnp.zeros(shape, jnp.int8),
                              scales=jnp.full(shape[:3], fill, jnp.float32))
    return jnp.full(shape, fill, jnp.dtype(dtype))
