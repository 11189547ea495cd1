"""What XLA:TPU's cost analysis counts for a row gather of an embedding table (deviceless v5e):
the table alone, vocab-sharded over "model" on a 2x2 mesh, and gathered beside a dot that reads
the whole table (a tied LM head). Prints the table's bytes per chip and XLA's bytes accessed.
With --whole_step MESH:WEIGHT_DTYPE (e.g. data:2,model:2:int8), also the compile check's decode
step of the Llama 3.2 1B preset (2 layers) at its vocabulary and at half of it: XLA's count and
the check's gathered-table and VMEM-staging corrections.

  python scripts/experiments/tpu_gather_cost.py [--whole_step=data:1,model:4:bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

VOCAB, DIM, ROWS = 128256, 2048, 4  # Llama 3.2 1B's embedding, a decode step's rows
# tests/test_aot.py's small engine (8 slots, pages of 32): the compile check's CI case
SMALL_RUN = {"engine.max_slots": 8, "cache.max_seq_len": 128, "cache.page_size": 32,
             "engine.prefill_buckets": [32], "engine.max_num_batched_tokens": 64}


def _bytes_accessed(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


def whole_step(mesh: str, weight_dtype: str) -> None:
    """The compile check's decode step at two vocabulary sizes (module doc)."""
    from jaxinfer.perf import planner
    from jaxinfer.proof import aot

    base = planner.MODEL_PRESETS["llama-3.2-1b"]
    for vocab in (base.vocab_size, base.vocab_size // 2):
        planner.MODEL_PRESETS["llama-3.2-1b"] = dataclasses.replace(base, vocab_size=vocab)
        run = aot.run_config(None, **{**SMALL_RUN, "mesh": mesh, "weight_dtype": weight_dtype})
        report = aot.check(aot.AotConfig(model="llama-3.2-1b", target="v5e:2x2", run=run,
                                         max_len=16, num_layers=2, decode_only=True,
                                         pages="largest"), log=lambda _: None)
        d = report.decode
        print(f"{mesh} {weight_dtype} vocab {vocab}: XLA counted {d.bytes_accessed / 1e6:.1f} MB,"
              f" gathered tables {d.gathered_table_bytes / 1e6:.1f} MB, staged "
              f"{d.staged_bytes / 1e6:.1f} MB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--whole_step", default="", help="MESH:WEIGHT_DTYPE")
    opts = parser.parse_args()
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
    if opts.whole_step:
        mesh_spec, weight_dtype = opts.whole_step.rsplit(":", 1)
        whole_step(mesh_spec, weight_dtype)


if __name__ == "__main__":
    main()
