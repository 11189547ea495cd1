"""Pallas TPU (Mosaic) ragged paged flash attention: a whole mixed step's rows in one call.

Same semantics as `reference.ragged_paged_attention_reference`. The flat query rows are tiled
into blocks of `block_tokens` tokens; with GQA packed, block j of kv head k is one
[block_tokens * G, H] tile (row r = token r // G, query head r % G of kv head k), so the MXU sees
full tiles for decode rows as well as for prompt chunks. Grid (kv head k, row block j), both
parallel (megacore): each program owns its output block, walks the sequences meeting it
(`common.block_sequences`, scalar-prefetched with the lengths and the page table), and for each
streams the sequence's K/V pages from HBM (`pl.ANY`) into a double-buffered VMEM scratch
[2, pages_per_block, page_size, H] (block i + 1's DMAs are started before block i is computed),
only the pages that hold keys some row of the block can see: causal skipping (a chunk's early
rows stop at their own position) and the sliding window bound the range. Scores and the online
softmax (m, l, acc) are f32 in VMEM; no score matrix beyond one [rows, keys] tile, no f32 copy of
the pages. Rows of other sequences are masked (their m, l, acc are left as they are), and a row no
sequence owns outputs 0. Attention sinks start every row's softmax from its head's sink, as the
decode kernel's do.

int8 pages read as the decode kernel's do (`paged_attention.tpu`: `page_copies_of` fetches each
page's scales with it, `load_block` converts the int8 tiles in VMEM and lays the block's scales
along lanes, applied to the score and probability tiles' key columns).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention.reference import (
    layer_row,
    layer_view,
    sink_rows,
    unpack_pages,
)
from pallas_kernels.paged_attention.tpu import (
    _online_softmax_step,
    _reset,
    _scores,
    _sublanes,
    _write_out,
    add_lane_groups,
    flash_scratch,
    lane_groups,
    load_block,
    out_dtype,
    page_copies_of,
    page_geometry,
)
from pallas_kernels.ragged_attention.common import block_rows, block_sequences
from pallas_kernels.ragged_attention.reference import validate_inputs

# Query rows (tokens x G) per block: 256 rows make a score tile of the MXU's size on v6e (and two
# of v5e's 128 x 128), and put a prompt chunk's K/V reuse at 256 FLOPs per byte read, about the
# ridge point of v5e (197 TFLOP/s over 819 GB/s); fewer leave prefill bandwidth-bound.
TARGET_BLOCK_ROWS = 256


def default_block_tokens(num_rows: int, group: int, dtype) -> int:
    """Tokens per row block: about TARGET_BLOCK_ROWS / G, a multiple of the sublane tile (so the
    [tokens * G, H] tile is whole VMEM tiles), and no more than the rows need."""
    sub = _sublanes(dtype)
    want = max(sub, TARGET_BLOCK_ROWS // group // sub * sub)
    return min(want, -(-num_rows // sub) * sub)


def validate_tpu_ragged_blocks(block_tokens: int, group: int, dtype) -> None:
    """The (8,128) rule for the row block (of the queries' `dtype`); the page blocks follow the
    decode kernel's (`page_geometry`)."""
    sub = _sublanes(dtype)
    if block_tokens < 1 or (block_tokens * group) % sub:
        raise ValueError(
            f"TPU (8,128) tiling rule: a row block of block_tokens={block_tokens} tokens x "
            f"G={group} query heads = {block_tokens * group} rows must be a positive multiple "
            f"of {sub} (the sublane tile of {jnp.dtype(dtype).name}); use a multiple of {sub}")


def _kernel(
    # scalar prefetch
    kv_lens_ref, page_table_ref, q_starts_ref, q_lens_ref, seq_lo_ref, seq_hi_ref, layer_ref,
    # inputs: q_ref; with sinks sink_ref f32[rows, 1] (each row's query head's sink); then the
    # pools in HBM, K and V (+ their scales with int8 pages);
    # outputs: o_ref; scratch: a VMEM double buffer per pool, sems, m_ref, l_ref, acc_ref
    q_ref, *refs,
    group, block_tokens, page_size, pages_per_block, pages_per_seq, num_pages, scale,
    soft_cap, sliding_window, pack, stacked, sinks,
):
    sink_ref, refs = (refs[0], refs[1:]) if sinks else (None, refs)
    n = (len(refs) - 5) // 2
    pools, o_ref, bufs = refs[:n], refs[n], refs[n + 1:2 * n + 1]
    sems, m_ref, l_ref, acc_ref = refs[2 * n + 1:]
    kh, j = pl.program_id(0), pl.program_id(1)
    row0 = j * block_tokens
    block_keys = page_size * pages_per_block
    lead = (layer_ref[0],) if stacked else ()  # the layer's row of stacked pools
    _reset(m_ref, l_ref, acc_ref, sink_ref)

    def sequence(s, carry):
        start, n_q, kv_len = q_starts_ref[s], q_lens_ref[s], kv_lens_ref[s]
        lo, hi, first_pos, last_pos = block_rows(start, n_q, kv_len, row0, block_tokens)
        last_blk = jnp.where(hi > lo, lax.div(jnp.maximum(last_pos, 0), block_keys), -1)
        first_blk = jnp.int32(0)
        if sliding_window is not None:  # the earliest key the block's first row can see
            first_blk = lax.div(jnp.maximum(first_pos - sliding_window + 1, 0), block_keys)

        def for_live_pages(blk, buf_slot, fn):
            for p in range(pages_per_block):
                @pl.when(blk * block_keys + p * page_size < kv_len)
                def _(p=p):
                    pid = page_table_ref[s * pages_per_seq + blk * pages_per_block + p]
                    pid = jnp.minimum(jnp.maximum(pid, 0), num_pages - 1)
                    for copy in page_copies_of(pools, bufs, sems, kh=kh, page_id=pid,
                                               buf_slot=buf_slot, j=p, lead=lead):
                        fn(copy)

        @pl.when(first_blk <= last_blk)
        def _():
            for_live_pages(first_blk, 0, lambda c: c.start())

        def kv_block(i, carry):
            buf_slot = lax.rem(i - first_blk, 2)

            @pl.when(i + 1 <= last_blk)
            def _():
                for_live_pages(i + 1, 1 - buf_slot, lambda c: c.start())

            for_live_pages(i, buf_slot, lambda c: c.wait())
            _attend_block(q_ref, bufs, m_ref, l_ref, acc_ref, buf_slot=buf_slot,
                          key0=i * block_keys, row0=row0, lo=lo, hi=hi,
                          pos0=first_pos - lo, kv_len=kv_len, group=group, scale=scale,
                          soft_cap=soft_cap, sliding_window=sliding_window, pack=pack)
            return carry

        return lax.fori_loop(first_blk, last_blk + 1, kv_block, carry)

    lax.fori_loop(seq_lo_ref[j], seq_hi_ref[j], sequence, 0)
    _write_out(o_ref, l_ref, acc_ref)


def _attend_block(q_ref, bufs, m_ref, l_ref, acc_ref, *, buf_slot, key0, row0, lo, hi,
                  pos0, kv_len, group, scale, soft_cap, sliding_window, pack) -> None:
    """One K/V block (keys key0..) for the rows [lo, hi) of the row block at row0; row r's query
    is at position pos0 + r. Other rows' scores are -inf, which leaves their m, l, acc as is.
    Lane-packed pages: the keys of each lane group in turn (`load_block`)."""
    kv_lo = 0 if sliding_window is None else pos0 + lo - sliding_window + 1  # row lo's window
    k, v, k_scale, v_scale = load_block(bufs, buf_slot, q_ref.dtype, key0=key0, kv_len=kv_len,
                                        kv_lo=kv_lo, pack=pack)
    for j in range(pack):
        s = _scores(q_ref[j], k, scale=scale, soft_cap=soft_cap, key_scales=k_scale)
        row = row0 + lax.div(lax.broadcasted_iota(jnp.int32, s.shape, 0), group)
        kv_pos = key0 + pack * lax.broadcasted_iota(jnp.int32, s.shape, 1) + j
        q_pos = pos0 + row
        visible = (row >= lo) & (row < hi) & (kv_pos <= q_pos)  # q_pos < kv_len: keys live
        if sliding_window is not None:
            visible &= kv_pos > q_pos - sliding_window
        _online_softmax_step(jnp.where(visible, s, -jnp.inf), v, m_ref, l_ref, acc_ref,
                             value_scales=v_scale, lane_group=(j, pack))


def ragged_paged_attention_tpu(
    q: jax.Array,  # [N, K, G, H] flat query rows
    k_pages: jax.Array,  # [K, num_pages, page_size, H] or lane-packed (paged_attention's
    v_pages: jax.Array,  # [K, num_pages, page_size, H]     reference.py)
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    q_starts: jax.Array,  # i32[S]
    q_lens: jax.Array,  # i32[S]
    *,
    k_scales: jax.Array | None = None,  # f32[K, groups, 8, W] with int8 pages
    v_scales: jax.Array | None = None,
    block_tokens: int | None = None,
    pages_per_block: int = 16,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,  # i32[]: pools (and scales) stacked [L, ...], row `layer` read
    sinks: jax.Array | None = None,  # f32[K, G] each query head's sink logit
    interpret=False,
) -> jax.Array:
    """Returns [N, K, G, H] in q.dtype. `block_tokens`: query tokens per row block (default
    `default_block_tokens`); `pages_per_block`: pages per K/V DMA block (clipped to P).
    `interpret`: False, True or `pltpu.InterpretParams`."""
    n, num_k, group, head_dim = q.shape
    views = [layer_view(x, layer) for x in (k_pages, v_pages, k_scales, v_scales)]
    validate_inputs(q, unpack_pages(views[0], head_dim), unpack_pages(views[1], head_dim),
                    kv_lens, page_table, q_starts, q_lens, k_scales=views[2],
                    v_scales=views[3], soft_cap=soft_cap, sliding_window=sliding_window,
                    sinks=sinks)
    pages_per_block = min(pages_per_block, page_table.shape[1])
    if block_tokens is None:
        block_tokens = default_block_tokens(n, group, q.dtype)
    validate_tpu_ragged_blocks(block_tokens, group, q.dtype)
    num_pages, page_size, pack = page_geometry(views[0], head_dim, pages_per_block, views[2])
    pages_per_seq = -(-page_table.shape[1] // pages_per_block) * pages_per_block
    page_table = jnp.pad(page_table, ((0, 0), (0, pages_per_seq - page_table.shape[1])))
    num_blocks = -(-n // block_tokens)
    seq_lo, seq_hi = block_sequences(q_starts, q_lens, num_blocks, block_tokens)
    rows = block_tokens * group
    q2 = jnp.pad(q, ((0, num_blocks * block_tokens - n), (0, 0), (0, 0), (0, 0)))
    q2 = lane_groups(q2.transpose(1, 0, 2, 3).reshape(num_k, num_blocks * rows, head_dim), pack)
    lanes = q2.shape[-1]

    kernel = functools.partial(
        _kernel, group=group, block_tokens=block_tokens, page_size=page_size,
        pages_per_block=pages_per_block, pages_per_seq=pages_per_seq, num_pages=num_pages,
        scale=float(head_dim) ** -0.5, soft_cap=soft_cap, sliding_window=sliding_window,
        pack=pack, stacked=layer is not None, sinks=sinks is not None)
    pools = [k_pages, v_pages] + ([k_scales, v_scales] if k_scales is not None else [])
    q_spec = pl.BlockSpec((None, pack, rows, lanes), lambda k, j, *_: (k, 0, j, 0))
    o_spec = pl.BlockSpec((None, rows, lanes), lambda k, j, *_: (k, j, 0))
    sink_in, sink_specs = [], []
    if sinks is not None:  # [K, rows, 1]: row r takes head (k, r % G)'s sink
        sink_in = [sink_rows(sinks, block_tokens)[..., None]]
        sink_specs = [pl.BlockSpec((None, rows, 1), lambda k, j, *_: (k, 0, 0))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(num_k, num_blocks),
        in_specs=[q_spec] + sink_specs + [pl.BlockSpec(memory_space=pl.ANY)] * len(pools),
        out_specs=o_spec,
        scratch_shapes=flash_scratch(pages_per_block=pages_per_block, rows=rows,
                                     pools=[v for v in views if v is not None]),
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_k, num_blocks * rows, lanes),
                                       out_dtype(q.dtype, pack)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(kv_lens, page_table.reshape(-1), q_starts, q_lens, seq_lo, seq_hi, layer_row(layer), q2,
      *sink_in, *pools)
    out = add_lane_groups(out, pack).astype(q.dtype)
    out = out.reshape(num_k, num_blocks * block_tokens, group, head_dim).transpose(1, 0, 2, 3)
    return out[:n]
