"""Ragged paged flash attention (pallas_kernels/ragged_attention/): both kernels in interpret mode
against the jnp reference over mixed steps of decode, verification and prompt-chunk rows (STYLE
rules 12-14), with NaN in every page slot a sequence does not own; the reference against the
decode oracle; the validators; the Triton lowering at the 8B production shape."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention.reference import pack_pages, paged_decode_attention_reference
from pallas_kernels.ragged_attention.gpu import _ragged_pallas, ragged_paged_attention_gpu
from pallas_kernels.ragged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_attention.tpu import ragged_paged_attention_tpu
from tests.helpers import assert_close, int8_pages, rel_err, release_behind_window, stacked

PAGE = 16
# (new query tokens, cache length after the step) per sequence: decode rows at lengths 1, page-1,
# page, page+1; a zero-length (idle) slot; a 3-token verification; a prompt chunk from token 0
# that crosses row blocks and a page boundary; a chunk over an earlier prefix, ending at the
# table's last slot (4 pages).
MIXED = ((1, 1), (1, PAGE - 1), (0, 0), (1, PAGE), (1, PAGE + 1), (3, 20), (21, 21),
         (13, 4 * PAGE))


def make_case(seqs=MIXED, *, g=4, head_dim=64, k_heads=2, dtype="float32", pages_per_seq=4,
              gaps=True, seed=0, page=PAGE):
    """Random q and a permuted page pool whose every slot past a sequence's length is NaN;
    sequences' rows ascending, with an unowned padding row after each when `gaps`. dtype
    "int8": f32 q, int8 pages; returns (args, {"k_scales", "v_scales"})."""
    if dtype == "int8":
        return int8_pages(make_case(seqs, g=g, head_dim=head_dim, k_heads=k_heads,
                                    pages_per_seq=pages_per_seq, gaps=gaps, seed=seed,
                                    page=page))
    rng = np.random.default_rng(seed)
    s = len(seqs)
    num_pages = s * pages_per_seq + 3
    table = rng.permutation(num_pages)[:s * pages_per_seq].reshape(s, pages_per_seq)
    k = np.full((k_heads, num_pages, page, head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    for i, (_, kv_len) in enumerate(seqs):
        for pos in range(kv_len):
            k[:, table[i, pos // page], pos % page] = rng.standard_normal((k_heads, head_dim))
            v[:, table[i, pos // page], pos % page] = rng.standard_normal((k_heads, head_dim))
    q_lens = np.array([n for n, _ in seqs], np.int32)
    q_starts = (np.cumsum(q_lens + gaps) - (q_lens + gaps)).astype(np.int32)
    n = int(q_starts[-1] + q_lens[-1]) + 2
    q = rng.standard_normal((n, k_heads, g, head_dim))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray([kv for _, kv in seqs], jnp.int32), jnp.asarray(table, jnp.int32),
            jnp.asarray(q_starts), jnp.asarray(q_lens))


def owned_rows(args) -> np.ndarray:
    n, starts, lens = args[0].shape[0], np.asarray(args[5]), np.asarray(args[6])
    owned = np.zeros(n, bool)
    for st, ln in zip(starts, lens):
        owned[st:st + ln] = True
    return owned


def check(out, args, dtype, **kw):
    """`out` against the reference over `args` (int8 pages: their scales in `kw`)."""
    want = ragged_paged_attention_reference(*args, **kw)
    assert out.shape == want.shape and out.dtype == want.dtype
    out32 = np.asarray(out, np.float32)
    assert np.isfinite(out32).all(), "NaN leaked from a page a sequence does not own"
    print(f"rel err {rel_err(out, want):.2e}")
    assert_close(out, want, dtype)
    np.testing.assert_array_equal(out32[~owned_rows(args)], 0.0)  # unowned rows: defined as 0


def test_reference_matches_decode_oracle():
    """Per-slot rows (B slots x T tokens, causal) give the decode oracle's answer."""
    seqs = ((3, 3), (3, 17), (3, 64), (3, 40))
    args = make_case(seqs, gaps=False)
    b, t = len(seqs), 3
    q, k, v, kv_lens, table = args[:5]
    want = paged_decode_attention_reference(q[:b * t].reshape(b, t, *q.shape[1:]), k, v,
                                            kv_lens, table, sliding_window=9, soft_cap=4.0)
    got = ragged_paged_attention_reference(*args, sliding_window=9, soft_cap=4.0)
    assert_close(got[:b * t], want.reshape(b * t, *q.shape[1:]))


def int8_case(dtype, **kw):
    """(args, scales, dtype to compare at): int8 pages (page `INT8_PAGE` for the TPU kernel's
    int8 tiling) are read with f32 queries and compared at f32's tolerance."""
    if dtype != "int8":
        return make_case(dtype=dtype, **kw), {}, dtype
    args, scales = make_case(dtype="int8", **kw)
    return args, scales, "float32"


INT8_PAGE = 32  # int8's sublane tile: the smallest page the TPU kernel takes int8 pages of


