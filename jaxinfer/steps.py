"""The jitted entry points: `prefill_step` and `decode_step` (DESIGN.md decision 2).

Both are defined once, here, at module level. They take the model as (graph, params) from
`split_model` and merge inside the trace (weights are arguments, never closed-over constants),
donate the KV cache and the per-slot decode state and thread them back out, and sample on device.
Static arguments are only what changes shapes or code: the model graph, the page bucket
`num_pages_read`, the top-logprobs width. Every sampling parameter is a traced per-row array, so
no value of it ever recompiles.

Dispatch cost matters at batch 1 (a step is ~20 ms on CPU): params travel as a plain dict (a
pytree of 182 arrays flattens in ~18 us, an `nnx.State` in ~150 us) and the graph is wrapped in
`ModelGraph`, whose hash is computed once (hashing an NNX GraphDef costs ~0.4 ms, on every call).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxinfer.attention import pool_partition
from jaxinfer.kv_cache import KVCache
from jaxinfer.sampling import SampleOutput, SamplingParams, apply_penalties, sample


class ModelGraph:
    """A jit-static handle on a model's NNX GraphDef: hash computed once, identity-fast equality."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef: nnx.GraphDef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, ModelGraph) and self._hash == other._hash
                                 and self.graphdef == other.graphdef)


def split_model(model: nnx.Module, mesh=None) -> tuple[ModelGraph, dict]:
    """(static graph, params as a plain nested dict of device arrays) — the steps' model
    arguments. With a mesh, each weight goes from the host straight into its shards
    (`sharding.param_shardings`); otherwise onto the default device."""
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    if mesh is None:
        return ModelGraph(graphdef), jax.device_put(params)
    from jaxinfer.sharding import param_shardings

    return ModelGraph(graphdef), jax.device_put(params, param_shardings(model, mesh))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """Per-slot decode state kept on device between steps.

    tokens: i32[B] the last token of each slot (the next decode step's input).
    active: bool[B] slot is decoding; idle rows compute but write nothing and keep their state.
    output_counts: i32[B, V] generated-token counts (presence/frequency penalties).
    seen: bool[B, V] tokens in prompt or output (repetition penalty).
    """

    tokens: jax.Array
    active: jax.Array
    output_counts: jax.Array
    seen: jax.Array

    def replace(self, **changes) -> SlotState:
        return dataclasses.replace(self, **changes)


def create_slot_state(max_slots: int, vocab_size: int) -> SlotState:
    return SlotState(
        tokens=jnp.zeros((max_slots,), jnp.int32),
        active=jnp.zeros((max_slots,), bool),
        output_counts=jnp.zeros((max_slots, vocab_size), jnp.int32),
        seen=jnp.zeros((max_slots, vocab_size), bool),
    )


def _penalize(logits, counts, seen, params: SamplingParams):
    """Applies penalties only when some row asks for them (an all-default batch skips the pass)."""
    any_penalty = jnp.any((params.repetition_penalty != 1.0) | (params.presence_penalty != 0.0)
                          | (params.frequency_penalty != 0.0))
    return jax.lax.cond(any_penalty, lambda: apply_penalties(logits, counts, seen, params),
                        lambda: logits)


def _row(params: SamplingParams, slot: jax.Array) -> SamplingParams:
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1), params)


@functools.partial(jax.jit, static_argnames=("graph", "num_pages_read", "num_top_logprobs"),
                   donate_argnames=("cache", "state"))
