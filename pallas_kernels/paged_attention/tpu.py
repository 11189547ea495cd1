"""Pallas TPU (Mosaic) paged decode attention; same semantics as `reference.py`'s oracle.

Grid (b, kv head k, page block i). `lengths`, the flattened `page_table` and the layer's row of
stacked pools (`layer`, the scanned layout; 0 and unused for one layer's pools) arrive by scalar
prefetch (SMEM). K/V pages stay in HBM (`pl.ANY`) and are copied page by page with
`make_async_copy` into a double-buffered VMEM scratch [2, pages_per_block, page_size, H]: block
i + 1 is started before block i is computed. Only live pages are fetched (blocks wholly past
lengths[b], or wholly before a sliding window, issue no DMA and no compute). All T*G query rows of
kv head k are one [T*G, H] tile; the online softmax keeps m, l, acc in f32 VMEM scratch and the
output is written at the last grid step. A row with no visible key (lengths[b] == 0) outputs 0.
Attention sinks (`sinks`, gpt-oss) start each row's softmax from its head's sink logit, as a key
seen before the first block whose value is 0 (`_reset`).

Lane-packed pages (H under 128, `reference.py`; the TPU pool's layout for H = 64): a page is
[page_size * H / 128, 128] in VMEM, row r holding keys pack * r + j in lane group j. The
queries come as `pack` copies, copy j holding q in lane group j and zeros elsewhere
(`lane_groups`), so the block's scores for the keys of group j are one [T*G, rows] matmul
against the packed tile; each group is one online-softmax step, whose values update only its
own lanes of acc (`_online_softmax_step`), and the groups of the f32 output are added outside
the kernel (`add_lane_groups`). Dead keys of a packed row are zeroed in K as well as V: the
other keys' scores go through the same row.

int8 pages (f32 scales per token and kv head, `reference.py`): each page's scale row [1, W] is
copied beside it into a [2, pages_per_block, 1, W] f32 buffer and the first page_size lanes of
the block's rows are laid side by side along lanes (`_scale_row`, one [1, keys] row per block);
the int8 K/V tiles are converted to the query's dtype in VMEM, and the scales, one per key, are
applied to the key columns of the score tile (K) and of the probability tile before the PV
matmul (V): the same product as scaling the tiles' rows, without a lane-to-sublane relayout.
int8 pages need page_size a multiple of 32, int8's sublane tile. The pool is read as int8;
nothing outside VMEM is dequantized.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention.reference import (
    SCALE_GROUP,
    layer_row,
    layer_view,
    packing,
    query_base,
    sink_rows,
    tree_rows,
    tree_visible,
    unpack_pages,
    validate_inputs,
    validate_sinks,
    validate_tree,
)

_LANES = 128


def _sublanes(dtype) -> int:
    """Rows per (sublane, 128) VMEM tile: 8 for 32-bit, 16 for bf16, 32 for 8-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def lane_packing(page_size: int, head_dim: int, dtype) -> int:
    """Tokens per row of the layout the kernels take a float pool of this geometry in as XLA:TPU
    stores it: 128 / H, lane-packed (`reference.py`), when H is under 128 and a packed page is
    whole VMEM tiles; else 1, the plain layout (with H = 64 XLA:TPU then relays the pool out
    before each call)."""
    if head_dim >= _LANES or _LANES % head_dim:
        return 1
    per = _LANES // head_dim
    if page_size % per or page_size // per % _sublanes(dtype):
        return 1
    return per


def validate_tpu_blocks(page_size: int, pages_per_block: int, head_dim: int, dtype) -> None:
    """The (8,128) tiling rules the kernel relies on, with a message naming the rule."""
    sub = _sublanes(dtype)
    if pages_per_block < 1:
        raise ValueError(f"pages_per_block must be >= 1, got {pages_per_block}")
    if page_size % sub:
        raise ValueError(
            f"TPU (8,128) tiling rule: page_size={page_size} must be a multiple of {sub} (the "
            f"sublane tile of {jnp.dtype(dtype).name}) so that a page is whole VMEM tiles and a "
            f"block of pages_per_block={pages_per_block} pages "
            f"({page_size * pages_per_block} rows) "
            f"reshapes to [rows, H] for free")
    if head_dim % _LANES and head_dim != _LANES // 2:
        raise ValueError(
            f"TPU (8,128) tiling rule: head dim H={head_dim} must be a multiple of {_LANES} "
            f"(the lane width) or exactly {_LANES // 2}; pad H (e.g. to "
            f"{-(-head_dim // _LANES) * _LANES})")


