"""Plain-jnp oracle of ragged paged attention, and the input validator every kernel shares.

One call covers a whole mixed step: S sequences, each with its own number of new query tokens
(1 for decode, R + 1 for verification, up to the chunk size for a prompt chunk), packed as flat
rows. Sequence s owns the rows [q_starts[s], q_starts[s] + q_lens[s]) of `q: [N, K, G, H]`; its
query t sits at position kv_lens[s] - q_lens[s] + t and sees the keys at positions <= its own
(causal among the new tokens, which were written into the pool first), with a sliding window only
those > position - window, and with a soft cap its scores pass through cap * tanh(s / cap).
Pool layout as the decode kernels' (`pallas_kernels.paged_attention.reference`): one layer's
`k_pages, v_pages: [K, num_pages, page_size, H]` (or with `layer`, row `layer` of stacked pools
[L, K, ...]), `page_table: i32[S, P]`. A row that no sequence
owns (padding, an idle slot) outputs 0. Attention sinks (`sinks: f32[K, G]`) as the decode
kernels' take them. Pages past a sequence's length are never read into the
result (tests fill them with NaN).

The kernels additionally need the sequences' rows in ascending, disjoint order
(q_starts[s] + q_lens[s] <= q_starts[s + 1]): they find the sequences of a block of rows by a
binary search (`common.block_sequences`). The engine's steps pack rows that way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.reference import (
    attend_with_sinks,
    check_pages,
    dequantize_pages,
    layer_of,
    layer_view,
    page_scales,
    unpack_pages,
    validate_sinks,
)


def validate_inputs(q, k_pages, v_pages, kv_lens, page_table, q_starts, q_lens, *,
                    k_scales=None, v_scales=None, soft_cap=None, sliding_window=None,
                    sinks=None) -> None:
    """Static checks with messages naming the bad shape or option and what would be valid."""
    if q.ndim != 4:
        raise ValueError(f"q must be [N, K, G, H] (flat rows), got shape {q.shape}")
    validate_sinks(q[:, None], sinks)
    _, num_k, _, head_dim = q.shape
    check_pages(q, k_pages, v_pages, num_k=num_k, head_dim=head_dim, k_scales=k_scales,
                v_scales=v_scales)
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be [S, P], got {page_table.shape}")
    num_seqs = page_table.shape[0]
    for name, a in (("kv_lens", kv_lens), ("q_starts", q_starts), ("q_lens", q_lens)):
        if a.shape != (num_seqs,):
            raise ValueError(f"{name} must be [S={num_seqs}] (one per page_table row); got "
                             f"{a.shape}")
    for name, a in (("kv_lens", kv_lens), ("page_table", page_table), ("q_starts", q_starts),
                    ("q_lens", q_lens)):
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")
    if sliding_window is not None and not sliding_window > 0:
        raise ValueError(f"sliding_window must be > 0 or None, got {sliding_window}")


def ragged_paged_attention_reference(
    q: jax.Array,  # [N, K, G, H] flat query rows
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array,  # [K, num_pages, page_size, H]
    kv_lens: jax.Array,  # i32[S] cache length of each sequence including its new tokens
    page_table: jax.Array,  # i32[S, P]
    q_starts: jax.Array,  # i32[S] first flat row of each sequence
    q_lens: jax.Array,  # i32[S] new query tokens of each sequence
    *,
    k_scales: jax.Array | None = None,  # f32[K, groups, 8, W] with int8 pages
    v_scales: jax.Array | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,  # i32[]: pools (and scales) stacked [L, ...], row `layer` read
    sinks: jax.Array | None = None,  # f32[K, G] each query head's sink logit
) -> jax.Array:
    """Returns [N, K, G, H] in q.dtype; computed in f32, one row at a time in spirit (each row
    gathers its own sequence's pages), written plainly."""
    for x in (k_pages, v_pages, k_scales, v_scales):
        layer_view(x, layer)
    k_pages, v_pages, k_scales, v_scales = (layer_of(x, layer)
                                            for x in (k_pages, v_pages, k_scales, v_scales))
    k_pages, v_pages = unpack_pages(k_pages, q.shape[-1]), unpack_pages(v_pages, q.shape[-1])
    validate_inputs(q, k_pages, v_pages, kv_lens, page_table, q_starts, q_lens,
                    k_scales=k_scales, v_scales=v_scales, soft_cap=soft_cap,
                    sliding_window=sliding_window, sinks=sinks)
    n, num_k, _, head_dim = q.shape
    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    span = page_table.shape[1] * page_size
    row = jnp.arange(n, dtype=jnp.int32)
    owns = (row[None] >= q_starts[:, None]) & (row[None] < (q_starts + q_lens)[:, None])  # [S, N]
    seq = jnp.argmax(owns, axis=0)  # [N]
    owned = owns.any(axis=0)
    q_pos = kv_lens[seq] - q_lens[seq] + row - q_starts[seq]  # [N]
    pages = jnp.clip(page_table[seq], 0, num_pages - 1)  # [N, P]
    k = dequantize_pages(k_pages[:, pages],
                         None if k_scales is None else page_scales(k_scales, pages))
    v = dequantize_pages(v_pages[:, pages],
                         None if v_scales is None else page_scales(v_scales, pages))
    k = k.reshape(num_k, n, span, head_dim)
    v = v.reshape(num_k, n, span, head_dim)
    kv_pos = jnp.arange(span, dtype=jnp.int32)[None]
    live = kv_pos < kv_lens[seq][:, None]  # [N, S]
    visible = owned[:, None] & live & (kv_pos <= q_pos[:, None])
    if sliding_window is not None:  # keys behind the window: pages maybe not held
        visible &= kv_pos > q_pos[:, None] - sliding_window
        live &= kv_pos > q_pos[:, None] - sliding_window
    v = jnp.where(live[None, :, :, None], v, 0.0)
    scores = jnp.einsum("NKGH,KNSH->NKGS", q.astype(jnp.float32), k) / jnp.sqrt(
        jnp.float32(head_dim))
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = visible[:, None, None]  # [N, 1, 1, S]
    probs = attend_with_sinks(scores, mask, None if sinks is None else sinks[None])
    return jnp.einsum("NKGS,KNSH->NKGH", probs, v).astype(q.dtype)