def prefill_step(graph: ModelGraph, params: dict, cache: KVCache, state: SlotState,
                 sampling: SamplingParams, tokens: jax.Array, slot: jax.Array, start: jax.Array,
                 chunk_len: jax.Array, is_last: jax.Array, *, num_pages_read: int,
                 num_top_logprobs: int = 0) -> tuple[KVCache, SlotState, SampleOutput]:
    """Prefills one chunk of one slot's prompt, written at any start position.

    Args:
      tokens: i32[T] the chunk padded to its bucket T; only the first `chunk_len` are real.
      slot: i32[] the slot; start: i32[] position of tokens[0]; chunk_len: i32[] real tokens.
      is_last: bool[] last chunk of the prompt: the sampled token becomes the slot's first output
        token and the slot turns active. Otherwise the sample is returned but not recorded.
      num_pages_read: static page bucket covering start + chunk_len.
    Returns:
      (cache, state, SampleOutput with B = 1) — the token sampled after the chunk.
    """
    model = nnx.merge(graph.graphdef, params)
    t = tokens.shape[0]
    offsets = jnp.arange(t, dtype=jnp.int32)
    positions = (start + offsets)[None]
    valid = (offsets < chunk_len)[None]
    kv_len = start + chunk_len
    page_rows = jax.lax.dynamic_slice_in_dim(cache.page_table, slot, 1)
    logits, k_pages, v_pages = model(
        tokens[None], positions, valid, cache.k_pages, cache.v_pages, page_rows, kv_len[None],
        (chunk_len - 1)[None], num_pages_read=num_pages_read, pool_shards=cache.data_shards)
    cache = cache.replace(k_pages=k_pages, v_pages=v_pages,
                          lengths=cache.lengths.at[slot].set(kv_len))

    fresh = start == 0  # a new prompt: forget the slot's previous penalty state
    counts_row = jnp.where(fresh, 0, state.output_counts[slot])
    seen_row = jnp.where(fresh, False, state.seen[slot])
    seen_row = seen_row.at[jnp.where(valid[0], tokens, seen_row.shape[0])].set(True, mode="drop")
    row_params = _row(sampling, slot)
    penalized = _penalize(logits, counts_row[None], seen_row[None], row_params)
    out = sample(penalized, row_params, kv_len[None], raw_logits=logits,
                 num_top_logprobs=num_top_logprobs)
    tok = out.tokens[0]
    counts_row = counts_row.at[tok].add(is_last.astype(jnp.int32))
    seen_row = seen_row.at[tok].set(seen_row[tok] | is_last)
    state = state.replace(
        tokens=state.tokens.at[slot].set(jnp.where(is_last, tok, state.tokens[slot])),
        active=state.active.at[slot].set(is_last),
        output_counts=state.output_counts.at[slot].set(counts_row),
        seen=state.seen.at[slot].set(seen_row),
    )
    return cache, state, out


@functools.partial(jax.jit, static_argnames=("graph", "num_pages_read", "num_top_logprobs",
                                             "attention_impl"),
                   donate_argnames=("cache", "state"))
