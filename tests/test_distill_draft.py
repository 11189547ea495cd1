"""scripts/distill_draft.py on a toy model: the training forward equals the engine model's logits,
and a few optax steps reduce the distillation loss (KL and CE)."""

import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.config import CacheConfig, RopeConfig
from jaxinfer.kv_cache import create_cache
from jaxinfer.model import Llama, init_params
from tests.helpers import assert_close, toy_config

_SPEC = importlib.util.spec_from_file_location(
    "distill_draft", os.path.join(os.path.dirname(__file__), "..", "scripts", "distill_draft.py"))
distill = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(distill)
# jitted: eager dispatch of every op is most of the test time on CPU
forward_logits = jax.jit(distill.forward_logits, static_argnums=0)
distill_loss = jax.jit(distill.distill_loss, static_argnums=(2, 3))


def _engine_logits(model: Llama, ids: list[int]) -> np.ndarray:
    """All-position logits f32[T, V] of one prefill through `Llama.__call__` on the paged cache
    (unused pages poisoned with NaN)."""
    t = len(ids)
    cache = create_cache(model.config, CacheConfig(page_size=4, max_seq_len=64), 1, fill=np.nan)
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, k_pages, v_pages):
        logits, _, _ = nnx.merge(graphdef, state)(
            jnp.asarray([ids]), jnp.arange(t)[None], jnp.ones((1, t), bool), k_pages, v_pages,
            cache.page_table, jnp.array([t]), None, num_pages_read=-(-t // 4))
        return logits[0]

    return np.asarray(prefill(state, cache.k_pages, cache.v_pages))


@pytest.mark.parametrize("variant", ["plain", "bias_untied_llama3", "window"])
def test_training_forward_matches_engine_logits(variant):
    overrides = {
        "plain": {},
        "bias_untied_llama3": dict(qkv_bias=True, tie_embeddings=False, rope=RopeConfig(
            theta=500000.0, type="llama3", factor=8.0, original_max_position=16)),
        "window": dict(sliding_window=5),
    }[variant]
    config = toy_config(**overrides)
    params = init_params(config, seed=0, scale=0.3)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, config.vocab_size, 13)]
    want = _engine_logits(Llama(config, params), ids)
    got = forward_logits(config, {k: jnp.asarray(v) for k, v in params.items()},
                                 jnp.asarray([ids]))[0]
    assert_close(got, want, scale=10)


def test_padding_does_not_change_earlier_positions():
    config = toy_config()
    params = {k: jnp.asarray(v) for k, v in init_params(config, scale=0.3).items()}
    ids = np.random.default_rng(2).integers(0, config.vocab_size, (1, 9))
    padded = np.concatenate([ids, np.zeros((1, 7), ids.dtype)], axis=1)
    assert_close(forward_logits(config, params, jnp.asarray(padded))[:, :9],
                 forward_logits(config, params, jnp.asarray(ids)))


def test_optax_steps_reduce_distillation_loss():
    """20 AdamW steps of KL distillation on a 1-layer draft of a 3-layer target: the KL falls,
    and so does the CE on the target's greedy tokens (one train_step compile keeps this fast)."""
    target_config = toy_config(num_layers=3)
    target = {k: jnp.asarray(v) for k, v in init_params(target_config, scale=0.3).items()}
    draft_config = dataclasses.replace(target_config, num_layers=1)
    rng = np.random.default_rng(3)
    sequences = [([int(x) for x in rng.integers(0, 64, 4)],
                  [int(x) for x in rng.integers(0, 64, n)]) for n in (12, 20, 7, 15)]
    data = distill.build_data(sequences, seq_len=24)
    assert data.tokens.shape == (4, 32) and data.mask.sum() == 13 + 21 + 8 + 16
    hidden = np.asarray(distill.target_hidden_step(target_config, target, data.tokens,
                                                   data.loss_idx))
    batch = (data.tokens, data.loss_idx, data.mask, hidden,
             distill.head_weight(target_config, target))
    # the KL floor: the target as its own draft scores 0 and agrees everywhere
    zero, agree = distill_loss({}, target, target_config, "kl", *batch)
    assert abs(float(zero)) < 1e-5 and float(agree) == 1.0
    frozen = {"embed": target["embed"]}
    trainable = {k: jnp.array(v) for k, v in target.items()  # donated: copies
                 if k != "embed" and not k.startswith(("layers.1.", "layers.2."))}
    before = {kind: float(distill_loss(trainable, frozen, draft_config, kind, *batch)[0])
              for kind in ("kl", "ce")}
    optimizer = distill.make_optimizer(steps=20, lr=1e-2, warmup=2, weight_decay=0.0)
    opt_state = optimizer.init(trainable)
    for _ in range(20):
        trainable, opt_state, _, _ = distill.train_step(
            trainable, opt_state, frozen, batch, config=draft_config, kind="kl",
            optimizer=optimizer)
    after = {kind: float(distill_loss(trainable, frozen, draft_config, kind, *batch)[0])
             for kind in ("kl", "ce")}
    assert after["kl"] < 0.7 * before["kl"], (before, after)
    assert after["ce"] < before["ce"], (before, after)
