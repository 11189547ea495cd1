"""The architecture registry: every model family jaxinfer loads, in one table.

A family module (`llama`, `qwen3`, `gemma3`) defines a `base.Family`: config parsing from a
Hugging Face config.json and from GGUF metadata into `ModelConfig` features, its weight names
and its default chat template. Adding an architecture is one module plus its entry in
`FAMILIES` (and its tests); nothing else in jaxinfer tests a family's name.
"""

from __future__ import annotations

from jaxinfer.families import gemma3, llama, qwen3
from jaxinfer.families.base import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.LLAMA, llama.MISTRAL, llama.QWEN2, qwen3.QWEN3, gemma3.GEMMA3)}


def _registered() -> str:
    return ", ".join(sorted(FAMILIES))


def family(arch: str) -> Family:
    """The family of `ModelConfig.arch`; an unregistered name raises, listing the registered."""
    if arch not in FAMILIES:
        raise ValueError(f"unregistered architecture {arch!r}; registered: {_registered()}")
    return FAMILIES[arch]


def for_hf_config(cfg: dict) -> Family:
    """The family a Hugging Face config.json selects by `model_type`, else `architectures[0]`."""
    model_type, classes = cfg.get("model_type"), cfg.get("architectures") or []
    for f in FAMILIES.values():
        if model_type in f.hf_model_types:
            return f
    for f in FAMILIES.values():
        if classes and classes[0] in f.hf_classes:
            return f
    raise ValueError(f"unsupported Hugging Face architecture model_type={model_type!r} "
                     f"architectures={classes}; registered: {_registered()} ("
                     + ", ".join(c for f in FAMILIES.values() for c in f.hf_classes) + ")")


def for_gguf(arch: str | None) -> Family:
    """The family a GGUF's `general.architecture` selects."""
    for f in FAMILIES.values():
        if f.gguf_arch is not None and f.gguf_arch == arch:
            return f
    names = ", ".join(sorted(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch))
    raise ValueError(f"unsupported GGUF architecture {arch!r}; registered: {names} "
                     "(Mistral GGUFs use llama)")
