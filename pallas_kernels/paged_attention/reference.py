"""Plain-jnp oracle of paged decode attention, and the input validator every kernel shares.

Layout (docs/architecture.md, decision 3): a pool `k_pages, v_pages: [K, num_pages, page_size, H]`,
or with `layer` (i32[]) given, a stack of layers' pools [L, K, num_pages, page_size, H] of which
row `layer` is read (the scanned layout: the kernels read that row in place, `take_pages`);
`page_table: i32[B, P]` page ids of each sequence in order; `lengths: i32[B]` tokens in the cache
per sequence *including* the T new tokens whose queries are given (they were written first).
Query t of sequence b sits at position lengths[b] - T + t and sees keys at positions
<= its own (causal among the T new tokens: T = 1 for decode, R + 1 for speculative verification),
and with a sliding window only keys > position - window. Pages past a sequence's length are never
read into the result (tests fill them with NaN).

Tree queries (speculative tree drafts): with `tree_mask: i32[B, T, W]` and `tree_base: i32[B]`
the T queries are the nodes of a draft tree whose slots are positions tree_base[b] + j (j = 0:
the root). Query t sees every key before tree_base[b] (the cached context) and the tree slot j
iff bit j % 32 of word j // 32 of tree_mask[b, t] is set (its ancestors and itself), always
below lengths[b]; it sits at position tree_base[b] + depth, depth = popcount(tree_mask[b, t])
- 1, which only a sliding window reads (`tree_positions`). `tree_visible` is the one
definition every implementation follows.

Attention sinks (gpt-oss): `sinks: f32[K, G]`, a learned logit per query head added to every
softmax denominator as a key with no value: weights exp(s_j) / (exp(sink) + sum_i exp(s_i))
(`attend_with_sinks`); a query that sees no key outputs 0 as without them.

Quantized pages: int8 `k_pages, v_pages` come with `k_scales, v_scales: f32[K, ceil(num_pages /
8), 8, W]`, one scale per stored token and kv head: page p's scales are lanes 0..page_size-1 of
row p % 8 of group p // 8 (`page_scales`; W = page_size, or on TPU `scale_width(page_size)`,
lanes past page_size unused); key/value s of head k is `pages[k, page, off, :] * scales[k, page
// 8, page % 8, off]`. Float pages take no scales. Every kernel dequantizes only the tiles it
loads (the scales are per key, so a kernel may equally apply them to the key columns of its
score / probability tile).

Lane-packed pages: float pages with H under 128 (H dividing 128) may come as `[K, num_pages,
page_size * H / 128, 128]`, the row-major reshape of the same array: row r of a page holds its
128 / H tokens r * 128 / H.. side by side along lanes (`pack_pages`). XLA:TPU stores a
[.., page_size, 64] array pages-minor (the least padding), which the Mosaic kernels cannot read,
and would relay each layer's pool out before every call; the packed array is row-major as
stored. The TPU kernels read packed pages as they are; the reference and the GPU kernels view
them as [K, num_pages, page_size, H] (`unpack_pages`: free in a row-major layout).

Why the scales are grouped 8 pages to a [8, W] block of whole 128-lane rows on TPU: XLA:TPU
stores an array in the layout that pads it least, and a [K, pages, page_size] f32 array with
page_size under 128 (or K small) goes pages-minor, which the Mosaic kernels (row-major operands)
cannot read: XLA would relay every layer's scales out before each call and back after the
write. [K, groups, 8, W] with W a multiple of 128 is unpadded in row-major (8, 128) tiles, so
XLA keeps it row-major, and its scatters (the writes) work on it in place (a [K, pages, 1, W]
array would be (1, 128)-tiled, which XLA's scatter relays out); a DMA moves whole 512-byte
runs, so a page's scales are fetched as one whole row.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

PAGE_DTYPES = ("float32", "bfloat16", "int8")  # int8: with k_scales / v_scales
LANES = 128  # a TPU vector register's lanes: the minor tile of every TPU array
SCALE_GROUP = 8  # pages to a group of scale rows: f32's sublane tile


def scale_width(page_size: int, lanes: int = LANES) -> int:
    """The minor dim of a TPU pool's scales: page_size rounded up to whole 128-lane tiles."""
    return -(-page_size // lanes) * lanes


def scale_groups(num_pages: int) -> int:
    """The group dim of the scales of `num_pages` pages (module doc)."""
    return -(-num_pages // SCALE_GROUP)


def take_pages(pool: jax.Array, pages: jax.Array, layer: jax.Array | int | None = None
               ) -> jax.Array:
    """Pages `pages` (i32[...], in bounds) of a pool [K, num_pages, ...] as [K, *pages.shape,
    ...]; with `layer`, of row `layer` of a stacked pool [L, K, num_pages, ...]: one gather
    from the stack, which never copies the layer's pool out of it."""
    if layer is None:
        return pool[:, pages]
    index = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, pages.dtype), pages.shape), pages],
                      axis=-1)
    rest = pool.shape[3:]
    batch_dims = pages.ndim
    dims = jax.lax.GatherDimensionNumbers(
        offset_dims=(0, *range(1 + batch_dims, 1 + batch_dims + len(rest))),
        collapsed_slice_dims=(0, 2), start_index_map=(0, 2))
    return jax.lax.gather(pool, index, dims, (1, pool.shape[1], 1, *rest),
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def page_scales(scales: jax.Array, pages: jax.Array, layer: jax.Array | int | None = None
                ) -> jax.Array:
    """The scale rows [K, *pages.shape, W] of page ids `pages` (module doc): a gather of rows
    of the [K, groups * 8, W] view (a free reshape: row-major, and on TPU whole (8, 128)
    tiles); with `layer`, of row `layer` of stacked scales [L, K, groups, 8, W]."""
    rows = scales.reshape(*scales.shape[:-3], -1, scales.shape[-1])
    return take_pages(rows, pages, layer)


def group_scales(scales, width: int | None = None) -> jax.Array:
    """Per-token scales [K, num_pages, page_size] in the pool's layout [K, ceil(num_pages / 8),
    8, width (default page_size)] (module doc), the padding 0."""
    k, n, page_size = scales.shape
    width = width or page_size
    pad = ((0, 0), (0, scale_groups(n) * SCALE_GROUP - n), (0, width - page_size))
    return jnp.pad(jnp.asarray(scales), pad).reshape(k, -1, SCALE_GROUP, width)


def packing(pages_shape, head_dim: int) -> int:
    """Tokens per stored row of pages [K, num_pages, rows, lanes] holding H = head_dim: 1, or
    lanes / H for lane-packed pages (module doc)."""
    lanes = pages_shape[-1]
    if lanes % head_dim:
        raise ValueError(f"pages {tuple(pages_shape)} hold neither H={head_dim} nor lane-packed "
                         f"H={head_dim} tokens (a minor dim that H divides, e.g. {LANES})")
    return lanes // head_dim


def pack_pages(pages: jax.Array, lanes: int = LANES) -> jax.Array:
    """[K, num_pages, page_size, H] -> lane-packed [K, num_pages, page_size * H / lanes, lanes]."""
    k, n, page_size, head_dim = pages.shape
    per = lanes // head_dim
    if lanes % head_dim or page_size % per:
        raise ValueError(f"pages {pages.shape} do not pack to {lanes}-lane rows: H={head_dim} "
                         f"must divide {lanes} and page_size a multiple of {lanes} / H")
    return pages.reshape(k, n, page_size // per, lanes)


def unpack_pages(pages: jax.Array, head_dim: int) -> jax.Array:
    """Pages [..., rows, lanes] (lane-packed or not) as [..., page_size, H]."""
    per = packing(pages.shape, head_dim)
    if per == 1:
        return pages
    shape = (*pages.shape[:-2], pages.shape[-2] * per, head_dim)
    if isinstance(pages, jax.ShapeDtypeStruct):  # a `layer_view`
        return jax.ShapeDtypeStruct(shape, pages.dtype)
    return pages.reshape(shape)


def check_pages(q, k_pages, v_pages, *, num_k: int, head_dim: int, k_scales=None,
                v_scales=None) -> None:
    """Raises ValueError unless K and V pages are both [K, num_pages, page_size, H] with q's K
    kv heads and head dim H, of one of PAGE_DTYPES, with f32 [K, num_pages, page_size] scales
    exactly when they are int8."""
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [K, num_pages, page_size, H]; got "
                         f"{k_pages.shape} and {v_pages.shape}")
    if k_pages.shape[0] != num_k or k_pages.shape[3] != head_dim:
        raise ValueError(f"pages {k_pages.shape} do not match q {q.shape}: need K={num_k}, "
                         f"H={head_dim}")
    check_scales(k_pages, v_pages, k_scales, v_scales)


def check_scales(k_pages, v_pages, k_scales, v_scales) -> None:
    """The pages' dtype and, for int8 pages, their scales (module doc)."""
    dtypes = (jnp.dtype(k_pages.dtype).name, jnp.dtype(v_pages.dtype).name)
    if dtypes[0] != dtypes[1] or dtypes[0] not in PAGE_DTYPES:
        raise ValueError(f"k_pages / v_pages dtypes {dtypes} unsupported: both must be one of "
                         f"{PAGE_DTYPES} (int8 with k_scales and v_scales)")
    scales = (k_scales, v_scales)
    if dtypes[0] != "int8":
        if any(x is not None for x in scales):
            raise ValueError(f"k_scales / v_scales go with int8 pages only; got {dtypes[0]} "
                             "pages with scales")
        return
    num_k, num_pages, page_size = k_pages.shape[:3]
    want = [num_k, scale_groups(num_pages), SCALE_GROUP]
    widths = (page_size, scale_width(page_size))
    for name, x in zip(("k_scales", "v_scales"), scales):
        if x is None or x.ndim != 4 or list(x.shape[:3]) != want or \
                x.shape[3] not in widths or x.dtype != jnp.float32:
            got = None if x is None else f"{x.dtype}{list(x.shape)}"
            raise ValueError(f"int8 pages need {name} float32{[*want, widths[0]]} or "
                             f"float32{[*want, widths[1]]} (one scale per token and kv head, "
                             f"module doc); got {got}")


def layer_view(pool, layer):
    """One layer's pool as shape and dtype: `pool` itself (layer None, or no pool), else a row
    of a stacked pool [L, ...] (what the validators and tiling rules check). `layer` must be
    an integer scalar."""
    if layer is None or pool is None:
        return pool
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar (the row of the stacked pools), got "
                         f"{jnp.result_type(layer)}{list(jnp.shape(layer))}")
    if pool.ndim < 2:
        raise ValueError(f"with layer given, the pools are stacked [L, K, ...]; got {pool.shape}")
    return jax.ShapeDtypeStruct(pool.shape[1:], pool.dtype)


