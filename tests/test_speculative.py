"""Speculative decoding (docs/architecture.md, decision 5), toy models: greedy output, each drafter,
R in {1, 3, 5}, batch 1 and 8, equals output without speculation token for token (also with a
repetition penalty, under preemption, and with R = 0 rows); a chi-square test on 10^5 draws shows
the sampled output has the target's distribution for a drafter whose q is far from p, and the same
test rejects a deliberately wrong acceptance rule; drafters and metrics. (The real default model
speculates in tests/test_hf_reference.py.)
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.spec_verify as spec_verify_pkg
from jaxinfer.config import CacheConfig, EngineConfig, SamplingConfig
from jaxinfer.engine import steps
from jaxinfer.engine.kv_cache import create_cache
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.sampling import SamplingParams
from jaxinfer.engine.speculative import NGramDrafter
from jaxinfer.model import Llama, init_params
from tests.helpers import prefill_rows, toy_config

VOCAB = 96
# One page bucket (every step reads a sequence's 8 pages: few compiles), and a pool too small
# for 8 requests at once: every test preempts, and all share one set of compiled steps.
CACHE = CacheConfig(page_size=8, max_seq_len=64, num_pages=24, min_bucket_pages=8)


def engine_config(**kw) -> EngineConfig:
    base = dict(max_slots=8, prefill_buckets=(16,), max_num_batched_tokens=64,
                prefill_chunk_size=16)
    base.update(kw)
    return EngineConfig(**base)


def _toy_params(seed: int, num_layers: int) -> dict:
    config = toy_config(vocab_size=VOCAB, max_position=128, num_layers=num_layers)
    params = init_params(config, seed=seed, scale=0.3)
    params["lm_head"] *= 8.0  # sharp logits: no near-ties for float noise to flip
    return params


def _toy(seed: int, num_layers: int = 2) -> Llama:
    config = toy_config(vocab_size=VOCAB, max_position=128, num_layers=num_layers)
    return Llama(config, _toy_params(seed, num_layers))


@pytest.fixture(scope="module")
def target() -> Llama:
    return _toy(5, num_layers=3)


@pytest.fixture(scope="module")
def draft() -> Llama:
    return _toy(9, num_layers=1)


def prompts(n: int) -> list[list[int]]:
    """Prompts with repeated spans (the n-gram drafter finds matches) and random ones."""
    rng = np.random.default_rng(3)
    out = []
    for i in range(n):
        span = [int(t) for t in rng.integers(0, VOCAB, 5 + i % 4)]
        out.append(span * 3 + [int(t) for t in rng.integers(0, VOCAB, 1 + i % 3)]
                   if i % 2 == 0 else [int(t) for t in rng.integers(0, VOCAB, 6 + 2 * i)])
    return out


def run(model, ps, sampling, draft_model=None, cache=CACHE, **kw):
    llm = LLM(model, None, cache=cache, engine=engine_config(**kw), draft_model=draft_model)
    res = llm.generate(ps, sampling, use_tqdm=False)
    llm.engine.scheduler.check_invariants()
    return [r.token_ids for r in res], llm.engine


@pytest.fixture(scope="module")
def baseline(target):
    ps = prompts(8)
    sampling = [SamplingConfig(max_new_tokens=m, ignore_eos=True) for m in (24, 1, 17, 30, 2,
                                                                             24, 9, 28)]
    return ps, sampling, run(target, ps, sampling)[0]


@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
@pytest.mark.parametrize("r", [1, pytest.param(3, marks=pytest.mark.slow), 5])
def test_greedy_speculation_equals_plain_decoding(target, draft, baseline, method, r):
    """Batch 8 (max_new_tokens 1 and 2 give rows with R = 0) and batch 1."""
    ps, sampling, expected = baseline
    kw = dict(speculative_method=method, num_speculative_tokens=r, self_spec_layers=1)
    got, eng = run(target, ps, sampling, draft if method == "draft" else None, **kw)
    assert got == expected
    stats = eng.stats()
    llm = LLM.__new__(LLM)
    llm.engine = eng  # the same engine again, now with one request
    assert [r.token_ids for r in llm.generate(ps[:1], sampling[:1], use_tqdm=False)] == (
        expected[:1])
    assert stats["spec_verify_rows"] > 0
    assert 0 <= stats["spec_accepted_tokens"] <= stats["spec_drafted_tokens"]
    # every generated token is one accepted draft or the one token each verification adds,
    # plus the first token of each request (sampled by its last prompt chunk)
    assert stats["output_tokens"] == (stats["spec_accepted_tokens"] + stats["spec_verify_rows"]
                                      + len(ps))
    if method in ("ngram", "self"):
        assert stats["spec_accepted_tokens"] > 0, stats
    # Batch 8 on the XLA path verifies host drafts in ragged batches: the rows the tokens need.
    assert eng.spec.ragged == (method == "ngram")
    if method == "ngram":
        assert 0 < stats["spec_ragged_rows"] <= (
            stats["spec_verify_rows"] + stats["spec_drafted_tokens"])


def test_speculation_under_preemption_and_penalties(target):
    """A pool too small for all requests (preemption + recompute, the n-gram drafter's pages
    reserved only when free) and a repetition penalty that changes the drafts' scores."""
    ps = prompts(8)
    sampling = SamplingConfig(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.3)
    expected, _ = run(target, ps, sampling)
    got, eng = run(target, ps, sampling, speculative_method="ngram", num_speculative_tokens=3)
    assert got == expected
    assert eng.stats()["preemptions"] > 0


