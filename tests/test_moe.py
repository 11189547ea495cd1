"""The mixture-of-experts MLP alone (`jaxinfer.model.moe`) against a dense reference written
plainly in numpy: every expert run on every row, each row's output the router-weighted sum of
its chosen experts'. Router variants, shared expert, expert/router biases, the clamped SwiGLU,
int8 / int4 experts, and the grouped compute (two grouped matmuls over N x k rows, never the
every-expert product)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfer.model import moe, quant
from tests.helpers import rel_err, toy_config

N = 11  # rows: not a multiple of anything


def _config(**overrides):
    base = dict(embed_dim=32, num_experts=8, experts_per_token=3, expert_ffn_dim=16)
    return toy_config(**{**base, **overrides})


def _weights(config, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: (0.3 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in moe.weight_shapes(config).items()}


def _act(gate, up, config):
    if config.activation == "swiglu_clamped":
        gate = np.minimum(gate, config.swiglu_limit)
        up = np.clip(up, -config.swiglu_limit, config.swiglu_limit)
        return (up + 1) * gate / (1 + np.exp(-config.swiglu_alpha * gate))
    return gate / (1 + np.exp(-gate)) * up


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def moe_reference(x: np.ndarray, w: dict[str, np.ndarray], config) -> np.ndarray:
    """x f32[N, D] -> f32[N, D]: every expert on every row, combined by the router."""
    c, k = config, config.experts_per_token
    logits = x @ w["router"] + (w["router_bias"] if c.router_bias else 0)
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # [N, k]
    if c.router == "topk_softmax":
        weights = _softmax(np.take_along_axis(logits, chosen, -1))
    else:
        weights = np.take_along_axis(_softmax(logits), chosen, -1)
        if c.router == "softmax_topk_norm":
            weights = weights / weights.sum(-1, keepdims=True)
    outs = []
    for e in range(c.num_experts):  # [N, D] of expert e on every row
        gu = np.einsum("nd,cdf->ncf", x, w["experts_gate_up"][e])
        if c.expert_bias:
            gu = gu + w["experts_gate_up_bias"][e]
        y = _act(gu[:, 0], gu[:, 1], c) @ w["experts_down"][e]
        outs.append(y + (w["experts_down_bias"][e] if c.expert_bias else 0))
    every = np.stack(outs, axis=1)  # [N, E, D]
    out = np.einsum("nk,nkd->nd", weights, np.take_along_axis(every, chosen[:, :, None], 1))
    if c.shared_expert_ffn_dim:
        gu = np.einsum("nd,cdf->ncf", x, w["shared_gate_up"])
        shared = _act(gu[:, 0], gu[:, 1], c) @ w["shared_down"]
        out = out + shared / (1 + np.exp(-(x @ w["shared_expert_gate"])))[:, None]
    return out


def _params(w: dict[str, np.ndarray], config, kind: str = "float32") -> dict:
    out = {}
    for name, value in w.items():
        axes, contract = moe.WEIGHTS[name]
        if contract is not None and kind != "float32":
            out[name] = quant.QuantWeight(quant.quantize(value, contract, kind, 16), axes,
                                          lambda v, _: nnx.Param(jnp.asarray(v)))
        else:
            out[name] = nnx.Param(jnp.asarray(value))
    return out


def _run(x, params, config):
    return np.asarray(jax.jit(lambda x: moe.moe_mlp(x, params, config))(jnp.asarray(x)))


@pytest.mark.parametrize("overrides", [
    dict(router="softmax_topk"),
    dict(router="softmax_topk_norm", shared_expert_ffn_dim=24),
    dict(router="topk_softmax", router_bias=True, expert_bias=True, activation="swiglu_clamped",
         swiglu_limit=1.0, experts_per_token=4),
    dict(num_experts=16, experts_per_token=1),
    dict(num_experts=4, experts_per_token=4),  # every expert chosen
], ids=["softmax_topk", "renorm_shared", "gpt_oss", "top1_of_16", "all_experts"])
def test_moe_matches_the_every_expert_reference(overrides):
    config = _config(**overrides)
    w = _weights(config)
    x = np.random.default_rng(1).standard_normal((N, config.embed_dim)).astype(np.float32)
    ours = _run(x, _params(w, config), config)
    assert rel_err(ours, moe_reference(x, w, config)) < 1e-5


def test_empty_experts_and_one_expert_taking_every_row():
    """A router that sends every row to experts 2 and 5 leaves the others' groups empty."""
    config = _config(experts_per_token=2)
    w = _weights(config)
    w["router"] = np.zeros_like(w["router"])
    w["router"][:, 2], w["router"][:, 5] = 5.0, 3.0
    x = np.abs(np.random.default_rng(2).standard_normal((N, config.embed_dim))).astype(np.float32)
    ours = _run(x, _params(w, config), config)
    assert rel_err(ours, moe_reference(x, w, config)) < 1e-5


