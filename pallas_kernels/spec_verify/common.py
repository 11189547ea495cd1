"""The small jnp steps between the kernels' two vocabulary passes, shared by TPU and GPU.

Both kernels split the vocabulary into blocks of `block_v` ids and run two passes, each a map over
(row b, vocabulary block i) with no state carried between blocks (so every grid step is parallel):

  pass 1 (`block_stats`): for every position j of row b: the block's max m of the scaled logits,
      z = sum exp(s - m) over the block, and the lowest id attaining m (the greedy argmax).
  `combine_stats` + `accept_drafts` (here, on [B, T] numbers): merge the blocks (log-sum-exp),
      run the acceptance test of every draft, find a = num_accepted and what to draw from.
  pass 2 (`residual_sums`): at position a only, the block sums of the unnormalised residual
      r = max(e - q * Z, 0) (e = exp(s - M), Z = sum e: r / Z = max(p - q, 0)) and of e itself.
  `draw` (here): pick the block whose cumulative sum crosses u * total, gather that one block and
      finish the inverse CDF inside it.

Working unnormalised (u * q(d) * Z < e(d) instead of u * q(d) < e(d) / Z) makes the bonus draw
and the one-hot residual independent of Z's rounding; only the given-q residual uses Z.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.spec_verify.reference import RESIDUAL_EPS, scale_logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DrawPlan:
    """What pass 2 draws from, per row: the residual at position `pos` (or p itself)."""

    pos: jax.Array  # i32[B] position a = num_accepted
    excl: jax.Array  # i32[B] id zeroed in the residual (rejected one-hot draft) or -1
    use_q: jax.Array  # i32[B] 1: subtract q * Z (rejected draft with given draft_probs)
    row_max: jax.Array  # f32[B] M at position a (finite)
    row_sum: jax.Array  # f32[B] Z = sum exp(s - M) at position a


def residual(scaled, q, row_max, row_sum, use_q, excl, cols):
    """(r, e): unnormalised residual and exp(s - M) of a block; all args broadcast together.

    scaled: f32 scaled logits (-inf where excluded or past the vocabulary); q: f32 proposal
    values or None (one-hot drafter); cols: i32 token ids. Selects, never multiplies, a q that is
    unused (padding positions of draft_probs, and ids past the vocabulary in a partial block, may
    hold NaN): r <= e, so r is 0 wherever e is.
    """
    e = jnp.exp(scaled - row_max)
    r = e if q is None else jnp.where((use_q > 0) & (e > 0), jnp.maximum(e - q * row_sum, 0.0), e)
    return jnp.where(cols == excl, 0.0, r), e


def combine_stats(m, z, idx, vocab: int):
    """Merge per-block stats f32/f32/i32[B, nV, T] into (M f32[B, T] finite, Z, argmax i32)."""
    big_m = jnp.max(m, axis=1)
    big_m = jnp.where(big_m == -jnp.inf, 0.0, big_m)  # an all -inf (padding) position
    total = jnp.sum(jnp.where(m == -jnp.inf, 0.0, z * jnp.exp(m - big_m[:, None])), axis=1)
    arg = jnp.min(jnp.where(m == jnp.max(m, axis=1, keepdims=True), idx, vocab), axis=1)
    return big_m, total, jnp.minimum(arg, vocab - 1).astype(jnp.int32)


def accept_drafts(target_logits, draft_ids, draft_probs, num_draft, temperature, uniforms,
                  row_max, row_sum, argmax):
    """Acceptance of every draft from the combined stats ([B, T] each).

    Returns (num_accepted i32[B], greedy_token i32[B] = argmax at position a, DrawPlan).
    """
    batch, _, vocab = target_logits.shape
    r = draft_ids.shape[1]
    rows = jnp.arange(batch)
    ids = jnp.clip(draft_ids, 0, vocab - 1)
    x_d = jnp.take_along_axis(target_logits[:, :r], ids[..., None], axis=-1)[..., 0]
    e_d = jnp.exp(scale_logits(x_d, temperature[:, None]) - row_max[:, :r])
    q_d = (1.0 if draft_probs is None
           else jnp.take_along_axis(draft_probs, ids[..., None], axis=-1)[..., 0])
    ok = jnp.where((temperature <= 0)[:, None], draft_ids == argmax[:, :r],
                   uniforms[:, :r] * q_d * row_sum[:, :r] < e_d)
    ok &= jnp.arange(r)[None, :] < num_draft[:, None]
    num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    rejected = num_accepted < num_draft
    d_a = ids[rows, jnp.minimum(num_accepted, r - 1)]
    one_hot_rejected = rejected & (draft_probs is None)
    plan = DrawPlan(pos=num_accepted,
                    excl=jnp.where(one_hot_rejected, d_a, -1).astype(jnp.int32),
                    use_q=(rejected & (draft_probs is not None)).astype(jnp.int32),
                    row_max=row_max[rows, num_accepted], row_sum=row_sum[rows, num_accepted])
    return num_accepted, argmax[rows, num_accepted], plan


def draw(target_logits, draft_probs, temperature, u, plan: DrawPlan, sum_r, sum_e,
         block_v: int):
    """Inverse-CDF draw (u: f32[B]) from per-block sums f32[B, nV] of pass 2. Returns i32[B]."""
    batch, _, vocab = target_logits.shape
    rows = jnp.arange(batch)[:, None]
    use_p = jnp.sum(sum_r, axis=1) <= RESIDUAL_EPS * plan.row_sum  # empty residual: draw p
    sums = jnp.where(use_p[:, None], sum_e, sum_r)
    cdf = jnp.cumsum(sums, axis=1)
    target = u * cdf[:, -1]
    blocks = jnp.arange(sums.shape[1])
    k = jnp.sum(cdf <= target[:, None], axis=1)
    k = jnp.minimum(k, jnp.max(jnp.where(sums > 0, blocks, 0), axis=1))  # never an empty block
    before = jnp.where(k > 0, cdf[rows[:, 0], jnp.maximum(k - 1, 0)], 0.0)

    # the chosen block of position a, recomputed exactly as pass 2 did
    cols = k[:, None] * block_v + jnp.arange(block_v)[None, :]
    safe_cols = jnp.minimum(cols, vocab - 1)
    pos = plan.pos[:, None]
    x = target_logits[rows, pos, safe_cols]
    scaled = jnp.where(cols < vocab, scale_logits(x, temperature[:, None]), -jnp.inf)
    q = None
    if draft_probs is not None:
        q = draft_probs[rows, jnp.minimum(pos, draft_probs.shape[1] - 1), safe_cols]
    res, e = residual(scaled, q, plan.row_max[:, None], plan.row_sum[:, None],
                      plan.use_q[:, None], plan.excl[:, None], cols)
    mass = jnp.where(use_p[:, None], e, res)
    idx = jnp.sum(jnp.cumsum(mass, axis=1) <= (target - before)[:, None], axis=1)
    last_positive = jnp.max(jnp.where(mass > 0, jnp.arange(block_v)[None, :], 0), axis=1)
    return (k * block_v + jnp.minimum(idx, last_positive)).astype(jnp.int32)
