"""Grouped matmul (the experts of a mixture of experts): reference (jnp), input validator, the
TPU (Mosaic) kernel that reads each non-empty expert's weight once, and XLA's forms over the
non-empty groups only (CPU, GPU); `grouped_matmul` picks per backend."""

from pallas_kernels.grouped_matmul.dispatch import grouped_matmul
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference, validate_inputs
from pallas_kernels.grouped_matmul.tpu import grouped_matmul_tpu, tile_sizes, traffic_bytes
from pallas_kernels.grouped_matmul.xla import grouped_matmul_xla

__all__ = ["grouped_matmul", "grouped_matmul_reference", "grouped_matmul_tpu",
           "grouped_matmul_xla", "tile_sizes", "traffic_bytes", "validate_inputs"]
