"""Triton paged decode kernel (pallas_kernels/paged_attention/gpu.py) on CPU.

Numerics run with `interpret=True` against the jnp reference (STYLE rules 13-14); the CUDA gate
lowers to Triton without a GPU (notes/pallas_on_cpu.md §2c).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as shipped

from jaxinfer.config import DraftTree
from pallas_kernels.paged_attention.gpu import _paged_decode_pallas, paged_decode_attention_gpu
from pallas_kernels.paged_attention.reference import paged_decode_attention_reference
from tests.helpers import (
    TOLERANCE,
    assert_close,
    int8_pages,
    rel_err,
    release_behind_window,
    stacked,
    tree_case,
)

PAGE = 16
PAGES_PER_SEQ = 4  # max length 64
LENGTHS = (0, 1, PAGE - 1, PAGE, PAGE + 1, PAGE * PAGES_PER_SEQ)


def make_case(dtype, g, h, t, *, k=2, lengths=LENGTHS, poison=True, seed=0):
    """Permuted page pool; pages (and page tails) past each length are NaN when `poison`."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    num_pages = b * PAGES_PER_SEQ + 3
    pool = rng.standard_normal((2, k, num_pages, PAGE, h)).astype(np.float32)
    table = rng.permutation(num_pages)[: b * PAGES_PER_SEQ].reshape(b, PAGES_PER_SEQ)
    if poison:
        live = np.zeros((num_pages, PAGE), bool)
        for i, n in enumerate(lengths):
            for pos in range(n):
                live[table[i, pos // PAGE], pos % PAGE] = True
        pool[:, :, ~live] = np.nan
    q = rng.standard_normal((b, t, k, g, h)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(pool[0], dtype), jnp.asarray(pool[1], dtype),
            jnp.asarray(lengths, jnp.int32), jnp.asarray(table, jnp.int32))


def check(out, expected, dtype_name):
    out32, exp32 = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    assert np.isfinite(out32).all(), "NaN leaked from a poisoned page"
    err = rel_err(out32, exp32)
    print(f"{dtype_name}: rel err {err:.2e}")
    assert_close(out32, exp32, dtype_name)
    assert err < TOLERANCE[dtype_name][1]


# dtype x G x H x T; int8 pages (f32 queries, f32 tolerance) on two corners of it.
SWEEP = [(dtype, g, h, t) for dtype in ("float32", "bfloat16") for g in (1, 4, 8)
         for h in (64, 128) for t in (1, 3)] + [("int8", 4, 128, 1), ("int8", 8, 64, 3)]


@pytest.mark.parametrize("dtype, g, h, t", SWEEP)
def test_matches_reference(dtype, g, h, t):
    scales = {}
    args = make_case("float32" if dtype == "int8" else dtype, g, h, t)
    if dtype == "int8":
        (args, scales), dtype = int8_pages(args), "float32"
    out = paged_decode_attention_gpu(*args, pages_per_split=2, interpret=True, **scales)
    assert out.shape == args[0].shape and out.dtype == dtype
    check(out, paged_decode_attention_reference(*args, **scales), dtype)
    assert not np.asarray(out[0], np.float32).any(), "length-0 row must output 0"


@pytest.mark.parametrize("soft_cap,window", [(5.0, None), (None, 20), (3.0, 7)])
def test_soft_cap_and_sliding_window(soft_cap, window):
    args = make_case(jnp.float32, 4, 64, 3)
    out = paged_decode_attention_gpu(*args, pages_per_split=1, soft_cap=soft_cap,
                                     sliding_window=window, interpret=True)
    check(out, paged_decode_attention_reference(*args, soft_cap=soft_cap,
                                                sliding_window=window), "float32")


def test_gemma3_shape_with_window():
    """Gemma 3's local layers: one kv head of dim 256, 4 query heads, window 20; the pages
    behind it NaN (a hybrid pool's released pages)."""
    q, k, v, lens, table = make_case(jnp.float32, 4, 256, 3, k=1)
    args = (q, k, v, lens, release_behind_window(table, np.maximum(np.asarray(lens) - 3, 0),
                                                 20, PAGE))
    out = paged_decode_attention_gpu(*args, pages_per_split=2, sliding_window=20,
                                     interpret=True)
    check(out, paged_decode_attention_reference(*args, sliding_window=20), "float32")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_num_splits_override(num_splits):
    """One split (no combine work) and a split count that does not divide the page count."""
    args = make_case(jnp.float32, 4, 64, 1)
    out = paged_decode_attention_gpu(*args, num_splits=num_splits, interpret=True)
    check(out, paged_decode_attention_reference(*args), "float32")


def test_matches_shipped_jax_kernel():
    """jax's ops.gpu.paged_attention: q [B, K*G, H] (kv-head major), no 1/sqrt(H) scaling, same
    page pool layout. It loads whole compute blocks, so pages are not poisoned here."""
    q, k_pages, v_pages, lengths, table = make_case(jnp.float32, 4, 64, 1, poison=False,
                                                    lengths=(1, 17, 40, 64))
    b, _, k, g, h = q.shape
    theirs = shipped.paged_attention(q.reshape(b, k * g, h) / np.sqrt(h), k_pages, v_pages,
                                     table, lengths, pages_per_compute_block=2, k_splits=2,
                                     interpret=True)
    ours = paged_decode_attention_gpu(q, k_pages, v_pages, lengths, table, pages_per_split=2,
                                      interpret=True)
    check(ours.reshape(b, k * g, h), theirs, "float32")


def production_args(h=128, t=1, dtype=jnp.bfloat16):
    """B=8, K=8, G=4, page 16, 8k context: abstract shapes only, nothing is allocated."""
    b, k, g, context = 8, 8, 4, 8192
    p = context // PAGE
    s = jax.ShapeDtypeStruct
    return (s((b, t, k, g, h), dtype), s((k, b * p, PAGE, h), dtype), s((k, b * p, PAGE, h), dtype),
            s((b,), jnp.int32), s((b, p), jnp.int32))


def with_int8_pages(f, args):
    """(f, args) with the K/V pools (args 1, 2) int8 and their f32 scales appended to args,
    passed to `f` as k_scales / v_scales."""
    pools = [jax.ShapeDtypeStruct(args[i].shape, jnp.int8) for i in (1, 2)]
    k, pages, page = args[1].shape[:3]
    scales = [jax.ShapeDtypeStruct((k, -(-pages // 8), 8, page), jnp.float32)] * 2
    n = len(args)
    return (lambda *a: f(*a[:n], k_scales=a[n], v_scales=a[n + 1]),
            (args[0], *pools, *args[3:], *scales))


@pytest.mark.parametrize("t,soft_cap,window,h,int8", [(1, None, None, 128, False),
                                                      (4, 30.0, 4096, 128, False),
                                                      (1, None, 512, 256, False),
                                                      (4, None, None, 128, True)])
def test_lowers_to_triton_for_cuda(t, soft_cap, window, h, int8):
    f = functools.partial(paged_decode_attention_gpu, soft_cap=soft_cap, sliding_window=window)
    args = production_args(h=h, t=t)
    if int8:  # bf16 queries over int8 pages
        f, args = with_int8_pages(f, args)
    hlo = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo
    assert "mosaic_gpu" not in hlo


def test_rejects_non_power_of_2_head_dim():
    with pytest.raises(ValueError, match="power of 2.*H=72"):
        jax.jit(paged_decode_attention_gpu).trace(*production_args(h=72))


def test_rejects_non_power_of_2_page_size():
    args = make_case(jnp.float32, 1, 64, 1)
    with pytest.raises(ValueError, match="page_size=12"):
        paged_decode_attention_gpu(args[0], args[1][:, :, :12], args[2][:, :, :12], *args[3:],
                                   interpret=True)


def test_triton_lowering_itself_rejects_h72():
    """Past the validator, Triton's own lowering check fires: proves the rule is real."""
    f = functools.partial(_paged_decode_pallas, pages_per_split=8, num_splits=None,
                          soft_cap=None, sliding_window=None, interpret=False)
    with pytest.raises(ValueError, match="power of 2"):
        jax.jit(f).trace(*production_args(h=72)).lower(lowering_platforms=("cuda",))


def test_rejects_pages_that_overflow_shared_memory():
    """f32 pages of 256 x 128 (128 KiB) overflow an H100's shared memory (proved by the
    deviceless compile in scripts/gpu_compile_check.py); the validator says so first."""
    s = jax.ShapeDtypeStruct
    pool = s((8, 65, 256, 128), jnp.float32)
    args = (s((8, 1, 8, 4, 128), jnp.float32), pool, pool, s((8,), jnp.int32),
            s((8, 8), jnp.int32))
    with pytest.raises(ValueError, match="page_size=256 x H=128 .* use page_size <= 128"):
        jax.jit(paged_decode_attention_gpu).trace(*args)
    ok = (args[0], s((8, 129, 128, 128), jnp.float32), s((8, 129, 128, 128), jnp.float32),
          args[3], s((8, 16), jnp.int32))
    jax.jit(paged_decode_attention_gpu).trace(*ok)  # 64 KiB pages pass


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_stacked_pool_reads_its_layer(dtype):
    """A scanned model's pool: the layer's pools (and int8 scales) are row `layer` (traced) of
    stacks whose other rows are poisoned; the kernel reads that row in place and matches the
    reference on the layer's own pools."""
    args = make_case("float32", 4, 64, 3)
    args, scales = int8_pages(args) if dtype == "int8" else (args, {})
    q, k, v, lens, table = args
    want = paged_decode_attention_reference(*args, **scales)
    stacks = {name: stacked(x) for name, x in scales.items()}
    out = paged_decode_attention_gpu(q, stacked(k), stacked(v), lens, table,
                                     layer=jnp.int32(1), interpret=True, **stacks)
    check(out, want, "float32")


@pytest.mark.parametrize("spec, dtype, kw", [
    ("2,2,1", "float32", {}),
    ("4,2,2,1", "bfloat16", dict(sliding_window=20)),  # 45 queries: masks of two words
    ("2,1", "int8", dict(soft_cap=3.0)),
])
def test_tree_queries_match_reference(spec, dtype, kw):
    """A draft tree's queries (each sees the context and its ancestors' slots, by its mask):
    the kernel against the reference, NaN in every dead slot."""
    t = DraftTree.parse(spec).num_nodes + 1
    lengths = (t, t + 1, PAGE + t, 3 * PAGE + 5)
    trees, _ = tree_case(spec, list(lengths))
    scales = {}
    args = make_case("float32" if dtype == "int8" else dtype, 4, 64, t, lengths=lengths)
    if dtype == "int8":
        (args, scales), dtype = int8_pages(args), "float32"
    out = paged_decode_attention_gpu(*args, pages_per_split=2, interpret=True, **trees,
                                     **scales, **kw)
    check(out, paged_decode_attention_reference(*args, **trees, **scales, **kw), dtype)


@pytest.mark.parametrize("num_splits, window", [(1, None), (3, 20)])
def test_attention_sinks_match_reference(num_splits, window):
    """gpt-oss's attention sinks join the splits' merge as one more split (output 0, max the
    sink, sum 1): the kernel against the reference, a row of length 0 still 0; the sinks
    change the output."""
    args = make_case(jnp.float32, 4, 64, 3)
    sinks = jnp.asarray(np.random.default_rng(1).normal(0.5, 1.5, args[0].shape[2:4]),
                        jnp.float32)
    out = paged_decode_attention_gpu(*args, num_splits=num_splits, sliding_window=window,
                                     sinks=sinks, interpret=True)
    want = paged_decode_attention_reference(*args, sliding_window=window, sinks=sinks)
    check(out, want, "float32")
    assert not np.asarray(out[0]).any(), "length-0 row must output 0"
    assert rel_err(want, paged_decode_attention_reference(*args, sliding_window=window)) > 0.05


def test_lowers_to_triton_for_cuda_with_sinks():
    args = production_args(h=64, t=1)
    sinks = jax.ShapeDtypeStruct(args[0].shape[2:4], jnp.float32)
    hlo = jax.jit(lambda *a: paged_decode_attention_gpu(*a[:-1], sliding_window=128,
                                                        sinks=a[-1])).trace(
        *args, sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo
