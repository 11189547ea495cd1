"""Checkpoint + tokenizer + config -> a ready `LLM` (serving engine) or `Generator` (the one place
that wires them)."""

from __future__ import annotations

import dataclasses
import os

import jax

from jaxinfer import weights_orbax
from jaxinfer.config import RunConfig
from jaxinfer.engine import LLM
from jaxinfer.generate import Generator
from jaxinfer.model import Llama
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.weights import Checkpoint, load_checkpoint


def default_dtype() -> str:
    """f32 on CPU (XLA CPU runs bf16 matmuls ~15x slower here); bf16 on TPU/GPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_tokenizer(ckpt: Checkpoint) -> Tokenizer | None:
    if ckpt.format == "orbax":  # None when converted without one
        return weights_orbax.load_tokenizer(ckpt.path)
    if ckpt.format == "gguf":
        return Tokenizer.from_gguf_metadata(ckpt.metadata)
    return Tokenizer.from_hf_dir(ckpt.path if os.path.isdir(ckpt.path)
                                 else os.path.dirname(ckpt.path))


def load_model(run: RunConfig, ckpt: Checkpoint | None = None) -> tuple[Llama, Checkpoint]:
    if ckpt is None and weights_orbax.is_orbax_dir(run.model_path):
        return _load_orbax_model(run)
    ckpt = ckpt or load_checkpoint(run.model_path)
    config = dataclasses.replace(ckpt.config, dtype=run.dtype or default_dtype())
    return Llama(config, ckpt.params), ckpt


def _load_orbax_model(run: RunConfig) -> tuple[Llama, Checkpoint]:
    """An orbax checkpoint (`jaxinfer.weights_orbax`): every weight restored straight into its
    sharding on the mesh `run.mesh` names (None: the default device). The returned Checkpoint
    (format "orbax") carries config, path and marker; its params are empty: the weights are in
    the model only."""
    from jaxinfer.sharding import make_mesh

    mesh = make_mesh(run.mesh) if run.mesh else None
    model, config = weights_orbax.restore_model(run.model_path, mesh=mesh,
                                                dtype=run.dtype or default_dtype())
    ckpt = Checkpoint(config=config, params={}, path=run.model_path, format="orbax",
                      metadata=weights_orbax.read_marker(run.model_path))
    return model, ckpt


def load_generator(run: RunConfig, ckpt: Checkpoint | None = None) -> Generator:
    model, ckpt = load_model(run, ckpt)
    return Generator(model, load_tokenizer(ckpt), cache=run.cache, engine=run.engine)


def load_llm(run: RunConfig, ckpt: Checkpoint | None = None) -> LLM:
    """The serving engine for `run`, on the mesh `run.mesh` names (None: one device)."""
    from jaxinfer.sharding import make_mesh

    mesh = make_mesh(run.mesh) if run.mesh else None
    model, ckpt = load_model(run, ckpt)
    draft = None
    if run.draft_model_path:
        draft, _ = load_model(dataclasses.replace(run, model_path=run.draft_model_path))
    return LLM(model, load_tokenizer(ckpt), cache=run.cache, engine=run.engine, mesh=mesh,
               draft_model=draft)
