"""Drafters for lossless speculative decoding (docs/architecture.md, decision 5; Chen et al. 2023).

A drafter proposes up to R tokens per decoding slot; the engine's `steps.verify_step` scores
them with the target in one pass and `pallas_kernels.spec_verify` accepts x with probability
min(1, p(x) / q(x)), resampling the first rejection from norm(max(p - q, 0)). The output has the
target's distribution whatever the drafter proposes, so a drafter only changes speed.

Four drafters, one interface (`Drafter`); the fourth, `jaxinfer.engine.eagle.EagleDrafter`,
drafts from the target's own hidden states with a trained head (EAGLE / EAGLE-3):

- `NGramDrafter` (prompt lookup, no model): the longest suffix of the sequence (max_n down to
  min_n tokens) that occurred earlier proposes the tokens that followed its latest occurrence.
  Its proposals are deterministic: q is one-hot (`one_hot = True`). It also drafts static
  trees (`jaxinfer.config.DraftTree`, `propose_tree`): a node's children are the distinct
  tokens that followed earlier occurrences of the suffix ending at the node.
- `ModelDrafter.from_model`: a separate small model sharing the target's tokenizer;
  `ModelDrafter.self_speculative`: the target's first k layers plus its final norm and head
  (LayerSkip-style self-speculation; the weights are the target's arrays, not copies).
  Each keeps its own paged KV pool with the *target's page table*: same page ids, same page
  size, so prefix sharing, preemption and rollback need no drafter bookkeeping. The drafter
  computes every token the target computes (`mirror` runs the target's prompt chunks through the
  draft), and each proposal re-feeds the slot's last two tokens, which fills the one position a
  fully accepted round leaves out. The draft samples from its own filtered distribution q with
  the request's temperature / top-k / top-p / min-p (penalties are not applied: any q is exact),
  using a random stream disjoint from the verifier's.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from numpy.lib.stride_tricks import sliding_window_view

from jaxinfer import sharding
from jaxinfer.config import CacheConfig, DraftTree, ModelConfig, SamplingConfig
from jaxinfer.engine import steps
from jaxinfer.engine.kv_cache import KVCache, cache_specs, split_table
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.sampling import (
    DRAFT_STREAM,
    SamplingParams,
    argmax_lowest,
    filtered_probs,
    inverse_cdf,
    spec_uniforms,
)
from jaxinfer.model import Llama, StepBatch
from jaxinfer.model.layers import kind_names


@dataclasses.dataclass
class DraftRow:
    """One decoding slot asking for drafts: its known tokens (prompt + output, the newest last,
    at position `pos`) and at most `max_draft` proposals."""

    slot: int
    tokens: list[int]
    pos: int
    max_draft: int


def chain_widths(r: int) -> list[int]:
    """The verification widths of chains of at most R drafts that vary in length: the powers
    of two below R, and R (a step verifies at the smallest covering its longest chain)."""
    return [w for w in (1 << i for i in range(r.bit_length())) if w < r] + [r]


class Drafter(abc.ABC):
    """Interface. `propose` returns (draft_ids [B, R], draft_probs f32[B, R, V] or None for
    one-hot proposals, num_draft i32[B] host array); rows not asked for have num_draft 0.
    variable_width: num_draft varies from step to step (host drafts; chains cut by
    confidence), so a step verifies at the smallest of `chain_widths` covering its longest;
    else every step verifies R."""

    one_hot: bool = True

    @property
    def variable_width(self) -> bool:
        return self.one_hot

    def set_sampling(self, configs) -> None:
        """The target's per-slot sampling configs (model drafters draw with them)."""
        return None

    def mirror(self, batch: steps.MixedBatch, num_pages_read: int, features=None) -> None:
        """Keeps the drafter's state in step with a target `mixed_step` (prompt chunks);
        host-only drafters have none. features: the step's rows' target features when the
        drafter reads any (`feature_layers`), else None."""
        return None

    def absorb(self, batch: steps.VerifyBatch, features, num_pages_read: int,
               accepted=None) -> None:
        """Keeps the drafter's state in step with a target `verify_step` of `batch` (the
        features of its rows, `feature_layers`); only a feature drafter has any to keep.
        accepted: a draft tree's verification's (path i32[B, D], num_emitted i32[B])
        (`steps.VerifyOutput`), None for chains."""
        return None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the drafter reads (`Llama.with_features`);
        none for drafters that read only tokens."""
        return ()

    def copy_pages(self, pairs, local_pairs=()) -> None:
        """Mirrors the target's page copies (forks; `local_pairs`: a hybrid pool's local pages)
        into the drafter's pool, if it has one."""
        return None

    @abc.abstractmethod
    def propose(self, rows: list[DraftRow], num_spec: int, max_slots: int,
                page_table: np.ndarray, num_pages_read: int):
        """Up to `num_spec` drafts for each row (at most `row.max_draft`)."""

    def propose_tree(self, rows: list[DraftRow], tree: DraftTree, max_slots: int,
                     page_table: np.ndarray, num_pages_read: int):
        """(node_ids i32[B, T], draft_probs f32[B, E, V] (the q each node with children,
        `DraftTree.expanded`, drew them from) or None for one-hot drafts, num_draft i32[B]
        host array) for a static draft tree: each row's first num_draft nodes are real (at
        most `row.max_draft`). Only the drafters of `config.TREE_METHODS` draft trees."""
        raise NotImplementedError(f"{type(self).__name__} does not draft trees")

    def warmup(self, num_spec: int, max_slots: int, pages_per_seq: int, page_buckets,
               prefill_variants, tree: DraftTree | None = None) -> None:
        """Compiles the drafter's device steps (nothing for host-only drafters): the draft
        (of `tree` when given, else of num_spec-token chains) at each of `page_buckets`, the
        mirror of each (MixedBatch, page bucket) of `prefill_variants`; `pages_per_seq`: the
        page-table input's width (`BatchBuilder.table_width`)."""
        return None

    @property
    def runners(self) -> list[ModelRunner]:
        """The runners of the drafter's own device steps (none for host-only drafters)."""
        return []

    def compiling(self, call: steps.Call) -> Drafter:
        """A twin that compiles its device steps through `call` instead of running them
        (`ModelRunner.compiling`); a host-only drafter is its own."""
        return self


