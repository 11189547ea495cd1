"""Attention over the paged KV cache: the K/V write, the reference attention, the kernel dispatch.

One layer's attention is `write_and_attend`: the step's keys and values are written into the pool
(each flat row at its slot's page for its position), then every query group of the step
descriptor (`jaxinfer.model.batch`) attends over its page-table rows. With the Pallas
implementation a step holding a prompt chunk runs all its groups (decode rows and the chunk) in
one call of the ragged flash kernel (`ragged_attention`); a step without one (decode,
verification) runs the paged decode kernel (`decode_attention`), whose split over the context
keeps a GPU busy at small batches. The reference attention
(`paged_attention_reference`) is the CPU implementation and the oracle for the Pallas kernels: it
gathers only the first `num_pages_read` pages of each row (a static bucket covering the live
tokens), masks every position at or past the row's length (scores *and* values, so NaN in unused
page slots cannot leak), and computes softmax in f32.

Pool layout (`jaxinfer.engine.kv_cache` has the whole story): one layer's pool is
[K, pages, page_size, H]; its last page is the trash page (`trash_page`), which no page table
holds: writes of padding and idle rows go there, so every scatter index stays in bounds. In the
scanned layout (`jaxinfer.model.layers`) a layer's pool is row `layer` (a traced index) of a
stacked pool [L, K, pages, page_size, H]: the write scatters into that row, the reference
gathers its pages straight from the stack (`take_pages`) and the kernels take the stack and the
row, so no step ever slices a copy of a layer's pool out of the stack. A pool
is an array, or for an int8 cache a `kv_quant.QuantizedPages` (int8 values + a scale per token
and kv head, rows stored in a rotated basis): the write rotates and quantizes the new rows, the
queries are rotated alike and the output rotated back, the reference dequantizes the pages it
gathers, and the kernels get the scales beside the int8 pages and dequantize each tile they load.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.model.batch import CHUNK, StepBatch
from jaxinfer.model.kv_quant import (
    PackedPages,
    Pool,
    QuantizedPages,
    quantize_rows,
    rotate,
    split_pool,
    write_packed,
)
from jaxinfer.sharding import data_shards, shards, split_of
from pallas_kernels.paged_attention.reference import (
    SCALE_GROUP,
    dequantize_pages,
    page_scales,
    take_pages,
    tree_depths,
    tree_visible,
    unpack_pages,
)

Q_BLOCK = 256  # queries per attention block in long prefill chunks
Layer = jax.Array | int | None  # a layer's row of a stacked pool (i32[] or static); None: unstacked


def trash_page(pool: Pool) -> int:
    """The trash page of a layer's pool [K, pages, page_size, H] (or of a stacked pool's
    layers), or of one data shard's part of it: its last page."""
    return pool.shape[-3] - 1


def write_kv(k_pages: Pool, v_pages: Pool, k_new: jax.Array, v_new: jax.Array,
             pages: jax.Array, offsets: jax.Array, valid: jax.Array, layer: Layer = None
             ) -> tuple[Pool, Pool]:
    """Writes N rows' keys/values into one layer's pool, in place under donation (an int8
    pool: quantized per row and kv head as they are written).

    Args:
      k_pages, v_pages: [K, pages, page_size, H] one layer's pool (its last page: trash), or
        with `layer`, a stacked pool [L, K, pages, page_size, H] whose row `layer` it is.
      k_new, v_new: [N, K, H] keys (RoPE applied) and values.
      pages: i32[N] the page of each row (an id of this pool); offsets: i32[N] within it.
      valid: bool[N] False for padding and idle rows: those writes go to the trash page.
      layer: i32[] (or a static int) the layer's row of a stacked pool; None: unstacked.
    Returns:
      The updated (k_pages, v_pages).
    """
    trash = trash_page(k_pages)
    page = jnp.where(valid, jnp.clip(pages, 0, trash - 1), trash)
    return (_write_rows(k_pages, k_new, page, offsets, layer),
            _write_rows(v_pages, v_new, page, offsets, layer))


