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
    state/                orbax StandardCheckpointer: {"embed", "layers": {"0": {...}}, ...}
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


def save_orbax(ckpt, path: str, *, dtype: str | None = None, overwrite: bool = False) -> dict:
    """Write `ckpt` (a `weights.Checkpoint`) as an orbax checkpoint directory at `path`.

    The model is built on the host (`Llama(config, params)`: fused, cast to `dtype`, default
    `source_dtype(ckpt)`; norms stay f32) and its params are saved from host numpy arrays, so
    the host needs about twice the model's bytes of memory, and no accelerator.
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
    config = dataclasses.replace(ckpt.config, dtype=dtype or source_dtype(ckpt))
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


def load_orbax(path: str, *, mesh=None, dtype: str | None = None):
    """Restore the orbax checkpoint at `path` -> (Llama, ModelConfig, Tokenizer or None).

    Every weight is restored straight into its target sharding: on `mesh` by the sharding rules
    (each device reads only its slice), else onto the default device. `dtype` ("float32" /
    "bfloat16", default: the stored dtype) casts the matrices while reading; norms stay f32.
    The model's leaves are already-placed `jax.Array`s: `steps.split_model(model, mesh)` and the
    engine keep them as they are (`jax.device_put` of an array already in its sharding is a
    no-op).
    """
    model, config = restore_model(path, mesh=mesh, dtype=dtype)
    return model, config, load_tokenizer(path)


def restore_model(path: str, *, mesh=None, dtype: str | None = None):
    """`load_orbax` without the tokenizer: (Llama, ModelConfig)."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from jaxinfer.model.llama import Llama

    path = os.path.abspath(os.fspath(path))
    config = read_config(path)
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    if mesh is not None:
        config.check_mesh(dict(mesh.shape))
    abstract = Llama.abstract(config)
    graphdef, _ = nnx.split(abstract)
    targets = restore_targets(abstract, mesh)
    state_dir = os.path.join(path, STATE_DIR)
    with _quiet_orbax(), ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(state_dir).item_metadata
        _check_stored(path, stored.tree if stored is not None else {}, targets)
        params = checkpointer.restore(state_dir, targets)
    return nnx.merge(graphdef, params), config
