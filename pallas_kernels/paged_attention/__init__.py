"""Paged decode attention: reference (jnp), input validator, and TPU (Mosaic) / GPU kernels."""

from pallas_kernels.paged_attention.dispatch import paged_decode_attention
from pallas_kernels.paged_attention.reference import (
    paged_decode_attention_reference,
    validate_inputs,
)

__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "validate_inputs"]
