"""Shared test helpers: a toy model and the f32/bf16 tolerance table (STYLE rule 14)."""

from __future__ import annotations

import numpy as np

from jaxinfer.config import ModelConfig, RopeConfig
from jaxinfer.model import Llama, init_params

# dtype -> (atol, rtol). bf16 against an f32 reference: ~2e-2.
TOLERANCE = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)}


def toy_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=64, embed_dim=32, num_layers=2, num_q_heads=4, num_kv_heads=2,
                head_dim=8, ffn_dim=48, max_position=256, rope=RopeConfig(theta=10000.0))
    base.update(overrides)
    return ModelConfig(**base)


def toy_model(config: ModelConfig | None = None, seed: int = 0):
    config = config or toy_config()
    params = init_params(config, seed=seed, scale=0.3)
    return Llama(config, params), params


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_close(actual, expected, dtype: str = "float32", scale: float = 1.0) -> None:
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               atol=atol * scale, rtol=rtol * scale,
                               err_msg=f"rel err {rel_err(actual, expected):.2e}")
