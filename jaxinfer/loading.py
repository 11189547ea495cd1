"""Checkpoint + tokenizer + config -> a ready `LLM` (serving engine) or `Generator` (the one place
that wires them)."""

from __future__ import annotations

import dataclasses
import os

import jax

from jaxinfer.config import RunConfig
from jaxinfer.engine import LLM
from jaxinfer.generate import Generator
from jaxinfer.model import Llama
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.weights import Checkpoint, load_checkpoint


def default_dtype() -> str:
    """f32 on CPU (XLA CPU runs bf16 matmuls ~15x slower here); bf16 on TPU/GPU."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_tokenizer(ckpt: Checkpoint) -> Tokenizer:
    if ckpt.format == "gguf":
        return Tokenizer.from_gguf_metadata(ckpt.metadata)
    return Tokenizer.from_hf_dir(ckpt.path if os.path.isdir(ckpt.path)
                                 else os.path.dirname(ckpt.path))


def load_model(run: RunConfig, ckpt: Checkpoint | None = None) -> tuple[Llama, Checkpoint]:
    ckpt = ckpt or load_checkpoint(run.model_path)
    config = dataclasses.replace(ckpt.config, dtype=run.dtype or default_dtype())
    return Llama(config, ckpt.params), ckpt


def load_generator(run: RunConfig, ckpt: Checkpoint | None = None) -> Generator:
    model, ckpt = load_model(run, ckpt)
    return Generator(model, load_tokenizer(ckpt), cache=run.cache, engine=run.engine)


def load_llm(run: RunConfig, ckpt: Checkpoint | None = None) -> LLM:
    model, ckpt = load_model(run, ckpt)
    return LLM(model, load_tokenizer(ckpt), cache=run.cache, engine=run.engine)