def layer_row(layer) -> jax.Array:
    """i32[1]: the layer's row of stacked pools as the kernels take it (0 when unstacked)."""
    return jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))


def layer_of(pool, layer):
    """Row `layer` of a stacked pool (the references' plain read); `pool` itself for None."""
    return pool if layer is None or pool is None else pool[layer]


def dequantize_pages(pages: jax.Array, scales: jax.Array | None) -> jax.Array:
    """f32 of gathered pages [..., page_size, H] with their scale rows [..., W] (`page_scales`;
    None: float pages)."""
    pages = pages.astype(jnp.float32)
    if scales is None:
        return pages
    return pages * scales[..., :pages.shape[-2], None]


def tree_depths(tree_mask: jax.Array) -> jax.Array:
    """i32[B, T]: each tree query's depth, popcount(its mask) - 1 (module doc)."""
    return jnp.sum(jax.lax.population_count(tree_mask), axis=-1).astype(jnp.int32) - 1


def tree_bit(words: Sequence[jax.Array], slot: jax.Array) -> jax.Array:
    """bool: bit `slot` of masks given as their W words (i32 arrays that broadcast against
    `slot`; slots outside [0, 32 W) are False). The word is picked by a chain of selects (W is
    small and static), so the kernels compute it the same way on their vectors."""
    index = jnp.clip(slot, 0, 32 * len(words) - 1)
    word = words[0]
    for w in range(1, len(words)):
        word = jnp.where(index >= 32 * w, words[w], word)
    bit = jax.lax.shift_right_logical(word, index & 31) & 1
    return (bit == 1) & (slot >= 0) & (slot < 32 * len(words))


