"""Plain-jnp oracle of speculative verification (Chen et al. 2023), and the shared validator.

Per row b, with R = draft_ids.shape[1] drafts of which the first `num_draft[b]` are real:

* Greedy row (temperature 0): p_j is one-hot at the argmax of target_logits[b, j] (ties: lowest
  id). Draft j is accepted while draft_ids[b, j] equals that argmax (and j < num_draft[b]).
  next_token is the argmax at position a = num_accepted: the correction at the first rejection,
  or the bonus token at position num_draft[b] when every draft is accepted.
* Sampled row: p_j = softmax(target_logits[b, j] / temperature[b]), q_j = draft_probs[b, j] (or
  one_hot(draft_ids[b, j]) when draft_probs is None). For j = 0 .. num_draft-1 in order, draft
  d is accepted iff uniforms[b, j] * q_j(d) < p_j(d) (u < p/q, which also covers q_j(d) = 0). At
  the first rejection next_token is drawn from the residual max(p_j - q_j, 0), normalised; when its
  mass is at most RESIDUAL_EPS (p == q up to rounding) from p_j instead. If all num_draft drafts
  are accepted next_token is drawn from p_{num_draft} (the bonus token).
* Draws are inverse-CDF with u = uniforms[b, R]: the first id whose cumulative mass exceeds
  u * total mass, never an id of zero mass (rounding past the end picks the last positive id).

Positions j > num_draft[b] are padding (may hold NaN) and never affect the result: everything
read from them passes through a `where`, never an arithmetic mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A residual whose mass is <= this is rounding noise (p == q computed by two different softmaxes
# differ by a few ulps per token, ~1e-7 in total): draw from p instead. Exactness cost: a row with
# a true residual mass below 1e-5 is rejected with probability below 1e-5 in the first place.
RESIDUAL_EPS = 1e-5
_F32_MAX = float(jnp.finfo(jnp.float32).max)


def validate_inputs(target_logits, draft_ids, draft_probs, num_draft, temperature,
                    uniforms) -> None:
    """Static shape/dtype checks; each message names the bad argument and what would be valid."""
    if target_logits.ndim != 3:
        raise ValueError(f"target_logits must be f32[B, T, V] with T = R + 1; got shape "
                         f"{target_logits.shape}")
    batch, t, vocab = target_logits.shape
    if draft_ids.ndim != 2 or draft_ids.shape[0] != batch:
        raise ValueError(f"draft_ids must be i32[B={batch}, R]; got shape {draft_ids.shape}")
    r = draft_ids.shape[1]
    if r < 1 or t != r + 1:
        raise ValueError(f"need R >= 1 drafts and target_logits T = R + 1: draft_ids has R={r}, "
                         f"target_logits has T={t}; valid: T={r + 1} (and R >= 1)")
    if vocab < 1:
        raise ValueError(f"target_logits has an empty vocabulary: shape {target_logits.shape}")
    if draft_probs is not None and draft_probs.shape != (batch, r, vocab):
        raise ValueError(f"draft_probs must be f32[B={batch}, R={r}, V={vocab}] or None; got "
                         f"shape {draft_probs.shape}")
    for name, x, shape in (("num_draft", num_draft, (batch,)),
                           ("temperature", temperature, (batch,)),
                           ("uniforms", uniforms, (batch, r + 1))):
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {shape} (B={batch}, R={r}); got {x.shape}")
    dtypes = [("target_logits", target_logits, jnp.float32), ("draft_ids", draft_ids, jnp.int32),
              ("num_draft", num_draft, jnp.int32), ("temperature", temperature, jnp.float32),
              ("uniforms", uniforms, jnp.float32)]
    if draft_probs is not None:
        dtypes.append(("draft_probs", draft_probs, jnp.float32))
    for name, x, dtype in dtypes:
        if x.dtype != dtype:
            raise ValueError(f"{name} must be {jnp.dtype(dtype).name}; got {x.dtype}")


def scale_logits(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """logits / T (T <= 0 counts as 1), clipped to finite f32 so a tiny T cannot make +-inf.

    -inf (excluded tokens) stays -inf. Every implementation scales with this one formula so that
    they all see the same scaled values. logits: f32[...]; temperature broadcastable to it.
    """
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    return jnp.where(logits == -jnp.inf, -jnp.inf, jnp.clip(scaled, -_F32_MAX, _F32_MAX))


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b]] for x: [B, N, ...] and index: i32[B]."""
    return x[jnp.arange(x.shape[0]), index]


