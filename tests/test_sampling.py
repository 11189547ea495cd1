"""Sampling: filters against a plain numpy reference, distribution, penalties, seeds, jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import SamplingConfig
from jaxinfer.engine.sampling import SamplingParams, apply_penalties, inverse_cdf
from jaxinfer.engine.sampling import filtered_probs as filtered_probs_eager
from jaxinfer.engine.sampling import sample as sample_eager

# Jitted once per module: eager lax.cond / fori_loop would compile op by op on every call.
sample = jax.jit(sample_eager, static_argnames="num_top_logprobs")
filtered_probs = jax.jit(filtered_probs_eager)

HALVES = np.log([0.5, 0.25, 0.125, 0.0625, 0.0625])  # exact dyadic probabilities


def params(*configs):
    return SamplingParams.from_configs(list(configs))


def filtered_reference(logits, cfg):
    """Independent float64 reference: sort, cut, renormalise. Boundary ties are kept."""
    z = np.asarray(logits, np.float64)
    if cfg.temperature == 0:
        return np.eye(len(z))[np.argmax(z)]
    z = z / cfg.temperature
    if 0 < cfg.top_k < len(z):
        z = np.where(z >= np.sort(z)[::-1][cfg.top_k - 1], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if cfg.top_p < 1:
        desc = np.sort(p)[::-1]
        cut = np.argmax(np.cumsum(desc) >= cfg.top_p - 1e-9)
        p = np.where(p >= desc[cut], p, 0.0)
    p = np.where(p >= cfg.min_p * p.max(), p, 0.0)
    return p / p.sum()


def pad(row, vocab=12):
    return np.concatenate([row, np.full(vocab - len(row), -np.inf)]).astype(np.float32)


# (logits, config, expected support) — hand cases; every row also checked against the reference.
CASES = [
    (pad(HALVES), SamplingConfig(temperature=1.0, top_p=0.75), [0, 1]),  # mass exactly top_p
    (pad(HALVES), SamplingConfig(temperature=1.0, top_p=0.7501), [0, 1, 2]),
    (pad(HALVES), SamplingConfig(temperature=1.0, top_p=1e-6), [0]),  # tiny: argmax only
    (pad(HALVES), SamplingConfig(temperature=1.0, top_p=0.9), [0, 1, 2, 3, 4]),  # tie at cut
    (pad(HALVES), SamplingConfig(temperature=1.0, top_k=3), [0, 1, 2]),
    (pad(HALVES), SamplingConfig(temperature=1.0, top_k=4), [0, 1, 2, 3, 4]),  # tie at k-th
    (pad(HALVES), SamplingConfig(temperature=1.0, min_p=0.3), [0, 1]),
    (pad(HALVES), SamplingConfig(temperature=1.0, min_p=0.2), [0, 1, 2]),
    (pad(HALVES), SamplingConfig(temperature=1.0, top_k=3, top_p=0.8, min_p=0.4), [0, 1]),
    (pad(HALVES), SamplingConfig(temperature=1.0, top_k=3, top_p=0.8, min_p=0.6), [0]),
    (pad(HALVES), SamplingConfig(temperature=2.0, top_p=0.55), [0, 1]),  # sqrt: .34, .24, .17
    (pad(HALVES), SamplingConfig(temperature=1.0), [0, 1, 2, 3, 4]),
    (pad([1.0, 3.0, 3.0, 0.5]), SamplingConfig(temperature=1.0, top_k=1), [1, 2]),  # tied max
    (pad([1.0, 3.0, 3.0, 0.5]), SamplingConfig(top_k=3, top_p=0.1), [1]),  # greedy: lowest id
    (pad([0.3, -1.0, 2.0, 1.5, 2.0, 0.0, -0.5, 1.0, 0.7, -2.0, 0.1, 1.9]),
     SamplingConfig(temperature=0.7, top_k=6, top_p=0.85, min_p=0.1), None),
    (pad([0.3, -1.0, 2.0, 1.5, 2.0, 0.0, -0.5, 1.0, 0.7, -2.0, 0.1, 1.9]),
     SamplingConfig(temperature=1.3, top_k=20, top_p=0.95), None),
]


def test_filtered_probs_support_and_values_per_row():
    logits = jnp.asarray(np.stack([c[0] for c in CASES]))
    got = np.asarray(filtered_probs(logits, params(*[c[1] for c in CASES])))
    for row, (z, cfg, support) in zip(got, CASES, strict=True):
        ref = filtered_reference(z, cfg)
        np.testing.assert_allclose(row, ref, atol=1e-6, err_msg=str(cfg))
        np.testing.assert_array_equal(np.flatnonzero(row), np.flatnonzero(ref), err_msg=str(cfg))
        if support is not None:
            assert np.flatnonzero(row).tolist() == support, cfg


def test_filtered_probs_large_vocab_matches_reference():
    # V = 3000 > the top-k cap and > one CDF block; rows exercise both top-k paths.
    rng = np.random.default_rng(0)
    z = (rng.standard_normal((4, 3000)) * 2).astype(np.float32)
    cfgs = [SamplingConfig(temperature=0.9, top_k=40, top_p=0.9),
            SamplingConfig(temperature=1.0, top_k=700, min_p=0.02),
            SamplingConfig(temperature=1.5, top_p=0.99),
            SamplingConfig()]
    for rows in ([0, 2, 3], [0, 1, 2, 3]):  # lax.top_k path, then the bisection path
        got = np.asarray(filtered_probs(jnp.asarray(z[rows]), params(*[cfgs[i] for i in rows])))
        for row, i in zip(got, rows, strict=True):
            ref = filtered_reference(z[i], cfgs[i])
            np.testing.assert_allclose(row, ref, atol=2e-6, err_msg=str(cfgs[i]))
            assert (np.flatnonzero(row) == np.flatnonzero(ref)).all(), cfgs[i]


def test_greedy_rows_and_top_k_1_are_argmax():
    rng = np.random.default_rng(1)
    z = rng.standard_normal((16, 50)).astype(np.float32)
    z[3, [7, 30]] = 10.0  # tie: the lowest id wins
    cfgs = [SamplingConfig(top_k=5, top_p=0.3, min_p=0.5) if i % 2 else
            SamplingConfig(temperature=0.5 + i, top_k=1, top_p=0.9) for i in range(16)]
    cfgs[3] = SamplingConfig(top_p=0.5)
    out = sample(jnp.asarray(z), params(*cfgs), jnp.arange(16, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.argmax(z, axis=-1))
    assert int(out.tokens[3]) == 7


def draws(z, cfg, num, seed=0, start=0):
    logits = jnp.broadcast_to(jnp.asarray(z, jnp.float32), (num, len(z)))
    p = SamplingParams.from_configs([cfg] * num)
    p = SamplingParams(**{**p.numpy(), "seed": jnp.full((num,), seed, jnp.int32)})
    positions = jnp.arange(start, start + num, dtype=jnp.int32)
    return np.asarray(sample(logits, p, positions).tokens)


@pytest.mark.parametrize("vocab, hot", [(12, None), (600, [0, 255, 256, 300, 511, 512, 599])])
def test_empirical_distribution_matches_filtered_probs(vocab, hot):
    rng = np.random.default_rng(2)
    z = rng.standard_normal(vocab).astype(np.float32)
    if hot is not None:  # mass on ids at CDF block edges; everything else impossible
        z = np.full(vocab, -np.inf, np.float32)
        z[hot] = rng.standard_normal(len(hot))
    cfg = SamplingConfig(temperature=0.9, top_k=9, top_p=0.95, min_p=0.05)
    expected = np.asarray(filtered_probs(jnp.asarray(z)[None], params(cfg)))[0]
    num = 20_000
    counts = np.bincount(draws(z, cfg, num, seed=3), minlength=vocab)
    support = expected > 0
    assert counts[~support].sum() == 0
    chi2 = np.sum((counts[support] - num * expected[support]) ** 2 / (num * expected[support]))
    assert chi2 < 30, (chi2, support.sum())  # df <= 8; 30 is beyond the 99.9% quantile
    assert np.max(np.abs(counts / num - expected)) < 0.015


def test_seed_and_position_fix_the_draw_across_batches_and_slots():
    rng = np.random.default_rng(4)
    z = rng.standard_normal(64).astype(np.float32)
    cfg = SamplingConfig(temperature=1.0, top_p=0.95, seed=11)
    alone = [int(sample(jnp.asarray(z)[None], params(cfg), jnp.array([pos])).tokens[0])
             for pos in range(20)]
    for slot, batch in [(0, 3), (5, 8)]:
        others = rng.standard_normal((batch, 64)).astype(np.float32)
        cfgs = [SamplingConfig(temperature=0.7, top_k=4, seed=s) for s in range(batch)]
        others[slot], cfgs[slot] = z, cfg
        for pos in range(20):
            positions = jnp.asarray(rng.integers(0, 99, batch)).at[slot].set(pos)
            out = sample(jnp.asarray(others), params(*cfgs), positions)
            assert int(out.tokens[slot]) == alone[pos]


def test_different_seeds_and_positions_give_different_draws():
    z = np.zeros(16, np.float32)  # uniform over 16 tokens
    cfg = SamplingConfig(temperature=1.0)
    by_seed = [int(draws(z, cfg, 1, seed=s, start=5)[0]) for s in range(64)]
    assert len(set(by_seed)) >= 12
    by_pos = draws(z, cfg, 64, seed=0)
    assert len(set(by_pos.tolist())) >= 12
    assert (draws(z, cfg, 64, seed=0) == by_pos).all()


def test_penalties_match_hf_and_openai_definitions():
    logits = jnp.array([[2.0, -1.0, 0.0, 3.0, -4.0], [2.0, -1.0, 0.0, 3.0, -4.0]])
    counts = jnp.array([[0, 2, 1, 0, 0], [0, 2, 1, 0, 0]], jnp.int32)
    seen = jnp.array([[True, True, True, False, True]] * 2)
    p = params(SamplingConfig(repetition_penalty=2.0, presence_penalty=0.5,
                              frequency_penalty=0.25), None)
    got = np.asarray(apply_penalties(logits, counts, seen, p))
    # seen: x < 0 -> x * 2, else x / 2; then - 0.5 * (count > 0) - 0.25 * count
    expected0 = [1.0, -2.0 - 0.5 - 0.5, 0.0 - 0.5 - 0.25, 3.0, -8.0]
    np.testing.assert_allclose(got[0], expected0, rtol=1e-6)
    np.testing.assert_allclose(got[1], np.asarray(logits[1]), rtol=0)  # neutral row unchanged


def test_logprobs_are_raw_and_top_logprobs_sorted():
    rng = np.random.default_rng(5)
    raw = jnp.asarray(rng.standard_normal((4, 40)).astype(np.float32))
    penalised = raw.at[:, :10].add(-5.0)
    cfgs = [SamplingConfig(temperature=1.0, seed=i) for i in range(3)] + [None]
    out = sample(penalised, params(*cfgs), jnp.arange(4), raw_logits=raw, num_top_logprobs=5)
    ref = np.asarray(jax.nn.log_softmax(raw, axis=-1))
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(4), tokens], atol=1e-5)
    top_ids, top_lp = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    assert top_ids.shape == (4, 5) and top_ids.dtype == np.int32
    assert (np.diff(top_lp, axis=-1) <= 0).all()
    np.testing.assert_allclose(top_lp, np.take_along_axis(ref, top_ids, -1), atol=1e-5)
    np.testing.assert_allclose(top_lp, -np.sort(-ref, axis=-1)[:, :5], atol=1e-5)
    none = sample(raw, params(*cfgs), jnp.arange(4))
    assert none.top_ids.shape == (4, 0) and none.top_logprobs.shape == (4, 0)


def test_one_compile_serves_all_settings_and_greedy_paths_agree():
    num_traces = 0

    def counted(*args, **kwargs):
        nonlocal num_traces
        num_traces += 1  # runs only while tracing
        return sample_eager(*args, **kwargs)

    step = jax.jit(counted, static_argnames="num_top_logprobs")
    rng = np.random.default_rng(6)
    z = jnp.asarray(rng.standard_normal((4, 300)).astype(np.float32))
    positions = jnp.arange(4)
    settings = [
        [None] * 4,
        [SamplingConfig(temperature=0.8, top_k=5)] * 4,
        [SamplingConfig(temperature=1.2, top_p=0.5, min_p=0.1, seed=9), None, None, None],
        [SamplingConfig(temperature=0.5, top_k=200, top_p=0.9)] * 2 + [None] * 2,
    ]
    outs = [step(z, params(*cfgs), positions, num_top_logprobs=2) for cfgs in settings]
    assert num_traces == 1 and step._cache_size() == 1
    greedy = np.argmax(np.asarray(z), axis=-1)
    np.testing.assert_array_equal(outs[0].tokens, greedy)  # cond skips the filter path
    np.testing.assert_array_equal(outs[2].tokens[1:], greedy[1:])  # cond takes it
    forced = inverse_cdf(filtered_probs(z, params(*settings[0])), jnp.full((4,), 0.999))
    np.testing.assert_array_equal(forced, greedy)


def test_from_configs_defaults_and_dtypes():
    p = params(None, SamplingConfig(temperature=0.5, top_k=3, seed=7)).numpy()
    assert p["temperature"].tolist() == [0.0, 0.5] and p["temperature"].dtype == np.float32
    assert p["top_k"].tolist() == [0, 3] and p["top_k"].dtype == np.int32
    assert p["seed"].tolist() == [0, 7] and p["top_p"].tolist() == [1.0, 1.0]
    assert p["repetition_penalty"].tolist() == [1.0, 1.0]


def test_the_draw_stays_on_the_chips_that_hold_the_vocabulary():
    """With the vocabulary split 4 ways (1280 ids: 320 a chip, not a multiple of 256) the
    inverse CDF's blocks divide each chip's part (`cdf_block`: 64), so the draw moves block sums
    between chips, never a row's whole distribution; and it draws what one device draws, the
    first id whose cumulative mass exceeds u (numpy, float64)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxinfer import sharding
    from jaxinfer.engine.sampling import cdf_block

    mesh = sharding.make_mesh("data:2,model:4")
    b, vocab = 8, 1280
    rng = np.random.default_rng(0)
    probs = rng.random((b, vocab)).astype(np.float32) ** 8  # mass on a few ids per row
    probs /= probs.sum(-1, keepdims=True)
    u = rng.random(b).astype(np.float32)
    split = NamedSharding(mesh, P(None, "model"))
    with jax.set_mesh(mesh):
        assert cdf_block(vocab) == 64
        draw = jax.jit(inverse_cdf)
        compiled = draw.lower(jax.device_put(probs, split), u).compile().as_text()
        tokens = np.asarray(draw(jax.device_put(probs, split), u))
    assert cdf_block(vocab) == 256  # one device
    gathered = [line for line in compiled.splitlines()
                if " all-gather(" in line and f",{vocab}]" in line]
    assert not gathered, gathered
    cdf = np.cumsum(probs.astype(np.float64), axis=-1)
    expected = (cdf <= (u * cdf[:, -1])[:, None]).sum(-1)
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(np.asarray(jax.jit(inverse_cdf)(probs, u)), expected)