def _kernel(
    # scalar prefetch: lengths, the page table, the layer's row, each row's first query
    # position (tree queries: the tree's slot 0)
    lengths_ref, page_table_ref, layer_ref, base_ref,
    # inputs: q_ref; with tree queries tree_ref i32[1 + W, T*G, 1] (each query row's depth,
    # then its mask words); with sinks sink_ref f32[T*G, 1] (each query row's head's sink);
    # then the pools in HBM, K and V (+ their scales with int8 pages);
    # outputs: o_ref; scratch: a VMEM double buffer per pool, sems, m_ref, l_ref, acc_ref
    q_ref, *refs,
    t, g, page_size, pages_per_block, pages_per_seq, num_pages, num_blocks, scale, soft_cap,
    sliding_window, pack, stacked, words, sinks,
):
    tree_ref, refs = (refs[0], refs[1:]) if words else (None, refs)
    sink_ref, refs = (refs[0], refs[1:]) if sinks else (None, refs)
    n = (len(refs) - 5) // 2
    pools, o_ref, bufs = refs[:n], refs[n], refs[n + 1:2 * n + 1]
    sems, m_ref, l_ref, acc_ref = refs[2 * n + 1:]
    b, kh, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block = page_size * pages_per_block
    length = lengths_ref[b]
    base = base_ref[b]
    last_blk = lax.div(length + block - 1, block) - 1  # -1 when length == 0
    if sliding_window is None:
        first_blk = jnp.int32(0)
    else:  # smallest key position any of the T queries can see
        first_blk = lax.div(jnp.maximum(base - sliding_window + 1, 0), block)
    slot = lax.rem(i, 2)
    lead = (layer_ref[0],) if stacked else ()

    def page_copies(blk, buf_slot, j):
        pid = page_table_ref[b * pages_per_seq + blk * pages_per_block + j]
        pid = jnp.minimum(jnp.maximum(pid, 0), num_pages - 1)
        return page_copies_of(pools, bufs, sems, kh=kh, page_id=pid, buf_slot=buf_slot, j=j,
                              lead=lead)

    def for_live_pages(blk, buf_slot, fn):
        for j in range(pages_per_block):
            @pl.when(blk * block + j * page_size < length)
            def _(j=j):
                for copy in page_copies(blk, buf_slot, j):
                    fn(copy)

    pl.when(i == 0)(lambda: _reset(m_ref, l_ref, acc_ref, sink_ref))

    @pl.when((i >= first_blk) & (i <= last_blk))
    def _compute():
        @pl.when(i == first_blk)
        def _():
            for_live_pages(i, slot, lambda c: c.start())

        @pl.when(i + 1 <= last_blk)
        def _():
            for_live_pages(i + 1, 1 - slot, lambda c: c.start())

        for_live_pages(i, slot, lambda c: c.wait())

        kv_lo = 0 if sliding_window is None else base - sliding_window + 1
        k, v, k_scale, v_scale = load_block(bufs, slot, q_ref.dtype, key0=i * block,
                                            kv_len=length, kv_lo=kv_lo, pack=pack)
        for j in range(pack):  # the keys in lane group j of the block's rows
            s = _scores(q_ref[j], k, scale=scale, soft_cap=soft_cap, key_scales=k_scale)
            kv_pos = i * block + pack * lax.broadcasted_iota(jnp.int32, s.shape, 1) + j
            if words:  # tree queries: the context, then the tree slots their masks name
                q_pos = base + tree_ref[0]
                visible = tree_visible(kv_pos, length, base, q_pos,
                                       [tree_ref[1 + w] for w in range(words)], sliding_window)
            else:
                q_pos = base + lax.div(lax.broadcasted_iota(jnp.int32, s.shape, 0), g)
                visible = kv_pos <= q_pos  # q_pos < length, so this also hides dead keys
                if sliding_window is not None:
                    visible &= kv_pos > q_pos - sliding_window
            _online_softmax_step(jnp.where(visible, s, -jnp.inf), v, m_ref, l_ref, acc_ref,
                                 value_scales=v_scale, lane_group=(j, pack))

    pl.when(i == num_blocks - 1)(lambda: _write_out(o_ref, l_ref, acc_ref))


