"""One layer's KV pool in its stored kinds (plain, int8, lane-packed), and the int8 quantizer.

A scanned model's pool stacks layers' pools (`jaxinfer.engine.kv_cache`): every array of a pool
below then has a leading layers axis ([L, K, ...]); `shape` is [L, K, pages, page_size, H].

A float pool is one array `[K, pages, page_size, H]`. An int8 pool is `QuantizedPages`: the same
array in int8 plus one f32 scale per stored token and kv head, `scales: f32[K, groups, 8, W]`, 8
pages' scale rows to a group (W = page_size, or on TPU page_size rounded up to whole 128-lane
tiles: the layout XLA:TPU keeps row-major as the Mosaic kernels read it and scatters into in place,
`pallas_kernels.paged_attention.reference`); token s of kv head k is `values[k, page, off, :] *
scales[k, page // 8, page % 8, off]`: its key or value in the pool's rotated basis (below),
quantized symmetric absmax (scale = max |x| / 127 over the token's H rotated values, so every value
rounds into [-127, 127]). The pair is one pytree, so it is donated, threaded through the jitted
steps, sharded (the scales by the pages' first two axes) and copied page by page exactly as a float
pool is; `shape` and `dtype` are the values', so code that only asks a pool for its geometry reads
both kinds alike.

Why f32 scales rather than bf16: a bf16 scale carries a relative rounding error up to 2^-9, the
same size as int8's own worst-case step (1/254 of the absmax), so it would about double the
quantization error of the largest values; f32 costs 4 bytes per token and kv head against H
bytes of values (6 % at H = 64, 3 % at H = 128; on TPU a page's row of whole 128-lane tiles,
16 bytes a token at page 32), and keeps the TPU kernel's scale tiles 32-bit.

A float pool laid out for TPU with H under 128 (dividing it; a packed page whole VMEM tiles,
e.g. page_size a multiple of 32 for bf16 at H = 64) is `PackedPages`: the same array
stored lane-packed, `values: [K, pages, page_size * H / 128, 128]`, 128 / H tokens to a row
(the row-major reshape of `[K, pages, page_size, H]`): XLA:TPU would store a `[.., page_size,
64]` array pages-minor, which the Mosaic kernels cannot read, and relay every layer's pool out
before each kernel call (`pallas_kernels.paged_attention.reference`, "Lane-packed pages"). Its
`shape` is the logical one, so code that asks a pool for its geometry reads it like the others;
the writes scatter each token's H values into its lanes (`write_packed`), the kernels take the
packed array, and the XLA reference views the pages it gathers as `[.., page_size, H]`.

Why rotated: a row's int8 error scales with its absmax, and keys carry a few large channels (median
absmax / rms 3.5-5.7 per layer on SmolLM2; 2.3-2.6 once rotated), so one scale per row rounds the
many small channels coarsely. An orthonormal Hadamard rotation (`rotation`) spreads each row's
energy over its H values before the scale is taken (as QuaRot does for its KV cache). Attention is
unchanged in exact arithmetic: the queries are rotated alike (q.k = Rq.Rk) and the output rotated
back (sum_s p_s R v_s = R sum_s p_s v_s); the rotation is symmetric and orthonormal, so `rotate` is
its own inverse and one function does all three. On SmolLM2-135M over 2304 positions of text
(docs/benchmarks.md, "Quantized KV cache") it takes int8 KV from KL 0.0022 / top-1 97.96 %
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

from pallas_kernels.paged_attention.reference import SCALE_GROUP, scale_groups, scale_width
from pallas_kernels.paged_attention.tpu import lane_packing

KV_INT8_MAX = 127.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """One layer's int8 pool (module doc)."""

    values: jax.Array  # i8[K, pages, page_size, H]
    scales: jax.Array  # f32[K, groups, 8, W] (module doc)

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedPages:
    """One layer's float pool stored lane-packed (module doc)."""

    values: jax.Array  # [K, pages, page_size * H / lanes, lanes]
    head_dim: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, rows, lanes = self.values.shape
        return (*lead, rows * lanes // self.head_dim, self.head_dim)

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.values.size * self.values.dtype.itemsize


Pool = jax.Array | QuantizedPages | PackedPages


def split_pool(pool: Pool) -> tuple[jax.Array, jax.Array | None]:
    """(values as stored, scales) of a pool; scales None for a float pool."""
    if isinstance(pool, QuantizedPages):
        return pool.values, pool.scales
    if isinstance(pool, PackedPages):
        return pool.values, None
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


def write_packed(pool: PackedPages, new: jax.Array, page: jax.Array, offsets: jax.Array,
                 layer: jax.Array | int | None = None, *, per_head: bool = False) -> PackedPages:
    """pool with new [K, N, H] set at token (page[n], offsets[n]) of every kv head: row
    offset // (lanes / H), lanes (offset % (lanes / H)) * H.. of the page (of row `layer` of a
    stacked pool [L, K, ...]; `per_head`: one scatter per kv head, `attention._write_rows`).
    Every index must be in bounds (the caller's trash page), so XLA updates in place."""
    lanes, head_dim = pool.values.shape[-1], pool.head_dim
    per = lanes // head_dim
    columns = [page, offsets // per, offsets % per * head_dim]  # page, row, first lane
    lead = [] if layer is None else [jnp.full_like(page, layer)]
    heads = len(lead)  # the kv heads' axis
    values = pool.values
    if per_head:  # every index a scatter dim but the lanes' window
        dims = jax.lax.ScatterDimensionNumbers(
            update_window_dims=(1,), inserted_window_dims=tuple(range(heads + 4 - 1)),
            scatter_dims_to_operand_dims=tuple(range(heads + 4)))
        for k in range(new.shape[0]):
            index = jnp.stack([*lead, jnp.full_like(page, k), *columns], axis=-1)
            values = jax.lax.scatter(values, index, new[k].astype(pool.dtype), dims,
                                     mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
        return PackedPages(values=values, head_dim=head_dim)
    inserted = tuple(range(heads)) + tuple(range(heads + 1, heads + 3))
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(0, 2), inserted_window_dims=inserted,
        scatter_dims_to_operand_dims=inserted + (heads + 3,))
    index = jnp.stack([*lead, *columns], axis=-1)  # [N, 3] (stacked: [N, 4])
    values = jax.lax.scatter(values, index, new.astype(pool.dtype), dims,
                             mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return PackedPages(values=values, head_dim=head_dim)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., H] float -> (i8[..., H], f32[...]): `rotate(x)`, quantized symmetric absmax over
    the last axis (module doc)."""
    x = rotate(x.astype(jnp.float32))
    scale = jnp.max(jnp.abs(x), axis=-1) / KV_INT8_MAX
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    q = jnp.clip(jnp.round(x * inv[..., None]), -KV_INT8_MAX, KV_INT8_MAX).astype(jnp.int8)
    return q, scale


def copy_pool_pages(pool: Pool, src: jax.Array, dst: jax.Array) -> Pool:
    """The pool (one layer's [K, pages, ...], or a stacked one [L, K, pages, ...]: every
    layer's) with pages dst[i] set to pages src[i] (i32[N] each; every source read before any
    page is written). An int8 pool's scale rows go by one dynamic-update-slice per page: for a
    scatter of whole rows XLA:TPU relays the scale array out (kv heads minor) and back, a copy
    of every layer's scales per call."""
    if isinstance(pool, PackedPages):
        return PackedPages(values=copy_pool_pages(pool.values, src, dst), head_dim=pool.head_dim)
    if not isinstance(pool, QuantizedPages):
        return _copy_pages(pool, src, dst)
    scales, n = pool.scales, src.shape[0]
    lead = scales.shape[:-3]  # the kv heads, after a stacked pool's layers
    width = scales.shape[-1]
    zeros = (0,) * len(lead)

    def at(page):  # start of a page's scale row (`page_scales`)
        return (*zeros, page // SCALE_GROUP, page % SCALE_GROUP, 0)

    def read(i, rows):
        row = jax.lax.dynamic_slice(scales, at(src[i]), (*lead, 1, 1, width))
        return jax.lax.dynamic_update_slice(rows, row, (*zeros, i, 0, 0))

    def write(i, x):
        row = jax.lax.dynamic_slice(rows, (*zeros, i, 0, 0), (*lead, 1, 1, width))
        return jax.lax.dynamic_update_slice(x, row, at(dst[i]))

    rows = jax.lax.fori_loop(0, n, read, jnp.zeros((*lead, n, 1, width), scales.dtype))
    scales = jax.lax.fori_loop(0, n, write, scales)
    return QuantizedPages(values=_copy_pages(pool.values, src, dst), scales=scales)


def copy_pool_rows(pool: Pool, src: tuple[jax.Array, jax.Array],
                   dst: tuple[jax.Array, jax.Array]) -> Pool:
    """The pool (one layer's [K, pages, page_size, H], or a stacked one: every layer's) with
    the token at (page, offset) = dst[0][n], dst[1][n] set to the one at src[0][n], src[1][n]
    for every kv head (i32[N] each; every source is read before any token is written), as
    stored: an int8 pool's values and scales, a lane-packed pool's H lanes. Indices must be in
    bounds (the caller pads with its trash page), so XLA updates the pool in place."""
    n = len(pool.shape)
    if isinstance(pool, QuantizedPages):
        def scale_at(page, off):  # a token's scale (`page_scales`)
            return page // SCALE_GROUP, page % SCALE_GROUP, off

        return QuantizedPages(values=copy_pool_rows(pool.values, src, dst),
                              scales=_copy_at(pool.scales, (n - 3, n - 2, n - 1),
                                              scale_at(*src), scale_at(*dst)))
    if isinstance(pool, PackedPages):
        per = pool.values.shape[-1] // pool.head_dim

        def lanes_at(page, off):  # page, row, first lane (`write_packed`)
            return page, off // per, off % per * pool.head_dim

        return PackedPages(values=_copy_at(pool.values, (n - 3, n - 2, n - 1), lanes_at(*src),
                                           lanes_at(*dst), window=pool.head_dim),
                           head_dim=pool.head_dim)
    return _copy_at(pool, (n - 3, n - 2), src, dst)


def _copy_at(x: jax.Array, axes: tuple[int, ...], src: tuple, dst: tuple,
             window: int = 1) -> jax.Array:
    """x with its slices at `dst` set to those at `src` (tuples of i32[N] indices into `axes`;
    the last indexed axis takes a run of `window` from its index, the others one; every other
    axis whole): one gather, then one scatter."""
    sizes = [1 if a in axes else x.shape[a] for a in range(x.ndim)]
    sizes[axes[-1]] = window
    collapsed = tuple(a for a in axes if sizes[a] == 1)
    rest = x.ndim - len(collapsed)
    offsets = tuple(range(1, 1 + rest))
    gather = jax.lax.GatherDimensionNumbers(offset_dims=offsets, collapsed_slice_dims=collapsed,
                                            start_index_map=axes)
    scatter = jax.lax.ScatterDimensionNumbers(update_window_dims=offsets,
                                              inserted_window_dims=collapsed,
                                              scatter_dims_to_operand_dims=axes)
    promise = jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS
    rows = jax.lax.gather(x, jnp.stack(src, axis=-1), gather, tuple(sizes), mode=promise)
    return jax.lax.scatter(x, jnp.stack(dst, axis=-1), rows, scatter, mode=promise)


def _copy_pages(values: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """values [..., pages, rows, lanes] with pages dst set to pages src."""
    at = (slice(None),) * (values.ndim - 3)
    return values.at[(*at, dst)].set(values[(*at, src)])


def make_pool(shape: tuple[int, ...], dtype: str, fill: float = 0.0, *, tpu: bool = False,
              parts: int = 1) -> Pool:
    """A layer's pool [K, pages, page_size, H] (or a stack of L layers' pools, [L, K, pages,
    page_size, H]) of `dtype` ("int8": QuantizedPages whose scales
    hold `fill`, so a NaN fill poisons what an int8 pool can poison; with the pages split into
    `parts` equal parts, each part's scales grouped on their own, so that a part's page p is
    its scales' p // 8, p % 8). `tpu`: laid out as the TPU kernels read it as XLA:TPU stores it
    (module doc: the scales in whole-lane rows, a float pool with H under 128 lane-packed where
    its pages stay whole tiles)."""
    *lead, pages, page_size, head_dim = shape  # lead: (K,), or (L, K) stacked
    if dtype == "int8":
        width = scale_width(page_size) if tpu else page_size
        groups = parts * scale_groups(pages // parts)
        return QuantizedPages(values=jnp.zeros(shape, jnp.int8),
                              scales=jnp.full((*lead, groups, SCALE_GROUP, width), fill,
                                              jnp.float32))
    per = lane_packing(page_size, head_dim, dtype) if tpu else 1
    if per > 1:
        return PackedPages(values=jnp.full((*lead, pages, page_size // per, per * head_dim),
                                           fill, jnp.dtype(dtype)), head_dim=head_dim)
    return jnp.full(shape, fill, jnp.dtype(dtype))