def test_draft_cache_mirrors_the_target_under_preemption_and_prefix_sharing(target):
    """A draft model with the target's own weights must have every greedy draft accepted:
    its pool (the target's page table, prompt chunks mirrored, the last two tokens re-fed,
    rollback by length) holds exactly the target's K/V through shared prefix pages and
    recomputation after preemption. Then the self-speculative drafter on the same load."""
    shared = prompts(1)[0]
    ps = [shared + [i, i + 1] for i in range(8)]
    sampling = SamplingConfig(max_new_tokens=20, ignore_eos=True)
    expected, _ = run(target, ps, sampling)
    twin = _toy(5, num_layers=3)  # the target's own weights
    got, eng = run(target, ps, sampling, twin, speculative_method="draft",
                   num_speculative_tokens=3)
    assert got == expected
    s = eng.stats()
    assert s["prefix_hits"] > 0 and s["preemptions"] > 0
    assert s["spec_accepted_tokens"] == s["spec_drafted_tokens"] > 0, s
    got, eng = run(target, ps, sampling, speculative_method="self", num_speculative_tokens=3,
                   self_spec_layers=1)
    assert got == expected
    assert eng.stats()["spec_accepted_tokens"] > 0


def test_forked_samples_under_speculation_equal_independent_requests(target):
    """n samples of one prompt with a model drafter (no fan-out under speculation: each sample
    computes its last prompt token, its partial page copied in both pools) give the samples of
    n separate requests with seeds seed + i."""
    prompt = prompts(1)[0] + [7, 8, 9]
    sc = SamplingConfig(max_new_tokens=16, ignore_eos=True, temperature=0.9, seed=4, n=4)
    twin = _toy(5, num_layers=3)  # the target's own weights
    kw = dict(speculative_method="draft", num_speculative_tokens=3)
    forked, eng = run(target, [prompt], sc, twin, **kw)
    alone, _ = run(target, [prompt] * 4, [SamplingConfig(
        max_new_tokens=16, ignore_eos=True, temperature=0.9, seed=4 + i) for i in range(4)],
        twin, **kw)
    assert forked == alone and len({tuple(t) for t in forked}) > 1
    s = eng.stats()
    assert s["spec_accepted_tokens"] == s["spec_drafted_tokens"] > 0  # the twin's q is p
    assert s["computed_tokens"] - s["output_tokens"] + 4 < 2 * len(prompt)  # one prefill