def tree_visible(kv_pos, length, base, q_pos, words: Sequence[jax.Array],
                 sliding_window: int | None):
    """bool: whether a tree query at position q_pos whose mask words are `words` sees the key
    at kv_pos, in a sequence of `length` keys whose tree slots start at `base` (module doc);
    every argument broadcasts together."""
    context = kv_pos < base  # tree_bit is False there: no select of booleans (Mosaic)
    if sliding_window is not None:
        context &= kv_pos > q_pos - sliding_window
    return (context | tree_bit(words, kv_pos - base)) & (kv_pos < length)


def tree_rows(tree_mask: jax.Array, group: int) -> jax.Array:
    """i32[B, 1 + W, T * G]: for the kernels' query rows t * G + g, query t's depth, then its
    mask words (tree_mask: i32[B, T, W])."""
    cols = jnp.concatenate([tree_depths(tree_mask)[..., None], tree_mask], axis=-1)
    return jnp.repeat(jnp.swapaxes(cols, 1, 2), group, axis=2)


def sink_rows(sinks: jax.Array, num_tokens: int) -> jax.Array:
    """f32[K, num_tokens * G]: for the kernels' query rows t * G + g of each kv head, head
    (k, g)'s sink (sinks: f32[K, G], module doc)."""
    return jnp.tile(sinks.astype(jnp.float32), (1, num_tokens))


