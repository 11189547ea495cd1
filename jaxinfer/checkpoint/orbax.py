"""Orbax checkpoints of the model's own state, restored straight into their shardings.

A GGUF or HF checkpoint holds canonical per-tensor params; loading one builds the whole model on
the host (dequantize, transpose, fuse qkv/gate_up, cast) before `steps.split_model` places it.
An orbax checkpoint holds what `split_model` returns instead: the fused, einsum-native,
already-cast arrays of `Llama`, one orbax array per leaf. `load_orbax` restores each leaf into
a `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` target computed from an abstract model
(`Llama.abstract`: shapes and logical axes, nothing allocated) and the sharding rules, so orbax
(tensorstore) reads, per device, only the slice that device holds (replicated arrays: the whole
array, once per distinct slice) and assembles the global `jax.Array` from those shards: no array
is ever whole on one device or on the host unless its sharding says it is replicated.

Layout of a checkpoint directory:

    jaxinfer_orbax.json   the marker: format, version, dtype, source, array count and bytes
                          (written last: a directory without it is not a complete checkpoint)
    config.json           the ModelConfig (`config_to_dict`; RopeConfig nested)
    state/                orbax StandardCheckpointer: {"embed", "layers": {"0": {...}}, ...};
                          a scanned model's (`ModelConfig.scan_layers`): {"layers": {"global":
                          {...}}, ...}, each kind's layers stacked

The stored layout of the layers is the config's; a restore into the other layout
(`restore_model(scan_layers=...)`) reads one weight of every layer of a kind at a time and
stacks (or splits) it on the devices, so it holds at most that weight twice beside the model.
    tokenizer/            tokenizer.json, tokenizer_config.json, generation_config.json
                          (`Tokenizer.save_hf`), when the source had a tokenizer

Storage chunks: the head axes (q_heads, kv_heads) are stored one head per chunk, a mixture's
experts one expert per chunk, and every chunk is at most CHUNK_BYTES (orbax splits the largest
axis first: vocab, ffn), so a device's slice of a tensor- or expert-parallel split touches only
its own chunks, and a reader never decodes more than one chunk's bytes to extract a slice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil

import jax

from jaxinfer import families
from jaxinfer.checkpoint.hf import read_json
from jaxinfer.config import ModelConfig, RopeConfig

MARKER = "jaxinfer_orbax.json"
FORMAT = "jaxinfer-orbax"
VERSION = 1
CONFIG_FILE = "config.json"
STATE_DIR = "state"
TOKENIZER_DIR = "tokenizer"
CHUNK_BYTES = 64 << 20  # largest stored chunk
HEAD_AXES = ("q_heads", "kv_heads", "expert")  # stored one head (one expert) per chunk


def config_to_dict(config: ModelConfig) -> dict:
    """ModelConfig -> a JSON-able dict (RopeConfigs nested under "rope" and "rope_local")."""
    return dataclasses.asdict(config)


def config_from_dict(data: dict) -> ModelConfig:
    """Inverse of `config_to_dict`; unknown keys raise ValueError naming them."""
    data = dict(data)
    rope = dict(data.pop("rope", {}))
    local = data.pop("rope_local", None)
    for cls, fields in ((ModelConfig, data), (RopeConfig, rope), (RopeConfig, local or {})):
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(fields) - known)
        if bad:
            raise ValueError(f"{cls.__name__}: unknown key(s) {bad}; valid: {sorted(known)}")
    return ModelConfig(**data, rope=RopeConfig(**rope),
                       rope_local=None if local is None else RopeConfig(**local))


def is_orbax_dir(path: str | os.PathLike | None) -> bool:
    """Whether `path` is a directory holding a jaxinfer orbax checkpoint (its marker file)."""
    return path is not None and os.path.isfile(os.path.join(os.fspath(path), MARKER))


def read_marker(path: str) -> dict:
    """The marker of the checkpoint at `path`; clear errors for anything else."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"orbax checkpoint {path} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a directory; an orbax checkpoint is a directory "
                         f"made by scripts/convert_checkpoint.py")
    if not os.path.isfile(os.path.join(path, MARKER)):
        partial = os.path.isdir(os.path.join(path, STATE_DIR))
        raise ValueError(
            f"{path} is not a jaxinfer orbax checkpoint: no {MARKER}"
            + (" (it has a state/ folder: an interrupted conversion? convert again)"
               if partial else "; make one with scripts/convert_checkpoint.py"))
    marker = read_json(os.path.join(path, MARKER))
    if not isinstance(marker, dict) or (marker.get("format"), marker.get("version")) != (
            FORMAT, VERSION):
        got = (f"format {marker.get('format')!r} version {marker.get('version')!r}"
               if isinstance(marker, dict) else f"a JSON {type(marker).__name__}")
        raise ValueError(f"{path}/{MARKER}: {got}; this jaxinfer reads {FORMAT!r} "
                         f"version {VERSION}")
    for name in (CONFIG_FILE, STATE_DIR):
        if not os.path.exists(os.path.join(path, name)):
            raise FileNotFoundError(f"orbax checkpoint {path} is missing {name}")
    return marker


