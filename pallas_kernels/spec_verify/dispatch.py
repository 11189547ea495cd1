"""`spec_verify`: the oracle or the kernel for the backend it is traced for.

impl="xla" -> `spec_verify_reference`; impl="pallas" -> the Mosaic kernel on TPU, the Triton
kernel on GPU, and the Triton kernel in interpret mode on CPU (slow; for checking the kernel
path end to end). Lowering is per platform (one export for several platforms fails on their
compiler params).
"""

from __future__ import annotations

import jax

from pallas_kernels.platform import traced_backend
from pallas_kernels.spec_verify.gpu import spec_verify_gpu
from pallas_kernels.spec_verify.reference import spec_verify_reference
from pallas_kernels.spec_verify.tpu import spec_verify_tpu


def spec_verify(
    target_logits: jax.Array,  # f32[B, T, V], T = R + 1; padding positions may be NaN
    draft_ids: jax.Array,  # i32[B, R]
    draft_probs: jax.Array | None,  # f32[B, R, V] or None (one-hot drafter)
    num_draft: jax.Array,  # i32[B] in [0, R]
    temperature: jax.Array,  # f32[B], 0 = greedy
    uniforms: jax.Array,  # f32[B, R + 1] in [0, 1)
    *,
    impl: str = "pallas",
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(num_accepted i32[B], next_token i32[B]); semantics in `reference.py`."""
    args = (target_logits, draft_ids, draft_probs, num_draft, temperature, uniforms)
    if impl == "xla":
        return spec_verify_reference(*args)
    if impl != "pallas":
        raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
    backend = backend or traced_backend()
    if backend == "tpu":
        return spec_verify_tpu(*args)
    if backend in ("gpu", "cuda"):
        return spec_verify_gpu(*args)
    if backend == "cpu":
        return spec_verify_gpu(*args, interpret=True)
    raise ValueError(f"no spec_verify kernel for backend {backend!r}; valid: tpu, gpu, cuda, "
                     "cpu (interpret mode)")
