"""LoRA adapters from PEFT checkpoints: a directory with `adapter_config.json` and
`adapter_model.safetensors`, the format `peft`'s `save_pretrained` writes.

An adapter adds, to each projection it targets, scale * (x A) B: lora_A.weight [r, in],
lora_B.weight [out, r] in the checkpoint (torch Linear layout), scale = lora_alpha / r, or
lora_alpha / sqrt(r) with `use_rslora` (both per module where `rank_pattern` / `alpha_pattern`
name it, matched as peft does: the pattern is a regex that must match the end of the module's
name). The targets are the dense projections every registered family names alike
(`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `model.layers.{i}.mlp.{gate,up,down}_proj`),
any subset, rank 1 to the pool's maximum, differing per projection. Anything else an adapter
may hold (an expert's or the embedding's adapter, DoRA, LoRA biases, modules_to_save,
fan_in_fan_out) is refused with an error naming the adapter and the tensor or setting, as are
factors whose shapes do not fit the base model.

`read_peft` returns the factors in canonical form (`jaxinfer.model.lora.canonical_shapes`),
B scaled; `jaxinfer.model.lora.pack_layer` lays them out for the device pool.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np

from jaxinfer.checkpoint.hf import read_json, read_safetensors
from jaxinfer.config import ModelConfig
from jaxinfer.model.lora import TARGETS, canonical_shapes

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_TENSOR = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj"
                     r"\.lora_([AB])\.weight$")
_MODULE = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn",
           "gate": "mlp", "up": "mlp", "down": "mlp"}
# adapter_config.json settings that change what the adapter computes and are not supported:
# (key, the value that is fine)
_UNSUPPORTED = (("use_dora", False), ("lora_bias", False), ("fan_in_fan_out", False),
                ("modules_to_save", None), ("layer_replication", None),
                ("target_parameters", None), ("trainable_token_indices", None),
                ("use_qalora", False), ("bias", "none"))


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One LoRA adapter in canonical form.

    name: what requests call it.  path: its directory.  rank: the largest rank of its
    projections.  layers: layer -> target ("q" .. "down") -> (A [input axes..., r],
    B [r, output axes...] with the scale multiplied in), float32.
    """

    name: str
    path: str
    rank: int
    layers: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]

    @property
    def targets(self) -> list[str]:
        """The projections it adapts in any layer, in `TARGETS` order."""
        used = {t for factors in self.layers.values() for t in factors}
        return [t for t in TARGETS if t in used]


def read_peft(path: str, config: ModelConfig, *, name: str, max_rank: int) -> Adapter:
    """The adapter in directory `path` for a base model of `config` (module doc); ValueError
    naming the adapter and the bad file, setting or tensor if it is not one this model can run
    with ranks <= max_rank."""
    where = f"LoRA adapter {name!r} ({path})"
    files = [os.path.join(path, f) for f in (CONFIG_FILE, WEIGHTS_FILE)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"{where}: {missing[0]} does not exist; a PEFT adapter directory holds "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    settings = read_json(files[0])
    _check_settings(settings, where)
    tensors = read_safetensors(files[1])
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _TENSOR.match(key)
        if m is None or m.group(2) != _MODULE[m.group(3)]:
            raise ValueError(f"{where}: tensor {key!r} is not the adapter of a supported "
                             f"projection; supported: lora_A/lora_B of self_attn.{{q,k,v,o}}_proj "
                             f"and mlp.{{gate,up,down}}_proj of model.layers.<i>")
        layer, target = int(m.group(1)), m.group(3)
        if layer >= config.num_layers:
            raise ValueError(f"{where}: tensor {key!r} is for layer {layer}, but the base model "
                             f"has {config.num_layers} layers")
        if target in ("gate", "up", "down") and config.is_moe(layer):
            raise ValueError(f"{where}: tensor {key!r} adapts the dense MLP of layer {layer}, "
                             "which is a mixture-of-experts layer in this model")
        pairs.setdefault((layer, target), {})[m.group(4)] = np.asarray(value, np.float32)
    if not pairs:
        raise ValueError(f"{where}: {files[1]} holds no LoRA tensors")
    layers: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    rank = 0
    for (layer, target), ab in sorted(pairs.items()):
        module = f"model.layers.{layer}.{_MODULE[target]}.{target}_proj"
        a, b = _canonical(ab, config, target, module, where, max_rank)
        r = a.shape[-1]
        alpha = float(_pattern(settings.get("alpha_pattern"), module, settings["lora_alpha"]))
        scale = alpha / (math.sqrt(r) if settings.get("use_rslora") else r)
        layers.setdefault(layer, {})[target] = (a, b * np.float32(scale))
        rank = max(rank, r)
    return Adapter(name=name, path=path, rank=rank, layers=layers)


def _check_settings(settings: dict, where: str) -> None:
    if settings.get("peft_type") != "LORA":
        raise ValueError(f"{where}: peft_type={settings.get('peft_type')!r}; only LORA adapters "
                         "are supported")
    for key, fine in _UNSUPPORTED:
        value = settings.get(key, fine)
        if value != fine and value not in (None, False, [], {}):
            raise ValueError(f"{where}: {CONFIG_FILE} sets {key}={value!r}, which is not "
                             f"supported (supported: {fine!r})")
    alpha = settings.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: {CONFIG_FILE} has lora_alpha={alpha!r}; a number is needed")


def _pattern(patterns: dict | None, module: str, default):
    """peft's per-module override: the value of the first key whose regex matches the end of
    `module` (as `peft.tuners.tuners_utils` matches `rank_pattern` / `alpha_pattern`)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _canonical(ab: dict[str, np.ndarray], config: ModelConfig, target: str, module: str,
               where: str, max_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of one projection from its checkpoint tensors (A [r, in], B [out, r]) in
    canonical form (B not yet scaled), checked against the base model's shapes."""
    for part in "AB":
        if part not in ab:
            raise ValueError(f"{where}: {module}.lora_{part}.weight is missing (its "
                             f"lora_{'B' if part == 'A' else 'A'} is there)")
    a, b = ab["A"], ab["B"]
    name = f"{module}.lora_A.weight"
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(f"{where}: {name} {a.shape} and lora_B {b.shape} are not a LoRA pair "
                         "([r, in] and [out, r])")
    r = a.shape[0]
    if not 1 <= r <= max_rank:
        raise ValueError(f"{where}: {name} has rank {r}, over the pool's max_lora_rank="
                         f"{max_rank} (raise --max_lora_rank)")
    for part, t in (("A", a), ("B", b)):
        if not np.isfinite(t).all():  # its rows' outputs would all be NaN
            raise ValueError(f"{where}: {module}.lora_{part}.weight holds non-finite values")
    a_shape, b_shape = canonical_shapes(config, target, r)
    want_in, want_out = math.prod(a_shape[:-1]), math.prod(b_shape[1:])
    if a.shape[1] != want_in or b.shape[0] != want_out:
        raise ValueError(f"{where}: {name} {a.shape} / lora_B {b.shape} do not fit the base "
                         f"model's {target}_proj (in {want_in}, out {want_out}): an adapter "
                         "for another model?")
    return a.T.reshape(a_shape), b.T.reshape(b_shape)
