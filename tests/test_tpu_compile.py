"""The TPU kernel through the real XLA:TPU + Mosaic compilers, without a TPU.

libtpu (the `jax[tpu]` test extra) gives compile-only TPU devices for a topology; compiling catches
what lowering cannot: VMEM overflow, illegal in-kernel layouts. Production shapes (Llama-3-8B
heads, 8k context, bf16; int8 pages with their scales), decode (T = 1) and verification
(T = R + 1), inside `shard_map` over the topology's 4 chips with the kv heads sharded.
"""

import os

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels.paged_attention.reference import scale_width
from pallas_kernels.paged_attention.tpu import paged_decode_attention_tpu

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
SPECS = (P(None, None, "model"), P("model"), P("model"), P(), P())


def _with_scales(shapes: list, specs: tuple, pool: tuple, kv_dtype) -> tuple[list, tuple]:
    """`shapes` with the pool's two entries (1, 2) in `kv_dtype`, and for int8 the K and V
    scales f32[K, ceil(pages / 8), 8, scale_width(page_size)] appended (the TPU pool's layout,
    sharded by kv head like the pages)."""
    shapes = list(shapes)
    shapes[1] = shapes[2] = (pool, kv_dtype)
    if kv_dtype != jnp.int8:
        return shapes, specs
    scales = (pool[0], -(-pool[1] // 8), 8, scale_width(pool[2]))
    return shapes + [(scales, jnp.float32)] * 2, specs + (P("model"),) * 2


def _pool(num_k, pages, page_size, head_dim, lane_packed) -> tuple[int, ...]:
    """A pool's shape, lane-packed (`reference.pack_pages`) or not."""
    if lane_packed:
        return (num_k, pages, page_size * head_dim // 128, 128)
    return (num_k, pages, page_size, head_dim)


def _compile(topology: str, *, t=1, batch=8, num_k=8, g=4, head_dim=128, page_size=16,
             context=8192, dtype=jnp.bfloat16, kv_dtype=None, lane_packed=False,
             tree_words=0, **kernel_kwargs):
    """The decode kernel over `kv_dtype` pages (default `dtype`; int8: with scales;
    `lane_packed`: the TPU pool's layout for H under 128); `tree_words` > 0: its T queries a
    draft tree's, with ancestor masks of that many words."""
    topo = topologies.get_topology_desc(topology, platform="tpu")
    mesh = topologies.make_mesh(topo, (4,), ("model",))
    pages = context // page_size
    shapes = [((batch, t, num_k, g, head_dim), dtype), None, None,
              ((batch,), jnp.int32), ((batch, pages), jnp.int32)]
    shapes, specs = _with_scales(
        shapes, SPECS, _pool(num_k, batch * pages, page_size, head_dim, lane_packed),
        kv_dtype or dtype)
    num_tree = 2 if tree_words else 0  # tree_mask, tree_base: after the first five
    shapes[5:5] = [((batch, t, tree_words), jnp.int32), ((batch,), jnp.int32)][:num_tree]
    specs = specs[:5] + (P(),) * num_tree + specs[5:]
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec))
            for (s, d), spec in zip(shapes, specs)]

    def kernel(*a):
        trees = dict(zip(("tree_mask", "tree_base"), a[5:5 + num_tree]))
        scales = dict(zip(("k_scales", "v_scales"), a[5 + num_tree:]))
        return paged_decode_attention_tpu(*a[:5], **trees, **scales, **kernel_kwargs)

    f = jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=SPECS[0], check_vma=False)
    with jax.set_mesh(mesh):
        return jax.jit(f).trace(*args).lower().compile()


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("t", [1, 4])
def test_compiles_at_production_shape(topology, t):
    compiled = _compile(topology, t=t, pages_per_block=8)
    assert compiled.memory_analysis() is not None


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("t", [1, 4])
def test_int8_pages_compile_at_production_shape(topology, t):
    """int8 pages at int8's smallest TPU page (32 rows) with their f32 scales."""
    _compile(topology, t=t, page_size=32, kv_dtype=jnp.int8, pages_per_block=8)


@pytest.mark.parametrize("t", [1, 4])
def test_lane_packed_pages_compile_at_production_shape(t):
    """Llama-3.2-1B's H = 64 pages stored two tokens to a 128-lane row (page 32: 16 rows, whole
    bf16 tiles)."""
    _compile("v5e:2x2", t=t, head_dim=64, page_size=32, lane_packed=True, pages_per_block=8)


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_tree_queries_compile_at_production_shape(topology):
    """A draft tree's verification ("4,2,2,1": the root and 44 nodes, masks of 2 words) with a
    sliding window, over bf16 pages and over int8 pages."""
    _compile(topology, t=45, tree_words=2, sliding_window=4096, pages_per_block=8)
    _compile(topology, t=45, tree_words=2, page_size=32, kv_dtype=jnp.int8, pages_per_block=8)


