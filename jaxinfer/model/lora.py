"""LoRA adapters as rows (docs/architecture.md, decision 18): the device pool of adapter slots
inside the model, and the per-row low-rank product its projections add.

The pool: `ModelConfig.lora_slots` slots S of rank `lora_rank` R in every `Block`, beside the
weights they adapt, in the activations' dtype whatever the weights' storage (quantized base
weights keep float adapters).
A projection's adapter is two factors, A from its input to the rank and B from the rank to its
output, stored einsum-native like the weights, the slot axis first (`pool_layout`):

    lora_qkv_a:     [S, D, 3, R]         q's, k's and v's A (they share their input)
    lora_qkv_b:     [S, R, K, G + 2, H]  their B in the fused qkv's output layout
    lora_o_a:       [S, N, H, R]         lora_o_b:       [S, R, D]
    lora_gate_up_a: [S, D, 2, R]         lora_gate_up_b: [S, R, 2, F]
    lora_down_a:    [S, F, R]            lora_down_b:    [S, R, D]

B carries the adapter's scale (alpha / r, or rsLoRA's alpha / sqrt(r)) multiplied in; an adapter
of rank r < R fills the first r rank columns (the rest are zero), and a projection it does not
target is zero in its slot. So every slot has one layout whatever it holds: loading an adapter
(`write_slot`) changes values, never shapes, and nothing recompiles. The fused qkv B keeps the
kv heads' layout: kv-head duplication (`jaxinfer.model.kv_heads`) and the `kv_heads` rule treat
it as they treat the qkv weight. Its column c of each kv head takes the product of its part's
A (q for c < G, then k, then v): delta[n, k, c, h] = sum_r (x A_part(c))[n, r] B[r, k, c, h].
Sharding follows the base weights (`jaxinfer.sharding.RULES`): B splits like its projection's
output axis (kv heads, the FFN), A like its input axis (the o projection's query heads, the
down projection's FFN), and the slot and rank axes are whole.

The scanned layer stack (`ModelConfig.scan_layers`, `jaxinfer.model.layers`) stacks the pool
like every other layer array: each kind's `Block` holds [L_kind, S, ...] on the logical axes
("layers",) + the axes above (the `layers` axis is never sharded). Each layer of the scan
reads the factors of the slots its step uses at [its row, slot] (`LoraRows.layer`) rather than
slicing its row out as it does its weights: a row taken out before the loop over slots is an
operand XLA (CPU) materialises, a copy of every slot of every layer per step. An adapter load
writes its slot of every layer of a kind in one update (`write_slot`).

Rows: each row of a step names its slot (`StepBatch.lora`: i32[N], -1 = the base model alone).
`LoraRows` finds, once per step, the slots that have rows; each projection then adds, for each
such slot s in turn (a `fori_loop` over them), (x A_s) B_s to the rows of s. This segmented form
reads only the adapters a step uses and costs one small matmul pair per adapter and projection
group (over all N rows, those of other slots masked out: rank-R products, small beside the
base weights' reads at decode sizes); a step without adapter rows runs no iteration. The other
XLA forms read more by construction: gathering each row's factors reads a copy of them per row,
and a one-hot product over every slot reads and multiplies every slot, used or not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model.layers import kind_layers

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the projections an adapter may target
QKV, GATE_UP = ("q", "k", "v"), ("gate", "up")


def pool_layout(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Pool array name -> (shape, logical axes) of one layer's pool (module doc), the slot axis
    first; empty without a pool (`lora_slots` 0)."""
    c = config
    if not c.lora_slots:
        return {}
    s, r = c.lora_slots, c.lora_rank
    d, n, k, g, h, f = (c.embed_dim, c.num_q_heads, c.num_kv_heads, c.q_per_kv, c.head_dim,
                        c.ffn_dim)
    return {
        "lora_qkv_a": ((s, d, 3, r), ("lora", "embed", "qkv", "lora_rank")),
        "lora_qkv_b": ((s, r, k, g + 2, h), ("lora", "lora_rank", "kv_heads", "qkv", "head_dim")),
        "lora_o_a": ((s, n, h, r), ("lora", "q_heads", "head_dim", "lora_rank")),
        "lora_o_b": ((s, r, d), ("lora", "lora_rank", "embed")),
        "lora_gate_up_a": ((s, d, 2, r), ("lora", "embed", "gate_up", "lora_rank")),
        "lora_gate_up_b": ((s, r, 2, f), ("lora", "lora_rank", "gate_up", "ffn")),
        "lora_down_a": ((s, f, r), ("lora", "ffn", "lora_rank")),
        "lora_down_b": ((s, r, d), ("lora", "lora_rank", "embed")),
    }


def pool_dtype(config: ModelConfig) -> np.dtype:
    """The pool's dtype: the activations' (`config.dtype`), whatever the weights' storage."""
    return np.dtype(jnp.dtype(config.dtype))


def is_pool(name: str) -> bool:
    """Whether a Block attribute (a params key) is part of the adapter pool."""
    return name.startswith("lora_")


