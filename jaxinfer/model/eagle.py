"""A feature-level draft head (EAGLE, Li et al. 2024; EAGLE-3, Li et al. 2025): one decoder layer
of the target's family (`llama.Block`) that predicts the target's next hidden state from its
current one and the next token, drafting with the target's embedding and a vocabulary head.

Notation: the target's features f_j at position j are hidden states of its layers
(`HeadConfig.feature_layers`, numbered as Hugging Face's `hidden_states`: EAGLE reads the last
layer's output after the final norm, index L; EAGLE-3 the residual stream entering layers
(2, L // 2, L - 3), concatenated). The head works on a D-wide "hidden" g: g_j = fc(f_j) for a
target feature, g_j = h_j (the head's own output) for a feature it predicted itself.

The head's entry at position j is computed from (g_{j-1}, t_j), the hidden of the previous
position and this position's token, so that it depends only on tokens <= j (the page property
prefix sharing relies on; position 0 has no previous hidden and reads g = 0). Its output h_j
approximates the target's hidden at j, whose logits give the token after j:

  EAGLE:   x = W_e e(t_j) + g_{j-1} + b         (fc over [embedding; feature] split in two:
           h = Block(x), no input norm           g = W_f f, so the store holds W_f f)
           logits = target's LM head(h)          (no norm: f is already the normed last hidden)
           next g = W_f h
  EAGLE-3: a = [input_norm(e(t_j)); hidden_norm(g_{j-1})]    (2D wide)
           h = g_{j-1} + o(attention(qkv(a))), then the MLP  (residual: g, or hidden_norm(g)
           logits = lm_head(norm(h)) over the draft vocabulary   with norm_before_residual)
           next g = h                                         draft id d is target id d2t[d]

`EagleHead` holds the head's own weights; the target's embedding and LM head are the target's
arrays (`llama.Llama.embed_rows`, `llama.Llama.head`), never copied.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig, _check_fields
from jaxinfer.model.batch import StepBatch
from jaxinfer.model.llama import Block, Llama, _cast, _param, rms_norm
from jaxinfer.model.params import expected_shapes, fuse_layer

KINDS = ("eagle", "eagle3")


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high features of an L-layer target: the residual stream entering
    layers 2, L // 2 and L - 3 (clamped into [0, L - 1] for very shallow targets)."""
    return tuple(min(max(i, 0), num_layers - 1)
                 for i in (2, num_layers // 2, num_layers - 3))  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadConfig:
    """A draft head (module doc).

    kind: "eagle" (fc over [embedding; last normed hidden], the target's LM head) or "eagle3"
      (fused features, [embedding; hidden] attention input, its own norm and LM head over a
      draft vocabulary of `draft_vocab_size` tokens mapped to the target's by `d2t`).
    layer: the decoder layer's shapes and block features (num_layers 1; vocab_size the
      target's); its embed_dim D is the head's width.
    target_dim: the target's width D_t; feature_layers: the target's layers it reads.
    fc_bias: EAGLE's fc has a bias. norm_before_residual: EAGLE-3's residual is the normed
      hidden. own_embed: the head has its own embedding [V, D] (else it reads the target's,
      which needs D = D_t).
    """

    kind: str
    layer: ModelConfig
    target_dim: int
    feature_layers: tuple[int, ...]
    draft_vocab_size: int
    fc_bias: bool = False
    norm_before_residual: bool = False
    own_embed: bool = False

    def __post_init__(self):
        _check_fields(self)
        c = self.layer
        if self.kind not in KINDS:
            raise ValueError(f"draft head kind={self.kind!r} must be one of {KINDS}")
        if c.num_layers != 1:
            raise ValueError(f"a draft head has one decoder layer; got num_layers="
                             f"{c.num_layers}")
        if not self.feature_layers:
            raise ValueError("a draft head reads at least one target layer (feature_layers)")
        if self.kind == "eagle":
            if len(self.feature_layers) != 1:
                raise ValueError(f"an EAGLE head reads one target layer; got feature_layers="
                                 f"{self.feature_layers}")
            if self.target_dim != c.embed_dim or self.draft_vocab_size != c.vocab_size:
                raise ValueError(
                    f"an EAGLE head feeds its output back through fc and drafts with the "
                    f"target's LM head: it needs target_dim={self.target_dim} == embed_dim="
                    f"{c.embed_dim} and draft_vocab_size={self.draft_vocab_size} == "
                    f"vocab_size={c.vocab_size}")
        if not 1 <= self.draft_vocab_size <= c.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, "
                             f"{c.vocab_size}] (the target's vocabulary)")
        if not self.own_embed and self.target_dim != c.embed_dim:
            raise ValueError(f"a head of width {c.embed_dim} cannot read the target's "
                             f"embeddings of width {self.target_dim}: it needs its own "
                             "(own_embed)")

    @property
    def feature_dim(self) -> int:
        """The width of the target features fc reads: F x D_t."""
        return len(self.feature_layers) * self.target_dim

    @property
    def qkv_in(self) -> int:
        """The attention input's width: [embedding; hidden] for EAGLE-3, else D."""
        return 2 * self.layer.embed_dim if self.kind == "eagle3" else self.layer.embed_dim

    @classmethod
    def for_target(cls, target: ModelConfig, *, kind: str = "eagle3",
                   draft_vocab_size: int | None = None) -> HeadConfig:
        """A head shaped like one layer of `target` (the layout `scripts/train_draft_head.py`
        trains): the first layer's block features, a full-attention layer, float weights."""
        layer = dataclasses.replace(
            target, num_layers=1, sliding_window=None, sliding_window_pattern=None,
            rope_local=None, rope=target.layer_rope(target.num_layers - 1), weight_dtype=None,
            int8_group_size=0, scan_layers=False, tie_embeddings=True)
        layers = (target.num_layers,) if kind == "eagle" else eagle3_feature_layers(
            target.num_layers)
        return cls(kind=kind, layer=layer, target_dim=target.embed_dim, feature_layers=layers,
                   draft_vocab_size=draft_vocab_size or target.vocab_size)


def head_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Canonical parameter name -> shape of a head: the layer's (`params.expected_shapes`
    names under "layers.0.", q/k/v over `qkv_in`), and fc [F D_t, D]; EAGLE: fc_embed [D, D],
    fc_bias [D]; EAGLE-3: hidden_norm [D], norm [D], lm_head [D, V_d], d2t [V_d] (target ids);
    own_embed: embed [V, D]."""
    c = config.layer
    d = c.embed_dim
    shapes = {k: v for k, v in expected_shapes(c).items() if k.startswith("layers.0.")}
    for name in ("q", "k", "v"):
        shapes[f"layers.0.{name}"] = (config.qkv_in, *shapes[f"layers.0.{name}"][1:])
    shapes["fc"] = (config.feature_dim, d)
    if config.kind == "eagle":
        shapes["fc_embed"] = (d, d)
        if config.fc_bias:
            shapes["fc_bias"] = (d,)
    else:
        shapes.update(hidden_norm=(d,), norm=(d,), lm_head=(d, config.draft_vocab_size),
                      d2t=(config.draft_vocab_size,))
    if config.own_embed:
        shapes["embed"] = (c.vocab_size, d)
    return shapes


def check_head_params(config: HeadConfig, params: dict) -> None:
    """Raises ValueError naming the first missing, unexpected or misshapen tensor, or a d2t
    entry outside the target's vocabulary."""
    shapes = head_shapes(config)
    for name, shape in shapes.items():
        if name not in params:
            raise ValueError(f"draft head tensor {name!r} {shape} is missing")
        if tuple(np.shape(params[name])) != shape:
            raise ValueError(f"draft head tensor {name!r} has shape "
                             f"{tuple(np.shape(params[name]))}, expected {shape}")
    extra = sorted(set(params) - set(shapes))
    if extra:
        raise ValueError(f"unexpected draft head tensor {extra[0]!r} (expected only "
                         f"{sorted(shapes)})")
    if "d2t" in params and not isinstance(params["d2t"], jax.ShapeDtypeStruct):
        d2t = np.asarray(params["d2t"])
        bad = np.flatnonzero((d2t < 0) | (d2t >= config.layer.vocab_size))
        if bad.size:
            raise ValueError(f"draft head tensor 'd2t' maps draft id {bad[0]} to {d2t[bad[0]]}, "
                             f"outside the target's vocabulary [0, {config.layer.vocab_size})")