def read_config(path: str) -> ModelConfig:
    read_marker(path)
    config_path = os.path.join(path, CONFIG_FILE)
    try:
        return config_from_dict(read_json(config_path))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{config_path}: not a jaxinfer model config ({e})") from None


class _NoOrbaxInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "orbax" not in record.pathname


@contextlib.contextmanager
def _quiet_orbax():
    """orbax logs each step of a save or restore at INFO (through absl, which an absl app prints
    to stderr); keep only its warnings and errors."""
    logger, quiet = logging.getLogger("absl"), _NoOrbaxInfo()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _logical_axes(model) -> dict:
    """The logical axes of every leaf of `split_model(model)[1]` (same nested dict)."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    _, state = nnx.split(model)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, P))


def source_dtype(ckpt) -> str:
    """The model dtype a conversion keeps by default: "bfloat16" for a bf16 source (HF), else
    "float32" (GGUF dequantizes to f32; an f16 source is widened, which is exact)."""
    import ml_dtypes

    embed = ckpt.params["embed"]  # a quant.QTensor after a quantized load: no float dtype
    return "bfloat16" if getattr(embed, "dtype", None) == ml_dtypes.bfloat16 else "float32"


def save_orbax(ckpt, path: str, *, dtype: str | None = None, scan_layers: bool = False,
               overwrite: bool = False) -> dict:
    """Write `ckpt` (a `weights.Checkpoint`) as an orbax checkpoint directory at `path`.

    The model is built on the host (`Llama(config, params)`: fused, cast to `dtype`, default
    `source_dtype(ckpt)`; norms stay f32; `scan_layers`: each kind's layers stacked, the
    scanned layout) and its params are saved from host numpy arrays, so the host needs about
    twice the model's bytes of memory, and no accelerator.
    The tokenizer is saved too when the source has one (a GGUF's metadata; an HF directory's
    tokenizer.json). Returns the marker dict (dtype, num_arrays, bytes, source, ...).
    """
    import orbax.checkpoint as ocp
    from flax import nnx

    from jaxinfer.model.llama import Llama

    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path) and os.listdir(path):
        ours = any(os.path.exists(os.path.join(path, n)) for n in (MARKER, STATE_DIR))
        if not (overwrite and ours):
            raise FileExistsError(
                f"{path} exists and is not empty; " + ("pass overwrite=True to replace it" if ours
                                                       else "it is not an orbax checkpoint, so "
                                                       "it is never replaced: pick another path"))
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)
    config = dataclasses.replace(ckpt.config, dtype=dtype or source_dtype(ckpt),
                                 scan_layers=scan_layers)
    model = Llama(config, ckpt.params)
    _, state = nnx.split(model)
    params = nnx.to_pure_dict(state)  # host numpy arrays
    axes = _logical_axes(model)

    def save_args(axes_of_leaf):
        heads = tuple(i for i, a in enumerate(axes_of_leaf) if a in HEAD_AXES)
        return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES, shard_axes=heads)

    args = jax.tree.map(save_args, axes, is_leaf=lambda x: isinstance(x, tuple))
    with _quiet_orbax(), ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(path, STATE_DIR), params, save_args=args)
        checkpointer.wait_until_finished()
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config_to_dict(config), f, indent=1)
    tokenizer = _source_tokenizer(ckpt)
    if tokenizer is not None:
        tokenizer.save_hf(os.path.join(path, TOKENIZER_DIR))
    leaves = jax.tree.leaves(params)
    marker = {"format": FORMAT, "version": VERSION, "dtype": config.dtype,
              "source": ckpt.path, "source_format": ckpt.format,
              "num_arrays": len(leaves), "bytes": int(sum(x.nbytes for x in leaves)),
              "tokenizer": tokenizer is not None}
    with open(os.path.join(path, MARKER), "w") as f:  # last: the checkpoint is complete
        json.dump(marker, f, indent=1)
    return marker


def _source_tokenizer(ckpt):
    from jaxinfer.checkpoint.tokenizer import Tokenizer

    template = families.family(ckpt.config.arch).chat_template
    if ckpt.format == "gguf":
        return Tokenizer.from_gguf_metadata(ckpt.metadata, default_chat_template=template)
    folder = ckpt.path if os.path.isdir(ckpt.path) else os.path.dirname(ckpt.path)
    if folder and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return Tokenizer.from_hf_dir(folder, default_chat_template=template)
    return None


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None when it was converted without one."""
    from jaxinfer.checkpoint.tokenizer import Tokenizer

    folder = os.path.join(os.fspath(path), TOKENIZER_DIR)
    return Tokenizer.from_hf_dir(folder) if os.path.isdir(folder) else None