def decode_step(graph: ModelGraph, params: dict, cache: KVCache, state: SlotState,
                sampling: SamplingParams, *, num_pages_read: int, num_top_logprobs: int = 0,
                attention_impl: str = "xla") -> tuple[KVCache, SlotState, SampleOutput]:
    """Decodes one token for every slot: feeds `state.tokens`, samples the next ones.

    Idle slots (state.active False) run through the math on a dummy row but write no K/V, keep
    their length and their token. `num_pages_read` is the static page bucket covering
    max(lengths) + 1 over the active slots. `attention_impl` ("xla" | "pallas", resolved) picks
    the attention of this step.
    Returns:
      (cache, state, SampleOutput with B = max_slots); rows of idle slots are meaningless.
    """
    model = nnx.merge(graph.graphdef, params)
    active = state.active
    positions = cache.lengths[:, None]
    kv_lens = cache.lengths + active.astype(jnp.int32)
    logits, k_pages, v_pages = model(
        state.tokens[:, None], positions, active[:, None], cache.k_pages, cache.v_pages,
        cache.page_table, kv_lens, jnp.zeros_like(kv_lens), num_pages_read=num_pages_read,
        attention_impl=attention_impl, pool_shards=cache.data_shards)
    cache = cache.replace(k_pages=k_pages, v_pages=v_pages, lengths=kv_lens)
    penalized = _penalize(logits, state.output_counts, state.seen, sampling)
    out = sample(penalized, sampling, kv_lens, raw_logits=logits,
                 num_top_logprobs=num_top_logprobs)
    rows = jnp.arange(active.shape[0])
    tokens = jnp.where(active, out.tokens, state.tokens)
    state = state.replace(
        tokens=tokens,
        output_counts=state.output_counts.at[rows, tokens].add(active.astype(jnp.int32)),
        seen=state.seen.at[rows, tokens].set(state.seen[rows, tokens] | active),
    )
    return cache, state, out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MixedBatch:
    """Host-built inputs of one `mixed_step` (small arrays, uploaded each step).

    page_table: i32[B, P] the slots' pages (the host allocator owns them).
    decode: bool[B] slot b decodes one token this step, fed from `SlotState.tokens`.
    decode_pos: i32[B] position of that token (= the slot's cache length before the step).
    decode_host: bool[B] the row's token comes from the host (`decode_tokens`) instead: a
      one-token prompt chunk of a request without penalties (e.g. a forked sample's last prompt
      token), run as a decode row rather than as a chunk of its own.
    fanout: bool[B] slot b computes no row but samples (with its own parameters, at position
      `decode_pos`) from the logits of the chunk's last token: a forked sample taking its first
      token from its parent's prompt chunk. Disjoint from `decode`.
    chunk_*: one prompt chunk of T tokens (T = 0: none) of slot `chunk_slot` at `chunk_start`;
      `chunk_len` real tokens; `chunk_samples`: it ends at the sequence's newest token, so the
      step samples the next one; `chunk_fresh`: first chunk of a sequence computed from token 0
      (resets the slot's penalty state); `chunk_prompt_len`: tokens at or past it are earlier
      outputs being recomputed after a preemption (they count for frequency penalties).
    """

    page_table: jax.Array
    decode: jax.Array
    decode_pos: jax.Array
    decode_host: jax.Array
    decode_tokens: jax.Array
    fanout: jax.Array
    chunk_tokens: jax.Array
    chunk_slot: jax.Array
    chunk_start: jax.Array
    chunk_len: jax.Array
    chunk_samples: jax.Array
    chunk_fresh: jax.Array
    chunk_prompt_len: jax.Array


@functools.partial(jax.jit, static_argnames=("graph", "num_pages_read", "num_top_logprobs",
                                             "attention_impl"),
                   donate_argnames=("cache", "state"))
