"""EAGLE / EAGLE-3 draft heads (`jaxinfer.model.eagle`, `jaxinfer.engine.eagle`,
`jaxinfer.checkpoint.eagle`, `jaxinfer.train.draft_head`; docs/architecture.md, decision 19) on
toy targets:
the head's forward against the papers' equations written out in numpy; a synthetic checkpoint in
the published layout loads and drafts, malformed ones are clear errors; greedy output with eagle
drafts, chains and trees, equals plain decoding under preemption and prefix sharing, and with
forks and a constrained request in the batch (trees also through the Pallas kernels); a tree
draft's nodes are the head's expansion along each node's path, and its accepted path absorbs
as a prompt chunk would write it; sampled forks equal independent requests; a chi-square test
on 10^5 draws shows sampled output with eagle chain and tree drafts has the target's
distribution (and rejects a q handed to the verifier at the wrong ids); a few seeded training
steps lower the loss and raise the held-out acceptance."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.checkpoint.eagle import load_draft_head, save_draft_head
from jaxinfer.checkpoint.hf import read_safetensors, write_safetensors
from jaxinfer.config import CacheConfig, SamplingConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.model import Llama, init_params
from jaxinfer.model.eagle import EagleHead, HeadConfig, head_params
from jaxinfer.train import draft_head as train
from tests.helpers import toy_config

VOCAB = 96


def _target(seed: int = 5, attention: float = 1.0, **features) -> tuple[Llama, dict]:
    """A toy target (Llama, or with the block `features` given); `attention` scales its
    attention outputs (small: the next token depends mostly on the current one, a text a small
    head can learn from a few sequences)."""
    config = toy_config(vocab_size=VOCAB, max_position=128, num_layers=4, **features)
    params = init_params(config, seed=seed, scale=0.3)
    params["lm_head"] *= 8.0  # sharp logits: no near-ties for float noise to flip
    for i in range(config.num_layers):
        params[f"layers.{i}.o"] *= attention
    return Llama(config, params), params


def _head(target: Llama, canonical: dict, kind: str, seed: int = 1,
          draft_vocab: int | None = None) -> tuple[HeadConfig, dict]:
    """A random head for `target` (its canonical params `canonical`); EAGLE-3's draft
    vocabulary a random sorted subset."""
    config = HeadConfig.for_target(target.config, kind=kind, draft_vocab_size=draft_vocab)
    d2t = None
    if kind == "eagle3":
        d2t = np.sort(np.random.default_rng(seed).choice(
            VOCAB, config.draft_vocab_size, replace=False)).astype(np.int32)
    params = train.init_head_params(config, canonical, d2t=d2t, seed=seed, scale=0.3)
    rng = np.random.default_rng(seed + 1)
    unused = "layers.0.attn_norm" if kind == "eagle" else None  # EAGLE's layer has none
    for name in params:  # norms away from 1, so a missing or misplaced norm shows
        if name.endswith("norm") and name != unused:
            params[name] = (params[name] * rng.uniform(0.5, 1.5, params[name].shape)
                            ).astype(np.float32)
    return config, params


# ----- the head's forward against the papers' equations --------------------------------------
def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, theta):  # x [T, heads, H] at positions 0..T-1, rotate-half (Llama)
    h = x.shape[-1]
    inv = theta ** (-np.arange(0, h, 2) / h)
    ang = np.arange(x.shape[0])[:, None, None] * inv
    x1, x2 = x[..., :h // 2], x[..., h // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                           x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def _paper_head(config: HeadConfig, p: dict, emb, feats, target_head, final_norm=None):
    """The head over one sequence, written from the papers (EAGLE: x_j = fc([e(t_j); f_{j-1}]),
    one decoder layer without its input norm, the target's LM head; EAGLE-3: fc fuses the low,
    middle and high features, the layer attends over [input_norm(e); hidden_norm(g)] with g as
    the residual, logits = lm_head(norm(h)) over the draft vocabulary). emb [T, D] the tokens'
    embeddings, feats [T, F, D_t] the target's features at each position (position j reads
    j - 1's; position 0 zeros). Returns (h [T, D], logits [T, V_d]), float64."""
    c = config.layer
    eps = c.rms_norm_eps
    t = emb.shape[0]
    f = feats.reshape(t, -1)
    prev = np.concatenate([np.zeros_like(f[:1]), f[:-1]])  # f_{j-1}
    if config.kind == "eagle":
        x = np.concatenate([emb, prev], -1) @ np.concatenate([p["fc_embed"], p["fc"]], 0)
        attn_in, residual = x, x
    else:
        g = prev @ p["fc"]
        attn_in = np.concatenate([_rms(emb, p["layers.0.attn_norm"], eps),
                                  _rms(g, p["hidden_norm"], eps)], -1)
        residual = g
    q = np.einsum("TD,DNH->TNH", attn_in, p["layers.0.q"])
    k = np.einsum("TD,DKH->TKH", attn_in, p["layers.0.k"])
    if c.qk_norm:  # Qwen3: each head's q and k normed before RoPE
        q, k = _rms(q, p["layers.0.q_norm"], eps), _rms(k, p["layers.0.k_norm"], eps)
    q, k = _rope(q, c.rope.theta), _rope(k, c.rope.theta)
    v = np.einsum("TD,DKH->TKH", attn_in, p["layers.0.v"])
    rep = c.num_q_heads // c.num_kv_heads
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = np.einsum("TNH,SNH->NTS", q, k) / np.sqrt(c.head_dim)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    attn = np.einsum("NTS,SNH->TNH", w, v)
    h = residual + np.einsum("TNH,NHD->TD", attn, p["layers.0.o"])
    m = _rms(h, p["layers.0.mlp_norm"], eps)
    gate, up = m @ p["layers.0.gate"], m @ p["layers.0.up"]
    h = h + (gate / (1 + np.exp(-gate)) * up) @ p["layers.0.down"]
    if config.kind == "eagle":
        return h, h @ target_head
    return h, _rms(h, p["norm"], eps) @ p["lm_head"]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("features", [{}, dict(arch="qwen3", qk_norm=True)],
                         ids=["llama", "qwen3"])
def test_head_forward_matches_the_papers_equations(features, kind):
    """Step 0 of the training-time forward (what every served entry computes: tests below
    check the served drafts against it) equals the equations in float64 on a toy target, a
    Qwen3 one's head with the family's per-head q/k norms."""
    target, canonical = _target(**features)
    config, params = _head(target, canonical, kind, draft_vocab=40 if kind == "eagle3" else None)
    head = EagleHead(config, params)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (1, 12)).astype(np.int32)
    data = train.record(target, [(tokens[0, :3].tolist(), tokens[0, 3:].tolist())], config,
                        seq_len=12, batch_size=1)
    (h,) = train.ttt_forward(head, target, jnp.asarray(data.tokens), jnp.asarray(data.feats), 1)
    logits = head.logits(h, target)
    p64 = {k: np.asarray(v, np.float64) for k, v in params.items()}
    emb = np.asarray(canonical["embed"], np.float64)[tokens[0]]
    want_h, want_logits = _paper_head(config, p64, emb, np.asarray(data.feats[0], np.float64),
                                      np.asarray(canonical["lm_head"], np.float64))
    np.testing.assert_allclose(np.asarray(h[0]), want_h, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(logits[0]), want_logits, rtol=2e-4, atol=2e-3)


