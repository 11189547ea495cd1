"""Speculative verification kernels (pallas_kernels/spec_verify) against the jnp oracle.

Both kernels run in interpret mode on CPU and must give IDENTICAL (num_accepted, next_token) to the
reference for the same uniforms (STYLE rules 13, 16): greedy and sampled rows mixed, num_draft
0..R, draft_probs given or one-hot, NaN-poisoned padding, a vocabulary the block does not divide.
Plus hand-checked cases, extreme logits, a distributional test of the rule (that a wrong rule
fails), TPU / CUDA lowering at a production shape and a deviceless Mosaic compile (libtpu).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.spec_verify import spec_verify, spec_verify_reference, validate_inputs
from pallas_kernels.spec_verify.gpu import spec_verify_gpu
from pallas_kernels.spec_verify.tpu import spec_verify_tpu

# Small blocks so the test vocabularies span several blocks with a partial last one.
KERNELS = {
    "tpu": functools.partial(spec_verify_tpu, block_v=512, interpret=True),
    "gpu": functools.partial(spec_verify_gpu, block_v=256, interpret=True),
}
REFERENCE = jax.jit(spec_verify_reference)
# Every case uses B rows and V = VOCAB (or 4096) so the hand-checked cases reuse the sweep's
# compiled functions (interpret-mode compiles dominate this file's time).
B, VOCAB = 12, 1000


def run_all(*args):
    """Reference and both kernels on the same inputs; asserts they agree; returns numpy."""
    want = [np.asarray(a) for a in REFERENCE(*args)]
    for name, kernel in KERNELS.items():
        got = [np.asarray(a) for a in kernel(*args)]
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"{name} num_accepted")
        np.testing.assert_array_equal(got[1], want[1], err_msg=f"{name} next_token")
    return want


def batch_of(logits, draft, draft_probs, num_draft, temperature, uniforms):
    """numpy -> the kernels' argument tuple (draft_probs may be None)."""
    return (jnp.asarray(logits, jnp.float32), jnp.asarray(draft, jnp.int32),
            None if draft_probs is None else jnp.asarray(draft_probs, jnp.float32),
            jnp.asarray(num_draft, jnp.int32), jnp.asarray(temperature, jnp.float32),
            jnp.asarray(uniforms, jnp.float32))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def make_batch(r, vocab, with_q, seed):
    """Rows for every num_draft in 0..R, greedy and sampled; padding is NaN (logits and q)."""
    rng = np.random.default_rng(seed)
    batch = B
    nd = np.resize(np.repeat(np.arange(r + 1), 2), batch).astype(np.int32)
    temp = np.where(np.arange(batch) % 2 == 0, 0.0, rng.uniform(0.3, 1.5, batch)).astype(np.float32)
    logits = (rng.standard_normal((batch, r + 1, vocab)) * 2.5).astype(np.float32)
    logits[:, :, rng.integers(0, vocab, 20)] = -np.inf  # filtered tokens
    scaled = logits[:, :r] / np.where(temp > 0, temp, 1.0)[:, None, None]
    q = softmax(scaled + rng.standard_normal(scaled.shape) * 1.5).astype(np.float32)
    draft = np.array([[rng.choice(vocab, p=q[b, j] / q[b, j].sum()) for j in range(r)]
                      for b in range(batch)], np.int32)
    greedy_rows = temp == 0
    draft[greedy_rows] = np.where(rng.random((greedy_rows.sum(), r)) < 0.8,
                                  np.argmax(logits[greedy_rows, :r], -1), draft[greedy_rows])
    for b in range(batch):
        logits[b, nd[b] + 1:] = np.nan
        q[b, nd[b]:] = np.nan
        draft[b, nd[b]:] = rng.integers(-5, vocab + 5, r - nd[b])  # garbage ids
    uniforms = rng.random((batch, r + 1)).astype(np.float32)
    return (jnp.asarray(logits), jnp.asarray(draft), jnp.asarray(q) if with_q else None,
            jnp.asarray(nd), jnp.asarray(temp), jnp.asarray(uniforms))