def query_base(lengths: jax.Array, num_queries: int, tree_base: jax.Array | None) -> jax.Array:
    """i32[B]: each row's first query position, lengths - T, or with tree queries the tree's
    slot 0 (module doc)."""
    return lengths - num_queries if tree_base is None else tree_base


def validate_tree(q, lengths, tree_mask, tree_base) -> None:
    """The tree arguments (module doc): both or neither, i32[B, T, W] and i32[B]."""
    if tree_mask is None and tree_base is None:
        return
    batch, t = q.shape[:2]
    if tree_mask is None or tree_base is None:
        raise ValueError("tree_mask and tree_base go together (tree queries); got only one")
    if tree_mask.ndim != 3 or tree_mask.shape[:2] != (batch, t) or tree_mask.dtype != jnp.int32:
        raise ValueError(f"tree_mask must be int32[B={batch}, T={t}, W] (ancestor bits of each "
                         f"query); got {tree_mask.dtype}{list(tree_mask.shape)}")
    if tree_base.shape != (batch,) or tree_base.dtype != jnp.int32:
        raise ValueError(f"tree_base must be int32[B={batch}]; got "
                         f"{tree_base.dtype}{list(tree_base.shape)}")


def validate_sinks(q, sinks) -> None:
    """Attention sinks (module doc): None, or f32[K, G] for q [B, T, K, G, H]."""
    if sinks is None:
        return
    want = tuple(q.shape[2:4])
    if tuple(sinks.shape) != want or sinks.dtype != jnp.float32:
        raise ValueError(f"sinks must be float32[K={want[0]}, G={want[1]}] (a logit per query "
                         f"head); got {sinks.dtype}{list(sinks.shape)}")


def attend_with_sinks(scores: jax.Array, mask: jax.Array, sinks: jax.Array | None
                      ) -> jax.Array:
    """Softmax weights of scores [..., S] (visible where `mask`; 0 elsewhere, and a row that
    sees no key all 0), with `sinks` (broadcast against scores[..., 0], or None) added to every
    row's denominator: exp(s_j) / (exp(sink) + sum_i exp(s_i)) (module doc)."""
    scores = jnp.where(mask, scores, -jnp.inf)
    if sinks is None:
        return jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)
    top = jnp.maximum(jnp.max(scores, axis=-1), sinks)[..., None]
    e = jnp.where(mask, jnp.exp(scores - top), 0.0)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sinks[..., None] - top))


