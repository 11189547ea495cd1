"""Pallas TPU (Mosaic) grouped matmul; semantics in `reference.py`, row tiles in `common.py`.

Grid (j, s): output-column tiles of `tn` ("parallel"), then the steps s of the group metadata
("arbitrary", a dynamic count: only the (group, row tile) pairs that hold rows). The weight is
[E, C, K, N] (C output blocks before the contraction: a mixture's gate and up, C = 2, as the
model stores them; [E, K, N] is C = 1): column tile j is tile j % (N / tn) of block
c = j // (N / tn), the index map picks w[group, c, :, tile] where it lies, so the stack is
never reshaped, and the output is [C, M, N] (tn may be all of N, as gpt-oss's 2880 is). Step s
multiplies the row tile x[m_tile_ids[s]] [tm, K] by its group's weight tile [K, tn] and stores
the rows of its group into the output tile (a tile two groups share is written by both steps,
each keeping its own rows; the output block stays in
VMEM while consecutive steps share it). The contraction is not tiled, so consecutive steps of
one group index the same weight block and Pallas does not fetch it again: each non-empty
expert's [K, N] weight is read from HBM once per call, in its stored dtype, and an empty
expert's never. A row tile is read once per column tile. A float or per-channel int8 weight
whose N pads the 128-lane tile and whose K does not is stored by XLA TPU with those two dims
swapped (`lanes_transposed`): the kernel reads it as [E, C, N, K] and contracts the tile's last
dim, so that layout needs no copy either.

Quantized experts' scales (and zeros) stay in HBM (`pl.ANY`) and the kernel DMAs each
non-empty expert's [rows, tn] at its first step of a column tile into one of two VMEM buffers,
starting the next expert's copy into the other one step ahead. The copy reads them in the
order XLA TPU stores f32[E, (C,) rows, N]: expert-major, or rows-major ([rows][E][N], for C = 1)
when `rows` would pad its sublane tile (`rows_major`: int4 groups of 128 over a 768
contraction give 6 rows), so the array reaches the kernel as it lies in HBM, with no relayout
copy per call (a BlockSpec could not pick one expert out of the middle axis).

Stored forms (`reference.py`):
- float: one dot.
- per-channel int8: dot(x, q) (q converted to x's dtype in VMEM), times the expert's scale row.
- groups, rows per tile up to 2 * group ("after", decode-sized tiles): per group g of the
  K / group (a static loop) acc += (x_g . q_g) * scale_g + (sum x_g) * (offset * scale_g +
  zero_g): the exact algebra of the dequantized weight summed over the group, the tile only
  converted (as `pallas_kernels.quant_matmul` does).
- groups, longer row tiles ("before", prefill): the expert's tile dequantized into a VMEM
  scratch [K, tn] in x's dtype once per (expert, column tile), at the expert's first step,
  then one dot per step at the MXU's full depth (per-group dots of depth `group` would waste
  it).

Padding rows (past the groups' sum) are only ever multiplied row by row, so a NaN there stays
in its own output row; tiles wholly past the sum are never visited and their output rows are
left unwritten.

Declared cost (`pl.CostEstimate`, the bytes XLA's cost analysis reports for the kernel): the
grid's DMA traffic computed by `traffic_bytes` for `cost_groups` non-empty experts (the group
sizes are data, unknown at compile time; default min(E, M), the most M rows can touch): their
weights and scales once, x once per column tile, the output once, and the metadata (XLA adds
1 KB of its own: the step count's copy into SMEM).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.grouped_matmul.common import group_tiles, max_steps
from pallas_kernels.grouped_matmul.reference import packed_int4, validate_inputs

TN_CHOICES = (512, 256, 128)  # output-column tiles, widest first (lane multiples)
MAX_TM = 512  # row tiles at most this long
VMEM_BUDGET = 24 << 20  # the tiles' estimated VMEM use stays under this (x2 buffered blocks)
VMEM_LIMIT = 48 << 20  # Mosaic's scoped VMEM limit for the kernel (v5e/v6e hold 128 MiB)


def _bytes(shape, dtype) -> int:
    """Bytes of an array on a TPU: 4-bit types two per byte."""
    bits = jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else \
        8 * jnp.dtype(dtype).itemsize
    return -(-math.prod(shape) * bits // 8)


def _after(tm: int, group: int) -> bool:
    """Whether grouped scales apply after per-group dots (module doc) for row tiles of `tm`."""
    return tm <= 2 * group


def _vmem_bytes(tm: int, k: int, tn: int, *, x_dtype, w_dtype, out_dtype, group: int) -> int:
    """Estimated VMEM of one step: double-buffered x, weight, scales and output blocks, the f32
    product, and the dequantized tile with its f32 temporaries ("before" groups)."""
    blocks = _bytes((tm, k), x_dtype) + _bytes((k, tn), w_dtype) + _bytes((tm, tn), out_dtype)
    if not jnp.issubdtype(w_dtype, jnp.floating):
        blocks += 2 * _bytes((k // group if group else 1, tn), jnp.float32)
    scratch = _bytes((tm, tn), jnp.float32)
    if group and not _after(tm, group):
        scratch += _bytes((k, tn), x_dtype) + 2 * _bytes((k, tn), jnp.float32)
    return 2 * blocks + scratch


def tile_sizes(m: int, k: int, n: int, num_groups: int, *, x_dtype, w_dtype, out_dtype=None,
               group: int = 0) -> tuple[int, int] | None:
    """(tm, tn) for M rows over `num_groups` experts [K, N]: tm the power of two nearest below
    half an average group, M / (2 E) (a tile shared by two groups is computed by both, so the
    extra rows stay near E * tm / M <= 1/2), from the sublane tile (8 rows of f32, 16 of bf16:
    x's and the output's) to MAX_TM, or M itself when that is shorter; tn the widest of
    TN_CHOICES dividing N whose tiles fit VMEM_BUDGET; when none divides, N itself, or for a
    float weight the widest of TN_CHOICES below N with a ragged last tile (gpt-oss's 2880:
    its [2880, 2880] tile would not fit; the last tile's columns past N are computed on
    padding and dropped). None when no tn fits."""
    sublane = 32 // min(jnp.dtype(x_dtype).itemsize, jnp.dtype(out_dtype or x_dtype).itemsize)
    tm = max(sublane, min(MAX_TM, 1 << max(0, (m // (2 * num_groups)).bit_length() - 1)))
    tm = min(tm, m)
    choices = [t for t in TN_CHOICES if n % t == 0] or [n] + (
        [t for t in TN_CHOICES if t < n] if jnp.issubdtype(w_dtype, jnp.floating) else [])
    for tn in choices:
        if _vmem_bytes(tm, k, tn, x_dtype=x_dtype, w_dtype=w_dtype,
                       out_dtype=out_dtype or x_dtype, group=group) <= VMEM_BUDGET:
            return tm, tn
    return None


def traffic_bytes(m: int, k: int, n: int, num_groups: int, col_tiles: int | None = None, *,
                  x_dtype, w_dtype, out_dtype, group: int, tm: int, tn: int,
                  cost_groups: int) -> int:
    """The HBM bytes the kernel's grid moves (module doc) when `cost_groups` of the
    `num_groups` experts have rows: their weights (and scales) once, x once per column tile,
    the output once, and the metadata read into SMEM."""
    rows = 0 if jnp.issubdtype(w_dtype, jnp.floating) else (k // group if group else 1)
    expert = _bytes((k, n), w_dtype) + _bytes((rows, n), jnp.float32) * (2 if group else 1)
    metadata = 4 * (2 * num_groups + 1 + 2 * max_steps(m, tm, num_groups))
    col_tiles = n // tn if col_tiles is None else col_tiles  # x is read once per column tile
    return (cost_groups * expert + col_tiles * _bytes((m, k), x_dtype)
            + _bytes((m, n), out_dtype) + metadata)


def _product(x, w_ref, scale_ref, zero_ref, wd_ref, *, group: int, offset: int, first,
             transposed: bool = False):
    """f32 [tm, tn]: the row tile times its expert's weight tile (module doc's forms; a
    `transposed` tile is [tn, K], float or per-channel int8)."""
    # bf16 x: one MXU pass is exact for integer weights to 256; f32 x: full-precision passes
    dot = functools.partial(
        jax.lax.dot_general, dimension_numbers=(((1,), (1 if transposed else 0,)), ((), ())),
        preferred_element_type=jnp.float32, precision=(
            jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else jax.lax.Precision.DEFAULT))
    if scale_ref is None:
        return dot(x, w_ref[...].astype(x.dtype))
    if not group:
        return dot(x, w_ref[...].astype(x.dtype)) * scale_ref[...]
    if wd_ref is None:  # after
        acc = jnp.zeros((x.shape[0], w_ref.shape[-1]), jnp.float32)
        for g in range(w_ref.shape[0] // group):
            xg = x[:, g * group:(g + 1) * group]
            scale = scale_ref[g:g + 1, :]
            shift = offset * scale + zero_ref[g:g + 1, :]
            acc += dot(xg, w_ref[g * group:(g + 1) * group, :].astype(x.dtype)) * scale
            acc += jnp.sum(xg.astype(jnp.float32), axis=1, keepdims=True) * shift
        return acc

    @pl.when(first)
    def _():
        k, tn = w_ref.shape
        values = w_ref[...].astype(jnp.float32).reshape(k // group, group, tn) + offset
        w = values * scale_ref[...][:, None, :] + zero_ref[...][:, None, :]
        wd_ref[...] = w.reshape(k, tn).astype(wd_ref.dtype)

    return dot(x, wd_ref[...])


def lanes_transposed(k: int, n: int) -> bool:
    """Whether XLA TPU stores a weight [.., K, N] with its two minor dims swapped (layout
    {.., n, k}): when N would pad its 128-lane tile and K would not (bf16 or int8 [4, 2, 256,
    192], a toy's expert shard: checked by tests/test_grouped_matmul.py). The kernel then reads
    it as [.., N, K] and contracts the tile's last dim, so it stays as stored."""
    return n % 128 != 0 and k % 128 == 0


def _tile_friendly(d: int) -> bool:
    """Whether XLA TPU tiles a second-minor dim of d without padding (a multiple of the
    8-sublane tile, or one of its 1, 2, 4-row tilings)."""
    return d % 8 == 0 or d in (1, 2, 4)


def rows_major(num_groups: int, rows: int) -> bool:
    """Whether XLA TPU stores scales f32[E, rows, N] rows-major ([rows][E][N] in memory, layout
    {2,0,1}): when `rows` would pad its tile and E would not (f32[128, 6, 2048], int4 groups of
    128 over a 768 contraction: checked by tests/test_grouped_matmul.py)."""
    return not _tile_friendly(rows) and _tile_friendly(num_groups)


def _scale_copies(scale_hbm, zero_hbm, bufs, sems, g, slot, *, c, j, tn: int, by_rows: bool,
                  layer):
    """The DMAs of expert g's scales (and zeros) of block c, column tile j, into buffer
    `slot` (`layer`: () or (the stack's row,))."""
    copies = []
    for field, (hbm, buf) in enumerate(zip((scale_hbm, zero_hbm), bufs)):
        if hbm is not None:
            cols = pl.ds(pl.multiple_of(j * tn, tn), tn)
            if by_rows:  # [rows, E, N]
                src = hbm.at[:, g, cols]
            else:  # [(L,) E, (C,) rows, N]
                blocks = (c,) if len(hbm.shape) - len(layer) == 4 else ()
                src = hbm.at[(*layer, g, *blocks, slice(None), cols)]
            copies.append(pltpu.make_async_copy(src, buf.at[slot], sems.at[field, slot]))
    return copies


def _kernel(
    # scalar prefetch
    offsets_ref,  # i32[E + 1] each group's first row (and the end)
    slots_ref,  # i32[E] the scale buffer of each group (non-empty groups alternate)
    group_ids_ref,  # i32[max_steps] each step's group
    m_tile_ids_ref,  # i32[max_steps] each step's row tile
    *refs,  # scalar prefetch: layer_ref i32[1] the stack's row (stacked); inputs: x_ref
    # [tm, K], w_ref [K, tn] float or integers, scale_hbm f32[(L,) E, (C,) rows, N] or
    # [rows, E, N] (quantized), zero_hbm (groups); outputs: out_ref [tm, tn]; scratch:
    # scale_buf, zero_buf f32[2, rows, tn], sems DMA[2, 2] (quantized), wd_ref [K, tn] x's
    # dtype ("before" groups)
    quantized: bool, group: int, offset: int, before: bool, by_rows: bool, col_tiles: int,
    transposed: bool, stacked: bool,
):
    refs = list(refs)
    layer = (refs.pop(0)[0],) if stacked else ()
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    scale_hbm = refs.pop(0) if quantized else None
    zero_hbm = refs.pop(0) if group else None
    out_ref = refs.pop(0)
    scale_buf, zero_buf, sems = (refs.pop(0), refs.pop(0), refs.pop(0)) if quantized else \
        (None, None, None)
    wd_ref = refs.pop(0) if before else None
    j, s, num_steps = pl.program_id(0), pl.program_id(1), pl.num_programs(1)
    g = group_ids_ref[s]
    first = jnp.logical_or(s == 0, g != group_ids_ref[jnp.maximum(s - 1, 0)])
    scale_ref = zero_ref = None
    if quantized:  # each expert's scales DMA'd once per column tile, the next one's prefetched
        copies = functools.partial(_scale_copies, scale_hbm, zero_hbm, (scale_buf, zero_buf),
                                   sems, c=j // col_tiles, j=j % col_tiles, tn=out_ref.shape[-1],
                                   by_rows=by_rows, layer=layer)
        slot = slots_ref[g]
        nxt = group_ids_ref[jnp.minimum(s + 1, num_steps - 1)]

        @pl.when(s == 0)
        def _():
            for c in copies(g, slot):
                c.start()

        @pl.when(first)
        def _():
            for c in copies(g, slot):
                c.wait()

        @pl.when(jnp.logical_and(s + 1 < num_steps, nxt != g))
        def _():
            for c in copies(nxt, slots_ref[nxt]):
                c.start()

        scale_ref = scale_buf.at[slot]
        zero_ref = zero_buf.at[slot] if group else None
    y = _product(x_ref[...], w_ref, scale_ref, zero_ref, wd_ref, group=group, offset=offset,
                 first=first, transposed=transposed)
    tm, tn = out_ref.shape
    rows = m_tile_ids_ref[s] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
    mine = jnp.logical_and(rows >= offsets_ref[g], rows < offsets_ref[g + 1])
    out_ref[...] = jnp.where(mine, y, out_ref[...].astype(jnp.float32)).astype(out_ref.dtype)


def grouped_matmul_tpu(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                       scale: jax.Array | None = None, zero: jax.Array | None = None,
                       group: int = 0, offset: int = 0, preferred_element_type=None,
                       tiles: tuple[int, int] | None = None, cost_groups: int | None = None,
                       metadata: tuple[jax.Array, ...] | None = None,
                       layer: jax.Array | int | None = None, interpret=False) -> jax.Array:
    """x [M, K] (rows sorted by group) times each group's weight w [E, K, N] or [E, C, K, N]
    (`reference.py`) -> [M, N] or [C, M, N] in `preferred_element_type` (default x.dtype).
    `layer` (i32[]): w, scale and zero are stacks [L, ...] of which row `layer` is multiplied,
    read where it lies (a scanned layer's experts: no copy of the row).
    `tiles`: (tm, tn), default `tile_sizes`; `cost_groups`: the non-empty experts the declared
    cost counts (module doc); `metadata`: `common.group_tiles(group_sizes, M, tm)` when the
    caller has it (matmuls over the same rows and tm share it), else computed here. Raises
    ValueError for inputs outside the layout, the u8-packed int4 layout (XLA's path takes it),
    or tiles that do not fit (check `tile_sizes` first)."""
    row = [None if a is None else jax.ShapeDtypeStruct(a.shape[layer is not None:], a.dtype)
           for a in (w, scale, zero)]
    validate_inputs(x, row[0], group_sizes, scale=row[1], zero=row[2], group=group)
    if packed_int4(x, row[0]):
        raise ValueError("u8-packed int4 w: the TPU kernel reads native jnp.int4 [E, K, N]")
    blocks = row[0].ndim == 4  # else one block, read as [E, K, N] (scales: `_scale_field`)
    (m, k), e, n = x.shape, row[0].shape[0], w.shape[-1]
    c = row[0].shape[1] if blocks else 1
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    tiles = tiles or tile_sizes(m, k, n, e, x_dtype=x.dtype, w_dtype=w.dtype,
                                out_dtype=out_dtype, group=group)
    quantized = not jnp.issubdtype(w.dtype, jnp.floating)
    if tiles is None or (n % tiles[1] and (quantized or tiles[1] % 128)):
        raise ValueError(f"w [{e}, {c}, {k}, {n}] {w.dtype} does not tile (tiles {tiles}): N "
                         f"must be a multiple of one of {TN_CHOICES} (float weights: or a "
                         f"lane multiple with a ragged last tile) whose [K, tn] tiles fit "
                         f"{VMEM_BUDGET >> 20} MiB of VMEM")
    tm, tn = tiles
    if metadata is None:
        metadata = group_tiles(group_sizes, m, tm)
    offsets, group_ids, m_tile_ids, num_steps, slots = metadata
    cost = traffic_bytes(m, k, c * n, e, c * -(-n // tn), x_dtype=x.dtype, w_dtype=w.dtype,
                         out_dtype=out_dtype, group=group, tm=tm, tn=tn,
                         cost_groups=min(e, m) if cost_groups is None else cost_groups)
    stacked = layer is not None
    call, operands = _pallas_call(x, w, scale, zero, group=group, offset=offset, tiles=tiles,
                                  out_dtype=out_dtype, num_steps=num_steps, cost=cost,
                                  stacked=stacked, interpret=interpret)
    prefetch = (offsets, slots, group_ids, m_tile_ids)
    if stacked:
        prefetch += (jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),)
    out = call(*prefetch, *operands)
    return out if blocks else out[0]


def _scale_field(a: jax.Array, by_rows: bool) -> jax.Array:
    """Scales f32[E, rows, N] or [E, C, rows, N] as the kernel reads them: as they are, or
    [rows, E, N] when XLA stores [E, rows, N] rows-major (`rows_major`), so the transpose is a
    bitcast of the stored array. XLA TPU keeps [E, C, rows, N] row-major (checked by
    tests/test_grouped_matmul.py)."""
    return jnp.transpose(a, (1, 0, 2)) if by_rows else a


def _pallas_call(x, w, scale, zero, *, group, offset, tiles, out_dtype, num_steps, cost,
                 stacked, interpret):
    """(the kernel's pallas_call, its operands after the scalar prefetch: x, w and the scale
    fields as the kernel reads them, rows-major scales as [rows, E, N], the order XLA stores
    them in (`rows_major`), so the transpose is free; `stacked`: w and its fields are [L, ..]
    stacks, read at the row of a fifth scalar prefetch)."""
    (m, k), e, n, (tm, tn) = x.shape, w.shape[int(stacked)], w.shape[-1], tiles
    c = w.shape[1 + stacked] if w.ndim - stacked == 4 else 1
    quantized = not jnp.issubdtype(w.dtype, jnp.floating)
    rows = k // group if group else 1
    by_rows = quantized and not stacked and scale.ndim == 3 and rows_major(e, rows)
    fields = [_scale_field(a.astype(jnp.float32), by_rows) for a in (scale, zero)
              if a is not None]
    before = bool(group) and not _after(tm, group)
    scratch = [pltpu.VMEM((2, rows, tn), jnp.float32), pltpu.VMEM((2, rows, tn), jnp.float32),
               pltpu.SemaphoreType.DMA((2, 2))] if quantized else []
    scratch += [pltpu.VMEM((k, tn), x.dtype)] if before else []
    def index(fn):  # an index map of (j, s, group ids, row tiles[, layer])
        return lambda j, s, offsets, slots, ids, tile, *layer: fn(j, s, ids, tile, *layer)

    col_tiles = -(-n // tn)  # per block: column tile j is block j // col_tiles's j % col_tiles
    # the weight as stored: no unit block axis added to [E, K, N] (a scanned stack's layer
    # would be copied out for it), [E, (C,) N, K] a bitcast when XLA swaps its minor dims
    transposed = not group and lanes_transposed(k, n)
    lead = w.ndim - 2 - stacked
    w = jnp.swapaxes(w, -1, -2) if transposed else w

    def w_index(j, s, ids, tile, *layer):
        tiles = (0, j % col_tiles)
        return (tuple(r[0] for r in layer) + (ids[s], j // col_tiles)[:lead]
                + (tiles[::-1] if transposed else tiles))

    w_spec = pl.BlockSpec((None,) * (lead + stacked) + ((tn, k) if transposed else (k, tn)),
                          index(w_index))
    in_specs = [pl.BlockSpec((tm, k), index(lambda j, s, ids, tile, *_: (tile[s], 0))), w_spec]
    in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * len(fields)
    w_field = w if interpret else pltpu.with_memory_space_constraint(w, pltpu.HBM)
    flops = 2 * m * k * c * n + (4 * m * c * n * rows if group else 0)
    call = pl.pallas_call(
        functools.partial(_kernel, quantized=quantized, group=group, offset=offset,
                          before=before, by_rows=by_rows, col_tiles=col_tiles,
                          transposed=transposed, stacked=stacked),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4 + stacked, grid=(c * col_tiles, num_steps), in_specs=in_specs,
            out_specs=pl.BlockSpec((None, tm, tn), index(
                lambda j, s, ids, tile, *_: (j // col_tiles, tile[s], j % col_tiles))),
            scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct((c, m, n), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=cost),
        interpret=interpret,
    )
    return call, (x, w_field, *fields)
