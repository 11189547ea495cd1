"""Speculative verification for TPU: two Pallas (Mosaic) passes over vocabulary blocks.

Grid (b, i) over rows and vocabulary blocks of `block_v` ids (a multiple of 128 lanes, or the
whole vocabulary when it is smaller); both axes are parallel, since no state crosses blocks (see
`common.py` for the two passes and the jnp steps between them). A vocabulary that the block does
not divide gets a partial last block: Pallas pads it with unspecified values, which the kernels
mask by id (`cols < V`) with a select, so neither garbage nor NaN can leak.

  pass 1: the (T, block_v) tile of target_logits[b] (T = R + 1 sublanes, the full dim) ->
          per position (max, sum exp, argmax), written as [T, 1] columns.
  pass 2: the same tile plus the (R, block_v) tile of draft_probs[b]; position a (scalar
          prefetch) is selected in VMEM with an iota-compare select and a sublane reduction (a
          BlockSpec cannot pick one row of a [T, V] slab: its last two dims must be (8, 128)
          multiples or whole), then the block sums of the residual and of exp(s - M).

Working set per grid step: 2 x (T + R) x block_v f32 double-buffered inputs (block_v = 8192,
R = 4: 576 KiB), far below every TPU's scoped VMEM. Traffic: (T + (T + R)) x V x 4 bytes per row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.spec_verify import common
from pallas_kernels.spec_verify.reference import scale_logits, validate_inputs

_LANES = 128
DEFAULT_BLOCK_V = 8192


def _block_size(vocab: int, block_v: int) -> int:
    if block_v < _LANES or block_v % _LANES:
        raise ValueError(f"TPU (8,128) tiling rule: block_v={block_v} must be a positive multiple "
                         f"of {_LANES} (the lane width), e.g. {max(block_v // _LANES, 1) * _LANES}")
    return vocab if vocab <= block_v else block_v  # a whole small vocabulary is one block


def _stats_kernel(
    # scalar prefetch
    temperature_ref,  # f32[B]
    # inputs
    x_ref,  # f32[T, blk] target logits of row b, block i
    # outputs
    m_ref, z_ref, idx_ref,  # f32 / f32 / i32 [T, 1]
    *, vocab: int, block_v: int,
):
    b, i = pl.program_id(0), pl.program_id(1)
    x = x_ref[...]
    cols = i * block_v + lax.broadcasted_iota(jnp.int32, x.shape, 1)
    s = jnp.where(cols < vocab, scale_logits(x, temperature_ref[b]), -jnp.inf)
    m = jnp.max(s, axis=1, keepdims=True)
    m_ref[...] = m
    z_ref[...] = jnp.sum(jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)), axis=1, keepdims=True)
    idx_ref[...] = jnp.min(jnp.where(s == m, cols, vocab), axis=1, keepdims=True)


def _select_row(tile, row):
    """tile[row] as [1, blk] via select + sublane sum (other rows may hold NaN)."""
    rows = lax.broadcasted_iota(jnp.int32, tile.shape, 0)
    return jnp.sum(jnp.where(rows == row, tile, 0.0), axis=0, keepdims=True)


def _residual_kernel(
    # scalar prefetch
    pos_ref, excl_ref, use_q_ref,  # i32[B]
    temperature_ref, row_max_ref, row_sum_ref,  # f32[B]
    # inputs
    x_ref,  # f32[T, blk]
    *refs,  # q_ref f32[R, blk] when draft_probs are given; outputs sum_r_ref, sum_e_ref f32[1, 1]
    vocab: int, block_v: int, has_q: bool,
):
    b, i = pl.program_id(0), pl.program_id(1)
    q_ref, sum_r_ref, sum_e_ref = refs if has_q else (None, *refs)
    pos = pos_ref[b]
    x = _select_row(x_ref[...], pos)
    cols = i * block_v + lax.broadcasted_iota(jnp.int32, x.shape, 1)
    scaled = jnp.where(cols < vocab, scale_logits(x, temperature_ref[b]), -jnp.inf)
    q = None
    if has_q:
        q = _select_row(q_ref[...], jnp.minimum(pos, q_ref.shape[0] - 1))
    r, e = common.residual(scaled, q, row_max_ref[b], row_sum_ref[b], use_q_ref[b],
                           excl_ref[b], cols)
    sum_r_ref[...] = jnp.sum(r, axis=1, keepdims=True)
    sum_e_ref[...] = jnp.sum(e, axis=1, keepdims=True)


def _pallas(kernel, grid, in_specs, out_specs, out_shape, num_scalar_prefetch, interpret, name):
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=num_scalar_prefetch,
                                               grid=grid, in_specs=in_specs, out_specs=out_specs),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name=name,
    )


@functools.partial(jax.jit, static_argnames=("block_v", "interpret"))
def _spec_verify_tpu(target_logits, draft_ids, draft_probs, num_draft, temperature, uniforms, *,
                     block_v: int, interpret):
    batch, t, vocab = target_logits.shape
    r = draft_ids.shape[1]
    blk = _block_size(vocab, block_v)
    num_blocks = pl.cdiv(vocab, blk)
    grid = (batch, num_blocks)
    sds = jax.ShapeDtypeStruct
    col = (batch, num_blocks, t, 1)
    col_spec = pl.BlockSpec((None, None, t, 1), lambda b, i, *_: (b, i, 0, 0))
    x_spec = pl.BlockSpec((None, t, blk), lambda b, i, *_: (b, 0, i))

    m, z, idx = _pallas(
        functools.partial(_stats_kernel, vocab=vocab, block_v=blk), grid, [x_spec],
        [col_spec] * 3, [sds(col, jnp.float32), sds(col, jnp.float32), sds(col, jnp.int32)],
        1, interpret, "spec_verify_stats",
    )(temperature, target_logits)
    row_max, row_sum, argmax = common.combine_stats(m[..., 0], z[..., 0], idx[..., 0], vocab)
    num_accepted, greedy_token, plan = common.accept_drafts(
        target_logits, draft_ids, draft_probs, num_draft, temperature, uniforms, row_max,
        row_sum, argmax)

    has_q = draft_probs is not None
    in_specs, inputs = [x_spec], [target_logits]
    if has_q:
        in_specs.append(pl.BlockSpec((None, r, blk), lambda b, i, *_: (b, 0, i)))
        inputs.append(draft_probs)
    one = pl.BlockSpec((None, None, 1, 1), lambda b, i, *_: (b, i, 0, 0))
    sum_r, sum_e = _pallas(
        functools.partial(_residual_kernel, vocab=vocab, block_v=blk, has_q=has_q), grid,
        in_specs, [one, one], [sds((batch, num_blocks, 1, 1), jnp.float32)] * 2,
        6, interpret, "spec_verify_residual",
    )(plan.pos, plan.excl, plan.use_q, temperature, plan.row_max, plan.row_sum, *inputs)
    sampled = common.draw(target_logits, draft_probs, temperature, uniforms[:, r], plan,
                          sum_r[:, :, 0, 0], sum_e[:, :, 0, 0], blk)
    return num_accepted, jnp.where(temperature <= 0, greedy_token, sampled)


def spec_verify_tpu(
    target_logits: jax.Array,  # f32[B, T, V], T = R + 1; padding positions may be NaN
    draft_ids: jax.Array,  # i32[B, R]
    draft_probs: jax.Array | None,  # f32[B, R, V] or None (one-hot drafter)
    num_draft: jax.Array,  # i32[B] in [0, R]
    temperature: jax.Array,  # f32[B], 0 = greedy
    uniforms: jax.Array,  # f32[B, R + 1] in [0, 1)
    *,
    block_v: int = DEFAULT_BLOCK_V,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
    """(num_accepted i32[B], next_token i32[B]) as `spec_verify_reference`.

    `block_v`: vocabulary ids per block (multiple of 128). `interpret`: False, True or
    `pltpu.InterpretParams` (CPU tests).
    """
    validate_inputs(target_logits, draft_ids, draft_probs, num_draft, temperature, uniforms)
    _block_size(target_logits.shape[-1], block_v)
    return _spec_verify_tpu(target_logits, draft_ids, draft_probs, num_draft, temperature,
                            uniforms, block_v=block_v, interpret=interpret)
