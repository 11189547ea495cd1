"""The device steps (docs/architecture.md, decision 2): `mixed_step` and `verify_step`, plus the
page copy of forks (`copy_pages`).

Each step is two jitted functions, defined once, here, at module level, and run back to back
(both asynchronous):

- the forward (`mixed_forward`, `verify_forward`): the model as (graph, params) from
  `split_model`, merged inside the trace (weights are arguments, never closed-over constants),
  over one step descriptor (`jaxinfer.model.batch.StepBatch`) built from the step's small
  host-built inputs; the KV cache is donated and threaded back out; returns the logits.
- the sampling (`mixed_sample`, `verify_sample`): penalties, filters, the draw (or speculative
  acceptance) and the per-slot decode state (donated) on device.

They are apart because their variants differ: a forward compiles once per (chunk bucket, page
bucket) or (width, rows, page bucket), the sampling once per batch shape, so the sampling code
(about 0.6-0.9 s of XLA compile on CPU, 40% of a toy model's step and 15% of SmolLM2's; 5-9 s
for Llama-3.1-8B on TPU) is not compiled again for every page bucket or chunk bucket of the
warm-up: a prompt chunk reaches `mixed_sample` only as the [V] penalty rows the forward
computes from its tokens (`ChunkPenalty`). The logits and those rows pass between them in
device memory. Static arguments are only what changes shapes or code: the model graph, the
page bucket `num_pages_read`, the top-logprobs width, the attention implementation, and for
verification the flat row count. Every sampling parameter is a traced per-row array, so no
value of it ever recompiles. Nor does an argument's sharding: the runner hands every argument
over in one form (`ModelRunner`: device arrays committed to their one sharding, host inputs as
numpy arrays), and each step pins what it hands to the next (the pool, the slot state, the
logits, the penalty rows) to that same sharding (`sharding.constrain` with `cache_specs`,
`state_specs`, `sharding.vocab_last`, `penalty_specs`).

Dispatch cost matters at batch 1 (a step is ~20 ms on CPU): params travel as a plain dict (a
pytree of 182 arrays flattens in ~18 us, an `nnx.State` in ~150 us) and the graph is wrapped in
`ModelGraph`, whose hash is computed once (hashing an NNX GraphDef costs ~0.4 ms, on every call).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxinfer.config import DraftTree
from jaxinfer.engine import spec_tree
from jaxinfer.engine.kv_cache import KVCache, cache_specs, split_table
from jaxinfer.engine.sampling import (
    VERIFY_STREAM,
    SampleOutput,
    SamplingParams,
    apply_penalties,
    apply_token_mask,
    filter_logits,
    raw_logprobs,
    sample,
    spec_uniforms,
)
from jaxinfer.model import CHUNK, QueryGroup, StepBatch, quant
from jaxinfer.model.attention import pool_partition, trash_page
from jaxinfer.model.kv_quant import copy_pool_pages
from jaxinfer.sharding import (
    constrain,
    data_shards,
    named,
    param_shardings,
    place,
    vocab_last,
)

Call = Callable[..., object]  # call(jitted step function, *args, **kwargs) -> its outputs


def run(fn, *args, **kwargs):
    """The `Call` that runs a jitted step function (the engine's); an ahead-of-time check
    passes one that compiles it from abstract arguments instead (`jaxinfer.proof.aot`)."""
    return fn(*args, **kwargs)


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
    (`sharding.param_shardings`); otherwise onto the first device. On TPU and GPU int4 weights
    become native 4-bit there (`quant.native_int4_params`). An abstract model's
    (`Llama.abstract`) params are `jax.ShapeDtypeStruct`s carrying those shardings."""
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    shardings = named(None, P()) if mesh is None else param_shardings(model, mesh)
    if platform(mesh) == "tpu":
        shardings = _row_major(params, shardings)
    params = place(params, shardings)
    if quant.native_int4(platform(mesh)):
        params = quant.native_int4_params(model, params)
    return ModelGraph(graphdef), params


# Parameters whose readers need them row-major (the last axis minor, each row contiguous): the
# embedding table (a float [V, D], read by a row gather) and the quantized experts' scales and
# zeros (read by the grouped-matmul kernel, which takes row-major operands only). Not every
# quantized weight's: XLA reads the dense projections' scales in whatever layout it gave them,
# and forcing one on it adds a copy (measured: Qwen3-30B int4's qkv scales).
_ROW_MAJOR_LEAVES = ("scale", "zero")


def _row_major(params: dict, shardings):
    """`shardings` (one for all of `params`, or a tree like it) with the parameters that need
    it (an expert weight's `_ROW_MAJOR_LEAVES`, a float embedding) laid out row-major.
    XLA:TPU otherwise gives an array the layout that pads it least, column-major where the
    minor dims are awkward: a float table 2880 wide (gpt-oss), int4 expert scales of 6 groups
    (Qwen3-30B's down projection, [L, E, 6, D]); every step then copies the whole array into
    rows for its reader (measured in the compile check). jit compiles for the layout its
    committed arguments carry, so the steps read these in place."""
    from jax.experimental.layout import Format, Layout

    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, params)

    def pick(path, x, sharding):
        keys = [getattr(k, "key", None) for k in path]
        expert = any(str(k).startswith("experts") for k in keys)
        if (expert and keys[-1] in _ROW_MAJOR_LEAVES) or (keys == ["embed"] and x.ndim == 2):
            return Format(Layout(tuple(range(x.ndim))), sharding)
        return sharding

    return jax.tree_util.tree_map_with_path(pick, params, shardings)