def _inverse_cdf(mass: jax.Array, u: jax.Array) -> jax.Array:
    """i32[B]: first id whose cumulative mass exceeds u * total, never a zero-mass id."""
    cdf = jnp.cumsum(mass, axis=-1)
    idx = jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1)
    iota = jnp.arange(mass.shape[-1])
    last_positive = jnp.max(jnp.where(mass > 0, iota, 0), axis=-1)
    return jnp.minimum(idx, last_positive).astype(jnp.int32)


def spec_verify_reference(
    target_logits: jax.Array,  # f32[B, T, V], T = R + 1; padding positions may be NaN
    draft_ids: jax.Array,  # i32[B, R]
    draft_probs: jax.Array | None,  # f32[B, R, V] proposals q_j, or None (one-hot drafter)
    num_draft: jax.Array,  # i32[B] in [0, R]
    temperature: jax.Array,  # f32[B], 0 = greedy
    uniforms: jax.Array,  # f32[B, R + 1] in [0, 1)
) -> tuple[jax.Array, jax.Array]:
    """Returns (num_accepted i32[B] in [0, num_draft], next_token i32[B]); see the module doc."""
    validate_inputs(target_logits, draft_ids, draft_probs, num_draft, temperature, uniforms)
    batch, _, vocab = target_logits.shape
    r = draft_ids.shape[1]
    greedy = temperature <= 0
    ids = jnp.clip(draft_ids, 0, vocab - 1)

    # target distributions p_j and greedy choices at every position
    scaled = scale_logits(target_logits, temperature[:, None, None])
    peak = jnp.max(scaled, axis=-1, keepdims=True)
    unnorm = jnp.exp(scaled - jnp.where(peak == -jnp.inf, 0.0, peak))
    p = unnorm / jnp.sum(unnorm, axis=-1, keepdims=True)  # [B, T, V]
    iota = jnp.arange(vocab)
    best = jnp.min(jnp.where(target_logits == jnp.max(target_logits, -1, keepdims=True), iota,
                             vocab), axis=-1)
    argmax = jnp.minimum(best, vocab - 1).astype(jnp.int32)  # [B, T]

    # acceptance of each draft, then the accepted prefix
    q = jax.nn.one_hot(ids, vocab, dtype=jnp.float32) if draft_probs is None else draft_probs
    p_d = jnp.take_along_axis(p[:, :r], ids[..., None], axis=-1)[..., 0]  # [B, R]
    q_d = jnp.take_along_axis(q, ids[..., None], axis=-1)[..., 0]
    ok = jnp.where(greedy[:, None], draft_ids == argmax[:, :r], uniforms[:, :r] * q_d < p_d)
    ok &= jnp.arange(r)[None, :] < num_draft[:, None]
    num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)

    # next token: residual at the first rejection, p itself for the bonus token
    p_a = _take(p, num_accepted)  # [B, V]
    q_a = _take(q, jnp.minimum(num_accepted, r - 1))
    rejected = num_accepted < num_draft
    residual = jnp.where(rejected[:, None], jnp.maximum(p_a - q_a, 0.0), p_a)
    empty = jnp.sum(residual, axis=-1) <= RESIDUAL_EPS
    sampled = _inverse_cdf(jnp.where(empty[:, None], p_a, residual), uniforms[:, r])
    next_token = jnp.where(greedy, _take(argmax, num_accepted), sampled)
    return num_accepted.astype(jnp.int32), next_token.astype(jnp.int32)
