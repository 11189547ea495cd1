"""The paged, static-shape KV cache (docs/architecture.md, decision 3).

Layout
------
One pool of fixed-size pages per layer (a tuple of L arrays, so each layer's write is an in-place
update of its own buffer under donation)::

    k_pages[l], v_pages[l]: [K, num_pages + D, page_size, H]  (kv heads, pages, offset, head dim)
    page_table:       i32[B, P]   page ids of slot b, in sequence order (P = pages per sequence)

Token `s` of slot `b` lives at `k_pages[l][:, page_table[b, s // page_size], s % page_size, :]`.

A scanned model (`ModelConfig.scan_layers`, `jaxinfer.model.layers`) stacks the pools instead:
one array per pool (`layers.pool_keys`: the global pool, and a hybrid cache's local pool), its
layers on a leading axis, threaded through the forward's scan and updated in place::

    k_pages[p], v_pages[p]: [L_p, K, num_pages + D, page_size, H]

and layer l's pool is row `slots[l].pool_index` of `k_pages[slots[l].pool]`
(`layers.layer_slots`); everything below holds per row.
A contiguous cache is the special case `page_table[b] = [b*P, ..., b*P + P - 1]`
(`contiguous_page_table`); prefix sharing later only changes which ids a row holds. How many
tokens a slot holds is the host's to know (the scheduler's `Request.num_computed`); each step
tells the device the length each attending row has after its writes (`QueryGroup.kv_lens`).

Worked example of one write (page_size = 4, slot 1 holds pages [7, 2, 9] and 5 tokens): the next
token of slot 1 has position s = 5, so it goes to page page_table[1, 5 // 4] = 2 at offset
5 % 4 = 1, i.e. `k_pages[l][:, 2, 1, :] = k_new[1]` for every layer l, and slot 1 attends with
kv_len 6. Positions 6 and 7 of page 2 and all of page 9 are unused: they are never read into a
result (attention masks every position >= kv_len; tests fill them with NaN to prove it).

The host owns page ids (which pages a slot holds); the device only reads the table. Each layer's
pool (each part of it, below) has one extra page at the end, the trash page, which no page table
holds: writes of rows that are idle or padded go there, so an idle slot never touches another
slot's pages, and every scatter index stays in bounds (XLA then updates in place without a
select over the pool).

Data parallelism (D > 1, the size of the mesh's "data" axis, `sharding.data_shards`): the
slots are split into D equal groups, and the pool into D equal parts along its pages axis, one
per data shard, each with its own trash page: part d holds global pages
[d * (N + 1), (d + 1) * (N + 1)), N = num_pages / D usable ones then its trash page
(`jaxinfer.model.attention.trash_page`: a part's last page). The scheduler gives a slot pages
only from its group's part (`scheduler.SchedulerConfig.shard_pages`), so each device holds only
the K/V of its own slots (1/D of the pool) and attends over it locally
(`jaxinfer.model.attention.on_pool_shards`). With D = 1 the pool is one part.

Hybrid pools (`CacheConfig.hybrid`, a model with sliding-window layers): the local layers'
pools are smaller, [K, num_local_pages + D, page_size, H] (the same split into D parts, each
ending with its trash page), and a second table of the same width addresses them::

    local_page_table: i32[B, P]  local page of each of slot b's blocks (its part's trash page
                                  for blocks behind the window, which no query reads)

Local layer l reads and writes `k_pages[l]` through `local_page_table`, global layers through
`page_table`. Token s of slot b in a local layer: `k_pages[l][:, local_page_table[b, s //
page_size], s % page_size, :]`. The host sends both tables as one array, i32[B, 2P] (global
then local: `split_table`), so every step input keeps its one table argument. The worked
example above with a window of 4 and slot 1's local row [6, 3, 0]: position 5 also goes to local
page 3 at offset 1 in every local layer, and its query sees positions 2..5, so block 0 (local
page 6) is still held. Before the step that writes position 7, whose query sees 4..7, the host
releases local page 6 and the row becomes [trash, 3, 0]. Keys behind the window are masked like
dead ones (scores and values), so whatever a released entry points at is never used.

int8 pools (`CacheConfig.dtype = "int8"`): each layer's k_pages[l] / v_pages[l] is a
`jaxinfer.model.kv_quant.QuantizedPages`, int8 values of the layout above plus
`scales: f32[K, D * ceil((num_pages / D + 1) / 8), 8, W]`, one per token and kv head, the
scale rows of each part's pages grouped 8 to a block (page p of a part: group p // 8, row p %
8 of the part's groups; W = page_size, on TPU page_size rounded up to whole 128-lane tiles: the
layout the Mosaic kernels read as XLA:TPU stores it, `pallas_kernels.paged_attention.reference`).
The write quantizes the new rows (the worked example then also sets `scales[:, 0, 2, 1] =
max|k_new[1]| / 127` per kv head); the scales are sharded like the pages' first two axes and
copied with them.

On TPU a float pool with H under 128 is stored lane-packed where its pages stay whole VMEM
tiles (`kv_quant.PackedPages`: k_pages[l] [K, num_pages + D, page_size * H / 128, 128], 128 / H
tokens to a row), the layout the Mosaic kernels read as XLA:TPU stores it: with H = 64 the
token at offset o of a page is in its row o // 2, lanes (o % 2) * 64.. Its `shape` is the
logical one above.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from jaxinfer.config import CacheConfig, ModelConfig, check_data_split
from jaxinfer.model.kv_quant import PackedPages, Pool, QuantizedPages, make_pool
from jaxinfer.model.layers import GLOBAL, LOCAL, local_layers, pool_keys
from jaxinfer.sharding import data_shards, named, placement, spec_for

# Logical axis names, for the sharding rules table.
PAGES_AXES = ("kv_heads", "pages", "page_offset", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k_pages: tuple[Pool, ...]  # L x [K, num_pages + D, page_size, H] (D: data shards), or
    v_pages: tuple[Pool, ...]  # stacked: [L_p, K, ...] per pool (int8: QuantizedPages)
    page_table: jax.Array  # i32[B, P]
    local_page_table: jax.Array | None = None  # i32[B, P] hybrid: the local layers' table
    # Static: the layers whose pool is the local one (hybrid; else empty).
    local_layers: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    # Static: the pools are stacked per pool (a scanned model's; module doc).
    stacked: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[-2]

    @property
    def num_layers(self) -> int:
        return sum(p.shape[0] for p in self.k_pages) if self.stacked else len(self.k_pages)

    def is_local_pool(self, index: int) -> bool:
        """Whether pool `index` (of `k_pages`) is a hybrid cache's local pool."""
        if not self.stacked:
            return index in self.local_layers
        return pool_keys(self.num_layers, self.local_layers)[index] == LOCAL

    @property
    def hybrid(self) -> bool:
        return bool(self.local_layers)

    @property
    def pages_per_seq(self) -> int:
        return self.page_table.shape[1]

    @property
    def max_slots(self) -> int:
        return self.page_table.shape[0]

    def replace(self, **changes) -> KVCache:
        return dataclasses.replace(self, **changes)


