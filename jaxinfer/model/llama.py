"""The decoder as a Flax NNX module: every registered architecture (`jaxinfer.families`: Llama
2/3.x, SmolLM/SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3, and the mixtures of experts Qwen2/3-MoE,
Mixtral, gpt-oss) is this one class, its block variant expressed as `ModelConfig` features
(QK-norm, post-norms, (1 + w) norms, embedding scale, biases, attention sinks, the MLP
activation, per layer the sliding window and RoPE, and a mixture-of-experts MLP on the layers
`config.is_moe` names: `jaxinfer.model.moe`).

One forward: `Llama(batch, k_pages, v_pages)` runs the N flat token rows of a step descriptor
(`jaxinfer.model.batch.StepBatch`) through every layer, writes their K/V into the paged pool and
returns the logits of the rows it names. Decode, prompt chunks, mixed steps, forked samples and
speculative verification are all descriptors; the model has no other entry point.

Weights are stored einsum-native, one `Block` per layer, with two projections fused at load so
XLA runs one larger matmul instead of three or two (`jaxinfer.model.params.fuse_layer`):

    qkv:     [D, K, G + 2, H]  per kv head: its G query heads, then its key, then its value
    gate_up: [2, D, F]         gate, up (a mixture layer: `moe.WEIGHTS` instead)

The fused qkv keeps each kv head's queries beside it, so sharding over `kv_heads` (tensor
parallelism) splits it cleanly. Query head n = k * G + g uses kv head k, as in Hugging Face.
gate_up keeps its two matrices apart on the leading axis, each [D, F] in the (8, 128) tiles
XLA:TPU's dot reads: stored [D, 2, F], XLA:TPU tiles the size-2 axis with F and relays each
layer out before the dot, which a scanned stack cannot fuse into its dynamic slice (a copy of
the layer's gate_up every step in the deviceless 70B check).
Norms, RoPE, softmax and logits are computed in f32 whatever the weight dtype. With
`config.weights` int8 or int4 each matrix is a `quant.QuantWeight` (q + scales, same logical
axes), dequantized inside the step, stored as `config.matrix_storage` says by its name (one kind
and layout per name in every layer; the embedding and LM head follow the rule in `quant`).

The layer stack has two layouts (`ModelConfig.scan_layers`, `jaxinfer.model.layers`): one
`Block` per layer run unrolled, or each layer kind's weights stacked on a leading `layers` axis
and the layers run as a `jax.lax.scan` over their repeating group, which XLA compiles once.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import LayerKind, ModelConfig
from jaxinfer.model import lora, moe, quant
from jaxinfer.model.attention import write_and_attend
from jaxinfer.model.batch import StepBatch
from jaxinfer.model.layers import (
    kind_layers,
    layer_kinds,
    layer_slots,
    local_layers,
    segments,
)
from jaxinfer.model.mlp import gated_mlp
from jaxinfer.model.params import expected_shapes, fuse_layer, norm_names, stack_layers
from jaxinfer.model.rope import apply_rope, rope_inv_freq
from jaxinfer.sharding import data_shards


def _param(value, axes: tuple[str, ...]) -> nnx.Param:
    """A weight with its logical axes. Its value stays a host (numpy) array until
    `jaxinfer.engine.steps.split_model` places it, on one device or straight into its shards on a
    mesh, so a model bigger than one device's memory never lands whole on one device."""
    if not isinstance(value, jax.ShapeDtypeStruct):  # abstract models keep their structs
        value = np.asarray(value)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _cast(value, dtype):
    """`value` as `dtype`: a numpy array cast (the same array when it already is: a model's
    host weights are the checkpoint's, not a second copy of them), or a
    `jax.ShapeDtypeStruct` (abstract model)."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(value.shape, dtype)
    if isinstance(value, np.ndarray):
        return value.astype(dtype, copy=False)
    return value.astype(dtype)


def _weight(value, axes: tuple[str, ...], contract: tuple[int, ...], kind: str, group: int,
            *, kernel: bool = True):
    """A matrix param stored as `kind`: a float dtype (cast), or int8 / int4 (a
    `quant.QuantWeight`, quantized here unless the loader already did: a `quant.QTensor`;
    `kernel`: `QuantWeight.kernel`)."""
    if isinstance(value, quant.QTensor):
        if value.kind != kind:
            raise ValueError(f"a {value.kind} weight given to a model of {kind} weights")
        return quant.QuantWeight(value, axes, _param, kernel=kernel)
    if kind in quant.QUANT_DTYPES:
        return quant.QuantWeight(quant.quantize(value, contract, kind, group), axes, _param,
                                 kernel=kernel)
    return _param(_cast(value, np.dtype(jnp.dtype(kind))), axes)


class Block(nnx.Module):
    """One decoder layer of kind `kind`: pre-norm GQA attention over the paged cache (local
    within the kind's sliding window or global, with the kind's RoPE), then the pre-norm gated
    MLP, or on a mixture layer (`kind.moe`) the mixture of experts (`jaxinfer.model.moe`, its
    weights `moe.WEIGHTS`); with `post_norms` each output is normed before its residual add.
    `stacked`: every array has a leading `layers` axis, the weights of several layers of this
    kind (the scanned layout, `jaxinfer.model.layers`); the forward runs a one-layer view of it
    (`layer_graph`, `row`: its arrays rows of the stacks, `quant.QuantWeight.kernel`; the LoRA
    pool's stacks left whole, read at the layer's row: `lora.LoraRows.layer`)."""

    def __init__(self, config: ModelConfig, fused: dict[str, np.ndarray], kind: LayerKind, *,
                 stacked: bool = False, row: bool = False):
        self.config, self.kind = config, kind
        store = config.matrix_storage  # (kind, group) by matrix name, the same in every layer
        lead = ("layers",) if stacked else ()

        def param(name, axes):
            return _param(_cast(fused[name], np.float32), lead + axes)

        def weight(name, axes, contract):
            return _weight(fused[name], lead + axes, tuple(a + len(lead) for a in contract),
                           *store(name), kernel=not row)

        for name in norm_names(config):
            setattr(self, name, param(name, ("norm",)))
        self.qkv = weight("qkv", ("embed", "kv_heads", "qkv", "head_dim"), (0,))
        self.o = weight("o", ("q_heads", "head_dim", "embed"), (0, 1))
        if kind.moe:
            for name in moe.weight_names(config):
                axes, contract = moe.WEIGHTS[name]
                setattr(self, name, param(name, axes) if contract is None
                        else weight(name, axes, contract))
        else:
            self.gate_up = weight("gate_up", ("gate_up", "embed", "ffn"), (1,))
            self.down = weight("down", ("ffn", "embed"), (0,))
        if config.qkv_bias:
            self.qkv_bias = param("qkv_bias", ("kv_heads", "qkv", "head_dim"))
        if config.o_bias:
            self.o_bias = param("o_bias", ("embed",))
        if config.attention_sinks:
            self.sinks = param("sinks", ("q_heads",))
        abstract = isinstance(fused["o"], jax.ShapeDtypeStruct)
        dtype = lora.pool_dtype(config)
        rows = fused["o"].shape[:len(lead)]  # (L_kind,) stacked, like every array here
        for name, (shape, axes) in lora.pool_layout(config).items():  # zero: no adapter yet
            shape = rows + shape
            setattr(self, name, _param(jax.ShapeDtypeStruct(shape, dtype) if abstract
                                       else np.zeros(shape, dtype), lead + axes))

    def __call__(self, x: jax.Array, batch: StepBatch, k_pages, v_pages,
                 layer: jax.Array | int | None = None,
                 adapters: lora.LoraRows | None = None,
                 expert_row: jax.Array | int | None = None) -> tuple[jax.Array, object, object]:
        """x [N, D] -> (x [N, D], k_pages, v_pages): attention, written then read through the
        pool, and the MLP, over the step's N rows. k_pages, v_pages: the layer's pool
        [K, pages, page_size, H] (layer None), or a stacked pool [L, K, ...] whose row `layer`
        (i32[] or a static int) is this layer's. `adapters`: the rows' LoRA slots (None: the
        base model alone). `expert_row`: the routed experts' weights are their kind's stacks,
        this layer's at that row (`moe.moe_mlp`)."""
        attn, k_pages, v_pages = self.attend(self._norm(x, "attn_norm"), batch, k_pages,
                                             v_pages, layer, adapters)
        return self.out_and_mlp(x, attn, adapters, expert_row), k_pages, v_pages

    def attend(self, h: jax.Array, batch: StepBatch, k_pages, v_pages,
               layer: jax.Array | int | None = None,
               adapters: lora.LoraRows | None = None) -> tuple[jax.Array, object, object]:
        """The attention of normed inputs h [N, D_in] (D_in: the qkv weight's input width):
        q, k, v projected (`project_qkv`), K/V written then read through the pool. Returns
        (attn [N, K, G, H], k_pages, v_pages)."""
        window = self.kind.window
        with jax.named_scope("attn"):
            q, k, v = (_rows(a, split=False)
                       for a in self.project_qkv(h, batch.positions, adapters))
            attn, k_pages, v_pages = write_and_attend(
                q, k, v, k_pages, v_pages, batch.for_layer(window is not None),
                sliding_window=window,
                sinks=self.sinks[...] if self.config.attention_sinks else None, layer=layer)
        return _rows(attn, split=True), k_pages, v_pages

    def _pool(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in lora.pool_layout(self.config)}

    def _norm(self, x, name: str):
        c = self.config
        return rms_norm(x, getattr(self, name)[...], c.rms_norm_eps,
                        plus_one=c.norm_plus_one).astype(x.dtype)

    def project_qkv(self, h: jax.Array, positions: jax.Array,
                    adapters: lora.LoraRows | None = None):
        """The fused projection of normed inputs h [N, D_in] (+ the rows' adapters, + QK-norm)
        + RoPE at positions i32[N]: q [N, K, G, H], k, v [N, K, H]. With
        `query_pre_attn_scalar` the queries carry the score scale's difference from 1/sqrt(H)
        (the attention scales by 1/sqrt(H))."""
        c = self.config
        g = c.q_per_kv
        qkv = quant.einsum("ND,DKCH->NKCH", h, self.qkv)
        if adapters is not None:
            qkv = qkv + lora.qkv_delta(h, self._pool(), adapters, c).astype(qkv.dtype)
        if c.qkv_bias:
            qkv = qkv + self.qkv_bias[...].astype(qkv.dtype)
        q, k = qkv[:, :, :g], qkv[:, :, g]
        if c.qk_norm:
            q, k = self._norm(q, "q_norm"), self._norm(k, "k_norm")
        rope = self.kind.rope
        inv_freq, scale = rope_inv_freq(rope, c.head_dim), rope.attention_scale
        q, k = apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale)
        if c.query_pre_attn_scalar not in (None, float(c.head_dim)):
            q = (q * math.sqrt(c.head_dim / c.query_pre_attn_scalar)).astype(q.dtype)
        return q, k, qkv[:, :, g + 1]

    def out_and_mlp(self, x: jax.Array, attn: jax.Array,
                    adapters: lora.LoraRows | None = None,
                    expert_row: jax.Array | int | None = None) -> jax.Array:
        """Output projection of attn [N, K, G, H] added to the residual x [N, D], then the
        gated MLP (each projection plus the rows' adapters; a mixture layer's experts at
        `expert_row` of their stacks, if given): the layer's output [N, D]."""
        c = self.config
        # As 2-D matrices: with "NKGH,KGHD" XLA CPU transposes the weight every step.
        attn = attn.reshape(attn.shape[0], c.num_q_heads * c.head_dim)
        out = quant.einsum("NX,XD->ND", attn, self.o,
                           shape=(c.num_q_heads * c.head_dim, c.embed_dim))
        extra = None
        if adapters is not None:
            pool = self._pool()
            out = out + lora.o_delta(attn, pool, adapters, c).astype(out.dtype)
            extra = lambda name, h: lora.mlp_delta(name, h, pool, adapters, c)  # noqa: E731
        if c.o_bias:
            out = out + self.o_bias[...].astype(out.dtype)
        x = x + (self._norm(out, "post_attn_norm") if c.post_norms else out)
        with jax.named_scope("mlp"):
            h = self._norm(x, "mlp_norm")
            if self.kind.moe:
                out = moe.moe_mlp(h, {n: getattr(self, n) for n in moe.weight_names(c)}, c,
                                  expert_row)
            else:
                out = gated_mlp(h, self.gate_up, self.down, c, extra)
            x = x + (self._norm(out, "post_mlp_norm") if c.post_norms else out)
        return x


