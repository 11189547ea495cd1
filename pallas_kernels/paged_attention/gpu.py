"""Paged decode attention for NVIDIA GPUs: a Pallas kernel on the Triton backend (split-K).

Same signature and semantics as `reference.paged_decode_attention_reference` (layout
`k_pages, v_pages: [K, num_pages, page_size, H]`, `q: [B, T, K, G, H]`, `lengths` include the T
new tokens, causal among them), plus tiling knobs.

Flash decoding: grid (batch b, kv head k, split s). One program owns every query row of kv head k
(the T*G rows `t * G + g`, padded up to a power of 2 >= 16 for Triton's dot) and the pages
`[s * pages_per_split, (s + 1) * pages_per_split)` of sequence b, clipped to the pages that hold
tokens (and, with a sliding window, to the pages the window can reach). It walks them one page at
a time with `lax.fori_loop` (pages past `lengths[b]` are neither loaded nor computed), keeps an
online softmax in f32 and writes partial (out, m, l). A jnp step merges the splits (log-sum-exp),
and attention sinks with them: each head's sink one more split of output 0, max the sink, sum 1.

int8 pages (with f32 scales per token and kv head, `reference.py`) are dequantized as each page
is loaded (`load_page`): the int8 tile times its scale column, in registers, in the query's dtype
for the tensor cores; the pool is read as int8.

In jax 0.10 `pallas_call` defaults to Mosaic GPU on CUDA; this kernel passes
`pltriton.CompilerParams` so it lowers to Triton (`__gpu$xla.gpu.triton`). Triton wants every
in-kernel array to have power-of-2 dims, so head dim and page size must be powers of 2 (>= 16:
Triton's `dot` needs each dim >= 16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.paged_attention.reference import (
    SCALE_GROUP,
    layer_row,
    layer_view,
    query_base,
    sink_rows,
    tree_rows,
    tree_visible,
    unpack_pages,
    validate_inputs,
    validate_sinks,
    validate_tree,
)

_MIN_DOT_DIM = 16  # Triton's tl.dot needs every dim >= 16
# One page of K (or V) per loop step, software-pipelined: measured with the deviceless sm_90a
# compile (scripts/gpu_compile_check.py), page_size * H * itemsize up to 64 KiB fits the H100/H200's
# 227 KiB of shared memory (f32 page 128 / bf16 page 256 at H = 128) and 128 KiB does not.
MAX_PAGE_BYTES = 64 * 1024


def warps_for(m_rows: int) -> int:
    """Warps of a program over `m_rows` query rows: its f32 [M, H] accumulator and [M, H]
    queries live in registers, so wide programs (a draft tree's T*G rows) get more threads.
    Measured with the deviceless sm_90a compile (scripts/gpu_compile_check.py, H = 128,
    bf16): 256 rows at 4 warps spill ~3 KB (255 registers), at 8 warps none (220)."""
    return min(16, max(4, m_rows // 32))


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def validate_gpu_inputs(q, k_pages, v_pages, lengths, page_table, *, pages_per_split: int,
                        num_splits: int | None, k_scales=None, v_scales=None) -> None:
    """The reference's checks plus the Triton shape rules, each naming the constraint."""
    validate_inputs(q, k_pages, v_pages, lengths, page_table, k_scales, v_scales)
    head_dim, page_size = q.shape[-1], k_pages.shape[2]
    if not _is_pow2(head_dim) or head_dim < _MIN_DOT_DIM:
        raise ValueError(f"Triton paged attention needs the head dim H to be a power of 2 and >= "
                         f"{_MIN_DOT_DIM} (Triton blocks must be powers of 2); got H={head_dim}")
    if not _is_pow2(page_size) or page_size < _MIN_DOT_DIM:
        raise ValueError(f"Triton paged attention needs page_size to be a power of 2 and >= "
                         f"{_MIN_DOT_DIM} (Triton blocks must be powers of 2); got "
                         f"page_size={page_size}")
    page_bytes = page_size * head_dim * k_pages.dtype.itemsize
    if page_bytes > MAX_PAGE_BYTES:
        raise ValueError(
            f"page_size={page_size} x H={head_dim} x {k_pages.dtype.itemsize}-byte "
            f"{k_pages.dtype} = {page_bytes} bytes per page exceeds the GPU kernel's "
            f"{MAX_PAGE_BYTES} (its pipelined page blocks would overflow shared memory); use "
            f"page_size <= {MAX_PAGE_BYTES // (head_dim * k_pages.dtype.itemsize)}")
    if pages_per_split < 1:
        raise ValueError(f"pages_per_split must be >= 1, got {pages_per_split}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")


def load_page(pools, page_id, dtype, lead=()):
    """K and V [page_size, H] of one page of this program's kv head, in `dtype`: pools are
    (k_ref, v_ref) [num_pages, page_size, H], or with int8 pages (k_ref, v_ref, k_scales_ref,
    v_scales_ref), the scales [groups, 8, W] (`reference.py`), and the tiles are dequantized
    here. `lead`: (the layer's row,) where the refs are stacked pools [L, num_pages, ...]."""
    k = pltriton.load(pools[0].at[(*lead, page_id)])
    v = pltriton.load(pools[1].at[(*lead, page_id)])
    if len(pools) == 4:
        # the page's scales, [1, page_size] (`reference.py`)
        row = (*lead, lax.div(page_id, SCALE_GROUP), pl.ds(lax.rem(page_id, SCALE_GROUP), 1),
               pl.ds(0, k.shape[0]))
        k = k.astype(jnp.float32) * pltriton.load(pools[2].at[row]).reshape(-1, 1)
        v = v.astype(jnp.float32) * pltriton.load(pools[3].at[row]).reshape(-1, 1)
    return k.astype(dtype), v.astype(dtype)


def _kernel(
    # inputs
    lengths_ref,  # i32[1]
    page_table_ref,  # i32[P_padded] the page ids of sequence b
    layer_ref,  # i32[1] the layer's row of stacked pools (unused unstacked)
    base_ref,  # i32[1] the first query's position (tree queries: the tree's slot 0)
    q_ref,  # [M, H] query rows t * G + g (zero padded to M)
    *refs,  # with tree queries first tree_ref i32[W_pad, M] (each query row's depth, then its
    #   mask words, `reference.tree_rows`); then
    #   k_ref, v_ref [num_pages, page_size, H] of kv head k, stacked: [L, num_pages, ...]
    #   (+ their f32 scales [groups, 8, W] with int8 pages), then the outputs:
    #   o_ref f32[M, H] unnormalised partial output of this split,
    #   m_ref f32[M] running max of this split (-inf when it saw nothing),
    #   l_ref f32[M] softmax denominator of this split
    num_t: int,
    group: int,
    pages_per_split: int,
    soft_cap: float | None,
    sliding_window: int | None,
    stacked: bool,
    words: int,
):
    tree_ref, refs = (refs[0], refs[1:]) if words else (None, refs)
    *pools, o_ref, m_ref, l_ref = refs
    split = pl.program_id(2)
    m_rows, head_dim = q_ref.shape
    page_size = pools[0].shape[-2]
    lead = (layer_ref[0],) if stacked else ()
    length = lengths_ref[0]
    scale = 1.0 / float(head_dim) ** 0.5

    row = lax.broadcasted_iota(jnp.int32, (m_rows, page_size), 0)
    col = lax.broadcasted_iota(jnp.int32, (m_rows, page_size), 1)
    slot = lax.broadcasted_iota(jnp.int32, (page_size, head_dim), 0)
    base = base_ref[0]
    if words:  # padded rows: depth 0, masks 0: they see the context only (unused)
        cols = [pltriton.load(tree_ref.at[pl.ds(w, 1), :]).reshape(-1, 1)
                for w in range(1 + words)]  # [M, 1] each
        q_pos, tree_words = base + cols[0], cols[1:]
    else:
        q_pos = base + lax.div(row, jnp.int32(group))  # padded rows: >= length, unused

    first_page = split * pages_per_split
    last_page = jnp.minimum(first_page + pages_per_split, pl.cdiv(length, page_size))
    if sliding_window is not None:  # the earliest query (t=0) sees keys > base - window
        lowest_key = jnp.maximum(base - sliding_window + 1, 0)
        first_page = jnp.maximum(first_page, lax.div(lowest_key, jnp.int32(page_size)))

    q = pltriton.load(q_ref)

    def body(page, carry):
        o, m, l = carry
        k, v = load_page(pools, page_table_ref[page], q.dtype, lead)  # [page_size, H]
        s = pltriton.dot(q, k, trans_b=True).astype(jnp.float32) * scale  # [M, page_size]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = page * page_size + col
        if words:
            visible = tree_visible(kv_pos, length, base, q_pos, tree_words, sliding_window)
        else:
            visible = (kv_pos <= q_pos) & (kv_pos < length)
            if sliding_window is not None:
                visible &= kv_pos > q_pos - sliding_window
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet
        p = jnp.exp(s - m_safe[:, None])  # 0 where masked
        alpha = jnp.exp(m - m_safe)
        live = page * page_size + slot < length  # [page_size, H]: slots holding tokens
        v = jnp.where(live, v, jnp.zeros_like(v))  # stale slots may hold NaN; 0 * NaN = NaN
        pv = pltriton.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return o * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((m_rows, head_dim), jnp.float32),
            jnp.full((m_rows,), -jnp.inf, jnp.float32),
            jnp.zeros((m_rows,), jnp.float32))
    o, m, l = lax.fori_loop(first_page, last_page, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("pages_per_split", "num_splits", "soft_cap",
                                             "sliding_window", "interpret", "num_warps",
                                             "num_stages"))
