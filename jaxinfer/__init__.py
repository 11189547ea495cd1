"""jaxinfer: LLM inference on JAX — exact, measured, readable.

The public API, imported lazily (so that `import jaxinfer.tts` or the host-only scheduler do not
import jax):

    from jaxinfer import LLM, SamplingConfig, load_llm

The package reads as the data flow, each layer importing only the ones before it:
config -> families -> sharding -> model -> checkpoint -> perf -> engine -> proof -> train -> tts
-> serve -> cli.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "CacheConfig": "jaxinfer.config",
    "EngineConfig": "jaxinfer.config",
    "ModelConfig": "jaxinfer.config",
    "RunConfig": "jaxinfer.config",
    "SamplingConfig": "jaxinfer.config",
    "make_mesh": "jaxinfer.sharding",
    "Llama": "jaxinfer.model",
    "load_model": "jaxinfer.checkpoint.loading",
    "load_tokenizer": "jaxinfer.checkpoint.loading",
    "Completion": "jaxinfer.engine.outputs",
    "RequestOutput": "jaxinfer.engine.outputs",
    "Engine": "jaxinfer.engine.engine",
    "LLM": "jaxinfer.engine.llm",
    "load_llm": "jaxinfer.engine.llm",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
