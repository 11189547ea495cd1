"""A mixture layer's experts: checkpoint tensors <-> the stacked params the model stores.

Checkpoints hold the experts one by one (Qwen-MoE `mlp.experts.{e}.gate_proj`, Mixtral
`block_sparse_moe.experts.{e}.w1`, a GGUF's `ffn_*_exps` read expert by expert:
`jaxinfer.checkpoint.gguf`) or stacked (gpt-oss `mlp.experts.gate_up_proj` [E, D, 2F], gate and
up interleaved, and `down_proj` [E, F, D]); the family names them (`families.base.ExpertNames`).
`stack` fills the canonical stacked arrays (`jaxinfer.model.moe`: experts_gate_up [E, 2, D, F],
experts_down [E, F, D]) expert by expert into arrays allocated once at their final size, so the
host never holds a second copy of the experts: a float load copies each (memory-mapped) expert
matrix into its place, a quantized one quantizes it (`jaxinfer.checkpoint.requant`, its rows in
chunks) and writes its integers and scales into the stacked fields.
"""

from __future__ import annotations

import numpy as np

from jaxinfer import families
from jaxinfer.checkpoint import requant
from jaxinfer.config import ModelConfig
from jaxinfer.model import quant

# The canonical params `stack` makes (the rest of a mixture layer loads tensor by tensor).
STACKED = ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias")
PARTS = ("gate", "up", "down")


def _names(config: ModelConfig):
    names = families.family(config.arch).experts
    if names is None:
        raise ValueError(f"architecture {config.arch!r} has no mixture layers; num_experts="
                         f"{config.num_experts}")
    if config.expert_bias and names.stacked is None:
        raise ValueError(f"{config.arch}: expert biases are only read from stacked experts")
    return names


def hf_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor the experts of mixture layer `layer` are read
    from."""
    names = _names(config)
    e, d, f = config.num_experts, config.embed_dim, config.moe_ffn_dim
    if names.stacked is not None:
        p = f"model.layers.{layer}.{names.stacked}."
        shapes = {p + "gate_up_proj": (e, d, 2 * f), p + "down_proj": (e, f, d)}
        if config.expert_bias:
            shapes.update({p + "gate_up_proj_bias": (e, 2 * f), p + "down_proj_bias": (e, d)})
        return shapes
    part_shapes = {"gate": (f, d), "up": (f, d), "down": (d, f)}
    return {names.expert_name(layer, i, part): part_shapes[part]
            for i in range(e) for part in PARTS}


def _sources(config: ModelConfig, tensors: dict, layer: int) -> dict[str, list]:
    """part -> expert -> its matrix [out, in] (an array or view, or a `gguf.GGUFTensor`)."""
    names = _names(config)
    if names.stacked is None:
        return {part: [tensors[names.expert_name(layer, i, part)]
                       for i in range(config.num_experts)] for part in PARTS}
    p = f"model.layers.{layer}.{names.stacked}."
    gate_up, down = tensors[p + "gate_up_proj"], tensors[p + "down_proj"]
    return {"gate": [gate_up[i][:, 0::2].T for i in range(config.num_experts)],
            "up": [gate_up[i][:, 1::2].T for i in range(config.num_experts)],
            "down": [down[i].T for i in range(config.num_experts)]}


def _float(source) -> np.ndarray:
    return source.dequantized() if hasattr(source, "dequantized") else np.asarray(source)


def _quantized(source, kind: str, group: int) -> quant.QTensor:
    """One expert matrix [out, in] quantized over its input axis, transposed to [in, out]."""
    t = (source.quantized(kind, group) if hasattr(source, "quantized")
         else requant.from_array(source, kind, group))
    return quant.transpose(t, (1, 0))


def stack(config: ModelConfig, tensors: dict, layer: int, *,
          stored: ModelConfig | None = None) -> dict:
    """The canonical stacked experts of mixture layer `layer` (`STACKED`) from the HF-named
    `tensors` (module doc). `stored`: the config of quantized weights, whose
    `matrix_storage` gives each stacked matrix's kind and group (`quant.QTensor`s); None:
    float arrays of the checkpoint's dtype (f32 from a GGUF). Biases f32."""
    sources = _sources(config, tensors, layer)
    e, d, f = config.num_experts, config.embed_dim, config.moe_ffn_dim
    targets = {"experts_gate_up": ((e, 2, d, f), ("gate", "up")),
               "experts_down": ((e, f, d), ("down",))}
    out = {}
    for name, (shape, parts) in targets.items():
        if stored is not None and stored.weights in quant.QUANT_DTYPES:
            out[name] = _stack_quantized(sources, parts, shape, *stored.matrix_storage(name))
        else:
            out[name] = _stack_float(sources, parts, shape)
    if config.expert_bias:
        p = f"model.layers.{layer}.{_names(config).stacked}."
        gate_up = _float(tensors[p + "gate_up_proj_bias"]).astype(np.float32)
        out["experts_gate_up_bias"] = np.ascontiguousarray(
            gate_up.reshape(e, f, 2).transpose(0, 2, 1))
        out["experts_down_bias"] = np.array(_float(tensors[p + "down_proj_bias"]), np.float32)
    return out