@pytest.mark.parametrize("r, vocab, with_q", [
    (1, 1000, True), (1, 4096, False), (3, 1000, False), (3, 4096, True), (5, 1000, True),
    (5, 4096, False)])
def test_kernels_match_reference(r, vocab, with_q):
    accepted_any = 0
    for seed in range(3):  # same shapes: compiled once
        num_accepted, next_token = run_all(*make_batch(r, vocab, with_q, seed))
        assert ((next_token >= 0) & (next_token < vocab)).all()
        accepted_any += num_accepted.sum()
    assert accepted_any > 0  # the sweep exercises acceptance, not only rejection


def _rows(p, r, n=B):
    """[n, R + 1, VOCAB] logits whose softmax is p on ids 0..len(p)-1 and 0 elsewhere (-inf)."""
    row = np.full(VOCAB, -np.inf, np.float32)
    row[:len(p)] = np.log(np.asarray(p, np.float32))
    return np.broadcast_to(row, (n, r + 1, VOCAB)).copy()


def test_greedy_acceptance_correction_bonus():
    r = 3
    logits = np.full((B, r + 1, VOCAB), -1.0, np.float32)
    best = np.array([5, 7, 9, 11])
    logits[:, np.arange(r + 1), best] = 3.0
    logits[:, np.arange(r + 1), best + 600] = 3.0  # ties: the lowest id wins
    logits[:, 1, 900] = -np.inf
    draft = np.resize([[5, 7, 1], [5, 7, 9], [4, 7, 9], [5, 7, 9], [5, 7, 9], [5, 8, 9]],
                      (B, r))
    nd = np.resize([3, 3, 3, 0, 2, 3], B)
    for b in range(B):
        logits[b, nd[b] + 1:] = np.nan  # padding
    num_accepted, next_token = run_all(*batch_of(logits, draft, None, nd, np.zeros(B),
                                                 np.full((B, r + 1), 0.5)))
    # correction at 2, bonus at 3, correction at 0, plain decode, bonus at 2, correction at 1
    np.testing.assert_array_equal(num_accepted, np.resize([2, 3, 0, 0, 2, 1], B))
    np.testing.assert_array_equal(next_token, np.resize([9, 11, 5, 5, 9, 7], B))


@pytest.mark.parametrize("r, one_hot", [(1, False), (3, True)])
def test_draft_with_zero_target_probability_is_always_rejected(r, one_hot):
    logits = _rows([0.5, 0.5], r)  # p(7) = 0
    q = np.zeros((B, r, VOCAB), np.float32)
    q[:, :, 7] = 1.0
    uniforms = np.zeros((B, r + 1), np.float32)  # u = 0: accepted unless p(d) = 0
    uniforms[:, r] = np.linspace(0, 0.999, B)
    num_accepted, next_token = run_all(*batch_of(
        logits, np.full((B, r), 7), None if one_hot else q, np.ones(B), np.ones(B), uniforms))
    assert (num_accepted == 0).all()
    np.testing.assert_array_equal(next_token, uniforms[:, r] >= 0.5)  # drawn from p


def test_q_equal_p_is_always_accepted():
    r = 5
    logits, draft, _, _, temp, uniforms = make_batch(r, VOCAB, True, seed=5)
    logits = jnp.nan_to_num(logits, nan=0.0)
    temp = jnp.where(temp > 0, temp, 0.8)  # all rows sampled
    q = jax.nn.softmax(logits[:, :r] / temp[:, None, None], axis=-1)
    nd = jnp.full(B, r, jnp.int32)
    num_accepted, _ = run_all(logits, jnp.clip(draft, 0, VOCAB - 1), q, nd, temp, uniforms * 0.99)
    assert (num_accepted == r).all()


