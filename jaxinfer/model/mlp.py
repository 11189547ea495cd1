"""The gated MLP, down(act(x . gate) * (x . up)): the dense layers', every expert's and the
shared expert's (`jaxinfer.model.moe`), with the activation in one place.

Activations (`config.ACTIVATIONS`): "silu" (SwiGLU), "gelu_tanh" (GeGLU, tanh-approximate
GELU) and "swiglu_clamped", gpt-oss's (Hugging Face `GptOssExperts._apply_gate`): the gate
clamped above at `swiglu_limit`, the up projection to [-limit, limit], then
(up + 1) * gate * sigmoid(swiglu_alpha * gate).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model import quant

_PLAIN = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def gated_activation(gate: jax.Array, up: jax.Array, config: ModelConfig) -> jax.Array:
    """act(gate) * up for gate f32[..., F] and up [..., F] (any float dtype): f32[..., F]."""
    if config.activation == "swiglu_clamped":
        limit = config.swiglu_limit
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up.astype(jnp.float32), -limit, limit)
        return (up + 1.0) * gate * jax.nn.sigmoid(gate * config.swiglu_alpha)
    return _PLAIN[config.activation](gate) * up


def gated_mlp(x: jax.Array, gate_up, down, config: ModelConfig,
              extra: Callable[[str, jax.Array], jax.Array] | None = None) -> jax.Array:
    """x [N, D] through gate_up [2, D, F] and down [F, D] (float Params or
    `quant.QuantWeight`s): [N, D] in x.dtype. `extra(name, input)`: an f32 addition to the
    output of projection "gate_up" / "down" of that input (the rows' LoRA adapters)."""
    gu = quant.einsum("ND,CDF->NCF", x, gate_up)
    if extra is not None:
        gu = gu + extra("gate_up", x).astype(gu.dtype)
    act = gated_activation(gu[:, 0].astype(jnp.float32), gu[:, 1], config).astype(x.dtype)
    out = quant.einsum("NF,FD->ND", act, down)
    if extra is not None:
        out = out + extra("down", act).astype(out.dtype)
    return out