def _default_sharding() -> jax.sharding.Sharding:
    device = jax.config.jax_default_device or jax.local_devices()[0]
    if isinstance(device, str):  # a platform name
        device = jax.local_devices(backend=device)[0]
    return jax.sharding.SingleDeviceSharding(device)


def restore_targets(model, mesh=None) -> dict:
    """`jax.ShapeDtypeStruct(shape, dtype, sharding)` for every leaf of `split_model(model)[1]`:
    on `mesh` by the sharding rules (`sharding.param_shardings`), else on the default device.
    A model whose kv heads the engine will duplicate for `mesh` restores its kv-head arrays
    split another way (`sharding.narrow_kv_rules`), never whole on every chip."""
    from flax import nnx

    from jaxinfer.model.kv_heads import kv_head_copies, model_axis
    from jaxinfer.sharding import RULES, narrow_kv_rules, param_shardings

    values = nnx.to_pure_dict(nnx.split(model)[1])
    if mesh is None:
        shardings = jax.tree.map(lambda _: _default_sharding(), values)
    else:
        widened = kv_head_copies(model.config, model_axis(mesh)) > 1
        shardings = param_shardings(model, mesh, narrow_kv_rules if widened else RULES)
    return jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                        values, shardings)


def _check_stored(path: str, stored, targets) -> None:
    """The stored arrays must be exactly the target's leaves, with its shapes."""
    def flat(tree):  # orbax stores the layer keys 0, 1, ... as "0", "1", ...
        return {".".join(str(getattr(k, "key", k)) for k in path): v
                for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}

    flat_stored, flat_want = flat(stored), flat(targets)
    missing = sorted(set(flat_want) - set(flat_stored))
    extra = sorted(set(flat_stored) - set(flat_want))
    if missing or extra:
        raise ValueError(f"orbax checkpoint {path} does not match its config.json: missing "
                         f"arrays {missing[:5]}, unexpected arrays {extra[:5]}")
    for name, want in flat_want.items():
        if tuple(flat_stored[name].shape) != tuple(want.shape):
            raise ValueError(f"orbax checkpoint {path}: array {name} has shape "
                             f"{tuple(flat_stored[name].shape)}, expected {tuple(want.shape)}")


def load_orbax(path: str, *, mesh=None, dtype: str | None = None,
               scan_layers: bool | None = None):
    """Restore the orbax checkpoint at `path` -> (Llama, ModelConfig, Tokenizer or None).

    Every weight is restored straight into its target sharding: on `mesh` by the sharding rules
    (each device reads only its slice), else onto the default device. `dtype` ("float32" /
    "bfloat16", default: the stored dtype) casts the matrices while reading; norms stay f32.
    `scan_layers`: the layout of the model's layers (None: the stored one; the other one is
    restored a weight at a time, module doc). The model's leaves are already-placed
    `jax.Array`s: `steps.split_model(model, mesh)` and the engine keep them as they are
    (`jax.device_put` of an array already in its sharding is a no-op).
    """
    model, config = restore_model(path, mesh=mesh, dtype=dtype, scan_layers=scan_layers)
    return model, config, load_tokenizer(path)


