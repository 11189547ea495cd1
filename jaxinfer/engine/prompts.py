"""Prompts in: text (optionally chat-templated) or token ids -> validated token ids."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from jaxinfer.checkpoint.tokenizer import Tokenizer
from jaxinfer.config import SamplingConfig, replace_checked, short_repr

GREEDY = SamplingConfig()  # the default sampling (frozen, so one shared instance)


def encode_prompt(tokenizer: Tokenizer | None, vocab_size: int, prompt: str | Sequence[int], *,
                  chat: bool = False, system: str | None = None) -> list[int]:
    """Text (optionally chat-templated with `system`) or token ids -> validated token ids."""
    if isinstance(prompt, str):
        _check_text("prompt", prompt)
        if system is not None:
            _check_text("system", system)
        if not prompt:
            raise ValueError("empty prompt: give at least one character or token id")
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        if chat:
            messages = ([{"role": "system", "content": system}] if system else [])
            messages.append({"role": "user", "content": prompt})
            return encode_messages(tokenizer, vocab_size, messages)
        ids = tokenizer.encode(prompt)
    else:
        ids = token_ids(prompt)
    if not ids:
        raise ValueError("empty prompt: it encodes to zero tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} out of range: valid ids are [0, {vocab_size})")
    return ids


def _check_text(name: str, text: Any) -> None:
    """Raises ValueError unless `text` is a str that UTF-8 can encode (no lone surrogates)."""
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a string, got {type(text).__name__} "
                         f"{short_repr(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text: a lone surrogate "
                         f"{text[e.start]!r} at character {e.start}") from None


def encode_messages(tokenizer: Tokenizer | None, vocab_size: int,
                    messages: Sequence[Mapping[str, str]]) -> list[int]:
    """A conversation ([{"role": ..., "content": ...}, ...], rendered with the checkpoint's chat
    template and its assistant header) -> validated token ids."""
    if tokenizer is None:
        raise ValueError("chat messages need a tokenizer; pass token ids instead")
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(
                m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a mapping with string 'role' and "
                             f"'content', got {short_repr(m)}")
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        add_generation_prompt=True)
    return encode_prompt(None, vocab_size, tokenizer.encode(text, add_special_tokens=False))


def token_ids(prompt: Any) -> list[int]:
    """A token-id prompt as a list of ints; anything but a sequence of integers raises
    ValueError."""
    if isinstance(prompt, (str, bytes, Mapping)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"prompt must be a string or a list of token ids, got "
                         f"{type(prompt).__name__} {short_repr(prompt)}")
    ids = list(prompt)
    bad = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
    if bad:
        raise ValueError(f"token id {short_repr(bad[0])} ({type(bad[0]).__name__}) is not an "
                         "integer: a prompt is a string or a list of integer token ids")
    return [int(t) for t in ids]


def sampling_config(sampling: Any, *, source: str = "sampling") -> SamplingConfig:
    """A `SamplingConfig`, or a mapping of its fields (unset ones keep their defaults), as a
    checked SamplingConfig; anything else raises ValueError."""
    if isinstance(sampling, SamplingConfig):
        return sampling
    if isinstance(sampling, Mapping):
        return replace_checked(GREEDY, sampling, source=source)
    raise ValueError(f"{source} must be a SamplingConfig or a mapping of its fields, got "
                     f"{type(sampling).__name__} {short_repr(sampling)}")


def batch_of(prompts: Any, sampling: Any) -> tuple[list, list]:
    """(prompts, one sampling per prompt): one string is one prompt; one SamplingConfig (or
    mapping) is shared by all; a list of them must match the prompts. Each prompt and
    sampling is checked when its request is added, so a bad one fails alone."""
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, (bytes, Mapping)) or not hasattr(prompts, "__iter__"):
        raise ValueError(f"prompts must be a string or a list of prompts, got "
                         f"{type(prompts).__name__} {short_repr(prompts)}")
    prompts = list(prompts)
    if isinstance(sampling, (SamplingConfig, Mapping)):
        configs = [sampling] * len(prompts)
    elif isinstance(sampling, (list, tuple)):
        configs = list(sampling)
    else:
        raise ValueError(f"sampling must be a SamplingConfig, a mapping of its fields or a "
                         f"list of them (one per prompt), got {type(sampling).__name__}")
    if len(configs) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(configs)} sampling configs")
    return prompts, configs
