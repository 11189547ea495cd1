"""The model's native int4 projection (`quant.einsum` on a `jnp.int4` weight, as placed on a
TPU) in both of its forms, by rows and group size: XLA's bytes accessed of x bf16[rows, 4096] @
w[4096, 14336] (the output axis split over 4 chips) compiled for TPU v5e without one, against
bf16 at the same rows, and the temporaries. Shows where the scales-after-dot form stops paying
(`quant.AFTER_DOT_ROWS_PER_GROUP`).

  python scripts/experiments/int4_einsum_rows.py --groups=32,128 --rows=8,64,256,512

Prints a table, then one JSON line.
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
flags.DEFINE_list("groups", ["32", "128"], "int4 group sizes.")
flags.DEFINE_list("rows", ["8", "64", "256", "512"], "Activation rows.")
flags.DEFINE_string("target", "v5e:2x2", "TPU topology (4 chips).")

def main(argv) -> int:
    del argv
    from jax.experimental import topologies

    from jaxinfer.model import quant

    topo = topologies.get_topology_desc(FLAGS.target, platform="tpu")
    mesh = topologies.make_mesh(topo, (4,), ("model",))
    rows_out = []
    default = quant.AFTER_DOT_ROWS_PER_GROUP
    for rows in (int(r) for r in FLAGS.rows):
        base = projection_costs(mesh, rows, None, mesh_context=False)
        for group in (int(g) for g in FLAGS.groups):
            for form, limit in (("after", 1 << 30), ("before", 0)):
                quant.AFTER_DOT_ROWS_PER_GROUP = limit
                r = projection_costs(mesh, rows, f"int4:{group}", mesh_context=False)
                rows_out.append({"rows": rows, "group": group, "form": form,
                                 "default": (form == "after") == (rows <= default * group),
                                 "vs_bf16": base["bytes_accessed"] / r["bytes_accessed"],
                                 "bf16": base, **r})
    quant.AFTER_DOT_ROWS_PER_GROUP = default
    print("| rows | group | form | bytes accessed MB | vs bf16 | args MB | temp MB | default |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows_out:
        print(f"| {r['rows']} | {r['group']} | {r['form']} | {r['bytes_accessed'] / 1e6:.1f} | "
              f"{r['vs_bf16']:.2f}x | {r['argument_bytes'] / 1e6:.1f} | "
              f"{r['temp_bytes'] / 1e6:.1f} | {'yes' if r['default'] else ''} |")
    print(json.dumps({"target": FLAGS.target, "results": rows_out}))
    return 0


if __name__ == "__main__":
    app.run(main)
