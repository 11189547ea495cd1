"""RoPE and the jnp reference attention over the paged KV cache.

The reference is the CPU implementation and the oracle for the Pallas kernels: it gathers only
the first `num_pages_read` pages of each row (a static bucket covering the live tokens), masks
every position at or past the row's length (scores *and* values, so NaN in unused page slots
cannot leak), and computes softmax in f32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxinfer.config import RopeConfig

Q_BLOCK = 256  # queries per attention block in long prefill chunks


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """f32[H/2] inverse frequencies, with llama3 / linear scaling applied (as Hugging Face does)."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * inv / rope.factor + smooth * inv
        inv = np.where(wavelen > low_wavelen, inv / rope.factor,
                       np.where(wavelen < high_wavelen, inv, smoothed))
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates `x` [B, T, ..., H] at `positions` i32[B, T]; HF rotate_half pairs (j, j + H/2)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    cos = jnp.cos(angles)
    sin = jnp.sin(angles)
    extra = x.ndim - 3
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[-1:])
    sin = sin.reshape(cos.shape)
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k_new: jax.Array, v_new: jax.Array,
             page_rows: jax.Array, positions: jax.Array, valid: jax.Array,
             first_page: jax.Array | None = None):
    """Writes new keys/values of one layer into its pool, in place under donation.

    Args:
      k_pages, v_pages: [K, num_pages + 1, page_size, H] one layer's pool; the last page is
        the trash page that absorbs writes of padding and idle rows.
      k_new, v_new: [B, T, K, H] keys (already rotated) and values of this step's tokens.
      page_rows: i32[B, P] page table rows of the B rows in this step.
      positions: i32[B, T] sequence position of each token.
      valid: bool[B, T] False for padding and idle rows: those writes go to the trash page.
      first_page: the global id of `k_pages`' first page when they are one data shard's part
        of the pool (`on_pool_shards`): tokens whose page lies outside it go to the trash page.
    Returns:
      The updated (k_pages, v_pages).
    """
    page_size = k_pages.shape[2]
    trash = k_pages.shape[1] - 1  # the pool's last page is never in a page table
    page_idx = jnp.clip(positions // page_size, 0, page_rows.shape[1] - 1)
    page = jnp.take_along_axis(page_rows, page_idx, axis=1)  # [B, T]
    if first_page is not None:
        page = page - first_page
        valid = valid & (page >= 0) & (page < trash)
    page = jnp.where(valid, jnp.clip(page, 0, trash - 1), trash)
    offset = positions % page_size
    # Every index is in bounds (invalid rows hit the trash page), so XLA emits a plain in-place
    # scatter / dynamic-update-slice; `mode="drop"` would add a select over the whole pool.
    k_new = jnp.moveaxis(k_new, 2, 0).astype(k_pages.dtype)  # [K, B, T, H]
    v_new = jnp.moveaxis(v_new, 2, 0).astype(v_pages.dtype)
    k_pages = k_pages.at[:, page, offset].set(k_new, mode="promise_in_bounds")
    v_pages = v_pages.at[:, page, offset].set(v_new, mode="promise_in_bounds")
    return k_pages, v_pages


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              page_rows: jax.Array, positions: jax.Array, kv_lens: jax.Array,
                              *, num_pages_read: int, sliding_window: int | None = None
                              ) -> jax.Array:
    """Causal attention of B rows x T new tokens over their cached pages.

    Args:
      q: [B, T, K, G, H] queries (rotated).
      k_pages, v_pages: [K, num_pages + 1, page_size, H] one layer's pool (new tokens written;
        the last page is the trash page and is never read).
      page_rows: i32[B, P] page table rows.
      positions: i32[B, T] query positions.
      kv_lens: i32[B] tokens in the cache per row after this step's writes.
      num_pages_read: static; only pages page_rows[:, :num_pages_read] are read.
      sliding_window: if set, a query at p sees keys in (p - window, p].
    Returns:
      [B, T, K, G, H] attention output in q.dtype.
    """
    _, num_pages, page_size, _ = k_pages.shape
    batch = q.shape[0]
    rows = jnp.clip(page_rows[:, :num_pages_read], 0, num_pages - 2)  # [B, Pr], no trash page
    span = num_pages_read * page_size
    k = k_pages[:, rows].astype(jnp.float32)  # [K, B, Pr, page_size, H]
    v = v_pages[:, rows].astype(jnp.float32)
    live = jnp.arange(span, dtype=jnp.int32)[None, :] < kv_lens[:, None]  # [B, S]
    live_pages = live.reshape(1, batch, num_pages_read, page_size, 1)
    v = jnp.where(live_pages, v, 0.0)
    # Chunks of several queries attend in blocks of Q_BLOCK queries over the once-gathered pages,
    # with (K, B) as the dots' batch dims: a [K, G, T, S] f32 score tensor for T = 512, S = 2048
    # is 38 MB per layer and XLA CPU materialises it several times, and any other dim order makes
    # it transpose the gathered K/V per block. Measured, 2048-token prefill in 512-token chunks:
    # 8.3 s -> 4.2 s (blocks of 64: 5.4 s, 512: 5.2 s). Decode (T = 1) keeps `_attend`, whose
    # result for a row is bitwise independent of the page bucket (the batch-invariance test).
    if q.shape[1] == 1:
        return _attend(q, k, v, live, positions, sliding_window)
    outs = []
    for begin in range(0, q.shape[1], Q_BLOCK):
        block = slice(begin, begin + Q_BLOCK)
        outs.append(_attend_kmajor(q[:, block], k, v, live, positions[:, block], sliding_window))
    return jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]


