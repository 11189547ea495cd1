"""`EagleDrafter`: speculative drafts from a feature-level draft head (`jaxinfer.model.eagle`;
docs/architecture.md, decision 19), on the device, lossless like every drafter (`speculative`
module doc).

State, all in one `KVCache` addressed by the *target's* page table (as `ModelDrafter`'s pool),
so prefix sharing, forks, preemption and rollback need no bookkeeping of the drafter's own:

- pool 0: the head layer's K/V; the entry at position j is computed from (g_{j-1}, t_j);
- pools 1 (K) and 2 (V): the hidden store, a one-kv-head pool whose two halves hold the target's
  hidden g_j = fc(f_j) at position j (its first and second D / 2 values). A position's entry and
  stored hidden depend only on tokens <= j, the property shared prefix pages need.

Each engine step keeps them in step with the target, which emits the features in the same pass
(`runner.ModelRunner.feature_layers`, no extra forward):

- `mirror` (after each prompt chunk): the chunk's hidden states into the store, and the head's
  entries for its positions (the first reads g_{s-1}: the previous chunk's, or a shared prefix
  page's);
- `propose` (one jitted `draft_step` per step): the entry at the newest token's position pos
  from (g_{pos-1}, t_pos), the first draft from its output, then R - 1 more entries from the
  head's own outputs and drafts (the chain); `propose_tree` (`draft_tree_step`): the same
  root, then a static draft tree expanded one depth at a time, its nodes' entries at their
  tree slots;
- `absorb` (after each verification): the verified rows' hidden states into the store, and the
  entries at pos + 1 .. pos + num_draft recomputed from the target's (not the head's)
  hidden, so every accepted position holds exactly what a prompt chunk would have written;
  the entry past the last accepted draft is recomputed by the next `propose` with the token
  the verification actually emitted. After a tree's verification the accepted path is
  absorbed as that chain (`absorb_tree_step`).

Drafts are drawn as `ModelDrafter`'s are: from the head's filtered distribution q (the request's
temperature / top-k / top-p / min-p; greedy rows: the argmax), with a random stream disjoint from
the verifier's; an EAGLE-3 head draws over its draft vocabulary and q is given to the verifier
over the target's (zero outside it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer import sharding
from jaxinfer.config import CacheConfig, DraftTree, SamplingConfig
from jaxinfer.engine import spec_tree, steps
from jaxinfer.engine.kv_cache import KVCache, cache_specs, create_cache
from jaxinfer.engine.sampling import (
    DRAFT_STREAM,
    SamplingParams,
    filtered_probs,
    inverse_cdf,
    spec_uniforms,
)
from jaxinfer.engine.speculative import Drafter, chain_widths, draw_draft
from jaxinfer.model import StepBatch
from jaxinfer.model.attention import on_pool_shards, trash_page, write_kv
from jaxinfer.model.eagle import EagleHead, HeadConfig
from jaxinfer.sharding import constrain, data_shards


def create_head_cache(config: HeadConfig, cache: CacheConfig, max_slots: int, *, mesh=None
                      ) -> KVCache:
    """The drafter's pools (module doc): the head layer's K/V in the cache's dtype, then the
    hidden store's two halves in the head's activation dtype, with the target's page count and
    page size (its page table addresses them)."""
    layer = config.layer
    cache = dataclasses.replace(cache, hybrid=False, num_local_pages=None)
    head = create_cache(layer, cache, max_slots, mesh=mesh)
    store_config = dataclasses.replace(layer, num_q_heads=1, num_kv_heads=1,
                                       head_dim=layer.embed_dim // 2)
    store = create_cache(store_config, cache, max_slots, mesh=mesh, dtype=layer.dtype)
    return head.replace(k_pages=head.k_pages + store.k_pages,
                        v_pages=head.v_pages + store.v_pages)


def exchange_hidden(cache: KVCache, g: jax.Array | None, batch: StepBatch
                    ) -> tuple[jax.Array, KVCache]:
    """The hidden store's one access per step: writes g [N, D] (unless None) at every valid
    row's (slot, position), then reads for every row the hidden at its position - 1 (zeros at
    position 0). Returns (g_prev [N, D], cache). On a pool split over "data" each shard
    handles the rows whose pages it holds (`attention.on_pool_shards`)."""
    k_store, v_store = cache.k_pages[1], cache.v_pages[1]
    d = 2 * k_store.shape[-1]
    new = jnp.zeros((batch.num_rows, d), k_store.dtype) if g is None else g
    heads = (new[:, None, :d // 2].astype(k_store.dtype),
             new[:, None, d // 2:].astype(k_store.dtype))

    def body(first_page, lo, hi, k, v, batch, layer):
        del layer
        page_size, width = k.shape[-2], batch.page_table.shape[1]
        trash = trash_page(k)

        def page_of(pos, ok):
            page = batch.page_table[batch.slots, jnp.clip(pos // page_size, 0, width - 1)]
            if first_page is not None:
                page = page - first_page
                ok = ok & (page >= 0) & (page < trash)
            return page, ok

        if g is not None:
            page, ok = page_of(batch.positions, batch.valid)
            k, v = write_kv(k, v, lo, hi, page, batch.positions % page_size, ok)
        prev = jnp.maximum(batch.positions - 1, 0)
        page, ok = page_of(prev, batch.positions > 0)
        page = jnp.where(ok, jnp.clip(page, 0, trash - 1), trash)
        out = jnp.concatenate([k[0, page, prev % page_size], v[0, page, prev % page_size]], -1)
        return jnp.where(ok[:, None], out, 0)[:, None], k, v

    if data_shards() > 1:
        out, k_store, v_store = on_pool_shards(body, heads, (k_store, v_store), batch)
    else:
        out, k_store, v_store = body(None, *heads, k_store, v_store, batch, None)
    cache = cache.replace(k_pages=(cache.k_pages[0], k_store), v_pages=(cache.v_pages[0], v_store))
    return out[:, 0], cache


def _head_rows(head: EagleHead, target, cache: KVCache, tokens: jax.Array, g_prev: jax.Array,
               batch: StepBatch) -> tuple[jax.Array, KVCache]:
    """The head's layer over the rows of `batch` (tokens i32[N], the previous positions'
    hidden g_prev [N, D]), its K/V written into pool 0: (outputs h [N, D], cache)."""
    e = head.embed_rows(target, tokens)
    h, k, v = head(e, g_prev, batch, cache.k_pages[0], cache.v_pages[0])
    return h, cache.replace(k_pages=(k, cache.k_pages[1]), v_pages=(v, cache.v_pages[1]))


def _models(graph, params, target_graph, target_params):
    return nnx.merge(graph.graphdef, params), nnx.merge(target_graph.graphdef, target_params)


def _table(cache: KVCache, page_table: jax.Array) -> jax.Array:
    """The global table of a step's page-table input (a hybrid target's is i32[B, 2P]): the
    head's pools have the target's global pages."""
    return page_table[:, :cache.pages_per_seq]


@functools.partial(jax.jit, static_argnames=("graph", "target_graph", "num_pages_read",
                                             "attention_impl"), donate_argnames=("cache",))
def mirror_step(graph: steps.ModelGraph, params: dict, target_graph: steps.ModelGraph,
                target_params: dict, cache: KVCache, batch: steps.MixedBatch, feats: jax.Array,
                *, num_pages_read: int, attention_impl: str = "xla") -> KVCache:
    """A target `mixed_step`'s rows into the drafter (module doc, `mirror`): feats [B + T, F,
    D_t] its rows' features (`steps.mixed_step`). Speculative mixed steps carry prompt chunks
    only (their decode rows are verification rows)."""
    head, target = _models(graph, params, target_graph, target_params)
    b = batch.decode.shape[0]
    step = steps.mixed_descriptor(batch, jnp.zeros((b,), jnp.int32),
                                  num_pages_read=num_pages_read, attention_impl=attention_impl)
    step = dataclasses.replace(step, page_table=_table(cache, step.page_table))
    g_prev, cache = exchange_hidden(cache, head.project(feats), step)
    _, cache = _head_rows(head, target, cache, step.tokens, g_prev, step)
    return constrain(cache, cache_specs)


def _absorb_chain(head: EagleHead, target, cache: KVCache, table: jax.Array, pos: jax.Array,
                  active: jax.Array, draft_ids: jax.Array, num: jax.Array, g: jax.Array, *,
                  num_pages_read: int, attention_impl: str) -> KVCache:
    """A verified chain into the drafter (module doc, `absorb`): g [B, R + 1, D] the target's
    hidden at positions pos .. pos + R (the newest token, then draft_ids i32[B, R]) goes into
    the store at pos .. pos + num, and the head's entries at pos + 1 .. pos + num (num i32[B];
    inactive rows write nothing) are recomputed from it."""
    b, t = g.shape[:2]
    offsets = jnp.arange(t, dtype=jnp.int32)
    positions = pos[:, None] + offsets
    num = jnp.where(active, num, 0)
    written = active[:, None] & (offsets[None] <= num[:, None])
    kv_lens = jnp.where(active, pos + num + 1, 0)
    store_rows = StepBatch.per_slot(jnp.zeros((b, t), jnp.int32), positions, written, table,
                                    kv_lens, num_pages_read=num_pages_read,
                                    attention_impl=attention_impl)
    _, cache = exchange_hidden(cache, g.reshape(b * t, -1), store_rows)
    rows = StepBatch.per_slot(draft_ids, positions[:, 1:], written[:, 1:], table, kv_lens,
                              num_pages_read=num_pages_read, attention_impl=attention_impl)
    _, cache = _head_rows(head, target, cache, draft_ids.reshape(-1),
                          g[:, :-1].reshape(b * (t - 1), -1), rows)
    return cache


@functools.partial(jax.jit, static_argnames=("graph", "target_graph", "num_pages_read",
                                             "attention_impl"), donate_argnames=("cache",))
def absorb_step(graph: steps.ModelGraph, params: dict, target_graph: steps.ModelGraph,
                target_params: dict, cache: KVCache, batch: steps.VerifyBatch, feats: jax.Array,
                *, num_pages_read: int, attention_impl: str = "xla") -> KVCache:
    """A `verify_step`'s rows into the drafter (module doc, `absorb`): feats [B, R + 1, F, D_t]
    the features of each slot's newest token and drafts (`steps.verify_step`)."""
    head, target = _models(graph, params, target_graph, target_params)
    b, t = feats.shape[:2]
    g = head.project(feats.reshape(b * t, *feats.shape[2:])).reshape(b, t, -1)
    cache = _absorb_chain(head, target, cache, _table(cache, batch.page_table), batch.pos,
                          batch.active, batch.draft_ids, batch.num_draft, g,
                          num_pages_read=num_pages_read, attention_impl=attention_impl)
    return constrain(cache, cache_specs)