# ----- the published layout ------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_published_layout_checkpoint_loads_as_written(kind, tmp_path):
    target, canonical = _target()
    config, params = _head(target, canonical, kind, draft_vocab=40 if kind == "eagle3" else None)
    save_draft_head(str(tmp_path), config, params)
    tensors = read_safetensors(str(tmp_path / "model.safetensors"))
    if kind == "eagle3":  # the names and conventions EAGLE-3's authors publish
        assert tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)
        assert tensors["fc.weight"].shape == (32, 96) and tensors["t2d"].sum() == 40
        np.testing.assert_array_equal(tensors["d2t"] + np.arange(40), params["d2t"])
    else:
        assert tensors["fc.weight"].shape == (32, 64) and "layers.0.mlp.up_proj.weight" in tensors
    head = load_draft_head(str(tmp_path), target.config)
    assert head.config == dataclasses.replace(config, layer=head.config.layer)
    back = head_params(head)  # what a trained head exports from
    assert back.keys() == params.keys()
    for name in params:
        np.testing.assert_array_equal(back[name], params[name], err_msg=name)
    loaded = nnx.state(head, nnx.Param)
    want = nnx.state(EagleHead(config, params), nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, loaded, want)


def _corrupt(path, **changes):
    """Rewrites the checkpoint at `path`: tensor name -> new array, or None to drop it."""
    f = os.path.join(path, "model.safetensors")
    tensors = {k: np.array(v) for k, v in read_safetensors(f).items()}  # off the mapped file
    for name, value in changes.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    write_safetensors(f, tensors)


def test_malformed_checkpoints_are_clear_errors(tmp_path):
    target, canonical = _target()
    config, params = _head(target, canonical, "eagle3", draft_vocab=40)
    cases = {
        "missing": (dict(**{"midlayer.mlp.down_proj.weight": None}),
                    r"'midlayer.mlp.down_proj.weight' .* is missing"),
        "shape": (dict(**{"fc.weight": np.zeros((32, 64), np.float32)}),
                  r"'fc.weight' has shape \(32, 64\), expected \(32, 96\)"),
        "extra": (dict(**{"midlayer.extra.weight": np.zeros((2,), np.float32)}),
                  r"unexpected draft head tensor 'midlayer.extra.weight'"),
        "d2t": (dict(d2t=np.full((40,), VOCAB, np.int64)), r"'d2t' and 't2d' disagree"),
    }
    for name, (changes, match) in cases.items():
        path = tmp_path / name
        save_draft_head(str(path), config, params)
        _corrupt(str(path), **changes)
        with pytest.raises(ValueError, match=match):
            load_draft_head(str(path), target.config)
    other, _ = _target()
    wide = dataclasses.replace(other.config, vocab_size=VOCAB + 4)
    save_draft_head(str(tmp_path / "ok"), config, params)
    with pytest.raises(ValueError, match="vocab_size=96 differs from the target's 100"):
        load_draft_head(str(tmp_path / "ok"), wide)
    with pytest.raises(ValueError, match="is not a directory"):
        load_draft_head(str(tmp_path / "nothing"), target.config)
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="num_hidden_layers=2: only one-layer heads"):
        load_draft_head(str(tmp_path / "ok"), target.config)


# ----- through the engine ----------------------------------------------------------------------
def _prompts(n: int) -> list[list[int]]:
    """`test_speculative`'s prompts (long enough to preempt in its pool) after a shared page."""
    from tests.test_speculative import prompts

    shared = [int(t) for t in np.random.default_rng(3).integers(0, VOCAB, 8)]
    return [shared + p for p in prompts(n)]


def _run(target, ps, sampling, head=None, **kw):
    from tests.test_speculative import CACHE, engine_config

    llm = LLM(target, None, cache=CACHE, engine=engine_config(**kw), draft_head=head)
    out = [r.token_ids for r in llm.generate(ps, sampling, use_tqdm=False)]
    llm.engine.scheduler.check_invariants()
    return out, llm.engine.stats()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_eagle_speculation_equals_plain_decoding(kind, tmp_path):
    """A synthetic checkpoint in the published layout loaded and drafting: batch 8 under a
    pool that preempts, with a shared prefix, rows with 0 drafts left; then batch 1."""
    target, canonical = _target()
    config, params = _head(target, canonical, kind, draft_vocab=40 if kind == "eagle3" else None)
    save_draft_head(str(tmp_path), config, params)
    head = load_draft_head(str(tmp_path), target.config)
    ps = _prompts(8)
    sampling = [SamplingConfig(max_new_tokens=m, ignore_eos=True)
                for m in (24, 1, 17, 30, 2, 24, 9, 28)]
    expected, _ = _run(target, ps, sampling)
    got, s = _run(target, ps, sampling, head, speculative_method="eagle",
                  num_speculative_tokens=3)
    assert got == expected
    stats = {k: s[k] for k in ("preemptions", "prefix_hits", "spec_drafted_tokens")}
    assert all(v > 0 for v in stats.values()), stats
    got, _ = _run(target, ps[:2], sampling[:2], head, speculative_method="eagle",
                  num_speculative_tokens=2, max_slots=1)
    assert got == expected[:2]
    # Chains cut by confidence: ragged verifications at widths 1, 2 and 4 (R = 4).
    got, s = _run(target, ps, sampling, head, speculative_method="eagle",
                  num_speculative_tokens=4, draft_confidence=0.05)
    assert got == expected
    assert 0 < s["spec_drafted_tokens"] < 4 * s["spec_verify_rows"], s


@pytest.mark.parametrize("workers,tree,confidence", [(1, None, 0.0), (3, None, 0.0),
                                                     (3, "2,1", 0.0), (1, None, 0.05)])
def test_warmup_compiles_the_eagle_steps(workers, tree, confidence):
    """Serial and concurrent warm-up compile the head's draft, mirror and absorb steps (chains,
    or the tree's; chains cut by confidence at each width) and the target's feature-emitting
    steps, at each page bucket (a floor of 4 of the 6 pages: buckets 4 and 6): a workload with
    eagle drafts then compiles nothing."""
    from jaxinfer.config import CacheConfig, EngineConfig
    from jaxinfer.engine.engine import Engine
    from tests.helpers import count_compiles

    jax.clear_caches()
    target, canonical = _target()
    config, params = _head(target, canonical, "eagle3", draft_vocab=40)
    eng = Engine(target, None, cache=CacheConfig(page_size=8, max_seq_len=48,
                                                   min_bucket_pages=4),
                 engine=EngineConfig(max_slots=2, prefill_buckets=(16, 32),
                                     max_num_batched_tokens=34, speculative_method="eagle",
                                     num_speculative_tokens=2 + 2 * (confidence > 0),
                                     spec_tree=tree, draft_confidence=confidence),
                 draft_head=EagleHead(config, params))
    eng.warmup(workers=workers)
    with count_compiles() as after:
        ids = [eng.add_request(p, SamplingConfig(max_new_tokens=10, ignore_eos=True))
               for p in _prompts(2)]
        eng.run()
    assert after == [], f"compiled {after} after warm-up"
    assert eng.stats()["spec_drafted_tokens"] > 0 and all(eng.results(i) for i in ids)