@pytest.mark.parametrize("kind,tol", [("int8", 1e-5), ("int4", 1e-5)])
def test_quantized_experts_match_their_dequantized_reference(kind, tol):
    """int8 (per expert and output channel) and int4 (groups of 16) experts compute what the
    reference computes with the same dequantized weights."""
    config = _config(shared_expert_ffn_dim=16)
    w = _weights(config)
    params = _params(w, config, kind)
    dequant = {name: (quant.dequantize_host(quant.quantize(v, moe.WEIGHTS[name][1], kind, 16))
                      if moe.WEIGHTS[name][1] is not None else v) for name, v in w.items()}
    x = np.random.default_rng(3).standard_normal((N, config.embed_dim)).astype(np.float32)
    assert rel_err(_run(x, params, config), moe_reference(x, dequant, config)) < tol


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in its equations (loops, conds)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_the_experts_are_grouped_not_dense():
    """No product of every expert with every row anywhere in the traced program: no
    `ragged_dot` (dense under a mask on CPU and GPU in jax 0.10), and no dot with an operand or
    result holding all E experts ([E, N, ...], [N, E, F]); the experts' dots multiply rows by
    one expert's weight at a time (`pallas_kernels.grouped_matmul`)."""
    config = _config()
    params = _params(_weights(config), config)
    x = jnp.zeros((N, config.embed_dim), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x: moe.moe_mlp(x, params, config))(x)
    eqns = list(_eqns(jaxpr.jaxpr))
    assert not [e for e in eqns if e.primitive.name == "ragged_dot_general"]
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    widths = {e.outvars[0].aval.shape[-1] for e in dots}
    assert {2 * 16, config.embed_dim} <= widths, "the experts' matmuls were not found"
    for e in dots:
        shapes = [v.aval.shape for v in e.invars] + [e.outvars[0].aval.shape]
        assert all(config.num_experts not in shape[:-1] for shape in shapes), shapes


def _placed(params: dict, mesh) -> dict:
    """Every weight field committed to the sharding the rules give it on `mesh`."""
    from jax.sharding import NamedSharding

    from jaxinfer.sharding import spec_for

    def put(name, a):
        return jax.device_put(a, NamedSharding(mesh, spec_for(name, moe.WEIGHTS[name][0],
                                                              a.shape, mesh)))

    return {name: jax.tree.map(lambda a, name=name: put(name, a), value)
            for name, value in params.items()}


@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
@pytest.mark.parametrize("rows", [N, 12])
def test_expert_mesh_matches_one_device(kind, rows):
    """On data:2,expert:2,model:2 (each chip 4 of the 8 experts and half their FFN; 11 rows
    whole on every data shard, 12 split over it) the mixture with gpt-oss's biases and a shared
    expert, float or int8 / int4 (groups of 8: one per FFN half), gives one device's output:
    each pair computed on the chip holding its expert, the down bias added once, the partial
    sums all-reduced."""
    from jaxinfer.sharding import make_mesh

    config = _config(router="topk_softmax", router_bias=True, expert_bias=True,
                     activation="swiglu_clamped", swiglu_limit=1.0, shared_expert_ffn_dim=16)
    w = _weights(config)
    if kind == "float32":
        params = _params(w, config)
    else:
        params = {name: (quant.QuantWeight(quant.quantize(v, moe.WEIGHTS[name][1], kind, 8),
                                           moe.WEIGHTS[name][0],
                                           lambda v, _: nnx.Param(jnp.asarray(v)))
                         if moe.WEIGHTS[name][1] is not None else nnx.Param(jnp.asarray(v)))
                  for name, v in w.items()}
    x = np.random.default_rng(4).standard_normal((rows, config.embed_dim)).astype(np.float32)
    want = _run(x, params, config)
    mesh = make_mesh("data:2,expert:2,model:2")
    placed = _placed(params, mesh)
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(lambda x, p: moe.moe_mlp(x, p, config))(jnp.asarray(x), placed))
    assert rel_err(got, want) < 1e-6, rel_err(got, want)
