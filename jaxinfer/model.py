"""The Llama-family decoder as a Flax NNX module (Llama 2/3.x, SmolLM/SmolLM2, Mistral, Qwen2).

Weights are stored einsum-native, one `Block` per layer, with two projections fused at load so
XLA runs one larger matmul instead of three or two:

    qkv:     [D, K, G + 2, H]  per kv head: its G query heads, then its key, then its value
    gate_up: [D, 2, F]         gate, up

The fused qkv keeps each kv head's queries beside it, so sharding over `kv_heads` (tensor
parallelism) splits it cleanly. Query head n = k * G + g uses kv head k, as in Hugging Face.
Norms, RoPE, softmax and logits are computed in f32 whatever the weight dtype.

Layers are unrolled, not scanned: on XLA CPU a scan slices each layer's weights out of a stacked
array with a copy before every matmul (measured: 29 ms vs 23 ms for the same 30 weight reads), and
per-layer arrays make each layer's KV write an in-place update of its own buffer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.attention import (
    apply_rope,
    data_shards,
    decode_attention,
    on_pool_shards,
    paged_attention_reference,
    rope_inv_freq,
    shard_rows,
    write_kv,
)
from jaxinfer.config import ModelConfig


def _param(value, axes: tuple[str, ...]) -> nnx.Param:
    """A weight with its logical axes. Its value stays a host (numpy) array until
    `steps.split_model` places it, on one device or straight into its shards on a mesh, so a
    model bigger than one device's memory never lands whole on one device."""
    if not isinstance(value, jax.ShapeDtypeStruct):  # abstract models keep their structs
        value = np.asarray(value)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _cast(value, dtype):
    """`value.astype(dtype)` for a numpy array or a `jax.ShapeDtypeStruct` (abstract model)."""
    if isinstance(value, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(value.shape, dtype)
    return value.astype(dtype)


def fuse_layer(config: ModelConfig, params: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """Canonical params of layer i (see `jaxinfer.weights`) -> the fused per-layer arrays.
    `jax.ShapeDtypeStruct` params give the fused structs (the same code, traced abstractly)."""
    names = ["attn_norm", "mlp_norm", "q", "k", "v", "o", "gate", "up", "down"]
    if config.qkv_bias:
        names += ["q_bias", "k_bias", "v_bias"]
    p = {name: params[f"layers.{i}.{name}"] for name in names}
    if any(isinstance(v, jax.ShapeDtypeStruct) for v in p.values()):
        return jax.eval_shape(functools.partial(_fuse, config, jnp), p)
    return _fuse(config, np, p)


def _fuse(config: ModelConfig, xp, p: dict) -> dict:
    """fuse_layer's arithmetic with `xp` = numpy (real arrays) or jax.numpy (under eval_shape)."""
    c = config
    num_k, g, h = c.num_kv_heads, c.q_per_kv, c.head_dim
    out = {
        "attn_norm": p["attn_norm"], "mlp_norm": p["mlp_norm"], "o": p["o"], "down": p["down"],
        "qkv": xp.concatenate([p["q"].reshape(c.embed_dim, num_k, g, h),
                               p["k"][:, :, None], p["v"][:, :, None]], axis=2),
        "gate_up": xp.stack([p["gate"], p["up"]], axis=1),
    }
    if c.qkv_bias:
        out["qkv_bias"] = xp.concatenate([p["q_bias"].reshape(num_k, g, h),
                                          p["k_bias"][:, None], p["v_bias"][:, None]], axis=1)
    return out


def init_params(config: ModelConfig, seed: int = 0, scale: float = 0.05) -> dict[str, np.ndarray]:
    """Random canonical params for tests on toy configs (normal(0, scale), norms near 1)."""
    from jaxinfer.weights import expected_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


class Block(nnx.Module):
    """One decoder layer: pre-norm GQA attention over the paged cache, then pre-norm SwiGLU."""

    def __init__(self, config: ModelConfig, fused: dict[str, np.ndarray]):
        self.config = config
        dt = np.dtype(jnp.dtype(config.dtype))
        self.attn_norm = _param(_cast(fused["attn_norm"], np.float32), ("norm",))
        self.mlp_norm = _param(_cast(fused["mlp_norm"], np.float32), ("norm",))
        self.qkv = _param(_cast(fused["qkv"], dt), ("embed", "kv_heads", "qkv", "head_dim"))
        self.o = _param(_cast(fused["o"], dt), ("q_heads", "head_dim", "embed"))
        self.gate_up = _param(_cast(fused["gate_up"], dt), ("embed", "gate_up", "ffn"))
        self.down = _param(_cast(fused["down"], dt), ("ffn", "embed"))
        if config.qkv_bias:
            self.qkv_bias = _param(_cast(fused["qkv_bias"], dt), ("kv_heads", "qkv", "head_dim"))

    def _qkv(self, x, positions, inv_freq):
        """Pre-norm fused projection + RoPE: q [B, T, K, G, H], k, v [B, T, K, H]."""
        c = self.config
        g = c.q_per_kv
        h = rms_norm(x, self.attn_norm[...], c.rms_norm_eps).astype(x.dtype)
        qkv = jnp.einsum("BTD,DKCH->BTKCH", h, self.qkv[...])
        if c.qkv_bias:
            qkv = qkv + self.qkv_bias[...]
        q = apply_rope(qkv[:, :, :, :g], positions, inv_freq)
        k = apply_rope(qkv[:, :, :, g], positions, inv_freq)
        return q, k, qkv[:, :, :, g + 1]

    def _out_and_mlp(self, x, attn):
        """Output projection of attn [B, T, K, G, H] added to x, then the SwiGLU block."""
        c = self.config
        # As 2-D matrices: with "BTNH,NHD" XLA CPU transposes the weight every step.
        attn = attn.reshape(attn.shape[:2] + (c.num_q_heads * c.head_dim,))
        x = x + attn @ self.o[...].reshape(c.num_q_heads * c.head_dim, c.embed_dim)
        with jax.named_scope("mlp"):
            h = rms_norm(x, self.mlp_norm[...], c.rms_norm_eps).astype(x.dtype)
            gu = jnp.einsum("BTD,DCF->BTCF", h, self.gate_up[...])
            act = jax.nn.silu(gu[:, :, 0].astype(jnp.float32)) * gu[:, :, 1]
            x = x + jnp.einsum("BTF,FD->BTD", act.astype(x.dtype), self.down[...])
        return x

    def __call__(self, x, positions, valid, inv_freq, k_pages, v_pages, page_rows, kv_lens, *,
                 num_pages_read: int, attention_impl: str = "xla", verify: bool = False,
                 pool_shards: int = 1, ragged=None):
        """One layer over x [B, T, D] (see `Llama.__call__`). With `ragged` = (flat positions
        i32[N], gather i32[B, T], slot i32[N], offset i32[N]), x is [1, N, D] flat rows: the
        projections and the MLP run on the N rows, the K/V write and attention on the [B, T]
        layout (queries gathered from the flat rows, outputs scattered back), so each row's
        pages are read once for all its queries."""
        c = self.config

        def write_attend(first, q, k, v, k_pages, v_pages, page_rows, positions, valid, kv_lens):
            """`first`: None for the whole pool, else one data shard's (`on_pool_shards`)."""
            k_pages, v_pages = write_kv(k_pages, v_pages, k, v, page_rows, positions, valid,
                                        first)
            rows, mine = page_rows, None
            if first is not None:
                rows, mine = shard_rows(page_rows, first, k_pages.shape[1] - 1)
            attend = paged_attention_reference
            if q.shape[1] == 1 or verify:  # decode / verify: the kernel path when asked for
                attend = functools.partial(decode_attention, impl=attention_impl, mine=mine)
            attn = attend(q, k_pages, v_pages, rows, positions, kv_lens,
                          num_pages_read=num_pages_read, sliding_window=c.sliding_window)
            return _keep(attn, mine), k_pages, v_pages

        with jax.named_scope("attn"):
            if ragged is None:
                q, k, v = self._qkv(x, positions, inv_freq)
            else:
                flat_positions, gather = ragged[:2]
                q, k, v = (a[0][gather] for a in self._qkv(x, flat_positions[None], inv_freq))
            if pool_shards > 1:
                attn, k_pages, v_pages = on_pool_shards(
                    write_attend, pool_shards, (q, k, v), (k_pages, v_pages),
                    (page_rows, positions, valid, kv_lens))
            else:
                attn, k_pages, v_pages = write_attend(None, q, k, v, k_pages, v_pages,
                                                      page_rows, positions, valid, kv_lens)
            if ragged is not None:
                attn = attn[ragged[2], ragged[3]][None]  # [1, N, K, G, H]
        return self._out_and_mlp(x, attn), k_pages, v_pages

    def mixed(self, x, positions, valid, token_rows, inv_freq, k_pages, v_pages, page_table,
              decode_lens, chunk_row, chunk_len, *, num_pages_read: int,
              attention_impl: str = "xla", pool_shards: int = 1):
        """One layer over the flat rows of a mixed step: x [1, B + T, D] holds one decode token
        of each of the B slots, then T tokens of one sequence's prompt chunk. All projections
        run as one matmul over the B + T rows; attention runs per group (decode rows over their
        own pages, with the kernel when asked for; the chunk causally over its sequence's).

        token_rows: i32[B + T, P] page-table row of each token (for the K/V write);
        page_table: i32[B, P]; decode_lens: i32[B] cache length after the step per decode row;
        chunk_row: i32[1, P]; chunk_len: i32[1] its cache length after the step.
        """
        c = self.config
        b = page_table.shape[0]

        def write_attend(first, q, k, v, k_pages, v_pages, token_rows, positions, valid,
                         page_table, decode_lens, chunk_row, chunk_len):
            """`first`: None for the whole pool, else one data shard's (`on_pool_shards`)."""
            k_pages, v_pages = write_kv(k_pages, v_pages, k[0][:, None], v[0][:, None],
                                        token_rows, positions[0][:, None], valid[0][:, None],
                                        first)
            mine = chunk_mine = None
            if first is not None:
                page_table, mine = shard_rows(page_table, first, k_pages.shape[1] - 1)
                chunk_row, chunk_mine = shard_rows(chunk_row, first, k_pages.shape[1] - 1)
            parts = [_keep(decode_attention(
                q[0, :b][:, None], k_pages, v_pages, page_table, positions[0, :b][:, None],
                decode_lens, num_pages_read=num_pages_read, sliding_window=c.sliding_window,
                impl=attention_impl, mine=mine)[:, 0], mine)]
            if q.shape[1] > b:
                chunk = paged_attention_reference(
                    q[:, b:], k_pages, v_pages, chunk_row, positions[:, b:], chunk_len,
                    num_pages_read=num_pages_read, sliding_window=c.sliding_window)
                parts.append(_keep(chunk, chunk_mine)[0])
            attn = jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
            return attn[None], k_pages, v_pages

        with jax.named_scope("attn"):
            q, k, v = (_rows(a, split=False) for a in self._qkv(x, positions, inv_freq))
            args = (token_rows, positions, valid, page_table, decode_lens, chunk_row, chunk_len)
            if pool_shards > 1:
                attn, k_pages, v_pages = on_pool_shards(write_attend, pool_shards, (q, k, v),
                                                        (k_pages, v_pages), args)
            else:
                attn, k_pages, v_pages = write_attend(None, q, k, v, k_pages, v_pages, *args)
        return self._out_and_mlp(x, _rows(attn, split=True)), k_pages, v_pages


class Llama(nnx.Module):
    """Decoder-only transformer over the paged KV cache. Build with `Llama(config, params)`
    from canonical checkpoint params (`jaxinfer.weights`)."""

    def __init__(self, config: ModelConfig, params: dict[str, np.ndarray]):
        self.config = config
        dt = np.dtype(jnp.dtype(config.dtype))
        self.embed = _param(_cast(params["embed"], dt), ("vocab", "embed"))
        self.layers = nnx.List([Block(config, fuse_layer(config, params, i))
                                for i in range(config.num_layers)])
        self.final_norm = _param(_cast(params["final_norm"], np.float32), ("norm",))
        if not config.tie_embeddings:
            self.lm_head = _param(_cast(params["lm_head"], dt), ("embed", "vocab"))

    @classmethod
    def abstract(cls, config: ModelConfig) -> Llama:
        """The model for `config` with `jax.ShapeDtypeStruct` weights (nothing allocated): the
        same graph, shapes, dtypes and logical axes as `Llama(config, params)`, e.g. as the
        target of a sharded restore (`jaxinfer.weights_orbax`)."""
        from jaxinfer.weights import expected_shapes

        return cls(config, {name: jax.ShapeDtypeStruct(shape, np.float32)
                            for name, shape in expected_shapes(config).items()})

    def __call__(self, tokens: jax.Array, positions: jax.Array, valid: jax.Array,
                 k_pages: tuple[jax.Array, ...], v_pages: tuple[jax.Array, ...],
                 page_rows: jax.Array, kv_lens: jax.Array, logits_index: jax.Array | None, *,
                 num_pages_read: int, attention_impl: str = "xla", verify: bool = False,
                 pool_shards: int = 1, ragged=None):
        """One forward pass of B rows x T tokens that also writes their K/V into the pool.

        Args:
          tokens: i32[B, T] token ids; positions: i32[B, T]; valid: bool[B, T] (False = padding).
          k_pages, v_pages: L x [K, num_pages, page_size, H] the pool (donated by the caller).
          page_rows: i32[B, P] page table rows; kv_lens: i32[B] cache length after this step.
          logits_index: i32[B] which token of each row to project to logits, or None for all.
          num_pages_read: static page bucket covering max(kv_lens).
          attention_impl: static, "xla" or "pallas" (decode steps only).
          verify: static; the T tokens of each row are consecutive (a speculative verification:
            the last token of the row and its drafts), so "pallas" runs the decode kernel's
            causal T-query path instead of the prefill reference.
          pool_shards: static; the pool is split over the mesh's "data" axis into this many
            parts (`KVCache.data_shards`, the `kv_cache` module doc).
          ragged: None, or the N flat rows that hold the real tokens of the [B, T] layout
            (flat tokens i32[N], flat positions i32[N], gather i32[B, T]: the flat row of
            (b, t), slot and offset i32[N]: the (b, t) of each flat row). The weight matmuls
            then run on N rows instead of B x T (`Block.__call__`); tokens, positions, valid
            still give the [B, T] layout of the K/V write and attention. logits_index must be
            None; the logits are the flat rows' [N, V].
        Returns:
          (logits f32[B, V] (or [B, T, V] when logits_index is None), k_pages, v_pages).
        """
        c = self.config
        if ragged is not None:
            x = self.embed[...][ragged[0]][None]  # [1, N, D]
            ragged = ragged[1:]
        else:
            x = self.embed[...][tokens]  # [B, T, D]
        inv_freq = rope_inv_freq(c.rope, c.head_dim)
        new_k, new_v = [], []
        for layer, kp, vp in zip(self.layers, k_pages, v_pages):
            x, kp, vp = layer(x, positions, valid, inv_freq, kp, vp, page_rows, kv_lens,
                              num_pages_read=num_pages_read, attention_impl=attention_impl,
                              verify=verify, pool_shards=pool_shards, ragged=ragged)
            new_k.append(kp)
            new_v.append(vp)
        if ragged is not None:
            return self._logits(x[0]), tuple(new_k), tuple(new_v)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]  # [B, D]
        return self._logits(x), tuple(new_k), tuple(new_v)

    def mixed(self, tokens: jax.Array, positions: jax.Array, valid: jax.Array,
              token_rows: jax.Array, k_pages: tuple[jax.Array, ...],
              v_pages: tuple[jax.Array, ...], page_table: jax.Array, decode_lens: jax.Array,
              chunk_row: jax.Array, chunk_len: jax.Array, logits_index: jax.Array, *,
              num_pages_read: int, attention_impl: str = "xla", pool_shards: int = 1):
        """The forward pass of a mixed step (see `Block.mixed`): tokens, positions, valid are
        [B + T] flat rows (B decode rows, then a T-token chunk); logits_index i32[M] picks the
        rows projected to logits. Returns (logits f32[M, V], k_pages, v_pages)."""
        c = self.config
        # The rows are split over "data" only in here (see `_rows`): the per-row inputs and the
        # logits stay whole on every data shard, so the step around the model (slot state,
        # sampling, page table) is partitioned as without the split.
        (tokens, positions, valid, token_rows, page_table, decode_lens, chunk_row, chunk_len,
         logits_index) = _whole(tokens, positions, valid, token_rows, page_table, decode_lens,
                                chunk_row, chunk_len, logits_index)
        x = _rows(self.embed[...][tokens][None], split=True)  # [1, N, D]
        inv_freq = rope_inv_freq(c.rope, c.head_dim)
        new_k, new_v = [], []
        for layer, kp, vp in zip(self.layers, k_pages, v_pages):
            x, kp, vp = layer.mixed(x, positions[None], valid[None], token_rows, inv_freq, kp,
                                    vp, page_table, decode_lens, chunk_row, chunk_len,
                                    num_pages_read=num_pages_read,
                                    attention_impl=attention_impl, pool_shards=pool_shards)
            new_k.append(kp)
            new_v.append(vp)
        # The M logits rows padded (with row 0) to a multiple of the data axis, so that the
        # lm_head splits them too; the padding is dropped once they are whole again.
        m = logits_index.shape[0]
        pad = -m % data_shards()
        rows = jnp.pad(logits_index, (0, pad)) if pad else logits_index
        logits = self._logits(_rows(x[0][rows][None], split=True))
        return _rows(logits[:, :m], split=False)[0], tuple(new_k), tuple(new_v)

    def _logits(self, x: jax.Array) -> jax.Array:
        c = self.config
        x = rms_norm(x, self.final_norm[...], c.rms_norm_eps).astype(x.dtype)
        with jax.named_scope("lm_head"):
            if c.tie_embeddings:
                logits = jnp.einsum("...D,VD->...V", x, self.embed[...],
                                    preferred_element_type=jnp.float32)
            else:
                logits = jnp.einsum("...D,DV->...V", x, self.lm_head[...],
                                    preferred_element_type=jnp.float32)
        return logits.astype(jnp.float32)


def _keep(x: jax.Array, rows: jax.Array | None) -> jax.Array:
    """x [B, ...] with the rows where `rows` (bool[B]) is False zeroed; x itself for None."""
    if rows is None:
        return x
    return jnp.where(rows.reshape(rows.shape + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))


def _rows(x: jax.Array, *, split: bool) -> jax.Array:
    """Data parallelism in a mixed step (`jax.set_mesh` with a "data" axis): the rows (axis 1)
    of activations x [1, N, ...] are split over "data" for the weight matmuls (`split=True`) and
    gathered (`split=False`) for the K/V write and attention, where each data shard writes and
    attends for the rows whose pages its part of the pool holds (`on_pool_shards`: a row's slot
    belongs to one shard, the rows of a step to any), and for the logits. Other axes are left
    to the partitioner ("model" for heads, FFN and vocabulary on a data x model mesh). No "data"
    axis, or one that does not divide the rows: x unchanged."""
    # The split must not leave the model (`Llama.mixed` keeps its inputs and logits whole, see
    # `_whole`). Left to propagate, it reached the step's slot state and sampling, and XLA
    # (jaxlib 0.10.2) miscompiles `a.at[i].set(v)` of an array split over "data" that is a slice
    # of a replicated one: the partitioned scatter writes each shard's own element back at
    # i - shard_start clamped into the shard, but the algebraic simplifier folds that read,
    # dynamic-slice(dynamic-slice(a, start), i - start), into dynamic-slice(a, i), dropping the
    # clamp, so each shard without i overwrites its last (or first) element with a[i]. That was
    # the wrong tokens on data:2 x model:4: in decode-only steps `logits_index.at[b].set(0)`
    # (M = 5 rows split 3 + 2) turned index 2 into 4, and slot 2 sampled slot 3's logits. (That
    # index is a constant since, but the step's other scatters, e.g. `.at[slot].set` of the slot
    # state, still ran split.)
    d = data_shards()
    if d == 1 or (split and x.shape[1] % d):
        return x
    free = jax.sharding.PartitionSpec.UNCONSTRAINED
    spec = jax.sharding.PartitionSpec(None, "data" if split else None,
                                      *([free] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, spec)


def _whole(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """The arrays replicated on a mesh with a "data" axis (see `_rows`); else unchanged."""
    if data_shards() == 1:
        return arrays
    return tuple(jax.lax.with_sharding_constraint(a, jax.sharding.PartitionSpec())
                 for a in arrays)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """f32 RMSNorm of x [..., D] with weight [D]; returns f32 (callers cast)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return xf * weight.astype(jnp.float32)
