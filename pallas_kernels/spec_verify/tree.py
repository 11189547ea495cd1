"""Lossless verification of a draft tree (SpecInfer, Miao et al. 2024; recursive rejection
sampling without replacement, Jeon et al. 2024): the tree counterpart of `reference.py`'s
chain rule, in plain jnp (it runs as XLA on every backend: its work is a few [B, V] passes per
tree level, small beside the step; no Pallas kernel).

The tree (static): nodes 1..T, `parents[i - 1]` the parent of node i (0: the root, the slot's
newest token), numbered breadth first (parents before children); node i's token is
node_ids[b, i - 1]; the first num_draft[b] nodes are real (a prefix is a subtree). The target's
logits row i is its distribution after node i (row 0: after the root).

Per row, from the root: at node n with target p = softmax(logits[n] / temperature) try n's real
children c_1, c_2, ... in order:

* Greedy row (temperature 0): the first child whose token is argmax p (ties: lowest id) is
  accepted.
* Sampled row: child c_k with token x is accepted iff u_{c_k} * q_k(x) < p(x) (u: its uniform),
  where q_k is the distribution it was drawn from: with `draft_probs` (row e = the q of the
  e-th node with children, root first, `expanded`), q with its earlier siblings' tokens removed
  and renormalised (the children are a sample without replacement from q, e.g. Gumbel top-k);
  without, one-hot at x (deterministic drafts). Greedy rows never read q (their children may
  be any tokens, e.g. the drafter's top-k). On rejection p <- norm(max(p - q_k, 0)) (kept
  as it is when that mass is at most RESIDUAL_EPS, as the chain rule does) and the next child
  is tried. A child whose q_k(x) is 0 (its siblings exhausted q's support) was not drawn: it is
  skipped, p unchanged.

An accepted child becomes n (a fresh p from its own logits row). When no child of n is
accepted, or n has none, the next token is argmax p (greedy) or drawn by inverse CDF from the
current p with u_0 (sampled): the correction after rejections, the bonus token at a leaf.
Each rejection is Chen et al.'s exact step with target p and draft q_k, and whatever follows a
rejection has distribution norm(max(p - q_k, 0)) whichever token was drafted, so every
accepted path and next token have the target's distribution; with one child per node this is
`spec_verify_reference`'s chain rule. A padding node (past num_draft) is never tried; target
rows of padding nodes may hold anything (they pass through `where`s only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.spec_verify.reference import RESIDUAL_EPS, _inverse_cdf, scale_logits


@functools.cache
def tree_tables(parents: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, int]:
    """(children i32[T + 1, C] (-1 padded, C = the most children of a node), expanded index
    i32[T + 1] (the draft_probs row of each node with children, -1 for leaves), depth D)."""
    t = len(parents)
    kids: list[list[int]] = [[] for _ in range(t + 1)]
    depth = [0] * (t + 1)
    for i, p in enumerate(parents, start=1):
        if not 0 <= p < i:
            raise ValueError(f"tree node {i} has parent {p}: parents must be earlier nodes "
                             f"(0 = the root) in breadth-first order")
        kids[p].append(i)
        depth[i] = depth[p] + 1
    width = max(len(k) for k in kids)
    children = np.full((t + 1, width), -1, np.int32)
    expanded = np.full((t + 1,), -1, np.int32)
    e = 0
    for n, k in enumerate(kids):
        children[n, :len(k)] = k
        if k:
            expanded[n] = e
            e += 1
    return children, expanded, max(depth)


def validate_tree_inputs(target_logits, node_ids, draft_probs, num_draft, temperature,
                         uniforms, parents) -> None:
    """Static shape/dtype checks naming the bad argument and what would be valid."""
    t = len(parents)
    _, expanded, _ = tree_tables(tuple(parents))
    num_expanded = int((expanded >= 0).sum())
    if target_logits.ndim != 3 or target_logits.shape[1] != t + 1:
        raise ValueError(f"target_logits must be f32[B, T + 1 = {t + 1}, V] for a tree of "
                         f"T={t} nodes; got shape {target_logits.shape}")
    batch, _, vocab = target_logits.shape
    shapes = [("node_ids", node_ids, (batch, t), jnp.int32),
              ("num_draft", num_draft, (batch,), jnp.int32),
              ("temperature", temperature, (batch,), jnp.float32),
              ("uniforms", uniforms, (batch, t + 1), jnp.float32),
              ("target_logits", target_logits, target_logits.shape, jnp.float32)]
    if draft_probs is not None:
        shapes.append(("draft_probs", draft_probs, (batch, num_expanded, vocab), jnp.float32))
    for name, x, shape, dtype in shapes:
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"{name} must be {jnp.dtype(dtype).name}{list(shape)} (B={batch}, "
                             f"T={t}, {num_expanded} nodes with children, V={vocab}); got "
                             f"{x.dtype}{list(x.shape)}")


def _softmax(scaled: jax.Array) -> jax.Array:
    peak = jnp.max(scaled, axis=-1, keepdims=True)
    e = jnp.exp(scaled - jnp.where(peak == -jnp.inf, 0.0, peak))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def spec_verify_tree(
    target_logits: jax.Array,  # f32[B, T + 1, V]; rows of padding nodes may hold anything
    node_ids: jax.Array,  # i32[B, T] node i's token at column i - 1
    draft_probs: jax.Array | None,  # f32[B, E, V] q of each node with children, or None
    num_draft: jax.Array,  # i32[B] in [0, T]: nodes 1..num_draft are real
    temperature: jax.Array,  # f32[B], 0 = greedy
    uniforms: jax.Array,  # f32[B, T + 1] in [0, 1): node i's test, u_0 the final draw
    *,
    parents: tuple[int, ...],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(path i32[B, D]: the accepted nodes from the root down, 0 past them; num_accepted
    i32[B]; next_token i32[B]); the rule in the module doc."""
    validate_tree_inputs(target_logits, node_ids, draft_probs, num_draft, temperature, uniforms,
                         parents)
    children, expanded, depth = tree_tables(tuple(parents))
    batch, _, vocab = target_logits.shape
    rows = jnp.arange(batch)
    greedy = temperature <= 0
    ids = jnp.clip(node_ids, 0, vocab - 1)
    iota = jnp.arange(vocab)
    best = jnp.max(target_logits, axis=-1, keepdims=True)
    argmax = jnp.minimum(jnp.min(jnp.where(target_logits == best, iota, vocab), -1), vocab - 1)
    children, expanded = jnp.asarray(children), jnp.asarray(expanded)

    node = jnp.zeros((batch,), jnp.int32)  # the current node of each row's path
    done = jnp.zeros((batch,), bool)
    final = jnp.zeros((batch, vocab), jnp.float32)  # what a done row's next token is drawn from
    final_node = jnp.zeros((batch,), jnp.int32)
    path = []
    for level in range(depth + 1):  # the last level's nodes are leaves: every row ends there
        p = _softmax(scale_logits(target_logits[rows, node], temperature[:, None]))
        q_left = None if draft_probs is None else \
            draft_probs[rows, jnp.maximum(expanded[node], 0)]
        chosen = jnp.full((batch,), -1, jnp.int32)
        for k in range(children.shape[1]):
            child = children[node, k]
            live = (child >= 1) & (child <= num_draft) & ~done & (chosen < 0)
            x = ids[rows, jnp.clip(child - 1, 0, ids.shape[1] - 1)]
            u = uniforms[rows, jnp.maximum(child, 0)]
            if q_left is None:  # one-hot q: accept with p(x); the residual is p without x
                q_k = jax.nn.one_hot(x, vocab, dtype=jnp.float32)
                drawn = live
            else:
                mass = jnp.sum(q_left, axis=-1, keepdims=True)
                q_k = jnp.where(mass > 0, q_left / jnp.where(mass > 0, mass, 1.0), 0.0)
                drawn = live & (greedy | (q_k[rows, x] > 0))  # greedy rows never read q
                q_left = jnp.where(drawn[:, None] & (iota == x[:, None]), 0.0, q_left)
            ok = jnp.where(greedy, x == argmax[rows, node], u * q_k[rows, x] < p[rows, x])
            accept = drawn & ok
            residual = jnp.maximum(p - q_k, 0.0)
            left = jnp.sum(residual, axis=-1, keepdims=True)
            update = (drawn & ~ok & ~greedy)[:, None] & (left > RESIDUAL_EPS)
            p = jnp.where(update, residual / jnp.where(left > 0, left, 1.0), p)
            chosen = jnp.where(accept, child, chosen)
        accepted = chosen >= 0
        ending = ~done & ~accepted
        final = jnp.where(ending[:, None], p, final)
        final_node = jnp.where(ending, node, final_node)
        done |= ending
        if level < depth:
            path.append(jnp.where(accepted, chosen, 0))
            node = jnp.where(accepted, chosen, node)
    path = jnp.stack(path, axis=1) if path else jnp.zeros((batch, 0), jnp.int32)
    num_accepted = jnp.sum(path > 0, axis=1).astype(jnp.int32)
    sampled = _inverse_cdf(final, uniforms[:, 0])
    next_token = jnp.where(greedy, argmax[rows, final_node], sampled)
    return path.astype(jnp.int32), num_accepted, next_token.astype(jnp.int32)