def page_copies_of(pools, bufs, sems, *, kh, page_id, buf_slot, j, lead=()) -> list:
    """The DMAs of one page of kv head `kh` from every pool in HBM (K, V, and with int8 pages
    their scales: the page's [1, W] row, `reference.py`) into slot `j` of buffer `buf_slot` of
    its VMEM double buffer. `lead`: (the layer's row,) of stacked pools [L, K, ...], else ()."""
    group, row = lax.div(page_id, SCALE_GROUP), pl.ds(lax.rem(page_id, SCALE_GROUP), 1)
    return [pltpu.make_async_copy(pool.at[(*lead, kh, page_id)] if p < 2
                                  else pool.at[(*lead, kh, group, row)],
                                  buf.at[buf_slot, j], sems.at[p, buf_slot])
            for p, (pool, buf) in enumerate(zip(pools, bufs))]


def load_block(bufs, slot, dtype, *, key0, kv_len, kv_lo=0, pack=1):
    """(k, v [rows, lanes], k_scale, v_scale f32[1, keys] or None) of the K/V block in buffer
    `slot`, keys key0.. of a sequence of kv_len keys of which no query sees those before kv_lo
    (a sliding window); row r holds key key0 + r, or with lane-packed pages (`pack` keys a row,
    `reference.py`) keys key0 + pack * r + j in lane group j. Float pages: v's dead keys (past
    kv_len: stale, unfetched or NaN; before kv_lo: a page the sequence no longer holds, e.g. a
    hybrid pool's trash page) zeroed. int8 pages: the tiles converted to `dtype`, and the dead
    keys' value scales zeroed instead (int8 values are finite)."""
    block_rows = bufs[0].shape[1] * bufs[0].shape[2]
    lanes = bufs[0].shape[-1]
    k = bufs[0][slot].reshape(block_rows, lanes)
    v = bufs[1][slot].reshape(block_rows, lanes)
    if len(bufs) == 2:
        shape = (block_rows, 1 if pack == 1 else lanes)
        key = key0 + pack * lax.broadcasted_iota(jnp.int32, shape, 0)
        if pack > 1:
            key += lax.broadcasted_iota(jnp.int32, shape, 1) // (lanes // pack)
        live = (key >= kv_lo) & (key < kv_len)
        if pack > 1:  # a packed row's keys share each score's dot: a NaN would reach the others
            k = jnp.where(live, k, jnp.zeros_like(k))
        return k, jnp.where(live, v, jnp.zeros_like(v)), None, None
    block_keys = block_rows
    key = key0 + lax.broadcasted_iota(jnp.int32, (1, block_keys), 1)
    live = (key >= kv_lo) & (key < kv_len)
    page_size = bufs[0].shape[2]
    v_scale = jnp.where(live, _scale_row(bufs[3], slot, page_size), 0.0)
    return k.astype(dtype), v.astype(dtype), _scale_row(bufs[2], slot, page_size), v_scale


def _scale_row(buf, slot, page_size: int) -> jax.Array:
    """f32[1, keys]: the per-key scales of the block in `slot` of buf [2, pages_per_block, 1, W]
    (a page's scale row, `reference.py`), the first page_size lanes of each page side by side
    along lanes (a lane concatenation, which Mosaic lowers for any page_size; a reshape of a
    [pages, page_size] tile does not below 128)."""
    pages = buf.shape[1]
    rows = [buf[slot, j, :, pl.ds(0, page_size)] for j in range(pages)]
    return rows[0] if pages == 1 else jnp.concatenate(rows, axis=1)


def _scores(q: jax.Array, k: jax.Array, *, scale: float, soft_cap: float | None,
            key_scales: jax.Array | None = None) -> jax.Array:
    """f32[rows, keys] = scale * q k^T (times the keys' int8 scales f32[1, keys], if given),
    soft-capped. Explicit precision: a global `jax_default_matmul_precision="highest"` would
    otherwise reach Mosaic, which rejects it for bf16 operands ("Bad lhs type")."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.DEFAULT,
                        preferred_element_type=jnp.float32) * scale
    if key_scales is not None:
        s = s * key_scales
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def _reset(m_ref, l_ref, acc_ref, sink_ref=None) -> None:
    """The online softmax's start: nothing seen; with attention sinks (f32[rows, 1], each query
    row's head's logit) the sink as a key already seen whose value is 0: running max the sink,
    sum exp(sink - sink) = 1, so every later weight's denominator holds exp(sink)."""
    if sink_ref is None:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    else:
        m_ref[...] = sink_ref[...]
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _write_out(o_ref, l_ref, acc_ref) -> None:
    """acc / l, and 0 for rows that saw no key (length 0)."""
    l = l_ref[...]
    o_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def flash_scratch(*, pages_per_block: int, rows: int, pools) -> list:
    """VMEM scratch of the flash loop over page blocks: a double-buffered block of each pool
    (K, V: [2, pages_per_block, page_size, H], and with int8 pages their scale rows [2,
    pages_per_block, 1, W]), their DMA semaphores, and the running max, sum and output of
    `rows` query rows (f32)."""
    head_dim = pools[0].shape[-1]
    return [
        *[pltpu.VMEM((2, pages_per_block, *(p.shape[2:] if i < 2 else (1, p.shape[3]))),
                     p.dtype) for i, p in enumerate(pools)],
        pltpu.SemaphoreType.DMA((len(pools), 2)),
        pltpu.VMEM((rows, 1), jnp.float32),
        pltpu.VMEM((rows, 1), jnp.float32),
        pltpu.VMEM((rows, head_dim), jnp.float32),
    ]