def test_ngram_lookup():
    d = NGramDrafter(max_n=3, min_n=1)
    assert d.lookup([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]  # suffix [1, 2, 3] seen at 0
    assert d.lookup([5, 1, 2, 9, 1, 2], 2) == [9, 1]
    assert d.lookup([1, 2, 3], 2) == []  # nothing repeats
    assert d.lookup([7, 8, 7, 9, 7], 4) == [9, 7]  # latest match of [7] is at 2
    assert d.lookup([4, 4], 5) == [4]
    assert d.lookup([1, 2, 1], 0) == []
    with pytest.raises(ValueError, match="min_n"):
        NGramDrafter(max_n=1, min_n=2)


def test_a_step_without_drafts_decodes_plainly(target):
    """The n-gram drafter finds nothing in a prompt without repeats: every step is a plain
    decode (no verify_step call), and the output is plain decoding's. With repeats, it verifies."""
    plain = list(range(10, 40))  # no token twice: no n-gram match until the output repeats
    sampling = SamplingConfig(max_new_tokens=3, ignore_eos=True)
    expected, _ = run(target, [plain], sampling)
    got, eng = run(target, [plain], sampling, speculative_method="ngram",
                   num_speculative_tokens=3)
    assert got == expected
    s = eng.stats()
    assert s["spec_verify_calls"] == 0 and s["spec_drafted_tokens"] == 0, s
    assert s["spec_verify_rows"] == 2  # decode steps after the first token
    _, eng = run(target, prompts(1), SamplingConfig(max_new_tokens=12, ignore_eos=True),
                 speculative_method="ngram", num_speculative_tokens=3)
    assert 0 < eng.stats()["spec_verify_calls"] <= eng.stats()["spec_verify_rows"]


def test_config_errors(target, draft):
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match=r"draft_confidence=1.0 must be in \[0, 1\)"):
        EngineConfig(speculative_method="eagle", draft_confidence=1)
    with pytest.raises(ValueError, match="draft_confidence=0.3 cuts EAGLE chain drafts.*'ngram'"):
        EngineConfig(speculative_method="ngram", draft_confidence=0.3)
    with pytest.raises(ValueError, match="draft_confidence=0.3 cuts EAGLE chain.*'3,1'"):
        EngineConfig(speculative_method="eagle", spec_tree="3,1", draft_confidence=0.3)
    with pytest.raises(ValueError, match="needs a draft model"):
        LLM(target, None, cache=CACHE, engine=engine_config(speculative_method="draft"))
    with pytest.raises(ValueError, match="vocab_size"):
        other = Llama(toy_config(vocab_size=50), init_params(toy_config(vocab_size=50)))
        LLM(target, None, cache=CACHE, engine=engine_config(speculative_method="draft"),
            draft_model=other)
    with pytest.raises(ValueError, match="self-speculative layers"):
        LLM(target, None, cache=CACHE,
            engine=engine_config(speculative_method="self", self_spec_layers=3))