@functools.partial(jax.jit, static_argnames=("graph", "target_graph", "num_pages_read",
                                             "attention_impl"), donate_argnames=("cache",))
def absorb_tree_step(graph: steps.ModelGraph, params: dict, target_graph: steps.ModelGraph,
                     target_params: dict, cache: KVCache, batch: steps.VerifyBatch,
                     feats: jax.Array, path: jax.Array, num_emitted: jax.Array, *,
                     num_pages_read: int, attention_impl: str = "xla") -> KVCache:
    """A draft tree's verification into the drafter: the accepted path absorbed as the chain
    it is. feats [B, T + 1, F, D_t] the features of each slot's root and nodes
    (`steps.verify_step` with a tree); path i32[B, D] the accepted nodes from the root down and
    num_emitted i32[B] (`steps.VerifyOutput`).

    The head's entries the tree draft wrote at the nodes' slots pos + i came from the head's
    own hidden and sit at tree slots, not positions; rather than move them (as `commit_path`
    moves the target's), the accepted path's entries are recomputed at pos + 1 .. pos + a from
    the target's features along the path, exactly what `absorb_step` writes for an accepted
    chain of the same tokens (and what a prompt chunk would write), so prefix sharing,
    preemption and the next draft see the same pool whichever way the tokens were drafted.
    Entries past pos + a (rejected nodes) are garbage past the slot's length."""
    head, target = _models(graph, params, target_graph, target_params)
    b, depth = path.shape
    along = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path], axis=1)  # [B, D + 1]
    chain = jnp.take_along_axis(feats, along[:, :, None, None], axis=1)  # [B, D + 1, F, D_t]
    g = head.project(chain.reshape(b * (depth + 1), *chain.shape[2:])).reshape(b, depth + 1, -1)
    ids = jnp.take_along_axis(batch.draft_ids, jnp.maximum(path - 1, 0), axis=1)
    cache = _absorb_chain(head, target, cache, _table(cache, batch.page_table), batch.pos,
                          batch.active, ids, jnp.maximum(num_emitted - 1, 0), g,
                          num_pages_read=num_pages_read, attention_impl=attention_impl)
    return constrain(cache, cache_specs)