# (dtype, G, H) per kernel: the dtypes (int8: int8 pages), GQA ratios 1/2/4/8, head dims
# 64/128/256 (a few interpret-mode compiles each keep the file near a minute on two cores)
@pytest.mark.parametrize("dtype, g, head_dim", [("float32", 1, 64), ("bfloat16", 4, 128),
                                                ("float32", 8, 256), ("int8", 4, 128)])
def test_tpu_matches_reference(dtype, g, head_dim):
    args, scales, dtype = int8_case(dtype, g=g, head_dim=head_dim,
                                    page=INT8_PAGE if dtype == "int8" else PAGE)
    # 16 tokens per row block: blocks shared by several sequences and a chunk over three blocks
    check(ragged_paged_attention_tpu(*args, block_tokens=16, pages_per_block=2, interpret=True,
                                     **scales), args, dtype, **scales)


@pytest.mark.parametrize("dtype, g, head_dim", [("bfloat16", 8, 64), ("float32", 4, 128),
                                                ("float32", 2, 256), ("int8", 8, 64)])
def test_gpu_matches_reference(dtype, g, head_dim):
    args, scales, dtype = int8_case(dtype, g=g, head_dim=head_dim)
    check(ragged_paged_attention_gpu(*args, block_tokens=8, interpret=True, **scales), args,
          dtype, **scales)


WINDOW_CAP = [dict(sliding_window=7), dict(sliding_window=20, soft_cap=5.0)]


@pytest.mark.parametrize("kw", WINDOW_CAP)
def test_tpu_soft_cap_and_sliding_window(kw):
    """Over H = 64 pages lane-packed two tokens to a row (the TPU pool's layout,
    `pack_pages`; NaN in the dead half of a half-live row)."""
    args = make_case()
    packed = (args[0], pack_pages(args[1]), pack_pages(args[2]), *args[3:])
    check(ragged_paged_attention_tpu(*packed, block_tokens=16, pages_per_block=1,
                                     interpret=True, **kw), args, "float32", **kw)


@pytest.mark.parametrize("kw", WINDOW_CAP)
def test_gpu_soft_cap_and_sliding_window(kw):
    args = make_case()
    check(ragged_paged_attention_gpu(*args, block_tokens=4, interpret=True, **kw), args,
          "float32", **kw)


def test_gemma3_shape_with_window():
    """Gemma 3's local layers (one kv head of dim 256, 4 query heads, a window shorter than the
    chunks' prefixes) on both kernels."""
    args = make_case(head_dim=256, k_heads=1)
    # The pages behind each sequence's window NaN (a hybrid pool's released pages); with two
    # pages a block, the TPU kernel loads some of them beside a visible page.
    first = np.asarray(args[3]) - np.asarray(args[6])
    args = args[:4] + (release_behind_window(args[4], first, 12, PAGE),) + args[5:]
    check(ragged_paged_attention_tpu(*args, block_tokens=16, pages_per_block=2, interpret=True,
                                     sliding_window=12), args, "float32", sliding_window=12)
    check(ragged_paged_attention_gpu(*args, block_tokens=4, interpret=True, sliding_window=12),
          args, "float32", sliding_window=12)


@pytest.mark.slow
def test_default_blocks_and_a_long_chunk():
    """Default block sizes; one 64-token chunk over a 64-token prefix (a chunk of several row
    blocks, each stopping at its own causal bound) beside two decode rows."""
    args = make_case(((1, 5), (64, 128), (1, 33)), pages_per_seq=8, gaps=False)
    check(ragged_paged_attention_tpu(*args, interpret=True), args, "float32")
    check(ragged_paged_attention_gpu(*args, interpret=True), args, "float32")