def mixed_step(graph: ModelGraph, params: dict, cache: KVCache, state: SlotState,
               sampling: SamplingParams, batch: MixedBatch, *, num_pages_read: int,
               num_top_logprobs: int = 0, attention_impl: str = "xla"
               ) -> tuple[KVCache, SlotState, SampleOutput]:
    """The serving engine's step: one decode token for each slot in `batch.decode` plus one
    prompt chunk, in one pass over the weights (Sarathi-Serve's decode-maximal batch).

    Rows 0..B-1 of the output are the decode rows, row B is the chunk's sample (meaningful only
    if `chunk_samples`). `num_pages_read` is the static page bucket covering every row's cache
    length after the step. Returns (cache, state, SampleOutput with B + 1 rows).
    """
    model = nnx.merge(graph.graphdef, params)
    b = batch.decode.shape[0]
    t = batch.chunk_tokens.shape[0]
    offsets = jnp.arange(t, dtype=jnp.int32)
    chunk_valid = offsets < batch.chunk_len
    chunk_kv_len = batch.chunk_start + batch.chunk_len
    chunk_row = jax.lax.dynamic_slice_in_dim(batch.page_table, batch.chunk_slot, 1)  # [1, P]
    tokens = jnp.concatenate([jnp.where(batch.decode_host, batch.decode_tokens, state.tokens),
                              batch.chunk_tokens])
    positions = jnp.concatenate([batch.decode_pos, batch.chunk_start + offsets])
    valid = jnp.concatenate([batch.decode, chunk_valid])
    token_rows = jnp.concatenate([batch.page_table, jnp.broadcast_to(chunk_row, (t,) +
                                                                     chunk_row.shape[1:])])
    decode_lens = batch.decode_pos + batch.decode.astype(jnp.int32)
    chunk_last = b + jnp.maximum(batch.chunk_len - 1, 0)
    logits_index = jnp.concatenate([
        jnp.where(batch.fanout, chunk_last, jnp.arange(b, dtype=jnp.int32)), chunk_last[None]])
    if t == 0:
        logits_index = jnp.arange(b + 1, dtype=jnp.int32).at[b].set(0)
    logits, k_pages, v_pages = model.mixed(
        tokens, positions, valid, token_rows, cache.k_pages, cache.v_pages, batch.page_table,
        decode_lens, chunk_row, chunk_kv_len[None], logits_index, num_pages_read=num_pages_read,
        attention_impl=attention_impl, pool_shards=cache.data_shards)
    cache = cache.replace(k_pages=k_pages, v_pages=v_pages, page_table=batch.page_table,
                          lengths=decode_lens)

    # The chunk's slot: penalty state over its tokens (reset on a fresh sequence).
    slot = batch.chunk_slot
    vocab = state.seen.shape[1]
    counts_row = jnp.where(batch.chunk_fresh, 0, state.output_counts[slot])
    seen_row = jnp.where(batch.chunk_fresh, False, state.seen[slot])
    seen_row = seen_row.at[jnp.where(chunk_valid, batch.chunk_tokens, vocab)].set(
        True, mode="drop")
    recomputed = chunk_valid & (batch.chunk_start + offsets >= batch.chunk_prompt_len)
    counts_row = counts_row.at[jnp.where(recomputed, batch.chunk_tokens, vocab)].add(
        1, mode="drop")
    all_counts = jnp.concatenate([state.output_counts, counts_row[None]])
    all_seen = jnp.concatenate([state.seen, seen_row[None]])
    all_params = jax.tree.map(lambda a: jnp.concatenate([a, a[slot][None]]), sampling)
    kv_lens = jnp.concatenate([decode_lens, chunk_kv_len[None]])
    penalized = _penalize(logits, all_counts, all_seen, all_params)
    out = sample(penalized, all_params, kv_lens, raw_logits=logits,
                 num_top_logprobs=num_top_logprobs)

    # Record the samples: decode (and fan-out) rows, then the chunk's (if it samples).
    rows = jnp.arange(b)
    took_row = batch.decode | batch.fanout
    new = jnp.where(took_row, out.tokens[:b], state.tokens)
    counts = state.output_counts.at[rows, new].add(took_row.astype(jnp.int32))
    seen = state.seen.at[rows, new].set(state.seen[rows, new] | took_row)
    tok = out.tokens[b]
    took = batch.chunk_samples & (t > 0)
    counts_row = counts_row.at[tok].add(took.astype(jnp.int32))
    seen_row = seen_row.at[tok].set(seen_row[tok] | took)
    touched = (t > 0) & (batch.chunk_len > 0)
    state = state.replace(
        tokens=new.at[slot].set(jnp.where(took, tok, new[slot])),
        active=took_row.at[slot].set(took_row[slot] | took),
        output_counts=counts.at[slot].set(jnp.where(touched, counts_row, counts[slot])),
        seen=seen.at[slot].set(jnp.where(touched, seen_row, seen[slot])),
    )
    return cache, state, out


# ----- speculative decoding (DESIGN.md decision 5) --------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyBatch:
    """Host-built inputs of one `verify_step`.

    page_table: i32[B, P] the slots' pages, covering positions [0, pos + num_draft] per row.
    active: bool[B] slot verifies this step; pos: i32[B] position of the slot's newest token
      (= its cache length before the step; the token itself is `SlotState.tokens`).
    draft_ids: i32[B, R] proposed tokens for positions pos + 1 ...; num_draft: i32[B] in [0, R]
      how many are real (0: a plain decode of one token).
    """

    page_table: jax.Array
    active: jax.Array
    pos: jax.Array
    draft_ids: jax.Array
    num_draft: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    """Per row: `tokens[:num_emitted]` are appended to the sequence (the accepted drafts, then
    the correction or bonus token); logprobs (raw, as `SampleOutput`) of those tokens."""

    tokens: jax.Array  # i32[B, R + 1]
    num_emitted: jax.Array  # i32[B], 1 + accepted drafts (0 for idle rows)
    logprobs: jax.Array  # f32[B, R + 1]
    top_ids: jax.Array  # i32[B, R + 1, n]
    top_logprobs: jax.Array  # f32[B, R + 1, n]