def _visible(live: jax.Array, positions: jax.Array, sliding_window: int | None) -> jax.Array:
    """bool[B, T, S]: key s is live (live: bool[B, S]), not after the query's position
    (positions: i32[B, T]) and, with a sliding window, inside it."""
    kv_pos = jnp.arange(live.shape[1], dtype=jnp.int32)[None, None, :]
    mask = live[:, None, :] & (kv_pos <= positions[:, :, None])
    if sliding_window is not None:
        mask &= kv_pos > positions[:, :, None] - sliding_window
    return mask


def _attend(q, k, v, live, positions, sliding_window):
    """Softmax attention of q [B, T, K, G, H] over gathered k, v [K, B, Pr, page_size, H]
    (v already zeroed past each row's length); live: bool[B, S]. Returns [B, T, K, G, H]."""
    _, _, num_pages_read, page_size, head_dim = k.shape
    span = num_pages_read * page_size
    scores = jnp.einsum("BTKGH,KBPQH->BKGTPQ", q.astype(jnp.float32), k)
    scores = scores.reshape(scores.shape[:4] + (span,)) * (1.0 / math.sqrt(head_dim))
    mask = _visible(live, positions, sliding_window)  # [B, T, S]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask[:, None, None], probs, 0.0)  # rows with no visible key (padding) -> 0
    probs = probs.reshape(probs.shape[:4] + (num_pages_read, page_size))
    out = jnp.einsum("BKGTPQ,KBPQH->BTKGH", probs, v)
    return out.astype(q.dtype)


def _attend_kmajor(q, k, v, live, positions, sliding_window):
    """`_attend` for chunks of several queries, with (K, B) as the dots' batch dims so the
    gathered k, v are read in place instead of being transposed once per query block."""
    batch, t, num_k, g, head_dim = q.shape
    span = k.shape[2] * k.shape[3]
    k = k.reshape(num_k, batch, span, head_dim)
    v = v.reshape(num_k, batch, span, head_dim)
    qk = jnp.transpose(q, (2, 0, 1, 3, 4)).reshape(num_k, batch, t * g, head_dim)
    qk = qk.astype(jnp.float32) * (1.0 / math.sqrt(head_dim))
    scores = jnp.einsum("KBXH,KBSH->KBXS", qk, k).reshape(num_k, batch, t, g, span)
    mask = _visible(live, positions, sliding_window)  # [B, T, S]
    mask = mask[None, :, :, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)
    out = jnp.einsum("KBXS,KBSH->KBXH", probs.reshape(num_k, batch, t * g, span), v)
    out = jnp.transpose(out.reshape(num_k, batch, t, g, head_dim), (1, 2, 0, 3, 4))
    return out.astype(q.dtype)


def resolve_impl(impl: str) -> str:
    """`auto` -> "pallas" on TPU/GPU, "xla" on CPU; "xla" / "pallas" as given."""
    if impl == "auto":
        return "xla" if jax.default_backend() == "cpu" else "pallas"
    return impl