def _online_softmax_step(s, v, m_ref, l_ref, acc_ref, *, value_scales=None,
                         lane_group=(0, 1)) -> None:
    """One block of the online softmax: scores s f32[rows, keys] (-inf where not visible),
    values v [keys, H] (int8 pages: times value_scales f32[1, keys], applied to the
    probabilities); updates the running max m, sum l and output accumulator acc.
    `lane_group` (j, pack), pack > 1: v is lane-packed [keys / pack, 128] and s holds the keys
    of its lane group j; only those lanes of acc take the block's values (each lane group of acc
    sums its own keys; the caller adds the groups)."""
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    pv = p if value_scales is None else p * value_scales
    update = jnp.dot(pv.astype(v.dtype), v, precision=lax.Precision.DEFAULT,
                     preferred_element_type=jnp.float32)
    j, pack = lane_group
    if pack > 1:
        group = lax.broadcasted_iota(jnp.int32, update.shape, 1) // (update.shape[1] // pack)
        update = jnp.where(group == j, update, 0.0)
    acc_ref[...] = alpha * acc_ref[...] + update
    m_ref[...] = m_new


def paged_decode_attention_tpu(
    q: jax.Array,  # [B, T, K, G, H]
    k_pages: jax.Array,  # [K, num_pages, page_size, H] or lane-packed (`reference.py`)
    v_pages: jax.Array,  # [K, num_pages, page_size, H] or lane-packed
    lengths: jax.Array,  # i32[B] cache length including the T new tokens
    page_table: jax.Array,  # i32[B, P]
    *,
    k_scales: jax.Array | None = None,  # f32[K, groups, 8, W] with int8 pages
    v_scales: jax.Array | None = None,
    pages_per_block: int = 8,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,  # i32[]: pools (and scales) stacked [L, ...], row `layer` read
    tree_mask: jax.Array | None = None,  # i32[B, T, W] tree queries' ancestor bits
    tree_base: jax.Array | None = None,  # i32[B] position of each row's tree slot 0
    sinks: jax.Array | None = None,  # f32[K, G] each query head's sink logit (reference.py)
    interpret=False,
) -> jax.Array:
    """Returns [B, T, K, G, H] in q.dtype. `interpret`: False, True or `pltpu.InterpretParams`."""
    batch, t, num_k, g, head_dim = q.shape
    views = [layer_view(x, layer) for x in (k_pages, v_pages, k_scales, v_scales)]
    validate_inputs(q, unpack_pages(views[0], head_dim), unpack_pages(views[1], head_dim),
                    lengths, page_table, views[2], views[3])
    validate_tree(q, lengths, tree_mask, tree_base)
    validate_sinks(q, sinks)
    pages_per_seq = page_table.shape[1]
    pages_per_block = min(pages_per_block, pages_per_seq)
    num_pages, page_size, pack = page_geometry(views[0], head_dim, pages_per_block, views[2])
    num_blocks = -(-pages_per_seq // pages_per_block)
    padded = num_blocks * pages_per_block
    if padded != pages_per_seq:  # padded entries lie past every length: never fetched
        page_table = jnp.pad(page_table, ((0, 0), (0, padded - pages_per_seq)))
    rows = t * g
    q2 = lane_groups(q.transpose(0, 2, 1, 3, 4).reshape(batch, num_k, rows, head_dim), pack)
    lanes = q2.shape[-1]

    kernel = functools.partial(
        _kernel, t=t, g=g, page_size=page_size, pages_per_block=pages_per_block,
        pages_per_seq=padded, num_pages=num_pages, num_blocks=num_blocks,
        scale=float(head_dim) ** -0.5, soft_cap=soft_cap, sliding_window=sliding_window,
        pack=pack, stacked=layer is not None,
        words=0 if tree_mask is None else tree_mask.shape[-1], sinks=sinks is not None)
    pools = [k_pages, v_pages] + ([k_scales, v_scales] if k_scales is not None else [])
    q_spec = pl.BlockSpec((None, None, pack, rows, lanes), lambda b, k, i, *_: (b, k, 0, 0, 0))
    o_spec = pl.BlockSpec((None, None, rows, lanes), lambda b, k, i, *_: (b, k, 0, 0))
    tree_in, tree_specs = [], []
    if tree_mask is not None:  # [B, 1 + W, rows, 1]: a column per word, rows on sublanes
        tree_in = [tree_rows(tree_mask, g)[..., None]]
        tree_specs = [pl.BlockSpec((None, tree_in[0].shape[1], rows, 1),
                                   lambda b, k, i, *_: (b, 0, 0, 0))]
    sink_in, sink_specs = [], []
    if sinks is not None:  # [K, rows, 1]: query row t * G + g takes head (k, g)'s sink
        sink_in = [sink_rows(sinks, t)[..., None]]
        sink_specs = [pl.BlockSpec((None, rows, 1), lambda b, k, i, *_: (k, 0, 0))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(batch, num_k, num_blocks),
        in_specs=([q_spec] + tree_specs + sink_specs
                  + [pl.BlockSpec(memory_space=pl.ANY)] * len(pools)),
        out_specs=o_spec,
        scratch_shapes=flash_scratch(pages_per_block=pages_per_block, rows=rows,
                                     pools=[v for v in views if v is not None]),
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((batch, num_k, rows, lanes), out_dtype(q.dtype, pack)),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(lengths, page_table.reshape(-1), layer_row(layer), query_base(lengths, t, tree_base), q2,
      *tree_in, *sink_in, *pools)
    out = add_lane_groups(out, pack).astype(q.dtype)
    return out.reshape(batch, num_k, t, g, head_dim).transpose(0, 2, 1, 3, 4)



def page_geometry(k_pages, head_dim: int, pages_per_block: int, k_scales) -> tuple:
    """(num_pages, page_size, pack: keys per stored row) of pages [K, num_pages, rows, lanes],
    lane-packed or not (`reference.py`), checked against the tiling rules."""
    pack = packing(k_pages.shape, head_dim)
    if pack > 1 and k_scales is not None:
        raise ValueError(f"lane-packed pages {k_pages.shape} must be float (int8 pages are "
                         f"[K, num_pages, page_size, H={head_dim}])")
    rows, sub = k_pages.shape[2], _sublanes(k_pages.dtype)
    if pack > 1 and rows % sub:
        raise ValueError(
            f"TPU (8,128) tiling rule: lane-packed pages of page_size={rows * pack} (H="
            f"{head_dim}, {pack} tokens to a row) are {rows} rows, which must be a multiple of "
            f"{sub} (the sublane tile of {jnp.dtype(k_pages.dtype).name}); use a page_size "
            f"that is a multiple of {sub * pack}")
    validate_tpu_blocks(rows, pages_per_block, k_pages.shape[-1], k_pages.dtype)
    return k_pages.shape[1], rows * pack, pack


def lane_groups(q: jax.Array, pack: int) -> jax.Array:
    """q [..., rows, H] -> [..., pack, rows, pack * H]: copy j holds q in lane group j (zeros
    elsewhere), so that its product with a lane-packed K tile is the scores of the keys in
    group j (`reference.py`)."""
    head_dim = q.shape[-1]
    pads = [(0, 0)] * (q.ndim - 1)
    return jnp.stack([jnp.pad(q, pads + [(j * head_dim, (pack - 1 - j) * head_dim)])
                      for j in range(pack)], axis=-3)


def out_dtype(dtype, pack: int):
    """The kernel's output dtype: the queries', or f32 while its lane groups are to be added."""
    return dtype if pack == 1 else jnp.float32


def add_lane_groups(out: jax.Array, pack: int) -> jax.Array:
    """out [..., pack * H] (each lane group the output over its own keys) -> [..., H]."""
    if pack == 1:
        return out
    return out.reshape(*out.shape[:-1], pack, out.shape[-1] // pack).sum(-2)
