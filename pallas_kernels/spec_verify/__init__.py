"""Speculative verification (Chen et al. 2023): reference (jnp), validator, TPU / GPU kernels."""

from pallas_kernels.spec_verify.dispatch import spec_verify
from pallas_kernels.spec_verify.reference import spec_verify_reference, validate_inputs

__all__ = ["spec_verify", "spec_verify_reference", "validate_inputs"]
