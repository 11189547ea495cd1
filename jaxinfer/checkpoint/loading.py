"""A run config -> the model and tokenizer of its checkpoint (GGUF, Hugging Face or orbax)."""

from __future__ import annotations

import dataclasses
import os

import jax

from jaxinfer import families
from jaxinfer.checkpoint import orbax as orbax_ckpt
from jaxinfer.checkpoint import requant
from jaxinfer.checkpoint.tokenizer import Tokenizer
from jaxinfer.checkpoint.weights import Checkpoint, load_checkpoint
from jaxinfer.config import RunConfig, resolve_scan_layers
from jaxinfer.model.llama import Llama
from jaxinfer.model.quant import QUANT_DTYPES, default_int4_group
from jaxinfer.sharding import parse_mesh


def default_dtype() -> str:
    """f32 on CPU (XLA CPU runs bf16 matmuls ~15x slower here); bf16 on TPU/GPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_tokenizer(ckpt: Checkpoint) -> Tokenizer | None:
    """The checkpoint's tokenizer; a checkpoint without a chat template gets its family's."""
    if ckpt.format == "orbax":  # None when converted without one
        return orbax_ckpt.load_tokenizer(ckpt.path)
    template = families.family(ckpt.config.arch).chat_template
    if ckpt.format == "gguf":
        return Tokenizer.from_gguf_metadata(ckpt.metadata, default_chat_template=template)
    return Tokenizer.from_hf_dir(ckpt.path if os.path.isdir(ckpt.path)
                                 else os.path.dirname(ckpt.path), default_chat_template=template)


def load_model(run: RunConfig, ckpt: Checkpoint | None = None) -> tuple[Llama, Checkpoint]:
    """The model of `run` (and its Checkpoint). `run.weight_dtype` int8 / int4: read from the
    file straight into quantized weights (`load_checkpoint(weight_dtype=...)`), or quantized
    from a given float `ckpt`; such a load returns the Checkpoint without params (the weights
    are in the model only, as for orbax), so no second copy of them stays alive. A mixture
    that `run.mesh` cannot hold (`ModelConfig.check_mesh`) fails before any weight is read."""
    if ckpt is None and orbax_ckpt.is_orbax_dir(run.model_path):
        return _load_orbax_model(run)
    quantized = run.weight_dtype in QUANT_DTYPES
    fresh = ckpt is None
    mesh = parse_mesh(run.mesh, jax.device_count()) if run.mesh else None
    ckpt = ckpt or load_checkpoint(run.model_path,
                                   weight_dtype=run.weight_dtype if quantized else None,
                                   mesh_sizes=mesh)
    config = dataclasses.replace(ckpt.config, dtype=run.dtype or default_dtype(),
                                 weight_dtype=run.weight_dtype or ckpt.config.weight_dtype,
                                 scan_layers=resolve_scan_layers(run.scan_layers,
                                                                 jax.default_backend()))
    if quantized and ckpt.config.weight_dtype not in QUANT_DTYPES:
        # quantized in `Llama` from floats: the layouts a load of its file would give
        config = dataclasses.replace(
            config, int8_group_size=requant.int8_group_size(ckpt.format),
            int4_group_size=default_int4_group(jax.default_backend(), ckpt.format,
                                               (config.embed_dim, config.ffn_dim)))
    if mesh is not None:
        config.check_mesh(mesh)
    model = Llama(config, ckpt.params)
    if quantized and fresh:
        ckpt = dataclasses.replace(ckpt, config=config, params={})
    return model, ckpt


def _load_orbax_model(run: RunConfig) -> tuple[Llama, Checkpoint]:
    """An orbax checkpoint (`jaxinfer.checkpoint.orbax`): every weight restored straight into its
    sharding on the mesh `run.mesh` names (None: the default device), in the layout
    `run.scan_layers` resolves to (a checkpoint stored in the other is relaid as it is read).
    The returned Checkpoint (format "orbax") carries config, path and marker; its params are
    empty: the weights are in the model only."""
    from jaxinfer.sharding import make_mesh

    mesh = make_mesh(run.mesh) if run.mesh else None
    stored = orbax_ckpt.read_config(run.model_path).weights
    requested = run.weight_dtype or stored
    if requested != stored and {requested, stored} & set(QUANT_DTYPES):
        raise ValueError(f"orbax checkpoint {run.model_path} stores {stored} weights; "
                         f"weight_dtype={run.weight_dtype!r} needs a checkpoint converted with "
                         f"it (scripts/convert_checkpoint.py --weight_dtype={run.weight_dtype})")
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    model, config = orbax_ckpt.restore_model(
        run.model_path, mesh=mesh, dtype=run.dtype or default_dtype(),
        scan_layers=resolve_scan_layers(run.scan_layers, platform))
    ckpt = Checkpoint(config=config, params={}, path=run.model_path, format="orbax",
                      metadata=orbax_ckpt.read_marker(run.model_path))
    return model, ckpt