def contiguous_page_table(max_slots: int, pages_per_seq: int) -> np.ndarray:
    """i32[B, P]: slot b owns pages [b*P, (b+1)*P)."""
    return np.arange(max_slots * pages_per_seq, dtype=np.int32).reshape(max_slots, pages_per_seq)


def create_cache(model: ModelConfig, cache: CacheConfig, max_slots: int, *, mesh=None,
                 dtype: str | None = None, fill: float = 0.0) -> KVCache:
    """Allocates the pool: `num_pages` usable pages split into D parts (D: the mesh's "data"
    axis, see the module doc), each with its trash page; hybrid (`CacheConfig.local_window`),
    the local layers' pools of `num_local_pages` (None: num_pages) likewise. With a mesh, every
    array is created in its sharding (`cache_specs`), in its shards: the whole pool never sits
    on one device; without, on the first device. `fill` lets tests poison every page (e.g.
    NaN; an int8 pool's scales)."""
    cache = cache.resolved(model)
    shards = data_shards(mesh) if mesh is not None else 1
    num_pages = cache.num_pages or max_slots * cache.pages_per_seq
    check_data_split(max_slots=max_slots, num_pages=num_pages, data_shards=shards)
    hybrid = cache.local_window(model) is not None
    num_local = (cache.num_local_pages or num_pages) if hybrid else num_pages
    check_data_split(max_slots=max_slots, num_pages=num_local, data_shards=shards)
    dt = dtype or cache.dtype or model.dtype
    local = local_layers(model, hybrid)

    def shape(is_local: bool) -> tuple[int, ...]:
        n = num_local if is_local else num_pages
        return (model.num_kv_heads, n + shards, cache.page_size, model.head_dim)

    def table(n: int) -> jax.Array:
        per_shard = n // shards
        rows = contiguous_page_table(max_slots, cache.pages_per_seq) % per_shard
        rows += (np.arange(max_slots) // (max_slots // shards) * (per_shard + 1))[:, None]
        return jnp.asarray(rows)

    devices = getattr(mesh, "devices", None)
    platform = jax.default_backend() if devices is None else devices.flat[0].platform
    if model.scan_layers:  # one stacked pool per pool key
        keys = pool_keys(model.num_layers, local)
        count = {key: sum((LOCAL if i in local else GLOBAL) == key
                          for i in range(model.num_layers)) for key in keys}
        shapes = [(count[key], *shape(key == LOCAL)) for key in keys]
    else:
        shapes = [shape(i in local) for i in range(model.num_layers)]

    def make() -> KVCache:
        def pools():
            return tuple(make_pool(s, dt, fill, tpu=platform == "tpu", parts=shards)
                         for s in shapes)

        return KVCache(k_pages=pools(), v_pages=pools(), page_table=table(num_pages),
                       local_page_table=table(num_local) if hybrid else None,
                       local_layers=local, stacked=model.scan_layers)

    if mesh is None:  # committed, as the steps' outputs are (else the first step compiles twice)
        return jax.device_put(make(), named(None, P()))
    return jax.jit(make, out_shardings=placement(jax.eval_shape(make), cache_specs, mesh))()


def cache_specs(cache: KVCache, mesh: Mesh | AbstractMesh) -> KVCache:
    """Specs of a KVCache's arrays: pages by PAGES_AXES (a stacked pool's layers whole; an int8
    pool's scales by the pages' axes before their page offset), the page table replicated. The
    pool is placed in them, and every step that returns it pins it to them
    (`sharding.constrain`)."""
    axes = (("layers",) if cache.stacked else ()) + PAGES_AXES

    def spec(pool):
        pages = spec_for("k_pages", axes, pool.shape, mesh)
        if isinstance(pool, QuantizedPages):
            return QuantizedPages(values=pages, scales=P(*pages[:-2], None, None))
        if isinstance(pool, PackedPages):
            return PackedPages(values=pages, head_dim=pool.head_dim)
        return pages

    return cache.replace(k_pages=tuple(spec(p) for p in cache.k_pages),
                         v_pages=tuple(spec(p) for p in cache.v_pages),
                         page_table=P(),
                         local_page_table=None if cache.local_page_table is None else P())


def split_table(cache: KVCache, table: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """A step's page-table input, i32[B, P] or (hybrid) i32[B, 2P], as (the global table
    i32[B, P], the local one i32[B, P] or None when `cache` has no local pool)."""
    p = cache.pages_per_seq
    if cache.hybrid and table.shape[1] != 2 * p:
        raise ValueError(f"a hybrid KV cache takes its page tables as one i32[B, {2 * p}] input "
                         f"(global then local: BatchBuilder.table_width), got {table.shape}")
    return table[:, :p], (table[:, p:] if cache.hybrid else None)


def cache_bytes(cache: KVCache) -> int:
    """Bytes of the pool (an int8 pool's scales included)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves((cache.k_pages, cache.v_pages)))


def pages_bucket(num_tokens: int, page_size: int, pages_per_seq: int, least: int = 1) -> int:
    """Static number of pages a step reads: the next power of two covering `num_tokens`, at
    least `least` (`CacheConfig.min_bucket_pages`, a power of two), <= P.

    Attention work is then proportional to the live tokens (within 2x) past the floor, not to
    the capacity, and only log2(P / least) + 1 variants of each step exist.
    """
    need = max(least, -(-num_tokens // page_size))
    bucket = 1 << (need - 1).bit_length()
    return min(bucket, pages_per_seq)
