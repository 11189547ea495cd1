"""Pallas TPU paged decode attention: interpret-mode numerics on CPU vs the reference, vs jax's
shipped TPU kernel, TPU lowering at a production shape, and the tiling validator (STYLE 12-14)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.config import DraftTree
from pallas_kernels.paged_attention.reference import pack_pages, paged_decode_attention_reference
from pallas_kernels.paged_attention.tpu import paged_decode_attention_tpu
from tests.helpers import (
    assert_close,
    int8_pages,
    rel_err,
    release_behind_window,
    stacked,
    tree_case,
)

PAGE = 16
INT8_PAGE = 32  # int8's sublane tile: the smallest page the TPU kernel takes int8 pages of


def make_case(*, t, g, head_dim, dtype, lengths, k_heads=1, pages_per_seq=4, seed=0,
              page=PAGE):
    """Random q, K/V pools whose every slot past a sequence's length is NaN, permuted pages.
    dtype "int8": f32 q, int8 pages; returns (args, {"k_scales", "v_scales"})."""
    if dtype == "int8":
        return int8_pages(make_case(t=t, g=g, head_dim=head_dim, dtype="float32",
                                    lengths=lengths, k_heads=k_heads, seed=seed,
                                    pages_per_seq=pages_per_seq, page=page))
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    num_pages = batch * pages_per_seq + 3  # spare pages never referenced
    page_table = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, -1)
    shape = (k_heads, num_pages, page, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    for b, length in enumerate(lengths):
        for pos in range(length):
            pid = page_table[b, pos // page]
            k[:, pid, pos % page] = rng.standard_normal((k_heads, head_dim))
            v[:, pid, pos % page] = rng.standard_normal((k_heads, head_dim))
    q = rng.standard_normal((batch, t, k_heads, g, head_dim))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(lengths, jnp.int32), jnp.asarray(page_table, jnp.int32))


def check(args, dtype, **kw):
    if dtype == "int8":  # f32 queries over int8 pages: compared at f32's tolerance
        (args, scales), dtype = args, "float32"
        kw.update(scales)
    out = paged_decode_attention_tpu(*args, interpret=True, **kw)
    kw.pop("pages_per_block", None)
    want = paged_decode_attention_reference(*args, **kw)
    assert out.shape == want.shape and out.dtype == want.dtype
    assert not np.isnan(np.asarray(out, np.float32)).any()
    print(f"rel err {rel_err(out, want):.2e}")
    assert_close(out, want, dtype)
    return out


def lengths(page: int) -> list[int]:
    """0, 1, page-1, page, page+1, max (4 pages)."""
    return [0, 1, page - 1, page, page + 1, 4 * page]


LENGTHS = lengths(PAGE)
# dtype x G x H x T; int8 pages (f32 queries) on two corners of it, each case an interpret-mode
# compile of several seconds.
SWEEP = [(dtype, g, head_dim, t) for dtype in ("float32", "bfloat16") for g in (1, 4, 8)
         for head_dim in (64, 128) for t in (1, 3)] + [("int8", 4, 128, 1), ("int8", 8, 64, 3)]


@pytest.mark.parametrize("dtype, g, head_dim, t", SWEEP)
def test_sweep_matches_reference(dtype, g, head_dim, t):
    page = INT8_PAGE if dtype == "int8" else PAGE
    args = make_case(t=t, g=g, head_dim=head_dim, dtype=dtype, lengths=lengths(page), page=page)
    out = check(args, dtype, pages_per_block=2)
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)  # length 0: defined as 0


@pytest.mark.parametrize("kw", [dict(soft_cap=2.0), dict(sliding_window=20),
                                dict(sliding_window=5, soft_cap=3.0)])
def test_soft_cap_and_sliding_window(kw):
    args = make_case(t=3, g=4, head_dim=64, dtype="float32", lengths=[3, 17, 40, 64],
                     k_heads=2)
    check(args, "float32", pages_per_block=2, **kw)


def test_gemma3_shape_with_window():
    """Gemma 3's local layers: one kv head of dim 256, 4 query heads, a window shorter than
    the longest row; the pages behind it NaN (a hybrid pool's released pages), one of them in
    a block with a visible page."""
    q, k, v, lens, table = make_case(t=3, g=4, head_dim=256, dtype="float32",
                                     lengths=[3, 17, 40, 64])
    table = release_behind_window(table, np.asarray(lens) - 3, 20, PAGE)
    assert table[3, 1] != table[3, 2]  # row 3: page 1 released, page 2 (same block) visible
    check((q, k, v, lens, table), "float32", pages_per_block=2, sliding_window=20)


@pytest.mark.parametrize("pages_per_block", [1, 3, 8])
def test_pages_per_block_not_dividing_table(pages_per_block):
    args = make_case(t=1, g=4, head_dim=128, dtype="float32", lengths=[1, 33, 80],
                     pages_per_seq=5)
    check(args, "float32", pages_per_block=pages_per_block)


def test_matches_shipped_jax_kernel():
    """jax.experimental.pallas.ops.tpu.paged_attention (T=1, q [B, K*G, H], no 1/sqrt(H))."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    q, k, v, lengths, page_table = make_case(t=1, g=4, head_dim=128, dtype="float32",
                                             lengths=[1, 17, 64], k_heads=2)
    # the shipped kernel computes in bf16: feed both bf16-rounded K/V. It also multiplies dead
    # slots of the last block by 0, so NaN poison would leak into it: zero them for this test.
    k = jnp.nan_to_num(k).astype(jnp.bfloat16).astype(jnp.float32)
    v = jnp.nan_to_num(v).astype(jnp.bfloat16).astype(jnp.float32)
    ours = paged_decode_attention_tpu(q, k, v, lengths, page_table, pages_per_block=2,
                                      interpret=True)
    batch, _, k_heads, g, head_dim = q.shape
    with pltpu.force_tpu_interpret_mode(True):
        theirs = paged_attention(q.reshape(batch, k_heads * g, head_dim) * head_dim ** -0.5,
                                 k, v, lengths, page_table, pages_per_compute_block=2)
    theirs = theirs.reshape(q.shape)
    print(f"rel err vs shipped {rel_err(ours, theirs):.2e}")
    assert_close(ours, theirs, "float32", scale=10.0)  # bf16 K/V in its kernel: looser