def _draw(head: EagleHead, h: jax.Array, target, sampling: SamplingParams, u: jax.Array):
    """A draft from the head's outputs h [B, D]: (target ids i32[B], q over the target's
    vocabulary f32[B, V], the head's softmax at its top token and at the draft, f32[B] each);
    sampled rows by inverse CDF at u f32[B], greedy rows the argmax."""
    logits = head.logits(h, target)
    tok, q = draw_draft(logits, sampling, u)
    p = jax.nn.softmax(logits, axis=-1)
    p_tok = jnp.take_along_axis(p, tok[:, None], axis=-1)[:, 0]
    return head.target_ids(tok), head.to_target_probs(q), jnp.max(p, axis=-1), p_tok


@functools.partial(jax.jit, static_argnames=("graph", "target_graph", "num_spec",
                                             "num_pages_read", "attention_impl"),
                   donate_argnames=("cache",))
def draft_step(graph: steps.ModelGraph, params: dict, target_graph: steps.ModelGraph,
               target_params: dict, cache: KVCache, sampling: SamplingParams,
               page_table: jax.Array, pos: jax.Array, last: jax.Array, num_draft: jax.Array, *,
               num_spec: int, num_pages_read: int, attention_impl: str = "xla"
               ) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
    """R = num_spec chain drafts for every slot with num_draft > 0 (module doc, `propose`).

    pos: i32[B] position of the slot's newest token `last` (i32[B]). Draft j is drawn from
    q_j with uniforms from (seed, pos, DRAFT_STREAM + j). Entries are written at pos .. pos +
    num_draft - 1 (the later ones from the head's own hidden, until `absorb_step` replaces
    them). `num_pages_read` covers pos + R. Returns (cache, ids i32[B, R], q f32[B, R, V],
    confidence f32[B, R]): draft j's is the head's probability (softmax of its logits) of
    drafts 0 .. j - 1 times its top probability at j, a function of the context and the
    earlier drafts only, not of draft j itself (`EagleDrafter.propose`)."""
    head, target = _models(graph, params, target_graph, target_params)
    b = pos.shape[0]
    on = num_draft > 0
    table = _table(cache, page_table)
    uniforms = spec_uniforms(sampling.seed, pos, num_spec, DRAFT_STREAM)

    def rows(j, tok):
        write = on & (j < num_draft)
        return StepBatch.per_slot(tok[:, None], (pos + j)[:, None], write[:, None], table,
                                  jnp.where(write, pos + j + 1, 0),
                                  num_pages_read=num_pages_read, attention_impl=attention_impl)

    # One loop body for every draft (the first reads the stored hidden g_{pos-1}, the others
    # the head's own): one copy of the head's layer and draw in the program, not two.
    g_prev, cache = exchange_hidden(cache, None, rows(0, last))
    h_shape = jax.eval_shape(lambda c: _head_rows(head, target, c, last, g_prev, rows(0, last)),
                             cache)[0]
    vocab = jax.eval_shape(lambda h: _draw(head, h, target, sampling, uniforms[:, 0]),
                           h_shape)[1].shape[-1]

    def body(j, carry):
        cache, h, tok, ids, probs, path, conf = carry
        g = head.next_hidden(h)
        g = jnp.where(j == 0, g_prev.astype(g.dtype), g)
        h, cache = _head_rows(head, target, cache, tok, g, rows(j, tok))
        tok, q, p_top, p_tok = _draw(head, h, target, sampling, uniforms[:, j])
        ids = ids.at[:, j].set(tok)
        probs = jax.lax.dynamic_update_slice_in_dim(probs, q[:, None], j, 1)
        conf = conf.at[:, j].set(path * p_top)
        return cache, h, tok, ids, probs, path * p_tok, conf

    carry = (cache, jnp.zeros(h_shape.shape, h_shape.dtype), last,
             jnp.zeros((b, num_spec), jnp.int32), jnp.zeros((b, num_spec, vocab), jnp.float32),
             jnp.ones((b,), jnp.float32), jnp.zeros((b, num_spec), jnp.float32))
    cache, _, _, ids, probs, _, conf = jax.lax.fori_loop(0, num_spec, body, carry)
    return (constrain(cache, cache_specs), constrain(ids, sharding.whole),
            constrain(probs, sharding.vocab_last), constrain(conf, sharding.whole))