def validate_inputs(q, k_pages, v_pages, lengths, page_table, k_scales=None,
                    v_scales=None) -> None:
    """Static checks with messages naming the bad shape and what would be valid."""
    if q.ndim != 5:
        raise ValueError(f"q must be [B, T, K, G, H], got shape {q.shape}")
    batch, _, num_k, _, head_dim = q.shape
    check_pages(q, k_pages, v_pages, num_k=num_k, head_dim=head_dim, k_scales=k_scales,
                v_scales=v_scales)
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
    k_scales: jax.Array | None = None,  # f32[K, groups, 8, W] with int8 pages (module doc)
    v_scales: jax.Array | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,  # i32[]: pools (and scales) stacked [L, ...], row `layer` read
    tree_mask: jax.Array | None = None,  # i32[B, T, W] tree queries' ancestor bits (module doc)
    tree_base: jax.Array | None = None,  # i32[B] position of each row's tree slot 0
    sinks: jax.Array | None = None,  # f32[K, G] each query head's sink logit (module doc)
) -> jax.Array:
    """Returns [B, T, K, G, H] in q.dtype; computed in f32, written plainly."""
    for x in (k_pages, v_pages, k_scales, v_scales):
        layer_view(x, layer)
    k_pages, v_pages, k_scales, v_scales = (layer_of(x, layer)
                                            for x in (k_pages, v_pages, k_scales, v_scales))
    k_pages, v_pages = unpack_pages(k_pages, q.shape[-1]), unpack_pages(v_pages, q.shape[-1])
    validate_inputs(q, k_pages, v_pages, lengths, page_table, k_scales, v_scales)
    validate_tree(q, lengths, tree_mask, tree_base)
    validate_sinks(q, sinks)
    batch, t, num_k, g, head_dim = q.shape
    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    span = page_table.shape[1] * page_size
    rows = jnp.clip(page_table, 0, num_pages - 1)
    k = dequantize_pages(k_pages[:, rows],
                         None if k_scales is None else page_scales(k_scales, rows))
    v = dequantize_pages(v_pages[:, rows],
                         None if v_scales is None else page_scales(v_scales, rows))
    k = k.reshape(num_k, batch, span, head_dim)
    v = v.reshape(num_k, batch, span, head_dim)
    kv_pos = jnp.arange(span)
    if tree_mask is None:
        q_pos = lengths[:, None] - t + jnp.arange(t)[None, :]  # [B, T]
        visible = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] <
                                                                  lengths[:, None, None])
        if sliding_window is not None:
            visible &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    else:
        q_pos = tree_base[:, None] + tree_depths(tree_mask)  # [B, T]
        words = [tree_mask[:, :, None, w] for w in range(tree_mask.shape[-1])]
        visible = tree_visible(kv_pos[None, None, :], lengths[:, None, None],
                               tree_base[:, None, None], q_pos[:, :, None], words,
                               sliding_window)
    live = kv_pos[None, :] < lengths[:, None]  # [B, S]
    if sliding_window is not None:  # keys behind every query's window: pages maybe not held
        live &= kv_pos[None, :] > jnp.min(q_pos, axis=1, keepdims=True) - sliding_window
    v = jnp.where(live[None, :, :, None], v, 0.0)
    scores = jnp.einsum("BTKGH,KBSH->BKGTS", q.astype(jnp.float32), k) / jnp.sqrt(
        jnp.float32(head_dim))
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = visible[:, None, None]  # [B, 1, 1, T, S]
    probs = attend_with_sinks(scores, mask, None if sinks is None else sinks[None, :, :, None])
    out = jnp.einsum("BKGTS,KBSH->BTKGH", probs, v)
    return out.astype(q.dtype)
