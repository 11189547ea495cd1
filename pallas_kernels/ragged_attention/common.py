"""The per-block schedule both ragged kernels share: which sequences a block of query rows meets.

Both kernels tile the flat query rows into blocks of `block_tokens` tokens and give each (kv head,
block) to one program, which walks the sequences owning rows of its block, and for each streams
that sequence's K/V pages through an online softmax. With the rows of the sequences ascending and
disjoint (the contract in `reference.py`), the sequences meeting block j are a contiguous range
[seq_lo[j], seq_hi[j]) found by binary search here, on traced arrays, once per call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def block_sequences(q_starts: jax.Array, q_lens: jax.Array, num_blocks: int,
                    block_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(seq_lo, seq_hi) i32[num_blocks]: block j of rows [j * block_tokens, (j + 1) *
    block_tokens) meets the sequences seq_lo[j] <= s < seq_hi[j] (some of them may own no row of
    it: an empty sequence in the range is skipped by the kernels' bounds)."""
    ends = q_starts + q_lens  # non-decreasing under the contract
    first_row = jnp.arange(num_blocks, dtype=jnp.int32) * block_tokens
    seq_lo = jnp.searchsorted(ends, first_row, side="right").astype(jnp.int32)
    seq_hi = jnp.searchsorted(q_starts, first_row + block_tokens, side="left").astype(jnp.int32)
    return seq_lo, jnp.maximum(seq_hi, seq_lo)


def block_rows(s_start, s_len, kv_len, row0, block_tokens: int):
    """For sequence s (first row s_start, s_len rows, kv_len keys) and the block of rows starting
    at row0: (lo, hi, first_pos, last_pos), the rows [lo, hi) it owns in the block (hi <= lo:
    none) and the positions of the first and last of them. Scalars (traced inside kernels)."""
    lo = jnp.maximum(s_start, row0)
    hi = jnp.minimum(s_start + s_len, row0 + block_tokens)
    base = kv_len - s_len - s_start  # position of row r is base + r
    return lo, hi, base + lo, base + hi - 1