def canonical_shapes(config: ModelConfig, target: str, rank: int
                     ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(A's shape, B's shape) of one projection's adapter of `rank` in canonical form
    (einsum-native, as a checkpoint reader gives them): A [input axes..., r], B [r, output
    axes...], e.g. q: A [D, r], B [r, N, H]; o: A [N, H, r], B [r, D]."""
    c = config
    d, n, k, h, f = c.embed_dim, c.num_q_heads, c.num_kv_heads, c.head_dim, c.ffn_dim
    inputs = {"q": (d,), "k": (d,), "v": (d,), "o": (n, h), "gate": (d,), "up": (d,),
              "down": (f,)}
    outputs = {"q": (n, h), "k": (k, h), "v": (k, h), "o": (d,), "gate": (f,), "up": (f,),
               "down": (d,)}
    return inputs[target] + (rank,), (rank,) + outputs[target]


def pack_layer(config: ModelConfig, factors: Mapping[str, tuple[np.ndarray, np.ndarray]],
               dtype, *, rank: int) -> dict[str, np.ndarray]:
    """One layer's adapter in the pool's layout without the slot axis (`pool_layout`, for a
    pool of rank `rank`): target -> (A, B) in canonical form (`canonical_shapes`; B already
    scaled, rank r <= rank) -> pool array name -> host array of `dtype`, zero where no target
    or past rank r."""
    c = dataclasses.replace(config, lora_slots=1, lora_rank=rank)
    out = {name: np.zeros(shape[1:], dtype) for name, (shape, _) in pool_layout(c).items()}
    g = c.q_per_kv
    for target, (a, b) in factors.items():
        r = a.shape[-1]
        if target in QKV:
            part = QKV.index(target)
            out["lora_qkv_a"][:, part, :r] = a
            if target == "q":
                out["lora_qkv_b"][:r, :, :g] = b.reshape(r, c.num_kv_heads, g, c.head_dim)
            else:
                out["lora_qkv_b"][:r, :, g + part - 1] = b
        elif target in GATE_UP:
            part = GATE_UP.index(target)
            out["lora_gate_up_a"][:, part, :r] = a
            out["lora_gate_up_b"][:r, part] = b
        else:
            out[f"lora_{target}_a"][..., :r] = a
            out[f"lora_{target}_b"][:r] = b
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraRows:
    """A step's rows by adapter slot, derived once per step (`of`), and where a layer's
    adapters are.

    ids: i32[N] each row's slot, -1 = none.  used: i32[S] the slots that have rows, first
    (the rest 0).  count: i32[] how many slots have rows.  layer: None, the pool arrays a
    layer hands `delta` are its own [S, ...] (unrolled); or i32[], they are its kind's stacks
    [L_kind, S, ...] and this is the layer's row (scanned, `in_layer`): each slot's factors
    are read at [layer, slot], so a step reads only the slots it uses, never a copy of the
    layer's whole row.
    """

    ids: jax.Array
    used: jax.Array
    count: jax.Array
    layer: jax.Array | None = None

    @classmethod
    def of(cls, ids: jax.Array, num_slots: int) -> LoraRows:
        key = jnp.where(ids < 0, num_slots, ids)  # -1 would index the last slot
        present = jnp.zeros((num_slots,), bool).at[key].set(True, mode="drop")
        used = jnp.nonzero(present, size=num_slots, fill_value=0)[0].astype(jnp.int32)
        return cls(ids=ids, used=used, count=present.sum(dtype=jnp.int32))

    def in_layer(self, layer: jax.Array | int) -> LoraRows:
        """These rows, for the layer whose pool is row `layer` of its kind's stacks."""
        return dataclasses.replace(self, layer=jnp.asarray(layer, jnp.int32))

    def factor(self, a: jax.Array, slot: jax.Array) -> jax.Array:
        """Slot `slot`'s factor [...] of pool array a: [S, ...], or [L_kind, S, ...] at row
        `layer`."""
        if self.layer is None:
            return jax.lax.dynamic_index_in_dim(a, slot, 0, keepdims=False)
        start = (self.layer, slot) + (0,) * (a.ndim - 2)
        return jax.lax.dynamic_slice(a, start, (1, 1) + a.shape[2:]).reshape(a.shape[2:])


def delta(x: jax.Array, a: jax.Array, b: jax.Array, rows: LoraRows, *, a_spec: str,
          b_spec: str, out_shape: tuple[int, ...], parts: np.ndarray | None = None
          ) -> jax.Array:
    """f32[out_shape]: for every slot s with rows, (x A_s) B_s on the rows of s (0 elsewhere).

    x [N, ...] the projection's input; a, b: the pool's factors [S, ...] (or stacks, `LoraRows`
    .layer); a_spec, b_spec: the
    einsums of x with one slot's A and of that product with its B; parts: i32[C] expands the
    product's part axis (1) to B's columns (the fused qkv: each column's part)."""

    def add(j, acc):
        s = rows.used[j]
        a_s, b_s = rows.factor(a, s), rows.factor(b, s)
        u = jnp.einsum(a_spec, x.astype(a.dtype), a_s, preferred_element_type=jnp.float32)
        if parts is not None:
            u = u[:, parts]
        y = jnp.einsum(b_spec, u.astype(b.dtype), b_s, preferred_element_type=jnp.float32)
        mine = (rows.ids == s).reshape((-1,) + (1,) * (y.ndim - 1))
        return acc + jnp.where(mine, y, 0.0)

    return jax.lax.fori_loop(0, rows.count, add, jnp.zeros(out_shape, jnp.float32))


def qkv_parts(config: ModelConfig) -> np.ndarray:
    """i32[G + 2]: the part (0 q, 1 k, 2 v) of each column of the fused qkv."""
    return np.array([0] * config.q_per_kv + [1, 2], np.int32)


def qkv_delta(x: jax.Array, pool: Mapping[str, jax.Array], rows: LoraRows,
              config: ModelConfig) -> jax.Array:
    """f32[N, K, G + 2, H]: the adapters' addition to the fused qkv of x [N, D] (normed)."""
    c = config
    return delta(x, pool["lora_qkv_a"], pool["lora_qkv_b"], rows, a_spec="ND,DPR->NPR",
                 b_spec="NCR,RKCH->NKCH", parts=qkv_parts(c),
                 out_shape=(x.shape[0], c.num_kv_heads, c.q_per_kv + 2, c.head_dim))


def o_delta(attn: jax.Array, pool: Mapping[str, jax.Array], rows: LoraRows,
            config: ModelConfig) -> jax.Array:
    """f32[N, D]: the adapters' addition to the o projection of attn [N, Q * H] (query heads
    in order, each head's H values together)."""
    c = config
    x = attn.reshape(attn.shape[0], c.num_q_heads, c.head_dim)
    return delta(x, pool["lora_o_a"], pool["lora_o_b"], rows, a_spec="NQH,QHR->NR",
                 b_spec="NR,RD->ND", out_shape=(x.shape[0], c.embed_dim))


def mlp_delta(name: str, x: jax.Array, pool: Mapping[str, jax.Array], rows: LoraRows,
              config: ModelConfig) -> jax.Array:
    """The adapters' addition to the dense MLP's `name` projection: "gate_up" of x [N, D]
    (normed) -> f32[N, 2, F]; "down" of x [N, F] -> f32[N, D]."""
    n, c = x.shape[0], config
    if name == "gate_up":
        return delta(x, pool["lora_gate_up_a"], pool["lora_gate_up_b"], rows,
                     a_spec="ND,DPR->NPR", b_spec="NPR,RPF->NPF",
                     out_shape=(n, 2, c.ffn_dim))
    return delta(x, pool["lora_down_a"], pool["lora_down_b"], rows, a_spec="NF,FR->NR",
                 b_spec="NR,RD->ND", out_shape=(n, c.embed_dim))


def pool_of(params: Mapping) -> dict:
    """The adapter pool's arrays in a model's params (`nnx.to_pure_dict` of a `Llama`), keyed
    like `params["layers"]`: unrolled, layer -> pool array name -> [S, ...]; scanned, kind name
    -> pool array name -> [L_kind, S, ...] (the kind's layers stacked, `Llama.with_lora_pool`)."""
    return {i: {name: value for name, value in layer.items() if is_pool(name)}
            for i, layer in params["layers"].items()}


def with_pool(params: Mapping, pool: Mapping) -> dict:
    """`params` with the pool arrays of `pool` (`pool_of`'s structure) in place of its own."""
    layers = {i: {**layer, **pool[i]} for i, layer in params["layers"].items()}
    return {**params, "layers": layers}


def slot_values(config: ModelConfig, layers: Mapping[int, Mapping[str, np.ndarray]]) -> dict:
    """One slot's values (layer -> pool array name -> the slot's array, `pack_layer`) in the
    structure of `pool_of` for a model of `config`: unrolled, `layers` itself; scanned
    (`config.scan_layers`), kind name -> pool array name -> [L_kind, ...], the kind's layers
    stacked in layer order (their rows in the kind's stack, `jaxinfer.model.layers`)."""
    if not config.scan_layers:
        return dict(layers)
    return {kind: {name: np.stack([layers[i][name] for i in rows]) for name in layers[rows[0]]}
            for kind, rows in kind_layers(config).items()}


def write_slot(pool: Mapping, slot: jax.Array, values: Mapping, *, stacked: bool = False
               ) -> dict:
    """`pool` (`pool_of`) with slot `slot` (i32[], traced: one compiled program serves every
    slot) set to `values` (`slot_values`). `stacked`: the pool of a scanned model, whose
    arrays [L_kind, S, ...] take the slot of every layer of the kind in one update."""
    at = (slice(None), slot) if stacked else (slot,)
    return {i: {name: a.at[at].set(values[i][name].astype(a.dtype)) for name, a in p.items()}
            for i, p in pool.items()}