# ----- draft trees ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_eagle_tree_speculation_equals_plain_decoding(kind, monkeypatch):
    """Tree drafts from the head ("3,2,1": its top 3, 2 and 1 tokens per depth): batch 8 under
    a pool that preempts, with a shared prefix, rows with 0 or 1 tokens left; accepted paths
    leave the first-child line (their K/V moved by `commit_path`, the head's recomputed by
    `absorb_tree_step`); then batch 1. Plain decoding's tokens every time."""
    from tests.test_spec_tree import _off_first_child_line, _recording_commits

    target, canonical = _target()
    config, params = _head(target, canonical, kind, draft_vocab=40 if kind == "eagle3" else None)
    head = EagleHead(config, params)
    ps = _prompts(8)
    sampling = [SamplingConfig(max_new_tokens=m, ignore_eos=True)
                for m in (24, 1, 17, 30, 2, 24, 9, 28)]
    expected, _ = _run(target, ps, sampling)
    seen = _recording_commits(monkeypatch)
    got, s = _run(target, ps, sampling, head, speculative_method="eagle", spec_tree="3,2,1")
    assert got == expected
    stats = {k: s[k] for k in ("preemptions", "prefix_hits", "spec_accepted_tokens")}
    assert all(v > 0 for v in stats.values()), stats
    assert _off_first_child_line(seen)
    got, _ = _run(target, ps[:2], sampling[:2], head, speculative_method="eagle",
                  spec_tree="2,1", max_slots=1)
    assert got == expected[:2]