def test_soft_cap_and_window_compile():
    _compile("v6e:2x2", soft_cap=30.0, sliding_window=4096)


def test_gemma3_shape_compiles():
    """Gemma 3's local layers: head dim 256, window 512 (kv heads 4 here, one per chip), the
    decode kernel and the ragged kernel over 8 decode rows and a 512-token chunk."""
    _compile("v6e:2x2", num_k=4, head_dim=256, sliding_window=512, pages_per_block=8)
    _compile_ragged("v6e:2x2", num_k=4, head_dim=256, sliding_window=512)


def test_oversized_vmem_block_fails_to_compile():
    """Proves the check can fail: 64 f32 pages of 512 tokens per block is 16 MiB per K/V buffer,
    64 MiB double-buffered, over the scoped VMEM limit."""
    with pytest.raises(Exception, match="(?i)vmem"):
        _compile("v5e:2x2", dtype=jnp.float32, context=32768, page_size=512, pages_per_block=64,
                 batch=1)


def _compile_ragged(topology: str, *, decode_rows=8, chunk=512, num_k=8, g=4, head_dim=128,
                    page_size=16, context=8192, dtype=jnp.bfloat16, kv_dtype=None,
                    lane_packed=False, **kernel_kwargs):
    """The ragged kernel over a mixed step at 8B shapes: `decode_rows` decode rows and a
    `chunk`-token prompt chunk, each sequence's table covering `context` tokens, over
    `kv_dtype` pages (default `dtype`; int8: with scales)."""
    from pallas_kernels.ragged_attention.tpu import ragged_paged_attention_tpu

    topo = topologies.get_topology_desc(topology, platform="tpu")
    mesh = topologies.make_mesh(topo, (4,), ("model",))
    seqs, pages = decode_rows + 1, context // page_size
    shapes = [((decode_rows + chunk, num_k, g, head_dim), dtype), None, None,
              ((seqs,), jnp.int32), ((seqs, pages), jnp.int32), ((seqs,), jnp.int32),
              ((seqs,), jnp.int32)]
    specs = (P(None, "model"), P("model"), P("model"), P(), P(), P(), P())
    shapes, specs = _with_scales(
        shapes, specs, _pool(num_k, seqs * pages + 1, page_size, head_dim, lane_packed),
        kv_dtype or dtype)
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec))
            for (s, d), spec in zip(shapes, specs)]

    def kernel(*a):
        scales = dict(zip(("k_scales", "v_scales"), a[7:]))
        return ragged_paged_attention_tpu(*a[:7], **scales, **kernel_kwargs)

    f = jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)
    with jax.set_mesh(mesh):
        return jax.jit(f).trace(*args).lower().compile()


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_ragged_compiles_at_production_shape(topology):
    """8 decode rows + a 512-token chunk, 8k context, 32 q / 8 kv heads, H = 128, bf16, soft cap
    and window on (their code paths compiled too). Its temporaries (the queries' relayout at
    most) do not grow with the context: no gathered pages, no score matrix."""
    temps = [_compile_ragged(topology, context=context, soft_cap=30.0, sliding_window=4096)
             .memory_analysis().temp_size_in_bytes for context in (2048, 8192)]
    q_bytes = (8 + 512) * 8 * 4 * 128 * 2 // 4  # per chip: 2 of the 8 kv heads
    assert temps[0] == temps[1] <= 2 * q_bytes, temps


def test_ragged_lane_packed_pages_compile():
    """The ragged kernel over H = 64 pages lane-packed two tokens to a row, window on."""
    _compile_ragged("v5e:2x2", head_dim=64, page_size=32, lane_packed=True,
                    sliding_window=4096)


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_ragged_int8_pages_compile_at_production_shape(topology):
    """The ragged kernel's int8 path (page 32, int8's smallest TPU page; scales beside the
    pages), soft cap and window on: no dequantized copy of the pool, its temporaries within the
    float kernel's bound (the queries' relayout)."""
    temp = _compile_ragged(topology, page_size=32, kv_dtype=jnp.int8, soft_cap=30.0,
                           sliding_window=4096).memory_analysis().temp_size_in_bytes
    assert temp <= (8 + 512) * 8 * 4 * 128 * 2 // 4 * 2, temp
