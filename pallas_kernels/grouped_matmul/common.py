"""Row tiles of a grouped matmul: which group each step computes on which tile of rows.

The scheme of JAX's megablox grouped matmul (`make_group_metadata`): the rows are cut into
tiles of `tm`, and every (group, tile) pair the group's rows touch is one step, in order of
group then tile. A tile two groups share is visited once by each (the step keeps only its own
group's rows); a group with no rows has no step, so its weight is never read; tiles wholly
past `group_sizes.sum()` have none either. Computed here with compares and masked sums over
[E, E] and [steps, E] (fused elementwise int32 ops that XLA's TPU cost model counts at a few
KB) rather than megablox's histogram, scatters and gathers, or cumsum and indexing, which it
counts at 1-5 MB per call (a gather of 131 of 128 ints: 1 MB).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def max_steps(m: int, tm: int, num_groups: int) -> int:
    """The most steps M rows in tiles of `tm` over `num_groups` groups can take: every tile,
    plus one more for each group boundary inside a tile."""
    return -(-m // tm) + num_groups - 1


def group_tiles(group_sizes: jax.Array, m: int, tm: int
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """(offsets i32[E + 1]: group e's rows are [offsets[e], offsets[e + 1]);
    group_ids, m_tile_ids i32[max_steps]: step s computes group group_ids[s] on rows
    [m_tile_ids[s] * tm, + tm); num_steps i32[]: the steps to run; slots i32[E]: 0 and 1
    alternating over the groups with rows, so consecutive steps of different groups get
    different ones (the TPU kernel's double-buffered scales)), for `group_sizes` i32[E] over M
    rows (the last tile may run past M when tm does not divide it). Entries past num_steps
    repeat the last step's."""
    e = group_sizes.shape[0]
    groups = jnp.arange(e, dtype=jnp.int32)
    upto = groups[None, :] <= groups[:, None]  # [E, E] j <= i

    def cumsum(a):  # i32[E] inclusive
        return jnp.sum(jnp.where(upto, a[None, :], 0), axis=1, dtype=jnp.int32)

    ends = cumsum(group_sizes)
    first = (ends - group_sizes) // tm
    tiles = jnp.where(group_sizes > 0, (ends - 1) // tm - first + 1, 0)
    step_ends = cumsum(tiles)  # steps up to and including each group's
    steps = max_steps(m, tm, e)
    # group sizes summing past M (outside the contract) must not step past the metadata
    num_steps = jnp.minimum(jnp.sum(tiles), steps)
    s = jnp.minimum(jnp.arange(steps, dtype=jnp.int32), jnp.maximum(num_steps - 1, 0))
    group_ids = jnp.minimum(jnp.sum(step_ends[None, :] <= s[:, None], axis=1, dtype=jnp.int32),
                            e - 1)
    mine = group_ids[:, None] == groups[None, :]  # [steps, E] one-hot

    def of_step(a):  # i32[steps]: a[group_ids]
        return jnp.sum(jnp.where(mine, a[None, :], 0), axis=1, dtype=jnp.int32)

    m_tile_ids = of_step(first) + s - of_step(step_ends - tiles)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), ends])
    slots = (cumsum((group_sizes > 0).astype(jnp.int32)) - 1) % 2
    return offsets, group_ids, m_tile_ids, num_steps.astype(jnp.int32), slots
