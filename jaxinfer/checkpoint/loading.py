"""A run config -> the model and tokenizer of its checkpoint (GGUF, Hugging Face or orbax)."""

from __future__ import annotations

import dataclasses
import os

import jax

from jaxinfer.checkpoint import orbax as orbax_ckpt
from jaxinfer.checkpoint.tokenizer import Tokenizer
from jaxinfer.checkpoint.weights import Checkpoint, load_checkpoint
from jaxinfer.config import RunConfig
from jaxinfer.model.llama import Llama


def default_dtype() -> str:
    """f32 on CPU (XLA CPU runs bf16 matmuls ~15x slower here); bf16 on TPU/GPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_tokenizer(ckpt: Checkpoint) -> Tokenizer | None:
    if ckpt.format == "orbax":  # None when converted without one
        return orbax_ckpt.load_tokenizer(ckpt.path)
    if ckpt.format == "gguf":
        return Tokenizer.from_gguf_metadata(ckpt.metadata)
    return Tokenizer.from_hf_dir(ckpt.path if os.path.isdir(ckpt.path)
                                 else os.path.dirname(ckpt.path))


def load_model(run: RunConfig, ckpt: Checkpoint | None = None) -> tuple[Llama, Checkpoint]:
    if ckpt is None and orbax_ckpt.is_orbax_dir(run.model_path):
        return _load_orbax_model(run)
    ckpt = ckpt or load_checkpoint(run.model_path)
    config = dataclasses.replace(ckpt.config, dtype=run.dtype or default_dtype())
    return Llama(config, ckpt.params), ckpt


def _load_orbax_model(run: RunConfig) -> tuple[Llama, Checkpoint]:
    """An orbax checkpoint (`jaxinfer.checkpoint.orbax`): every weight restored straight into its
    sharding on the mesh `run.mesh` names (None: the default device). The returned Checkpoint
    (format "orbax") carries config, path and marker; its params are empty: the weights are in
    the model only."""
    from jaxinfer.sharding import make_mesh

    mesh = make_mesh(run.mesh) if run.mesh else None
    model, config = orbax_ckpt.restore_model(run.model_path, mesh=mesh,
                                                dtype=run.dtype or default_dtype())
    ckpt = Checkpoint(config=config, params={}, path=run.model_path, format="orbax",
                      metadata=orbax_ckpt.read_marker(run.model_path))
    return model, ckpt
