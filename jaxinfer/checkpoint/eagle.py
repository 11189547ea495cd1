"""Draft heads on disk in the layouts their authors publish (EAGLE, EAGLE-3; vLLM's and SGLang's
loaders read the same): a directory with the head's `config.json` (a Llama config of one hidden
layer) and its weights as `*.safetensors`, torch-style ([out, in] matrices):

  EAGLE-3: midlayer.self_attn.{q,k,v}_proj.weight [N H | K H, 2 D]   ([embedding; hidden] input)
           midlayer.self_attn.o_proj.weight [D, N H], midlayer.mlp.{gate,up,down}_proj.weight,
           midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight [D],
           fc.weight [D, 3 D_t], norm.weight [D], lm_head.weight [V_d, D],
           d2t i64[V_d] (draft id d is target id d + d2t[d]), t2d bool[V] (the target ids that
           are draft ids); config.json's draft_vocab_size, target_hidden_size (optional), and
           eagle_config.eagle_aux_hidden_state_layer_ids (optional: the target layers whose
           outputs are fused; default the inputs of layers 2, L // 2, L - 3).
  EAGLE:   layers.0.self_attn.*, layers.0.mlp.*, layers.0.post_attention_layernorm.weight (the
           layer has no input norm), fc.weight [D, 2 D] over [embedding; feature], fc.bias [D]
           (optional).
  Either, with the block features of the target's family (`HeadConfig.for_target`), which
  config.json's model_type selects: a Qwen2 head ("qwen2", `layer.qkv_bias`) has the layer's
  self_attn.{q,k,v}_proj.bias [N H | K H] too, a Qwen3 head ("qwen3", `layer.qk_norm`) its
  per-head self_attn.{q,k}_norm.weight [H]. A published head of model_type "llama" for such a
  target (what SpecForge trains for Qwen3) is a Llama layer and loads as one.

An optional embed_tokens.weight (a copy of the target's embedding, which EAGLE trains frozen) is
not loaded: the head reads the target's own, unless its width differs from the target's. A
"model." prefix on every name is accepted. Anything else missing, misshapen or extra is a
ValueError naming the tensor.

`save_draft_head` writes a head in the same layout (what `scripts/train_draft_head.py` exports),
so a head trained here loads in other servers too.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import numpy as np

from jaxinfer.checkpoint.hf import config_from_hf, read_json, read_safetensors, write_safetensors
from jaxinfer.config import ModelConfig
from jaxinfer.model.eagle import EagleHead, HeadConfig, eagle3_feature_layers, head_shapes

_MATS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
         "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
         "down": "mlp.down_proj"}


def _layer_norms(kind: str) -> dict[str, str]:
    norms = {"mlp_norm": "post_attention_layernorm"}
    if kind == "eagle3":
        norms.update(attn_norm="input_layernorm", hidden_norm="hidden_norm")
    return norms


def read_head_config(cfg: dict, names: set[str], target: ModelConfig) -> HeadConfig:
    """The `HeadConfig` of a published head's config.json dict (its tensor `names` tell EAGLE
    from EAGLE-3) for drafting on `target`."""
    eagle3 = any(n.startswith("midlayer.") for n in names) or any(
        "Eagle3" in a for a in cfg.get("architectures") or [])
    kind = "eagle3" if eagle3 else "eagle"
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"draft head num_hidden_layers={cfg['num_hidden_layers']}: only "
                         "one-layer heads are supported")
    layer = config_from_hf({**cfg, "model_type": cfg.get("model_type", "llama")})
    layer = dataclasses.replace(layer, num_layers=1, max_position=target.max_position,
                                dtype=target.dtype, tie_embeddings=True, scan_layers=False,
                                weight_dtype=None)
    target_dim = int(cfg.get("target_hidden_size") or layer.embed_dim)
    if kind == "eagle":
        return HeadConfig(kind=kind, layer=layer, target_dim=target_dim,
                          feature_layers=(target.num_layers,),
                          draft_vocab_size=layer.vocab_size, fc_bias="fc.bias" in names)
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = (tuple(int(i) + 1 for i in ids) if ids  # layer outputs: the next layers' inputs
              else eagle3_feature_layers(target.num_layers))
    return HeadConfig(kind=kind, layer=layer, target_dim=target_dim, feature_layers=layers,
                      draft_vocab_size=int(cfg.get("draft_vocab_size") or layer.vocab_size),
                      norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                      own_embed=target_dim != layer.embed_dim)


def _tensor(tensors: dict, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"draft head tensor {name!r} {shape} is missing")
    x = tensors[name]
    if tuple(x.shape) != shape:
        raise ValueError(f"draft head tensor {name!r} has shape {tuple(x.shape)}, expected "
                         f"{shape}")
    return np.asarray(x)


def params_from_published(config: HeadConfig, tensors: dict) -> dict[str, np.ndarray]:
    """Published tensors (module doc) -> canonical head params (`model.eagle.head_shapes`)."""
    c = config.layer
    d = c.embed_dim
    prefix = "midlayer." if config.kind == "eagle3" else "layers.0."
    shapes = head_shapes(config)
    used, out = set(), {}

    def take(name, shape):
        used.add(name)
        return _tensor(tensors, name, shape).astype(np.float32)

    for ours, theirs in _MATS.items():
        shape = shapes[f"layers.0.{ours}"]
        torch_shape = ((int(np.prod(shape[1:])), shape[0]) if ours in ("q", "k", "v")
                       else (shape[-1], int(np.prod(shape[:-1]))))
        out[f"layers.0.{ours}"] = take(prefix + theirs + ".weight", torch_shape).T.reshape(shape)
    for ours, theirs in _layer_norms(config.kind).items():
        key = f"layers.0.{ours}" if ours != "hidden_norm" else ours
        out[key] = take(f"{prefix}{theirs}.weight", (d,))
    if c.qkv_bias:
        for ours in ("q", "k", "v"):
            shape = shapes[f"layers.0.{ours}_bias"]
            out[f"layers.0.{ours}_bias"] = take(f"{prefix}{_MATS[ours]}.bias",
                                                (int(np.prod(shape)),)).reshape(shape)
    if c.qk_norm:
        for ours in ("q", "k"):
            out[f"layers.0.{ours}_norm"] = take(f"{prefix}self_attn.{ours}_norm.weight",
                                                (c.head_dim,))
    if config.kind == "eagle":
        out["layers.0.attn_norm"] = np.ones((d,), np.float32)  # no input norm: unused
        fc = take("fc.weight", (d, d + config.target_dim))
        out["fc_embed"], out["fc"] = fc[:, :d].T, fc[:, d:].T
        if config.fc_bias:
            out["fc_bias"] = take("fc.bias", (d,))
    else:
        out["fc"] = take("fc.weight", (d, config.feature_dim)).T
        out["norm"] = take("norm.weight", (d,))
        vd = config.draft_vocab_size
        out["lm_head"] = take("lm_head.weight", (vd, d)).T
        used.add("d2t")
        offsets = _tensor(tensors, "d2t", (vd,)).astype(np.int64)
        out["d2t"] = (np.arange(vd) + offsets).astype(np.int32)
        if "t2d" in tensors:
            used.add("t2d")
            t2d = _tensor(tensors, "t2d", (c.vocab_size,)).astype(bool)
            inside = (out["d2t"] >= 0) & (out["d2t"] < c.vocab_size)
            if not inside.all() or not t2d[out["d2t"]].all() or t2d.sum() != vd:
                raise ValueError("draft head tensors 'd2t' and 't2d' disagree: d2t must map the "
                                 f"{vd} draft ids onto exactly the target ids t2d marks")
    if config.own_embed:
        out["embed"] = take("embed_tokens.weight", (c.vocab_size, d))
    used.add("embed_tokens.weight")
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"unexpected draft head tensor {extra[0]!r} for an {config.kind} head")
    return out


def read_published(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json dict, tensors with any "model." prefix dropped) of a head directory."""
    if not os.path.isdir(path):
        raise ValueError(f"draft head {path!r} is not a directory (config.json + *.safetensors)")
    cfg = read_json(os.path.join(path, "config.json"))
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"draft head {path!r} has no *.safetensors file (a pytorch_model.bin "
                         "head needs converting to safetensors first)")
    tensors = {}
    for f in files:
        for name, x in read_safetensors(f).items():
            tensors[name.removeprefix("model.")] = x
    return cfg, tensors


