"""Prompts in: text (optionally chat-templated) or token ids -> validated token ids."""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.checkpoint.tokenizer import Tokenizer
from jaxinfer.config import SamplingConfig

GREEDY = SamplingConfig()  # the default sampling (frozen, so one shared instance)


def encode_prompt(tokenizer: Tokenizer | None, vocab_size: int, prompt: str | Sequence[int], *,
                  chat: bool = False, system: str | None = None) -> list[int]:
    """Text (optionally chat-templated with `system`) or token ids -> validated token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt: give at least one character or token id")
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        if chat:
            messages = ([{"role": "system", "content": system}] if system else [])
            messages.append({"role": "user", "content": prompt})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("empty prompt: it encodes to zero tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} out of range: valid ids are [0, {vocab_size})")
    return ids


def batch_of(prompts: Sequence[str | Sequence[int]] | str,
             sampling: SamplingConfig | Sequence[SamplingConfig]
             ) -> tuple[list, list[SamplingConfig]]:
    """(prompts, one SamplingConfig per prompt): one string is one prompt; one config is
    shared by all; a list of configs must match the prompts."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    configs = ([sampling] * len(prompts) if isinstance(sampling, SamplingConfig)
               else list(sampling))
    if len(configs) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(configs)} sampling configs")
    return prompts, configs