def decode_attention(q, k_pages, v_pages, page_rows, positions, kv_lens, *, num_pages_read: int,
                     sliding_window: int | None, impl: str, mine: jax.Array | None = None
                     ) -> jax.Array:
    """Attention of a decode step (T = 1) or a speculative verification (T = R + 1 consecutive
    queries per row, causal among themselves) with the chosen implementation (see
    `paged_attention_reference` for the arguments). The kernel reads `page_rows[:, :Pr]` and
    places query t at L - T + t with L = positions[:, -1] + 1, which is the reference's position
    for every query; keys at or past a row's `kv_lens` that a query may see under L belong to
    rows or queries whose outputs the caller discards (idle rows, padding past a row's drafts).
    `mine`: bool[B], given inside `on_pool_shards`: the arrays are one data shard's, and only
    these rows are its own; the kernel runs on the arrays as they are and skips the other rows
    (length 0: no page read; the caller zeroes their outputs)."""
    if impl == "xla":
        return paged_attention_reference(q, k_pages, v_pages, page_rows, positions, kv_lens,
                                         num_pages_read=num_pages_read,
                                         sliding_window=sliding_window)
    from pallas_kernels.paged_attention import paged_decode_attention

    def kernel(q, k_pages, v_pages, kv_lens, table):
        return paged_decode_attention(q, k_pages, v_pages, kv_lens, table,
                                      sliding_window=sliding_window)

    table = page_rows[:, :num_pages_read]
    kv_lens = positions[:, -1] + 1
    if mine is not None:
        return kernel(q, k_pages, v_pages, jnp.where(mine, kv_lens, 0), table)
    mesh = jax.sharding.get_abstract_mesh()
    if not _heads_split(mesh, k_pages.shape[0]):
        return kernel(q, k_pages, v_pages, kv_lens, table)
    # Tensor parallel: each model shard runs the kernel on its own kv heads (and their G query
    # heads), the pages it holds. (check_vma=False: pallas_call has no varying-axis rule.)
    heads = P(None, None, "model")
    return jax.shard_map(kernel, in_specs=(heads, P("model"), P("model"), P(), P()),
                         out_specs=heads, check_vma=False)(q, k_pages, v_pages, kv_lens, table)


def _heads_split(mesh, num_kv_heads: int) -> bool:
    """Whether the pool's kv heads are split over "model" (`sharding.RULES`: when it divides)."""
    return ("model" in mesh.axis_names and mesh.shape["model"] > 1
            and num_kv_heads % mesh.shape["model"] == 0)


def data_shards() -> int:
    """Size of the "data" axis of the context mesh (`jax.set_mesh`); 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape["data"] if "data" in mesh.axis_names else 1


def pool_partition(num_kv_heads: int) -> P:
    """The PartitionSpec of a layer's pool [K, pages, page_size, H] on the context mesh, split
    over "data" (`on_pool_shards`): pages over "data", kv heads over "model" where it divides."""
    mesh = jax.sharding.get_abstract_mesh()
    return P("model" if _heads_split(mesh, num_kv_heads) else None, "data")


def on_pool_shards(body, num_shards: int, heads: tuple, pools: tuple, rest: tuple):
    """Runs `body` on each shard of a pool split over "data" (and over "model" by kv heads where
    they divide): the data-parallel KV cache. Each data shard holds the pages of its own slots
    (`kv_cache` module doc), so it writes and attends only for rows whose pages it holds.

    body(first_page, *heads, *pools, *rest) -> (out, *pools): `first_page` is the global id of
    the shard's first page; `heads` (and `out`) have their kv-head axis at 2 ([B, T, K, ...]);
    `pools` are [K, pages, page_size, H]; `rest` is whole on every shard. Every data shard sees
    every row; `body` zeroes the rows it does not hold (`shard_rows`), and the outputs are
    summed over "data", so each row comes from exactly the one shard that holds its pages, bit
    for bit what the whole pool gives. (check_vma=False: pallas_call has no varying-axis rule.)
    """
    if data_shards() != num_shards:
        raise ValueError(f"a KV pool split into {num_shards} parts (KVCache.data_shards) needs "
                         f"a context mesh (jax.set_mesh) whose data axis is {num_shards}; it is "
                         f"{data_shards()}")
    pool_spec = pool_partition(pools[0].shape[0])
    head_spec = P(None, None, pool_spec[0])  # kv heads split as the pool's
    local_pages = pools[0].shape[1] // num_shards

    def shard(*args):
        out, *new_pools = body(jax.lax.axis_index("data") * local_pages, *args)
        return (jax.lax.psum(out, "data"), *new_pools)

    return jax.shard_map(
        shard, in_specs=(head_spec,) * len(heads) + (pool_spec,) * len(pools) + (P(),) * len(rest),
        out_specs=(head_spec,) + (pool_spec,) * len(pools), check_vma=False,
    )(*heads, *pools, *rest)


def shard_rows(page_rows: jax.Array, first_page: jax.Array, num_pages: int
               ) -> tuple[jax.Array, jax.Array]:
    """For one data shard whose part of the pool holds global pages [first_page, first_page +
    num_pages) (its trash page excluded): (page_rows i32[B, P] as local ids clipped into the
    part, bool[B] the rows whose pages it holds). A row's pages all lie in one shard (the
    scheduler allocates a slot's pages from its shard), so its first page decides."""
    local = page_rows - first_page
    mine = (local[:, 0] >= 0) & (local[:, 0] < num_pages)
    return jnp.clip(local, 0, num_pages - 1), mine
