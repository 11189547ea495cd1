"""The mixture-of-experts MLP: routing, grouped expert matmuls, the weighted combine.

Each of a step's N rows picks k of the E experts (`route`). The N x k (row, expert) pairs are
sorted by expert (a stable argsort), so every expert's rows form one contiguous group, and two
grouped matmuls (`_grouped`, `pallas_kernels.grouped_matmul`) multiply each group by its own
expert's gate/up and down weights only, reading only the experts that have rows; the pairs'
outputs, scaled by their router weights, are summed back into their rows
(`jax.ops.segment_sum`). An optional shared expert (a dense gated MLP every row runs, scaled by
sigmoid(x . shared_expert_gate), Qwen2-MoE's) is added. Multiplying every expert with every row
exists only as the tests' reference.

Weights of a mixture layer (einsum-native; `WEIGHTS` names their logical axes):

    router [D, E]                 f32, never quantized (the routing decisions hang on it)
    router_bias [E]               with `router_bias`
    experts_gate_up [E, D, 2, F]  gate, up of each expert; int8/int4 like every matrix
    experts_down [E, F, D]        (`quant`: contraction axis 1, per expert and output channel)
    experts_gate_up_bias [E, 2, F], experts_down_bias [E, D]     with `expert_bias`
    shared_gate_up [D, 2, Fs], shared_down [Fs, D], shared_expert_gate [D]
                                  with `shared_expert_ffn_dim` Fs > 0

The canonical checkpoint params (`jaxinfer.model.params`) already hold the experts stacked and
fused in these shapes: a loader fills them expert by expert (`jaxinfer.checkpoint.experts`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model import quant
from jaxinfer.model.mlp import gated_activation, gated_mlp
from pallas_kernels.grouped_matmul import grouped_matmul

# name -> (logical axes, contraction axes: a matrix stored as `config.weights`; None: an f32
# vector or the router)
WEIGHTS: dict[str, tuple[tuple[str, ...], tuple[int, ...] | None]] = {
    "router": (("embed", "expert"), None),
    "router_bias": (("expert",), None),
    "experts_gate_up": (("expert", "embed", "gate_up", "ffn"), (1,)),
    "experts_down": (("expert", "ffn", "embed"), (1,)),
    "experts_gate_up_bias": (("expert", "gate_up", "ffn"), None),
    "experts_down_bias": (("expert", "embed"), None),
    "shared_gate_up": (("embed", "gate_up", "ffn"), (0,)),
    "shared_down": (("ffn", "embed"), (0,)),
    "shared_expert_gate": (("embed",), None),
}


def weight_names(config: ModelConfig) -> tuple[str, ...]:
    """The weights a mixture layer of `config` has (module doc)."""
    names = ["router", "experts_gate_up", "experts_down"]
    if config.router_bias:
        names.append("router_bias")
    if config.expert_bias:
        names += ["experts_gate_up_bias", "experts_down_bias"]
    if config.shared_expert_ffn_dim:
        names += ["shared_gate_up", "shared_down", "shared_expert_gate"]
    return tuple(names)


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shapes of `weight_names(config)` (module doc)."""
    d, e, f, fs = config.embed_dim, config.num_experts, config.moe_ffn_dim, \
        config.shared_expert_ffn_dim
    shapes = {"router": (d, e), "router_bias": (e,), "experts_gate_up": (e, d, 2, f),
              "experts_down": (e, f, d), "experts_gate_up_bias": (e, 2, f),
              "experts_down_bias": (e, d), "shared_gate_up": (d, 2, fs),
              "shared_down": (fs, d), "shared_expert_gate": (d,)}
    return {name: shapes[name] for name in weight_names(config)}


def route(logits: jax.Array, router: str, k: int) -> tuple[jax.Array, jax.Array]:
    """The k experts of each row and their weights, from router logits f32[N, E]
    (`config.ROUTERS`): (weights f32[N, k], experts i32[N, k]), experts by descending
    weight."""
    if router == "topk_softmax":
        top, experts = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), experts
    top, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if router == "softmax_topk_norm":
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, experts


