"""Weight-only quantized matmul for decode-sized rows: reference (jnp), input validator, and the
TPU (Mosaic) kernel that reads each stored weight tile from HBM once."""

from pallas_kernels.quant_matmul.reference import quantized_matmul_reference, validate_inputs
from pallas_kernels.quant_matmul.tpu import quantized_matmul, tile_sizes, traffic_bytes

__all__ = ["quantized_matmul", "quantized_matmul_reference", "tile_sizes", "traffic_bytes",
           "validate_inputs"]
