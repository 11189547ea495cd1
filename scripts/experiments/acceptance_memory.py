"""How much memory does the speculative acceptance take on a TPU? `steps.verify_sample` alone
(the verify step's sampling program: penalties, filters, the acceptance kernel) compiled
deviceless for v5e:2x2 on several meshes, slot counts and draft widths at 8B's vocabulary;
prints XLA's temporaries per chip in units of one f32 [B, R + 1, V] distribution, the numbers
behind `jaxinfer.perf.planner`'s ACCEPTANCE_SPLIT_COPIES.

  python scripts/experiments/acceptance_memory.py

Reproduces docs/benchmarks.md, "Whole-engine compile check": the acceptance temporaries table.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxinfer.engine import steps  # noqa: E402
from jaxinfer.engine.sampling import SamplingParams  # noqa: E402

VOCAB = 128256  # Llama 3.x
CASES = [(2, 2, 60, 4), (1, 4, 60, 4), (4, 1, 60, 4), (2, 2, 30, 4), (2, 2, 60, 2)]


def temporaries(data: int, model: int, slots: int, drafts: int) -> int:
    """XLA's temporary bytes per chip of verify_sample (Pallas acceptance kernel)."""
    topo = topologies.get_topology_desc("v5e:2x2", platform="tpu")
    mesh = topologies.make_mesh(topo, (data, model), ("data", "model"))

    def arg(shape, dtype, spec=None):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or P()))

    b, v, split = slots, VOCAB, P(None, "model")
    state = steps.SlotState(tokens=arg((b,), jnp.int32), active=arg((b,), bool),
                            output_counts=arg((b, v), jnp.int32, split),
                            seen=arg((b, v), bool, split))
    row = {"top_k": jnp.int32, "seed": jnp.int32}
    sampling = SamplingParams(**{name: arg((b,), row.get(name, jnp.float32)) for name in (
        "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "seed")})
    batch = steps.VerifyBatch(page_table=arg((b, 128), jnp.int32), active=arg((b,), bool),
                              pos=arg((b,), jnp.int32), draft_ids=arg((b, drafts), jnp.int32),
                              num_draft=arg((b,), jnp.int32))
    logits = arg((b, drafts + 1, v), jnp.float32, P(None, None, "model"))
    allowed = arg((b, drafts + 1, -(-v // 32)), jnp.int32)
    with jax.set_mesh(mesh):
        compiled = steps.verify_sample.trace(state, sampling, batch, None, logits, allowed,
                                             kernel="pallas").lower().compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    print("| mesh | slots | R | temp MiB | / whole f32[B,R+1,V] | split copies besides one whole |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for data, model, slots, drafts in CASES:
        temp = temporaries(data, model, slots, drafts)
        unit = 4 * slots * (drafts + 1) * VOCAB
        print(f"| data:{data} x model:{model} | {slots} | {drafts} | {temp / 2**20:.1f} | "
              f"{temp / unit:.3f} | {(temp / unit - 1) * model:.1f} |", flush=True)


if __name__ == "__main__":
    main()