def _paged_decode_pallas(q, k_pages, v_pages, lengths, page_table, k_scales=None,
                         v_scales=None, layer=None, tree_mask=None, tree_base=None, sinks=None, *,
                         pages_per_split: int,
                         num_splits: int | None,
                         soft_cap, sliding_window, interpret: bool, num_warps: int | None = None,
                         num_stages: int = 2):
    """The kernel plus combine, without validation (tests use it to reach Triton's own check)."""
    batch, num_t, num_k, group, head_dim = q.shape
    num_pages_per_seq = page_table.shape[1]
    if num_splits is None:
        num_splits = max(pl.cdiv(num_pages_per_seq, pages_per_split), 1)
    else:
        pages_per_split = max(pl.cdiv(num_pages_per_seq, num_splits), 1)
    padded_pages = num_splits * pages_per_split
    page_table = jnp.pad(page_table, ((0, 0), (0, padded_pages - num_pages_per_seq)))

    rows = num_t * group
    m_rows = max(pl.next_power_of_2(rows), _MIN_DOT_DIM)
    q_rows = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(batch, num_k, rows, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, m_rows - rows), (0, 0)))
    pools = [k_pages, v_pages] + ([k_scales, v_scales] if k_scales is not None else [])

    tree_in, tree_specs, words = [], [], 0
    if tree_mask is not None:  # [B, W_pad, M]: depth then words per query row, padded
        words = tree_mask.shape[-1]
        cols = tree_rows(tree_mask, group)
        w_pad = pl.next_power_of_2(cols.shape[1])
        tree_in = [jnp.pad(cols, ((0, 0), (0, w_pad - cols.shape[1]), (0, m_rows - rows)))]
        tree_specs = [pl.BlockSpec((None, w_pad, m_rows), lambda b, k, s: (b, 0, 0))]
    kernel = functools.partial(_kernel, num_t=num_t, group=group, pages_per_split=pages_per_split,
                               soft_cap=soft_cap, sliding_window=sliding_window,
                               stacked=layer is not None, words=words)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(batch, num_k, num_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, k, s: (b,)),  # lengths
            pl.BlockSpec((None, padded_pages), lambda b, k, s: (b, 0)),  # page_table
            pl.BlockSpec((1,), lambda b, k, s: (0,)),  # the layer's row
            pl.BlockSpec((1,), lambda b, k, s: (b,)),  # the first query's position
            pl.BlockSpec((None, None, m_rows, head_dim), lambda b, k, s: (b, k, 0, 0)),  # q
            *tree_specs,
            *[head_block(p, layer is not None) for p in pools],  # K, V (+ scales), kv head k
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, m_rows, head_dim), lambda b, k, s: (b, k, s, 0, 0)),
            pl.BlockSpec((None, None, None, m_rows), lambda b, k, s: (b, k, s, 0)),
            pl.BlockSpec((None, None, None, m_rows), lambda b, k, s: (b, k, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, num_k, num_splits, m_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_k, num_splits, m_rows), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_k, num_splits, m_rows), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps or warps_for(m_rows),
                                                num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention_triton",
    )(lengths, page_table, layer_row(layer), query_base(lengths, num_t, tree_base), q_rows,
      *tree_in, *pools)

    # combine the splits: rescale each by exp(m_s - max_s m_s); empty splits have m=-inf, l=0.
    # Attention sinks join as one more split: max its head's sink, sum 1, output 0.
    if sinks is not None:
        sink = jnp.pad(sink_rows(sinks, num_t), ((0, 0), (0, m_rows - rows)))  # [K, M]
        sink = jnp.broadcast_to(sink[None, :, None], (batch, num_k, 1, m_rows))
        m = jnp.concatenate([m, sink], axis=2)
        l = jnp.concatenate([l, jnp.ones_like(sink)], axis=2)
        o = jnp.concatenate([o, jnp.zeros_like(o[:, :, :1])], axis=2)
    m_max = jnp.max(m, axis=2, keepdims=True)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m - m_max)  # [B, K, S, M]
    l_tot = jnp.sum(l * w, axis=2)  # [B, K, M]
    o_tot = jnp.sum(o * w[..., None], axis=2)  # [B, K, M, H]
    out = jnp.where(l_tot[..., None] > 0, o_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None], 0.0)
    out = out[:, :, :rows].reshape(batch, num_k, num_t, group, head_dim)
    return jnp.transpose(out, (0, 2, 1, 3, 4)).astype(q.dtype)