class NGramDrafter(Drafter):
    """Prompt lookup decoding (Saxena 2023; vLLM's `ngram` method): match the last n tokens
    (n = max_n down to min_n) against the earlier sequence, prompt and output alike, and propose
    what followed the most recent match."""

    one_hot = True

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n; got min_n={min_n}, "
                             f"max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix of `tokens`; [] when no suffix of min_n tokens occurred before."""
        if k <= 0:
            return []
        arr = np.asarray(tokens, np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            windows = sliding_window_view(arr[:-1], n)  # starts 0 .. len - 1 - n
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []

    def propose(self, rows, num_spec, max_slots, page_table, num_pages_read):
        ids = np.zeros((max_slots, num_spec), np.int32)
        num = np.zeros((max_slots,), np.int32)
        for row in rows:
            found = self.lookup(row.tokens, min(row.max_draft, num_spec))
            ids[row.slot, :len(found)] = found
            num[row.slot] = len(found)
        return ids, None, num

    def continuations(self, tokens: list[int], k: int) -> list[int]:
        """Up to k distinct tokens that followed earlier occurrences of a suffix of `tokens`:
        longer suffixes first (max_n down to min_n), later occurrences first; the first is
        `lookup`'s first token."""
        arr = np.asarray(tokens, np.int64)
        out: list[int] = []
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            windows = sliding_window_view(arr[:-1], n)
            for start in np.flatnonzero((windows == arr[-n:]).all(axis=1))[::-1] + n:
                if int(arr[start]) not in out:
                    out.append(int(arr[start]))
                    if len(out) == k:
                        return out
        return out

    def propose_tree(self, rows: list[DraftRow], tree: DraftTree, max_slots: int,
                     page_table=None, num_pages_read=None
                     ) -> tuple[np.ndarray, None, np.ndarray]:
        """(node_ids i32[B, T], None: one-hot, num_draft i32[B]) for a static draft tree: node
        n's children take `continuations` of the row's tokens and n's path, in order. A node
        left without one (fewer continuations than children, or an unfilled parent) repeats
        its first sibling's token or its parent's (one-hot drafts: any token is exact, and a
        repeated sibling is never accepted); num_draft ends at the last filled node, at most
        `row.max_draft` (a prefix of the nodes is a subtree)."""
        t = tree.num_nodes
        ids = np.zeros((max_slots, t), np.int32)
        num = np.zeros((max_slots,), np.int32)
        for row in rows:
            tokens = np.zeros((t + 1,), np.int64)
            tokens[0] = row.tokens[-1]
            filled = np.zeros((t + 1,), bool)
            filled[0] = True
            for node in tree.expanded:
                if node > row.max_draft:
                    break
                kids = tree.children[node]
                found = []
                if filled[node]:
                    path = [int(tokens[a]) for a in tree.ancestors(node)[1:]]
                    found = self.continuations(row.tokens + path, len(kids))
                for j, child in enumerate(kids):
                    filled[child] = j < len(found)
                    tokens[child] = found[j] if filled[child] else tokens[kids[0] if j else node]
            last = int(np.flatnonzero(filled[:row.max_draft + 1])[-1])
            ids[row.slot] = tokens[1:]
            num[row.slot] = last
        return ids, None, num


class ModelDrafter(Drafter):
    """A small Llama-family model as the drafter (see the module docstring). Its `runner` holds
    its own pool in the target's layout (the target's page table addresses it)."""

    one_hot = False

    def __init__(self, graph: steps.ModelGraph, params: dict, config: ModelConfig,
                 cache: CacheConfig, max_slots: int, mesh=None, attention_impl="xla"):
        self.runner = ModelRunner(graph, params, config=config, cache=cache, max_slots=max_slots,
                                  mesh=mesh, attention_impl=attention_impl)

    @classmethod
    def from_model(cls, draft: Llama, target: ModelConfig, cache: CacheConfig, max_slots: int,
                   mesh=None, attention_impl="xla") -> ModelDrafter:
        """A separate draft model; it must share the target's vocabulary (tokenizer)."""
        if draft.config.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model vocab_size={draft.config.vocab_size} differs from the target's "
                f"{target.vocab_size}: a draft model must share the target's tokenizer")
        graph, params = steps.split_model(draft, mesh)
        return cls(graph, params, draft.config, cache, max_slots, mesh, attention_impl)

    @classmethod
    def self_speculative(cls, target_params: dict, target: ModelConfig, num_layers: int,
                         cache: CacheConfig, max_slots: int, mesh=None,
                         attention_impl="xla") -> ModelDrafter:
        """The target's first `num_layers` layers + final norm + head, sharing its arrays (a
        mixture's dense layers among them stay dense). A scanned target's stacks are shared
        whole: the draft's forward reads their first rows (`jaxinfer.model.layers`), so no
        layer's weights are copied."""
        if not 1 <= num_layers < target.num_layers:
            raise ValueError(f"self-speculative layers={num_layers} must be in "
                             f"[1, {target.num_layers - 1}] (the target has {target.num_layers})")
        config = dataclasses.replace(
            target, num_layers=num_layers,
            dense_layers=tuple(i for i in target.dense_layers if i < num_layers))
        graphdef, _ = nnx.split(Llama.abstract(config))
        params = dict(target_params)
        if config.scan_layers:
            params["layers"] = {name: target_params["layers"][name]
                                for name in kind_names(config)}
        else:
            params["layers"] = {i: target_params["layers"][i] for i in range(num_layers)}
        return cls(steps.ModelGraph(graphdef), params, config, cache, max_slots, mesh,
                   attention_impl)

    @property
    def runners(self) -> list[ModelRunner]:
        return [self.runner]

    def compiling(self, call: steps.Call) -> ModelDrafter:
        twin = copy.copy(self)
        twin.runner = self.runner.compiling(call)
        return twin

    def set_sampling(self, configs: list[SamplingConfig | None]) -> None:
        self.runner.set_sampling(configs)

    def mirror(self, batch, num_pages_read, features=None):
        self.runner.mixed(batch, num_pages_read)

    def copy_pages(self, pairs, local_pairs=()) -> None:
        self.runner.copy_pages(pairs, local_pairs)

    def propose(self, rows, num_spec, max_slots, page_table, num_pages_read):
        prev = np.zeros((max_slots, 2), np.int32)
        pos = np.zeros((max_slots,), np.int32)
        num = np.zeros((max_slots,), np.int32)
        for row in rows:
            prev[row.slot] = row.tokens[-2:] if len(row.tokens) >= 2 else [0, row.tokens[-1]]
            pos[row.slot] = row.pos
            num[row.slot] = min(row.max_draft, num_spec)
        ids, probs = self._draft(page_table, pos, prev, num, num_spec, num_pages_read)
        return ids, probs, num

    def _draft(self, page_table, pos, prev, num, num_spec, num_pages_read):
        r = self.runner
        page_table, pos, prev, num = r.host((page_table, pos, prev, num))
        with sharding.mesh_context(r.mesh):
            r.kv, ids, probs = r.call(
                draft_step, r.graph, r.params, r.kv, r.sampling, page_table, pos, prev, num,
                num_spec=num_spec, num_pages_read=num_pages_read,
                attention_impl=r.attention_impl)
        return ids, probs

    def warmup(self, num_spec, max_slots, pages_per_seq, page_buckets, prefill_variants,
               tree=None):
        table = np.zeros((max_slots, pages_per_seq), np.int32)
        zeros = np.zeros((max_slots,), np.int32)
        for pages in page_buckets:
            self._draft(table, zeros, np.zeros((max_slots, 2), np.int32), zeros, num_spec, pages)
        for batch, pages in prefill_variants:
            self.mirror(batch, pages)