def _chain_outputs(target, head, head_kv, table, pos, tokens, num_pages_read):
    """The head run one position at a time along `tokens` (the root's, then a path's) from
    position pos, as a chain draft runs it (its own hidden fed forward), on a copy of the pool
    `head_kv` through page-table row `table` i32[1, P]: the last position's output h [1, D].
    Op by op, outside any compiled program: the reference the drafted q rows are held to at
    rtol 1e-4 (through sharp logits, a program fused otherwise than the draft step's differs
    from it by more)."""
    from jaxinfer.engine import eagle as eagle_engine
    from jaxinfer.model import StepBatch

    kv = jax.tree.map(jnp.copy, head_kv)
    h = None
    for j, tok in enumerate(tokens):
        rows = StepBatch.per_slot(jnp.asarray([[tok]], jnp.int32),
                                  jnp.asarray([[pos + j]], jnp.int32), jnp.ones((1, 1), bool),
                                  jnp.asarray(table, jnp.int32),
                                  jnp.asarray([pos + j + 1], jnp.int32),
                                  num_pages_read=num_pages_read)
        if h is None:
            g, kv = eagle_engine.exchange_hidden(kv, None, rows)
        else:
            g = head.next_hidden(h)
        h, kv = eagle_engine._head_rows(head, target, kv, jnp.asarray([tok], jnp.int32), g,
                                        rows)
    return h


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_tree_draft_is_the_heads_expansion_and_absorbs_as_a_chain(kind):
    """Two slots sharing an 8-token context page pair draft the tree "3,2,1" (slot 0 greedy,
    slot 1 sampled): each node's children are the head's top 3 / 2 / 1 tokens (greedy) and
    each q row the head's distribution (sampled; its children distinct tokens of its support),
    at the output of the head run along the node's path one position at a time (a chain).
    Then the tree is verified by the target and paths off the first-child line absorbed: the
    head's pools hold at the path's positions what a prompt chunk of the context and path
    writes (the target's hidden in the store, the head's entries computed from it)."""
    from jaxinfer.config import DraftTree
    from jaxinfer.engine import eagle as eagle_engine
    from jaxinfer.engine import steps
    from jaxinfer.engine.sampling import SamplingParams, filtered_probs

    target, canonical = _target()
    config, params = _head(target, canonical, kind, draft_vocab=40 if kind == "eagle3" else None)
    head = EagleHead(config, params)
    tree = DraftTree.parse("3,2,1")
    ctx = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB, 9)]
    pos, per = 8, 6
    table = np.asarray([[0, 1, 2, 3, 4, 5], [0, 1, 6, 7, 8, 9]], np.int32)
    cache = CacheConfig(page_size=4, max_seq_len=4 * per, num_pages=10)
    base, head_base = _mirrored(target, head, ctx[:pos], cache, 2, table[:1])
    graph, tparams = steps.split_model(target)
    head_graph, hparams = steps.split_model(head)
    sampling = SamplingParams.from_configs([SamplingConfig(), SamplingConfig(temperature=1.0,
                                                                             seed=3)])
    head_kv, ids, probs = eagle_engine.draft_tree_step(
        head_graph, hparams, graph, tparams, jax.tree.map(jnp.copy, head_base), sampling,
        table, np.full(2, pos, np.int32), np.full(2, ctx[pos], np.int32),
        np.full(2, tree.num_nodes, np.int32), tree=tree, num_pages_read=per)
    ids, probs = np.asarray(ids), np.asarray(probs)
    for slot in range(2):
        for e, node in enumerate(tree.expanded):
            path = [ctx[pos]] + [int(ids[slot, a - 1]) for a in tree.ancestors(node)[1:]]
            h = _chain_outputs(target, head, head_base, table[slot:slot + 1], pos, path, per)
            logits = head.logits(h, target)
            kids = [int(ids[slot, c - 1]) for c in tree.children[node]]
            if slot == 0:
                top = np.asarray(jax.lax.top_k(logits[0], len(kids))[1])
                assert kids == [int(t) for t in head.target_ids(top)], (node, kids)
                continue
            row = SamplingParams.from_configs([SamplingConfig(temperature=1.0)])
            want = np.asarray(head.to_target_probs(filtered_probs(logits, row)))[0]
            np.testing.assert_allclose(probs[1, e], want, rtol=1e-4, atol=1e-6)
            assert len(set(kids)) == len(kids) and (want[kids] > 0).all(), (node, kids)

    # verify, then absorb paths off the first-child line: slot 0 takes 2 -> 7 -> 13 (3
    # drafts), slot 1 takes 3 -> 8 (2 drafts)
    st = steps.create_slot_state(2, VOCAB).replace(tokens=jnp.full((2,), ctx[pos], jnp.int32))
    batch = steps.VerifyBatch(page_table=table, active=np.ones(2, bool),
                              pos=np.full(2, pos, np.int32), draft_ids=ids,
                              num_draft=np.full(2, tree.num_nodes, np.int32))
    _, _, feats = steps.verify_forward(graph, tparams, jax.tree.map(jnp.copy, base), st.tokens,
                                       batch, num_rows=2 * (tree.num_nodes + 1),
                                       num_pages_read=per, tree=tree,
                                       feature_layers=config.feature_layers)
    path = np.asarray([[2, 7, 13], [3, 8, 0]], np.int32)
    accepted = np.asarray([3, 2], np.int32)
    head_kv = eagle_engine.absorb_tree_step(head_graph, hparams, graph, tparams, head_kv, batch,
                                            feats, path, accepted + 1, num_pages_read=per)
    for slot in range(2):
        seq = ctx + [int(ids[slot, n - 1]) for n in path[slot, :accepted[slot]]]
        _, want = _mirrored(target, head, seq, cache, 2, table[slot:slot + 1])
        at = np.arange(pos, pos + accepted[slot] + 1)  # the root's entry too (drafted)
        pages, offs = table[slot, at // 4], at % 4
        for got, exp in zip(head_kv.k_pages + head_kv.v_pages, want.k_pages + want.v_pages):
            np.testing.assert_allclose(np.asarray(got)[..., pages, offs, :],
                                       np.asarray(exp)[..., pages, offs, :],
                                       rtol=2e-4, atol=2e-4, err_msg=f"slot {slot}")


# ----- training --------------------------------------------------------------------------------
def _greedy_data(target, config, seed, num=16, n_tokens=24):
    rng = np.random.default_rng(seed)
    ps = [[int(t) for t in rng.integers(0, VOCAB, 6 + i % 5)] for i in range(num)]
    llm = LLM(target, None)
    outs = llm.generate(ps, SamplingConfig(max_new_tokens=n_tokens, ignore_eos=True),
                        use_tqdm=False)
    return ps, train.record(target, [(p, o.token_ids) for p, o in zip(ps, outs)], config,
                            seq_len=40)


def test_training_answers_are_the_greedy_ones_then_seeded_draws():
    """`train.generate` with samples=3: every prompt's greedy answer in prompt order (the
    engine's plain greedy output), then two draws per prompt at the temperature, seeded (a
    rerun gives the same) and distinct per prompt; a prompt the engine refuses fails alone,
    and draws without a temperature are a clear error."""
    target, _ = _target()
    rng = np.random.default_rng(3)
    ps = [[int(t) for t in rng.integers(0, VOCAB, 5 + i)] for i in range(3)]
    llm = LLM(target, None)
    greedy = [o.token_ids for o in llm.generate(ps, SamplingConfig(max_new_tokens=8),
                                                use_tqdm=False)]
    seqs, errors = train.generate(llm, ps + [[VOCAB + 1]], max_new_tokens=8, samples=3,
                                  temperature=4.0, seed=7)  # the toy's logits are sharp
    assert len(errors) == 1 and errors[0].startswith("prompt 3: ") and str(VOCAB + 1) in (
        errors[0]), errors
    assert [a for _, a in seqs[:3]] == greedy and [p for p, _ in seqs[:3]] == ps
    assert [p for p, _ in seqs[3:]] == [p for p in ps for _ in range(2)]
    drawn = [tuple(a) for _, a in seqs[3:]]
    assert len(set(drawn)) == len(drawn) and not set(drawn) & {tuple(g) for g in greedy}
    again, _ = train.generate(llm, ps, max_new_tokens=8, samples=3, temperature=4.0, seed=7)
    assert again == seqs
    with pytest.raises(ValueError, match="samples=2 needs temperature > 0"):
        train.generate(llm, ps, max_new_tokens=8, samples=2)
    with pytest.raises(ValueError, match="samples=0 must be >= 1"):
        train.generate(llm, ps, max_new_tokens=8, samples=0)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_a_few_training_steps_lower_the_loss_and_raise_acceptance(kind):
    """Seeded: 90 optax steps on the target's own greedy answers to 48 prompts (EAGLE-3: its
    draft vocabulary their 64 most frequent tokens) lower the loss and raise the replayed
    acceptance on held-out prompts; the engine's measured acceptance with the trained head on
    those prompts is the replay's (the served drafts are the trained forward's); the
    training-answers acceptance beside it is the replay on the first training sequences."""
    target, canonical = _target(attention=0.1)
    config = HeadConfig.for_target(target.config, kind=kind,
                                   draft_vocab_size=64 if kind == "eagle3" else None)
    _, data = _greedy_data(target, config, 0, num=48)
    held_ps, held = _greedy_data(target, config, 1)
    d2t = train.draft_vocab(data, 64, VOCAB) if kind == "eagle3" else None
    head = EagleHead(config, train.init_head_params(config, canonical, d2t=d2t, seed=0,
                                                    scale=0.02))
    before = train.untrained_acceptance(head, target, held, depth=3)
    trained, history, _ = train.fit(head, target, data, held, train.TrainConfig(
        steps=90, lr=1e-2, warmup=5, depth=2, eval_every=90, eval_depth=3))
    first, last = (np.mean([r["loss"] for r in history[:5]]),
                   np.mean([r["loss"] for r in history[-5:]]))
    after = history[-1]["acceptance"]
    assert last < 0.7 * first and after > before + 0.08, (first, last, before, after)
    seen = train.untrained_acceptance(trained, target, data.take(np.arange(len(held))), 3)
    assert history[-1]["train_acceptance"] == seen  # the first training sequences, replayed
    _, s = _run(target, held_ps, SamplingConfig(max_new_tokens=24, ignore_eos=True), trained,
                speculative_method="eagle", num_speculative_tokens=3)
    assert s["mean_accepted_length"] == pytest.approx(after, abs=0.05), (s, after)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_head_can_start_as_a_target_layer(kind):
    """`init_head_params(from_layer=i)`: the head's layer is the target's layer i, array for
    array; where EAGLE-3's q/k/v read [embedding; hidden], an input of two equal halves
    projects as the target's layer projects one of them. The rest starts as without it."""
    target, canonical = _target()
    config = HeadConfig.for_target(target.config, kind=kind,
                                   draft_vocab_size=40 if kind == "eagle3" else None)
    d2t = np.arange(40, dtype=np.int32) if kind == "eagle3" else None
    plain = train.init_head_params(config, canonical, d2t=d2t, seed=3)
    params = train.init_head_params(config, canonical, d2t=d2t, seed=3, from_layer=2)
    x = np.random.default_rng(0).normal(size=(5, target.config.embed_dim)).astype(np.float32)
    for name, value in params.items():
        if not name.startswith("layers.0."):
            np.testing.assert_array_equal(value, plain[name])
            continue
        want = canonical[name.replace("layers.0.", "layers.2.")]
        if value.shape == want.shape:
            np.testing.assert_array_equal(value, want)
            continue
        assert kind == "eagle3" and name[-1] in "qkv", name
        got = np.concatenate([x, x], axis=1) @ value.reshape(value.shape[0], -1)
        np.testing.assert_allclose(got, x @ want.reshape(want.shape[0], -1), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("tied,weight_dtype", [(False, None), (True, None), (True, "int8"),
                                               (False, "int8")])
def test_eagle3_training_targets_read_only_the_draft_columns(tied, weight_dtype):
    """The training targets of an EAGLE-3 head, from the target's LM head on the draft
    vocabulary alone (`draft_columns`), equal the target's whole-vocabulary distribution
    restricted to the draft vocabulary and renormalised, for tied, untied and int8 heads."""
    config = toy_config(vocab_size=VOCAB, max_position=64, tie_embeddings=tied,
                        weight_dtype=weight_dtype)
    canonical = init_params(dataclasses.replace(config, weight_dtype=None), seed=3, scale=0.3)
    target = Llama(config, canonical)
    d2t = np.sort(np.random.default_rng(0).choice(VOCAB, 24, replace=False)).astype(np.int32)
    head_config = HeadConfig.for_target(config, kind="eagle3", draft_vocab_size=24)
    head = EagleHead(head_config, train.init_head_params(head_config, canonical, d2t=d2t))
    final = np.random.default_rng(1).normal(0, 1, (2, 5, config.embed_dim)).astype(np.float32)
    got = train._targets(head, target, jnp.asarray(final), train.draft_columns(head, target))
    want = jax.nn.softmax(target.head(jnp.asarray(final))[..., d2t], axis=-1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


# ----- the sampled output's distribution (chi-square) ---------------------------------------
def _small_head(kind: str):
    """test_speculative's 12-token chi-square target and a random head (EAGLE-3: a draft
    vocabulary of 7 of the 12 tokens, mapped out of order of the identity, so q is zero on 5)."""
    from tests.test_speculative import SMALL_V

    config = toy_config(vocab_size=SMALL_V, max_position=16)
    canonical = init_params(config, seed=11, scale=0.5)
    target = Llama(config, canonical)
    head_config = HeadConfig.for_target(config, kind=kind,
                                        draft_vocab_size=7 if kind == "eagle3" else None)
    d2t = (np.array([0, 2, 3, 5, 8, 9, 11], np.int32) if kind == "eagle3" else None)
    params = train.init_head_params(head_config, canonical, d2t=d2t, seed=4, scale=0.5)
    return target, EagleHead(head_config, params)


def _mirrored(target: Llama, head: EagleHead, tokens: list[int], cache: CacheConfig,
              slots: int, table=((0, 1),)):
    """The target's and the head's pools with `tokens` at positions 0.. of the pages `table`
    (i32[1, P]) lists (what a prompt chunk and `mirror_step` write): (target KVCache, head
    KVCache). One compiled program per length, not the forward op by op. The pools are
    committed to the device, as the steps' outputs are: a step handed an uncommitted array
    where it is later handed its own output compiles a second program."""
    pools = _mirror_pools(target, head, jnp.asarray([tokens], jnp.int32),
                          jnp.asarray(table, jnp.int32), cache=cache, slots=slots)
    return jax.device_put(pools, jax.devices()[0])


@functools.partial(jax.jit, static_argnames=("cache", "slots"))
def _mirror_pools(target, head, tokens, table, *, cache: CacheConfig, slots: int):
    from jaxinfer.engine import eagle as eagle_engine
    from jaxinfer.engine.kv_cache import create_cache
    from jaxinfer.model import CHUNK, StepBatch

    n = tokens.shape[1]
    kv = create_cache(target.config, cache, slots)
    step = StepBatch.per_slot(tokens, jnp.arange(n, dtype=jnp.int32)[None],
                              jnp.ones((1, n), bool), table, jnp.asarray([n], jnp.int32),
                              num_pages_read=table.shape[1], kind=CHUNK)
    _, feats, kp, vp = target.with_features(step, kv.k_pages, kv.v_pages,
                                            head.config.feature_layers)
    head_kv = eagle_engine.create_head_cache(head.config, cache, slots)
    g_prev, head_kv = eagle_engine.exchange_hidden(head_kv, head.project(feats), step)
    _, head_kv = eagle_engine._head_rows(head, target, head_kv, step.tokens, g_prev, step)
    return kv.replace(k_pages=kp, v_pages=vp), head_kv


def _eagle_draws(target: Llama, head: EagleHead, tree: str | None = None,
                 keep=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`test_speculative._spec_draws` with the drafts from the head, through the serving
    drafter's own steps: the prompt's first 4 tokens mirrored into the head's pools (one
    shared page), then per row R = 2 drafts (`draft_step`; with `tree`, that draft tree,
    `draft_tree_step`) verified (`verify_step`, emitting the features; a tree's accepted
    path's K/V moved by `commit_path`), and for the rows that emitted one token the
    verification absorbed (`absorb_step`, `absorb_tree_step`) and a second draft verified.
    keep(num, ids, q, confidence) -> num: the chain drafts each row keeps (None: both).
    10^5 rows: (first, second tokens, the exact target joint)."""
    from jaxinfer.config import DraftTree
    from jaxinfer.engine import eagle as eagle_engine
    from jaxinfer.engine import spec_tree, steps
    from tests.helpers import prefill_rows
    from tests.test_speculative import REPEATS, ROWS, _seeded_rows

    config, hc = target.config, head.config
    temperature, prompt, ps = 1.3, [3, 1, 4, 1, 5], 4
    graph, params = steps.split_model(target)
    head_graph, head_params_ = steps.split_model(head)
    shape = None if tree is None else DraftTree.parse(tree)
    width = 2 if shape is None else shape.num_nodes
    per = 1 + -(-(1 + width) // ps)  # the shared page, then the row's own for pos 4 .. 5 + width
    cache_config = CacheConfig(page_size=ps, max_seq_len=per * ps, num_pages=1 + ROWS * per)
    base, head_base = _mirrored(target, head, prompt[:4], cache_config, ROWS)

    def next_probs(seq):
        lg, _, _ = prefill_rows(target, [seq], [[1, 2]], base.k_pages, base.v_pages,
                                num_pages_read=2)
        return np.asarray(jax.nn.softmax(lg[0, -1] / temperature), np.float64)

    p1 = next_probs(prompt)
    joint = np.stack([p1[a] * next_probs(prompt + [a]) for a in range(config.vocab_size)])
    table = np.concatenate([np.zeros((ROWS, 1)), 1 + np.arange(ROWS * (per - 1)).reshape(
        ROWS, per - 1)], axis=1).astype(np.int32)
    ones = np.ones(ROWS, bool)
    num = np.full(ROWS, width, np.int32)
    args = dict(num_pages_read=per)

    def verify(kv, st, head_kv, sampling, pos, last):
        draft_args = (head_graph, head_params_, graph, params, head_kv, sampling, table,
                      np.full(ROWS, pos, np.int32), last, num)
        kept = num
        if shape is None:
            head_kv, ids, probs, conf = eagle_engine.draft_step(*draft_args, num_spec=2,
                                                                **args)
            if keep is not None:
                kept = keep(num, np.asarray(ids), np.asarray(probs), np.asarray(conf))
        else:
            head_kv, ids, probs = eagle_engine.draft_tree_step(*draft_args, tree=shape, **args)
        batch = steps.VerifyBatch(page_table=table, active=ones,
                                  pos=np.full(ROWS, pos, np.int32), draft_ids=ids,
                                  num_draft=kept)
        kv, st, out, feats = steps.verify_step(graph, params, kv, st, sampling, batch, probs,
                                               num_rows=ROWS * (width + 1), tree=shape,
                                               feature_layers=hc.feature_layers, **args)
        if shape is not None:
            kv = spec_tree.commit_path(kv, table, batch.pos, out.path, out.num_emitted)
        return kv, st, head_kv, batch, out, feats

    firsts, seconds = [], []
    for rep in range(REPEATS):
        kv, head_kv = jax.tree.map(jnp.copy, (base, head_base))
        st = jax.device_put(steps.create_slot_state(ROWS, config.vocab_size).replace(
            tokens=jnp.full((ROWS,), prompt[4], jnp.int32)), jax.devices()[0])  # as verify's
        sampling = _seeded_rows(temperature, rep)
        kv, st, head_kv, batch, out, feats = verify(kv, st, head_kv, sampling, 4,
                                                    np.full(ROWS, prompt[4], np.int32))
        toks, n = np.asarray(out.tokens), np.asarray(out.num_emitted)
        absorb_args = (head_graph, head_params_, graph, params, head_kv, batch, feats)
        if shape is None:
            head_kv = eagle_engine.absorb_step(*absorb_args, **args)
        else:
            head_kv = eagle_engine.absorb_tree_step(*absorb_args, out.path, out.num_emitted,
                                                    **args)
        first, second = toks[:, 0], toks[:, 1].copy()
        *_, out2, _ = verify(kv, st, head_kv, sampling, 5, first)
        need = n == 1  # the second token comes from a second verification
        second[need] = np.asarray(out2.tokens)[need, 0]
        firsts.append(first)
        seconds.append(second)
    return np.concatenate(firsts), np.concatenate(seconds), joint


@pytest.mark.optimized  # 10^5-row steps: they run ~2x faster optimised (tests/conftest.py)
@pytest.mark.parametrize("kind,tree", [("eagle", None), ("eagle3", None), ("eagle", "2,1"),
                                       ("eagle3", "3,1")])
def test_sampled_eagle_speculation_has_the_target_distribution(kind, tree):
    """10^5 draws of the first two tokens, drafted by a random head (far from the target) as
    chains and as trees (children sampled without replacement): their joint is the target's
    (chi-square), the EAGLE-3 head drafting over a subset of the vocabulary."""
    from tests.test_speculative import _pvalues

    first, second, joint = _eagle_draws(*_small_head(kind), tree=tree)
    p_first, p_joint = _pvalues(first, second, joint)
    assert p_first > 1e-3 and p_joint > 1e-3, (p_first, p_joint)


def _confidence_cut(threshold: float, own: bool = False):
    """`_eagle_draws`'s keep: `EagleDrafter`'s rule (`confident_drafts`); with `own`, a wrong
    one that keeps a row's drafts only when its first draft's own probability q(x) is below
    the threshold (it picks which samples of q are verified, so the verified drafts no longer
    follow q)."""
    from jaxinfer.engine.eagle import confident_drafts

    def keep(num, ids, q, confidence):
        if own:
            kept = np.where(np.take_along_axis(q[:, 0], ids[:, :1], 1)[:, 0] < threshold,
                            num, 0).astype(np.int32)
        else:
            kept = confident_drafts(num, confidence, threshold)
        assert 0.1 < np.mean(kept == num) < 0.9, np.mean(kept == num)  # rows are cut
        return kept

    return keep


@pytest.mark.optimized
def test_sampled_eagle_chains_cut_by_confidence_have_the_target_distribution():
    """The chain cut of `EngineConfig.draft_confidence` keeps sampled output exact: 10^5 draws
    with each row keeping one or two of its drafts by their confidence (chi-square)."""
    from tests.test_speculative import _pvalues

    first, second, joint = _eagle_draws(*_small_head("eagle3"), keep=_confidence_cut(0.12))
    p_first, p_joint = _pvalues(first, second, joint)
    assert p_first > 1e-3 and p_joint > 1e-3, (p_first, p_joint)


@pytest.mark.slow  # the power check of the test above; -m slow runs it
def test_the_chain_cut_test_rejects_a_cut_by_the_drafts_own_value():
    from tests.test_speculative import _pvalues

    first, second, joint = _eagle_draws(*_small_head("eagle3"),
                                        keep=_confidence_cut(0.4, own=True))
    assert min(_pvalues(first, second, joint)) < 1e-6


@pytest.mark.slow  # the power check of the test above; -m slow runs it
@pytest.mark.parametrize("tree", [None, "3,1"])
def test_the_eagle_distribution_test_rejects_a_misplaced_draft_distribution(monkeypatch, tree):
    """The same draws with the EAGLE-3 head's q handed to the verifier at the draft ids
    instead of the target ids they map to (d2t ignored): the verifier then corrects for a
    distribution the drafts were not drawn from, and the test sees it, for chains and trees."""
    from jaxinfer.engine import eagle as eagle_engine
    from tests.test_speculative import _pvalues

    def unmapped(self, q):
        full = jnp.zeros(q.shape[:-1] + (self.config.layer.vocab_size,), q.dtype)
        return full.at[..., :q.shape[-1]].set(q)

    monkeypatch.setattr(EagleHead, "to_target_probs", unmapped)
    steps = (eagle_engine.draft_step, eagle_engine.draft_tree_step)
    for step in steps:
        step.clear_cache()
    try:
        first, second, joint = _eagle_draws(*_small_head("eagle3"), tree=tree)
    finally:
        for step in steps:
            step.clear_cache()
    p_first, p_joint = _pvalues(first, second, joint)
    assert min(p_first, p_joint) < 1e-6, (p_first, p_joint)


# ----- forks and structured output in the batch ---------------------------------------------
def test_forked_samples_with_eagle_drafts_equal_independent_requests():
    """n sampled forks of one prompt (their prompt's partial page copied in the head's pools
    too) give the samples of n separate requests with seeds seed + i: the drafts, and so the
    accepted tokens, are the same as from a head pool filled by a request of its own."""
    config = toy_config(vocab_size=VOCAB, max_position=128, num_layers=4)
    canonical = init_params(config, seed=5, scale=0.3)  # unsharpened: q overlaps p
    target = Llama(config, canonical)
    config, params = _head(target, canonical, "eagle3", draft_vocab=40)
    head = EagleHead(config, params)
    prompt = _prompts(1)[0] + [7, 8, 9]
    kw = dict(speculative_method="eagle", num_speculative_tokens=3)
    forked, s = _run(target, [prompt], SamplingConfig(
        max_new_tokens=16, ignore_eos=True, temperature=1.0, seed=4, n=4), head, **kw)
    alone, s_alone = _run(target, [prompt] * 4, [SamplingConfig(
        max_new_tokens=16, ignore_eos=True, temperature=1.0, seed=4 + i) for i in range(4)],
        head, **kw)
    assert forked == alone and len({tuple(t) for t in forked}) > 1
    assert s["spec_accepted_tokens"] == s_alone["spec_accepted_tokens"] > 0, (s, s_alone)
    assert s["computed_tokens"] - s["output_tokens"] + 4 < 2 * len(prompt)  # one prefill


@pytest.mark.parametrize("tree", [None, "3,2,1"])
def test_greedy_eagle_with_forks_and_structured_output_in_the_batch(tree):
    """A toy target with SmolLM2's vocabulary and tokenizer (constraints need one): greedy
    requests, a greedy fork of n = 3 and a request under a regex, batched under a pool that
    preempts, with a shared prefix: eagle drafts, chains or trees (the constrained row's
    checked against its grammar), give plain decoding's tokens and the constrained output
    matches the regex."""
    import re

    from jaxinfer.checkpoint.tokenizer import Tokenizer
    from jaxinfer.checkpoint.weights import default_model_path
    from tests.test_speculative import CACHE, engine_config

    vocab = 49152
    config = toy_config(vocab_size=vocab, max_position=128, num_layers=2)
    canonical = init_params(config, seed=5, scale=0.3)
    canonical["lm_head"] *= 8.0  # sharp logits: no near-ties for float noise to flip
    target = Llama(config, canonical)
    head_config = HeadConfig.for_target(config, kind="eagle3", draft_vocab_size=2048)
    head = EagleHead(head_config, train.init_head_params(
        head_config, canonical, d2t=np.arange(2048, dtype=np.int32), seed=1, scale=0.3))
    tokenizer = Tokenizer.from_gguf_file(default_model_path())
    regex = r"[0-9]{3}-[0-9]{4}"
    ps = _prompts(6)
    sampling = [SamplingConfig(max_new_tokens=m, ignore_eos=True) for m in (24, 1, 17, 30)]
    sampling += [SamplingConfig(max_new_tokens=20, ignore_eos=True, n=3),
                 SamplingConfig(max_new_tokens=12, regex=regex)]

    def run(**kw):
        llm = LLM(target, tokenizer, cache=CACHE, engine=engine_config(**kw),
                  draft_head=head if kw else None)
        out = llm.generate(ps, sampling, use_tqdm=False)
        llm.engine.scheduler.check_invariants()
        return [(r.token_ids, r.finish_reason) for r in out], llm.engine.stats()

    expected, _ = run()
    got, s = run(speculative_method="eagle", num_speculative_tokens=3, spec_tree=tree)
    assert got == expected
    assert re.fullmatch(regex, tokenizer.decode(expected[-1][0], skip_special_tokens=True))
    stats = {k: s[k] for k in ("preemptions", "prefix_hits", "spec_drafted_tokens")}
    assert all(v > 0 for v in stats.values()), stats


@pytest.mark.parametrize("spec", ["data:8", "data:2,model:4"])
def test_features_recorded_on_a_mesh_equal_one_device(spec):
    """`record` on a mesh (the target's weights by the sharding rules, the sequences split over
    "data", a batch of 4 rounded up to the data axis) gives the single-device features."""
    from jaxinfer.sharding import make_mesh

    target, _ = _target()
    config = HeadConfig.for_target(target.config, kind="eagle3", draft_vocab_size=32)
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(1, VOCAB, 3 + i).tolist(), rng.integers(1, VOCAB, 18).tolist())
            for i in range(6)]
    one = train.record(target, seqs, config, seq_len=24, batch_size=4)
    got = train.record(target, seqs, config, seq_len=24, batch_size=4, mesh=make_mesh(spec))
    for name, want in one.arrays().items():
        np.testing.assert_allclose(getattr(got, name), want, rtol=1e-4, atol=1e-4,
                                   err_msg=name)


def test_training_on_a_data_mesh_equals_one_device():
    """A few optax steps with each batch split over the 8 fake devices (data:8, the head
    replicated) give the single-device run's losses, metrics and head within float
    tolerance; a batch the data axis does not divide is a clear error."""
    from jaxinfer.sharding import make_mesh

    target, canonical = _target(attention=0.1)
    config = HeadConfig.for_target(target.config, kind="eagle3", draft_vocab_size=64)
    _, data = _greedy_data(target, config, 0, num=16, n_tokens=8)
    d2t = train.draft_vocab(data, 64, VOCAB)
    cfg = train.TrainConfig(steps=4, lr=1e-2, warmup=1, depth=2, eval_every=4, eval_depth=2)

    def fit(mesh):
        head = EagleHead(config, train.init_head_params(config, canonical, d2t=d2t, seed=0))
        trained, history, state = train.fit(head, target, data, data.take(np.arange(4)),
                                            cfg, mesh=mesh)
        return head_params(trained), history, jax.tree.leaves(state[0])[0].sharding

    mesh = make_mesh("data:8")
    (one, h1, _), (eight, h8, placed) = fit(None), fit(mesh)
    assert len(placed.device_set) == 8 and placed.is_fully_replicated
    assert h1[-1].keys() == h8[-1].keys() and "acceptance" in h8[-1]
    for a, b in zip(h1, h8):
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-6, err_msg=k)
    for name in one:
        np.testing.assert_allclose(eight[name], one[name], rtol=1e-4, atol=1e-5, err_msg=name)
    with pytest.raises(ValueError, match=r"batch_size=4 must be a multiple of the mesh's "
                                         r"data axis \(8\)"):
        train.fit(EagleHead(config, train.init_head_params(config, canonical, d2t=d2t)),
                  target, data, data, dataclasses.replace(cfg, batch_size=4), mesh=mesh)


def test_feature_noise_is_eagles_relative_uniform_augmentation_and_seeded():
    """`noisy_features` adds to each entry uniform noise within a times its feature vector's
    RMS (layers of scales 0.1, 1 and 10 alike; spread a / sqrt(3)), the same for one key; a
    training run with it is seeded (two runs equal) and scores other losses than one without;
    a negative amplitude is a clear error."""
    rng = np.random.default_rng(0)
    feats = rng.normal(0, 1, (256, 3, 32)) * np.array([0.1, 1.0, 10.0])[:, None]
    rms = np.sqrt(np.mean(feats ** 2, axis=-1, keepdims=True))
    out = train.noisy_features(jnp.asarray(feats, jnp.float32), 0.2, jax.random.key(3))
    rel = (np.asarray(out, np.float64) - feats) / rms
    assert np.abs(rel).max() <= 0.2 + 1e-4 and abs(rel.mean()) < 0.005
    for layer in range(3):
        assert rel[:, layer].std() == pytest.approx(0.2 / np.sqrt(3), rel=0.05)
    again = train.noisy_features(jnp.asarray(feats, jnp.float32), 0.2, jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))

    target, canonical = _target(attention=0.1)
    config = HeadConfig.for_target(target.config, kind="eagle3", draft_vocab_size=64)
    _, data = _greedy_data(target, config, 0, num=16, n_tokens=8)
    d2t = train.draft_vocab(data, 64, VOCAB)

    def losses(noise):
        cfg = train.TrainConfig(steps=3, lr=1e-2, warmup=1, depth=2, eval_every=3,
                                eval_depth=2, feature_noise=noise)
        head = EagleHead(config, train.init_head_params(config, canonical, d2t=d2t, seed=0))
        return [r["loss"] for r in train.fit(head, target, data, data.take(np.arange(4)),
                                             cfg)[1]]

    noisy = losses(0.5)
    assert losses(0.5) == noisy and losses(0.0)[0] != noisy[0]
    with pytest.raises(ValueError, match="feature_noise=-0.1 must be >= 0"):
        train.TrainConfig(feature_noise=-0.1)


def test_the_loss_plot_is_an_svg_of_the_history(tmp_path):
    """One point per step on the loss line, falling where the loss falls; one dot per
    held-out acceptance measurement and one ring per training-answers one, on one axis; a
    valid SVG document; an empty history is a clear error."""
    import xml.etree.ElementTree as ET

    from jaxinfer.train.loss_plot import loss_svg, write_loss_svg

    history = [{"step": s, "loss": 5.0 / s} for s in range(1, 11)]
    for r in history[4::5]:
        r["acceptance"] = 1.0 + r["step"] / 10
        r["train_acceptance"] = 1.0 + r["step"] / 5
    write_loss_svg(history, str(tmp_path / "loss.svg"), title="a & b")
    root = ET.parse(tmp_path / "loss.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    (line,) = [e for e in root.iter(ns + "polyline") if e.get("class") == "loss"]
    ys = [float(p.split(",")[1]) for p in line.get("points").split()]
    xs = [float(p.split(",")[0]) for p in line.get("points").split()]
    assert len(ys) == 10 and all(a < b for a, b in zip(xs, xs[1:]))
    assert all(a < b for a, b in zip(ys, ys[1:]))  # SVG's y grows downwards: the loss falls
    dots = [e for e in root.iter(ns + "circle") if e.get("class") == "acceptance"]
    assert len(dots) == 2 and float(dots[0].get("cy")) > float(dots[1].get("cy"))
    rings = [e for e in root.iter(ns + "circle") if e.get("class") == "train-acceptance"]
    assert len(rings) == 2 and float(rings[1].get("cy")) < float(dots[1].get("cy"))
    assert rings[0].get("cy") == dots[1].get("cy")  # 2.0 at step 5 and at step 10: one axis
    assert any(e.text == "a & b" for e in root.iter(ns + "text"))
    assert "<polyline" in loss_svg(history[:1])  # one record: a degenerate but valid plot
    with pytest.raises(ValueError, match="history is empty"):
        loss_svg([])


# A family's block features a head keeps (`HeadConfig.for_target`): the published tensors they
# add, their shapes in the toy config, and the config.json model_type that selects them again.
FAMILY_BLOCKS = {
    "qwen2": (dict(qkv_bias=True), {"self_attn.q_proj.bias": (32,),
                                    "self_attn.v_proj.bias": (16,)}),
    "qwen3": (dict(qk_norm=True), {"self_attn.q_norm.weight": (8,),
                                   "self_attn.k_norm.weight": (8,)}),
}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("arch", sorted(FAMILY_BLOCKS))
def test_a_head_keeps_its_familys_block_through_a_round_trip(arch, kind, tmp_path):
    """A head for a Qwen2 target (q/k/v biases) or a Qwen3 target (per-head q/k norms), as
    the family's block has them: written as the family's tensors with its model_type, loaded
    back into the block, and exported by `head_params`; drafting with it is lossless."""
    features, published = FAMILY_BLOCKS[arch]
    config = toy_config(arch=arch, vocab_size=VOCAB, max_position=128, num_layers=4,
                        **features)
    canonical = init_params(config, seed=5, scale=0.3)
    canonical["lm_head"] *= 8.0
    target = Llama(config, canonical)
    head_config, params = _head(target, canonical, kind,
                                draft_vocab=40 if kind == "eagle3" else None)
    for feature in features:
        assert getattr(head_config.layer, feature)
    save_draft_head(str(tmp_path), head_config, params)
    tensors = read_safetensors(str(tmp_path / "model.safetensors"))
    prefix = "midlayer." if kind == "eagle3" else "layers.0."
    for name, shape in published.items():
        assert tensors[prefix + name].shape == shape, name
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == arch
    head = load_draft_head(str(tmp_path), target.config)
    for feature in features:
        assert getattr(head.config.layer, feature)
    back = head_params(head)
    assert back.keys() == params.keys()
    for name in params:
        np.testing.assert_array_equal(back[name], params[name], err_msg=name)
    ps = _prompts(3)
    sampling = SamplingConfig(max_new_tokens=12, ignore_eos=True)
    expected, _ = _run(target, ps, sampling)
    got, s = _run(target, ps, sampling, head, speculative_method="eagle",
                  num_speculative_tokens=2)
    assert got == expected and s["spec_drafted_tokens"] > 0


def test_eagle_tree_drafts_through_the_pallas_kernels_in_interpret_mode():
    """--attention_impl=pallas with eagle tree drafts: the head's depth passes and the target's
    verification attend with the decode kernel's tree queries (interpret mode on CPU): the
    same greedy tokens as plain decoding on the XLA path."""
    from tests.test_speculative import engine_config

    config = toy_config(vocab_size=VOCAB, max_position=128, num_layers=2, head_dim=16)
    canonical = init_params(config, seed=5, scale=0.3)
    canonical["lm_head"] *= 8.0
    target = Llama(config, canonical)
    head_config, params = _head(target, canonical, "eagle")
    prompt = [[5, 6, 7, 8, 5, 6, 9, 8, 5, 6]]
    sampling = SamplingConfig(max_new_tokens=5, ignore_eos=True)
    cache = CacheConfig(page_size=16, max_seq_len=16)  # the Triton kernel's smallest page

    def run(head=None, **kw):
        llm = LLM(target, None, cache=cache, draft_head=head, engine=engine_config(
            max_slots=1, max_num_batched_tokens=16, **kw))
        return [r.token_ids for r in llm.generate(prompt, sampling, use_tqdm=False)], llm.engine

    expected, _ = run()
    got, eng = run(EagleHead(head_config, params), attention_impl="pallas",
                   speculative_method="eagle", spec_tree="2,1")
    assert eng.runner.attention_impl == "pallas" and eng.stats()["spec_drafted_tokens"] > 0
    assert got == expected
