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


def split_model(model: nnx.Module) -> tuple[ModelGraph, dict]:
    """(static graph, params as a plain nested dict of arrays) — the steps' model arguments."""
    graphdef, state = nnx.split(model)
    return ModelGraph(graphdef), nnx.to_pure_dict(state)


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
        (chunk_len - 1)[None], num_pages_read=num_pages_read)
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
        attention_impl=attention_impl)
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