def test_tpu_interpret_no_races():
    """TPU interpret mode simulating the async DMAs: a read before .wait() would give NaN."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interp  # private

    args = make_case(((1, 17), (0, 0), (9, 40)), head_dim=128)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait",
                                   uninitialized_memory="nan")
    try:
        out = ragged_paged_attention_tpu(*args, block_tokens=8, pages_per_block=2,
                                         interpret=params)
        assert tpu_interp.races is not None and not tpu_interp.races.races_found
        check(out, args, "float32")
    finally:
        pltpu.reset_tpu_interpret_mode_state()


def _abstract(n=520, s=9, g=4, head_dim=128, page=PAGE, pages=512, dtype=jnp.bfloat16):
    """The 8B production shape: 8 decode rows + a 512-token chunk, 8k context, bf16."""
    sds = jax.ShapeDtypeStruct
    pool = sds((8, s * pages + 1, page, head_dim), dtype)
    i32 = functools.partial(sds, dtype=jnp.int32)
    return (sds((n, 8, g, head_dim), dtype), pool, pool, i32((s,)), i32((s, pages)), i32((s,)),
            i32((s,)))


@pytest.mark.parametrize("kw, head_dim, int8", [
    ({}, 128, False), (dict(soft_cap=30.0, sliding_window=4096), 128, False),
    (dict(sliding_window=512), 256, False), ({}, 128, True)])
def test_lowers_to_triton_for_cuda(kw, head_dim, int8):
    from tests.test_pallas_gpu import with_int8_pages

    f, args = functools.partial(ragged_paged_attention_gpu, **kw), _abstract(head_dim=head_dim)
    if int8:  # bf16 queries over int8 pages
        f, args = with_int8_pages(f, args)
    hlo = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo and "mosaic_gpu" not in hlo


@pytest.mark.parametrize("fn, args, kw, match", [
    (ragged_paged_attention_tpu, _abstract(g=3), dict(block_tokens=20),
     r"\(8,128\) tiling rule: a row block of block_tokens=20 tokens x G=3 .* multiple of 16"),
    (ragged_paged_attention_tpu, _abstract(head_dim=72), {}, r"head dim H=72"),
    (ragged_paged_attention_gpu, _abstract(head_dim=72), {}, r"power of 2.*H=72"),
    (ragged_paged_attention_gpu, _abstract(), dict(block_tokens=64),
     r"256 rows .* exceed the 65536 a Triton program keeps in registers; use block_tokens <= 32"),
    (ragged_paged_attention_gpu, _abstract(), dict(soft_cap=0.0), r"soft_cap must be > 0"),
    (ragged_paged_attention_tpu, _abstract(s=9)[:6] + (jax.ShapeDtypeStruct((8,), jnp.int32),),
     {}, r"q_lens must be \[S=9\]"),
])
def test_validators_name_the_limit(fn, args, kw, match):
    with pytest.raises(ValueError, match=match):
        jax.jit(functools.partial(fn, **kw)).trace(*args)


def test_triton_lowering_itself_rejects_h72():
    """Past the validator, Triton's own lowering check fires: the power-of-2 rule is real."""
    f = functools.partial(_ragged_pallas, block_tokens=16, soft_cap=None, sliding_window=None,
                          interpret=False)
    with pytest.raises(ValueError, match="power of 2"):
        jax.jit(f).trace(*_abstract(head_dim=72)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_stacked_pool_reads_its_layer(kernel):
    """A scanned model's pool: the layer's int8 pools and scales are row `layer` (traced) of
    stacks whose other rows are poisoned; each kernel reads that row in place and matches the
    reference on the layer's own pools, and so does the reference given the stack."""
    args, scales, dtype = int8_case("int8", g=4, head_dim=64, page=INT8_PAGE)
    q, k, v, *rest = args
    layer = jnp.int32(1)
    stacks = {name: stacked(x) for name, x in scales.items()}
    run = (functools.partial(ragged_paged_attention_tpu, block_tokens=16, pages_per_block=2)
           if kernel == "tpu" else functools.partial(ragged_paged_attention_gpu, block_tokens=8))
    out = run(q, stacked(k), stacked(v), *rest, layer=layer, interpret=True, **stacks)
    check(out, args, dtype, **scales)
    assert_close(ragged_paged_attention_reference(q, stacked(k), stacked(v), *rest, layer=layer,
                                                  **stacks),
                 ragged_paged_attention_reference(*args, **scales))


@pytest.mark.parametrize("kernel, kw", [("tpu", {}), ("tpu", dict(sliding_window=20)),
                                        ("gpu", {}), ("gpu", dict(sliding_window=7))])
def test_attention_sinks_match_reference(kernel, kw):
    """gpt-oss's attention sinks over a whole mixed step (decode rows, a verification, prompt
    chunks; the TPU kernel over lane-packed pages): the kernel against the reference, unowned
    rows still 0; the sinks change the output; the reference's decode rows are the decode
    oracle's with the same sinks."""
    args = make_case()
    sinks = jnp.asarray(np.random.default_rng(1).normal(0.5, 1.5, args[0].shape[1:3]),
                        jnp.float32)
    if kernel == "tpu":
        packed = (args[0], pack_pages(args[1]), pack_pages(args[2]), *args[3:])
        out = ragged_paged_attention_tpu(*packed, block_tokens=16, pages_per_block=2,
                                         sinks=sinks, interpret=True, **kw)
    else:
        out = ragged_paged_attention_gpu(*args, block_tokens=8, sinks=sinks, interpret=True,
                                         **kw)
    check(out, args, "float32", sinks=sinks, **kw)
    want = ragged_paged_attention_reference(*args, sinks=sinks, **kw)
    assert rel_err(want, ragged_paged_attention_reference(*args, **kw)) > 0.05
    q, k, v, kv_lens, table, starts, _ = args
    decode = np.array([i for i, (n, _) in enumerate(MIXED) if n == 1])
    rows = np.asarray(starts)[decode]
    oracle = paged_decode_attention_reference(q[rows][:, None], k, v, kv_lens[decode],
                                              table[decode], sinks=sinks, **kw)
    assert_close(want[rows], oracle[:, 0])


def test_lowers_to_triton_for_cuda_with_sinks():
    args = _abstract(head_dim=64)
    sinks = jax.ShapeDtypeStruct(args[0].shape[1:3], jnp.float32)
    hlo = jax.jit(lambda *a: ragged_paged_attention_gpu(*a[:-1], sliding_window=128,
                                                        sinks=a[-1])).trace(
        *args, sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo and "mosaic_gpu" not in hlo
