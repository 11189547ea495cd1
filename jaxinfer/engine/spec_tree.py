"""Draft trees on the device (`jaxinfer.config.DraftTree`; docs/architecture.md, decisions 5
and 19): the static arrays the steps build a tree verification from, the penalty counts along
each node's path, and `commit_path`, which puts the accepted path's K/V where its tokens sit.

Where a tree's K/V goes. A verification (and a model drafter's tree steps) writes node i of a
slot whose newest token is at position `pos` at the node's *slot*, position pos + i, while
rotating it at pos + depth(i) (`StepBatch.write_positions`): the nodes of one depth cannot share
a position in the pages. The tree's slots are pos .. pos + T, pages the scheduler reserved
(`scheduler.reserve_lookahead`). After acceptance of the path n_1 .. n_a (n_d at depth d), its
tokens are at positions pos + 1 .. pos + a, so `commit_path` copies each n_d's K/V row from
pos + n_d to pos + d, in every layer (a gather of the a rows, then a scatter: every source is
read before any row is written, so a row moving onto another's slot is safe). Everything past
pos + a is garbage past the slot's length, as a rejected chain's drafts are: rollback stays a
length change.

Why rows, not pages: the path's rows are a handful per slot (a <= D) out of the one or two pages
the tree spans; a page move would copy page_size rows per page per layer, and the accepted
rows would still need moving within the page (they are not contiguous in the tree's layout).
Breadth-first numbering puts the first child of the root at pos + 1 already (no copy).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxinfer.config import DraftTree
from jaxinfer.engine.kv_cache import KVCache, cache_specs, split_table
from jaxinfer.model.attention import pool_partition, trash_page
from jaxinfer.model.kv_quant import copy_pool_rows
from jaxinfer.sharding import constrain, data_shards


@functools.cache
def depths(tree: DraftTree) -> np.ndarray:
    """i32[T + 1] the depth of the root (0) and of every node."""
    return np.asarray(tree.depths, np.int32)


@functools.cache
def ancestor_bits(tree: DraftTree) -> np.ndarray:
    """i32[T + 1, W] (`DraftTree.ancestor_bits`), cached."""
    return tree.ancestor_bits()


@functools.cache
def levels(tree: DraftTree) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Per depth 1..D: (its nodes i32[n], their parents i32[n])."""
    out = []
    for d in range(1, tree.max_depth + 1):
        nodes = np.asarray([i for i in range(1, tree.num_nodes + 1) if tree.depths[i] == d],
                           np.int32)
        out.append((nodes, np.asarray([tree.parents[i - 1] for i in nodes], np.int32)))
    return tuple(out)


def path_counts(drafted: jax.Array, tree: DraftTree) -> jax.Array:
    """i32[B, T + 1, V]: for the root and every node, how often each token occurs among its
    (strict) ancestors' drafts, from drafted i32[B, T, V] (node i's one-hot, zeros for padding
    nodes): the output counts penalties see at that node if its path is accepted."""
    b, t, vocab = drafted.shape
    own = jnp.concatenate([jnp.zeros((b, 1, vocab), drafted.dtype), drafted], axis=1)
    counts = jnp.zeros_like(own)
    for nodes, parents in levels(tree):
        counts = counts.at[:, nodes].set(counts[:, parents] + own[:, parents])
    return counts


@functools.partial(jax.jit, donate_argnames=("cache",))
def commit_path(cache: KVCache, page_table: jax.Array, pos: jax.Array, path: jax.Array,
                num_emitted: jax.Array) -> KVCache:
    """Moves each slot's accepted nodes' K/V from their tree slots to their tokens' positions
    (module doc), in every layer of the pool (a hybrid pool's local layers through the local
    table; a pool split over "data": each shard moves the rows its pages hold).

    page_table: i32[B, P] (hybrid: [B, 2P], `kv_cache.split_table`); pos: i32[B] each slot's
    root position; path: i32[B, D] its accepted nodes from the root down (0 past them);
    num_emitted: i32[B] 1 + the accepted nodes (`steps.VerifyOutput.num_emitted`; 0 or 1:
    nothing moves, e.g. idle slots)."""
    table, local_table = split_table(cache, page_table)
    b, depth = path.shape
    d = jnp.arange(1, depth + 1, dtype=jnp.int32)[None]
    move = (d < num_emitted[:, None]) & (path != d)  # [B, D]; the first child stays put
    src, dst = pos[:, None] + path, pos[:, None] + d
    slots = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, depth))
    shards = data_shards()

    def rows(tbl, positions, trash, first):
        page_size = cache.k_pages[0].shape[-2]
        pages = tbl[slots, jnp.clip(positions // page_size, 0, tbl.shape[1] - 1)] - first
        ok = move & (pages >= 0) & (pages < trash)
        return (jnp.where(ok, pages, trash).reshape(-1),
                jnp.where(ok, positions % page_size, 0).reshape(-1))

    def copy(k_pages, v_pages, tbl, first=0):
        trash = trash_page(k_pages)
        s, t = rows(tbl, src, trash, first), rows(tbl, dst, trash, first)
        return copy_pool_rows(k_pages, s, t), copy_pool_rows(v_pages, s, t)

    def shard(tbl, k_pages, v_pages):
        return copy(k_pages, v_pages, tbl, jax.lax.axis_index("data") * k_pages.shape[-3])

    pools = []
    for i, (k, v) in enumerate(zip(cache.k_pages, cache.v_pages)):
        tbl = local_table if cache.is_local_pool(i) else table
        if shards > 1:
            spec = pool_partition(k.shape[-4], stacked=cache.stacked)
            pools.append(jax.shard_map(shard, in_specs=(P(), spec, spec), out_specs=(spec, spec),
                                       check_vma=False)(tbl, k, v))
        else:
            pools.append(copy(k, v, tbl))
    return constrain(cache.replace(k_pages=tuple(k for k, _ in pools),
                                   v_pages=tuple(v for _, v in pools)), cache_specs)