def _tpu_lowering_text(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def test_lowers_for_tpu_at_production_shape():
    batch, k_heads, g, head_dim, ctx = 8, 8, 4, 128, 8192
    pages_per_seq = ctx // PAGE
    sds = jax.ShapeDtypeStruct
    args = (sds((batch, 1, k_heads, g, head_dim), jnp.bfloat16),
            sds((k_heads, batch * pages_per_seq, PAGE, head_dim), jnp.bfloat16),
            sds((k_heads, batch * pages_per_seq, PAGE, head_dim), jnp.bfloat16),
            sds((batch,), jnp.int32), sds((batch, pages_per_seq), jnp.int32))
    text = _tpu_lowering_text(
        lambda *a: paged_decode_attention_tpu(*a, pages_per_block=8), *args)
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("head_dim, page, dtype, match", [
    (72, 16, jnp.float32, "head dim H=72"),
    (128, 8, jnp.bfloat16, "page_size=8 must be a multiple of 16"),
    (128, 12, jnp.float32, "page_size=12 must be a multiple of 8"),
    (128, 16, jnp.int8, "page_size=16 must be a multiple of 32 .* of int8"),
])
def test_illegal_blocks_rejected(head_dim, page, dtype, match):
    sds = jax.ShapeDtypeStruct
    scales = {}
    if dtype == jnp.int8:
        scales = {"k_scales": sds((1, 1, 8, page), jnp.float32),
                  "v_scales": sds((1, 1, 8, page), jnp.float32)}
    args = (sds((2, 1, 1, 4, head_dim), jnp.float32 if dtype == jnp.int8 else dtype),
            sds((1, 8, page, head_dim), dtype), sds((1, 8, page, head_dim), dtype),
            sds((2,), jnp.int32), sds((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"\(8,128\) tiling rule.*" + match):
        _tpu_lowering_text(lambda *a: paged_decode_attention_tpu(*a, pages_per_block=2,
                                                                 **scales), *args)


def test_lane_packed_page_of_half_a_tile_rejected():
    sds = jax.ShapeDtypeStruct
    args = (sds((2, 1, 1, 4, 64), jnp.bfloat16), sds((1, 8, 8, 128), jnp.bfloat16),
            sds((1, 8, 8, 128), jnp.bfloat16), sds((2,), jnp.int32), sds((2, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"lane-packed pages of page_size=16 .* are 8 rows.*"
                                         r"multiple of 16 .*bfloat16.*multiple of 32"):
        _tpu_lowering_text(lambda *a: paged_decode_attention_tpu(*a, pages_per_block=2), *args)


def test_tpu_interpret_no_races():
    """TPU interpret mode simulates the async DMAs: a read before .wait() would give NaN."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interp  # private

    args = make_case(t=3, g=4, head_dim=128, dtype="float32", lengths=[0, 17, 64])
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait",
                                   uninitialized_memory="nan")
    try:
        out = paged_decode_attention_tpu(*args, pages_per_block=2, interpret=params)
        want = paged_decode_attention_reference(*args)
        assert tpu_interp.races is not None and not tpu_interp.races.races_found
        assert_close(out, want, "float32")
    finally:
        pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("dtype, page, t, kw", [
    ("bfloat16", 32, 1, {}),
    ("float32", PAGE, 3, dict(sliding_window=20, soft_cap=3.0)),
])
def test_lane_packed_pages_match_reference(dtype, page, t, kw):
    """H = 64 pages stored two tokens to a 128-lane row (the TPU pool's layout,
    `reference.pack_pages`), NaN in every dead slot, half-live rows included: the reference's
    outputs over the unpacked pages."""
    q, k, v, lens, table = make_case(t=t, g=4, head_dim=64, dtype=dtype, k_heads=2, page=page,
                                     lengths=[0, 1, page - 1, page + 2, 3 * page + 1])
    out = paged_decode_attention_tpu(q, pack_pages(k), pack_pages(v), lens, table,
                                     pages_per_block=2, interpret=True, **kw)
    want = paged_decode_attention_reference(q, k, v, lens, table, **kw)
    assert out.shape == want.shape and out.dtype == want.dtype
    assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype, packed", [("bfloat16", True), ("int8", False)])
def test_stacked_pool_reads_its_layer(dtype, packed):
    """A scanned model's pool: the layer's pools (and int8 scales) are row `layer` (traced) of
    stacks whose other rows are poisoned; the kernel reads that row in place and matches the
    reference on the layer's own pools, and so does the reference given the stack."""
    page = INT8_PAGE if dtype == "int8" else 32
    case = make_case(t=3, g=4, head_dim=64, dtype=dtype, k_heads=2, page=page,
                     lengths=[0, 1, page + 2, 3 * page + 1])
    (q, k, v, lens, table), scales = case if dtype == "int8" else (case, {})
    want = paged_decode_attention_reference(q, k, v, lens, table, **scales)
    if packed:
        k, v = pack_pages(k), pack_pages(v)
    layer = jnp.int32(1)
    pools = [stacked(x) for x in (k, v)]
    stacks = {name: stacked(x) for name, x in scales.items()}
    out = jax.jit(lambda *a, **kw: paged_decode_attention_tpu(*a, pages_per_block=2,
                                                              interpret=True, **kw))(
        q, *pools, lens, table, layer=layer, **stacks)
    assert_close(out, want, "float32" if dtype == "int8" else dtype)
    if not packed:
        assert_close(paged_decode_attention_reference(q, *pools, lens, table, layer=layer,
                                                      **stacks), want)



@pytest.mark.parametrize("spec, dtype, kw", [
    ("2,2,1", "float32", {}),
    ("4,2,2,1", "bfloat16", dict(sliding_window=20)),  # 45 queries: masks of two words
    ("2,1", "int8", dict(soft_cap=3.0)),
])
def test_tree_queries_match_reference(spec, dtype, kw):
    """A draft tree's queries (each sees the context and its ancestors' slots, by its mask):
    the kernel against the reference, NaN in every dead slot."""
    page = INT8_PAGE if dtype == "int8" else PAGE
    t = DraftTree.parse(spec).num_nodes + 1
    lens = [t, t + 1, page + t, 3 * page + 5]
    trees, _ = tree_case(spec, lens)
    args = make_case(t=t, g=4, head_dim=128, dtype=dtype, k_heads=2, page=page, lengths=lens)
    check(args, dtype, pages_per_block=2, **trees, **kw)


@pytest.mark.parametrize("packed, t, kw", [
    (False, 3, dict(soft_cap=3.0)),
    (True, 1, dict(sliding_window=20)),  # H = 64 lane-packed, as the TPU pool stores it
    (False, 3, dict(tree="2,1")),
])
def test_attention_sinks_match_reference(packed, t, kw):
    """gpt-oss's attention sinks (a logit per query head in every softmax denominator): the
    kernel against the reference, NaN in every dead slot, a row of length 0 still 0; the sinks
    change the output (a kernel that dropped them would fail)."""
    kw = dict(kw)
    spec = kw.pop("tree", None)
    if spec is not None:
        t = DraftTree.parse(spec).num_nodes + 1
    lens = [0, t, PAGE + t, 3 * PAGE + 5]
    q, k, v, lens, table = make_case(t=t, g=4, head_dim=64, dtype="float32", k_heads=2,
                                     lengths=lens)
    if spec is not None:
        kw.update(tree_case(spec, np.asarray(lens).tolist())[0])
    sinks = jnp.asarray(np.random.default_rng(1).normal(0.5, 1.5, (2, 4)), jnp.float32)
    pools = (pack_pages(k), pack_pages(v)) if packed else (k, v)
    out = paged_decode_attention_tpu(q, *pools, lens, table, pages_per_block=2, sinks=sinks,
                                     interpret=True, **kw)
    want = paged_decode_attention_reference(q, k, v, lens, table, sinks=sinks, **kw)
    assert_close(out, want, "float32")
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    assert rel_err(want, paged_decode_attention_reference(q, k, v, lens, table, **kw)) > 0.05


def test_attention_sinks_must_be_a_logit_per_query_head():
    q, k, v, lens, table = make_case(t=1, g=4, head_dim=128, dtype="float32", k_heads=2,
                                     lengths=[3, 5])
    with pytest.raises(ValueError, match=r"sinks must be float32\[K=2, G=4\]"):
        paged_decode_attention_tpu(q, k, v, lens, table, sinks=jnp.zeros((8,), jnp.float32),
                                   interpret=True)