def draw_draft(logits: jax.Array, sampling: SamplingParams, u: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """(proposal i32[B], q f32[B, V]): a draft token from the drafter's filtered distribution
    q of logits f32[B, V] with uniforms u f32[B] (greedy rows: the lowest-id argmax); every
    drafter with a q draws through it."""
    q = filtered_probs(logits, sampling)
    sampled = inverse_cdf(jnp.where(sampling.temperature[:, None] > 0, q, 1.0), u)
    tok = jnp.where(sampling.temperature > 0, sampled, argmax_lowest(logits))
    return tok.astype(jnp.int32), q


@functools.partial(jax.jit, static_argnames=("graph", "num_spec", "num_pages_read",
                                             "attention_impl"), donate_argnames=("cache",))
def draft_step(graph: steps.ModelGraph, params: dict, cache: KVCache, sampling: SamplingParams,
               page_table: jax.Array, pos: jax.Array, prev: jax.Array, num_draft: jax.Array, *,
               num_spec: int, num_pages_read: int, attention_impl: str = "xla"
               ) -> tuple[KVCache, jax.Array, jax.Array]:
    """R = num_spec draft tokens for every slot with num_draft > 0, autoregressively.

    prev: i32[B, 2] the slot's tokens at positions pos - 1 and pos (both are fed: the first
    restores the K/V a fully accepted round did not compute). Position j's proposal d_j is
    drawn from q_j, the draft's filtered distribution (one-hot argmax for greedy rows), with
    uniforms from (seed, pos, DRAFT_STREAM + j). K/V is written for positions pos - 1 ..
    pos + num_draft (the last draft's too); writes past that go to the trash page.
    `num_pages_read` covers pos + R + 1. Returns (cache, ids i32[B, R], q f32[B, R, V]).
    """
    model = nnx.merge(graph.graphdef, params)
    b = pos.shape[0]
    on = num_draft > 0
    uniforms = spec_uniforms(sampling.seed, pos, num_spec, DRAFT_STREAM)
    table, local_table = split_table(cache, page_table)

    def forward(tokens, positions, valid, kv_lens, logits_index, k_pages, v_pages):
        return model(StepBatch.per_slot(
            tokens, positions, valid, table, kv_lens, logits_index=logits_index,
            num_pages_read=num_pages_read, attention_impl=attention_impl,
            local_page_table=local_table), k_pages, v_pages)

    positions = pos[:, None] + jnp.array([-1, 0], jnp.int32)
    logits, k_pages, v_pages = forward(
        prev, jnp.maximum(positions, 0), on[:, None] & (positions >= 0), jnp.where(on, pos + 1, 0),
        jnp.ones((b,), jnp.int32), cache.k_pages, cache.v_pages)
    tok, q = draw_draft(logits, sampling, uniforms[:, 0])
    ids = jnp.zeros((b, num_spec), jnp.int32).at[:, 0].set(tok)
    probs = jnp.zeros((b, num_spec, q.shape[-1]), jnp.float32).at[:, 0].set(q)

    def body(j, carry):
        k_pages, v_pages, tok, ids, probs = carry
        write = on & (j <= num_draft)
        logits, k_pages, v_pages = forward(
            tok[:, None], (pos + j)[:, None], write[:, None], jnp.where(write, pos + j + 1, 0),
            jnp.zeros((b,), jnp.int32), k_pages, v_pages)
        col = jnp.minimum(j, num_spec - 1)
        tok, q = draw_draft(logits, sampling, uniforms[:, col])
        keep = j < num_spec
        ids = jnp.where(keep, ids.at[:, col].set(tok), ids)
        probs = jnp.where(keep, jax.lax.dynamic_update_slice_in_dim(probs, q[:, None], col, 1),
                          probs)
        return k_pages, v_pages, tok, ids, probs

    # j = num_spec only writes the K/V of the last draft (its logits are unused): a round whose
    # drafts are all accepted then leaves no position of the draft's pool stale, even if the
    # request ends or is preempted before its next round (its pages enter the prefix cache).
    k_pages, v_pages, _, ids, probs = jax.lax.fori_loop(
        1, num_spec + 1, body, (k_pages, v_pages, tok, ids, probs))
    cache = cache.replace(k_pages=k_pages, v_pages=v_pages)
    # ids and probs go to `verify_step`, in the shardings its runner places them in.
    return (sharding.constrain(cache, cache_specs), sharding.constrain(ids, sharding.whole),
            sharding.constrain(probs, sharding.vocab_last))