def load_draft_head(path: str, target: ModelConfig) -> EagleHead:
    """The EAGLE / EAGLE-3 head stored at `path` (module doc), for drafting on `target`."""
    from jaxinfer.model.eagle import check_head_fits

    cfg, tensors = read_published(path)
    config = read_head_config(cfg, set(tensors), target)
    check_head_fits(config, target)
    return EagleHead(config, params_from_published(config, tensors))


def save_draft_head(path: str, config: HeadConfig, params: dict) -> None:
    """Writes canonical head params (`model.eagle.head_shapes`) in the published layout of
    its kind (module doc), f32, as `path`/config.json + `path`/model.safetensors."""
    c = config.layer
    os.makedirs(path, exist_ok=True)
    prefix = "midlayer." if config.kind == "eagle3" else "layers.0."
    out = {}
    for ours, theirs in _MATS.items():
        w = np.asarray(params[f"layers.0.{ours}"], np.float32)
        w = (w.reshape(w.shape[0], -1).T if ours in ("q", "k", "v")
             else w.reshape(-1, w.shape[-1]).T)
        out[prefix + theirs + ".weight"] = np.ascontiguousarray(w)
    for ours, theirs in _layer_norms(config.kind).items():
        key = f"layers.0.{ours}" if ours != "hidden_norm" else ours
        out[f"{prefix}{theirs}.weight"] = np.asarray(params[key], np.float32)
    if c.qkv_bias:
        for ours in ("q", "k", "v"):
            out[f"{prefix}{_MATS[ours]}.bias"] = np.asarray(
                params[f"layers.0.{ours}_bias"], np.float32).reshape(-1)
    if c.qk_norm:
        for ours in ("q", "k"):
            out[f"{prefix}self_attn.{ours}_norm.weight"] = np.asarray(
                params[f"layers.0.{ours}_norm"], np.float32)
    if config.kind == "eagle":
        out["fc.weight"] = np.ascontiguousarray(np.concatenate(
            [params["fc_embed"], params["fc"]], axis=0).T.astype(np.float32))
        if config.fc_bias:
            out["fc.bias"] = np.asarray(params["fc_bias"], np.float32)
    else:
        out["fc.weight"] = np.ascontiguousarray(np.asarray(params["fc"], np.float32).T)
        out["norm.weight"] = np.asarray(params["norm"], np.float32)
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"],
                                                                np.float32).T)
        d2t = np.asarray(params["d2t"], np.int64)
        out["d2t"] = d2t - np.arange(d2t.size)
        t2d = np.zeros((c.vocab_size,), bool)
        t2d[d2t] = True
        out["t2d"] = t2d
    write_safetensors(os.path.join(path, "model.safetensors"), out)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_published_config(config), f, indent=2)


