"""Speculative verification for NVIDIA GPUs: two Pallas passes on the Triton backend.

Grid (b, i): one program per row and vocabulary block of `block_v` ids (a power of 2, as Triton
wants), so a B = 8, V = 128256 batch runs 8 x 126 programs per pass (block 1024) and fills the
SMs. No state crosses programs; `common.py` merges the blocks between the passes.

  pass 1: loads the [T_pad, block_v] tile of target_logits[b] (T_pad = T rounded up to a power
          of 2, masked rows) -> per position (max, sum exp, argmax) of the block.
  pass 2: loads one [block_v] slice of position a = num_accepted (a dynamic row index read from
          a per-row input) of target_logits[b] and draft_probs[b] -> the block sums of the
          residual and of exp(s - M). Traffic per row: (T + 2) x V x 4 bytes.

Loads past the vocabulary are masked (`other` = -inf / 0), so V need not be a multiple of the
block. `pltriton.CompilerParams` picks Triton (jax 0.10 defaults to Mosaic GPU on CUDA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.spec_verify import common
from pallas_kernels.spec_verify.reference import scale_logits, validate_inputs

# [T_pad, 1024] f32 per program is 32 values per thread at 8 warps (T_pad = 8): no spills.
DEFAULT_BLOCK_V = 1024


def _check_block(block_v: int) -> None:
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"Triton needs block_v to be a power of 2 >= 16 (Triton blocks must be "
                         f"powers of 2); got block_v={block_v}")


def _stats_kernel(
    # inputs
    temperature_ref,  # f32[1]
    x_ref,  # f32[T, V] target logits of row b
    # outputs
    m_ref, z_ref, idx_ref,  # f32 / f32 / i32 [T_pad]
    *, num_t: int, vocab: int, block_v: int,
):
    i = pl.program_id(1)
    t_pad = m_ref.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (t_pad, block_v), 0)
    cols = i * block_v + lax.broadcasted_iota(jnp.int32, (t_pad, block_v), 1)
    live = (rows < num_t) & (cols < vocab)
    x = pltriton.load(x_ref.at[pl.ds(0, t_pad), pl.ds(i * block_v, block_v)], mask=live,
                      other=-jnp.inf)
    s = jnp.where(live, scale_logits(x, temperature_ref[0]), -jnp.inf)
    m = jnp.max(s, axis=1)
    m_ref[...] = m
    z_ref[...] = jnp.sum(jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[:, None]), axis=1)
    idx_ref[...] = jnp.min(jnp.where(s == m[:, None], cols, vocab), axis=1)


def _residual_kernel(
    # inputs
    pos_ref, excl_ref, use_q_ref,  # i32[1]
    temperature_ref, row_max_ref, row_sum_ref,  # f32[1]
    x_ref,  # f32[T, V]
    *refs,  # q_ref f32[R, V] when draft_probs are given; outputs sum_r_ref, sum_e_ref f32[1]
    vocab: int, block_v: int, has_q: bool,
):
    i = pl.program_id(1)
    q_ref, sum_r_ref, sum_e_ref = refs if has_q else (None, *refs)
    pos = pos_ref[0]
    cols = i * block_v + lax.broadcasted_iota(jnp.int32, (block_v,), 0)
    live = cols < vocab
    x = pltriton.load(x_ref.at[pos, pl.ds(i * block_v, block_v)], mask=live, other=-jnp.inf)
    scaled = jnp.where(live, scale_logits(x, temperature_ref[0]), -jnp.inf)
    q = None
    if has_q:
        q_row = jnp.minimum(pos, q_ref.shape[0] - 1)
        q = pltriton.load(q_ref.at[q_row, pl.ds(i * block_v, block_v)], mask=live, other=0.0)
    r, e = common.residual(scaled, q, row_max_ref[0], row_sum_ref[0], use_q_ref[0], excl_ref[0],
                           cols)
    sum_r_ref[...] = jnp.full((1,), jnp.sum(r), jnp.float32)
    sum_e_ref[...] = jnp.full((1,), jnp.sum(e), jnp.float32)


def _row_spec():
    return pl.BlockSpec((1,), lambda b, i: (b,))


@functools.partial(jax.jit, static_argnames=("block_v", "interpret", "num_warps"))
def _spec_verify_gpu(target_logits, draft_ids, draft_probs, num_draft, temperature, uniforms, *,
                     block_v: int, interpret: bool, num_warps: int = 8):
    batch, t, vocab = target_logits.shape
    r = draft_ids.shape[1]
    num_blocks = pl.cdiv(vocab, block_v)
    t_pad = pl.next_power_of_2(t)
    grid = (batch, num_blocks)
    sds = jax.ShapeDtypeStruct
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    x_spec = pl.BlockSpec((None, t, vocab), lambda b, i: (b, 0, 0))

    stat_spec = pl.BlockSpec((None, None, t_pad), lambda b, i: (b, i, 0))
    stat = (batch, num_blocks, t_pad)
    m, z, idx = pl.pallas_call(
        functools.partial(_stats_kernel, num_t=t, vocab=vocab, block_v=block_v),
        grid=grid, in_specs=[_row_spec(), x_spec], out_specs=[stat_spec] * 3,
        out_shape=[sds(stat, jnp.float32), sds(stat, jnp.float32), sds(stat, jnp.int32)],
        compiler_params=params, interpret=interpret, name="spec_verify_stats_triton",
    )(temperature, target_logits)
    row_max, row_sum, argmax = common.combine_stats(m[..., :t], z[..., :t], idx[..., :t], vocab)
    num_accepted, greedy_token, plan = common.accept_drafts(
        target_logits, draft_ids, draft_probs, num_draft, temperature, uniforms, row_max,
        row_sum, argmax)

    has_q = draft_probs is not None
    in_specs, inputs = [x_spec], [target_logits]
    if has_q:
        in_specs.append(pl.BlockSpec((None, r, vocab), lambda b, i: (b, 0, 0)))
        inputs.append(draft_probs)
    sum_spec = pl.BlockSpec((None, None, 1), lambda b, i: (b, i, 0))
    sum_r, sum_e = pl.pallas_call(
        functools.partial(_residual_kernel, vocab=vocab, block_v=block_v, has_q=has_q),
        grid=grid, in_specs=[_row_spec()] * 6 + in_specs, out_specs=[sum_spec] * 2,
        out_shape=[sds((batch, num_blocks, 1), jnp.float32)] * 2,
        compiler_params=params, interpret=interpret, name="spec_verify_residual_triton",
    )(plan.pos, plan.excl, plan.use_q, temperature, plan.row_max, plan.row_sum, *inputs)
    sampled = common.draw(target_logits, draft_probs, temperature, uniforms[:, r], plan,
                          sum_r[..., 0], sum_e[..., 0], block_v)
    return num_accepted, jnp.where(temperature <= 0, greedy_token, sampled)


def spec_verify_gpu(
    target_logits: jax.Array,  # f32[B, T, V], T = R + 1; padding positions may be NaN
    draft_ids: jax.Array,  # i32[B, R]
    draft_probs: jax.Array | None,  # f32[B, R, V] or None (one-hot drafter)
    num_draft: jax.Array,  # i32[B] in [0, R]
    temperature: jax.Array,  # f32[B], 0 = greedy
    uniforms: jax.Array,  # f32[B, R + 1] in [0, 1)
    *,
    block_v: int = DEFAULT_BLOCK_V,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(num_accepted i32[B], next_token i32[B]) as `spec_verify_reference`.

    `block_v`: vocabulary ids per program (power of 2). `interpret=True` runs on CPU.
    """
    validate_inputs(target_logits, draft_ids, draft_probs, num_draft, temperature, uniforms)
    _check_block(block_v)
    return _spec_verify_gpu(target_logits, draft_ids, draft_probs, num_draft, temperature,
                            uniforms, block_v=block_v, interpret=interpret)
