"""The model's quantized projection on TPU (`quant.einsum` traced under the TPU mesh: the Pallas
kernel `pallas_kernels.quant_matmul` up to `quant_tpu.KERNEL_MAX_ROWS` rows) by rows: XLA's
bytes accessed of x bf16[rows, 4096] @ w[4096, 14336] (the output axis split over 4 chips)
compiled for a TPU topology without one, per weight layout, against bf16 at the same rows, with
the arguments and temporaries.

  python scripts/experiments/quant_kernel_rows.py --rows=8,64,256

Prints a table, then one JSON line.

Reproduces docs/benchmarks.md, "Quantized weights on TPU (deviceless)": one projection by rows
and weight layout (the kernel up to 256 rows, XLA's dot at 512).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from absl import app, flags  # noqa: E402
from tpu_costs import projection_costs  # noqa: E402  (this directory)

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["8", "64", "256"], "Activation rows.")
flags.DEFINE_list("layouts", ["int8", "int4:128"], "Weight layouts: int8 (per channel), "
                  "int8:G or int4:G (groups of G; int4 native 4-bit, as placed on a TPU).")
flags.DEFINE_string("target", "v5e:2x2", "TPU topology (4 chips).")

def main(argv) -> int:
    del argv
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(FLAGS.target, platform="tpu")
    mesh = topologies.make_mesh(topo, (4,), ("model",))
    results = []
    for rows in (int(r) for r in FLAGS.rows):
        base = projection_costs(mesh, rows, None)
        for layout in FLAGS.layouts:
            r = projection_costs(mesh, rows, layout)
            results.append({"rows": rows, "layout": layout, "bf16": base, **r})
    mb = lambda b: f"{b / 1e6:.1f}"  # noqa: E731
    print("| rows | weights | bytes accessed MB | bf16 MB | vs bf16 | args MB | args vs bf16 "
          "| temp MB |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        b = r["bf16"]
        print(f"| {r['rows']} | {r['layout']} | {mb(r['bytes_accessed'])} | "
              f"{mb(b['bytes_accessed'])} | {b['bytes_accessed'] / r['bytes_accessed']:.2f}x | "
              f"{mb(r['argument_bytes'])} | {b['argument_bytes'] / r['argument_bytes']:.2f}x | "
              f"{mb(r['temp_bytes'])} |")
    print(json.dumps({"target": FLAGS.target, "results": results}))
    return 0


if __name__ == "__main__":
    app.run(main)
