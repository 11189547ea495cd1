"""The model's parameters: canonical names and shapes, and the fused layout the model stores.

Canonical params are what every checkpoint loader produces (`jaxinfer.checkpoint`), einsum-native:

  embed [V, D], final_norm [D], lm_head [D, V] (only when not tied),
  layers.{i}.attn_norm [D], q [D, N, H], k [D, K, H], v [D, K, H], o [N, H, D], mlp_norm [D],
  gate [D, F], up [D, F], down [F, D], and with `qkv_bias`: q_bias [N, H], k_bias [K, H],
  v_bias [K, H]; with `qk_norm`: q_norm [H], k_norm [H]; with `post_norms`: post_attn_norm [D],
  post_mlp_norm [D]; with `o_bias`: o_bias [D]; with `attention_sinks`: sinks [N].
  A mixture layer (`config.is_moe`) has instead of gate/up/down the weights of
  `jaxinfer.model.moe` (router [D, E], experts_gate_up [E, 2, D, F], experts_down [E, F, D],
  their biases), except the shared expert's, which are canonical like a dense MLP's:
  shared_gate [D, Fs], shared_up [D, Fs], shared_down [Fs, D] and shared_expert_gate [D].

`fuse_layer` turns one layer's into the arrays `Block` stores (see `jaxinfer.model.llama`).
A quantized load (`jaxinfer.checkpoint.requant`) gives the matrices as `quant.QTensor`s in the
same canonical shapes; they fuse field by field.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model import moe, quant

# The stored matrix (`config.MATRICES`, `config.TABLES`) each canonical matrix goes into; the
# router and the shared expert's gate stay float (the routing decisions hang on small logit
# differences; the gate is a vector).
STORED_IN = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gate_up", "up": "gate_up",
             "down": "down", "experts_gate_up": "experts_gate_up", "experts_down": "experts_down",
             "shared_gate": "shared_gate_up", "shared_up": "shared_gate_up",
             "shared_down": "shared_down", "embed": "embed", "lm_head": "lm_head"}


def stored_matrix(name: str) -> str | None:
    """The stored matrix canonical param `name` ("layers.3.k", "embed") is part of, whose
    storage `ModelConfig.matrix_storage` names; None for a norm, a bias or a float matrix."""
    return STORED_IN.get(name.split(".")[-1])


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical parameter name -> shape for `config`."""
    c = config
    d, n, k, h, v = c.embed_dim, c.num_q_heads, c.num_kv_heads, c.head_dim, c.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, d), "final_norm": (d,)}
    if not c.tie_embeddings:
        shapes["lm_head"] = (d, v)
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm": (d,), p + "q": (d, n, h), p + "k": (d, k, h), p + "v": (d, k, h),
            p + "o": (n, h, d), p + "mlp_norm": (d,),
        })
        shapes.update({p + name: shape for name, shape in _mlp_shapes(c, i).items()})
        if c.o_bias:
            shapes[p + "o_bias"] = (d,)
        if c.attention_sinks:
            shapes[p + "sinks"] = (n,)
        if c.qkv_bias:
            shapes.update({p + "q_bias": (n, h), p + "k_bias": (k, h), p + "v_bias": (k, h)})
        if c.qk_norm:
            shapes.update({p + "q_norm": (h,), p + "k_norm": (h,)})
        if c.post_norms:
            shapes.update({p + "post_attn_norm": (d,), p + "post_mlp_norm": (d,)})
    return shapes


def _mlp_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Canonical MLP params of `layer`: dense gate/up/down, or a mixture's (module doc)."""
    d, f = config.embed_dim, config.ffn_dim
    if not config.is_moe(layer):
        return {"gate": (d, f), "up": (d, f), "down": (f, d)}
    shapes = moe.weight_shapes(config)
    for name in ("shared_gate_up", "shared_down"):
        shapes.pop(name, None)
    if config.shared_expert_ffn_dim:
        fs = config.shared_expert_ffn_dim
        shapes.update(shared_gate=(d, fs), shared_up=(d, fs), shared_down=(fs, d))
    return shapes


def mlp_names(config: ModelConfig, layer: int) -> tuple[str, ...]:
    """The canonical MLP param names of `layer` (`expected_shapes`)."""
    return tuple(_mlp_shapes(config, layer))


def norm_names(config: ModelConfig) -> tuple[str, ...]:
    """The per-layer norm weights of `config` (f32 vectors, stored as they are)."""
    return (("attn_norm", "mlp_norm") + (("q_norm", "k_norm") if config.qk_norm else ())
            + (("post_attn_norm", "post_mlp_norm") if config.post_norms else ()))


