"""Prompt files for `jaxinfer-generate --prompts_file`: plain text (one prompt per line) or JSONL
(one object per line: "prompt" and any `SamplingConfig` field, which overrides the run's
sampling for that prompt).

The format is the file's, never a line's: `--prompts_format=auto` reads `*.jsonl` and
`*.ndjson` as JSONL and anything else as text, so a text prompt that starts with "{" stays
text (`jsonl_read_as_text` tells when every line of a text file reads as a JSONL record, which
the CLI warns about). A line that cannot be a prompt (not UTF-8, not JSON, not an object, no
usable "prompt", an unknown key, a bad sampling value) becomes a record with an error naming
the file and line: it fails alone and the other prompts run. A file that cannot be read at all
stops the run before the model loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxinfer.config import SamplingConfig
from jaxinfer.engine.prompts import sampling_config, token_ids

FORMATS = ("auto", "text", "jsonl")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """One prompt of a file: its text or token ids and sampling, or the error that replaces
    them. `where`: "<file>:<line>"."""

    where: str
    prompt: str | list[int] | None = None
    sampling: SamplingConfig | None = None
    error: str | None = None


def file_format(path: str, fmt: str = "auto") -> str:
    """"text" or "jsonl": `fmt`, or for "auto" the one `path`'s suffix names."""
    if fmt not in FORMATS:
        raise ValueError(f"prompts format {fmt!r} is not one of {FORMATS}")
    if fmt == "auto":
        return "jsonl" if path.lower().endswith(_JSONL_SUFFIXES) else "text"
    return fmt


def read_prompt_file(path: str, sampling: SamplingConfig, *, fmt: str = "auto",
                     flag: str = "prompts_file") -> list[PromptRecord]:
    """The prompts of `path`, one record per non-blank line; `sampling` is the run's (a JSONL
    record's fields override it). Raises ValueError, naming the --`flag` that gave `path`, if
    the file cannot be read."""
    fmt = file_format(path, fmt)
    if os.path.isdir(path):
        raise ValueError(f"--{flag}={path} is a directory, not a file of prompts")
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"--{flag}={path}: {e.strerror or e}") from None
    records = []
    for number, raw in enumerate(lines, 1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            records.append(PromptRecord(where=where, error=(
                f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})")))
            continue
        if number == 1:
            line = line.removeprefix("\ufeff")  # a UTF-8 byte order mark
        if not line.strip():
            continue
        if fmt == "text":
            records.append(PromptRecord(where=where, prompt=line, sampling=sampling))
        else:
            records.append(_jsonl_record(line, where, sampling))
    return records


def _jsonl_record(line: str, where: str, sampling: SamplingConfig) -> PromptRecord:
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as e:
        return PromptRecord(where=where, error=f"{where}: not valid JSON ({e.msg} at column "
                                               f"{e.colno})")
    except (ValueError, RecursionError) as e:  # an integer past the digit limit, deep nesting
        return PromptRecord(where=where, error=f"{where}: not readable JSON ({e})")
    if not isinstance(obj, dict):
        return PromptRecord(where=where, error=f"{where}: a record must be a JSON object with "
                                               f"a \"prompt\", got {type(obj).__name__}")
    if "prompt" not in obj:
        return PromptRecord(where=where, error=f"{where}: the record has no \"prompt\" key")
    prompt = obj.pop("prompt")
    try:
        if not isinstance(prompt, str):
            prompt = token_ids(prompt)
        overrides = {**dataclasses.asdict(sampling), **obj}
        record_sampling = sampling_config(overrides, source=where) if obj else sampling
    except ValueError as e:
        message = str(e)
        return PromptRecord(where=where, error=message if message.startswith(where)
                            else f"{where}: {message}")
    return PromptRecord(where=where, prompt=prompt, sampling=record_sampling)


def jsonl_read_as_text(records: list[PromptRecord]) -> bool:
    """Whether the prompts read from a text file are all JSON objects with a "prompt" key: the
    file is then most likely JSONL under another name, and runs its raw JSON as prompts."""
    prompts = [r.prompt for r in records if r.error is None]
    return bool(prompts) and len(prompts) == len(records) and all(
        isinstance(p, str) and _is_record(p) for p in prompts)


def _is_record(line: str) -> bool:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and "prompt" in obj
