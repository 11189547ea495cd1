"""One 8B-shaped projection (x bf16[8, 4096] @ w[4096, 14336], int4 in groups of 128) compiled
for an H100 (sm_90a) without one (the compile-only CUDA plugin): the temporaries and the
fusions XLA GPU makes for native 4-bit stored as `jnp.uint4` or `jnp.int4`, with the scales
after a dot batched over the groups, dequantized before the dot, or a bare convert; and int8.

  PYTHONPATH=$PWD:/work/cudaplug JAX_PLATFORMS=cpu python scripts/experiments/int4_gpu_dot.py

Prints per variant the argument and temporary bytes and the first fusions of the program.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

D, F, ROWS, GROUP = 4096, 14336, 8, 128


def after(x, q, s, z):
    import jax.numpy as jnp

    n = D // GROUP
    xg = x.reshape(ROWS, n, GROUP)
    y = jnp.einsum("mng,ngo->mno", xg, q.reshape(n, GROUP, F).astype(x.dtype),
                   preferred_element_type=jnp.float32)
    return (jnp.einsum("mno,no->mo", y, s) + xg.astype(jnp.float32).sum(-1) @ z).astype(x.dtype)


def before(x, q, s, z):
    n = D // GROUP
    w = (q.reshape(n, GROUP, F).astype(x.dtype) * s[:, None].astype(x.dtype)
         + z[:, None].astype(x.dtype))
    return x @ w.reshape(D, F)


def convert(x, q, s, z):
    return x @ q.astype(x.dtype)


def main() -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxinfer.proof import aot

    mesh = aot.target_mesh(aot.resolve_target("gpu:h100"), "data:1,model:1")

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

    n = D // GROUP
    for name, fn, dtype in [("u4 after", after, jnp.uint4), ("s4 after", after, jnp.int4),
                            ("u4 before", before, jnp.uint4), ("s4 before", before, jnp.int4),
                            ("u4 convert", convert, jnp.uint4), ("s4 convert", convert, jnp.int4),
                            ("s8 convert", convert, jnp.int8)]:
        compiled = jax.jit(fn).lower(sds((ROWS, D), jnp.bfloat16), sds((D, F), dtype),
                                     sds((n, F), jnp.float32), sds((n, F), jnp.float32)).compile()
        mem = compiled.memory_analysis()
        print(f"{name}: arguments {mem.argument_size_in_bytes / 1e6:.1f} MB, temp "
              f"{mem.temp_size_in_bytes / 1e6:.1f} MB")
        fusions = [line.strip() for line in compiled.as_text().splitlines()
                   if line.startswith("  ") and " fusion(" in line]
        for line in fusions[:3]:
            print("   ", line[:150])


if __name__ == "__main__":
    main()
