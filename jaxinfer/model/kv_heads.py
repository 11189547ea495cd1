"""Kv heads duplicated up to the model axis, so tensor parallelism splits them one per chip.

With K kv heads on a model axis of M > K chips, splitting the `kv_heads` axis is impossible and
`sharding.RULES` would replicate whatever carries it: the fused qkv weight and the whole KV pool
on every chip (70B's 8 kv heads on v5e-16: 40 GiB of pool per chip instead of 5). Instead, as
jax-llm-examples, MaxText and tpu-inference lay it out, each kv head is stored r = M / K times:
the model gets K' = M kv heads, each with G' = G / r of its original G query heads, so every
chip holds one kv head (its k/v projection and its pages) and the query heads that read it.

In the fused layout `qkv: [D, K, G + 2, H]` (`jaxinfer.model.llama`), kv head k's queries
g = j * G' + g' (j < r) move to the new kv head k' = k * r + j at position g', and its key and
value are copied to all r of them. Query head n = k * G + g is then k' * G' + g', still n:
the query heads keep their order (the o projection is unchanged), and n // G' = k' names a
copy of its own kv head k, so GQA attends exactly as before. The copies are written by the same
keys and values, so the pool holds r identical copies of each head, one per chip.

The rule: r = M / K when M > K, K divides M and M divides N (each copy gets whole query heads);
otherwise no copies (the rules replicate what M does not divide, as before). On an expert mesh
M is expert x model: attention is tensor parallel over both (`jaxinfer.sharding`).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.model.llama import Llama
from jaxinfer.sharding import rule_shards

log = logging.getLogger(__name__)


def kv_head_copies(config: ModelConfig, model_axis: int) -> int:
    """How many times each kv head of `config` is stored on a model axis of `model_axis` chips
    (module doc: the rule); 1 = as in the checkpoint."""
    k, n, m = config.num_kv_heads, config.num_q_heads, model_axis
    if m <= k or m % k or n % m:
        return 1
    return m // k


def model_axis(mesh) -> int:
    """The chips the kv heads split over on `mesh`: its tensor-parallel axes (`sharding.RULES`:
    model, or expert x model on an expert mesh); 1 without a mesh."""
    return rule_shards("kv_heads", mesh)


def fit_kv_heads(model: Llama, mesh) -> Llama:
    """`model` with its kv heads duplicated for `mesh` (`kv_head_copies`), or `model` itself
    when no copies are needed."""
    copies = kv_head_copies(model.config, model_axis(mesh))
    if copies == 1:
        return model
    log.info("%d kv heads stored %dx each for a %d-way model axis", model.config.num_kv_heads,
             copies, copies * model.config.num_kv_heads)
    return duplicate_kv_heads(model, copies)


def duplicate_kv_heads(model: Llama, copies: int) -> Llama:
    """A new model with each kv head of `model` stored `copies` times (module doc); the other
    weights are the same arrays. Host (numpy), device and abstract (`jax.ShapeDtypeStruct`)
    weights all work; quantized qkv fields (q, scale, zero) are rearranged alike."""
    c = model.config
    if copies < 1 or c.q_per_kv % copies:
        raise ValueError(f"copies={copies}: each kv head's {c.q_per_kv} query heads must split "
                         f"evenly over its copies; valid: divisors of {c.q_per_kv}")
    wide = dataclasses.replace(c, num_kv_heads=c.num_kv_heads * copies)
    graphdef, abstract_state = nnx.split(Llama.abstract(wide))
    params = nnx.to_pure_dict(nnx.split(model)[1])
    for layer in params["layers"].values():
        for name in ("qkv", "qkv_bias", "lora_qkv_b"):
            if name in layer:
                layer[name] = jax.tree.map(
                    lambda a: _duplicate(a, copies, c.q_per_kv), layer[name])
    nnx.replace_by_pure_dict(abstract_state, params)
    return nnx.merge(graphdef, abstract_state)


def _duplicate(a, copies: int, g: int):
    """a [..., K, G + 2, H] (a fused qkv weight, one of its quantized fields, or its bias) ->
    [..., K * copies, G / copies + 2, H] (module doc)."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.eval_shape(lambda x: duplicate_arrays(x, copies, g, jnp), a)
    return duplicate_arrays(a, copies, g, np if isinstance(a, np.ndarray) else jnp)


def duplicate_arrays(a, copies: int, g: int, xp=np):
    """`_duplicate` of an array a [..., K, G + 2, H] of module `xp` (numpy or jax.numpy)."""
    *lead, k, c, h = a.shape
    if c != g + 2:
        raise ValueError(f"expected a fused qkv array [..., K, {g + 2}, H], got {a.shape}")
    q = a[..., :g, :].reshape(*lead, k * copies, g // copies, h)
    kv = xp.repeat(a[..., g:, :], copies, axis=len(lead))  # [..., K * copies, 2, H]
    return xp.concatenate([q, kv], axis=-2)