def _published_config(config: HeadConfig) -> dict:
    """The head's config.json in its kind's published form."""
    c = config.layer
    # The model_type names the block's features: q/k norms are Qwen3's, q/k/v biases without
    # an o_proj bias Qwen2's (a Llama config's attention_bias would put a bias on o_proj too).
    # EAGLE-3 readers dispatch on the Llama head's class whatever the model_type.
    family = "Qwen3" if c.qk_norm else "Qwen2" if c.qkv_bias else "Llama"
    hf = {"architectures": ["LlamaForCausalLMEagle3" if config.kind == "eagle3"
                            else f"{family}ForCausalLM"],
          "model_type": family.lower(), "hidden_size": c.embed_dim, "intermediate_size": c.ffn_dim,
          "num_attention_heads": c.num_q_heads, "num_key_value_heads": c.num_kv_heads,
          "head_dim": c.head_dim, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
          "rope_theta": c.rope.theta, "vocab_size": c.vocab_size,
          "max_position_embeddings": c.max_position, "hidden_act": "silu",
          "tie_word_embeddings": False, "torch_dtype": "float32"}
    if c.qk_norm:
        hf["attention_bias"] = c.qkv_bias
    if c.rope.type != "default":
        hf["rope_scaling"] = {"rope_type": c.rope.type, "factor": c.rope.factor,
                              "low_freq_factor": c.rope.low_freq_factor,
                              "high_freq_factor": c.rope.high_freq_factor,
                              "original_max_position_embeddings": c.rope.original_max_position}
    if config.kind == "eagle3":
        hf["draft_vocab_size"] = config.draft_vocab_size
        hf["target_hidden_size"] = config.target_dim
        hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids":
                              [f - 1 for f in config.feature_layers]}
    return hf