@pytest.mark.parametrize("wide_k", [40, 200])
def test_sampling_on_a_split_vocabulary_gathers_no_row_and_equals_one_device(wide_k):
    """`sample` with rows of every kind (greedy, top-k, top-p, min-p, plain temperature; with
    wide_k 200 past `TOP_K_CAP`, so the batch bisects) and top-5 logprobs, on logits whose
    vocabulary is split 4 ways: no chip gathers a whole row (the top-k filter bisects over each
    chip's part, the top logprobs are each chip's top 5 and then the top 5 of those, the
    inverse CDF's blocks stay on their chip), and tokens, logprobs and top ids equal one
    device's."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxinfer import sharding

    mesh = sharding.make_mesh("data:2,model:4")
    vocab = 1280
    settings = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0, top_k=7),
                SamplingConfig(temperature=0.8, top_k=wide_k), SamplingConfig(temperature=1.0,
                                                                            top_p=0.9),
                SamplingConfig(temperature=1.0, min_p=0.05), SamplingConfig(temperature=1.3),
                SamplingConfig(temperature=0.7, top_k=3, top_p=0.8, seed=5),
                SamplingConfig(temperature=1.0, top_k=64)]
    p = params(*settings)
    logits = jnp.asarray(np.random.default_rng(1).normal(0, 3, (len(settings), vocab)),
                         jnp.float32)
    positions = jnp.arange(len(settings), dtype=jnp.int32)

    def draw(x, p, pos):
        out = sample_eager(x, p, pos, num_top_logprobs=5)
        return out.tokens, out.logprobs, out.top_ids, out.top_logprobs

    one = jax.jit(draw)(logits, p, positions)
    with jax.set_mesh(mesh):
        split = jax.device_put(logits, NamedSharding(mesh, P(None, "model")))
        compiled = jax.jit(draw).lower(split, p, positions).compile().as_text()
        many = jax.jit(draw)(split, p, positions)
    gathered = [line for line in compiled.splitlines()
                if "all-gather" in line and f",{vocab}]" in line]
    assert not gathered, gathered
    np.testing.assert_array_equal(np.asarray(many[0]), np.asarray(one[0]))
    np.testing.assert_array_equal(np.asarray(many[2]), np.asarray(one[2]))
    np.testing.assert_allclose(np.asarray(many[1]), np.asarray(one[1]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(many[3]), np.asarray(one[3]), rtol=1e-6, atol=1e-6)
