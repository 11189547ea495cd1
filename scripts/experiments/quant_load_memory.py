"""Peak host memory of a quantized load of the default model, above the post-import baseline:
`load_model` then `split_model` onto the default device, in a fresh process.

  python scripts/experiments/quant_load_memory.py int8

Reproduces docs/benchmarks.md, "Quantized weights": peak host memory while loading.
"""

import resource
import sys

import jax

from jaxinfer.checkpoint.loading import load_model
from jaxinfer.config import RunConfig
from jaxinfer.engine import steps


def main(weight_dtype: str) -> None:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    model, _ = load_model(RunConfig(dtype="float32", weight_dtype=weight_dtype))
    _, params = steps.split_model(model, None)
    jax.block_until_ready(params)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"{weight_dtype}: weights on device {weights / 1e6:.1f} MB, peak host memory while "
          f"loading +{(peak - base) * 1024 / 1e6:.0f} MB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "int8")
