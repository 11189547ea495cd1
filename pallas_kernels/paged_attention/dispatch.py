"""`paged_decode_attention`: one entry point that picks the kernel for the backend it is traced for.

TPU -> the Mosaic kernel, GPU -> the Triton kernel, CPU -> the Triton kernel in interpret mode
(the way CPU tests run the kernel path end to end; it is slow and only for checking). Lowering is
per platform (a single export for several platforms fails on their compiler params).
"""

from __future__ import annotations

import jax

from pallas_kernels.paged_attention.gpu import paged_decode_attention_gpu
from pallas_kernels.paged_attention.tpu import paged_decode_attention_tpu
from pallas_kernels.platform import traced_backend


def paged_decode_attention(
    q: jax.Array,  # [B, T, K, G, H]
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array,  # [K, num_pages, page_size, H]
    lengths: jax.Array,  # i32[B] cache length including the T new tokens
    page_table: jax.Array,  # i32[B, P]
    *,
    k_scales: jax.Array | None = None,  # f32[K, groups, 8, W] with int8 pages
    v_scales: jax.Array | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,  # i32[]: pools (and scales) stacked [L, ...], row `layer` read
    tree_mask: jax.Array | None = None,  # i32[B, T, W] tree queries' ancestor bits (reference.py)
    tree_base: jax.Array | None = None,  # i32[B] position of each row's tree slot 0
    sinks: jax.Array | None = None,  # f32[K, G] each query head's sink logit (reference.py)
    backend: str | None = None,
) -> jax.Array:
    """Paged decode attention on `backend` (default: the platform traced for,
    `traced_backend`). [B, T, K, G, H]."""
    backend = backend or traced_backend()
    kwargs = dict(k_scales=k_scales, v_scales=v_scales, soft_cap=soft_cap,
                  sliding_window=sliding_window, layer=layer, tree_mask=tree_mask,
                  tree_base=tree_base, sinks=sinks)
    if backend == "tpu":
        return paged_decode_attention_tpu(q, k_pages, v_pages, lengths, page_table, **kwargs)
    if backend in ("gpu", "cuda"):
        return paged_decode_attention_gpu(q, k_pages, v_pages, lengths, page_table, **kwargs)
    if backend == "cpu":
        return paged_decode_attention_gpu(q, k_pages, v_pages, lengths, page_table,
                                          interpret=True, **kwargs)
    raise ValueError(f"no paged decode attention kernel for backend {backend!r}; "
                     "valid: tpu, gpu, cpu (interpret mode)")
