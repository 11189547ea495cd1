"""`grouped_matmul`: one entry point that picks the implementation for the backend it is traced
for.

TPU -> the Mosaic kernel (`tpu.py`) when the weight tiles (`tpu.tile_sizes`) and is not in the
u8-packed int4 layout (a CPU layout), else XLA's tile loop; CPU and GPU -> XLA's forms
(`xla.py`; `xla.form_for` picks per backend and shape). Lowering is per platform
(`pallas_kernels.platform.traced_backend`).
"""

from __future__ import annotations

import jax

from pallas_kernels.grouped_matmul.reference import packed_int4, validate_inputs
from pallas_kernels.grouped_matmul.tpu import grouped_matmul_tpu, tile_sizes
from pallas_kernels.grouped_matmul.xla import form_for, grouped_matmul_xla
from pallas_kernels.platform import traced_backend

BACKENDS = ("tpu", "gpu", "cuda", "rocm", "cpu")


def grouped_matmul(
    x: jax.Array,  # [M, K] f32 or bf16, rows sorted by group
    w: jax.Array,  # [E, K, N] or [E, C, K, N] float, or quantized (reference.py)
    group_sizes: jax.Array,  # i32[E] rows of each group, summing to <= M
    *,
    scale: jax.Array | None = None,  # f32[E, (C,) 1, N] per channel, [E, (C,) K / group, N]
    zero: jax.Array | None = None,  # f32[E, (C,) K / group, N] groups
    group: int = 0,
    offset: int = 0,
    preferred_element_type=None,
    cost_groups: int | None = None,
    layer: jax.Array | int | None = None,  # i32[]: w, scale, zero are stacks [L, ...]
    backend: str | None = None,
) -> jax.Array:
    """Rows [start_e, start_e + group_sizes[e]) of x times expert e's weight, for every e:
    [M, N] ([C, M, N] for C blocks: block c's product at [c]) in
    `preferred_element_type` (default x.dtype), f32 accumulation; rows past
    group_sizes.sum() are unspecified (drop them by index: they may hold NaN). Only the experts
    with rows are read. `cost_groups`: the non-empty experts the TPU kernel's declared cost
    counts (`tpu.py`; default min(E, M)). `layer`: the weight and its fields are stacks of
    which row `layer` is this call's (a scanned layer's experts): the TPU kernel reads the row
    where it lies, XLA's forms take it first (XLA:CPU and XLA:GPU copy a scanned layer's
    weights out anyway). `backend`: default the platform traced for."""
    backend = backend or traced_backend()
    if backend not in BACKENDS:
        raise ValueError(f"no grouped matmul for backend {backend!r}; valid: {BACKENDS}")
    row = [None if a is None else jax.ShapeDtypeStruct(a.shape[layer is not None:], a.dtype)
           for a in (w, scale, zero)]
    validate_inputs(x, row[0], group_sizes, scale=row[1], zero=row[2], group=group)
    kwargs = dict(group=group, offset=offset, preferred_element_type=preferred_element_type)
    if backend == "tpu" and not packed_int4(x, row[0]) and tile_sizes(
            x.shape[0], x.shape[1], w.shape[-1], row[0].shape[0], x_dtype=x.dtype,
            w_dtype=w.dtype, out_dtype=preferred_element_type, group=group) is not None:
        return grouped_matmul_tpu(x, w, group_sizes, scale=scale, zero=zero, layer=layer,
                                  cost_groups=cost_groups, **kwargs)
    if layer is not None:
        w, scale, zero = (None if a is None else jax.lax.dynamic_index_in_dim(
            a, layer, keepdims=False) for a in (w, scale, zero))
    return grouped_matmul_xla(x, w, group_sizes, scale=scale, zero=zero,
                              form=form_for(backend, x.shape[0], w.shape[0]), **kwargs)