def test_ragged_verification_equals_the_padded_layout(target):
    """verify_step over just the real tokens' flat rows gives the tokens, logprobs and cache
    lengths of the padded count B x (R + 1), for rows with 0 to R drafts and idle rows, at the
    smallest row count that fits and at the bucketed one (padding rows). Unrolled: it reads the
    last layer's pool."""
    config = dataclasses.replace(target.config, scan_layers=False)
    target = Llama(config, _toy_params(5, config.num_layers))
    graph, params = steps.split_model(target)
    b, r = 6, 3
    rng = np.random.default_rng(1)
    cache_config = CacheConfig(page_size=8, max_seq_len=64, num_pages=b * 8)
    base = create_cache(config, cache_config, b)
    table = np.arange(b * 8, dtype=np.int32).reshape(b, 8)
    ctx = jnp.asarray(rng.integers(0, VOCAB, (b, 20)), jnp.int32)
    _, kp, vp = prefill_rows(target, ctx, table, base.k_pages, base.v_pages, num_pages_read=4)
    base = base.replace(k_pages=kp, v_pages=vp)
    state = steps.create_slot_state(b, VOCAB).replace(tokens=ctx[:, -1])
    sampling = SamplingParams.from_configs([SamplingConfig(logprobs=True)] * b)
    num = np.array([0, 3, 1, 2, 1, 0], np.int32)
    active = np.array([True, True, True, False, True, True])
    batch = steps.VerifyBatch(page_table=table, active=active, pos=np.full((b,), 19, np.int32),
                              draft_ids=rng.integers(0, VOCAB, (b, r)).astype(np.int32),
                              num_draft=num)
    need = int((num + 1)[active].sum())  # 10
    # Make each row's first draft its greedy token (what a first verification emits), so some
    # drafts are accepted and some are not.
    kv, st = jax.tree.map(jnp.copy, (base, state))
    padded = b * (r + 1)
    _, _, out = steps.verify_step(graph, params, kv, st, sampling, batch, None, num_rows=padded,
                                  num_pages_read=4)
    drafts = batch.draft_ids.copy()
    drafts[:, 0] = np.asarray(out.tokens)[:, 0]
    batch = dataclasses.replace(batch, draft_ids=drafts)
    outs = {}
    ragged = steps.verify_rows(need, b, r, ragged=True)
    for rows in (padded, need, ragged):
        kv, st = jax.tree.map(jnp.copy, (base, state))  # both are donated
        kv, _, out = steps.verify_step(graph, params, kv, st, sampling, batch, None,
                                       num_pages_read=4, num_rows=rows)
        outs[rows] = (np.asarray(out.num_emitted), np.asarray(out.tokens),
                      np.asarray(out.logprobs), np.asarray(kv.k_pages[-1]))
    assert ragged == 12 and padded == 24  # 2 x 6 slots
    padded = outs.pop(padded)
    for got in outs.values():
        np.testing.assert_array_equal(got[0], padded[0])
        for row in range(b):
            n = padded[0][row]
            np.testing.assert_array_equal(got[1][row, :n], padded[1][row, :n])
            np.testing.assert_allclose(got[2][row, :n], padded[2][row, :n], atol=1e-5)
            if active[row]:  # the K/V written at the newest token and each draft, last layer
                pos = np.arange(19, 20 + num[row])
                pages = table[row, pos // 8]
                np.testing.assert_allclose(got[3][:, pages, pos % 8], padded[3][:, pages, pos % 8],
                                           atol=1e-5)
    assert padded[0][3] == 0 and padded[0].max() > 1  # the idle row; some drafts accepted


# ----- the statistical test ------------------------------------------------------------------
SMALL_V = 12
ROWS = 10_000
REPEATS = 10  # 10^5 draws of the first and second generated tokens


def _seeded_rows(temperature: float, rep: int) -> SamplingParams:
    """The ROWS rows of repetition `rep`: `SamplingConfig(temperature=temperature, seed=rep *
    ROWS + i)` for row i, built from one config (10^5 config objects would cost more than the
    steps)."""
    one = SamplingParams.from_configs([SamplingConfig(temperature=temperature)] * ROWS)
    return dataclasses.replace(one, seed=jnp.arange(rep * ROWS, (rep + 1) * ROWS,
                                                    dtype=jnp.int32))


def _chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square p-value; cells expected < 5 are pooled into one."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    dof = int(keep.sum()) - 1
    return float(jax.scipy.special.gammaincc(dof / 2, stat / 2))


def _wrong_rule(target_logits, draft_ids, draft_probs, num_draft, temperature, uniforms,
                impl="xla"):
    """Accepts a draft with probability p(x) (ignoring q) — biased whenever q != p."""
    t = temperature[:, None, None]
    p = jax.nn.softmax(target_logits / t, axis=-1)
    r = draft_ids.shape[1]
    pd = jnp.take_along_axis(p[:, :r], draft_ids[..., None], axis=-1)[..., 0]
    ok = (uniforms[:, :r] < pd) & (jnp.arange(r)[None] < num_draft[:, None])
    accepted = jnp.argmin(jnp.concatenate([ok, jnp.zeros_like(ok[:, :1])], axis=1), axis=1)
    rows = jnp.arange(p.shape[0])
    pa = p[rows, accepted]
    qa = draft_probs[rows, jnp.minimum(accepted, r - 1)]
    resid = jnp.where((accepted < num_draft)[:, None], jnp.maximum(pa - qa, 0), pa)
    cdf = jnp.cumsum(resid, axis=-1)
    tok = jnp.sum(cdf <= uniforms[:, r:] * cdf[:, -1:], axis=-1)
    return accepted.astype(jnp.int32), jnp.minimum(tok, p.shape[-1] - 1).astype(jnp.int32)


def _spec_draws(model: Llama, rule=None, allowed: np.ndarray | None = None,
                cut_forbidden: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """10^5 independent (first, second) generated tokens after a fixed prompt, by R = 2
    speculation whose drafts come from a fixed q far from p; and the exact joint p.

    allowed: bool[V] a constraint's token set at every position (structured output): the
    target is masked at every verified position and the exact joint is p restricted to it and
    renormalised; drafts still come from the unconstrained q. cut_forbidden: a wrong rule for
    model drafts, cutting a forbidden draft and sampling the target there instead of letting
    the verifier reject it (whose residual norm(max(p - q, 0)) is not p)."""
    config = model.config
    temperature = 1.3
    graph, params = steps.split_model(model)
    prompt = [3, 1, 4, 1, 5]  # positions 0..3 cached in one shared page, 4 = the newest token
    ps = 4
    cache_config = CacheConfig(page_size=ps, max_seq_len=8, num_pages=1 + ROWS)
    cache = create_cache(config, cache_config, ROWS)
    shared = np.zeros((1, 2), np.int32)
    _, kp, vp = prefill_rows(model, [prompt[:4]], shared, cache.k_pages, cache.v_pages,
                             num_pages_read=1)
    base = cache.replace(k_pages=kp, v_pages=vp)

    # The exact target joint: p(x1) after the prompt, p(x2 | x1) for every x1.
    def next_probs(seq):
        lg, _, _ = prefill_rows(model, [seq], [[1, 2]], base.k_pages, base.v_pages,
                                num_pages_read=2)
        p = np.asarray(jax.nn.softmax(lg[0, -1] / temperature), np.float64)
        return p if allowed is None else np.where(allowed, p, 0) / p[allowed].sum()

    p1 = next_probs(prompt)
    joint = np.stack([p1[a] * next_probs(prompt + [a]) for a in range(config.vocab_size)])
    # q: far from p (reversed preference), fixed, the same at both draft positions.
    q = np.asarray(jax.nn.softmax(-np.log(p1 + 1e-3)), np.float32)

    table = np.stack([np.zeros(ROWS), 1 + np.arange(ROWS)], axis=1).astype(np.int32)
    masks = None
    if allowed is not None:
        bits = np.zeros(32, np.uint8)
        bits[:config.vocab_size] = allowed
        word = np.packbits(bits, bitorder="little").view(np.int32)
        masks = np.broadcast_to(word, (ROWS, 3, 1)).copy()

    def num_draft(drafts):
        if not cut_forbidden:
            return np.full(ROWS, 2, np.int32)
        ok = allowed[drafts]
        return np.where(ok[:, 0], np.where(ok[:, 1], 2, 1), 0).astype(np.int32)

    ctx = contextlib.nullcontext()
    if rule is not None:
        ctx = _patched(rule)
    firsts, seconds = [], []
    rng = np.random.default_rng(0)
    with ctx:
        for rep in range(REPEATS):
            kv = jax.tree.map(jnp.copy, base)
            st = steps.create_slot_state(ROWS, config.vocab_size)
            # committed, as the state the first verification returns to the second is
            st = jax.device_put(st.replace(tokens=jnp.full((ROWS,), prompt[4], jnp.int32)),
                                jax.devices()[0])
            sampling = _seeded_rows(temperature, rep)
            drafts = rng.choice(config.vocab_size, size=(ROWS, 2), p=q / q.sum()).astype(np.int32)
            probs = np.broadcast_to(q, (ROWS, 2, config.vocab_size)).copy()
            batch = steps.VerifyBatch(page_table=table, active=np.ones(ROWS, bool),
                                      pos=np.full(ROWS, 4, np.int32), draft_ids=drafts,
                                      num_draft=num_draft(drafts))
            kv, st, out = steps.verify_step(graph, params, kv, st, sampling, batch, probs,
                                            num_pages_read=2, num_rows=ROWS * 3, allowed=masks)
            toks, n = np.asarray(out.tokens), np.asarray(out.num_emitted)
            first = toks[:, 0]
            second = toks[:, 1].copy()
            need = n == 1  # the second token comes from a second verification
            drafts2 = rng.choice(config.vocab_size, size=(ROWS, 2), p=q / q.sum())
            batch2 = steps.VerifyBatch(page_table=table, active=np.ones(ROWS, bool),
                                       pos=np.full(ROWS, 5, np.int32),
                                       draft_ids=drafts2.astype(np.int32),
                                       num_draft=num_draft(drafts2))
            kv, st, out2 = steps.verify_step(graph, params, kv, st, sampling, batch2, probs,
                                             num_pages_read=2, num_rows=ROWS * 3, allowed=masks)
            second[need] = np.asarray(out2.tokens)[need, 0]
            firsts.append(first)
            seconds.append(second)
    return np.concatenate(firsts), np.concatenate(seconds), joint


@contextlib.contextmanager
def _patched(rule):
    original = spec_verify_pkg.spec_verify
    spec_verify_pkg.spec_verify = rule
    steps.verify_sample.clear_cache()
    try:
        yield
    finally:
        spec_verify_pkg.spec_verify = original
        steps.verify_sample.clear_cache()


@pytest.fixture(scope="module")
def small_model() -> Llama:
    config = toy_config(vocab_size=SMALL_V, max_position=16)
    return Llama(config, init_params(config, seed=11, scale=0.5))


def _pvalues(first, second, joint):
    v = joint.shape[0]
    n = first.size
    p_first = _chi2_pvalue(np.bincount(first, minlength=v), n * joint.sum(axis=1))
    p_joint = _chi2_pvalue(np.bincount(first * v + second, minlength=v * v),
                           n * joint.reshape(-1))
    return p_first, p_joint


def test_sampled_output_has_the_target_distribution(small_model):
    first, second, joint = _spec_draws(small_model)
    p_first, p_joint = _pvalues(first, second, joint)
    assert p_first > 1e-3 and p_joint > 1e-3, (p_first, p_joint)


@pytest.mark.slow  # the power check of the distribution test above; -m slow runs it
def test_the_distribution_test_rejects_a_wrong_acceptance_rule(small_model):
    first, second, joint = _spec_draws(small_model, rule=_wrong_rule)
    p_first, p_joint = _pvalues(first, second, joint)
    assert min(p_first, p_joint) < 1e-6, (p_first, p_joint)


# A constraint allowing 5 of the 12 tokens at every position: q (unconstrained) drafts a
# forbidden token more than half the time.
ALLOWED = np.isin(np.arange(SMALL_V), [0, 3, 5, 8, 11])


def test_constrained_speculation_has_the_constrained_target_distribution(small_model):
    first, second, joint = _spec_draws(small_model, allowed=ALLOWED)
    assert np.all(np.isin(first, np.flatnonzero(ALLOWED)))
    p_first, p_joint = _pvalues(first, second, joint)
    assert p_first > 1e-3 and p_joint > 1e-3, (p_first, p_joint)


@pytest.mark.slow  # the power check of the distribution test above; -m slow runs it
def test_the_constrained_test_rejects_cutting_forbidden_model_drafts(small_model):
    first, second, joint = _spec_draws(small_model, allowed=ALLOWED,
                                       cut_forbidden=True)
    p_first, p_joint = _pvalues(first, second, joint)
    assert min(p_first, p_joint) < 1e-6, (p_first, p_joint)


def test_pallas_path_end_to_end_in_interpret_mode():
    """--attention_impl=pallas: verification and drafting attend with the decode kernel's
    T-query path and accept with the spec_verify kernel (both in interpret mode on CPU) —
    the same greedy tokens as the XLA path."""
    config = toy_config(vocab_size=VOCAB, max_position=128, num_layers=2, head_dim=16)
    params = init_params(config, seed=5, scale=0.3)
    params["lm_head"] *= 8.0
    target = Llama(config, params)
    ps = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]  # one page: one variant of each step
    sampling = SamplingConfig(max_new_tokens=5, ignore_eos=True)
    cache = CacheConfig(page_size=16, max_seq_len=16)  # the Triton kernel's smallest page
    kw = dict(speculative_method="self", self_spec_layers=1, num_speculative_tokens=2,
              max_slots=1, max_num_batched_tokens=16)
    expected, _ = run(target, ps, sampling, cache=cache, **kw)
    got, eng = run(target, ps, sampling, cache=cache, attention_impl="pallas", **kw)
    assert eng.runner.attention_impl == "pallas"
    assert got == expected
