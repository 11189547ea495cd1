"""Which layout does XLA:TPU give a KV pool array, and does the write reach it in place? For
each candidate shape of one layer's pool part (per chip, 70B int8 on v5e-16 and 1B on v5e:2x2
sizes), compiled deviceless for one v5e chip: the layout XLA:TPU assigns a donated input of that
shape (what the engine's steps receive), whether it is row-major (minor-to-major 3,2,1,0: what
the Mosaic kernels take as operands, so anything else is relaid out before each call), and the
relayout copies of the whole array around an in-place write of one token per slot (112 slots;
scale arrays: one f32 per token, values: one row) and their bytes accessed. The numbers behind
the layouts in `jaxinfer.model.kv_quant` and `pallas_kernels.paged_attention.reference`.

  python scripts/experiments/tpu_pool_layouts.py
"""

from __future__ import annotations

import os
import re
import sys
from math import prod

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

SLOTS = 112
PAGES = 14337  # one data part of 70B int8's v5e-16 pool, its trash page included
# (what, shape, dtype, the write: token (page, offset) -> index of its scale or value row, or
# "per head": one scatter per kv head)
CASES = [
    ("scales [K, pages, page]", (1, PAGES, 32), jnp.float32, lambda p, o: (p, o)),
    ("scales [K, pages, 1, 128]", (1, PAGES, 1, 128), jnp.float32, lambda p, o: (p, 0, o)),
    ("scales [K, pages, 128]", (1, PAGES, 128), jnp.float32, lambda p, o: (p, o)),
    ("scales [K, pages/8, 8, 128]", (1, -(-PAGES // 8), 8, 128), jnp.float32,
     lambda p, o: (p // 8, p % 8, o)),
    ("scales [K, pages/8, 8, 128], K=2", (2, -(-PAGES // 8), 8, 128), jnp.float32,
     lambda p, o: (p // 8, p % 8, o)),
    ("scales [K, pages/8, 8, 128], K=2, a write per kv head", (2, -(-PAGES // 8), 8, 128),
     jnp.float32, "per head"),
    ("int8 values [K, pages, 32, 128]", (1, PAGES, 32, 128), jnp.int8, lambda p, o: (p, o)),
    ("bf16 values H=64 [K, pages, 32, 64]", (2, 4097, 32, 64), jnp.bfloat16,
     lambda p, o: (p, o)),
    ("bf16 values H=64 packed [K, pages, 16, 128]", (2, 4097, 16, 128), jnp.bfloat16,
     lambda p, o: (p, o // 2)),
]


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \(?(\w+)\[([\d,]*)\]\S* ([\w\-]+)\(")
_BYTES = {"f32": 4, "bf16": 2, "s8": 1}


def relayouts(hlo: str, array_bytes: int) -> int:
    """Copies (plain, asynchronous, or fused with a bitcast) of at least half the array."""
    count = 0
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if not m or m.group(2) not in _BYTES:
            continue
        name, dtype, dims, opcode = m.groups()
        size = _BYTES[dtype] * prod(int(d) for d in dims.split(",") if d)
        is_copy = opcode in ("copy", "copy-start") or name.startswith("copy_bitcast_fusion")
        count += is_copy and 2 * size >= array_bytes
    return count


def main() -> None:
    topo = topologies.get_topology_desc("v5e:2x2", platform="tpu")
    sharding = SingleDeviceSharding(topo.devices[0])

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    print("| array | shape | XLA:TPU layout (minor to major, tiling) | row-major | relayout "
          "copies around a write | write bytes accessed |")
    print("| --- | --- | --- | --- | ---: | ---: |")
    for what, shape, dtype, index in CASES:
        scalar_rows = dtype == jnp.float32  # a scale per token; values: a row per token
        new_shape = (shape[0], SLOTS) if scalar_rows else (shape[0], SLOTS, shape[-1])

        def write(x, page, off, new, index=index, scalar_rows=scalar_rows):
            if index == "per head":  # `attention._write_scales` with several kv heads a chip
                for k in range(x.shape[0]):
                    x = x.at[k, page // 8, page % 8, off].set(new[k], mode="promise_in_bounds")
                return x
            at = index(page, off)
            if scalar_rows:
                return x.at[(slice(None), *at)].set(new, mode="promise_in_bounds")
            return x.at[(slice(None), *at)].set(new.astype(x.dtype)[..., :x.shape[-1]],
                                                mode="promise_in_bounds")

        args = (sds(shape, dtype), sds((SLOTS,), jnp.int32), sds((SLOTS,), jnp.int32),
                sds(new_shape, jnp.float32))
        compiled = jax.jit(write, donate_argnums=0).lower(*args).compile()
        layout = compiled.input_formats[0][0].layout
        m2m = tuple(reversed(layout.major_to_minor))
        dims = "x".join(map(str, shape))
        copies = relayouts(compiled.as_text(), int(jnp.dtype(dtype).itemsize * prod(shape)))
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        print(f"| {what} | {dtype.__name__}[{dims}] | {{{','.join(map(str, m2m))}}} "
              f"T{layout.tiling[0]} | {'yes' if m2m == tuple(range(len(shape)))[::-1] else 'no'}"
              f" | {copies} | {cost['bytes accessed'] / 1e6:.2f} MB |")


if __name__ == "__main__":
    main()
