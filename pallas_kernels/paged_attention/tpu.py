"""Pallas TPU (Mosaic) paged decode attention; same semantics as `reference.py`'s oracle.

Grid (b, kv head k, page block i). `lengths` and the flattened `page_table` arrive by scalar
prefetch (SMEM). K/V pages stay in HBM (`pl.ANY`) and are copied page by page with
`make_async_copy` into a double-buffered VMEM scratch [2, pages_per_block, page_size, H]: block
i + 1 is started before block i is computed. Only live pages are fetched (blocks wholly past
lengths[b], or wholly before a sliding window, issue no DMA and no compute). All T*G query rows of
kv head k are one [T*G, H] tile; the online softmax keeps m, l, acc in f32 VMEM scratch and the
output is written at the last grid step. A row with no visible key (lengths[b] == 0) outputs 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention.reference import validate_inputs

_LANES = 128


def _sublanes(dtype) -> int:
    """Rows per (sublane, 128) VMEM tile: 8 for 32-bit, 16 for bf16, 32 for 8-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


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
    # scalar prefetch
    lengths_ref, page_table_ref,
    # inputs
    q_ref, k_hbm, v_hbm,
    # outputs
    o_ref,
    # scratch
    k_buf, v_buf, sems, m_ref, l_ref, acc_ref,
    *, t, g, page_size, pages_per_block, pages_per_seq, num_pages, num_blocks, scale, soft_cap,
    sliding_window,
):
    b, kh, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block = page_size * pages_per_block
    length = lengths_ref[b]
    last_blk = lax.div(length + block - 1, block) - 1  # -1 when length == 0
    if sliding_window is None:
        first_blk = jnp.int32(0)
    else:  # smallest key position any of the T queries can see
        first_blk = lax.div(jnp.maximum(length - t - sliding_window + 1, 0), block)
    slot = lax.rem(i, 2)

    def page_copies(blk, buf_slot, j):
        pid = page_table_ref[b * pages_per_seq + blk * pages_per_block + j]
        pid = jnp.minimum(jnp.maximum(pid, 0), num_pages - 1)
        return (pltpu.make_async_copy(k_hbm.at[kh, pid], k_buf.at[buf_slot, j],
                                      sems.at[0, buf_slot]),
                pltpu.make_async_copy(v_hbm.at[kh, pid], v_buf.at[buf_slot, j],
                                      sems.at[1, buf_slot]))

    def for_live_pages(blk, buf_slot, fn):
        for j in range(pages_per_block):
            @pl.when(blk * block + j * page_size < length)
            def _(j=j):
                for copy in page_copies(blk, buf_slot, j):
                    fn(copy)

    pl.when(i == 0)(lambda: _reset(m_ref, l_ref, acc_ref))

    @pl.when((i >= first_blk) & (i <= last_blk))
    def _compute():
        @pl.when(i == first_blk)
        def _():
            for_live_pages(i, slot, lambda c: c.start())

        @pl.when(i + 1 <= last_blk)
        def _():
            for_live_pages(i + 1, 1 - slot, lambda c: c.start())

        for_live_pages(i, slot, lambda c: c.wait())

        head_dim = q_ref.shape[-1]
        k = k_buf[slot].reshape(block, head_dim)
        v = v_buf[slot].reshape(block, head_dim)
        s = _scores(q_ref[...], k, scale=scale, soft_cap=soft_cap)  # [T*G, block]
        kv_pos = i * block + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        q_pos = length - t + lax.div(lax.broadcasted_iota(jnp.int32, s.shape, 0), g)
        visible = kv_pos <= q_pos  # q_pos < length, so this also hides dead keys
        if sliding_window is not None:
            visible &= kv_pos > q_pos - sliding_window
        live_row = (i * block + lax.broadcasted_iota(jnp.int32, (block, 1), 0)) < length
        v = jnp.where(live_row, v, jnp.zeros_like(v))  # dead pages may hold NaN / stale data
        _online_softmax_step(jnp.where(visible, s, -jnp.inf), v, m_ref, l_ref, acc_ref)

    pl.when(i == num_blocks - 1)(lambda: _write_out(o_ref, l_ref, acc_ref))


