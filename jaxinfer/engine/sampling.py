"""On-device token sampling: pure functions of per-row traced parameters (STYLE rule 16).

Every parameter is a per-row array, so one compiled function serves any mix of settings; the
only static argument is the width `num_top_logprobs` of the optional top-n output.

Pipeline for one decode step (the order of vLLM and Hugging Face):
  0. `apply_token_mask` (called by the engine): tokens a request's constraint forbids get -inf,
     so every mode below (greedy, temperature, top-k/p, min-p, penalties) sees only allowed ones.
  1. `apply_penalties` (called by the engine): repetition (HF), then presence / frequency (OpenAI).
  2. `sample`: temperature scaling, top-k, top-p, min-p (`filtered_probs`), then an
     inverse-CDF draw with one uniform per row from `fold_in(fold_in(key(0), seed), position)`,
     so a row's token depends only on its logits, parameters, seed and position (batch invariance).
     Greedy rows (temperature 0) take the argmax of the penalised logits; ties go to the lowest id.

Exactness: top-k and top-p are exact over the full vocabulary without a sort (a [64, 49152] sort
costs ~0.6 s on CPU). Thresholds are found by bisection over the float bit patterns (32 full
passes, each a compare and a sum), and top-k first tries `lax.top_k` with a static cap. Ties at a
top-k or top-p boundary are all kept (as HF `TopKLogitsWarper`), so a row's support never depends
on token order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sharding
from jaxinfer.config import SamplingConfig

# fold_in tags of the speculative randoms: the verifier's acceptance uniforms and the drafter's
# draws come from disjoint streams (`spec_uniforms`).
VERIFY_STREAM = 1 << 20
DRAFT_STREAM = 1 << 21
TOP_K_CAP = 64  # rows with top_k <= cap use lax.top_k; a batch with a larger k bisects instead
TOP_P_RTOL = 1e-6  # keep mass >= top_p * (1 - rtol): f32 softmax may put a mass == top_p 1 ulp low
_CDF_BLOCK = 256  # two-level inverse CDF: block sums, then a cumsum inside one block (at most)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling parameters, all traced. Neutral values switch a filter off."""

    temperature: jax.Array  # f32[B], 0 = greedy
    top_k: jax.Array  # i32[B], 0 = off (also off when >= V)
    top_p: jax.Array  # f32[B], 1 = off
    min_p: jax.Array  # f32[B], 0 = off
    repetition_penalty: jax.Array  # f32[B], 1 = off
    presence_penalty: jax.Array  # f32[B], 0 = off
    frequency_penalty: jax.Array  # f32[B], 0 = off
    seed: jax.Array  # i32[B]

    @classmethod
    def from_configs(cls, configs: Sequence[SamplingConfig | None]) -> SamplingParams:
        """Host-side batch of B configs (numpy arrays: the runner places them in one
        `device_put`, where a `jnp.asarray` per field would dispatch a program each); `None`
        rows (idle slots) get greedy defaults."""
        rows = [c if c is not None else SamplingConfig() for c in configs]
        return cls(**{
            f.name: np.array([getattr(c, f.name) for c in rows],
                             np.int32 if f.name in ("top_k", "seed") else np.float32)
            for f in dataclasses.fields(cls)})

    def any_penalty(self) -> jax.Array:
        """bool[]: some row has a penalty on (`SamplingConfig.has_penalties`, on device)."""
        return jnp.any((self.repetition_penalty != 1.0) | (self.presence_penalty != 0.0)
                       | (self.frequency_penalty != 0.0))

    def numpy(self) -> dict[str, np.ndarray]:
        """Host copies of every field, for logging and tests."""
        return {f.name: np.asarray(getattr(self, f.name)) for f in dataclasses.fields(self)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Result of `sample`. Logprobs are of the raw model logits (vLLM's default "raw logprobs"):
    before penalties, temperature and filters, so they do not depend on sampling settings."""

    tokens: jax.Array  # i32[B] chosen token ids
    logprobs: jax.Array  # f32[B] log_softmax(raw_logits)[token]
    top_ids: jax.Array  # i32[B, n] highest raw logprobs, descending; ties: lowest id first
    top_logprobs: jax.Array  # f32[B, n]


def apply_penalties(logits: jax.Array, output_counts: jax.Array, seen: jax.Array,
                    params: SamplingParams) -> jax.Array:
    """Repetition (HF `RepetitionPenaltyLogitsProcessor`), then presence/frequency (OpenAI, vLLM).

    Args:
      logits: f32[B, V] raw model logits.
      output_counts: i32[B, V] times each token was generated so far (prompt excluded).
      seen: bool[B, V] token occurs in the prompt or the output so far.
      params: per-row penalties.
    Returns:
      f32[B, V]: seen tokens get `logit * r` if the logit is < 0 else `logit / r`; then every
      token gets `- presence * (count > 0) - frequency * count`.
    """
    rep = params.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits < 0, logits * rep, logits / rep), logits)
    counts = output_counts.astype(jnp.float32)
    return (logits - params.presence_penalty[:, None] * (counts > 0)
            - params.frequency_penalty[:, None] * counts)


def apply_token_mask(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """Logits f32[..., V] with the tokens `allowed` forbids set to -inf; skipped when no row is
    constrained.

    Args:
      logits: f32[..., V].
      allowed: i32[..., W] packed masks, W = ceil(V / 32): bit j of word w allows token
        32 w + j (`jaxinfer.engine.constraints`); -1 (all ones) = unconstrained.
    Returns:
      f32[..., V]. A row whose mask allows no token (a constraint in an error state, which the
      host then finishes) is left unmasked rather than made all -inf (NaN probabilities).
    """
    vocab = logits.shape[-1]

    def masked():
        bits = (allowed[..., None] >> jnp.arange(32, dtype=jnp.int32)) & 1
        keep = bits.reshape(allowed.shape[:-1] + (-1,))[..., :vocab] == 1
        keep |= ~jnp.any(keep, axis=-1, keepdims=True)
        return jnp.where(keep, logits, -jnp.inf)

    return jax.lax.cond(jnp.any(allowed != -1), masked, lambda: logits)


def argmax_lowest(logits: jax.Array) -> jax.Array:
    """i32[B] argmax of f32[B, V]; ties pick the lowest id. Logits must be finite or -inf."""
    vocab = logits.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    best = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(logits == best, iota, vocab), axis=-1), vocab - 1)


def _bisect_max(lo: jax.Array, hi: jax.Array, ok) -> jax.Array:
    """Largest u32 t in [lo, hi] with ok(t), per row; ok must be monotone (true then false) and
    ok(lo) true. lo, hi: u32[B, 1]. 32 steps cover the whole u32 range."""

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo + 1) // 2
        good = ok(mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    return jax.lax.fori_loop(0, 32, step, (lo, hi))[0]


def _ordered_keys(x: jax.Array) -> jax.Array:
    """u32 keys whose unsigned order is the float order of x (f32, no NaN)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _kth_largest(x: jax.Array, k: jax.Array) -> jax.Array:
    """f32[B, 1] k-th largest value of each row of f32[B, V] (k: i32[B], 1 <= k <= V), exact.

    `lax.top_k` for a batch whose k are all within `TOP_K_CAP`, else bisection; on a split
    vocabulary (`vocab_shards`) always bisection: its passes are compares and sums over each
    chip's own part, and XLA:TPU compiles a per-chip top-k of an 8B vocabulary's 32064-id parts
    about as slowly as the whole rest of `sample`."""
    cap = min(TOP_K_CAP, x.shape[-1])

    def from_top_k(_):
        vals = top_k(x, cap)[0]
        return jnp.take_along_axis(vals, jnp.clip(k - 1, 0, cap - 1)[:, None], axis=-1)

    def from_bisection(_):
        keys = _ordered_keys(x)

        def count_ok(t):
            return jnp.sum(keys >= t, axis=-1, keepdims=True) >= k[:, None]

        lo = jnp.min(keys, axis=-1, keepdims=True)
        t = _bisect_max(lo, jnp.max(keys, axis=-1, keepdims=True), count_ok)
        return jnp.max(jnp.where(keys == t, x, -jnp.inf), axis=-1, keepdims=True)

    if vocab_shards(x.shape[-1]) > 1:
        return from_bisection(None)
    return jax.lax.cond(jnp.all(k <= cap), from_top_k, from_bisection, None)


def _top_p_threshold(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """f32[B, 1]: the largest p with sum(probs[probs >= p]) >= top_p (probs: f32[B, V] >= 0)."""
    target = (top_p * (1 - TOP_P_RTOL))[:, None]

    def mass_ok(t):
        thr = jax.lax.bitcast_convert_type(t, jnp.float32)
        return jnp.sum(jnp.where(probs >= thr, probs, 0.0), axis=-1, keepdims=True) >= target

    bits = jax.lax.bitcast_convert_type(probs, jnp.uint32)
    hi = jnp.max(bits, axis=-1, keepdims=True)
    t = _bisect_max(jnp.zeros_like(hi), hi, mass_ok)
    return jax.lax.bitcast_convert_type(t, jnp.float32)


def _sampled_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """f32[B, V] filtered distribution of every row, greedy rows treated as temperature 1."""
    batch, vocab = logits.shape
    active = params.temperature > 0
    scaled = logits / jnp.where(active, params.temperature, 1.0)[:, None]
    k_on = active & (params.top_k > 0) & (params.top_k < vocab)
    k = jnp.where(k_on, params.top_k, 1)
    kth = jax.lax.cond(jnp.any(k_on), lambda: _kth_largest(scaled, k),
                       lambda: jnp.full((batch, 1), -jnp.inf))
    probs = jax.nn.softmax(jnp.where((scaled >= kth) | ~k_on[:, None], scaled, -jnp.inf),
                           axis=-1)
    p_on = active & (params.top_p < 1)
    p_thr = jax.lax.cond(jnp.any(p_on), lambda: _top_p_threshold(probs, params.top_p),
                         lambda: jnp.zeros((batch, 1)))
    # Top-k's cut is not carried on: the ids it cut have probability exactly 0 (exp(-inf)),
    # so they stay 0 below. (XLA:TPU compiles the bool mask kept alive across the top-p
    # bisection markedly slower.) p / max p is unchanged by renormalising after top-p, so
    # min-p reads the same probs.
    keep = (((probs >= p_thr) | ~p_on[:, None])
            & (probs >= params.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)))
    kept = jnp.where(keep, probs, 0.0)
    return kept / jnp.sum(kept, axis=-1, keepdims=True)


def filtered_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The distribution `sample` draws from: f32[B, V], each row sums to 1.

    Args:
      logits: f32[B, V] penalised logits.
      params: per-row settings (penalties are not applied here).
    Returns:
      Sampled rows: softmax(logits / T), restricted to the top-k logits (ties at the k-th value
      kept), then to the smallest nucleus with mass >= top_p of that renormalised distribution
      (always >= 1 token, ties at the boundary kept), then to tokens with p >= min_p * max p;
      renormalised. Greedy rows (T == 0): one-hot at the lowest-id argmax.
    """
    greedy = jax.nn.one_hot(argmax_lowest(logits), logits.shape[-1], dtype=jnp.float32)
    return jnp.where((params.temperature > 0)[:, None], _sampled_probs(logits, params), greedy)


def row_uniforms(seed: jax.Array, positions: jax.Array) -> jax.Array:
    """f32[B] in [0, 1) from keys fold_in(fold_in(key(0), seed), position) (i32[B] each)."""

    def one(s, p):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s), p)
        return jax.random.uniform(key, ())

    return jax.vmap(one)(seed, positions)


def vocab_shards(vocab: int) -> int:
    """How many chips hold a part of a vocabulary of `vocab` ids under the context mesh (the
    `vocab` rule of `sharding.RULES`; 1 without a mesh or when they do not divide it). The
    [..., V] functions below work on chip-aligned parts: an op that needs a row's whole
    vocabulary on a split array (a reshape across a chip boundary, `lax.top_k`) makes XLA's
    partitioner all-gather every row's f32[V] onto every chip, and XLA:TPU compiles that
    several times slower."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else sharding.rule_shards("vocab", mesh)
    return shards if vocab % shards == 0 else 1


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` of f32[*R, V] (values descending, i32 ids), in two stages when the vocabulary
    is split (`vocab_shards`): each chip's top k of its own part, then the top k of those
    candidates (a superset of the whole row's top k), so only the candidates cross chips."""
    vocab = x.shape[-1]
    shards = vocab_shards(vocab)
    if shards == 1:
        vals, ids = jax.lax.top_k(x, k)
        return vals, ids.astype(jnp.int32)
    part = vocab // shards
    vals, ids = jax.lax.top_k(x.reshape(x.shape[:-1] + (shards, part)), min(k, part))
    ids = ids.astype(jnp.int32) + part * jnp.arange(shards, dtype=jnp.int32)[:, None]
    vals, best = jax.lax.top_k(vals.reshape(x.shape[:-1] + (-1,)), k)
    return vals, jnp.take_along_axis(ids.reshape(best.shape[:-1] + (-1,)), best, axis=-1)


def cdf_block(vocab: int) -> int:
    """The ids per block of `inverse_cdf` for a vocabulary of `vocab`: up to `_CDF_BLOCK`, and
    dividing each chip's part (`vocab_shards`), so no block straddles two chips (an 8B
    vocabulary on 4 chips: 32064 ids a chip, not a multiple of 256, but 501 blocks of 64)."""
    return math.gcd(vocab // vocab_shards(vocab), _CDF_BLOCK)


def inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """i32[B]: first id whose cumulative mass exceeds u * total, never a zero-probability id.

    Two levels so no [B, V] cumsum is needed: block sums pick a block, a cumsum inside it picks
    the id (`cdf_block` ids a block; each chip sums its own blocks). probs: f32[B, V] >= 0 with
    positive rows; u: f32[B] in [0, 1). Resolution: u has 23 random bits, so ids with
    probability below ~1.2e-7 are drawn at a rounded rate.
    """
    batch, vocab = probs.shape
    block = cdf_block(vocab)
    blocks = probs.reshape(batch, vocab // block, block)
    block_cdf = jnp.cumsum(jnp.sum(blocks, axis=-1), axis=-1)  # f32[B, V / block]
    r = u * block_cdf[:, -1]
    b = jnp.minimum(jnp.sum(block_cdf <= r[:, None], axis=-1), block_cdf.shape[-1] - 1)
    before = jnp.where(b > 0, jnp.take_along_axis(block_cdf, (b - 1)[:, None], -1)[:, 0], 0.0)
    inner = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]  # f32[B, block]
    idx = jnp.sum(jnp.cumsum(inner, axis=-1) <= (r - before)[:, None], axis=-1)
    iota = jnp.arange(block)
    last_positive = jnp.max(jnp.where(inner > 0, iota, 0), axis=-1)  # rounding past the end
    return (b * block + jnp.minimum(idx, last_positive)).astype(jnp.int32)


def sample(logits: jax.Array, params: SamplingParams, positions: jax.Array, *,
           raw_logits: jax.Array | None = None, num_top_logprobs: int = 0) -> SampleOutput:
    """Draw one token per row; pure and jit-friendly (`num_top_logprobs` is static).

    Args:
      logits: f32[B, V] penalised logits (`apply_penalties` output) the draw uses.
      params: per-row settings.
      positions: i32[B] index of the token being generated in its sequence; with `seed` it fixes
        the row's random number.
      raw_logits: f32[B, V] the model's logits before penalties, for logprobs; default `logits`.
      num_top_logprobs: static n of the top-n output (0 gives [B, 0] arrays).
    Returns:
      SampleOutput. If no row samples (all temperatures 0) only the argmax is computed.
    """
    raw_logits = logits if raw_logits is None else raw_logits
    greedy = argmax_lowest(logits)

    def draw(_):
        probs = _sampled_probs(logits, params)
        tokens = inverse_cdf(probs, row_uniforms(params.seed, positions))
        return jnp.where(params.temperature > 0, tokens, greedy)

    tokens = jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda _: greedy, None)
    return SampleOutput(tokens, *raw_logprobs(raw_logits, tokens, num_top_logprobs))


def raw_logprobs(logits: jax.Array, tokens: jax.Array, num_top: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprobs of the model's raw distribution (`SampleOutput`): of the chosen `tokens` i32[*R]
    under logits f32[*R, V], and the top `num_top` (static) ids and logprobs, descending.
    Returns (f32[*R], i32[*R, n], f32[*R, n])."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0] - lse
    if not num_top:
        shape = tokens.shape + (0,)
        return chosen, jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)
    top_vals, top_ids = top_k(logits, num_top)
    return chosen, top_ids, top_vals - lse[..., None]


def filter_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Logits with tokens outside each sampled row's top-k / top-p / min-p support set to -inf,
    so that softmax(result / T) is `filtered_probs`; skipped when no row filters."""
    on = (params.temperature > 0) & ((params.top_k > 0) | (params.top_p < 1)
                                     | (params.min_p > 0))
    return jax.lax.cond(
        jnp.any(on),
        lambda: jnp.where(on[:, None] & (_sampled_probs(logits, params) <= 0), -jnp.inf, logits),
        lambda: logits)


def spec_uniforms(seed: jax.Array, pos: jax.Array, num: int, stream: int) -> jax.Array:
    """f32[B, num] uniforms from key(seed) folded with the row's position and `stream + j`: a
    position's randoms are used once per request, and the drafter (DRAFT_STREAM) never sees the
    verifier's (VERIFY_STREAM), which the losslessness proof needs (q must not depend on the
    acceptance test's u)."""

    def one(s, p):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s), p)
        return jax.vmap(lambda j: jax.random.uniform(jax.random.fold_in(key, stream + j), ()))(
            jnp.arange(num))

    return jax.vmap(one)(seed, pos)