class Llama(nnx.Module):
    """Decoder-only transformer over the paged KV cache. Build with `Llama(config, params)`
    from canonical checkpoint params (`jaxinfer.model.params`)."""

    def __init__(self, config: ModelConfig, params: dict[str, np.ndarray]):
        self.config = config
        self.embed = _weight(params["embed"], ("vocab", "embed"), (1,),
                             *config.matrix_storage("embed"))
        kinds = layer_kinds(config)
        if config.scan_layers:
            self.layers = nnx.Dict({
                name: Block(config, stack_layers(config, params, rows), kinds[rows[0]],
                            stacked=True)
                for name, rows in kind_layers(config).items()})
        else:
            self.layers = nnx.List([Block(config, fuse_layer(config, params, i), kinds[i])
                                    for i in range(config.num_layers)])
        self.final_norm = _param(_cast(params["final_norm"], np.float32), ("norm",))
        if not config.tie_embeddings:
            self.lm_head = _weight(params["lm_head"], ("embed", "vocab"), (0,),
                                   *config.matrix_storage("lm_head"))

    @classmethod
    def abstract(cls, config: ModelConfig) -> Llama:
        """The model for `config` with `jax.ShapeDtypeStruct` weights (nothing allocated): the
        same graph, shapes, dtypes and logical axes as `Llama(config, params)`, e.g. as the
        target of a sharded restore (`jaxinfer.checkpoint.orbax`)."""
        return cls(config, {name: jax.ShapeDtypeStruct(shape, np.float32)
                            for name, shape in expected_shapes(config).items()})

    def with_lora_pool(self, slots: int, rank: int) -> Llama:
        """A new model with an empty LoRA adapter pool of `slots` x `rank` in every layer
        (`jaxinfer.model.lora`; zeros, or `jax.ShapeDtypeStruct`s in an abstract model): one
        [S, ...] per layer unrolled, one [L_kind, S, ...] per kind scanned. The weights are the
        same arrays."""
        config = dataclasses.replace(self.config, lora_slots=slots, lora_rank=rank)
        graphdef, state = nnx.split(Llama.abstract(config))
        params = nnx.to_pure_dict(nnx.split(self)[1])
        dtype = lora.pool_dtype(config)
        # an abstract model (`abstract`) gets an abstract pool: nothing is allocated
        empty = (jax.ShapeDtypeStruct if any(isinstance(x, jax.ShapeDtypeStruct)
                                             for x in jax.tree.leaves(params)) else np.zeros)
        stacks = kind_layers(config)
        for key, layer in params["layers"].items():
            rows = (len(stacks[key]),) if config.scan_layers else ()
            for name in [n for n in layer if lora.is_pool(n)]:
                del layer[name]  # a pool of another size
            for name, (shape, _) in lora.pool_layout(config).items():
                layer[name] = empty(rows + shape, dtype)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    def __call__(self, batch: StepBatch, k_pages: tuple, v_pages: tuple
                 ) -> tuple[jax.Array, tuple, tuple]:
        """One forward pass of the step's N rows that also writes their K/V into the pool.

        Args:
          batch: the step descriptor (`jaxinfer.model.batch`).
          k_pages, v_pages: the pool (donated by the caller): unrolled, L x [K, pages,
            page_size, H]; scanned, one stacked pool per `layers.pool_keys` [L_pool, K, pages,
            page_size, H] (`jaxinfer.engine.kv_cache`).
        Returns:
          (logits f32[M, V] of the rows `batch.logits_index` names, k_pages, v_pages).
        """
        logits, _, k_pages, v_pages = self.with_features(batch, k_pages, v_pages, ())
        return logits, k_pages, v_pages

    def with_features(self, batch: StepBatch, k_pages: tuple, v_pages: tuple,
                      features: tuple[int, ...]) -> tuple[jax.Array, jax.Array, tuple, tuple]:
        """`__call__` that also returns hidden states of every row (a feature drafter's input,
        `jaxinfer.model.eagle`), computed in the same pass.

        features: static indices in [0, L], numbered as Hugging Face's `hidden_states`: i < L is
          the residual stream entering layer i (0: the embeddings), L the last layer's output
          after the final norm.
        Returns:
          (logits f32[M, V], feats [N, len(features), D] in the activation dtype (empty
          features: [N, 0, D]), k_pages, v_pages).
        """
        c = self.config
        if any(not 0 <= f <= c.num_layers for f in features):
            raise ValueError(f"feature layers {features} must be in [0, {c.num_layers}]")
        # The rows are split over "data" only in here (see `_rows`): the step's inputs and the
        # logits stay whole on every data shard.
        batch = _whole(batch)
        x = _rows(self.embed_rows(batch.tokens), split=True)  # [N, D]
        adapters = (lora.LoraRows.of(batch.lora, c.lora_slots)
                    if c.lora_slots and batch.lora is not None else None)
        inner = tuple(f for f in features if f < c.num_layers)
        if c.scan_layers:
            x, feats, k_pages, v_pages = self._scanned(x, batch, tuple(k_pages),
                                                       tuple(v_pages), inner, adapters)
        else:
            x, feats, k_pages, v_pages = self._unrolled(x, batch, tuple(k_pages),
                                                        tuple(v_pages), inner, adapters)
        # The M logits rows padded (with row 0) to a multiple of the data axis, so that the
        # lm_head splits them too; the padding is dropped once they are whole again.
        m = batch.logits_index.shape[0]
        pad = -m % data_shards()
        rows = jnp.pad(batch.logits_index, (0, pad)) if pad else batch.logits_index
        logits = self._logits(_rows(x[rows], split=True))
        out = [feats[inner.index(f)] if f < c.num_layers else self.final_hidden(x)
               for f in features]
        feats = (jnp.stack(out, axis=1) if out else jnp.zeros(x.shape[:1] + (0,) + x.shape[1:],
                                                              x.dtype))
        return _rows(logits, split=False)[:m], _rows(feats, split=False), k_pages, v_pages

    def _unrolled(self, x, batch: StepBatch, k_pages: tuple, v_pages: tuple,
                  features: tuple[int, ...] = (), adapters: lora.LoraRows | None = None):
        """Every layer in turn, each with its own weights, pool and LoRA adapter pool; also
        the rows' residual stream entering each layer of `features` ([F, N, D])."""
        new_k, new_v, feats = [], [], {}
        for i, (layer, kp, vp) in enumerate(zip(self.layers, k_pages, v_pages, strict=True)):
            if i in features:
                feats[i] = x
            graph, arrays = nnx.split(layer)
            x, kp, vp = _traced_once(graph, arrays, x, batch, kp, vp, adapters)
            new_k.append(kp)
            new_v.append(vp)
        return x, [feats[f] for f in features], tuple(new_k), tuple(new_v)

    def _scanned(self, x, batch: StepBatch, k_pages: tuple, v_pages: tuple,
                 features: tuple[int, ...] = (), adapters: lora.LoraRows | None = None):
        """The layers as `layers.segments` over the stacked weights and pools (module doc of
        `jaxinfer.model.layers`): each segment of several repetitions a `jax.lax.scan` whose
        carry is (x, the pools, the `features` so far). A feature layer inside a scan is
        recorded by a select on the repetition that reaches it. `adapters` (the rows' slots) is
        the same for every layer; each layer reads the LoRA factors of those slots at its row
        of its kind's stacked pool."""
        c = self.config
        kinds = layer_kinds(c)
        # Two pools: a hybrid cache's global and local ones (`layers.pool_keys`); one pool
        # holds every layer whatever their kinds.
        slots = layer_slots(c, local_layers(c, len(k_pages) > 1), stacked=True)
        if len(k_pages) != 1 + max(s.pool for s in slots):
            raise ValueError(f"a scanned model of {c.num_layers} layers takes "
                             f"{1 + max(s.pool for s in slots)} stacked pools, got "
                             f"{len(k_pages)} (kv_cache.create_cache for this model)")
        stacks = {name: nnx.to_pure_dict(nnx.state(block)) for name, block in self.layers.items()}

        def run(i, weight, row, x, pools):
            """Layer i (its kind's), reading weight row `weight` and pool row `row`."""
            slot = slots[i]
            # The adapter pool stays whole: each slot the step uses is read at [weight, slot]
            # (`lora.LoraRows.in_layer`), not the layer's row of every slot; so do the routed
            # experts, read at their row by the grouped matmul (`moe.moe_mlp`).
            arrays = {name: a if lora.is_pool(name) or name in moe.EXPERT_WEIGHTS
                      else jax.tree.map(lambda w: w[weight], a)
                      for name, a in stacks[slot.kind].items()}
            block = nnx.merge(layer_graph(c, kinds[i]), arrays)
            k_pools, v_pools = pools
            x, kp, vp = block(x, batch, k_pools[slot.pool], v_pools[slot.pool], layer=row,
                              adapters=None if adapters is None else adapters.in_layer(weight),
                              expert_row=weight)
            return x, (_put(k_pools, slot.pool, kp), _put(v_pools, slot.pool, vp))

        pools = (k_pages, v_pages)
        feats = tuple(jnp.zeros_like(x) for _ in features)
        for seg in segments(kinds):
            if seg.repeats == 1:
                for i in range(seg.start, seg.stop):
                    feats = _record(feats, features, x, i)
                    x, pools = run(i, slots[i].weight, slots[i].pool_index, x, pools)
                continue

            def body(carry, step, seg=seg):
                x, pools, feats = carry
                for i in range(seg.start, seg.start + seg.period):
                    first, second = slots[i], slots[i + seg.period]
                    feats = _record(feats, features, x, i, step, seg.period, seg.stop)
                    x, pools = run(
                        i, first.weight + step * (second.weight - first.weight),
                        first.pool_index + step * (second.pool_index - first.pool_index),
                        x, pools)
                return (x, pools, feats), None

            (x, pools, feats), _ = jax.lax.scan(body, (x, pools, feats),
                                                jnp.arange(seg.repeats, dtype=jnp.int32))
        return x, list(feats), *pools

    def embed_rows(self, tokens: jax.Array) -> jax.Array:
        """The input embeddings [..., D] of token ids i32[...] (scaled where the family scales
        them), in the activation dtype."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        x = quant.take_rows(self.embed, tokens, dt)
        if c.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(c.embed_dim), dt)
        return x

    def final_hidden(self, x: jax.Array) -> jax.Array:
        """The last layer's output x [..., D] after the final norm (what the LM head reads;
        Hugging Face's last `hidden_states`), in x's dtype."""
        c = self.config
        return rms_norm(x, self.final_norm[...], c.rms_norm_eps,
                        plus_one=c.norm_plus_one).astype(x.dtype)

    def _logits(self, x: jax.Array) -> jax.Array:
        return self.head(self.final_hidden(x))

    def head(self, x: jax.Array) -> jax.Array:
        """The LM head of final hidden states x [..., D] (after the final norm): f32[..., V]."""
        c = self.config
        with jax.named_scope("lm_head"):
            if c.tie_embeddings:
                logits = quant.einsum("...D,VD->...V", x, self.embed,
                                      preferred_element_type=jnp.float32)
            else:
                logits = quant.einsum("...D,DV->...V", x, self.lm_head,
                                      preferred_element_type=jnp.float32)
        return logits.astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=0, inline=True)
def _traced_once(graph: nnx.GraphDef, arrays, x, batch: StepBatch, k_pages, v_pages,
                 adapters: lora.LoraRows | None):
    """An unrolled layer: `Block` `graph` with `arrays`. Layers of one graph and shapes trace
    once (jit's trace cache); `inline` copies the traced equations into the enclosing step, so
    its program is what calling each layer directly gives, traced in a fraction of the time."""
    return nnx.merge(graph, arrays)(x, batch, k_pages, v_pages, adapters=adapters)


@functools.cache
def layer_graph(config: ModelConfig, kind: LayerKind) -> nnx.GraphDef:
    """The graph of one unstacked `Block` of `kind`: merged with one row of every array of a
    stacked Block of that kind, it is that layer (its quantized weights' layout and logical
    axes without the `layers` axis)."""
    first = layer_kinds(config).index(kind)
    prefix = f"layers.{first}."
    shapes = {name: jax.ShapeDtypeStruct(shape, np.float32)
              for name, shape in expected_shapes(config).items() if name.startswith(prefix)}
    return nnx.split(Block(config, fuse_layer(config, shapes, first), kind, row=True))[0]


def _record(feats: tuple, features: tuple[int, ...], x: jax.Array, layer: int,
            step: jax.Array | None = None, period: int = 1, stop: int = 0) -> tuple:
    """`feats` with x (the residual stream entering a layer) stored for the features it is.
    Unrolled (`step` None): the layer is `layer`. In a scan: the layer is layer + step *
    period (`step` traced, the repetition), so each feature in [layer, stop) congruent to
    `layer` modulo `period` is stored by a select on its repetition."""
    out = []
    for f, old in zip(features, feats, strict=True):
        if step is None:
            out.append(x if f == layer else old)
        elif layer <= f < stop and (f - layer) % period == 0:
            out.append(jnp.where(step == (f - layer) // period, x, old))
        else:
            out.append(old)
    return tuple(out)


def _put(pools: tuple, index: int, pool) -> tuple:
    return pools[:index] + (pool,) + pools[index + 1:]


def _rows(x: jax.Array, *, split: bool) -> jax.Array:
    """Data parallelism (a context mesh with a "data" axis): the rows (axis 0) of activations
    x [N, ...] are split over "data" for the weight matmuls (`split=True`), so each data shard
    multiplies 1/D of them, and gathered (`split=False`) for the K/V write and attention, where
    each data shard writes and attends for the rows whose pages its part of the pool holds
    (`attention.on_pool_shards`: a row's slot belongs to one shard, the rows of a step to any),
    and for the logits. Other axes are left to the partitioner ("model" for heads, FFN and
    vocabulary on a data x model mesh). No "data" axis, or one that does not divide the rows:
    x unchanged.

    The split must not leave the model (`Llama.__call__` keeps its inputs and its logits whole,
    `_whole`): propagated into the step around it, it reaches scatters such as the slot state's
    `.at[slot].set`, and XLA (jaxlib 0.10.2) miscompiles `a.at[i].set(v)` of an array split over
    "data" that is a slice of a replicated one. The partitioned scatter writes each shard's own
    element back at i - shard_start clamped into the shard; the algebraic simplifier folds that
    read, dynamic-slice(dynamic-slice(a, start), i - start), into dynamic-slice(a, i) without
    the clamp, so each shard without i overwrites its last (or first) element with a[i]."""
    d = data_shards()
    if d == 1 or (split and x.shape[0] % d):
        return x
    free = jax.sharding.PartitionSpec.UNCONSTRAINED
    spec = jax.sharding.PartitionSpec("data" if split else None, *([free] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, spec)


def _whole(tree):
    """Every array of `tree` replicated on a mesh with a "data" axis (see `_rows`); else `tree`."""
    if data_shards() == 1:
        return tree
    return jax.tree.map(
        lambda a: jax.lax.with_sharding_constraint(a, jax.sharding.PartitionSpec()), tree)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, plus_one: bool = False
             ) -> jax.Array:
    """f32 RMSNorm of x [..., D] scaled by weight [D] (by 1 + weight with `plus_one`, Gemma's
    form); returns f32 (callers cast)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    return xf * (1.0 + w if plus_one else w)
