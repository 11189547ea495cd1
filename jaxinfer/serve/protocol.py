"""OpenAI API request shapes, their mapping onto `SamplingConfig`, and the response shapes.

Requests are validated strictly (pydantic, strict types, unknown fields refused), so a wrong
type, a value out of range or an unknown field is a 400 that names the field and what is
valid. Absent fields take OpenAI's defaults (temperature 1, top_p 1, n 1); absent `seed`
draws a random one per request (an explicit seed reproduces a request exactly; sample i of n
uses seed + i); absent `max_tokens` is `--max_new_tokens` capped by the room the prompt leaves
in the context (`default_max_tokens`). `response_format` (json_object, json_schema) becomes the
request's structured-output constraint.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxinfer.config import MAX_TOP_LOGPROBS, SamplingConfig
from jaxinfer.engine.outputs import Completion

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort",
                  "error": "error"}
NonNegFloat = Annotated[float, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: the schema the output must match."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema
    (enforced by the engine's structured output, `SamplingConfig.json_schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_text(self) -> str | None:
        """The JSON Schema as JSON text, or None for free text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.json_schema is None:
            raise ValueError("response_format: type json_schema needs a json_schema object "
                             "with a schema")
        return json.dumps(self.json_schema.schema_)


class LoadLoraAdapter(_Strict):
    """`POST /v1/load_lora_adapter`: a PEFT adapter directory to serve as model `lora_name`."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoraAdapter(_Strict):
    """`POST /v1/unload_lora_adapter`."""

    lora_name: Annotated[str, Field(min_length=1)]


class SamplingFields(_Strict):
    """The parameters both endpoints share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # 0 or -1: off (vLLM's -1 accepted)
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    seed: Annotated[int, Field(ge=0, lt=2**31)] | None = None
    stop: str | list[str] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    n: Annotated[int, Field(ge=1, le=128)] = 1
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if "" in stops:
            raise ValueError("stop: a stop string must not be empty")
        return tuple(stops)

    def sampling(self, *, max_tokens: int, num_top: int, logprobs: bool,
                 prompt_logprobs: int | None = None) -> SamplingConfig:
        seed = self.seed if self.seed is not None else secrets.randbelow(2**31 - self.n)
        if seed + self.n - 1 >= 2**31:
            raise ValueError(f"seed: seed + n - 1 must be < 2**31 (sample i is seeded seed + "
                             f"i), got seed={seed}, n={self.n}")
        return SamplingConfig(
            temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            min_p=self.min_p, seed=seed, stop=self.stops(), presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            n=self.n, ignore_eos=self.ignore_eos, max_new_tokens=max_tokens,
            logprobs=logprobs, top_logprobs=num_top, prompt_logprobs=prompt_logprobs,
            json_schema=self.response_format.schema_text() if self.response_format else None)


class CompletionRequest(SamplingFields):
    """`echo` returns the prompt before the completion; with `logprobs` also the prompt's
    logprobs (the engine's prompt logprobs; the first token has none). `max_tokens` 0 (with
    echo) returns just the prompt: how lm-eval scores a text."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt: empty list; give a string, a list of strings, a list of "
                             "token ids or a list of such lists")
        return list(p)


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[Message]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def conversation(self) -> list[dict[str, str]]:
        if not self.messages:
            raise ValueError("messages: empty list; give at least one message")
        # The chat templates know "system"; OpenAI's newer "developer" role means the same.
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.content}
                for m in self.messages]


def default_max_tokens(prompt_len: int, context: int, cap: int) -> int:
    """max_tokens when the request gives none: `cap` (--max_new_tokens), or the room the prompt
    leaves in the context if that is smaller (the handler refuses a prompt that leaves none)."""
    return max(1, min(cap, context - prompt_len))


# ----- responses ---------------------------------------------------------------------------------
def usage(prompt_lens: list[int], groups: list[list[Completion]]) -> dict[str, Any]:
    """OpenAI usage: prompt tokens (once per prompt, not per sample), completion tokens (every
    sample's, EOS included), and the prompt tokens served from the prefix cache."""
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for g in groups for c in g)
    cached = sum(max((c.metrics.prompt_reused for c in g), default=0) for g in groups)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[float] | None,
                        tops: list[list[tuple[int, float]]] | None, offset: int) -> dict:
    """The legacy completions `logprobs` object of some tokens whose text starts at `offset`."""
    tokens = [tokenizer.decode([t]) for t in token_ids]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = None
    if tops is not None:
        top = [{tokenizer.decode([i]): lp for i, lp in row} for row in tops]
    return {"tokens": tokens, "token_logprobs": list(logprobs or []), "top_logprobs": top,
            "text_offset": offsets}


def prompt_logprobs(tokenizer, prompt_ids: list[int], logprobs: list[float | None],
                    tops: list[list[tuple[int, float]] | None], num_top: int) -> dict:
    """The completions `logprobs` object of an echoed prompt, from offset 0: the first token
    with no logprob and no top logprobs (as OpenAI's and vLLM's echo give); `top_logprobs`
    null when `num_top` is 0, as for generated tokens."""
    out = completion_logprobs(tokenizer, prompt_ids, logprobs,
                              tops[1:] if num_top else None, 0)
    if num_top:
        out["top_logprobs"].insert(0, None)
    return out


def echo_logprobs(tokenizer, c: Completion, num_top: int) -> dict:
    """The completions `logprobs` object of an echoed prompt (`prompt_logprobs`), then of the
    tokens generated after it, from the end of the echoed text."""
    out = prompt_logprobs(tokenizer, c.prompt_ids, c.prompt_logprobs, c.prompt_top_logprobs,
                          num_top)
    rest = completion_logprobs(tokenizer, c.token_ids, c.logprobs, c.top_logprobs,
                               len(tokenizer.decode(c.prompt_ids)))
    for key in ("tokens", "token_logprobs", "text_offset"):
        out[key] += rest[key]
    if num_top:
        out["top_logprobs"] += rest["top_logprobs"]
    return out


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[float] | None,
                  tops: list[list[tuple[int, float]]] | None) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(i: int, lp: float) -> dict:
        text = tokenizer.decode([i])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for k, (t, lp) in enumerate(zip(token_ids, logprobs or [])):
        content.append({**entry(t, lp),
                        "top_logprobs": [entry(i, v) for i, v in tops[k]] if tops else []})
    return {"content": content}