def init_params(config: ModelConfig, seed: int = 0, scale: float = 0.05) -> dict[str, np.ndarray]:
    """Random canonical params for tests on toy configs (normal(0, scale), norms near 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def fuse_layer(config: ModelConfig, params: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """Canonical params of layer i -> the fused per-layer arrays. `jax.ShapeDtypeStruct` params
    give the fused structs (the same code, traced abstractly)."""
    names = [*norm_names(config), "q", "k", "v", "o", *mlp_names(config, i)]
    if config.qkv_bias:
        names += ["q_bias", "k_bias", "v_bias"]
    names += [name for name, on in (("o_bias", config.o_bias),
                                    ("sinks", config.attention_sinks)) if on]
    p = {name: params[f"layers.{i}.{name}"] for name in names}
    if isinstance(p["q"], quant.QTensor):
        return _fuse_quantized(config, p)
    if any(isinstance(v, jax.ShapeDtypeStruct) for v in p.values()):
        return jax.eval_shape(functools.partial(_fuse, config, jnp), p)
    return _fuse(config, np, p)


def _fuse(config: ModelConfig, xp, p: dict) -> dict:
    """fuse_layer's arithmetic with `xp` = numpy (real arrays) or jax.numpy (under eval_shape)."""
    c = config
    num_k, g, h = c.num_kv_heads, c.q_per_kv, c.head_dim
    out = {
        **_passed(p), "o": p["o"],
        # The input width from q itself: an EAGLE-3 head's layer projects [embedding; hidden].
        "qkv": xp.concatenate([p["q"].reshape(p["q"].shape[0], num_k, g, h),
                               p["k"][:, :, None], p["v"][:, :, None]], axis=2),
    }
    for prefix in ("", "shared_"):
        if prefix + "gate" in p:
            out[prefix + "gate_up"] = xp.stack([p[prefix + "gate"], p[prefix + "up"]], axis=0)
    if c.qkv_bias:
        out["qkv_bias"] = xp.concatenate([p["q_bias"].reshape(num_k, g, h),
                                          p["k_bias"][:, None], p["v_bias"][:, None]], axis=1)
    return out


def _fuse_quantized(config: ModelConfig, p: dict) -> dict:
    """`_fuse` for QTensor matrices (norms and biases stay float arrays)."""
    c = config
    num_k, g, h, d = c.num_kv_heads, c.q_per_kv, c.head_dim, c.embed_dim
    q = quant.reshape(p["q"], (d, num_k, g, h), (0,))
    k, v = (quant.reshape(p[n], (d, num_k, 1, h), (0,)) for n in ("k", "v"))
    out = {**_passed(p), "o": p["o"], "qkv": quant.join([q, k, v], axis=2, stack=False)}
    for prefix in ("", "shared_"):
        if prefix + "gate" in p:
            out[prefix + "gate_up"] = quant.join([p[prefix + "gate"], p[prefix + "up"]], axis=0,
                                                 stack=True)
    if c.qkv_bias:
        out["qkv_bias"] = np.concatenate([p["q_bias"].reshape(num_k, g, h),
                                          p["k_bias"][:, None], p["v_bias"][:, None]], axis=1)
    return out


# Params a layer stores as they are: norms, the down projections, the mixture's weights (already
# stacked and fused by the loader), biases and sinks; q/k/v and gate/up are fused by `_fuse`.
_FUSED_INPUTS = ("q", "k", "v", "o", "gate", "up", "shared_gate", "shared_up", "q_bias",
                 "k_bias", "v_bias")


def _passed(p: dict) -> dict:
    return {name: value for name, value in p.items() if name not in _FUSED_INPUTS}


def stack_layers(config: ModelConfig, params: dict, layers: Sequence[int]) -> dict:
    """The fused arrays of `layers` (layers of one kind) stacked on a new leading axis: what a
    scanned `Block` stores (`jaxinfer.model.layers`). Float arrays are written layer by layer
    into one host buffer each (the host holds one layer's fused copy beside the stack);
    quantized weights stack field by field once all are fused (`quant.join`); abstract params
    give the stacked `jax.ShapeDtypeStruct`s."""
    out: dict = {}
    quantized: dict[str, list] = {}
    for n, i in enumerate(layers):
        for name, value in fuse_layer(config, params, i).items():
            if isinstance(value, quant.QTensor):
                quantized.setdefault(name, []).append(value)
            elif isinstance(value, jax.ShapeDtypeStruct):
                out[name] = jax.ShapeDtypeStruct((len(layers), *value.shape), value.dtype)
            else:
                if n == 0:
                    out[name] = np.empty((len(layers), *value.shape), value.dtype)
                out[name][n] = value
    for name, parts in quantized.items():
        out[name] = quant.join(parts, axis=0, stack=True)
    return out
