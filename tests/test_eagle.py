"""EAGLE / EAGLE-3 draft heads (`jaxinfer.model.eagle`, `jaxinfer.engine.eagle`,
`jaxinfer.checkpoint.eagle`, `jaxinfer.train.draft_head`; docs/architecture.md, decision 19) on
toy targets:
the head's forward against the papers' equations written out in numpy; a synthetic checkpoint in
the published layout loads and drafts, malformed ones are clear errors; greedy output with eagle
drafts equals plain decoding under preemption and prefix sharing; a few seeded training steps
lower the loss and raise the held-out acceptance."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.checkpoint.eagle import load_draft_head, save_draft_head
from jaxinfer.checkpoint.hf import read_safetensors, write_safetensors
from jaxinfer.config import SamplingConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.model import Llama, init_params
from jaxinfer.model.eagle import EagleHead, HeadConfig, head_params
from jaxinfer.train import draft_head as train
from tests.helpers import toy_config

VOCAB = 96


def _target(seed: int = 5, attention: float = 1.0) -> tuple[Llama, dict]:
    """A toy target; `attention` scales its attention outputs (small: the next token depends
    mostly on the current one, a text a small head can learn from a few sequences)."""
    config = toy_config(vocab_size=VOCAB, max_position=128, num_layers=4)
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
    q = _rope(np.einsum("TD,DNH->TNH", attn_in, p["layers.0.q"]), c.rope.theta)
    k = _rope(np.einsum("TD,DKH->TKH", attn_in, p["layers.0.k"]), c.rope.theta)
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
def test_head_forward_matches_the_papers_equations(kind):
    """Step 0 of the training-time forward (what every served entry computes: tests below
    check the served drafts against it) equals the equations in float64 on a toy target."""
    target, canonical = _target()
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


@pytest.mark.parametrize("workers", [1, 3])
def test_warmup_compiles_the_eagle_steps(workers):
    """Serial and concurrent warm-up compile the head's draft, mirror and absorb steps and the
    target's feature-emitting steps: a workload with eagle drafts then compiles nothing."""
    from jaxinfer.config import CacheConfig, EngineConfig
    from jaxinfer.engine.engine import Engine
    from tests.helpers import count_compiles

    jax.clear_caches()
    target, canonical = _target()
    config, params = _head(target, canonical, "eagle3", draft_vocab=40)
    eng = Engine(target, None, cache=CacheConfig(page_size=8, max_seq_len=48),
                 engine=EngineConfig(max_slots=2, prefill_buckets=(16, 32),
                                     max_num_batched_tokens=34, speculative_method="eagle",
                                     num_speculative_tokens=2),
                 draft_head=EagleHead(config, params))
    eng.warmup(workers=workers)
    with count_compiles() as after:
        ids = [eng.add_request(p, SamplingConfig(max_new_tokens=10, ignore_eos=True))
               for p in _prompts(2)]
        eng.run()
    assert after == [], f"compiled {after} after warm-up"
    assert eng.stats()["spec_drafted_tokens"] > 0 and all(eng.results(i) for i in ids)


# ----- training --------------------------------------------------------------------------------
def _greedy_data(target, config, seed, num=16, n_tokens=24):
    rng = np.random.default_rng(seed)
    ps = [[int(t) for t in rng.integers(0, VOCAB, 6 + i % 5)] for i in range(num)]
    llm = LLM(target, None)
    outs = llm.generate(ps, SamplingConfig(max_new_tokens=n_tokens, ignore_eos=True),
                        use_tqdm=False)
    return ps, train.record(target, [(p, o.token_ids) for p, o in zip(ps, outs)], config,
                            seq_len=40)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_a_few_training_steps_lower_the_loss_and_raise_acceptance(kind):
    """Seeded: 90 optax steps on the target's own greedy answers to 48 prompts (EAGLE-3: its
    draft vocabulary their 64 most frequent tokens) lower the loss and raise the replayed
    acceptance on held-out prompts; the engine's measured acceptance with the trained head on
    those prompts is the replay's (the served drafts are the trained forward's)."""
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
    _, s = _run(target, held_ps, SamplingConfig(max_new_tokens=24, ignore_eos=True), trained,
                speculative_method="eagle", num_speculative_tokens=3)
    assert s["mean_accepted_length"] == pytest.approx(after, abs=0.05), (s, after)