def _stack_float(sources: dict, parts: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray:
    first = _float(sources[parts[0]][0])
    out = np.empty(shape, first.dtype)
    for i in range(shape[0]):
        for j, part in enumerate(parts):
            w = first if (i, j) == (0, 0) else _float(sources[part][i])
            out[(i, j) if len(parts) > 1 else i] = w.T
    return out


def _stack_quantized(sources: dict, parts: tuple[str, ...], shape: tuple[int, ...], kind: str,
                     group: int) -> quant.QTensor:
    contract = (len(shape) - 2,)  # [E, (2,) in, out]
    group = min(group, shape[contract[0]]) if group else 0
    dtypes = {"q": np.uint8 if group else np.int8, "scale": np.float32, "zero": np.float32}
    fields = {k: np.empty(s, dtypes[k])
              for k, s in quant.field_shapes(shape, contract, kind, group).items()}
    for i in range(shape[0]):
        for j, part in enumerate(parts):
            t = _quantized(sources[part][i], kind, group)
            for k, value in t.fields().items():
                fields[k][(i, j) if len(parts) > 1 else i] = value
    return quant.QTensor(q=fields["q"], scale=fields["scale"], zero=fields.get("zero"),
                         shape=shape, contract=contract, kind=kind, group=group)


def stored_in(config: ModelConfig, layer: int) -> dict[str, str]:
    """HF name -> the stacked matrix (`STACKED`) it goes into, for every tensor `hf_shapes`
    names for the experts of mixture layer `layer` but the biases."""
    names = _names(config)
    if names.stacked is not None:
        p = f"model.layers.{layer}.{names.stacked}."
        return {p + "gate_up_proj": "experts_gate_up", p + "down_proj": "experts_down"}
    return {names.expert_name(layer, i, part): "experts_down" if part == "down"
            else "experts_gate_up" for i in range(config.num_experts) for part in PARTS}


def unstack(config: ModelConfig, params: dict, layer: int) -> dict[str, np.ndarray]:
    """Inverse of `stack` for float params: the Hugging Face tensors of layer `layer`'s
    experts (per-expert views, or gpt-oss's interleaved stacks)."""
    names = _names(config)
    p = f"layers.{layer}."
    gate_up, down = params[p + "experts_gate_up"], params[p + "experts_down"]
    if names.stacked is None:
        out = {}
        for i in range(config.num_experts):
            out[names.expert_name(layer, i, "gate")] = gate_up[i, 0].T
            out[names.expert_name(layer, i, "up")] = gate_up[i, 1].T
            out[names.expert_name(layer, i, "down")] = down[i].T
        return out
    h = f"model.layers.{layer}.{names.stacked}."
    out = {h + "gate_up_proj": _interleave(gate_up), h + "down_proj": down}
    if config.expert_bias:
        bias = params[p + "experts_gate_up_bias"]
        out[h + "gate_up_proj_bias"] = _interleave(bias)
        out[h + "down_proj_bias"] = params[p + "experts_down_bias"]
    return out


def _interleave(a: np.ndarray) -> np.ndarray:
    """[E, 2, .., F] -> [E, .., 2F] with gate (index 0) at even and up at odd columns."""
    return np.moveaxis(a, 1, -1).reshape(a.shape[0], *a.shape[2:-1], 2 * a.shape[-1])
