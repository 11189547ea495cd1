"""The CPU (XLA) path's cost of one layer's KV write + paged attention: a decode step of 8 slots
at position 1000 (64 pages of 16 read), 3 kv heads x 3 query heads of dim 64 (SmolLM2-135M's
shapes), jitted, the pool donated; prints the median and best of 5 timings of 50 steps.
`dtype`: bfloat16 or int8 (the pool's layout as `kv_quant.make_pool` builds it off TPU).

  python scripts/experiments/kv_write_attend_cpu.py int8
"""

from __future__ import annotations

import functools
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer.model.attention import paged_attention_reference, write_kv  # noqa: E402
from jaxinfer.model.kv_quant import make_pool  # noqa: E402

K, G, H, PAGE, SLOTS, PAGES = 3, 3, 64, 16, 8, 64


def main(dtype: str) -> None:
    shape = (K, SLOTS * PAGES + 1, PAGE, H)
    k_pages, v_pages = make_pool(shape, dtype), make_pool(shape, dtype)
    table = jnp.arange(SLOTS * PAGES, dtype=jnp.int32).reshape(SLOTS, PAGES)
    pos = jnp.full((SLOTS, 1), 1000, jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(k_pages, v_pages, q, k, v):
        pages = table[jnp.arange(SLOTS), pos[:, 0] // PAGE]
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, pages, pos[:, 0] % PAGE,
                                    jnp.ones(SLOTS, bool))
        out = paged_attention_reference(q, k_pages, v_pages, table, pos, pos[:, 0] + 1,
                                        num_pages_read=PAGES)
        return out, k_pages, v_pages

    q = jnp.ones((SLOTS, 1, K, G, H), jnp.float32)
    k = v = jnp.ones((SLOTS, K, H), jnp.float32)
    out, k_pages, v_pages = step(k_pages, v_pages, q, k, v)
    jax.block_until_ready(out)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(50):
            out, k_pages, v_pages = step(k_pages, v_pages, q, k, v)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / 50 * 1e3)
    print(f"{dtype}: {np.median(times):.2f} ms per step (median of 5 x 50), best "
          f"{min(times):.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "int8")