def restore_model(path: str, *, mesh=None, dtype: str | None = None,
                  scan_layers: bool | None = None):
    """`load_orbax` without the tokenizer: (Llama, ModelConfig)."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from jaxinfer.model.llama import Llama

    path = os.path.abspath(os.fspath(path))
    stored_config = read_config(path)
    if dtype is not None:
        stored_config = dataclasses.replace(stored_config, dtype=dtype)
    config = stored_config if scan_layers is None else dataclasses.replace(
        stored_config, scan_layers=scan_layers)
    if mesh is not None:
        config.check_mesh(dict(mesh.shape))
    abstract = Llama.abstract(config)
    graphdef, _ = nnx.split(abstract)
    targets = restore_targets(abstract, mesh)
    stored_targets = (targets if config == stored_config
                      else restore_targets(Llama.abstract(stored_config), mesh))
    state_dir = os.path.join(path, STATE_DIR)
    with _quiet_orbax(), ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(state_dir).item_metadata
        _check_stored(path, stored.tree if stored is not None else {}, stored_targets)
        if config == stored_config:
            params = checkpointer.restore(state_dir, targets)
        else:
            params = _restore_relayout(state_dir, config, targets, stored_targets)
    return nnx.merge(graphdef, params), config


def _restore_relayout(state_dir: str, config: ModelConfig, targets: dict,
                      stored_targets: dict) -> dict:
    """The params of `targets` (one layout of the layers) from a checkpoint stored in the other
    (`stored_targets`): the arrays outside the layers as they are, then, per kind and weight,
    every layer's copy of that weight, stacked or split on the devices into its targets'
    shardings (module doc)."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from jaxinfer.model.layers import layer_slots

    def restore(item):
        args = ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True)
        return ocp.PyTreeCheckpointer().restore(state_dir, args=args)

    params = restore({k: v for k, v in targets.items() if k != "layers"})
    params["layers"] = {}
    slots = layer_slots(config, (), stacked=True)
    for kind in dict.fromkeys(slot.kind for slot in slots):
        layers = [i for i, slot in enumerate(slots) if slot.kind == kind]
        template = targets["layers"][kind if config.scan_layers else layers[0]]
        for path, _ in jax.tree_util.tree_flatten_with_path(template)[0]:
            keys = tuple(k.key for k in path)
            if config.scan_layers:  # stored one array per layer: stack them
                item = {i: _nest(keys, _at(stored_targets["layers"][i], keys)) for i in layers}
                parts = restore({"layers": item})["layers"]
                whole = _at(targets["layers"][kind], keys)
                value = jax.jit(lambda xs: jnp.stack(xs), out_shardings=whole.sharding)(
                    [_at(parts[i], keys) for i in layers])
                _put_at(params["layers"].setdefault(kind, {}), keys, value)
                del parts
            else:  # stored stacked: split into one array per layer
                item = {kind: _nest(keys, _at(stored_targets["layers"][kind], keys))}
                stack = _at(restore({"layers": item})["layers"][kind], keys)
                shardings = [_at(targets["layers"][i], keys).sharding for i in layers]
                rows = jax.jit(lambda x: list(x), out_shardings=shardings)(stack)
                for i, row in zip(layers, rows):
                    _put_at(params["layers"].setdefault(i, {}), keys, row)
                del stack
    return params


def _at(tree, keys: tuple):
    """tree[keys[0]][keys[1]]..."""
    for k in keys:
        tree = tree[k]
    return tree


def _nest(keys: tuple, leaf) -> dict:
    """{keys[0]: {keys[1]: ... leaf}}: the one-leaf tree orbax's partial restore reads."""
    for k in reversed(keys):
        leaf = {k: leaf}
    return leaf


def _put_at(tree: dict, keys: tuple, value) -> None:
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value
