"""`ragged_paged_attention`: one entry point that picks the kernel for the backend it is traced
for, as `pallas_kernels.paged_attention.dispatch` does for decode: TPU -> Mosaic, GPU -> Triton,
CPU -> the Triton kernel in interpret mode (how CPU tests run the kernel path end to end)."""

from __future__ import annotations

import jax

from pallas_kernels.platform import traced_backend
from pallas_kernels.ragged_attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_attention.tpu import ragged_paged_attention_tpu


def ragged_paged_attention(
    q: jax.Array,  # [N, K, G, H] flat query rows
    k_pages: jax.Array,  # [K, num_pages, page_size, H]
    v_pages: jax.Array,  # [K, num_pages, page_size, H]
    kv_lens: jax.Array,  # i32[S] cache length of each sequence including its new tokens
    page_table: jax.Array,  # i32[S, P]
    q_starts: jax.Array,  # i32[S] first flat row of each sequence (ascending, disjoint)
    q_lens: jax.Array,  # i32[S] new query tokens of each sequence
    *,
    k_scales: jax.Array | None = None,  # f32[K, groups, 8, W] with int8 pages
    v_scales: jax.Array | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,  # i32[]: pools (and scales) stacked [L, ...], row `layer` read
    sinks: jax.Array | None = None,  # f32[K, G] each query head's sink logit
    backend: str | None = None,
) -> jax.Array:
    """Ragged paged attention on `backend` (default: the platform traced for,
    `traced_backend`). [N, K, G, H]."""
    backend = backend or traced_backend()
    args = (q, k_pages, v_pages, kv_lens, page_table, q_starts, q_lens)
    kwargs = dict(k_scales=k_scales, v_scales=v_scales, soft_cap=soft_cap,
                  sliding_window=sliding_window, layer=layer, sinks=sinks)
    if backend == "tpu":
        return ragged_paged_attention_tpu(*args, **kwargs)
    if backend in ("gpu", "cuda"):
        return ragged_paged_attention_gpu(*args, **kwargs)
    if backend == "cpu":
        return ragged_paged_attention_gpu(*args, interpret=True, **kwargs)
    raise ValueError(f"no ragged paged attention kernel for backend {backend!r}; "
                     "valid: tpu, gpu, cpu (interpret mode)")
