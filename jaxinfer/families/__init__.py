"""The architecture registry: every model family jaxinfer loads, in one table.

A family module (`llama`, `qwen3`, `gemma3`, and the mixtures of experts `qwen_moe`, `mixtral`,
`gpt_oss`) defines a `base.Family`: config parsing from a Hugging Face config.json and from GGUF
metadata into `ModelConfig` features, its weight names and its default chat template. Adding an
architecture is one module plus its entry in `FAMILIES` (and its tests); nothing else in jaxinfer
tests a family's name.
"""

from __future__ import annotations

from jaxinfer.families import gemma3, gpt_oss, llama, mixtral, qwen3, qwen_moe
from jaxinfer.families.base import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.LLAMA, llama.MISTRAL, llama.QWEN2, qwen3.QWEN3, gemma3.GEMMA3, qwen_moe.QWEN3_MOE,
    qwen_moe.QWEN2_MOE, mixtral.MIXTRAL, gpt_oss.GPT_OSS)}

# Architectures people ask for that no family computes, and what they need (Hugging Face
# model_type or GGUF general.architecture -> the missing features).
UNSUPPORTED = {
    "deepseek_v3": "multi-head latent attention (MLA) and grouped top-k routing with sigmoid "
                   "scores and a correction bias",
    "deepseek_v2": "multi-head latent attention (MLA) and grouped top-k routing",
    "deepseek2": "multi-head latent attention (MLA) and grouped top-k routing",
    "llama4": "interleaved chunked attention, NoPE layers and a sigmoid top-1 router",
    "llama4_text": "interleaved chunked attention, NoPE layers and a sigmoid top-1 router",
}


def _unsupported(name: str | None) -> str:
    why = UNSUPPORTED.get(name or "")
    return f" ({name} needs {why}, which jaxinfer does not implement)" if why else ""


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
                     f"architectures={classes}{_unsupported(model_type)}; registered: "
                     f"{_registered()} ("
                     + ", ".join(c for f in FAMILIES.values() for c in f.hf_classes) + ")")


def for_gguf(arch: str | None) -> Family:
    """The family a GGUF's `general.architecture` selects."""
    for f in FAMILIES.values():
        if f.gguf_arch is not None and f.gguf_arch == arch:
            return f
    names = ", ".join(sorted(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch))
    raise ValueError(f"unsupported GGUF architecture {arch!r}{_unsupported(arch)}; registered: "
                     f"{names} (Mistral and Mixtral GGUFs use llama)")