def _write_rows(pool: Pool, new: jax.Array, page: jax.Array, offsets: jax.Array,
                layer: Layer) -> Pool:
    """pool with new [N, K, H] set at (page[n], offsets[n]) for every kv head (of row `layer`
    of a stacked pool). Every index is in bounds (invalid rows hit the trash page), so XLA
    emits a plain in-place scatter; `mode="drop"` would add a select over the whole pool.

    XLA:TPU lays a scatter's operand out with the scatter's window minor where nothing else
    fixes its layout, so a scatter whose window spans several kv heads (kv heads minor) makes it
    relay the whole array out and back: a float layer's own pool, an entry parameter, keeps its
    row-major layout, but a stacked pool is a scan's carry, and an int8 pool's codes and scales
    are relaid out even as a layer's own pool (a copy of the layer's pool per step). A stacked
    pool's rows, and an int8 pool's codes and scales, are therefore written one kv head at a
    time where a device holds several (docs/architecture.md, "The KV pool and page tables";
    checked by the compile check's moves, `jaxinfer.proof.aot`, and `tests/test_aot.py` with
    two kv heads per chip)."""
    new = jnp.moveaxis(new, 1, 0)  # [K, N, H]
    num_k = pool.shape[0 if layer is None else 1]
    per_head = (layer is not None or isinstance(pool, QuantizedPages)) and _local_heads(num_k) > 1
    if isinstance(pool, PackedPages):
        return write_packed(pool, new, page, offsets, layer, per_head=per_head)
    if isinstance(pool, QuantizedPages):
        values, scales = quantize_rows(new)
        at = (page // SCALE_GROUP, page % SCALE_GROUP, offsets)  # its scale row, `page_scales`
        return QuantizedPages(
            values=scatter_heads(pool.values, values, (page, offsets), layer, per_head=per_head),
            scales=scatter_heads(pool.scales, scales, at, layer, per_head=_local_heads(num_k) > 1))
    return scatter_heads(pool, new.astype(pool.dtype), (page, offsets), layer, per_head=per_head)


def scatter_heads(pool: jax.Array, updates: jax.Array, at: tuple[jax.Array, ...],
                  layer: Layer, *, per_head: bool) -> jax.Array:
    """pool [K, *indexed, *rest] (or [L, K, ...] at row `layer`) with updates [K, N, *rest] set
    at the positions `at` (one i32[N] per indexed axis) of every kv head: one scatter, or with
    `per_head` one per kv head (`_write_rows`). Every index must be in bounds."""
    lead = () if layer is None else (jnp.full_like(at[0], layer),)
    if per_head:
        for k in range(updates.shape[0]):
            pool = pool.at[(*lead, k, *at)].set(updates[k], mode="promise_in_bounds")
        return pool
    heads = len(lead)  # the kv heads' axis of the pool
    inserted = tuple(range(heads)) + tuple(range(heads + 1, heads + 1 + len(at)))
    rest = pool.ndim - heads - 1 - len(at)
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(0, *range(2, 2 + rest)), inserted_window_dims=inserted,
        scatter_dims_to_operand_dims=inserted)
    return jax.lax.scatter(pool, jnp.stack([*lead, *at], axis=-1), updates, dims,
                           mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _local_heads(num_k: int) -> int:
    """The kv heads of a pool one device holds on the context mesh (`sharding.RULES`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return num_k // shards(mesh, _heads(mesh, num_k)) if not mesh.empty else num_k


def write_and_attend(q: jax.Array, k: jax.Array, v: jax.Array, k_pages: Pool, v_pages: Pool,
                     batch: StepBatch, *, sliding_window: int | None,
                     sinks: jax.Array | None = None, layer: Layer = None
                     ) -> tuple[jax.Array, Pool, Pool]:
    """One layer's attention for the step `batch`: writes k, v [N, K, H] of every row, then each
    query group attends (q: [N, K, G, H], RoPE applied). Returns (out [N, K, G, H], k_pages,
    v_pages). `sinks`: f32[N] a logit per query head added to every softmax denominator
    (gpt-oss; `paged_attention_reference`), in every implementation. `layer`: the layer's
    row of stacked pools (module doc); None: its own pools.

    On a pool split over the mesh's "data" axis (`jaxinfer.engine.kv_cache`), each data shard
    writes and attends for the rows whose pages it holds (`on_pool_shards`). An int8 pool holds
    its rows rotated (`kv_quant.rotate`): the queries are rotated alike and the output rotated
    back, so the readers (reference and kernels) attend in that basis unchanged."""
    if isinstance(k_pages, QuantizedPages):
        q = rotate(q)
    v_rotated = isinstance(v_pages, QuantizedPages)
    # The sinks travel as [1, K, G] beside q, so they split over kv heads as the queries do.
    sink_heads = () if sinks is None else (sinks.reshape(1, *q.shape[1:3]),)

    def body(first_page, q, k, v, *rest):
        *sink, k_pages, v_pages, batch, layer = rest
        return _write_and_attend(first_page, q, k, v, k_pages, v_pages, batch, layer,
                                 sliding_window=sliding_window, sinks=sink[0][0] if sink else None)

    shards = data_shards()
    if shards > 1:
        if k_pages.shape[-3] % shards:
            raise ValueError(
                f"a KV pool of {k_pages.shape[-3]} pages cannot be split over the mesh's data "
                f"axis ({shards}): allocate it for this mesh (kv_cache.create_cache(..., "
                "mesh=mesh))")
        attn, k_pages, v_pages = on_pool_shards(body, (q, k, v, *sink_heads), (k_pages, v_pages),
                                                batch, layer)
    else:
        attn, k_pages, v_pages = body(None, q, k, v, *sink_heads, k_pages, v_pages, batch, layer)
    return (rotate(attn) if v_rotated else attn), k_pages, v_pages


def _write_and_attend(first_page, q, k, v, k_pages, v_pages, batch: StepBatch, layer: Layer,
                      *, sliding_window, sinks):
    """`write_and_attend` on the whole pool (`first_page` None) or on one data shard's part,
    whose first page has the global id `first_page`."""
    page_size, pages_per_seq = k_pages.shape[-2], batch.page_table.shape[1]
    trash = trash_page(k_pages)
    at = batch.kv_positions
    page_idx = jnp.clip(at // page_size, 0, pages_per_seq - 1)
    pages = batch.page_table[batch.slots, page_idx]  # [N]
    valid = batch.valid
    if first_page is not None:  # rows whose page lies in another shard's part write nothing
        pages = pages - first_page
        valid = valid & (pages >= 0) & (pages < trash)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, pages, at % page_size, valid, layer)
    if batch.attention_impl == "pallas" and any(g.kind == CHUNK for g in batch.groups):
        attn = ragged_attention(q, k_pages, v_pages, batch, first_page,
                                sliding_window=sliding_window, sinks=sinks, layer=layer)
        return attn, k_pages, v_pages
    outs = []
    for group in batch.groups:
        rows, mine = batch.page_table[group.slots], None
        if first_page is not None:
            rows, mine = shard_rows(rows, first_page, trash)
        args = (q[group.rows], k_pages, v_pages, rows, group.positions, group.kv_lens)
        if group.kind == CHUNK:
            out = paged_attention_reference(*args, num_pages_read=batch.num_pages_read,
                                            sliding_window=sliding_window, sinks=sinks,
                                            layer=layer)
        else:
            out = decode_attention(*args, num_pages_read=batch.num_pages_read,
                                   sliding_window=sliding_window, impl=batch.attention_impl,
                                   mine=mine, sinks=sinks, layer=layer, tree=group.tree)
        out = _keep(out, mine)
        outs.append(out.reshape((-1,) + out.shape[2:]))  # [G x T, K, G, H]
    attn = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
    return attn[batch.out_index], k_pages, v_pages


def ragged_attention(q: jax.Array, k_pages: Pool, v_pages: Pool, batch: StepBatch,
                     first_page: jax.Array | None, *, sliding_window: int | None,
                     sinks: jax.Array | None = None, layer: Layer = None) -> jax.Array:
    """Every query group of the step in one call of the ragged flash kernel
    (`pallas_kernels.ragged_attention`): group row g is a sequence whose queries are the flat
    rows rows[g, 0] + t for its real tokens t < kv_lens[g] - positions[g, 0] (the descriptors
    pack each group row's rows consecutively, groups in row order; padding past the real
    tokens is owned by no sequence and outputs 0). Returns [N, K, G, H], row n's own output.
    `first_page`: as `_write_and_attend`'s; the rows whose pages lie in another data shard's
    part get no queries (the other shard computes them; the outputs are summed). `sinks`:
    f32[K, G] or None, as `paged_attention_reference`'s. `layer`: the layer's row of stacked
    pools, passed to the kernel with them."""
    from pallas_kernels.ragged_attention import ragged_paged_attention

    groups = batch.groups
    slots = jnp.concatenate([g.slots for g in groups])
    q_starts = jnp.concatenate([g.rows[:, 0] for g in groups])
    q_lens = jnp.concatenate([jnp.clip(g.kv_lens - g.positions[:, 0], 0, g.rows.shape[1])
                              for g in groups])
    kv_lens = jnp.concatenate([g.kv_lens for g in groups])
    table = batch.page_table[slots][:, :batch.num_pages_read]

    sink_args = () if sinks is None else (sinks,)

    def kernel(q, k_pages, v_pages, kv_lens, table, q_starts, q_lens, *rest):
        *sink, layer = rest  # rest: (sinks,) if any, then the layer's row
        (k, k_scales), (v, v_scales) = split_pool(k_pages), split_pool(v_pages)
        return ragged_paged_attention(q, k, v, kv_lens, table, q_starts, q_lens,
                                      k_scales=k_scales, v_scales=v_scales,
                                      sliding_window=sliding_window, layer=layer,
                                      sinks=sink[0] if sink else None)

    args = (kv_lens, table, q_starts, q_lens)
    if first_page is not None:
        table, mine = shard_rows(table, first_page, trash_page(k_pages))
        return kernel(q, k_pages, v_pages, kv_lens, table, q_starts, jnp.where(mine, q_lens, 0),
                      *sink_args, layer)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(q, k_pages, v_pages, *args, *sink_args, layer)
    # Tensor parallel: each model shard runs the kernel on its own kv heads, or on all of them
    # where the pool is replicated (see `decode_attention`); the sinks split like the queries.
    heads, pool = _kernel_specs(mesh, k_pages, layer, query_heads=1)
    sink_specs = (P(heads[1]),) * len(sink_args)
    return _on_model_shards(kernel, (q, k_pages, v_pages, *args, *sink_args), layer,
                            in_specs=(heads, pool, pool) + (P(),) * 4 + sink_specs,
                            out_specs=heads)


def _keep(x: jax.Array, rows: jax.Array | None) -> jax.Array:
    """x [B, ...] with the rows where `rows` (bool[B]) is False zeroed; x itself for None."""
    if rows is None:
        return x
    return jnp.where(rows.reshape(rows.shape + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))


def paged_attention_reference(q: jax.Array, k_pages: Pool, v_pages: Pool,
                              page_rows: jax.Array, positions: jax.Array, kv_lens: jax.Array,
                              *, num_pages_read: int, sliding_window: int | None = None,
                              sinks: jax.Array | None = None, layer: Layer = None,
                              tree: jax.Array | None = None) -> jax.Array:
    """Causal attention of B rows x T new tokens over their cached pages.

    Args:
      q: [B, T, K, G, H] queries (RoPE applied).
      k_pages, v_pages: [K, num_pages + 1, page_size, H] one layer's pool (new tokens written;
        the last page is the trash page and is never read); an int8 pool's gathered pages are
        dequantized with their scales. Pages behind the sliding window may be any page (a
        hybrid pool's released ones): their keys and values are masked like dead ones.
      page_rows: i32[B, P] page table rows.
      positions: i32[B, T] query positions.
      kv_lens: i32[B] tokens in the cache per row after this step's writes.
      num_pages_read: static; only pages page_rows[:, :num_pages_read] are read.
      sliding_window: if set, a query at p sees keys in (p - window, p].
      sinks: f32[K, G] or None: head (k, g)'s learned logit, added to its softmax denominator
        as a key no value stands for (gpt-oss's attention sinks): weights exp(s_j) /
        (exp(sink) + sum_i exp(s_i)).
      layer: i32[] the layer's row of stacked pools [L, K, ...] (gathered from in place);
        None: the pools are the layer's own.
      tree: i32[B, T, W] tree queries' ancestor bits (`batch.QueryGroup.tree`): each query
        sees the context and its tree slots instead of the keys up to its position.
    Returns:
      [B, T, K, G, H] attention output in q.dtype.
    """
    page_size = k_pages.shape[-2]
    batch = q.shape[0]
    rows = jnp.clip(page_rows[:, :num_pages_read], 0, trash_page(k_pages) - 1)  # [B, Pr]
    span = num_pages_read * page_size
    k = _gather(k_pages, rows, layer)  # f32[K, B, Pr, page_size, H]
    v = _gather(v_pages, rows, layer)
    kv_pos = jnp.arange(span, dtype=jnp.int32)[None, :]
    live = kv_pos < kv_lens[:, None]  # [B, S]
    if sliding_window is not None:  # behind every query's window: pages a hybrid pool released
        live &= kv_pos > jnp.min(positions, axis=1, keepdims=True) - sliding_window
    mask = _visible(live, positions, sliding_window, tree)  # [B, T, S]
    live_pages = live.reshape(1, batch, num_pages_read, page_size, 1)
    v = jnp.where(live_pages, v, 0.0)
    # Chunks of several queries attend in blocks of Q_BLOCK queries over the once-gathered pages,
    # with (K, B) as the dots' batch dims: a [K, G, T, S] f32 score tensor for T = 512, S = 2048
    # is 38 MB per layer and XLA CPU materialises it several times, and any other dim order makes
    # it transpose the gathered K/V per block. Measured, 2048-token prefill in 512-token chunks:
    # 8.3 s -> 4.2 s (blocks of 64: 5.4 s, 512: 5.2 s). Decode (T = 1) keeps `_attend`, whose
    # result for a row is bitwise independent of the page bucket (the batch-invariance test).
    if q.shape[1] == 1:
        return _attend(q, k, v, mask, sinks)
    outs = []
    for begin in range(0, q.shape[1], Q_BLOCK):
        block = slice(begin, begin + Q_BLOCK)
        outs.append(_attend_kmajor(q[:, block], k, v, mask[:, block], sinks))
    return jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]


def _gather(pool: Pool, rows: jax.Array, layer: Layer) -> jax.Array:
    """f32 pages `rows` (i32[B, Pr]) of a pool (row `layer` of a stacked one): [K, B, Pr,
    page_size, H]."""
    values, scales = split_pool(pool)
    pages = unpack_pages(take_pages(values, rows, layer), pool.shape[-1])  # packed: a view
    return dequantize_pages(pages, None if scales is None else page_scales(scales, rows, layer))


def _visible(live: jax.Array, positions: jax.Array, sliding_window: int | None,
             tree: jax.Array | None = None) -> jax.Array:
    """bool[B, T, S]: key s is live (live: bool[B, S]), not after the query's position
    (positions: i32[B, T]) and, with a sliding window, inside it; tree queries (tree: i32[B,
    T, W]): live, and the context (inside the window) or one of the query's tree slots."""
    kv_pos = jnp.arange(live.shape[1], dtype=jnp.int32)[None, None, :]
    if tree is not None:
        base = (positions - tree_depths(tree))[:, :1, None]
        words = [tree[:, :, None, w] for w in range(tree.shape[-1])]
        return live[:, None, :] & tree_visible(kv_pos, live.shape[1], base,
                                               positions[:, :, None], words, sliding_window)
    mask = live[:, None, :] & (kv_pos <= positions[:, :, None])
    if sliding_window is not None:
        mask &= kv_pos > positions[:, :, None] - sliding_window
    return mask


def _masked_softmax(scores: jax.Array, mask: jax.Array, sinks: jax.Array | None = None
                    ) -> jax.Array:
    """f32 softmax of `scores` [..., S] over the keys where `mask` (broadcasting to it) is True,
    0 elsewhere (a row with no visible key, padding, is all 0); with `sinks` (broadcast against
    scores less its last axis) in the denominator when given.

    The denominator is a dot with ones, not a sum: XLA:CPU groups a reduction's terms by the
    axis length, so a row's probabilities would change in their last bits with the span of
    keys read (the page bucket, which depends on the pool, the batch and preemption), and an
    int8 pool turns such noise into different codes a few layers later; the dot adds the
    terms in an order that the masked keys' trailing zeros do not change (tests/
    test_kv_int8.py)."""
    top = jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True)
    if sinks is not None:
        top = jnp.maximum(top, sinks[..., None])
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.where(mask, jnp.exp(scores - top), 0.0)
    total = jnp.einsum("...S,S->...", e, jnp.ones(e.shape[-1], e.dtype))[..., None]
    if sinks is not None:
        total = total + jnp.exp(sinks[..., None] - top)
    return e / jnp.where(total > 0, total, 1.0)


def _attend(q, k, v, mask, sinks=None):
    """Softmax attention of q [B, T, K, G, H] over gathered k, v [K, B, Pr, page_size, H]
    (v already zeroed past each row's length); mask: bool[B, T, S] the keys each query sees;
    sinks: f32[K, G] or None.
    Returns [B, T, K, G, H]."""
    _, _, num_pages_read, page_size, head_dim = k.shape
    span = num_pages_read * page_size
    scores = jnp.einsum("BTKGH,KBPQH->BKGTPQ", q.astype(jnp.float32), k)
    scores = scores.reshape(scores.shape[:4] + (span,)) * (1.0 / math.sqrt(head_dim))
    probs = _masked_softmax(scores, mask[:, None, None],
                            None if sinks is None else sinks[None, :, :, None])
    probs = probs.reshape(probs.shape[:4] + (num_pages_read, page_size))
    out = jnp.einsum("BKGTPQ,KBPQH->BTKGH", probs, v)
    return out.astype(q.dtype)


def _attend_kmajor(q, k, v, mask, sinks=None):
    """`_attend` for chunks of several queries, with (K, B) as the dots' batch dims so the
    gathered k, v are read in place instead of being transposed once per query block."""
    batch, t, num_k, g, head_dim = q.shape
    span = k.shape[2] * k.shape[3]
    k = k.reshape(num_k, batch, span, head_dim)
    v = v.reshape(num_k, batch, span, head_dim)
    qk = jnp.transpose(q, (2, 0, 1, 3, 4)).reshape(num_k, batch, t * g, head_dim)
    qk = qk.astype(jnp.float32) * (1.0 / math.sqrt(head_dim))
    scores = jnp.einsum("KBXH,KBSH->KBXS", qk, k).reshape(num_k, batch, t, g, span)
    probs = _masked_softmax(scores, mask[None, :, :, None, :],
                            None if sinks is None else sinks[:, None, None, :])
    out = jnp.einsum("KBXS,KBSH->KBXH", probs.reshape(num_k, batch, t * g, span), v)
    out = jnp.transpose(out.reshape(num_k, batch, t, g, head_dim), (1, 2, 0, 3, 4))
    return out.astype(q.dtype)


def resolve_impl(impl: str) -> str:
    """`auto` -> "pallas" on TPU/GPU, "xla" on CPU; "xla" / "pallas" as given (each serves
    every model, attention sinks included)."""
    if impl == "auto":
        return "xla" if jax.default_backend() == "cpu" else "pallas"
    return impl


def decode_attention(q, k_pages, v_pages, page_rows, positions, kv_lens, *, num_pages_read: int,
                     sliding_window: int | None, impl: str, mine: jax.Array | None = None,
                     sinks: jax.Array | None = None, layer: Layer = None,
                     tree: jax.Array | None = None) -> jax.Array:
    """Attention of a decode step (T = 1) or a speculative verification (T = R + 1 consecutive
    queries per row, causal among themselves) with the chosen implementation (see
    `paged_attention_reference` for the arguments). The kernel reads `page_rows[:, :Pr]` and
    places query t at L - T + t with L = positions[:, -1] + 1, which is the reference's position
    for every query; keys at or past a row's `kv_lens` that a query may see under L belong to
    rows or queries whose outputs the caller discards (idle rows, padding past a row's drafts).
    `mine`: bool[B], given inside `on_pool_shards`: the arrays are one data shard's, and only
    these rows are its own; the kernel runs on the arrays as they are and skips the other rows
    (length 0: no page read; the caller zeroes their outputs). `layer`: the layer's row of
    stacked pools, passed to the kernel with them. `tree`: i32[B, T, W] tree queries
    (`batch.QueryGroup.tree`): the kernel takes their masks and the tree's slot 0, and the
    rows' kv_lens as they are."""
    if impl == "xla":
        return paged_attention_reference(q, k_pages, v_pages, page_rows, positions, kv_lens,
                                         num_pages_read=num_pages_read,
                                         sliding_window=sliding_window, sinks=sinks,
                                         layer=layer, tree=tree)
    from pallas_kernels.paged_attention import paged_decode_attention

    extras = {}  # the kernel's optional arrays, by its keyword
    if tree is not None:
        extras.update(tree_mask=tree, tree_base=positions[:, 0] - tree_depths(tree)[:, 0])
    if sinks is not None:
        extras["sinks"] = sinks
    names = tuple(extras)

    def kernel(q, k_pages, v_pages, kv_lens, table, *rest):  # rest: the extras, layer
        *values, layer = rest
        (k, k_scales), (v, v_scales) = split_pool(k_pages), split_pool(v_pages)
        return paged_decode_attention(q, k, v, kv_lens, table, k_scales=k_scales,
                                      v_scales=v_scales, sliding_window=sliding_window,
                                      layer=layer, **dict(zip(names, values)))

    table = page_rows[:, :num_pages_read]
    if tree is None:
        kv_lens = positions[:, -1] + 1
    if mine is not None:
        return kernel(q, k_pages, v_pages, jnp.where(mine, kv_lens, 0), table,
                      *extras.values(), layer)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return kernel(q, k_pages, v_pages, kv_lens, table, *extras.values(), layer)
    # Tensor parallel: each model shard runs the kernel on its own kv heads (and their G query
    # heads), the pages it holds; where the model axis does not divide the kv heads the pool is
    # replicated (`sharding.spec_for`) and every shard runs it on all of them: a Mosaic kernel
    # is never left to XLA's partitioner, which refuses it. (check_vma=False: pallas_call has
    # no varying-axis rule.)
    heads, pool = _kernel_specs(mesh, k_pages, layer, query_heads=2)
    extra_specs = tuple(P(heads[2]) if name == "sinks" else P() for name in names)
    return _on_model_shards(kernel, (q, k_pages, v_pages, kv_lens, table, *extras.values()),
                            layer, in_specs=(heads, pool, pool, P(), P()) + extra_specs,
                            out_specs=heads)


def _kernel_specs(mesh, k_pages: Pool, layer: Layer, *, query_heads: int) -> tuple[P, P]:
    """(the queries' spec, the pools' spec) of a kernel run per tensor-parallel shard: kv heads
    split over the axes that split the pool's (the queries' kv-head axis is `query_heads`; a
    stacked pool's is 1), or everything whole on every shard."""
    split = _heads(mesh, k_pages.shape[-4])
    return P(*([None] * query_heads), split), P(*([None] * (layer is not None)), split)


def _on_model_shards(kernel, args: tuple, layer: Layer, *, in_specs: tuple, out_specs: P):
    """kernel(*args, layer) on every tensor-parallel shard (`jax.shard_map`); the layer's row,
    a scalar, replicated."""
    return jax.shard_map(kernel, in_specs=in_specs + (P(),), out_specs=out_specs,
                         check_vma=False)(*args, layer)


def _heads(mesh, num_kv_heads: int):
    """The mesh axes the pool's kv heads are split over (`sharding.RULES`: the tensor-parallel
    axes, where they divide), as a PartitionSpec entry; None: whole on every chip."""
    return split_of("kv_heads", num_kv_heads, mesh)


def pool_partition(num_kv_heads: int, *, stacked: bool = False) -> P:
    """The PartitionSpec of a layer's pool [K, pages, page_size, H] (`stacked`: of a stacked
    pool [L, K, ...]) on the context mesh, split over "data" (`on_pool_shards`): pages over
    "data", kv heads over the tensor-parallel axes where they divide, the layers whole."""
    spec = (_heads(jax.sharding.get_abstract_mesh(), num_kv_heads), "data")
    return P(*((None,) if stacked else ()), *spec)


def on_pool_shards(body, heads: tuple, pools: tuple, batch: StepBatch, layer: Layer = None):
    """Runs `body` on each shard of a pool split over "data" (and over the tensor-parallel axes
    by kv heads where they divide): the data-parallel KV cache. Each data shard holds the pages
    of its own slots (`jaxinfer.engine.kv_cache`), so it writes and attends only for rows whose
    pages it holds.

    body(first_page, *heads, *pools, batch, layer) -> (out, *pools): `first_page` is the global
    id of the shard's first page; `heads` (and `out`) are [N, K, ...] (kv heads at axis 1);
    `pools` are [K, pages, page_size, H] (arrays or `QuantizedPages`), or stacked [L, K, ...]
    with `layer` their row; `batch` (and `layer`) are whole on every shard.
    Every data shard sees every row; `body` zeroes the rows it does not hold (`shard_rows`), and
    the outputs are summed over "data", so each row comes from exactly the one shard that holds
    its pages, bit for bit what the whole pool gives. (check_vma=False: pallas_call has no
    varying-axis rule.)
    """
    pool_spec = pool_partition(pools[0].shape[-4], stacked=layer is not None)
    head_spec = P(None, pool_spec[-2])  # kv heads split as the pool's
    local_pages = pools[0].shape[-3] // data_shards()

    def shard(*args):
        out, *new_pools = body(jax.lax.axis_index("data") * local_pages, *args)
        return (jax.lax.psum(out, "data"), *new_pools)

    return jax.shard_map(
        shard, in_specs=(head_spec,) * len(heads) + (pool_spec,) * len(pools) + (P(), P()),
        out_specs=(head_spec,) + (pool_spec,) * len(pools), check_vma=False,
    )(*heads, *pools, batch, layer)


def shard_rows(page_rows: jax.Array, first_page: jax.Array, num_pages: int
               ) -> tuple[jax.Array, jax.Array]:
    """For one data shard whose part of the pool holds global pages [first_page, first_page +
    num_pages) before its trash page: (page_rows i32[B, P] as local ids clipped into the
    part, bool[B] the rows whose pages it holds). A row's pages all lie in one shard (the
    scheduler allocates a slot's pages from its shard), so its first page decides: in a hybrid
    pool's local table that may be the part's trash page (released behind the window)."""
    local = page_rows - first_page
    mine = (local[:, 0] >= 0) & (local[:, 0] <= num_pages)
    return jnp.clip(local, 0, num_pages - 1), mine
