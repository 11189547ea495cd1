"""Ragged paged flash attention for NVIDIA GPUs: a Pallas kernel on the Triton backend.

Same signature and semantics as `reference.ragged_paged_attention_reference`. Grid (row block j,
kv head k): the program owns the [M, H] query tile of block j's `block_tokens` tokens x G query
heads of kv head k (GQA packed, so the tensor cores see M rows; zero-padded to a power of 2, as
Triton wants), walks the sequences meeting the block (`common.block_sequences`), and for each
streams that sequence's pages one at a time with `lax.fori_loop` through an online softmax kept
in f32 registers: only pages with keys some row of the block can see are loaded (causal skipping
and the sliding window bound the range). Nothing is materialised beyond one [M, page_size] score
tile. Each program writes its whole tile once (no two programs share rows), 0 for rows no
sequence owns.

The page read is the decode kernel's `load_page`: int8 pages (with their f32 scales) are
dequantized there, one [page_size, H] tile at a time in registers.

`pltriton.CompilerParams` make `pallas_call` lower to Triton (`__gpu$xla.gpu.triton`; in jax 0.10
the default GPU backend is Mosaic GPU). Head dim and page size must be powers of 2 >= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.paged_attention.gpu import head_block, load_page, validate_gpu_inputs
from pallas_kernels.paged_attention.reference import (
    layer_row,
    layer_view,
    sink_rows,
    unpack_pages,
)
from pallas_kernels.ragged_attention.common import block_rows, block_sequences
from pallas_kernels.ragged_attention.reference import validate_inputs

_MIN_DOT_DIM = 16  # Triton's tl.dot needs every dim >= 16
# The f32 accumulator tile [M, H] lives in registers: 64 KiB is FlashAttention-2's 128 x 128 tile,
# 64 registers per thread over 8 warps; larger tiles spill.
MAX_ACC_BYTES = 64 * 1024
TARGET_BLOCK_ROWS = 128  # tokens x G rows per program, tensor-core M of FlashAttention-2


def _tile_rows(block_tokens: int, group: int) -> int:
    return max(pl.next_power_of_2(block_tokens * group), _MIN_DOT_DIM)


def default_block_tokens(num_rows: int, group: int, head_dim: int) -> int:
    """Tokens per row block: a power of 2 near TARGET_BLOCK_ROWS / G, no more than needed, and
    no more than the f32 accumulator's register budget allows at head dim H (MAX_ACC_BYTES:
    64 rows at H = 256)."""
    rows = min(TARGET_BLOCK_ROWS, max(_MIN_DOT_DIM, MAX_ACC_BYTES // (4 * head_dim)))
    want = max(1, pl.next_power_of_2(rows // group + 1) // 2)
    return min(want, pl.next_power_of_2(num_rows))


def validate_gpu_ragged_inputs(q, k_pages, v_pages, kv_lens, page_table, q_starts, q_lens, *,
                               block_tokens: int, k_scales=None, v_scales=None, soft_cap=None,
                               sliding_window=None, sinks=None) -> None:
    """The reference's checks, the decode kernel's Triton rules for H and the pages, and the
    register budget of the query tile, each naming the limit."""
    validate_inputs(q, k_pages, v_pages, kv_lens, page_table, q_starts, q_lens,
                    k_scales=k_scales, v_scales=v_scales, soft_cap=soft_cap,
                    sliding_window=sliding_window, sinks=sinks)
    head_dim = q.shape[-1]
    as_decode = jax.ShapeDtypeStruct((kv_lens.shape[0], 1) + q.shape[1:], q.dtype)
    validate_gpu_inputs(as_decode, k_pages, v_pages, kv_lens, page_table, pages_per_split=1,
                        num_splits=None, k_scales=k_scales, v_scales=v_scales)
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    tile = _tile_rows(block_tokens, q.shape[2])
    if tile * head_dim * 4 > MAX_ACC_BYTES:
        raise ValueError(
            f"block_tokens={block_tokens} x G={q.shape[2]} query heads = {tile} rows (padded to "
            f"a power of 2) x H={head_dim} f32 = {tile * head_dim * 4} bytes of accumulator "
            f"exceed the {MAX_ACC_BYTES} a Triton program keeps in registers; use block_tokens "
            f"<= {max(1, MAX_ACC_BYTES // (4 * head_dim * q.shape[2]))}")


def _kernel(
    # inputs
    kv_lens_ref, page_table_ref, q_starts_ref, q_lens_ref, seq_lo_ref, seq_hi_ref, layer_ref,
    q_ref,  # [M, H] rows t * G + g of the block (zero padded to M)
    *refs,  # with sinks sink_ref f32[M] (each row's query head's sink); k_ref, v_ref
    #   [num_pages, page_size, H] of kv head k, stacked: [L, num_pages, ...] (+ their f32
    #   scales [groups, 8, W] with int8 pages), then the output o_ref [M, H]
    group, block_tokens, pages_per_seq, soft_cap, sliding_window, stacked, sinks,
):
    sink_ref, refs = (refs[0], refs[1:]) if sinks else (None, refs)
    *pools, o_ref = refs
    j = pl.program_id(0)
    m_rows, head_dim = q_ref.shape
    page_size = pools[0].shape[-2]
    lead = (layer_ref[0],) if stacked else ()  # the layer's row of stacked pools
    row0 = j * block_tokens
    scale = 1.0 / float(head_dim) ** 0.5
    row = row0 + lax.div(lax.broadcasted_iota(jnp.int32, (m_rows, page_size), 0),
                         jnp.int32(group))
    real = lax.broadcasted_iota(jnp.int32, (m_rows, page_size), 0) < block_tokens * group
    col = lax.broadcasted_iota(jnp.int32, (m_rows, page_size), 1)
    slot = lax.broadcasted_iota(jnp.int32, (page_size, head_dim), 0)
    q = pltriton.load(q_ref)

    def sequence(s, carry):
        start, n_q, kv_len = q_starts_ref[s], q_lens_ref[s], kv_lens_ref[s]
        lo, hi, first_pos, last_pos = block_rows(start, n_q, kv_len, row0, block_tokens)
        last_page = jnp.where(hi > lo, lax.div(jnp.maximum(last_pos, 0), page_size) + 1, 0)
        first_page = jnp.int32(0)
        if sliding_window is not None:
            first_page = lax.div(jnp.maximum(first_pos - sliding_window + 1, 0), page_size)
        q_pos = first_pos - lo + row
        mine = real & (row >= lo) & (row < hi)

        def page(p, carry):
            o, m, l = carry
            k, v = load_page(pools, page_table_ref[s * pages_per_seq + p], q.dtype, lead)
            sc = pltriton.dot(q, k, trans_b=True).astype(jnp.float32) * scale  # [M, page]
            if soft_cap is not None:
                sc = soft_cap * jnp.tanh(sc / soft_cap)
            kv_pos = p * page_size + col
            visible = mine & (kv_pos <= q_pos)
            if sliding_window is not None:
                visible &= kv_pos > q_pos - sliding_window
            sc = jnp.where(visible, sc, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(sc, axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            prob = jnp.exp(sc - m_safe[:, None])
            alpha = jnp.exp(m - m_safe)
            v = jnp.where(p * page_size + slot < kv_len, v, jnp.zeros_like(v))  # NaN-safe
            pv = pltriton.dot(prob.astype(v.dtype), v).astype(jnp.float32)
            return o * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(prob, axis=1)

        return lax.fori_loop(first_page, last_page, page, carry)

    # The softmax starts from nothing seen, or with attention sinks from each row's sink as a
    # key already seen whose value is 0 (max the sink, sum 1).
    init = (jnp.zeros((m_rows, head_dim), jnp.float32),
            jnp.full((m_rows,), -jnp.inf, jnp.float32) if sink_ref is None
            else pltriton.load(sink_ref),
            jnp.zeros((m_rows,), jnp.float32) if sink_ref is None
            else jnp.ones((m_rows,), jnp.float32))
    o, _, l = lax.fori_loop(seq_lo_ref[j], seq_hi_ref[j], sequence, init)
    out = jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


def _pad_pow2(x: jax.Array) -> jax.Array:
    """x [n] zero-padded to a power of 2 (Triton blocks must be)."""
    return jnp.pad(x, (0, pl.next_power_of_2(x.shape[0]) - x.shape[0]))


@functools.partial(jax.jit, static_argnames=("block_tokens", "soft_cap", "sliding_window",
                                             "interpret", "num_warps", "num_stages"))
def _ragged_pallas(q, k_pages, v_pages, kv_lens, page_table, q_starts, q_lens, k_scales=None,
                   v_scales=None, layer=None, sinks=None, *, block_tokens: int, soft_cap,
                   sliding_window,
                   interpret: bool, num_warps: int | None = None, num_stages: int = 2):
    """The kernel without validation (tests use it to reach Triton's own checks)."""
    n, num_k, group, head_dim = q.shape
    pages_per_seq = page_table.shape[1]
    num_blocks = -(-n // block_tokens)
    seq_lo, seq_hi = block_sequences(q_starts, q_lens, num_blocks, block_tokens)
    rows, m_rows = block_tokens * group, _tile_rows(block_tokens, group)
    q2 = jnp.pad(q, ((0, num_blocks * block_tokens - n), (0, 0), (0, 0), (0, 0)))
    q2 = q2.reshape(num_blocks, block_tokens, num_k, group, head_dim).transpose(0, 2, 1, 3, 4)
    q2 = q2.reshape(num_blocks, num_k, rows, head_dim)
    q2 = jnp.pad(q2, ((0, 0), (0, 0), (0, m_rows - rows), (0, 0)))
    if num_warps is None:
        num_warps = 8 if m_rows * head_dim >= 128 * 128 else 4
    meta = [_pad_pow2(a) for a in (kv_lens, page_table.reshape(-1), q_starts, q_lens, seq_lo,
                                   seq_hi)] + [layer_row(layer)]
    whole = [pl.BlockSpec(a.shape, lambda j, k: (0,)) for a in meta]
    pools = [k_pages, v_pages] + ([k_scales, v_scales] if k_scales is not None else [])
    pool_specs = [head_block(p, layer is not None) for p in pools]  # the pools of kv head k
    tile = pl.BlockSpec((None, None, m_rows, head_dim), lambda j, k: (j, k, 0, 0))
    kernel = functools.partial(_kernel, group=group, block_tokens=block_tokens,
                               pages_per_seq=pages_per_seq, soft_cap=soft_cap,
                               sliding_window=sliding_window, stacked=layer is not None,
                               sinks=sinks is not None)
    sink_in, sink_specs = [], []
    if sinks is not None:  # [K, M]: row t * G + g takes head (k, g)'s sink (padding rows too)
        sink_in = [jnp.pad(sink_rows(sinks, block_tokens),
                           ((0, 0), (0, m_rows - rows)))]
        sink_specs = [pl.BlockSpec((None, m_rows), lambda j, k: (k, 0))]
    out = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_k),
        in_specs=[*whole, tile, *sink_specs, *pool_specs],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(q2.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_triton",
    )(*meta, q2, *sink_in, *pools)
    out = out[:, :, :rows].reshape(num_blocks, num_k, block_tokens, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(-1, num_k, group, head_dim)[:n]


def ragged_paged_attention_gpu(
    q: jax.Array,  # [N, K, G, H] flat query rows
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array,  # [K, num_pages, page_size, H]
    kv_lens: jax.Array,  # i32[S]
    page_table: jax.Array,  # i32[S, P]
    q_starts: jax.Array,  # i32[S]
    q_lens: jax.Array,  # i32[S]
    *,
    k_scales: jax.Array | None = None,  # f32[K, groups, 8, W] with int8 pages
    v_scales: jax.Array | None = None,
    block_tokens: int | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,  # i32[]: pools (and scales) stacked [L, ...], row `layer` read
    sinks: jax.Array | None = None,  # f32[K, G] each query head's sink logit
    interpret: bool = False,
) -> jax.Array:
    """Returns [N, K, G, H] in q.dtype. `block_tokens`: query tokens per program (default
    `default_block_tokens`). `interpret=True` runs on CPU."""
    if block_tokens is None:
        block_tokens = default_block_tokens(q.shape[0], q.shape[2], q.shape[3])
    k_pages, v_pages = unpack_pages(k_pages, q.shape[-1]), unpack_pages(v_pages, q.shape[-1])
    views = [layer_view(x, layer) for x in (k_pages, v_pages, k_scales, v_scales)]
    validate_gpu_ragged_inputs(q, *views[:2], kv_lens, page_table, q_starts, q_lens,
                               block_tokens=block_tokens, k_scales=views[2], v_scales=views[3],
                               soft_cap=soft_cap, sliding_window=sliding_window,
                               sinks=sinks)
    return _ragged_pallas(q, k_pages, v_pages, kv_lens, page_table, q_starts, q_lens,
                          k_scales, v_scales, layer, sinks,
                          block_tokens=block_tokens, soft_cap=soft_cap,
                          sliding_window=sliding_window, interpret=interpret)