def _children(head: EagleHead, h: jax.Array, target, sampling: SamplingParams,
              uniforms: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """`width` distinct children of each of P parents from the head's outputs h [B, P, D]:
    (target ids i32[B, P, width] in draft order, q over the target's vocabulary
    f32[B, P, V]). Greedy rows: the head's top-`width` tokens (the first its argmax); sampled
    rows: a sample without replacement from q, drawn one child after another, each by inverse
    CDF at its uniforms[..., j] (f32[B, P, width]) from what is left of q once its earlier
    siblings are removed: the draws `spec_verify_tree`'s rule assumes. A child drawn after q's
    support ran out has q = 0 at its token and is skipped by the verifier."""
    b, p, d = h.shape
    rows = jax.tree.map(lambda a: jnp.repeat(a, p, axis=0), sampling)
    logits = head.logits(h.reshape(b * p, d), target)  # [B P, V_d]
    q = filtered_probs(logits, rows)
    left, drawn = q, []
    for j in range(width):
        mass = jnp.sum(left, axis=-1, keepdims=True)
        tok = inverse_cdf(jnp.where(mass > 0, left, 1.0), uniforms.reshape(b * p, width)[:, j])
        drawn.append(tok)
        left = jnp.where(jnp.arange(left.shape[-1])[None] == tok[:, None], 0.0, left)
    _, top = jax.lax.top_k(logits, width)
    sampled = jnp.stack(drawn, axis=-1)
    tok = jnp.where(rows.temperature[:, None] > 0, sampled, top).astype(jnp.int32)
    return (head.target_ids(tok).reshape(b, p, width),
            head.to_target_probs(q).reshape(b, p, -1))


@functools.partial(jax.jit, static_argnames=("graph", "target_graph", "tree", "num_pages_read",
                                             "attention_impl"), donate_argnames=("cache",))
def draft_tree_step(graph: steps.ModelGraph, params: dict, target_graph: steps.ModelGraph,
                    target_params: dict, cache: KVCache, sampling: SamplingParams,
                    page_table: jax.Array, pos: jax.Array, last: jax.Array,
                    num_draft: jax.Array, *, tree: DraftTree, num_pages_read: int,
                    attention_impl: str = "xla") -> tuple[KVCache, jax.Array, jax.Array]:
    """A static draft tree (`jaxinfer.config.DraftTree`, T nodes) for every slot with
    num_draft > 0 (its first num_draft nodes are real), expanded depth by depth.

    The root's entry at pos from (g_{pos-1}, last) as `draft_step`'s first; then at each depth
    the head runs on all that depth's nodes at once, each on its parent's output hidden and its
    own token, its K/V written at the node's slot pos + i and rotated at pos + depth, its query
    seeing the context and its ancestors' slots (the tree mask, as the verification's): each
    node's output is what a chain along its path would compute. Children come from their
    parent's outputs (`_children`: top-k for greedy rows, a sample without replacement for
    sampled ones, node i's uniform from (seed, pos, DRAFT_STREAM + i)); the deepest nodes are
    leaves and are not run. `absorb_tree_step` then recomputes the accepted path's entries at
    their positions. `num_pages_read` covers pos + num_draft.

    Returns (cache, node ids i32[B, T], q f32[B, E, V]: the distribution each node with
    children (`DraftTree.expanded`, the root first) drew its children from)."""
    head, target = _models(graph, params, target_graph, target_params)
    b, t = pos.shape[0], tree.num_nodes
    on = num_draft > 0
    table = _table(cache, page_table)
    uniforms = spec_uniforms(sampling.seed, pos, t + 1, DRAFT_STREAM)  # [B, T + 1]
    bits = spec_tree.ancestor_bits(tree)
    row = {n: e for e, n in enumerate(tree.expanded)}
    root = StepBatch.per_slot(last[:, None], pos[:, None], on[:, None], table,
                              jnp.where(on, pos + 1, 0), num_pages_read=num_pages_read,
                              attention_impl=attention_impl)
    g_prev, cache = exchange_hidden(cache, None, root)
    h, cache = _head_rows(head, target, cache, last, g_prev, root)
    ids = jnp.zeros((b, t + 1), jnp.int32)
    probs = [None] * len(tree.expanded)
    level, outputs = np.zeros((1,), np.int32), h[:, None]  # the previous depth's nodes, h
    kv_lens = jnp.where(on, pos + num_draft + 1, 0)
    for depth, (nodes, parents) in enumerate(spec_tree.levels(tree), start=1):
        expanded = [int(n) for n in level if tree.children[n]]
        width = max(len(tree.children[n]) for n in expanded)
        kids = np.asarray([(tree.children[n] + (tree.children[n][0],) * width)[:width]
                           for n in expanded], np.int32)  # [P, width], short rows padded
        at = np.searchsorted(level, expanded)
        tok, q = _children(head, outputs[:, at], target, sampling, uniforms[:, kids], width)
        for k, n in enumerate(expanded):
            probs[row[n]] = q[:, k]
            ids = ids.at[:, np.asarray(tree.children[n])].set(tok[:, k, :len(tree.children[n])])
        if depth == tree.max_depth:
            break
        write = on[:, None] & (nodes[None] <= num_draft[:, None])
        batch = StepBatch.per_slot(
            ids[:, nodes], jnp.broadcast_to(pos[:, None] + depth, write.shape), write, table,
            kv_lens, num_pages_read=num_pages_read, attention_impl=attention_impl,
            tree=jnp.broadcast_to(bits[nodes], (b, len(nodes), bits.shape[1])),
            write_positions=pos[:, None] + nodes)
        g = head.next_hidden(outputs[:, np.searchsorted(level, parents)])  # [B, n, D]
        h, cache = _head_rows(head, target, cache, ids[:, nodes].reshape(-1),
                              g.reshape(b * len(nodes), -1), batch)
        level, outputs = nodes, h.reshape(b, len(nodes), -1)
    return (constrain(cache, cache_specs), constrain(ids[:, 1:], sharding.whole),
            constrain(jnp.stack(probs, axis=1), sharding.vocab_last))


def confident_drafts(num: np.ndarray, confidence: np.ndarray, threshold: float) -> np.ndarray:
    """Drafts kept per row, i32[B]: of its num[B] drafts, the leading ones whose confidence
    f32[B, R] (`draft_step`) is at least `threshold`, and always the first."""
    sure = confidence >= threshold
    sure[:, 0] = True
    leading = np.argmin(np.pad(sure, ((0, 0), (0, 1))), axis=1)
    return np.minimum(num, leading).astype(np.int32)


class EagleDrafter(Drafter):
    """Chain and tree drafts from an `EagleHead` (module doc). The target's (graph, params) are the
    engine runner's own arrays: the head reads the target's embedding and LM head from them.

    confidence (`EngineConfig.draft_confidence`): a chain keeps its leading drafts whose
    confidence (`draft_step`: the head's probability of the drafts before, times its top
    probability at this one) is at least this, and always its first, so a step verifies only
    as wide as its longest kept chain (EAGLE-2's estimate of acceptance, used to cut the chain:
    rows cost where the weight matmuls are compute-bound). Whether draft j is kept depends on
    the context and the earlier drafts, not on draft j's own value, so each kept draft is
    still drawn from q_j and the verification stays lossless. 0: every row keeps R."""

    one_hot = False

    def __init__(self, head: EagleHead, target_graph: steps.ModelGraph, target_params: dict, *,
                 cache: CacheConfig, max_slots: int, mesh=None, attention_impl: str = "xla",
                 confidence: float = 0.0):
        self.config: HeadConfig = head.config
        self.mesh = mesh
        self.attention_impl = attention_impl
        self.confidence = confidence
        self.graph, self.params = steps.split_model(head, mesh)
        self.target_graph, self.target_params = target_graph, target_params
        self.kv = self._placed(create_head_cache(self.config, cache, max_slots, mesh=mesh),
                               cache_specs)
        self.slot_configs: list[SamplingConfig | None] = [None] * max_slots
        self.sampling = self._placed(SamplingParams.from_configs(self.slot_configs))

    @property
    def variable_width(self) -> bool:
        return self.confidence > 0

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the head reads."""
        return self.config.feature_layers

    def _placed(self, tree, specs: sharding.Specs = sharding.whole):
        return sharding.place(tree, sharding.placement(tree, specs, self.mesh))

    def _args(self):
        return (self.graph, self.params, self.target_graph, self.target_params)

    def set_sampling(self, configs) -> None:
        configs = list(configs)
        if configs != self.slot_configs:
            self.slot_configs = configs
            self.sampling = self._placed(SamplingParams.from_configs(configs))

    def mirror(self, batch, num_pages_read, features=None):
        batch = jax.tree.map(np.asarray, batch)
        with sharding.mesh_context(self.mesh):
            self.kv = mirror_step(*self._args(), self.kv, batch, self._placed(features),
                                  num_pages_read=num_pages_read,
                                  attention_impl=self.attention_impl)

    def absorb(self, batch, features, num_pages_read, accepted=None) -> None:
        ids = self._placed(batch.draft_ids)  # the drafts as the device holds them, warm-up too
        batch = dataclasses.replace(jax.tree.map(np.asarray, dataclasses.replace(
            batch, draft_ids=None)), draft_ids=ids)
        with sharding.mesh_context(self.mesh):
            if accepted is None:
                self.kv = absorb_step(*self._args(), self.kv, batch, self._placed(features),
                                      num_pages_read=num_pages_read,
                                      attention_impl=self.attention_impl)
            else:
                path, num_emitted = self._placed(accepted)
                self.kv = absorb_tree_step(*self._args(), self.kv, batch,
                                           self._placed(features), path, num_emitted,
                                           num_pages_read=num_pages_read,
                                           attention_impl=self.attention_impl)

    def copy_pages(self, pairs, local_pairs=()) -> None:
        """The target's page copies (a fork's partial page) in the head's pools; the local
        pairs of a hybrid target are its sliding-window pool's, which the head does not have."""
        if not pairs:
            return
        n = max(8, 1 << (len(pairs) - 1).bit_length())
        trash = trash_page(self.kv.k_pages[0])
        src, dst = np.full((n,), trash, np.int32), np.full((n,), trash, np.int32)
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
        with sharding.mesh_context(self.mesh):
            self.kv = steps.copy_pages(self.kv, src, dst, src, dst)

    @staticmethod
    def _inputs(rows, max_slots, width):
        """(pos, newest token, drafts to make: min(max_draft, width)), i32[B] each."""
        pos = np.zeros((max_slots,), np.int32)
        last = np.zeros((max_slots,), np.int32)
        num = np.zeros((max_slots,), np.int32)
        for row in rows:
            pos[row.slot], last[row.slot] = row.pos, row.tokens[-1]
            num[row.slot] = min(row.max_draft, width)
        return pos, last, num

    def propose(self, rows, num_spec, max_slots, page_table, num_pages_read):
        pos, last, num = self._inputs(rows, max_slots, num_spec)
        ids, probs, conf = self._draft(page_table, pos, last, num, num_spec, num_pages_read)
        if self.confidence > 0:
            num = confident_drafts(num, np.asarray(conf), self.confidence)
        return ids, probs, num

    def _draft(self, page_table, pos, last, num, num_spec, num_pages_read, tree=None):
        """(ids, q, chain confidences or None for a tree) of `draft_step` / `draft_tree_step`."""
        args = (*self._args(), self.kv, self.sampling, np.asarray(page_table, np.int32), pos,
                last, num)
        with sharding.mesh_context(self.mesh):
            if tree is None:
                self.kv, ids, probs, conf = draft_step(
                    *args, num_spec=num_spec, num_pages_read=num_pages_read,
                    attention_impl=self.attention_impl)
                return ids, probs, conf
            self.kv, ids, probs = draft_tree_step(
                *args, tree=tree, num_pages_read=num_pages_read,
                attention_impl=self.attention_impl)
        return ids, probs, None

    def propose_tree(self, rows, tree, max_slots, page_table, num_pages_read):
        """(node ids i32[B, T], q f32[B, E, V], num_draft i32[B]) from `draft_tree_step`: each
        row drafts its first min(max_draft, T) nodes."""
        pos, last, num = self._inputs(rows, max_slots, tree.num_nodes)
        ids, probs, _ = self._draft(page_table, pos, last, num, tree.num_nodes, num_pages_read,
                                    tree)
        return ids, probs, num

    def warmup(self, num_spec, max_slots, pages_per_seq, page_buckets, prefill_variants,
               tree=None):
        width = num_spec if tree is None else tree.num_nodes
        table = np.zeros((max_slots, pages_per_seq), np.int32)
        zeros = np.zeros((max_slots,), np.int32)
        c = self.config
        feats = (len(c.feature_layers), c.target_dim)  # one row's features, in the head's dtype
        dtype = np.dtype(jnp.dtype(c.layer.dtype))
        accepted = None if tree is None else (
            np.zeros((max_slots, tree.max_depth), np.int32), zeros)
        # A chain cut by confidence is verified (and absorbed) at any of chain_widths.
        widths = chain_widths(num_spec) if tree is None and self.variable_width else [width]
        for pages in page_buckets:
            self._draft(table, zeros, zeros, zeros, width, pages, tree)
            for w in widths:
                vb = steps.VerifyBatch(page_table=table, active=np.zeros((max_slots,), bool),
                                       pos=zeros, draft_ids=np.zeros((max_slots, w), np.int32),
                                       num_draft=zeros,
                                       lora=np.full((max_slots,), -1, np.int32))
                self.absorb(vb, np.zeros((max_slots, w + 1, *feats), dtype), pages, accepted)
        for batch, pages in prefill_variants:
            rows = max_slots + batch.chunk_tokens.shape[0]
            self.mirror(batch, pages, np.zeros((rows, *feats), dtype))