VERIFY_STREAM = 1 << 20  # fold_in tags: acceptance uniforms are independent of the drafter's


def spec_uniforms(seed: jax.Array, pos: jax.Array, num: int, stream: int) -> jax.Array:
    """f32[B, num] uniforms from key(seed) folded with the row's position and `stream + j`: a
    position's randoms are used once per request, and the drafter (another stream) never sees
    the verifier's, which the losslessness proof needs (q must not depend on the test's u)."""

    def one(s, p):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s), p)
        return jax.vmap(lambda j: jax.random.uniform(jax.random.fold_in(key, stream + j), ()))(
            jnp.arange(num))

    return jax.vmap(one)(seed, pos)


def _filter_mask(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Logits with tokens outside each sampled row's top-k / top-p / min-p support set to -inf,
    so that softmax(result / T) is `filtered_probs`; skipped when no row filters."""
    from jaxinfer.sampling import _sampled_probs

    on = (params.temperature > 0) & ((params.top_k > 0) | (params.top_p < 1)
                                     | (params.min_p > 0))
    return jax.lax.cond(
        jnp.any(on),
        lambda: jnp.where(on[:, None] & (_sampled_probs(logits, params) <= 0), -jnp.inf, logits),
        lambda: logits)


@functools.partial(jax.jit, static_argnames=("graph", "num_pages_read", "num_top_logprobs",
                                             "attention_impl", "num_rows"),
                   donate_argnames=("cache", "state"))
def verify_step(graph: ModelGraph, params: dict, cache: KVCache, state: SlotState,
                sampling: SamplingParams, batch: VerifyBatch, draft_probs: jax.Array | None, *,
                num_pages_read: int, num_top_logprobs: int = 0, attention_impl: str = "xla",
                num_rows: int = 0) -> tuple[KVCache, SlotState, VerifyOutput]:
    """Speculative verification (Chen et al. 2023) of every active slot in one pass.

    Row b feeds its newest token and its drafts, R + 1 tokens at positions pos .. pos + R,
    attending over its pages and causally among themselves, and writes their K/V. The target's
    R + 1 distributions (penalties applied as if each earlier draft were accepted, then the
    row's filters) decide with `pallas_kernels.spec_verify` (the kernel with "pallas", its jnp
    reference with "xla") how many drafts are accepted and the next token. Rejected positions
    are rolled back by length only: their K/V stays in the pages past the row's length, to be
    overwritten. `num_pages_read` covers pos + R + 1 of every active row. R (the width of
    `draft_ids`) is static; each row's `num_draft` is traced, so any mix, 0 included, runs on
    one compiled step. draft_probs: f32[B, R, V] the drafter's q, or None (one-hot drafts).

    num_rows: static; 0 feeds the model B x (R + 1) query tokens (every row as wide as the
    widest draft, the decode kernel's multi-query path with "pallas"). N > 0 feeds it a *ragged*
    batch to the weight matmuls instead: one flat row per real token, slot after slot (its
    newest token, then its num_draft drafts), N >= sum(num_draft + 1) over active rows, the
    rest padding; the K/V write and attention still run on the [B, R + 1] layout (queries
    gathered from the flat rows), which reads each row's pages once (`Llama.__call__`'s
    `ragged`). The projections and MLP then cost the rows the step has, not B x (R + 1) (where
    they are compute-bound, e.g. a CPU at batch 8). The [B, R + 1] logits are gathered back from
    the flat rows, so everything after the model is the same.
    """
    from pallas_kernels.spec_verify import spec_verify

    model = nnx.merge(graph.graphdef, params)
    b, r = batch.draft_ids.shape
    t = r + 1
    vocab = state.seen.shape[1]
    offsets = jnp.arange(t, dtype=jnp.int32)
    tokens = jnp.concatenate([state.tokens[:, None], batch.draft_ids], axis=1)  # [B, T]
    positions = batch.pos[:, None] + offsets
    real = offsets[None] <= batch.num_draft[:, None]
    valid = batch.active[:, None] & real
    kv_lens = jnp.where(batch.active, batch.pos + batch.num_draft + 1, 0)
    if num_rows:
        logits, k_pages, v_pages = _ragged_forward(
            model, cache, tokens, positions, valid, kv_lens, batch, num_rows,
            num_pages_read=num_pages_read, attention_impl=attention_impl)
    else:
        logits, k_pages, v_pages = model(
            tokens, positions, valid, cache.k_pages, cache.v_pages, batch.page_table, kv_lens,
            None, num_pages_read=num_pages_read, attention_impl=attention_impl, verify=True,
            pool_shards=cache.data_shards)  # [B, T, V]

    # Penalties at position j see the drafts before j as generated; then the row's filters.
    flat = lambda a: a.reshape((b * t,) + a.shape[2:])  # noqa: E731
    rows_params = jax.tree.map(lambda a: jnp.repeat(a, t, axis=0), sampling)

    def penalized():
        drafted = jax.nn.one_hot(jnp.where(offsets[None, :r] < batch.num_draft[:, None],
                                           batch.draft_ids, vocab), vocab, dtype=jnp.int32)
        prior = jnp.concatenate([jnp.zeros((b, 1, vocab), jnp.int32),
                                 jnp.cumsum(drafted, axis=1)], axis=1)  # [B, T, V]
        counts = state.output_counts[:, None] + prior
        seen = state.seen[:, None] | (prior > 0)
        return apply_penalties(flat(logits), flat(counts), flat(seen), rows_params)

    any_penalty = jnp.any((sampling.repetition_penalty != 1.0) | (sampling.presence_penalty != 0.0)
                          | (sampling.frequency_penalty != 0.0))
    target = jax.lax.cond(any_penalty, penalized, lambda: flat(logits))
    target = _filter_mask(target, rows_params).reshape(b, t, vocab)
    uniforms = spec_uniforms(sampling.seed, batch.pos, t, VERIFY_STREAM)
    accepted, next_token = spec_verify(
        target, batch.draft_ids, draft_probs, jnp.where(batch.active, batch.num_draft, 0),
        sampling.temperature, uniforms, impl="pallas" if attention_impl == "pallas" else "xla")

    drafts = jnp.concatenate([batch.draft_ids, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(offsets[None] < accepted[:, None], drafts, 0)
    out_tokens = jnp.where(offsets[None] == accepted[:, None], next_token[:, None], emitted)
    num_emitted = jnp.where(batch.active, accepted + 1, 0)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]; raw logprobs as in `sample`
    logprobs = jnp.take_along_axis(logits, out_tokens[..., None], axis=-1)[..., 0] - lse
    if num_top_logprobs:
        top_vals, top_ids = jax.lax.top_k(logits, num_top_logprobs)
        top_logprobs = top_vals - lse[..., None]
    else:
        top_ids = jnp.zeros((b, t, 0), jnp.int32)
        top_logprobs = jnp.zeros((b, t, 0), jnp.float32)

    # Roll forward by what was accepted: lengths, the slot's newest token, penalty state.
    kept = offsets[None] < num_emitted[:, None]  # [B, T]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    idx = jnp.where(kept, out_tokens, vocab)
    cache = cache.replace(k_pages=k_pages, v_pages=v_pages, page_table=batch.page_table,
                          lengths=jnp.where(batch.active, batch.pos + accepted + 1,
                                            cache.lengths))
    state = state.replace(
        tokens=jnp.where(batch.active, next_token, state.tokens),
        output_counts=state.output_counts.at[rows, idx].add(1, mode="drop"),
        seen=state.seen.at[rows, idx].set(True, mode="drop"),
    )
    out = VerifyOutput(tokens=out_tokens, num_emitted=num_emitted, logprobs=logprobs,
                       top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)
    return cache, state, out


def _ragged_forward(model, cache: KVCache, tokens: jax.Array, positions: jax.Array,
                    valid: jax.Array, kv_lens: jax.Array, batch: VerifyBatch, num_rows: int, *,
                    num_pages_read: int, attention_impl: str):
    """`verify_step`'s model pass over a ragged batch of `num_rows` flat rows (see there):
    tokens, positions, valid [B, T] in the padded layout. Returns (logits f32[B, T, V],
    k_pages, v_pages), position t of row b taken from its flat row (padding past num_draft
    repeats the row's last)."""
    b, t = tokens.shape
    width = jnp.where(batch.active, batch.num_draft + 1, 0)  # flat rows per slot
    end = jnp.cumsum(width)
    start = end - width
    flat = jnp.arange(num_rows, dtype=jnp.int32)
    slot = jnp.minimum(jnp.searchsorted(end, flat, side="right"), b - 1).astype(jnp.int32)
    offset = jnp.where(flat < end[-1], flat - start[slot], 0)
    offset = jnp.clip(offset, 0, t - 1)
    gather = jnp.clip(start[:, None] + jnp.minimum(jnp.arange(t)[None], batch.num_draft[:, None]),
                      0, num_rows - 1).astype(jnp.int32)  # [B, T]
    logits, k_pages, v_pages = model(
        tokens, positions, valid, cache.k_pages, cache.v_pages, batch.page_table, kv_lens, None,
        num_pages_read=num_pages_read, attention_impl=attention_impl, verify=True,
        pool_shards=cache.data_shards,
        ragged=(tokens[slot, offset], positions[slot, offset], gather, slot, offset))  # [N, V]
    return logits[gather], k_pages, v_pages


def ragged_rows(num_rows_needed: int, max_slots: int, width: int) -> int:
    """Static flat-row count of a ragged verification (`verify_step(num_rows=...)`) that needs
    `num_rows_needed` rows, for `max_slots` slots verified at `width` drafts: the next multiple
    of max_slots (at most width + 1 of them: the padded layout's rows), so a step pays for fewer
    than max_slots padding rows and each width has at most width + 1 compiled sizes."""
    return min(-(-num_rows_needed // max_slots), width + 1) * max_slots


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_pages(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copies pages src[i] -> dst[i] in every layer's K and V (copy-on-write of a forked
    sequence's partial last page). src, dst: i32[N]; pad with the trash page (last index) to
    keep N static. On a pool split over "data" each shard copies the pairs it holds (a
    fork's pages all lie in one shard) and sends the others to its trash page."""
    if cache.data_shards == 1:
        return cache.replace(k_pages=tuple(k.at[:, dst].set(k[:, src]) for k in cache.k_pages),
                             v_pages=tuple(v.at[:, dst].set(v[:, src]) for v in cache.v_pages))
    local = cache.k_pages[0].shape[1] // cache.data_shards  # per shard, its trash included

    def shard(src, dst, *pools):
        first = jax.lax.axis_index("data") * local
        s, d = src - first, dst - first
        ok = (s >= 0) & (s < local) & (d >= 0) & (d < local)
        s, d = jnp.where(ok, s, local - 1), jnp.where(ok, d, local - 1)
        return tuple(p.at[:, d].set(p[:, s]) for p in pools)

    spec = pool_partition(cache.k_pages[0].shape[0])
    pools = cache.k_pages + cache.v_pages
    out = jax.shard_map(shard, in_specs=(P(), P()) + (spec,) * len(pools),
                        out_specs=(spec,) * len(pools), check_vma=False)(src, dst, *pools)
    n = len(cache.k_pages)
    return cache.replace(k_pages=tuple(out[:n]), v_pages=tuple(out[n:]))
