"""What XLA:TPU's cost analysis counts for a row gather of an embedding table (deviceless v5e):
the table alone, vocab-sharded over "model" on a 2x2 mesh, and gathered beside a dot that reads
the whole table (a tied LM head). Prints the table's bytes per chip and XLA's bytes accessed.

  python scripts/experiments/tpu_gather_cost.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

VOCAB, DIM, ROWS = 128256, 2048, 4  # Llama 3.2 1B's embedding, a decode step's rows


def _bytes_accessed(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


def main() -> None:
    topo = topologies.get_topology_desc("v5e:2x2", platform="tpu")
    mesh = topologies.make_mesh(topo, (2, 2), ("data", "model"))
    whole = NamedSharding(mesh, P())
    rows = jax.ShapeDtypeStruct((ROWS,), jnp.int32, sharding=whole)
    x = jax.ShapeDtypeStruct((ROWS, DIM), jnp.bfloat16, sharding=whole)

    def gather(t, i):
        return t[i].astype(jnp.bfloat16)

    def tied(t, i, x):
        return gather(t, i), jnp.einsum("nd,vd->nv", x, t.astype(jnp.bfloat16),
                                        preferred_element_type=jnp.float32)

    print(f"{'table':>8} {'program':>22} {'table MB/chip':>14} {'bytes accessed MB':>18}")
    for dtype in (jnp.int8, jnp.bfloat16):
        table = jax.ShapeDtypeStruct((VOCAB, DIM), dtype,
                                     sharding=NamedSharding(mesh, P("model", None)))
        per_chip = VOCAB // 2 * DIM * jnp.dtype(dtype).itemsize / 1e6
        with jax.set_mesh(mesh):
            for name, fn, args in (("gather", gather, (table, rows)),
                                   ("gather + tied head", tied, (table, rows, x))):
                print(f"{jnp.dtype(dtype).name:>8} {name:>22} {per_chip:14.1f} "
                      f"{_bytes_accessed(fn, *args) / 1e6:18.3f}")


if __name__ == "__main__":
    main()
