"""Draft trees (`jaxinfer.config.DraftTree`, `jaxinfer.engine.spec_tree`): the tree spellings;
tree attention in the paged reference against a dense masked loop; a tree verification step
whose every node's logits are those of a plain forward over the context and the node's path
(unrolled, scanned, and a Gemma-3-shaped sliding-window model on a hybrid pool), and whose
accepted path's K/V, moved into place by `commit_path`, is that forward's; the multi-draft
acceptance rule against a plain per-row recursion with the same uniforms, and against the chain
rule on a chain tree."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.config import CacheConfig, DraftTree, EngineConfig, SamplingConfig
from jaxinfer.engine import spec_tree, steps
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.model import Llama, init_params
from pallas_kernels.paged_attention.reference import paged_decode_attention_reference
from pallas_kernels.spec_verify import spec_verify_reference, spec_verify_tree
from tests.helpers import prefill_rows, toy_config, tree_case


def test_tree_spellings_and_errors():
    tree = DraftTree.parse("2,2,1")
    assert tree.parents == (0, 0, 1, 1, 2, 2, 3, 4, 5, 6)
    assert (tree.num_nodes, tree.max_depth, tree.expanded) == (10, 3, (0, 1, 2, 3, 4, 5, 6))
    assert tree.children[1] == (3, 4) and tree.nodes_within(1) == 2
    assert DraftTree.parse("parents: 0,0,1") == DraftTree(parents=(0, 0, 1))
    assert DraftTree.parse("1,1,1").parents == (0, 1, 2)
    bits = DraftTree.parse("4,2,2,1").ancestor_bits()  # 45 slots: two words
    assert bits.shape == (45, 2) and bits[44, 1] != 0 and bits[44, 0] & 1
    for spec, match in [("parents:0,2", "parent 2"), ("parents:0,1,0", "breadth first"),
                        ("2,x", "neither"), ("2,0", ">= 1"), ("8,8", "more than 64")]:
        with pytest.raises(ValueError, match=match):
            DraftTree.parse(spec)
    with pytest.raises(ValueError, match="spec_tree=.*needs a drafter"):
        EngineConfig(spec_tree="2,1")
    assert EngineConfig(speculative_method="ngram", spec_tree="2,1").spec_width == 4


def test_tree_attention_reference_against_a_dense_loop():
    """The kernels' oracle with tree queries: each query's softmax over exactly the keys it
    may see (context inside its window, its ancestors' slots), listed one by one."""
    rng = np.random.default_rng(0)
    tree = DraftTree.parse("parents:0,0,1,2,2,3")
    t, page, window = tree.num_nodes + 1, 4, 6
    lengths = [t, t + 5, t + 11]
    trees, _ = tree_case("parents:0,0,1,2,2,3", lengths)
    num_pages = 5 * len(lengths)
    table = rng.permutation(num_pages).reshape(len(lengths), 5).astype(np.int32)
    k = rng.standard_normal((2, num_pages, page, 8)).astype(np.float32)
    v = rng.standard_normal((2, num_pages, page, 8)).astype(np.float32)
    q = rng.standard_normal((len(lengths), t, 2, 3, 8)).astype(np.float32)
    out = np.asarray(paged_decode_attention_reference(
        *map(jnp.asarray, (q, k, v)), jnp.asarray(lengths, jnp.int32), jnp.asarray(table),
        sliding_window=window, **trees))
    for b, length in enumerate(lengths):
        base = length - t
        for node in range(t):
            pos = base + tree.depths[node]
            keys = [s for s in range(base) if s > pos - window]
            keys += [base + j for j in tree.ancestors(node)]
            kk = np.stack([k[:, table[b, s // page], s % page] for s in keys], 1)  # [K, S, H]
            vv = np.stack([v[:, table[b, s // page], s % page] for s in keys], 1)
            scores = np.einsum("KGH,KSH->KGS", q[b, node], kk) / math.sqrt(8)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            np.testing.assert_allclose(out[b, node], np.einsum("KGS,KSH->KGH", probs, vv),
                                       rtol=1e-5, atol=1e-5)


def _models():
    dense = dict(vocab_size=64, max_position=128)
    gemma = dict(arch="gemma3", num_layers=3, qk_norm=True, post_norms=True,
                 norm_plus_one=True, scale_embeddings=True, activation="gelu_tanh",
                 query_pre_attn_scalar=8.0, sliding_window=8, sliding_window_pattern=3,
                 tie_embeddings=True, vocab_size=64, max_position=128)
    return {"unrolled": toy_config(**dense), "scanned": toy_config(scan_layers=True, **dense),
            "sliding window": toy_config(**gemma)}


@pytest.mark.parametrize("name", ["unrolled", "scanned", "sliding window"])
def test_tree_verification_matches_each_paths_forward(name):
    """Two slots (contexts of 11 and 14 tokens, the second in pages out of order) verify the
    tree "2,2,1" with random node tokens (slot 0: all 10 nodes, slot 1: the first 6). Every
    real node's logits are those of a plain forward over the context and the node's path; after
    `commit_path` of paths off the first-child line (slot 0: 3 nodes, slot 1: 2 from the first
    child) the pool holds each path's K/V at positions pos + 1 .. in every layer."""
    config = _models()[name]
    graph, params = steps.split_model(Llama(config, init_params(config, seed=3, scale=0.3)))
    model = nnx.merge(graph.graphdef, params)  # on device (a scanned model indexes its stacks)
    tree = DraftTree.parse("2,2,1")
    rng = np.random.default_rng(1)
    b, ps, per = 2, 4, 8
    hybrid = config.sliding_window is not None  # its local pool: the same page ids
    cache_config = CacheConfig(page_size=ps, max_seq_len=ps * per, num_pages=b * per,
                               hybrid=hybrid, num_local_pages=b * per if hybrid else None)
    table = np.stack([np.arange(per), per + np.arange(per)[::-1]]).astype(np.int32)
    tables = np.concatenate([table, table], 1) if hybrid else table  # the step's input
    contexts = [rng.integers(0, 64, n).tolist() for n in (11, 14)]
    nodes = rng.integers(0, 64, (b, tree.num_nodes)).astype(np.int32)
    num = np.array([tree.num_nodes, 6], np.int32)
    pos = np.array([len(c) - 1 for c in contexts], np.int32)

    def plain(seq, row):
        """logits of the last token and the pool after a plain forward of `seq` at row."""
        kv = create_cache(config, cache_config, b)
        logits, kp, vp = prefill_rows(model, [seq], table[row:row + 1], kv.k_pages, kv.v_pages,
                                      num_pages_read=per)
        return np.asarray(logits[0, -1]), kv.replace(k_pages=kp, v_pages=vp)

    kv = create_cache(config, cache_config, b)
    for row, ctx in enumerate(contexts):  # cache the contexts but their newest tokens
        _, kp, vp = prefill_rows(model, [ctx[:-1]], table[row:row + 1], kv.k_pages, kv.v_pages,
                                 num_pages_read=per)
        kv = kv.replace(k_pages=kp, v_pages=vp)
    state = steps.create_slot_state(b, 64).replace(
        tokens=jnp.asarray([c[-1] for c in contexts], jnp.int32))
    batch = steps.VerifyBatch(page_table=tables, active=np.ones(b, bool), pos=pos,
                              draft_ids=nodes, num_draft=num)
    kv, logits, _ = steps.verify_forward(graph, params, kv, state.tokens, batch,
                                         num_rows=b * (tree.num_nodes + 1), num_pages_read=per,
                                         tree=tree)
    logits = np.asarray(logits)
    for row, ctx in enumerate(contexts):
        for node in range(num[row] + 1):
            path = [int(nodes[row, j - 1]) for j in tree.ancestors(node)[1:]]
            want, _ = plain(ctx + path, row)
            np.testing.assert_allclose(logits[row, node], want, rtol=2e-4, atol=2e-4,
                                       err_msg=f"slot {row} node {node}")
    path = np.array([[2, 6, 10], [1, 4, 0]], np.int32)  # slot 1's node 8 is past its 6
    accepted = np.array([3, 2], np.int32)
    kv = spec_tree.commit_path(kv, jnp.asarray(tables), jnp.asarray(pos), jnp.asarray(path),
                               jnp.asarray(accepted + 1))
    for row, ctx in enumerate(contexts):
        tokens = [int(nodes[row, n - 1]) for n in path[row, :accepted[row]]]
        _, want = plain(ctx + tokens, row)
        at = pos[row] + 1 + np.arange(accepted[row])
        pages, offs = table[row, at // ps], at % ps
        for got, exp in zip(kv.k_pages + kv.v_pages, want.k_pages + want.v_pages):
            got, exp = np.asarray(got), np.asarray(exp)
            np.testing.assert_allclose(got[..., pages, offs, :], exp[..., pages, offs, :],
                                       rtol=2e-4, atol=2e-4)


# ----- acceptance ------------------------------------------------------------------------------
def plain_tree_rule(logits, nodes, q, num, temperature, u, tree: DraftTree,
                    remove_drawn: bool = True):
    """The multi-draft rule of `spec_verify_tree` (module doc) for one row, written as the
    recursion it is, in float64: (accepted path, next token). remove_drawn=False: a wrong rule
    that tests every child against the whole q."""
    vocab = logits.shape[-1]
    node, path = 0, []
    while True:
        if temperature <= 0:
            best = int(np.argmax(logits[node]))
            for c in tree.children[node]:
                if c <= num and nodes[c - 1] == best:
                    break
            else:
                return path, best
            node, path = c, path + [c]
            continue
        p = np.exp(logits[node] / temperature - np.max(logits[node] / temperature))
        p /= p.sum()
        left = None  # what is left of q (a leaf has none)
        if q is not None and tree.children[node]:
            left = q[tree.expanded.index(node)].astype(np.float64)
        for c in tree.children[node]:
            if c > num:
                continue
            x = nodes[c - 1]
            if left is None:
                q_k = np.eye(vocab)[x]
            else:
                if left.sum() <= 0 or left[x] <= 0:
                    continue
                q_k = left / left.sum()
                if remove_drawn:
                    left[x] = 0.0
            if u[c] * q_k[x] < p[x]:
                node, path = c, path + [c]
                break
            residual = np.maximum(p - q_k, 0)
            if residual.sum() > 1e-5:
                p = residual / residual.sum()
        else:
            cdf = np.cumsum(p)
            return path, int(min(np.sum(cdf <= u[0] * cdf[-1]), np.flatnonzero(p > 0)[-1]))


@pytest.mark.parametrize("spec", ["2,2,1", "parents:0,0,0,1,1,2,4,4", "3,2"])
@pytest.mark.parametrize("one_hot", [False, True])
def test_tree_acceptance_equals_the_plain_recursion(spec, one_hot):
    """400 rows of random targets, drafts drawn without replacement from random q (one-hot:
    random distinct siblings), random num_draft, a third of the rows greedy: the same path and
    next token as the plain per-row recursion with the same uniforms."""
    tree = DraftTree.parse(spec)
    rng = np.random.default_rng(len(spec) + one_hot)
    rows, vocab, t = 400, 10, tree.num_nodes
    logits = (rng.standard_normal((rows, t + 1, vocab)) * 2).astype(np.float32)
    q = rng.dirichlet(np.full(vocab, 0.5), (rows, len(tree.expanded))).astype(np.float32)
    nodes = np.zeros((rows, t), np.int32)
    for r in range(rows):
        for e, n in enumerate(tree.expanded):
            kids = tree.children[n]
            if one_hot:
                drawn = rng.choice(vocab, len(kids), replace=False)
            else:  # Gumbel top-k: a sample without replacement from q
                drawn = np.argsort(-(np.log(q[r, e] + 1e-30) + rng.gumbel(size=vocab)))
            nodes[r, np.asarray(kids) - 1] = drawn[:len(kids)]
    num = rng.integers(0, t + 1, rows).astype(np.int32)
    temp = np.where(rng.random(rows) < 0.33, 0.0, rng.uniform(0.5, 1.5, rows)).astype(np.float32)
    u = rng.random((rows, t + 1)).astype(np.float32)
    probs = None if one_hot else q
    path, accepted, token = map(np.asarray, spec_verify_tree(
        jnp.asarray(logits), jnp.asarray(nodes), None if probs is None else jnp.asarray(probs),
        jnp.asarray(num), jnp.asarray(temp), jnp.asarray(u), parents=tree.parents))
    for r in range(rows):
        want_path, want_token = plain_tree_rule(logits[r].astype(np.float64), nodes[r],
                                                None if probs is None else probs[r], num[r],
                                                temp[r], u[r], tree)
        assert list(path[r, :accepted[r]]) == want_path, r
        assert not path[r, accepted[r]:].any() and token[r] == want_token, r
    assert 0 < accepted.mean() and (accepted > 1).any()


def test_a_chain_tree_is_the_chain_rule():
    """The tree "1,1,1" accepts as `spec_verify_reference` does with R = 3 (node j's uniform
    the chain's draft j - 1's; the final draw's u_0 the chain's u_R)."""
    rng = np.random.default_rng(0)
    b, vocab = 256, 12
    logits = (rng.standard_normal((b, 4, vocab)) * 2).astype(np.float32)
    q = rng.dirichlet(np.ones(vocab), (b, 3)).astype(np.float32)
    ids = np.array([[rng.choice(vocab, p=q[i, j]) for j in range(3)] for i in range(b)],
                   np.int32)
    num = rng.integers(0, 4, b).astype(np.int32)
    temp = np.where(rng.random(b) < 0.3, 0.0, 1.0).astype(np.float32)
    u = rng.random((b, 4)).astype(np.float32)
    chain_u = np.concatenate([u[:, 1:], u[:, :1]], axis=1)
    for probs in (q, None):
        args = [jnp.asarray(x) for x in (logits, ids)]
        probs = None if probs is None else jnp.asarray(probs)
        want = spec_verify_reference(*args, probs, jnp.asarray(num), jnp.asarray(temp),
                                     jnp.asarray(chain_u))
        _, accepted, token = spec_verify_tree(*args, probs, jnp.asarray(num), jnp.asarray(temp),
                                              jnp.asarray(u), parents=(0, 1, 2))
        np.testing.assert_array_equal(accepted, want[0])
        np.testing.assert_array_equal(token, want[1])


def test_tree_acceptance_validates_its_inputs():
    sds = jax.ShapeDtypeStruct
    f32, i32 = jnp.float32, jnp.int32
    args = dict(target_logits=sds((2, 4, 9), f32), node_ids=sds((2, 3), i32),
                draft_probs=sds((2, 3, 9), f32), num_draft=sds((2,), i32),
                temperature=sds((2,), f32), uniforms=sds((2, 4), f32))
    jax.eval_shape(lambda **a: spec_verify_tree(**a, parents=(0, 1, 2)), **args)
    bad = dict(args, draft_probs=sds((2, 2, 9), f32))
    with pytest.raises(ValueError, match=r"draft_probs must be float32\[2, 3, 9\]"):
        jax.eval_shape(lambda **a: spec_verify_tree(**a, parents=(0, 1, 2)), **bad)
    with pytest.raises(ValueError, match="T \\+ 1 = 3"):
        jax.eval_shape(lambda **a: spec_verify_tree(**a, parents=(0, 1)), **args)


# ----- the rule's output distribution (chi-square) -----------------------------------------
TREE_V = 8
TREE_DRAWS = 100_000


def _tree_draws(rule, tree: DraftTree, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """TREE_DRAWS independent first two tokens emitted after one verification of `tree`, and
    the exact target joint f64[V, V]. A fixed random target P(x1), P(x2 | x1) (node n's
    logits row: P after its path); each node's children a sample without replacement (Gumbel
    top-k) from a fixed q far from P; temperature 1. A row that accepts no draft emits x1 only:
    x2 then comes from P(. | x1) exactly (the next verification is that row's business).
    rule(logits, nodes, q, num, temperature, uniforms) -> (path, accepted, next_token)."""
    rng = np.random.default_rng(seed)
    v, t, n = TREE_V, tree.num_nodes, TREE_DRAWS
    p1 = rng.dirichlet(np.full(v, 0.7))
    p2 = rng.dirichlet(np.full(v, 0.7), v)  # [x1, x2]
    q = np.asarray(jax.nn.softmax(-2.0 * np.log(p1 + 1e-3)), np.float64)  # prefers P's unlikely
    nodes = np.zeros((n, t), np.int32)
    for node in tree.expanded:
        kids = np.asarray(tree.children[node])
        drawn = np.argsort(-(np.log(q) + rng.gumbel(size=(n, v))), axis=1)[:, :len(kids)]
        nodes[:, kids - 1] = drawn
    logits = np.zeros((n, t + 1, v), np.float32)
    logits[:, 0] = np.log(p1)
    for node in range(1, t + 1):
        a = tree.ancestors(node)
        # depth 1: P(. | x1); deeper rows are only drawn from past x2 (any distribution works)
        logits[:, node] = np.log(p2[nodes[:, a[1] - 1]])
    probs = np.broadcast_to(q.astype(np.float32), (n, len(tree.expanded), v))
    u = rng.random((n, t + 1)).astype(np.float32)
    path, accepted, token = map(np.asarray, rule(
        logits, nodes, probs, np.full(n, t, np.int32), np.ones(n, np.float32), u))
    rows = np.arange(n)
    first_node = np.maximum(path[:, 0], 1) - 1
    first = np.where(accepted > 0, nodes[rows, first_node], token)
    second_node = np.maximum(path[:, min(1, path.shape[1] - 1)], 1) - 1
    second = np.where(accepted > 1, nodes[rows, second_node], token)
    alone = accepted == 0
    cdf = np.cumsum(p2[first[alone]], axis=1)
    second[alone] = np.minimum((cdf < rng.random((alone.sum(), 1))).sum(axis=1), v - 1)
    return first * v + second, p1[:, None] * p2


def _product_rule(tree: DraftTree):
    return lambda *args: spec_verify_tree(*map(jnp.asarray, args), parents=tree.parents)


def _with_replacement_rule(tree: DraftTree):
    """A wrong rule: each child tested against the whole q (as if siblings were drawn with
    replacement) while they are drawn without it: `plain_tree_rule` minus the removal."""
    def rule(logits, nodes, q, num, temperature, u):
        paths, tokens = [], []
        for r in range(logits.shape[0]):
            path, token = plain_tree_rule(logits[r].astype(np.float64), nodes[r], q[r], num[r],
                                          temperature[r], u[r], tree, remove_drawn=False)
            paths.append(path + [0] * (tree.max_depth - len(path)))
            tokens.append(token)
        paths = np.asarray(paths, np.int32)
        return paths, (paths > 0).sum(axis=1), np.asarray(tokens)
    return rule


def _chi2(cells: np.ndarray, joint: np.ndarray) -> float:
    from tests.test_speculative import _chi2_pvalue

    return _chi2_pvalue(np.bincount(cells, minlength=joint.size), cells.size * joint.reshape(-1))


@pytest.mark.parametrize("spec", ["3,2", "parents:0,0,0,0,1,1,2"])
def test_tree_acceptance_has_the_target_distribution(spec):
    """10^5 verifications of a tree whose drafts come from q far from the target: the first
    two emitted tokens follow the target's joint (chi-square), through accepted paths off the
    first-child line too."""
    tree = DraftTree.parse(spec)
    cells, joint = _tree_draws(_product_rule(tree), tree)
    assert _chi2(cells, joint) > 1e-3


@pytest.mark.slow  # the power check of the test above (10^5 rows through a Python loop)
def test_the_tree_distribution_test_rejects_a_wrong_rule():
    tree = DraftTree.parse("3,2")
    cells, joint = _tree_draws(_with_replacement_rule(tree), tree)
    assert _chi2(cells, joint) < 1e-6


# ----- through the engine (n-gram tree drafts) -----------------------------------------------
def _recording_commits(monkeypatch) -> list:
    """Wraps `spec_tree.commit_path` to record (path, num_emitted) of every verification."""
    seen = []
    original = spec_tree.commit_path

    def commit(cache, table, pos, path, num_emitted):
        seen.append((np.asarray(path), np.asarray(num_emitted)))
        return original(cache, table, pos, path, num_emitted)

    monkeypatch.setattr(spec_tree, "commit_path", commit)
    return seen


def _off_first_child_line(seen) -> bool:
    """Some accepted path left the first-child line (its K/V had to move)."""
    for path, emitted in seen:
        d = np.arange(1, path.shape[1] + 1)
        if ((d < emitted[:, None]) & (path != d)).any():
            return True
    return False


def _oracle_continuations(sequences: list[list[int]], vocab: int):
    """`NGramDrafter.continuations` that knows the greedy outputs: at a sequence that is a
    prefix of one of `sequences`, its true next token, second behind a wrong one at every other
    length (so accepted paths leave the first-child line); nothing elsewhere."""
    def continuations(self, tokens, k):
        for seq in sequences:
            if len(seq) > len(tokens) and seq[:len(tokens)] == tokens:
                true = seq[len(tokens)]
                return ([(true + 1) % vocab, true] if len(tokens) % 2 else [true])[-k:]
        return []
    return continuations


def test_greedy_tree_speculation_equals_plain_decoding(monkeypatch):
    """Batch 8 under a pool that preempts (rows with 0 or 1 tokens left draft nothing or one
    depth): tree drafts from a drafter whose candidates hold the greedy tokens, often as a
    second child, give plain decoding's tokens, accepting paths whose K/V `commit_path` moved
    (without the move the next steps read the first child's K/V); then the real n-gram
    drafter's trees under a repetition penalty, and batch 1."""
    from jaxinfer.engine.speculative import NGramDrafter
    from tests.test_speculative import VOCAB, _toy, prompts, run

    target = _toy(5, num_layers=3)
    ps = prompts(8)
    sampling = [SamplingConfig(max_new_tokens=m, ignore_eos=True)
                for m in (24, 1, 17, 30, 2, 24, 9, 28)]
    expected, _ = run(target, ps, sampling)
    with monkeypatch.context() as m:
        m.setattr(NGramDrafter, "continuations", _oracle_continuations(
            [p + e for p, e in zip(ps, expected)], VOCAB))
        seen = _recording_commits(m)
        got, eng = run(target, ps, sampling, speculative_method="ngram", spec_tree="3,2,1")
    assert got == expected
    s = eng.stats()
    assert s["preemptions"] > 0 and s["mean_accepted_length"] > 2.5, s
    assert _off_first_child_line(seen)
    penalized = [dataclasses.replace(c, repetition_penalty=1.3) for c in sampling]
    want, _ = run(target, ps, penalized)
    got, _ = run(target, ps, penalized, speculative_method="ngram", spec_tree="3,2,1")
    assert got == want
    got, _ = run(target, ps[:1], sampling[:1], speculative_method="ngram", spec_tree="2,2,1",
                 max_slots=1)
    assert got == expected[:1]


def test_sampled_tree_forks_equal_independent_requests():
    """n samples of one prompt with tree drafts equal n requests with seeds seed + i (the
    verifier's uniforms depend on the seed and position only)."""
    from tests.test_speculative import _toy, prompts, run

    target = _toy(5, num_layers=3)
    prompt = prompts(1)[0] + [7, 8, 9]
    kw = dict(speculative_method="ngram", spec_tree="2,2")
    forked, _ = run(target, [prompt], SamplingConfig(
        max_new_tokens=16, ignore_eos=True, temperature=0.9, seed=4, n=4), **kw)
    alone, _ = run(target, [prompt] * 4, [SamplingConfig(
        max_new_tokens=16, ignore_eos=True, temperature=0.9, seed=4 + i) for i in range(4)], **kw)
    assert forked == alone and len({tuple(t) for t in forked}) > 1


def test_ngram_tree_proposals():
    """Children are the distinct continuations of the node's suffix, latest first; missing
    ones repeat a sibling or the parent; num_draft ends at the last real node."""
    from jaxinfer.engine.speculative import DraftRow, NGramDrafter

    d = NGramDrafter(max_n=2, min_n=1)
    assert d.continuations([1, 5, 1, 6, 2, 1, 7, 1], 3) == [7, 6, 5]
    tree = DraftTree.parse("2,1")  # nodes 1, 2 under the root; 3 under 1, 4 under 2
    tokens = [1, 5, 9, 1, 6, 4, 1]
    ids, probs, num = d.propose_tree([DraftRow(slot=1, tokens=tokens, pos=6, max_draft=4)],
                                     tree, max_slots=2)
    assert probs is None and list(num) == [0, 4]
    assert list(ids[1]) == [6, 5, 4, 9]  # after 1: 6 (latest), 5; after [1, 6]: 4; [1, 5]: 9
    ids, _, num = d.propose_tree([DraftRow(slot=0, tokens=[3, 1, 3], pos=2, max_draft=4)],
                                 tree, max_slots=1)
    # after 3: only 1 (node 2 repeats it); after [3, 1]: 3 (node 3); node 4 under a repeat
    assert list(ids[0]) == [1, 1, 3, 1] and num[0] == 3
    _, _, num = d.propose_tree([DraftRow(slot=0, tokens=tokens, pos=6, max_draft=2)], tree, 1)
    assert num[0] == 2


def test_tree_config_errors():
    with pytest.raises(ValueError, match="drafter that drafts trees"):
        EngineConfig(speculative_method="self", spec_tree="2,2")
    with pytest.raises(ValueError, match="neither per-depth"):
        EngineConfig(speculative_method="ngram", spec_tree="two")
    assert EngineConfig(speculative_method="ngram", spec_tree="3,2").spec_width == 9


def test_tree_verification_through_the_pallas_kernels_in_interpret_mode(monkeypatch):
    """--attention_impl=pallas with tree drafts (holding the greedy tokens, as in the test
    above): the verification attends with the decode kernel's tree queries and accepts paths
    off the first-child line (interpret mode on CPU); the same greedy tokens as the XLA path."""
    from jaxinfer.engine.speculative import NGramDrafter
    from tests.test_speculative import VOCAB, run

    config = toy_config(vocab_size=VOCAB, max_position=128, num_layers=2, head_dim=16)
    params = init_params(config, seed=5, scale=0.3)
    params["lm_head"] *= 8.0
    target = Llama(config, params)
    ps = [[5, 6, 7, 8, 5, 6, 9, 8, 5, 6]]
    sampling = SamplingConfig(max_new_tokens=5, ignore_eos=True)
    cache = CacheConfig(page_size=16, max_seq_len=16)  # the Triton kernel's smallest page
    kw = dict(speculative_method="ngram", spec_tree="2,1", max_slots=1,
              max_num_batched_tokens=16)
    expected, _ = run(target, ps, sampling, cache=cache, max_slots=1,
                      max_num_batched_tokens=16)
    monkeypatch.setattr(NGramDrafter, "continuations", _oracle_continuations(
        [ps[0] + expected[0]], VOCAB))
    seen = _recording_commits(monkeypatch)
    got, eng = run(target, ps, sampling, cache=cache, attention_impl="pallas", **kw)
    assert eng.runner.attention_impl == "pallas" and eng.stats()["spec_accepted_tokens"] > 0
    assert got == expected and _off_first_child_line(seen)


@pytest.mark.parametrize("workers", [1, 3])
def test_warmup_compiles_the_tree_verification(workers):
    """Serial and concurrent warm-up compile the tree verification (and the accepted path's
    K/V move) that serving uses, at each page bucket (4 and 6 of the 6 pages, a floor of 4): a
    workload with n-gram tree drafts then compiles nothing."""
    from jaxinfer.engine.engine import Engine
    from tests.helpers import count_compiles
    from tests.test_speculative import _toy

    jax.clear_caches()
    eng = Engine(_toy(5, num_layers=2), None,
                 cache=CacheConfig(page_size=8, max_seq_len=48, min_bucket_pages=4),
                 engine=EngineConfig(max_slots=2, prefill_buckets=(16, 32),
                                     max_num_batched_tokens=34, speculative_method="ngram",
                                     spec_tree="2,1"))
    eng.warmup(workers=workers)
    with count_compiles() as after:
        ids = [eng.add_request(p, SamplingConfig(max_new_tokens=10, ignore_eos=True))
               for p in ([1, 2, 3, 4, 5] * 3, [9, 8, 7] * 4)]
        eng.run()
    assert after == [], f"compiled {after} after warm-up"
    assert eng.stats()["spec_drafted_tokens"] > 0 and all(eng.results(i) for i in ids)


def test_a_constrained_tree_keeps_forbidden_nodes_of_a_drafter_with_q():
    """`SpecDecoder._constrain_tree` under a grammar that forbids token 9, on the tree "2,1"
    with node 2 = 9 (node 4 below it): one-hot drafts are cut before node 2; a drafter with q
    keeps every node (node 2's rejection shapes the residual the correction is drawn from), the
    masks of node 2 and its descendant all ones, the others the grammar's after their paths."""
    from types import SimpleNamespace

    from jaxinfer.engine.spec import SpecDecoder

    class Forbids9:
        def check_drafts(self, drafts, out):
            k = next((j for j, t in enumerate(drafts) if t == 9), len(drafts))
            for j in range(k + 1):
                out[j] = 100 + j + sum(drafts[:j])  # a mask naming the path it follows
            return k

    tree = DraftTree.parse("2,1")  # nodes 1, 2 under the root; 3 under 1, 4 under 2
    nodes = np.asarray([5, 9, 6, 7], np.int32)
    for one_hot, want_num, want in [(True, 1, [100, 106, -1, -1, -1]),
                                    (False, 4, [100, 106, -1, 113, -1])]:
        decoder = SimpleNamespace(tree=tree, drafter=SimpleNamespace(one_hot=one_hot))
        allowed = np.full((tree.num_nodes + 1, 1), -1, np.int32)
        num = SpecDecoder._constrain_tree(decoder, Forbids9(), nodes, tree.num_nodes, allowed)
        assert num == want_num and allowed[:, 0].tolist() == want, (one_hot, num, allowed)
