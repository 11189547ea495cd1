"""The step descriptor: what one forward pass computes (docs/architecture.md, decision 2).

A step is N flat token rows. Every row is projected by the weights (one matmul over all N), writes
its K/V into the paged pool, and has its attention computed by a *query group*: a [G, T] block of
rows in which group row g attends over the pages of one page-table row, its T queries at
consecutive positions and causal among themselves. Which rows exist and how they are grouped is
the only difference between the engine's cases:

- decode: one row per slot; a DECODE group [B, 1] (slot b's row attends over slot b's pages);
- a prompt chunk: T rows of one sequence; a CHUNK group [1, T];
- a mixed step: B decode rows, then a chunk's T rows; both groups;
- a speculative verification: each slot's newest token and its drafts, packed as flat rows (only
  the real ones: a row with fewer drafts takes fewer); a DECODE group [B, R + 1] gathers them back
  per slot (queries past a slot's drafts repeat its last row; their outputs are not used);
- a forked sample's first token: no row at all, only a `logits_index` entry pointing at its
  parent's last prompt row;
- a speculative tree verification (`jaxinfer.config.DraftTree`): each slot's newest token (the
  root) and its draft tree's nodes; a DECODE group [B, T + 1] with a `tree` mask: node i is
  rotated at the root's position + its depth but written at the root's position + i (its
  slot, `StepBatch.write_positions`), and its query sees the context and its ancestors' slots.

With `attention_impl="xla"` every group runs the reference attention (CHUNK groups blocked over
their queries). With "pallas", a step that has a CHUNK group runs all its groups in one call of
the ragged flash kernel (each group row a sequence of consecutive flat rows), and a step without
one runs its DECODE groups through the paged decode kernel (which reads a row's pages once for
its T queries). Every index here is
a traced array; the shapes (N, G, T, M) and the static fields fix the compiled variant.

Example: slots 0 and 1 decode (positions 9 and 4) beside a 3-token chunk of slot 2 at 0..2:
  tokens/positions/slots: rows 0, 1 = the decodes (slots 0, 1), rows 2..4 = the chunk (slot 2);
  groups = (DECODE rows [[0], [1]], slots [0, 1], kv_lens [10, 5]),
           (CHUNK rows [[2, 3, 4]], slots [2], kv_lens [3]);
  out_index = [0, 1, 2, 3, 4] (group outputs concatenated in order: 2 decode rows, 3 chunk rows);
  logits_index = [0, 1, 4] (each decode row, and the chunk's last token).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

DECODE, CHUNK = "decode", "chunk"  # QueryGroup.kind


def _static(**kw):
    return dataclasses.field(metadata=dict(static=True), **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class QueryGroup:
    """G rows of T queries; group row g attends over page-table row `slots[g]` (see module doc).

    rows: i32[G, T] the flat row holding query (g, t).
    positions: i32[G, T] its position: consecutive along t (the decode kernel relies on it),
      except in a tree group.
    slots: i32[G] the page-table row each group row reads.
    kv_lens: i32[G] tokens in that row's cache after this step's writes.
    kind: static, DECODE (the newest tokens of a sequence: decode, verification) or CHUNK (a
      prompt chunk); which attention each kind gets: see the module doc.
    tree: i32[G, T, W] or None. A tree group's queries are nodes of draft trees: query (g, t)
      sits at positions[g, t] = base + its depth, depth = popcount(tree[g, t]) - 1, and sees
      the keys before base (the context) and the tree slots base + j whose bit j % 32 of word
      j // 32 is set (its ancestors and itself), below kv_lens[g]
      (`pallas_kernels.paged_attention.reference`, tree queries). DECODE groups only.
    """

    rows: jax.Array
    positions: jax.Array
    slots: jax.Array
    kv_lens: jax.Array
    tree: jax.Array | None = None
    kind: str = _static(default=DECODE)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBatch:
    """One forward pass over the paged pool: the model's only input besides the pool.

    tokens: i32[N] token ids; positions: i32[N] their positions in their sequences.
    valid: bool[N] the row writes its K/V (padding and idle rows write the trash page).
    slots: i32[N] the page-table row the row's K/V goes to.
    page_table: i32[B, P] every slot's pages.
    local_page_table: i32[B, P] every slot's local pages, read and written by the sliding-window
      layers of a hybrid pool (`jaxinfer.engine.kv_cache`); None: every layer uses page_table.
    write_positions: i32[N] the cache position each row's K/V is written at, where it differs
      from its position (a draft tree's nodes: their slots); None: `positions`.
    groups: the query groups; every row that matters is a query of exactly one of them.
    out_index: i32[N] where row n's attention output is in the groups' outputs, flattened
      ([G, T] each, row-major) and concatenated in order.
    logits_index: i32[M] the rows projected to logits (the model returns f32[M, V]).
    lora: i32[N] each row's LoRA adapter slot (`jaxinfer.model.lora`), -1 = the base model
      alone; None = every row the base model (also what a model without an adapter pool does).
    num_pages_read: static page bucket covering every group row's kv_lens (pages read per row).
    attention_impl: static, "xla" or "pallas" (resolved; see the module doc).
    """

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array
    slots: jax.Array
    page_table: jax.Array
    groups: tuple[QueryGroup, ...]
    out_index: jax.Array
    logits_index: jax.Array
    local_page_table: jax.Array | None = None
    lora: jax.Array | None = None
    write_positions: jax.Array | None = None
    num_pages_read: int = _static()
    attention_impl: str = _static(default="xla")

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def kv_positions(self) -> jax.Array:
        """i32[N] where each row's K/V goes (`write_positions`, else `positions`)."""
        return self.positions if self.write_positions is None else self.write_positions

    def for_layer(self, local: bool) -> StepBatch:
        """This step as one layer sees it: a local (sliding-window) layer of a hybrid pool
        reads and writes through the local table."""
        if not local or self.local_page_table is None:
            return self
        return dataclasses.replace(self, page_table=self.local_page_table)

    @classmethod
    def per_slot(cls, tokens: jax.Array, positions: jax.Array, valid: jax.Array,
                 page_table: jax.Array, kv_lens: jax.Array, *, num_pages_read: int,
                 logits_index: jax.Array | None = None, kind: str = DECODE,
                 attention_impl: str = "xla", local_page_table: jax.Array | None = None,
                 tree: jax.Array | None = None, write_positions: jax.Array | None = None
                 ) -> StepBatch:
        """B slots x T consecutive tokens each, padded: flat row b * T + t is (b, t), one group.

        tokens, positions: i32[B, T]; valid: bool[B, T]; page_table: i32[B, P]: slot b is
        page-table row b; kv_lens: i32[B] cache length after the step; logits_index: i32[B]
        the t projected for each slot, or None for every (b, t) (M = B x T, row-major);
        local_page_table: i32[B, P] hybrid pools' local table, or None. A tree group (draft
        tree nodes, `QueryGroup.tree`): tree i32[B, T, W] their masks, write_positions i32[B, T]
        their slots.
        """
        b, t = tokens.shape
        flat = jnp.arange(b * t, dtype=jnp.int32)
        slots = jnp.arange(b, dtype=jnp.int32)
        logits = flat if logits_index is None else slots * t + logits_index
        return cls(
            tokens=tokens.reshape(-1), positions=positions.reshape(-1), valid=valid.reshape(-1),
            slots=jnp.repeat(slots, t), page_table=page_table,
            local_page_table=local_page_table,
            write_positions=None if write_positions is None else write_positions.reshape(-1),
            groups=(QueryGroup(rows=flat.reshape(b, t), positions=positions, slots=slots,
                               kv_lens=kv_lens, tree=tree, kind=kind),),
            out_index=flat, logits_index=logits.astype(jnp.int32),
            num_pages_read=num_pages_read, attention_impl=attention_impl)
