"""Speculative verification (Chen et al. 2023): reference (jnp), validator, TPU / GPU kernels;
draft trees' multi-draft rule (`tree.py`, jnp on every backend)."""

from pallas_kernels.spec_verify.dispatch import spec_verify
from pallas_kernels.spec_verify.reference import spec_verify_reference, validate_inputs
from pallas_kernels.spec_verify.tree import spec_verify_tree

__all__ = ["spec_verify", "spec_verify_reference", "spec_verify_tree", "validate_inputs"]