def test_one_hot_residual_excludes_rejected_draft():
    """p = (0.6, 0.3, 0.1): draft 0 rejected (u >= 0.6) -> residual (0, 0.3, 0.1) / 0.4."""
    r = 3
    uniforms = np.full((B, r + 1), 0.7, np.float32)
    uniforms[:, r] = np.linspace(0, 0.999, B)
    num_accepted, next_token = run_all(*batch_of(
        _rows([0.6, 0.3, 0.1], r), np.zeros((B, r)), None, np.ones(B), np.ones(B), uniforms))
    assert (num_accepted == 0).all()
    np.testing.assert_array_equal(next_token, np.where(uniforms[:, r] < 0.75, 1, 2))


@pytest.mark.parametrize("r, with_q", [(1, True), (3, False)])
def test_extreme_logits_are_nan_free(r, with_q):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((B, r + 1, VOCAB)).astype(np.float32)
    logits[0] *= 1e30  # huge magnitudes
    logits[1] = -np.inf  # all excluded but one token per position
    logits[1, :, 17] = 0.0
    logits[2, :, :5] = [1e30, -1e30, 3e38, -3e38, 1e30]
    logits[2, :, 5:] = -np.inf
    q = softmax(rng.standard_normal((B, r, VOCAB))).astype(np.float32)
    q[:, :, ::2] = 0.0  # exact zeros in q
    q /= q.sum(-1, keepdims=True)
    q[3] = softmax(logits[3, :r])  # p == q (row 3 has temperature 1)
    draft = rng.integers(0, 8, (B, r))
    draft[1] = 17
    temp = np.resize([1e-6, 1e-6, 1e-6, 1.0, 1e-6, 0.0], B)
    for u in (0.0, 0.5, 0.9999999):
        num_accepted, next_token = run_all(*batch_of(
            logits, draft, q if with_q else None, np.full(B, r), temp, np.full((B, r + 1), u)))
        assert ((next_token >= 0) & (next_token < VOCAB)).all()
        assert next_token[1] == 17 and num_accepted[1] == r
        chosen = logits[np.arange(B), num_accepted, next_token]
        assert np.isfinite(chosen).all(), "drew an excluded (-inf) token"


def _first_token_counts(p, q, rule, n=20000, seed=0):
    """Counts of the first emitted token over n rows (R = 1): the draft if accepted, else the
    next token. rule='chen': the reference; rule='wrong': accept iff u < p(d), ignoring q, with
    the same residual max(p - q, 0) (numpy)."""
    rng = np.random.default_rng(seed)
    vocab = len(p)
    draft = rng.choice(vocab, size=n, p=q)
    uniforms = rng.random((n, 2)).astype(np.float32)
    if rule == "chen":
        num_accepted, next_token = jax.jit(spec_verify_reference)(*batch_of(
            np.broadcast_to(np.log(p), (n, 2, vocab)), draft[:, None],
            np.broadcast_to(q, (n, 1, vocab)), np.ones(n), np.ones(n), uniforms))
        accepted, next_token = np.asarray(num_accepted) == 1, np.asarray(next_token)
    else:
        accepted = uniforms[:, 0] < p[draft]
        residual = np.maximum(p - q, 0)
        cdf = np.cumsum(residual / residual.sum())
        next_token = np.minimum(np.searchsorted(cdf, uniforms[:, 1], side="right"), vocab - 1)
    return np.bincount(np.where(accepted, draft, next_token), minlength=vocab)


def _chi2_pvalue(counts, p):
    from scipy.stats import chisquare

    return chisquare(counts, counts.sum() * p).pvalue


def test_reference_emits_the_target_distribution():
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    q = np.array([0.05, 0.1, 0.2, 0.3, 0.15, 0.2])  # far from p
    pytest.importorskip("scipy")
    assert _chi2_pvalue(_first_token_counts(p, q, "chen"), p) > 1e-3
    assert _chi2_pvalue(_first_token_counts(p, q, "wrong"), p) < 1e-6  # the test can fail


