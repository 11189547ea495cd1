"""The grouped matmul through XLA's ops (CPU, GPU); semantics in `reference.py`.

In this jax (0.10) `jax.lax.ragged_dot` is the dense computation on CPU and GPU: on CPU jax
expands it to every row times every expert under a mask (with a transposed copy of the
weights), and XLA:GPU (sm_90a, with or without its experimental ragged-dot flags) lowers it to
a dot over all E experts of x masked per expert. Every expert is read and computed on every
row, so neither form here uses it. Two forms, both reading only the experts that have rows:

- "tiles": a `lax.fori_loop` over the non-empty (group, row tile) steps of
  `common.group_tiles` (a dynamic count). Step s slices the row tile x[r0:r0 + tm], multiplies
  it by its group's weight w[g] [K, N] with f32 accumulation (stored forms in `_tile_product`:
  one expert at a time, never a dequantized copy of the stack) and writes the rows of its
  group into the output. XLA:CPU and XLA:GPU copy the step's expert out of the stack before a
  dot (their dots read whole buffers). The last tile starts at M - tm (a slice past M would be
  clamped), its rows still picked by index.
- "rows": each row's expert gathered inside one multiply-reduce fusion, out[m] = sum_k x[m, k]
  w[e(m), k, :], no loop and no copy: XLA:GPU compiles it to one reduction kernel reading each
  row's expert where it lies (sm_90a, deviceless: no temporary the size of a weight), where
  the tile loop's one-row dots of bf16 weights become a multiply materialised in f32 and a
  reduction per step. Rows of one expert each read it (B tokens of a decode step read at most
  B k experts).

A weight of C output blocks [E, C, K, N] (a mixture's gate and up) takes one dot per block in
each step of the loop, each slicing its [K, N] where it lies, and one gather in the rows form;
neither reshapes the stack.

`form_for` picks per backend and shape: CPU the tile loop (the rows form measured 3-80x
slower there, as XLA:CPU materialises the gathered weights: `scripts/grouped_matmul_benchmark.py`),
GPU the rows form while M <= E (it then reads at most M experts, where the loop would copy as
many), the tile loop above; GPU times are not measured (compiled deviceless only). Padding rows
(past the groups' sum) come out 0, and a NaN in them stays out of the valid rows (masks are
selects, not products).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.common import group_tiles
from pallas_kernels.grouped_matmul.reference import row_groups, unpack_int4, validate_inputs

MAX_TM = 64  # row tiles at most this long (`tile_rows`)
FORMS = ("tiles", "rows")


def tile_rows(m: int) -> int:
    """Rows per step of the tile loop for M rows: the power of two nearest below sqrt(M / 4),
    from 1 to MAX_TM (1 row at M = 8, 4 at 64, 8 at 256, 16 at 2048, 64 at 16384). Longer tiles
    take fewer steps (each copies and reads its expert) but compute more rows: a tile shared
    by two groups is computed by both, and past a few rows the dot stops being bound by the
    weight's read. Measured on CPU, E 64, [1024, 512] f32 experts, k 8: the fastest tm at each
    of those M (`scripts/grouped_matmul_benchmark.py --sweep`)."""
    return min(m, MAX_TM, 1 << max(0, math.isqrt(m // 4).bit_length() - 1))


def form_for(backend: str, m: int, num_groups: int) -> str:
    """The form (module doc) for M rows over `num_groups` experts on `backend`."""
    return "rows" if backend in ("gpu", "cuda", "rocm") and m <= num_groups else "tiles"


def _grouped_after(xg, values, scale, zero, *, offset: int, precision):
    """f32 [.., N]: sum over groups of (x_g . q_g) * scale_g + (sum x_g) * (offset * scale_g +
    zero_g), the dequantized weight's product with only a convert on the stored integers;
    xg [.., G, group], values [.., G, group, N] (batched over the leading dims), scale and zero
    f32 [.., G, N]."""
    parts = jnp.einsum("...gk,...gkn->...gn", xg, values.astype(xg.dtype), precision=precision,
                       preferred_element_type=jnp.float32)
    sums = xg.astype(jnp.float32).sum(-1)  # (q + offset) . x = q . x + offset sum(x)
    return (jnp.einsum("...gn,...gn->...n", parts + offset * sums[..., None], scale,
                       precision=precision)
            + jnp.einsum("...g,...gn->...n", sums, zero, precision=precision))


def _tile_product(xt, w, scale, zero, g, c: int, *, group: int, offset: int,
                  precision) -> jax.Array:
    """f32 [tm, N]: the row tile xt [tm, K] times block c of expert g's weight (w [E, K, N]
    with c 0, or [E, C, K, N]), stored as `w` is: float and per-channel int8 by one dot (int8's
    scale on the product); groups with their scales after a dot batched over the groups while
    tm <= 2 * group (a [tm, K / group, N] f32 intermediate of at most 2 elements per weight
    element), else dequantized to x's dtype before one dot."""
    lead = 1 if w.ndim == 3 else 2

    def pick(a):  # a[g] or a[g, c], sliced where it lies
        start = (g, c)[:lead] + (0,) * (a.ndim - lead)
        return jax.lax.dynamic_slice(a, start, (1,) * lead + a.shape[lead:])[(0,) * lead]

    wg = pick(w)
    if jnp.issubdtype(w.dtype, jnp.floating) or not group:
        y = jnp.dot(xt, wg.astype(xt.dtype), precision=precision,
                    preferred_element_type=jnp.float32)
        return y if scale is None else y * pick(scale)
    (tm, k), n = xt.shape, wg.shape[-1]
    if wg.shape[0] != k:
        wg = unpack_int4(wg[None], group)[0]
    scale, zero = pick(scale).astype(jnp.float32), pick(zero).astype(jnp.float32)
    if tm <= 2 * group:
        return _grouped_after(xt.reshape(tm, k // group, group),
                              wg.reshape(k // group, group, n), scale, zero, offset=offset,
                              precision=precision)
    rows = functools.partial(jnp.repeat, repeats=group, axis=0)
    weight = (wg.astype(jnp.float32) + offset) * rows(scale) + rows(zero)
    return jnp.dot(xt, weight.astype(xt.dtype), precision=precision,
                   preferred_element_type=jnp.float32)


def _tiles(x, w, group_sizes, scale, zero, *, group, offset, out_dtype, tm, precision):
    m = x.shape[0]
    tm = min(tm or tile_rows(m), m)
    offsets, group_ids, m_tile_ids, num_steps, _ = group_tiles(group_sizes, m, tm)

    def step(s, out):
        g = group_ids[s]
        r0 = jnp.minimum(m_tile_ids[s] * tm, m - tm)
        xt = jax.lax.dynamic_slice_in_dim(x, r0, tm)
        y = jnp.stack([_tile_product(xt, w, scale, zero, g, c, group=group, offset=offset,
                                     precision=precision) for c in range(num_blocks)])
        rows = r0 + jnp.arange(tm, dtype=jnp.int32)[:, None]
        mine = (rows >= offsets[g]) & (rows < offsets[g + 1])
        old = jax.lax.dynamic_slice_in_dim(out, r0, tm, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(
            out, jnp.where(mine, y.astype(out_dtype), old), r0, 1)

    num_blocks = 1 if w.ndim == 3 else w.shape[1]
    return jax.lax.fori_loop(0, num_steps, step,
                             jnp.zeros((num_blocks, m, w.shape[-1]), out_dtype))


def _rows(x, w, group_sizes, scale, zero, *, group, offset, out_dtype, precision):
    (m, k), e = x.shape, w.shape[0]
    ids = row_groups(group_sizes, m)
    valid = ids < e
    ids = jnp.minimum(ids, e - 1)  # padding rows read the last expert, their output dropped
    xf = x.astype(jnp.float32)

    def gather(a):  # [M, C, .., N]: each row's expert, a block axis of 1 added after the gather
        return a[ids] if w.ndim == 4 else a[ids][:, None]

    c = 1 if w.ndim == 3 else w.shape[1]
    if jnp.issubdtype(w.dtype, jnp.floating) or not group:  # [M, C, N]
        y = jnp.sum(xf[:, None, :, None] * gather(w).astype(jnp.float32), axis=2)
        y = y if scale is None else y * gather(scale)[:, :, 0].astype(jnp.float32)
    else:
        values = gather(w) if w.shape[-2] == k else unpack_int4(gather(w), group)
        xg = jnp.broadcast_to(xf.reshape(m, 1, k // group, group), (m, c, k // group, group))
        y = _grouped_after(xg, values.reshape(m, c, k // group, group, -1),
                           gather(scale).astype(jnp.float32), gather(zero).astype(jnp.float32),
                           offset=offset, precision=precision)
    return jnp.where(valid[:, None], jnp.swapaxes(y, 0, 1), 0).astype(out_dtype)


def grouped_matmul_xla(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                       scale: jax.Array | None = None, zero: jax.Array | None = None,
                       group: int = 0, offset: int = 0, preferred_element_type=None,
                       form: str = "tiles", tm: int | None = None) -> jax.Array:
    """x [M, K] (rows sorted by group) times each group's weight w [E, K, N] or [E, C, K, N]
    (`reference.py`; the u8-packed int4 layout too) -> [M, N] or [C, M, N] in
    `preferred_element_type` (default x.dtype); padding rows 0. `form`: "tiles" or "rows"
    (module doc; `form_for` picks); `tm`: rows per step of the tile loop, default
    `tile_rows`."""
    validate_inputs(x, w, group_sizes, scale=scale, zero=zero, group=group)
    if form not in FORMS:
        raise ValueError(f"form {form!r} is not one of {FORMS}")
    kwargs = dict(group=group, offset=offset,
                  out_dtype=jnp.dtype(preferred_element_type or x.dtype),
                  precision=jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None)
    if form == "rows":
        out = _rows(x, w, group_sizes, scale, zero, **kwargs)
    else:
        out = _tiles(x, w, group_sizes, scale, zero, tm=tm, **kwargs)
    return out if w.ndim == 4 else out[0]