def head_block(pool: jax.Array, stacked: bool) -> pl.BlockSpec:
    """The whole [num_pages, ...] pool (or scales) of a program's kv head (grid axis 1); of a
    stacked pool [L, K, ...], every layer's: [L, num_pages, ...] (the kernel reads its layer's
    row)."""
    lead = pool.shape[:1] if stacked else ()
    rest = pool.shape[len(lead) + 1:]
    return pl.BlockSpec((*lead, None, *rest),
                        lambda *grid: (0,) * len(lead) + (grid[1],) + (0,) * len(rest))



def paged_decode_attention_gpu(
    q: jax.Array,  # [B, T, K, G, H]
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array,  # [K, num_pages, page_size, H]
    lengths: jax.Array,  # i32[B] cache length including the T new tokens
    page_table: jax.Array,  # i32[B, P]
    *,
    k_scales: jax.Array | None = None,  # f32[K, groups, 8, W] with int8 pages
    v_scales: jax.Array | None = None,
    pages_per_split: int = 8,
    num_splits: int | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,  # i32[]: pools (and scales) stacked [L, ...], row `layer` read
    tree_mask: jax.Array | None = None,  # i32[B, T, W] tree queries' ancestor bits
    tree_base: jax.Array | None = None,  # i32[B] position of each row's tree slot 0
    sinks: jax.Array | None = None,  # f32[K, G] each query head's sink logit (reference.py)
    interpret: bool = False,
) -> jax.Array:
    """Returns [B, T, K, G, H] in q.dtype, like the reference.

    `num_splits=None` uses ceil(P / pages_per_split) splits; a given `num_splits` overrides
    `pages_per_split` with ceil(P / num_splits). `interpret=True` runs on CPU.
    """
    k_pages, v_pages = unpack_pages(k_pages, q.shape[-1]), unpack_pages(v_pages, q.shape[-1])
    views = [layer_view(x, layer) for x in (k_pages, v_pages, k_scales, v_scales)]
    validate_gpu_inputs(q, *views[:2], lengths, page_table, pages_per_split=pages_per_split,
                        num_splits=num_splits, k_scales=views[2], v_scales=views[3])
    validate_tree(q, lengths, tree_mask, tree_base)
    validate_sinks(q, sinks)
    return _paged_decode_pallas(q, k_pages, v_pages, lengths, page_table, k_scales, v_scales,
                                layer, tree_mask, tree_base, sinks,
                                pages_per_split=pages_per_split,
                                num_splits=num_splits,
                                soft_cap=soft_cap, sliding_window=sliding_window,
                                interpret=interpret)