def _abstract_args(with_q=True, b=8, r=4, vocab=128256, sharding=None):
    s = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
    return (s((b, r + 1, vocab), jnp.float32), s((b, r), jnp.int32),
            s((b, r, vocab), jnp.float32) if with_q else None, s((b,), jnp.int32),
            s((b,), jnp.float32), s((b, r + 1), jnp.float32))


@pytest.mark.parametrize("with_q", [True, False])
def test_lowers_for_tpu_and_cuda_at_production_shape(with_q):
    args = _abstract_args(with_q)
    tpu = jax.jit(spec_verify_tpu).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert tpu.count("tpu_custom_call") >= 2
    cuda = jax.jit(spec_verify_gpu).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count("__gpu$xla.gpu.triton") >= 2 and "mosaic_gpu" not in cuda


@pytest.mark.parametrize("topology, with_q", [("v5e:2x2", True), ("v6e:2x2", False)])
def test_compiles_for_tpu_topology(topology, with_q):
    """Real XLA:TPU + Mosaic compile (libtpu, no TPU): catches VMEM and layout errors."""
    from jax.experimental import topologies

    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # compile-only devices: no chip to guard, and a concurrent libtpu process holds the lockfile
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topo = topologies.get_topology_desc(topology, platform="tpu")
    sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
    compiled = jax.jit(spec_verify_tpu).trace(
        *_abstract_args(with_q, sharding=sharding)).lower().compile()
    assert compiled.memory_analysis() is not None


@pytest.mark.parametrize("change, match", [
    (dict(target_logits=((8, 4, 100), jnp.float32)), r"T = R \+ 1.*T=4.*valid: T=5"),
    (dict(target_logits=((8, 5, 100), jnp.bfloat16)), "target_logits must be float32"),
    (dict(draft_ids=((8, 4), jnp.float32)), "draft_ids must be int32"),
    (dict(draft_probs=((8, 4, 99), jnp.float32)), r"draft_probs must be f32\[B=8, R=4, V=100\]"),
    (dict(num_draft=((7,), jnp.int32)), r"num_draft must have shape \(8,\)"),
    (dict(uniforms=((8, 4), jnp.float32)), r"uniforms must have shape \(8, 5\)"),
    (dict(draft_ids=((8, 0), jnp.int32), target_logits=((8, 1, 100), jnp.float32)), "R >= 1"),
])
def test_validator_errors(change, match):
    shapes = dict(target_logits=((8, 5, 100), jnp.float32), draft_ids=((8, 4), jnp.int32),
                  draft_probs=((8, 4, 100), jnp.float32), num_draft=((8,), jnp.int32),
                  temperature=((8,), jnp.float32), uniforms=((8, 5), jnp.float32))
    shapes.update(change)
    args = [jax.ShapeDtypeStruct(*shapes[k]) for k in shapes]
    with pytest.raises(ValueError, match=match):
        validate_inputs(*args)
    for fn in (spec_verify_reference, spec_verify_tpu, spec_verify_gpu):
        with pytest.raises(ValueError, match=match):
            jax.jit(fn).trace(*args)


def test_block_size_errors():
    args = _abstract_args(vocab=1000)
    with pytest.raises(ValueError, match=r"\(8,128\) tiling rule: block_v=200"):
        jax.jit(functools.partial(spec_verify_tpu, block_v=200)).trace(*args)
    with pytest.raises(ValueError, match="power of 2.*block_v=384"):
        jax.jit(functools.partial(spec_verify_gpu, block_v=384)).trace(*args)


def test_dispatch():
    args = make_batch(1, VOCAB, True, seed=9)
    want = REFERENCE(*args)
    for kw in (dict(impl="xla"), dict(impl="pallas", backend="cpu")):
        got = jax.jit(functools.partial(spec_verify, **kw))(*args)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="impl must be"):
        spec_verify(*args, impl="triton")
    with pytest.raises(ValueError, match="no spec_verify kernel for backend 'rocm'"):
        spec_verify(*args, backend="rocm")