def _scores(q: jax.Array, k: jax.Array, *, scale: float, soft_cap: float | None) -> jax.Array:
    """f32[rows, keys] = scale * q k^T (soft-capped). Explicit precision: a global
    `jax_default_matmul_precision="highest"` would otherwise reach Mosaic, which rejects it for
    bf16 operands ("Bad lhs type")."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.DEFAULT,
                        preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def _reset(m_ref, l_ref, acc_ref) -> None:
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _write_out(o_ref, l_ref, acc_ref) -> None:
    """acc / l, and 0 for rows that saw no key (length 0)."""
    l = l_ref[...]
    o_ref[...] = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)


def flash_scratch(*, pages_per_block: int, page_size: int, rows: int, k_pages, v_pages) -> list:
    """VMEM scratch of the flash loop over page blocks: K and V blocks double-buffered, their
    DMA semaphores, and the running max, sum and output of `rows` query rows (f32)."""
    head_dim = k_pages.shape[-1]
    return [
        pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype),
        pltpu.VMEM((2, pages_per_block, page_size, head_dim), v_pages.dtype),
        pltpu.SemaphoreType.DMA((2, 2)),
        pltpu.VMEM((rows, 1), jnp.float32),
        pltpu.VMEM((rows, 1), jnp.float32),
        pltpu.VMEM((rows, head_dim), jnp.float32),
    ]


def _online_softmax_step(s, v, m_ref, l_ref, acc_ref) -> None:
    """One block of the online softmax: scores s f32[rows, keys] (-inf where not visible),
    values v [keys, H]; updates the running max m, sum l and output accumulator acc."""
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v.dtype), v,
                                                  precision=lax.Precision.DEFAULT,
                                                  preferred_element_type=jnp.float32)
    m_ref[...] = m_new


def paged_decode_attention_tpu(
    q: jax.Array,  # [B, T, K, G, H]
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array,  # [K, num_pages, page_size, H]
    lengths: jax.Array,  # i32[B] cache length including the T new tokens
    page_table: jax.Array,  # i32[B, P]
    *,
    pages_per_block: int = 8,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret=False,
) -> jax.Array:
    """Returns [B, T, K, G, H] in q.dtype. `interpret`: False, True or `pltpu.InterpretParams`."""
    validate_inputs(q, k_pages, v_pages, lengths, page_table)
    batch, t, num_k, g, head_dim = q.shape
    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    pages_per_seq = page_table.shape[1]
    pages_per_block = min(pages_per_block, pages_per_seq)
    validate_tpu_blocks(page_size, pages_per_block, head_dim, k_pages.dtype)
    num_blocks = -(-pages_per_seq // pages_per_block)
    padded = num_blocks * pages_per_block
    if padded != pages_per_seq:  # padded entries lie past every length: never fetched
        page_table = jnp.pad(page_table, ((0, 0), (0, padded - pages_per_seq)))
    rows = t * g
    q2 = q.transpose(0, 2, 1, 3, 4).reshape(batch, num_k, rows, head_dim)

    kernel = functools.partial(
        _kernel, t=t, g=g, page_size=page_size, pages_per_block=pages_per_block,
        pages_per_seq=padded, num_pages=num_pages, num_blocks=num_blocks,
        scale=float(head_dim) ** -0.5, soft_cap=soft_cap, sliding_window=sliding_window)
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, k, i, *_: (b, k, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, num_k, num_blocks),
        in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=q_spec,
        scratch_shapes=flash_scratch(pages_per_block=pages_per_block, page_size=page_size,
                                     rows=rows, k_pages=k_pages, v_pages=v_pages),
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q2.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(lengths, page_table.reshape(-1), q2, k_pages, v_pages)
    return out.reshape(batch, num_k, t, g, head_dim).transpose(0, 2, 1, 3, 4)
