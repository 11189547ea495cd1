"""Pallas TPU (Mosaic) weight-only quantized matmul for decode-sized rows; semantics in
`reference.py`.

Grid (n, k) over output-column tiles of `tn` and contraction tiles of `tk` (k last,
"arbitrary": an f32 [M, tn] accumulator in VMEM scratch carries the partial sums; n
"parallel"). The weight's BlockSpec index (k, n) visits every [tk, tn] tile of `q` exactly
once, so each stored weight byte is DMA'd from HBM once, in its stored dtype, and converted to
x's dtype only in VMEM:

- per channel (group 0): acc += x_k . q_k; the scale row [1, tn] multiplies the f32
  accumulator at the last k step.
- groups (group > 0): for each of the tile's tk / group groups g (a static loop),
  acc += (x_g . q_g) * scale_g + (sum x_g) * (offset * scale_g + zero_g): the exact algebra of
  (q + offset) * scale + zero summed over the group, so the weight tile is never dequantized
  (only converted). The scale and zero blocks are whole columns [K / group, B, tn] (index
  (0, 0, n), fetched once per column tile: a [tk / group, tn] block would break the (8, 128)
  rule for tk / group under 8), and a group's row is read at (k * tk / group + g, b).

The output is [M, B x N], tile (b, n) at column block b * N / tn + n: [M, B, N] by a free
reshape.

x's and the output's blocks span all M rows (a block dim equal to the array's is legal at any
M; Mosaic pads the rows to the sublane tile in VMEM, so M = 1, 8 or 13 needs no pad or slice
in HBM: compiled for v5e and v6e). x is one whole [M, K] block (index (0, 0): fetched once)
while it is at most X_WHOLE_BYTES, else [M, tk] tiles (index (0, k): fetched again for every
output-column tile).

Declared cost (`pl.CostEstimate`, what XLA's cost analysis reports as the kernel's bytes
accessed: a pallas_call without one reports none): exactly the DMA traffic of this grid,
computed from the shapes and tiles by `traffic_bytes`: q once, scale (and zero) once, x once
or once per output-column tile, the output written once.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quant_matmul.reference import validate_inputs

TN_CHOICES = (512, 256, 128)  # output-column tiles, widest first (lane multiples)
TK_CHOICES = (2048, 1024, 512, 256, 128)  # contraction tiles, longest first
X_WHOLE_BYTES = 2 << 20  # x stays one block (fetched once) up to this size (x2 buffered)


def tile_sizes(k: int, n: int, group: int) -> tuple[int, int] | None:
    """(tk, tn) for a [K, N] weight in groups of `group` (0: per channel): the widest tn in
    TN_CHOICES dividing N and the longest tk in TK_CHOICES dividing K that is a multiple of the
    group; None when none does (e.g. N = 576: the caller uses XLA's dot)."""
    tn = next((t for t in TN_CHOICES if n % t == 0), None)
    tk = next((t for t in TK_CHOICES if k % t == 0 and (not group or t % group == 0)), None)
    return None if tn is None or tk is None else (tk, tn)


def _bytes(shape, dtype) -> int:
    """Bytes of an array on a TPU: 4-bit types two per byte."""
    bits = jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else \
        8 * jnp.dtype(dtype).itemsize
    return -(-math.prod(shape) * bits // 8)


def x_whole(m: int, k: int, dtype) -> bool:
    """Whether x is one block (fetched once) rather than [M, tk] tiles."""
    return m * k * jnp.dtype(dtype).itemsize <= X_WHOLE_BYTES


def traffic_bytes(m: int, k: int, n: int, *, q_dtype, x_dtype, out_dtype, group: int,
                  tk: int, tn: int, batch: int = 1) -> int:
    """The HBM bytes the kernel's grid moves (module doc) for `batch` weights [K, N]: q and the
    scales (and zeros) once, x once (one whole block, or a single k tile) or once per
    output-column tile, the output written once."""
    scales = (1, batch, n) if not group else (k // group, batch, n)
    fields = _bytes((batch, k, n), q_dtype) + _bytes(scales, jnp.float32) * (2 if group else 1)
    x_fetches = 1 if x_whole(m, k, x_dtype) or k == tk else batch * n // tn
    return fields + x_fetches * _bytes((m, k), x_dtype) + _bytes((m, batch, n), out_dtype)


def _kernel(
    # inputs
    x_ref,  # [M, K] whole, or [M, tk]
    q_ref,  # [tk, tn] integers
    scale_ref,  # f32[1 (per channel) or K / group, B, tn]
    *refs,  # zero_ref f32[K / group, B, tn] when grouped; out_ref [M, tn]; acc_ref f32[M, tn]
    group: int, offset: int, tk: int, whole: bool,
):
    zero_ref, out_ref, acc_ref = refs if group else (None, *refs)
    b, k = pl.program_id(1), pl.program_id(2)

    def row(ref, r):  # f32[1, tn]: row r of weight b's scales
        return ref[r, pl.ds(b, 1), :] if len(ref.shape) == 3 else ref[pl.ds(r, 1), :]

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[:, pl.ds(pl.multiple_of(k * tk, tk), tk)] if whole else x_ref[...]
    # bf16 x: one MXU pass is exact (integer weights to 256 are exact in bf16); f32 x: the
    # full-precision passes, whatever the caller's default matmul precision
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=(
        jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else jax.lax.Precision.DEFAULT))
    if not group:
        acc_ref[...] += dot(x, q_ref[...].astype(x.dtype))
    else:
        acc = acc_ref[...]
        first = k * (tk // group)
        for g in range(tk // group):
            xg = x[:, g * group:(g + 1) * group]
            part = dot(xg, q_ref[g * group:(g + 1) * group, :].astype(x.dtype))
            scale = row(scale_ref, first + g)
            shift = offset * scale + row(zero_ref, first + g)
            acc = acc + part * scale + jnp.sum(xg.astype(jnp.float32), axis=1,
                                              keepdims=True) * shift
        acc_ref[...] = acc

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        out = acc_ref[...]
        out_ref[...] = (out * row(scale_ref, 0) if not group else out).astype(out_ref.dtype)


def quantized_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array | None, *,
                     group: int, offset: int = 0, out_dtype=None,
                     tiles: tuple[int, int] | None = None,
                     interpret: bool = False) -> jax.Array:
    """x [M, K] @ the quantized weight [K, N] ([B, K, N]: B weights; `reference.py`) -> [M, N]
    ([M, B, N]) in `out_dtype` (default x.dtype). `tiles`: (tk, tn), default `tile_sizes`.
    Raises ValueError for inputs outside the layout, or a weight that no tile in TN_CHOICES /
    TK_CHOICES divides (check `tile_sizes` first)."""
    validate_inputs(x, q, scale, zero, group=group)
    batched = q.ndim == 3
    q = q if batched else q[None]  # a leading unit dim: the same tiled layout
    (m, k), (b, _, n) = x.shape, q.shape
    tiles = tiles or tile_sizes(k, n, group)
    if tiles is None or k % tiles[0] or n % tiles[1] or (group and tiles[0] % group):
        raise ValueError(f"weight [{k}, {n}] (group {group}) does not tile (tiles {tiles}): "
                         f"N must be a multiple of one of {TN_CHOICES}, K of one of "
                         f"{TK_CHOICES} that the group divides")
    tk, tn = tiles
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    whole = x_whole(m, k, x.dtype)
    fields = [q, scale.astype(jnp.float32)] + ([zero.astype(jnp.float32)] if group else [])
    if not interpret:  # read from HBM by the kernel's DMAs, never staged into VMEM by XLA
        fields = [pltpu.with_memory_space_constraint(a, pltpu.HBM) for a in fields]
    # scales: all rows and weights of a column tile (a block of one weight's [rows, tn] would
    # squeeze the second-minor dim); index (0, 0, j), so with b inside j each is fetched once
    scale_spec = (pl.BlockSpec((scale.shape[0], b, tn), lambda j, c, i: (0, 0, j))
                  if scale.ndim == 3
                  else pl.BlockSpec((scale.shape[0], tn), lambda j, c, i: (0, j)))
    in_specs = [pl.BlockSpec((m, k), lambda j, c, i: (0, 0)) if whole
                else pl.BlockSpec((m, tk), lambda j, c, i: (0, i)),
                pl.BlockSpec((None, tk, tn), lambda j, c, i: (c, i, j)),
                scale_spec] + ([scale_spec] if group else [])
    traffic = traffic_bytes(m, k, n, q_dtype=q.dtype, x_dtype=x.dtype, out_dtype=out_dtype,
                            group=group, tk=tk, tn=tn, batch=b)
    flops = b * (2 * m * k * n + (4 * m * n * (k // group) if group else m * n))
    out = pl.pallas_call(
        functools.partial(_kernel, group=group, offset=offset, tk=tk, whole=whole),
        grid=(n // tn, b, k // tk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((m, tn), lambda j, c, i: (0, c * (n // tn) + j)),
        out_shape=jax.ShapeDtypeStruct((m, b * n), out_dtype),
        scratch_shapes=[pltpu.VMEM((m, tn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=traffic),
        interpret=interpret,
    )(x, *fields)
    return out.reshape(m, b, n) if batched else out