def _grouped(x: jax.Array, w, group_sizes: jax.Array, *, cost_groups: int) -> jax.Array:
    """The grouped matmul: rows x [M, K] sorted by expert, expert e's group_sizes[e] rows
    (i32[E], summing to M) multiplied by its weight w[e] (`w`: [E, K, ...] a float Param or a
    `quant.QuantWeight` read as stored, its trailing axes flattened to N). Returns [M, N] in
    x.dtype. Only the experts with rows are read (`pallas_kernels.grouped_matmul`: the Pallas
    kernel on TPU, a loop over the routed experts on XLA); `cost_groups`: the experts a step is
    expected to touch, which the TPU kernel declares as its cost."""
    num_experts, n = w.shape[0], math.prod(w.shape[2:])
    if not isinstance(w, quant.QuantWeight):
        return grouped_matmul(x, w[...].reshape(num_experts, x.shape[1], n), group_sizes,
                              cost_groups=cost_groups)

    def flat(a):  # [E, K', ...] -> [E, K', N]: the stored contraction axis kept as it is
        return a.reshape(a.shape[0], a.shape[1], n)

    zero = getattr(w, "zero", None)
    return grouped_matmul(
        x, flat(w.q[...]), group_sizes, scale=flat(w.scale[...]),
        zero=None if zero is None else flat(zero[...]), group=w.group,
        offset=quant.NATIVE_INT4_OFFSET if w.native else 0, cost_groups=cost_groups)


def moe_mlp(x: jax.Array, weights: Mapping[str, object], config: ModelConfig) -> jax.Array:
    """A mixture layer's MLP (module doc) over the normed rows x [N, D]; `weights` maps
    `weight_names(config)` to the layer's Params / `quant.QuantWeight`s. Returns [N, D] in
    x.dtype."""
    c = config
    n, k, f = x.shape[0], c.experts_per_token, c.moe_ffn_dim
    with jax.named_scope("router"):
        logits = jnp.einsum("ND,DE->NE", x.astype(jnp.float32), weights["router"][...])
        if c.router_bias:
            logits = logits + weights["router_bias"][...]
        top, experts = route(logits, c.router, k)  # [N, k]
    pairs = experts.reshape(-1)  # [N k]: row i's j-th expert at i * k + j
    order = jnp.argsort(pairs, stable=True)  # the pairs grouped by expert
    rows, by_expert = order // k, pairs[order]  # [M]: each sorted pair's row and expert
    group_sizes = jnp.bincount(pairs, length=c.num_experts).astype(jnp.int32)
    touched = max(1, min(c.num_experts, round(c.expected_experts(n))))
    with jax.named_scope("experts"):
        gu = _grouped(x[rows], weights["experts_gate_up"], group_sizes,
                      cost_groups=touched).reshape(-1, 2, f)
        if c.expert_bias:
            gu = gu + weights["experts_gate_up_bias"][...][by_expert].astype(gu.dtype)
        act = gated_activation(gu[:, 0].astype(jnp.float32), gu[:, 1], c).astype(x.dtype)
        y = _grouped(act, weights["experts_down"], group_sizes, cost_groups=touched)  # [M, D]
        if c.expert_bias:
            y = y + weights["experts_down_bias"][...][by_expert].astype(y.dtype)
    scaled = y.astype(jnp.float32) * top.reshape(-1)[order][:, None]
    out = jax.ops.segment_sum(scaled, rows, num_segments=n)
    if c.shared_expert_ffn_dim:
        with jax.named_scope("shared_expert"):
            shared = gated_mlp(x, weights["shared_gate_up"], weights["shared_down"], c)
            gate = jnp.einsum("ND,D->N", x.astype(jnp.float32),
                              weights["shared_expert_gate"][...])
            out = out + shared.astype(jnp.float32) * jax.nn.sigmoid(gate)[:, None]
    return out.astype(x.dtype)
