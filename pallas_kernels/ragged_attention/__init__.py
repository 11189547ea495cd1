"""Ragged paged flash attention (a whole mixed step: decode, verification and prompt-chunk rows in
one call): reference (jnp), input validator, and TPU (Mosaic) / GPU (Triton) kernels."""

from pallas_kernels.ragged_attention.dispatch import ragged_paged_attention
from pallas_kernels.ragged_attention.reference import (
    ragged_paged_attention_reference,
    validate_inputs,
)

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "validate_inputs"]
