"""Plain-jnp oracle of paged decode attention, and the input validator every kernel shares.

Layout (DESIGN.md decision 3): one layer's pool `k_pages, v_pages: [K, num_pages, page_size, H]`;
`page_table: i32[B, P]` page ids of each sequence in order; `lengths: i32[B]` tokens in the cache
per sequence *including* the T new tokens whose queries are given (they were written first).
Query t of sequence b sits at position lengths[b] - T + t and sees keys at positions
<= its own (causal among the T new tokens: T = 1 for decode, R + 1 for speculative verification),
and with a sliding window only keys > position - window. Pages past a sequence's length are never
read into the result (tests fill them with NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_pages(q, k_pages, v_pages, *, num_k: int, head_dim: int) -> None:
    """Raises ValueError unless K and V pages are both [K, num_pages, page_size, H] with q's K
    kv heads and head dim H."""
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [K, num_pages, page_size, H]; got "
                         f"{k_pages.shape} and {v_pages.shape}")
    if k_pages.shape[0] != num_k or k_pages.shape[3] != head_dim:
        raise ValueError(f"pages {k_pages.shape} do not match q {q.shape}: need K={num_k}, "
                         f"H={head_dim}")

def validate_inputs(q, k_pages, v_pages, lengths, page_table) -> None:
    """Static checks with messages naming the bad shape and what would be valid."""
    if q.ndim != 5:
        raise ValueError(f"q must be [B, T, K, G, H], got shape {q.shape}")
    batch, _, num_k, _, head_dim = q.shape
    check_pages(q, k_pages, v_pages, num_k=num_k, head_dim=head_dim)
    if lengths.shape != (batch,) or page_table.ndim != 2 or page_table.shape[0] != batch:
        raise ValueError(f"lengths must be [B={batch}] and page_table [B={batch}, P]; got "
                         f"{lengths.shape} and {page_table.shape}")
    if lengths.dtype != jnp.int32 or page_table.dtype != jnp.int32:
        raise ValueError(f"lengths and page_table must be int32; got {lengths.dtype}, "
                         f"{page_table.dtype}")


def paged_decode_attention_reference(
    q: jax.Array,  # [B, T, K, G, H]
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array,  # [K, num_pages, page_size, H]
    lengths: jax.Array,  # i32[B] cache length including the T new tokens
    page_table: jax.Array,  # i32[B, P]
    *,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Returns [B, T, K, G, H] in q.dtype; computed in f32, written plainly."""
    validate_inputs(q, k_pages, v_pages, lengths, page_table)
    batch, t, num_k, g, head_dim = q.shape
    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    span = page_table.shape[1] * page_size
    rows = jnp.clip(page_table, 0, num_pages - 1)
    k = k_pages[:, rows].reshape(num_k, batch, span, head_dim).astype(jnp.float32)
    v = v_pages[:, rows].reshape(num_k, batch, span, head_dim).astype(jnp.float32)
    kv_pos = jnp.arange(span)
    q_pos = lengths[:, None] - t + jnp.arange(t)[None, :]  # [B, T]
    visible = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] <
                                                              lengths[:, None, None])
    if sliding_window is not None:
        visible &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    live = kv_pos[None, :] < lengths[:, None]  # [B, S]
    v = jnp.where(live[None, :, :, None], v, 0.0)
    scores = jnp.einsum("BTKGH,KBSH->BKGTS", q.astype(jnp.float32), k) / jnp.sqrt(
        jnp.float32(head_dim))
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = visible[:, None, None]  # [B, 1, 1, T, S]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)
    out = jnp.einsum("BKGTS,KBSH->BTKGH", probs, v)
    return out.astype(q.dtype)
