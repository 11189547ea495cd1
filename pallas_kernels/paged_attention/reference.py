"""Plain-jnp oracle of paged decode attention, and the input validator every kernel shares.

Layout (DESIGN.md decision 3): one layer's pool `k_pages, v_pages: [K, num_pages, page_size, H]`;
`page_table: i32[B, P]` page ids of each sequence in order; `lengths: i32[B]` tokens in the cache
per sequence *including* the T new tokens whose queries are given (they were written first).
Query t of sequence b sits at position lengths[b] - T + t and sees keys at positions
<= its own (causal among the T new tokens: T = 1 for decode, R + 1 for speculative verification),
and with a sliding window only keys > position - window. Pages past a sequence's length are never
read into the result (tests fill them with NaN).

Quantized pages: int8 `k_pages, v_pages` come with `k_scales, v_scales: f32[K, num_pages, 1,
W]`, one scale per stored token and kv head in lanes 0..page_size-1 of the page's row (W =
page_size, or on TPU `scale_width(page_size)`, lanes past page_size unused); key/value s of head
k is `pages[k, page, off, :] * scales[k, page, 0, off]`. Float pages take no scales. Every
kernel dequantizes only the tiles it loads (the scales are per key, so a kernel may equally
apply them to the key columns of its score / probability tile).

Lane-packed pages: float pages with H under 128 (H dividing 128) may come as `[K, num_pages,
page_size * H / 128, 128]`, the row-major reshape of the same array: row r of a page holds its
128 / H tokens r * 128 / H.. side by side along lanes (`pack_pages`). XLA:TPU stores a
[.., page_size, 64] array pages-minor (the least padding), which the Mosaic kernels cannot read,
and would relay each layer's pool out before every call; the packed array is row-major as
stored. The TPU kernels read packed pages as they are; the reference and the GPU kernels view
them as [K, num_pages, page_size, H] (`unpack_pages`: free in a row-major layout).

Why a page's scales are a [1, W] row of whole 128-lane tiles on TPU: XLA:TPU stores an array in
the layout that pads it least, and a [K, pages, page_size] f32 array with page_size under 128
(or K small) goes pages-minor, which the Mosaic kernels (row-major operands) cannot read: XLA
would relay every layer's scales out before each call and back after the write. [K, pages, 1,
W] with W a multiple of 128 is already unpadded in row-major (1, 128) tiles, so XLA keeps it
row-major; a DMA moves whole 512-byte runs, so a page's scales are fetched as one whole row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PAGE_DTYPES = ("float32", "bfloat16", "int8")  # int8: with k_scales / v_scales
LANES = 128  # a TPU vector register's lanes: the minor tile of every TPU array


def scale_width(page_size: int) -> int:
    """The minor dim of a TPU pool's scales: page_size rounded up to whole 128-lane tiles."""
    return -(-page_size // LANES) * LANES


def packing(pages_shape, head_dim: int) -> int:
    """Tokens per stored row of pages [K, num_pages, rows, lanes] holding H = head_dim: 1, or
    lanes / H for lane-packed pages (module doc)."""
    lanes = pages_shape[-1]
    if lanes == head_dim:
        return 1
    if lanes != LANES or LANES % head_dim:
        raise ValueError(f"pages {tuple(pages_shape)} hold neither H={head_dim} nor lane-packed "
                         f"H={head_dim} tokens (minor dim {LANES}, H dividing {LANES})")
    return LANES // head_dim


def pack_pages(pages: jax.Array) -> jax.Array:
    """[K, num_pages, page_size, H] -> lane-packed [K, num_pages, page_size * H / 128, 128]."""
    k, n, page_size, head_dim = pages.shape
    per = packing((LANES,), head_dim)
    if page_size % per:
        raise ValueError(f"page_size={page_size} must be a multiple of {per} to pack H="
                         f"{head_dim} tokens {per} to a {LANES}-lane row")
    return pages.reshape(k, n, page_size // per, LANES)


def unpack_pages(pages: jax.Array, head_dim: int) -> jax.Array:
    """Pages [K, num_pages, rows, lanes] (lane-packed or not) as [K, num_pages, page_size, H]."""
    per = packing(pages.shape, head_dim)
    if per == 1:
        return pages
    return pages.reshape(*pages.shape[:2], pages.shape[2] * per, head_dim)


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
    want = tuple(k_pages.shape[:3])
    widths = (want[2], scale_width(want[2]))
    for name, x in zip(("k_scales", "v_scales"), scales):
        if x is None or x.ndim != 4 or tuple(x.shape[:3]) != (*want[:2], 1) or \
                x.shape[3] not in widths or x.dtype != jnp.float32:
            got = None if x is None else f"{x.dtype}{list(x.shape)}"
            raise ValueError(f"int8 pages need {name} float32{[*want[:2], 1, want[2]]} or "
                             f"float32{[*want[:2], 1, widths[1]]} (one scale per token and kv "
                             f"head, module doc); got {got}")


def dequantize_pages(pages: jax.Array, scales: jax.Array | None) -> jax.Array:
    """f32 of gathered pages [..., page_size, H] with their scales [..., 1, W] (module doc;
    None: float pages)."""
    pages = pages.astype(jnp.float32)
    if scales is None:
        return pages
    return pages * scales[..., 0, :pages.shape[-2], None]


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
    k_scales: jax.Array | None = None,  # f32[K, num_pages, 1, W] with int8 pages (module doc)
    v_scales: jax.Array | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Returns [B, T, K, G, H] in q.dtype; computed in f32, written plainly."""
    k_pages, v_pages = unpack_pages(k_pages, q.shape[-1]), unpack_pages(v_pages, q.shape[-1])
    validate_inputs(q, k_pages, v_pages, lengths, page_table, k_scales, v_scales)
    batch, t, num_k, g, head_dim = q.shape
    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    span = page_table.shape[1] * page_size
    rows = jnp.clip(page_table, 0, num_pages - 1)
    k = dequantize_pages(k_pages[:, rows], None if k_scales is None else k_scales[:, rows])
    v = dequantize_pages(v_pages[:, rows], None if v_scales is None else v_scales[:, rows])
    k = k.reshape(num_k, batch, span, head_dim)
    v = v.reshape(num_k, batch, span, head_dim)
    kv_pos = jnp.arange(span)
    q_pos = lengths[:, None] - t + jnp.arange(t)[None, :]  # [B, T]
    visible = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] <
                                                              lengths[:, None, None])
    if sliding_window is not None:
        visible &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    live = kv_pos[None, :] < lengths[:, None]  # [B, S]
    if sliding_window is not None:  # keys behind every query's window: pages maybe not held
        live &= kv_pos[None, :] > q_pos[:, :1] - sliding_window
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