def platform(mesh=None) -> str:
    """The platform of `mesh`'s devices (None: of the first device)."""
    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    return device.platform


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


def state_specs(state: SlotState, mesh) -> SlotState:
    """Specs of the slot state: the per-token arrays split like the logits they are updated
    with (`sharding.vocab_last`), the rest replicated. Never split over "data" (`model._rows`)."""
    return SlotState(tokens=P(), active=P(), output_counts=vocab_last(state.output_counts, mesh),
                     seen=vocab_last(state.seen, mesh))


def _penalize(logits, counts, seen, params: SamplingParams):
    """Applies penalties only when some row asks for them (an all-default batch skips the pass)."""
    return jax.lax.cond(params.any_penalty(),
                        lambda: apply_penalties(logits, counts, seen, params), lambda: logits)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedBatch:
    """Host-built inputs of one `mixed_step` (small arrays, uploaded each step).

    page_table: i32[B, P] the slots' pages (the host allocator owns them); a hybrid pool's:
      i32[B, 2P], the local table after the global one (`kv_cache.split_table`).
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
      outputs being recomputed after a preemption (they count for frequency penalties);
      `chunk_next`: the token after the chunk where it is known (the target of its last row's
      prompt logprob, `mixed_step(prompt_logprobs=...)`), else 0.
    lora: i32[B] each slot's LoRA adapter slot (`jaxinfer.model.lora`; -1: the base model);
      None: every row the base model.
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
    chunk_next: jax.Array
    lora: jax.Array | None = None

    @classmethod
    def idle(cls, max_slots: int, pages_per_seq: int, chunk_size: int = 0) -> MixedBatch:
        """Nothing decodes; a chunk of `chunk_size` padding tokens (writes only the trash page):
        the warm-up's and a drafter's dummy step. `pages_per_seq`: the page-table input's width
        (`BatchBuilder.table_width`)."""
        zeros = np.zeros((max_slots,), np.int32)
        off = np.zeros((max_slots,), bool)
        return cls(page_table=np.zeros((max_slots, pages_per_seq), np.int32), decode=off,
                   decode_pos=zeros, decode_host=off, decode_tokens=zeros, fanout=off,
                   chunk_tokens=np.zeros((chunk_size,), np.int32), chunk_slot=np.int32(0),
                   chunk_start=np.int32(0), chunk_len=np.int32(0), chunk_samples=np.bool_(False),
                   chunk_fresh=np.bool_(False), chunk_prompt_len=np.int32(0),
                   chunk_next=np.int32(0), lora=np.full((max_slots,), -1, np.int32))

    def without_chunk_tokens(self) -> MixedBatch:
        """The batch as `mixed_sample` takes it: the chunk's tokens (i32[T]) left out, so
        that no input of the sampling has the chunk bucket's length (the forward hands it the
        chunk's penalty rows instead, `ChunkPenalty`)."""
        return dataclasses.replace(self, chunk_tokens=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkPenalty:
    """The prompt chunk's part of its slot's penalty state, computed by `mixed_forward` (whose
    executable is one per chunk bucket anyway), so that the sampling has no input of the
    chunk's length T and one `mixed_sample` executable serves every chunk bucket.

    counts: i32[V] occurrences of each token among the chunk's recomputed outputs (its tokens
      at or past `chunk_prompt_len`), added to the slot's output counts.
    seen: bool[V] the chunk's tokens, added to the slot's seen tokens.
    present: bool[] the step has a chunk (T > 0).
    """

    counts: jax.Array
    seen: jax.Array
    present: jax.Array


def chunk_penalty(batch: MixedBatch, vocab_size: int) -> ChunkPenalty:
    """The `ChunkPenalty` of `batch`'s prompt chunk (only its `chunk_len` real tokens count)."""
    t = batch.chunk_tokens.shape[0]
    offsets = jnp.arange(t, dtype=jnp.int32)
    valid = offsets < batch.chunk_len
    recomputed = valid & (batch.chunk_start + offsets >= batch.chunk_prompt_len)
    # Padding tokens index past the vocabulary: the scatters drop them.
    seen = jnp.zeros((vocab_size,), bool).at[
        jnp.where(valid, batch.chunk_tokens, vocab_size)].set(True, mode="drop")
    counts = jnp.zeros((vocab_size,), jnp.int32).at[
        jnp.where(recomputed, batch.chunk_tokens, vocab_size)].add(1, mode="drop")
    return ChunkPenalty(counts=counts, seen=seen, present=jnp.asarray(t > 0))


def penalty_specs(penalty: ChunkPenalty, mesh) -> ChunkPenalty:
    """Specs of a `ChunkPenalty`: its rows split like the slot state's (`state_specs`)."""
    return ChunkPenalty(counts=vocab_last(penalty.counts, mesh),
                        seen=vocab_last(penalty.seen, mesh), present=P())


def mixed_descriptor(batch: MixedBatch, last_tokens: jax.Array, *, num_pages_read: int,
                      attention_impl: str, prompt_rows: bool = False) -> StepBatch:
    """The model's view of a mixed step: B decode rows, then the chunk's T rows; a decode group
    [B, 1] and a chunk group [1, T]; logits for each decode row (a fan-out row: the chunk's last
    token's) and the chunk's last token (row B of the output; none without a chunk); with
    `prompt_rows`, then for every chunk row (rows B + 1 .. B + T: the prompt-logprob variant)."""
    b, t = batch.decode.shape[0], batch.chunk_tokens.shape[0]
    slots = jnp.arange(b, dtype=jnp.int32)
    offsets = jnp.arange(t, dtype=jnp.int32)
    chunk_pos = batch.chunk_start + offsets
    decode_lens = batch.decode_pos + batch.decode.astype(jnp.int32)
    groups = [QueryGroup(rows=slots[:, None], positions=batch.decode_pos[:, None], slots=slots,
                         kv_lens=decode_lens)]
    if t:
        groups.append(QueryGroup(rows=(b + offsets)[None], positions=chunk_pos[None],
                                 slots=batch.chunk_slot[None],
                                 kv_lens=(batch.chunk_start + batch.chunk_len)[None], kind=CHUNK))
        chunk_last = b + jnp.maximum(batch.chunk_len - 1, 0)
        logits_index = jnp.concatenate([jnp.where(batch.fanout, chunk_last, slots),
                                        chunk_last[None]] + ([b + offsets] if prompt_rows else []))
    else:  # without a chunk, row B (the chunk's sample) is unused: `mixed_forward` pads it
        logits_index = slots
    valid = jnp.concatenate([batch.decode, offsets < batch.chunk_len])
    row_slots = jnp.concatenate([slots, jnp.broadcast_to(batch.chunk_slot, (t,))])
    return StepBatch(
        tokens=jnp.concatenate([jnp.where(batch.decode_host, batch.decode_tokens, last_tokens),
                                batch.chunk_tokens]),
        positions=jnp.concatenate([batch.decode_pos, chunk_pos]), valid=valid, slots=row_slots,
        page_table=batch.page_table, groups=tuple(groups),
        out_index=jnp.arange(b + t, dtype=jnp.int32), logits_index=logits_index,
        lora=_row_adapters(batch.lora, row_slots, valid),
        num_pages_read=num_pages_read, attention_impl=attention_impl)


def _row_adapters(lora: jax.Array | None, row_slots: jax.Array, valid: jax.Array
                  ) -> jax.Array | None:
    """i32[N]: each row's adapter slot from its slot's (lora i32[B]); -1 for idle rows, so
    they add no adapter to the step. None: no adapters."""
    if lora is None:
        return None
    return jnp.where(valid, lora[row_slots], -1)


def mixed_step(graph: ModelGraph, params: dict, cache: KVCache, state: SlotState,
               sampling: SamplingParams, batch: MixedBatch, *, num_pages_read: int,
               num_top_logprobs: int = 0, attention_impl: str = "xla",
               allowed: jax.Array | None = None, prompt_logprobs: bool = False,
               feature_layers: tuple[int, ...] = (), call: Call = run) -> tuple:
    """The serving engine's step: one decode token for each slot in `batch.decode` plus one
    prompt chunk, in one pass over the weights (Sarathi-Serve's decode-maximal batch), then the
    samples (`mixed_forward`, then `mixed_sample`; the cache and the state are donated).

    Rows 0..B-1 of the output are the decode rows, row B is the chunk's sample (meaningful only
    if `chunk_samples`). `num_pages_read` is the static page bucket covering every row's cache
    length after the step. allowed: i32[B, W] each slot's packed token mask (structured
    output, `jaxinfer.engine.constraints`); None = all ones. call: how each jitted half is
    invoked (`Call`).

    prompt_logprobs: the prompt-logprob variant (a static flag, so ordinary steps keep
    projecting only the rows they sample from): every chunk row is projected too, and the
    forward returns, per chunk row i, the raw logprob of the token after it (chunk token i + 1,
    `chunk_next` for the last) and the top `num_top_logprobs`: only [T, n] leaves the device.

    feature_layers: the target layers whose hidden states a feature drafter reads
    (`Llama.with_features`), computed in the same pass.

    Returns (cache, state, SampleOutput with B + 1 rows, the chunk rows' SampleOutput with T
    rows (tokens: the scored tokens) or None without `prompt_logprobs`), and with
    `feature_layers` the features [B + T, F, D] of the step's rows (decode rows, then the chunk
    rows) after them.
    """
    cache, logits, penalty, prompt, feats = call(
        mixed_forward, graph, params, cache, state.tokens, batch, num_pages_read=num_pages_read,
        attention_impl=attention_impl,
        prompt_top_logprobs=num_top_logprobs if prompt_logprobs else None,
        feature_layers=feature_layers)
    if allowed is None:
        allowed = jnp.full((batch.decode.shape[0], -(-logits.shape[-1] // 32)), -1, jnp.int32)
    state, out = call(mixed_sample, state, sampling, batch.without_chunk_tokens(), logits,
                      penalty, allowed, num_top_logprobs=num_top_logprobs)
    return (cache, state, out, prompt) + ((feats,) if feature_layers else ())


@functools.partial(jax.jit, static_argnames=("graph", "num_pages_read", "attention_impl",
                                             "prompt_top_logprobs", "feature_layers"),
                   donate_argnames=("cache",))
def mixed_forward(graph: ModelGraph, params: dict, cache: KVCache, last_tokens: jax.Array,
                  batch: MixedBatch, *, num_pages_read: int, attention_impl: str = "xla",
                  prompt_top_logprobs: int | None = None, feature_layers: tuple[int, ...] = ()
                  ) -> tuple[KVCache, jax.Array, ChunkPenalty, SampleOutput | None,
                             jax.Array | None]:
    """The model pass of `mixed_step`: writes the step's K/V; returns (cache, logits
    f32[B + 1, V], the chunk's part of its slot's penalty state (`ChunkPenalty`), the chunk
    rows' prompt logprobs with the top `prompt_top_logprobs`, or None when that is None, the
    rows' features [B + T, F, D] of `feature_layers` or None when that is empty). last_tokens:
    i32[B] each slot's newest token (`SlotState.tokens`), the input of its decode row."""
    model = nnx.merge(graph.graphdef, params)
    prompt_rows = prompt_top_logprobs is not None
    step = _with_tables(cache, mixed_descriptor(batch, last_tokens,
                                                 num_pages_read=num_pages_read,
                                                 attention_impl=attention_impl,
                                                 prompt_rows=prompt_rows))
    logits, feats, k_pages, v_pages = model.with_features(step, cache.k_pages, cache.v_pages,
                                                          feature_layers)
    b = batch.decode.shape[0]
    if logits.shape[0] == b:
        # No chunk: row B, which no request reads, is zeros rather than a projected row. The
        # LM head is the largest weight, and at B = 1 XLA:CPU multiplies one row as a GEMV
        # but two as a GEMM that costs 1.5-2x as much (docs/benchmarks.md, "Speculative
        # decoding").
        logits = jnp.concatenate([logits, jnp.zeros_like(logits[:1])])
    cache = cache.replace(k_pages=k_pages, v_pages=v_pages, page_table=step.page_table,
                          local_page_table=step.local_page_table)
    prompt = None
    if prompt_rows:
        targets = jnp.concatenate([batch.chunk_tokens[1:], batch.chunk_next[None]])
        chunk_logits = constrain(logits[b + 1:], vocab_last)
        prompt = SampleOutput(targets, *raw_logprobs(chunk_logits, targets, prompt_top_logprobs))
        logits = logits[:b + 1]
    penalty = chunk_penalty(batch, logits.shape[-1])
    return (constrain(cache, cache_specs), constrain(logits, vocab_last),
            constrain(penalty, penalty_specs), prompt, feats if feature_layers else None)


def _with_tables(cache: KVCache, step: StepBatch) -> StepBatch:
    """`step` with its page-table input (the host's i32[B, P], or i32[B, 2P] for a hybrid pool)
    split into the global and the local table (`kv_cache.split_table`)."""
    table, local = split_table(cache, step.page_table)
    return dataclasses.replace(step, page_table=table, local_page_table=local)


@functools.partial(jax.jit, static_argnames=("num_top_logprobs",), donate_argnames=("state",))
def mixed_sample(state: SlotState, sampling: SamplingParams, batch: MixedBatch,
                 logits: jax.Array, penalty: ChunkPenalty, allowed: jax.Array, *,
                 num_top_logprobs: int = 0) -> tuple[SlotState, SampleOutput]:
    """The sampling of `mixed_step` from its logits f32[B + 1, V]: the slots' token masks
    (allowed: i32[B, W]; the chunk's row takes its slot's), penalties (over each slot's state,
    and for the chunk's slot the chunk's `penalty` too), the draws, and the slot state rolled
    forward. batch: the step's inputs without the chunk's tokens
    (`MixedBatch.without_chunk_tokens`), so one executable serves every chunk bucket."""
    # The chunk's slot: its penalty state (reset on a fresh sequence) plus the chunk's tokens.
    b = batch.decode.shape[0]
    slot = batch.chunk_slot
    counts_row = jnp.where(batch.chunk_fresh, 0, state.output_counts[slot]) + penalty.counts
    seen_row = jnp.where(batch.chunk_fresh, False, state.seen[slot]) | penalty.seen
    all_counts = jnp.concatenate([state.output_counts, counts_row[None]])
    all_seen = jnp.concatenate([state.seen, seen_row[None]])
    all_params = jax.tree.map(lambda a: jnp.concatenate([a, a[slot][None]]), sampling)
    decode_lens = batch.decode_pos + batch.decode.astype(jnp.int32)
    kv_lens = jnp.concatenate([decode_lens, (batch.chunk_start + batch.chunk_len)[None]])
    masked = apply_token_mask(logits, jnp.concatenate([allowed, allowed[slot][None]]))
    penalized = _penalize(masked, all_counts, all_seen, all_params)
    out = sample(penalized, all_params, kv_lens, raw_logits=logits,
                 num_top_logprobs=num_top_logprobs)

    # Record the samples: decode (and fan-out) rows, then the chunk's (if it samples).
    rows = jnp.arange(b)
    took_row = batch.decode | batch.fanout
    new = jnp.where(took_row, out.tokens[:b], state.tokens)
    counts = state.output_counts.at[rows, new].add(took_row.astype(jnp.int32))
    seen = state.seen.at[rows, new].set(state.seen[rows, new] | took_row)
    tok = out.tokens[b]
    took = batch.chunk_samples & penalty.present
    counts_row = counts_row.at[tok].add(took.astype(jnp.int32))
    seen_row = seen_row.at[tok].set(seen_row[tok] | took)
    touched = penalty.present & (batch.chunk_len > 0)
    state = state.replace(
        tokens=new.at[slot].set(jnp.where(took, tok, new[slot])),
        active=took_row.at[slot].set(took_row[slot] | took),
        output_counts=counts.at[slot].set(jnp.where(touched, counts_row, counts[slot])),
        seen=seen.at[slot].set(jnp.where(touched, seen_row, seen[slot])),
    )
    return constrain(state, state_specs), out


# ----- speculative decoding (docs/architecture.md, decision 5) ------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyBatch:
    """Host-built inputs of one `verify_step`.

    page_table: i32[B, P] the slots' pages, covering positions [0, pos + num_draft] per row.
    active: bool[B] slot verifies this step; pos: i32[B] position of the slot's newest token
      (= its cache length before the step; the token itself is `SlotState.tokens`).
    draft_ids: i32[B, R] proposed tokens for positions pos + 1 ...; num_draft: i32[B] in [0, R]
      how many are real (0: a plain decode of one token).
    lora: i32[B] each slot's LoRA adapter slot (-1: the base model); None: the base model.
    """

    page_table: jax.Array
    active: jax.Array
    pos: jax.Array
    draft_ids: jax.Array
    num_draft: jax.Array
    lora: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    """Per row: `tokens[:num_emitted]` are appended to the sequence (the accepted drafts, then
    the correction or bonus token); logprobs (raw, as `SampleOutput`) of those tokens."""

    tokens: jax.Array  # i32[B, R + 1] (a draft tree's: [B, D + 1])
    num_emitted: jax.Array  # i32[B], 1 + accepted drafts (0 for idle rows)
    logprobs: jax.Array  # f32[B, R + 1]
    top_ids: jax.Array  # i32[B, R + 1, n]
    top_logprobs: jax.Array  # f32[B, R + 1, n]
    path: jax.Array | None = None  # a draft tree's: i32[B, D] the accepted nodes, 0 past them


def verify_rows(num_real_rows: int, max_slots: int, width: int, *, ragged: bool) -> int:
    """The static flat-row count N of a `verify_step` at `width` drafts per slot: the padded
    max_slots x (width + 1), or with `ragged` the next multiple of max_slots covering the
    `num_real_rows` real tokens (at most the padded count), so a step pays for fewer than
    max_slots padding rows and each width has at most width + 1 compiled sizes."""
    padded = max_slots * (width + 1)
    if not ragged:
        return padded
    return min(-(-num_real_rows // max_slots) * max_slots, padded)


def _verify_descriptor(batch: VerifyBatch, last_tokens: jax.Array, num_rows: int, *,
                       num_pages_read: int, attention_impl: str, tree: DraftTree | None = None
                       ) -> tuple[StepBatch, jax.Array]:
    """The model's view of a verification: each active slot's newest token and its num_draft
    drafts as flat rows, slot after slot, then padding up to `num_rows`; one decode group
    [B, R + 1] (query t of slot b: its flat row, or its last one past its drafts). A draft
    tree's (R = T nodes): node t is written at its slot pos + t, rotated at pos + its depth, and
    the group's tree masks are the tree's ancestor bits (`spec_tree` module doc). Returns
    (the descriptor, gather i32[B, R + 1]: the flat row of (b, t))."""
    b, r = batch.draft_ids.shape
    t = r + 1
    offsets = jnp.arange(t, dtype=jnp.int32)
    tokens = jnp.concatenate([last_tokens[:, None], batch.draft_ids], axis=1)  # [B, T]
    slots_at = batch.pos[:, None] + offsets
    positions = slots_at if tree is None else batch.pos[:, None] + spec_tree.depths(tree)
    width = jnp.where(batch.active, batch.num_draft + 1, 0)  # flat rows per slot
    end = jnp.cumsum(width)
    start = end - width
    flat = jnp.arange(num_rows, dtype=jnp.int32)
    real = flat < end[-1]
    slot = jnp.minimum(jnp.searchsorted(end, flat, side="right"), b - 1).astype(jnp.int32)
    offset = jnp.clip(jnp.where(real, flat - start[slot], 0), 0, t - 1)
    gather = jnp.clip(start[:, None] + jnp.minimum(offsets[None], batch.num_draft[:, None]),
                      0, num_rows - 1).astype(jnp.int32)
    kv_lens = jnp.where(batch.active, batch.pos + batch.num_draft + 1, 0)
    masks = None if tree is None else jnp.broadcast_to(spec_tree.ancestor_bits(tree),
                                                       (b, t, tree.words))
    step = StepBatch(
        tokens=tokens[slot, offset], positions=positions[slot, offset], valid=real, slots=slot,
        page_table=batch.page_table,
        groups=(QueryGroup(rows=gather, positions=positions,
                           slots=jnp.arange(b, dtype=jnp.int32), kv_lens=kv_lens, tree=masks),),
        out_index=slot * t + offset, logits_index=flat,
        lora=_row_adapters(batch.lora, slot, real),
        num_pages_read=num_pages_read, attention_impl=attention_impl,
        write_positions=None if tree is None else slots_at[slot, offset])
    return step, gather


def _verify_targets(logits: jax.Array, state: SlotState, sampling: SamplingParams,
                    batch: VerifyBatch, tree: DraftTree | None = None) -> jax.Array:
    """f32[B, T, V] the target's logits at each position as acceptance sees them: penalties
    applied as if every earlier draft were accepted (they count as generated; in a draft tree,
    the node's ancestors), then the row's top-k / top-p / min-p filters."""
    b, t, vocab = logits.shape
    r = t - 1
    flat = lambda a: a.reshape((b * t,) + a.shape[2:])  # noqa: E731
    rows_params = jax.tree.map(lambda a: jnp.repeat(a, t, axis=0), sampling)

    def penalized():
        drafted = jax.nn.one_hot(jnp.where(jnp.arange(r)[None] < batch.num_draft[:, None],
                                           batch.draft_ids, vocab), vocab, dtype=jnp.int32)
        if tree is None:
            prior = jnp.concatenate([jnp.zeros((b, 1, vocab), jnp.int32),
                                     jnp.cumsum(drafted, axis=1)], axis=1)  # [B, T, V]
        else:
            prior = spec_tree.path_counts(drafted, tree)
        counts = state.output_counts[:, None] + prior
        seen = state.seen[:, None] | (prior > 0)
        return apply_penalties(flat(logits), flat(counts), flat(seen), rows_params)

    target = jax.lax.cond(sampling.any_penalty(), penalized, lambda: flat(logits))
    return filter_logits(target, rows_params).reshape(b, t, vocab)


def verify_step(graph: ModelGraph, params: dict, cache: KVCache, state: SlotState,
                sampling: SamplingParams, batch: VerifyBatch, draft_probs: jax.Array | None, *,
                num_rows: int, num_pages_read: int, num_top_logprobs: int = 0,
                attention_impl: str = "xla", allowed: jax.Array | None = None,
                tree: DraftTree | None = None, feature_layers: tuple[int, ...] = (),
                call: Call = run) -> tuple:
    """Speculative verification (Chen et al. 2023) of every active slot in one pass
    (`verify_forward`, then `verify_sample`; the cache and the state are donated).

    Slot b feeds its newest token and its drafts, num_draft + 1 tokens at positions pos ..,
    attending over its pages and causally among themselves, and writes their K/V. They are
    `num_rows` flat rows (static; `verify_rows`): the weight matmuls cost the real tokens, not
    B x (R + 1), where they are compute-bound (a CPU at batch 8); the attention still reads each
    slot's pages once for all its queries (`_verify_descriptor`). The target's distributions at
    the R + 1 positions (`_verify_targets`) decide with `pallas_kernels.spec_verify` (the kernel
    with "pallas", its jnp reference with "xla") how many drafts are accepted and the next
    token. Rejected positions are rolled back by length only: their K/V stays in the pages past
    the slot's length, to be overwritten. `num_pages_read` covers pos + R + 1 of every active
    slot. R (the width of `draft_ids`) is static; each slot's `num_draft` is traced, so any mix,
    0 included, runs on one compiled step. draft_probs: f32[B, R', V] the drafter's q at R' >= R
    drafts (the first R verified: a chain cut shorter than it was drafted), or None
    (one-hot drafts). allowed: i32[B, R + 1, W] the packed token mask at each position
    (structured output: the target's distribution is masked at every verified position, so
    acceptance is exact for the constrained distribution); None = all ones.
    feature_layers: as `mixed_step`'s. call: how each jitted half is invoked (`Call`).

    tree: a static draft tree (`jaxinfer.config.DraftTree`): draft_ids [B, T] are its nodes'
    tokens (the first num_draft real), draft_probs f32[B, E, V] the q of each node with
    children (`DraftTree.expanded`), allowed [B, T + 1, W] the mask at the root and each node;
    every node attends to the context and its ancestors, acceptance takes the longest path
    by `pallas_kernels.spec_verify.spec_verify_tree`, and the output's `path` names the
    accepted nodes, whose K/V the caller moves into place with `spec_tree.commit_path` before
    the slot's next step (their rows were written at the nodes' slots).

    Returns (cache, state, VerifyOutput), and with `feature_layers` the features
    [B, R + 1, F, D] of each slot's newest token and drafts after them.
    """
    cache, logits, feats = call(verify_forward, graph, params, cache, state.tokens, batch,
                                num_rows=num_rows, num_pages_read=num_pages_read,
                                attention_impl=attention_impl, tree=tree,
                                feature_layers=feature_layers)
    if allowed is None:
        allowed = jnp.full(logits.shape[:2] + (-(-logits.shape[-1] // 32),), -1, jnp.int32)
    state, out = call(verify_sample, state, sampling, batch, draft_probs, logits, allowed,
                      num_top_logprobs=num_top_logprobs,
                      kernel="pallas" if attention_impl == "pallas" else "xla", tree=tree)
    return (cache, state, out) + ((feats,) if feature_layers else ())


@functools.partial(jax.jit, static_argnames=("graph", "num_rows", "num_pages_read",
                                             "attention_impl", "tree", "feature_layers"),
                   donate_argnames=("cache",))
def verify_forward(graph: ModelGraph, params: dict, cache: KVCache, last_tokens: jax.Array,
                   batch: VerifyBatch, *, num_rows: int, num_pages_read: int,
                   attention_impl: str = "xla", tree: DraftTree | None = None,
                   feature_layers: tuple[int, ...] = ()
                   ) -> tuple[KVCache, jax.Array, jax.Array | None]:
    """The model pass of `verify_step`: writes the K/V of every slot's newest token and drafts;
    returns (cache, logits f32[B, R + 1, V], features [B, R + 1, F, D] of `feature_layers` or
    None when that is empty). last_tokens: i32[B] (`SlotState.tokens`)."""
    model = nnx.merge(graph.graphdef, params)
    step, gather = _verify_descriptor(batch, last_tokens, num_rows,
                                      num_pages_read=num_pages_read,
                                      attention_impl=attention_impl, tree=tree)
    step = _with_tables(cache, step)
    logits, feats, k_pages, v_pages = model.with_features(step, cache.k_pages, cache.v_pages,
                                                          feature_layers)
    cache = cache.replace(k_pages=k_pages, v_pages=v_pages, page_table=step.page_table,
                          local_page_table=step.local_page_table)
    return (constrain(cache, cache_specs), constrain(logits[gather], vocab_last),
            feats[gather] if feature_layers else None)


@functools.partial(jax.jit, static_argnames=("num_top_logprobs", "kernel", "tree"),
                   donate_argnames=("state",))
def verify_sample(state: SlotState, sampling: SamplingParams, batch: VerifyBatch,
                  draft_probs: jax.Array | None, logits: jax.Array, allowed: jax.Array, *,
                  num_top_logprobs: int = 0, kernel: str = "xla",
                  tree: DraftTree | None = None) -> tuple[SlotState, VerifyOutput]:
    """The acceptance of `verify_step` from its logits f32[B, R + 1, V] masked by allowed
    i32[B, R + 1, W] (`kernel`: "pallas" or "xla", the `spec_verify` implementation; a draft
    tree's: `spec_verify_tree`), and the slot state rolled forward by what was accepted."""
    from pallas_kernels.spec_verify import spec_verify, spec_verify_tree

    b, r = batch.draft_ids.shape
    t = r + 1
    if draft_probs is not None and tree is None:
        draft_probs = draft_probs[:, :r]
    target = _verify_targets(apply_token_mask(logits, allowed), state, sampling, batch, tree)
    uniforms = spec_uniforms(sampling.seed, batch.pos, t, VERIFY_STREAM)
    num_draft = jnp.where(batch.active, batch.num_draft, 0)
    path = None
    if tree is None:
        accepted, next_token = _whole_on_each_device(
            functools.partial(spec_verify, impl=kernel), kernel == "pallas",
            target, batch.draft_ids, draft_probs, num_draft, sampling.temperature, uniforms)
        drafts = batch.draft_ids
    else:
        path, accepted, next_token = spec_verify_tree(
            target, batch.draft_ids, draft_probs, num_draft, sampling.temperature, uniforms,
            parents=tree.parents)
        drafts = jnp.take_along_axis(batch.draft_ids, jnp.maximum(path - 1, 0), axis=1)
        logits = jnp.take_along_axis(  # the rows the emitted tokens were drawn from
            logits, jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path], 1)[..., None], 1)
        t = tree.max_depth + 1

    offsets = jnp.arange(t, dtype=jnp.int32)
    drafts = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(offsets[None] < accepted[:, None], drafts, 0)
    out_tokens = jnp.where(offsets[None] == accepted[:, None], next_token[:, None], emitted)
    num_emitted = jnp.where(batch.active, accepted + 1, 0)

    # Roll forward by what was accepted: the slot's newest token, penalty state.
    kept = offsets[None] < num_emitted[:, None]  # [B, T]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    idx = jnp.where(kept, out_tokens, state.seen.shape[1])
    state = state.replace(
        tokens=jnp.where(batch.active, next_token, state.tokens),
        output_counts=state.output_counts.at[rows, idx].add(1, mode="drop"),
        seen=state.seen.at[rows, idx].set(True, mode="drop"),
    )
    logprobs, top_ids, top_logprobs = raw_logprobs(logits, out_tokens, num_top_logprobs)
    out = VerifyOutput(tokens=out_tokens, num_emitted=num_emitted, logprobs=logprobs,
                       top_ids=top_ids, top_logprobs=top_logprobs, path=path)
    return constrain(state, state_specs), out


def _whole_on_each_device(fn, kernel: bool, *args):
    """fn(*args); for a Pallas kernel on a multi-device context mesh, run whole on every device
    (shard_map, every argument replicated): XLA's partitioner refuses a Mosaic kernel, and the
    acceptance of B rows is small beside the step (its inputs, f32[B, R + 1, V], are gathered
    from their vocab shards first)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not kernel or mesh.empty or mesh.size == 1:
        return fn(*args)
    return jax.shard_map(fn, in_specs=P(), out_specs=P(), check_vma=False)(*args)


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_pages(cache: KVCache, src: jax.Array, dst: jax.Array, local_src: jax.Array,
               local_dst: jax.Array) -> KVCache:
    """Copies pages src[i] -> dst[i] in every layer's K and V (a hybrid pool's local layers:
    local_src[i] -> local_dst[i]), an int8 pool's scales with them (copy-on-write of a forked
    sequence's partial last page). src, dst, local_src, local_dst: i32[N]; pad with a trash
    page to keep N static. A stacked pool (a scanned model's) copies every layer's pages in
    one go. On a pool split over "data" each shard copies the pairs it holds (a fork's pages
    all lie in one shard) and sends the others to its trash page."""
    shards = data_shards()

    def copy(pools, s, d):  # ((k_pages,), (v_pages,)): arrays or int8 pages + scales
        return tuple((copy_pool_pages(k, s, d),) for (k,) in pools)

    def shard(src, dst, pools):
        local = pools[0][0].shape[-3]  # pages of this shard's part, its trash included
        first = jax.lax.axis_index("data") * local
        s, d = src - first, dst - first
        ok = (s >= 0) & (s < local) & (d >= 0) & (d < local)
        trash = trash_page(pools[0][0])
        return copy(pools, jnp.where(ok, s, trash), jnp.where(ok, d, trash))

    def copy_pool(k_pages, v_pages, s, d):
        pools = ((k_pages,), (v_pages,))
        if shards > 1:
            spec = pool_partition(k_pages.shape[-4], stacked=cache.stacked)
            pools = jax.shard_map(shard, in_specs=(P(), P(), spec), out_specs=spec,
                                  check_vma=False)(s, d, pools)
        else:
            pools = copy(pools, s, d)
        return pools[0][0], pools[1][0]

    pools = [copy_pool(k, v, *((local_src, local_dst) if cache.is_local_pool(i) else (src, dst)))
             for i, (k, v) in enumerate(zip(cache.k_pages, cache.v_pages))]
    return constrain(cache.replace(k_pages=tuple(k for k, _ in pools),
                                   v_pages=tuple(v for _, v in pools)), cache_specs)