def check_head_fits(config: HeadConfig, target: ModelConfig) -> None:
    """Raises ValueError naming the mismatch unless a head of `config` drafts for `target`:
    its vocabulary, the width of the target's features and embeddings, its feature layers."""
    if config.layer.vocab_size != target.vocab_size:
        raise ValueError(f"the draft head's vocab_size={config.layer.vocab_size} differs from "
                         f"the target's {target.vocab_size}: the head was made for another "
                         "model")
    if config.target_dim != target.embed_dim:
        raise ValueError(f"the draft head reads features of width {config.target_dim}; the "
                         f"target's embed_dim is {target.embed_dim}")
    bad = [f for f in config.feature_layers if not 0 <= f <= target.num_layers]
    if bad:
        raise ValueError(f"the draft head reads target layer {bad[0]}; the target has "
                         f"{target.num_layers} (valid: 0..{target.num_layers})")


class VocabMap(nnx.Variable):
    """An integer table of the head (EAGLE-3's draft id -> target id): state, not a weight."""


class EagleHead(nnx.Module):
    """The draft head (module doc). Build with `EagleHead(config, params)` from canonical params
    (`head_shapes`; checked by `check_head_params`)."""

    def __init__(self, config: HeadConfig, params: dict):
        check_head_params(config, params)
        self.config = config
        c = config.layer
        self.block = Block(c, fuse_layer(c, params, 0), c.layer_kind(0))
        dt = np.dtype(jnp.dtype(c.dtype))
        self.fc = _param(_cast(params["fc"], dt), (None, "embed"))
        if config.kind == "eagle":
            self.fc_embed = _param(_cast(params["fc_embed"], dt), (None, "embed"))
            if config.fc_bias:
                self.fc_bias = _param(_cast(params["fc_bias"], np.float32), ("norm",))
        else:
            self.hidden_norm = _param(_cast(params["hidden_norm"], np.float32), ("norm",))
            self.norm = _param(_cast(params["norm"], np.float32), ("norm",))
            self.lm_head = _param(_cast(params["lm_head"], dt), ("embed", "vocab"))
            d2t = params["d2t"]
            d2t = (jax.ShapeDtypeStruct(d2t.shape, np.int32) if isinstance(
                d2t, jax.ShapeDtypeStruct) else np.asarray(d2t, np.int32))
            self.d2t = VocabMap(d2t, out_sharding=(None,), eager_sharding=False)
        if config.own_embed:
            self.embed = _param(_cast(params["embed"], dt), ("vocab", "embed"))

    @classmethod
    def abstract(cls, config: HeadConfig) -> EagleHead:
        """The head with `jax.ShapeDtypeStruct` weights (a restore target, `nnx.eval_shape`)."""
        return cls(config, {name: jax.ShapeDtypeStruct(shape, np.int32 if name == "d2t"
                                                       else np.float32)
                            for name, shape in head_shapes(config).items()})

    # ----- the pieces -----------------------------------------------------------------------
    def embed_rows(self, target: Llama, tokens: jax.Array) -> jax.Array:
        """e(t) [..., D] of token ids: the head's own embedding, else the target's."""
        if self.config.own_embed:
            return self.embed[...][tokens].astype(jnp.dtype(self.config.layer.dtype))
        return target.embed_rows(tokens)

    def project(self, feats: jax.Array) -> jax.Array:
        """The hidden g [N, D] of target features feats [N, F, D_t] (fc's feature part)."""
        flat = feats.reshape(feats.shape[0], -1).astype(self.fc.dtype)
        return jnp.einsum("NX,XD->ND", flat, self.fc[...])

    def next_hidden(self, h: jax.Array) -> jax.Array:
        """The hidden g [N, D] the next position reads from this one's output h [N, D]."""
        if self.config.kind == "eagle":
            return jnp.einsum("...D,DE->...E", h.astype(self.fc.dtype), self.fc[...])
        return h

    def inputs(self, e: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(the attention's input [N, qkv_in], the residual [N, D]) of embeddings e and the
        previous position's hidden g, both [N, D]."""
        if self.config.kind == "eagle":
            x = jnp.einsum("ND,DE->NE", e.astype(self.fc_embed.dtype), self.fc_embed[...]) + g
            if self.config.fc_bias:
                x = x + self.fc_bias[...].astype(x.dtype)
            return x, x
        hidden = self._norm(g, self.hidden_norm)
        embeds = self._norm(e, self.block.attn_norm)
        residual = hidden if self.config.norm_before_residual else g
        return jnp.concatenate([embeds, hidden], axis=-1), residual.astype(g.dtype)

    def _norm(self, x: jax.Array, weight) -> jax.Array:
        c = self.config.layer
        return rms_norm(x, weight[...], c.rms_norm_eps, plus_one=c.norm_plus_one).astype(
            x.dtype)

    def __call__(self, e: jax.Array, g: jax.Array, batch: StepBatch, k_pages, v_pages
                 ) -> tuple[jax.Array, object, object]:
        """The head's layer over the step's rows: e, g [N, D] (each row's embedding and the
        hidden of its previous position), the layer's K/V written to and read from the head's
        pool k_pages, v_pages [K, pages, page_size, H]. Returns (h [N, D], k_pages, v_pages)."""
        attn_in, residual = self.inputs(e, g)
        attn, k_pages, v_pages = self.block.attend(attn_in, batch, k_pages, v_pages)
        return self.block.out_and_mlp(residual, attn), k_pages, v_pages

    def logits(self, h: jax.Array, target: Llama) -> jax.Array:
        """f32[..., V_d] over the draft vocabulary (EAGLE: the target's whole vocabulary,
        through its LM head) of outputs h [..., D]."""
        if self.config.kind == "eagle":
            return target.head(h)
        x = self._norm(h, self.norm)
        return jnp.einsum("...D,DV->...V", x, self.lm_head[...],
                          preferred_element_type=jnp.float32).astype(jnp.float32)

    def target_ids(self, draft_ids: jax.Array) -> jax.Array:
        """The target's token ids i32[...] of draft-vocabulary ids."""
        if self.config.kind == "eagle":
            return draft_ids
        return jnp.asarray(self.d2t[...])[draft_ids]

    def to_target_probs(self, q: jax.Array) -> jax.Array:
        """A distribution over the draft vocabulary f32[..., V_d] as one over the target's
        f32[..., V] (zero on the tokens the head cannot draft)."""
        if self.config.kind == "eagle":
            return q
        vocab = self.config.layer.vocab_size
        full = jnp.zeros(q.shape[:-1] + (vocab,), q.dtype)
        return full.at[..., jnp.asarray(self.d2t[...])].set(q)


def head_params(head: EagleHead) -> dict[str, np.ndarray]:
    """The canonical params (`head_shapes`) of a float head, f32 numpy: the inverse of
    `EagleHead(config, params)` (the layer's fused qkv, its biases and gate_up split back)."""
    c = head.config.layer
    block = head.block
    qkv = np.asarray(block.qkv[...], np.float32)  # [D_in, K, G + 2, H]
    g = c.q_per_kv
    out = {"layers.0.q": qkv[:, :, :g].reshape(qkv.shape[0], c.num_q_heads, c.head_dim),
           "layers.0.k": qkv[:, :, g], "layers.0.v": qkv[:, :, g + 1],
           "layers.0.o": np.asarray(block.o[...], np.float32),
           "layers.0.down": np.asarray(block.down[...], np.float32)}
    gate_up = np.asarray(block.gate_up[...], np.float32)
    out["layers.0.gate"], out["layers.0.up"] = gate_up[0], gate_up[1]
    if c.qkv_bias:  # fused [K, G + 2, H] (`params.fuse_layer`)
        bias = np.asarray(block.qkv_bias[...], np.float32)
        out["layers.0.q_bias"] = bias[:, :g].reshape(c.num_q_heads, c.head_dim)
        out["layers.0.k_bias"], out["layers.0.v_bias"] = bias[:, g], bias[:, g + 1]
    for name in head_shapes(head.config):
        if name.startswith("layers.0.") and name not in out:
            out[name] = np.asarray(getattr(block, name.removeprefix("layers.0."))[...],
                                   np.float32)
        elif not name.startswith("layers.0."):
            dtype = np.int32 if name == "d2t" else np.float32
            out[name] = np.asarray(getattr(head, name)[...], dtype)
    return out
