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
    experts_gate_up [E, 2, D, F]  gate, up of each expert; int8/int4 like every matrix
    experts_down [E, F, D]        (`quant`: contraction axis D / F, per expert and output
                                  channel; the grouped matmul reads both as stored)
    experts_gate_up_bias [E, 2, F], experts_down_bias [E, D]     with `expert_bias`
    shared_gate_up [2, D, Fs], shared_down [Fs, D], shared_expert_gate [D]
                                  with `shared_expert_ffn_dim` Fs > 0

The canonical checkpoint params (`jaxinfer.model.params`) already hold the experts stacked and
fused in these shapes: a loader fills them expert by expert (`jaxinfer.checkpoint.experts`).

On a mesh (`jaxinfer.sharding`: experts over "expert", each expert's FFN over "model") the
routed experts run under `jax.shard_map` (`_sharded`). How the tokens lie decides the
communication: attention is tensor parallel over expert x model, so after it every chip of a
data shard holds every row of that shard, whole. Dispatch therefore moves nothing: each chip
routes all its rows (the router is whole everywhere), keeps the (row, expert) pairs of the
experts it holds, runs them through its experts' FFN slice, and sums their weighted outputs into
a partial [N, D]. The combine is one all-reduce (`psum`) of that partial over expert x model
(it also sums the model axis's partial products of the split FFN): the same collective, of the
same N x D values, as a dense layer's tensor-parallel down projection. An all-to-all (MaxText,
tpu-inference) pays off where tokens are split over the expert axis (attention data parallel
over it); here it would send rows every chip already has.

Static shapes without dropping: a chip's grouped matmuls run over a buffer of all N x k pairs
(its pairs sorted first, by expert; the rest after the last group, in no group), the worst case
in which every row picks only this chip's experts, so no capacity factor and no token is ever
dropped. The grouped matmul computes only the rows in its groups (`_grouped`) and leaves the
rows past them unspecified (NaN, maybe): a select drops them from the combine. The shared
expert is a dense MLP every row runs: it stays outside, tensor parallel like the dense layers.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.model import quant
from jaxinfer.model.mlp import gated_activation, gated_mlp
from jaxinfer.sharding import data_shards, spec_for
from pallas_kernels.grouped_matmul import grouped_matmul

# name -> (logical axes, contraction axes: a matrix stored as `config.weights`; None: an f32
# vector or the router)
WEIGHTS: dict[str, tuple[tuple[str, ...], tuple[int, ...] | None]] = {
    "router": (("embed", "router"), None),
    "router_bias": (("router",), None),
    "experts_gate_up": (("expert", "gate_up", "embed", "expert_ffn"), (2,)),
    "experts_down": (("expert", "expert_ffn", "embed"), (1,)),
    "experts_gate_up_bias": (("expert", "gate_up", "expert_ffn"), None),
    "experts_down_bias": (("expert", "embed"), None),
    "shared_gate_up": (("gate_up", "embed", "ffn"), (1,)),
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
    shapes = {"router": (d, e), "router_bias": (e,), "experts_gate_up": (e, 2, d, f),
              "experts_down": (e, f, d), "experts_gate_up_bias": (e, 2, f),
              "experts_down_bias": (e, d), "shared_gate_up": (2, d, fs),
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


def _grouped(x: jax.Array, w, group_sizes: jax.Array, *, cost_groups: int,
             layer: jax.Array | None) -> jax.Array:
    """The grouped matmul: rows x [M, K] sorted by expert, expert e's group_sizes[e] rows
    (i32[E], summing to <= M) multiplied by its weight w[e] (`w`: [E, K, N], or [E, C, K, N]
    with C output blocks (gate, up), a float Param or a `quant.QuantWeight`), read as stored:
    no reshape or transpose of the stack, which XLA:TPU would turn into a copy of every expert
    each step. Returns [M, N] ([C, M, N]) in x.dtype; rows past the groups are
    unspecified (the caller drops them). Only the experts with rows are read
    (`pallas_kernels.grouped_matmul`: the Pallas kernel on TPU, a loop over the routed experts
    on XLA); `cost_groups`: the experts a step is expected to touch, which the TPU kernel
    declares as its cost. `layer`: w is a scanned stack [L, E, ...], row `layer` multiplied
    where it lies."""
    if not isinstance(w, quant.QuantWeight):
        return grouped_matmul(x, w[...], group_sizes, cost_groups=cost_groups, layer=layer)
    zero = getattr(w, "zero", None)
    return grouped_matmul(
        x, w.q[...], group_sizes, scale=w.scale[...],
        zero=None if zero is None else zero[...], group=w.group,
        offset=quant.NATIVE_INT4_OFFSET if w.native else 0, cost_groups=cost_groups,
        layer=layer)


def moe_mlp(x: jax.Array, weights: Mapping[str, object], config: ModelConfig,
            layer: jax.Array | int | None = None) -> jax.Array:
    """A mixture layer's MLP (module doc) over the normed rows x [N, D]; `weights` maps
    `weight_names(config)` to the layer's Params / `quant.QuantWeight`s. `layer` (a scanned
    layer's row): the routed experts' weights (`EXPERT_WEIGHTS`) are their kind's stacks
    [L_kind, E, ...], read at that row by the grouped matmul itself (a row sliced out of the
    stack for a Pallas kernel would be a copy of the layer's experts every step). Returns
    [N, D] in x.dtype."""
    c = config
    with jax.named_scope("router"):
        logits = jnp.einsum("ND,DE->NE", x.astype(jnp.float32), weights["router"][...])
        if c.router_bias:
            logits = logits + weights["router_bias"][...]
        top, experts = route(logits, c.router, c.experts_per_token)  # [N, k]
    routed = {name: weights[name] for name in EXPERT_WEIGHTS if name in weights}
    with jax.named_scope("experts"):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.size == 1:
            out = _experts(x, top, experts, routed, c, first=0, down_bias=True, layer=layer)
        else:
            out = _sharded(x, top, experts, routed, c, mesh, layer)
    if c.shared_expert_ffn_dim:
        with jax.named_scope("shared_expert"):
            shared = gated_mlp(x, weights["shared_gate_up"], weights["shared_down"], c)
            gate = jnp.einsum("ND,D->N", x.astype(jnp.float32),
                              weights["shared_expert_gate"][...])
            out = out + shared.astype(jnp.float32) * jax.nn.sigmoid(gate)[:, None]
    return out.astype(x.dtype)


# the weights of the routed experts: split over the expert axis, run inside `_sharded`
EXPERT_WEIGHTS = ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias")


def _experts(x: jax.Array, top: jax.Array, experts: jax.Array, w: Mapping[str, object],
             c: ModelConfig, *, first, down_bias, layer=None) -> jax.Array:
    """The routed experts' sum for the rows x [N, D], from the experts [first, first + E_l) that
    `w` holds (`EXPERT_WEIGHTS`, E_l = their leading dim): f32[N, D], each row the sum over its
    pairs with those experts of router weight x expert output; the other pairs give 0.
    top f32[N, k], experts i32[N, k]: the router's choice. `down_bias`: add the experts' down
    bias here (a bool, or a traced bool: one chip of those summing a split FFN adds it).
    `layer`: `w` are stacks, this layer's row `layer` (`moe_mlp`)."""
    n, k = x.shape[0], c.experts_per_token
    num_local = _local_experts(w, layer)
    local = experts.reshape(-1) - first  # [N k]: row i's j-th expert at i * k + j
    mine = (local >= 0) & (local < num_local)
    key = jnp.where(mine, local, num_local)  # the other chips' pairs sort after every group
    order = jnp.argsort(key, stable=True)  # the pairs grouped by expert
    rows, by_expert = order // k, jnp.minimum(key[order], num_local - 1)  # [M]
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    # the experts of these rows a step is expected to touch among those held here
    touched = max(1, min(num_local, round(c.expected_experts(n) * num_local / c.num_experts)))
    gate, up = _grouped(x[rows], w["experts_gate_up"], group_sizes, cost_groups=touched,
                        layer=layer)

    def pair_bias(name):  # [M, ...]: each pair's expert's bias
        b = w[name][...]
        return (b if layer is None else b[layer])[by_expert]

    if c.expert_bias:
        gate_up_bias = pair_bias("experts_gate_up_bias").astype(gate.dtype)  # [M, 2, F]
        gate, up = gate + gate_up_bias[:, 0], up + gate_up_bias[:, 1]
    act = gated_activation(gate.astype(jnp.float32), up, c).astype(x.dtype)
    y = _grouped(act, w["experts_down"], group_sizes, cost_groups=touched, layer=layer)
    if c.expert_bias:
        bias = pair_bias("experts_down_bias").astype(y.dtype)
        y = y + jnp.where(down_bias, bias, jnp.zeros_like(bias))
    # rows past the groups are in no group: whatever the grouped matmul left there is masked
    kept = (mine.reshape(-1)[order])[:, None]
    scaled = jnp.where(kept, y.astype(jnp.float32) * top.reshape(-1)[order][:, None], 0.0)
    return jax.ops.segment_sum(scaled, rows, num_segments=n)


def _local_experts(w: Mapping[str, object], layer) -> int:
    """The experts `w` holds (its stacks' second dim when `layer` is given)."""
    gate_up = w["experts_gate_up"]
    stored = gate_up.q if isinstance(gate_up, quant.QuantWeight) else gate_up
    return stored.shape[0 if layer is None else 1]


def _sharded(x: jax.Array, top: jax.Array, experts: jax.Array, w: Mapping[str, object],
             c: ModelConfig, mesh, layer=None) -> jax.Array:
    """`_experts` on every chip of `mesh` for its own experts and FFN slice, summed over the
    expert and model axes in x.dtype, as a dense layer's tensor-parallel all-reduce is (module
    doc): [N, D], rows split over "data" as the model splits them (`llama._rows`)."""
    d = data_shards()
    rows = P("data") if d > 1 and x.shape[0] % d == 0 else P()
    lead = () if layer is None else ("layers",)
    specs = {name: jax.tree.map(lambda a, name=name: spec_for(name, lead + WEIGHTS[name][0],
                                                               a.shape, mesh), value)
             for name, value in w.items()}
    reduce = tuple(a for a in ("expert", "model") if a in mesh.axis_names)
    expert_axis = "expert" in mesh.axis_names and mesh.shape["expert"] > 1

    args, in_specs = (x, top, experts, w), (rows, rows, rows, specs)
    if layer is not None:  # the stacks' row, the same on every chip
        args, in_specs = args + (jnp.asarray(layer, jnp.int32),), in_specs + (P(),)

    def shard(x, top, experts, w, *row):
        layer = row[0] if row else None
        first = jax.lax.axis_index("expert") * _local_experts(w, layer) if expert_axis else 0
        down_bias = jax.lax.axis_index("model") == 0 if "model" in mesh.axis_names else True
        partial = _experts(x, top, experts, w, c, first=first, down_bias=down_bias,
                           layer=layer)
        return jax.lax.psum(partial.astype(x.dtype), reduce)

    return jax.shard_map(shard, in_specs=in_specs, out_specs=rows, check_vma=False)(*args)
