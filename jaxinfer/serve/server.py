"""The server's shared state: its config, admission (429/503), authentication, request parsing,
and OpenAI's error shape.

Errors use OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}`: 400 for a body
that is not JSON (or not UTF-8), a wrong type, a value out of range, an unknown field, an empty
prompt or message list, a prompt that does not fit the context; 401 for a missing or wrong key
(`--api_key`); 404 for an unknown model or route; 429 with Retry-After when admitting the
request would put more than `max_waiting_requests` samples beyond the engine's slots
(unfinished samples > max_slots + max_waiting_requests); 503 with Retry-After while loading,
shutting down or after the engine failed. Each error concerns its request only.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import pydantic
from fastapi.responses import JSONResponse
from starlette.requests import Request

from jaxinfer.config import SamplingConfig
from jaxinfer.engine.adapters import UnknownAdapter
from jaxinfer.serve.engine_loop import Done, EngineLoop
from jaxinfer.serve.generation import Generation
from jaxinfer.serve.metrics import ServerMetrics


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """served_model_name: the one model id `/v1/models` lists and requests must name.
    api_key: bearer token every /v1 request must carry (None: open). max_waiting_requests:
    samples admitted beyond the engine's slots before 429. default_max_tokens: max_tokens of a
    request that gives none (capped by the room in the context). retry_after_s: the
    Retry-After of 429 and 503 answers."""

    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int = 256
    default_max_tokens: int = 128
    retry_after_s: int = 1

    def __post_init__(self):
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests={self.max_waiting_requests} must be >= 0")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} must be >= 1")


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             429: "rate_limit_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        body = {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=headers)


def engine_error(e: Exception, param: str | None = None) -> APIError:
    """A ValueError from the engine or the sampling config, as a 400 in OpenAI's names."""
    message = str(e).replace("max_new_tokens", "max_tokens")
    if param is None:
        param = next((p for p in ("max_tokens", "top_logprobs", "seed", "stop", "prompt")
                      if p in message), None)
    return APIError(400, message, param=param, code="invalid_value")


class Server:
    """The state the routes share: the engine thread, the config, metrics, admission count."""

    def __init__(self, make_engine: Callable[[], Any], config: ServerConfig):
        """make_engine: builds the warmed-up engine, on the engine thread (`EngineLoop`)."""
        self.config = config
        self.metrics = ServerMetrics(lambda: self.engine_loop.stats)
        self.engine_loop = EngineLoop(make_engine, on_done=self.metrics.observe)
        self.unfinished = 0  # samples admitted and not yet done (event-loop thread only)
        self.accepting = True
        self.created = int(time.time())

    @property
    def engine(self):
        """The engine, once warmed up (read-only use: tokenizer, config, limits)."""
        if self.engine_loop.error is not None:
            raise APIError(503, f"the engine failed: {self.engine_loop.error}",
                           code="engine_failed", retry_after=self.config.retry_after_s)
        if not self.engine_loop.ready.is_set():
            raise APIError(503, "the model is loading", code="loading",
                           retry_after=self.config.retry_after_s)
        return self.engine_loop.engine

    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {key}":
            self.metrics.rejected.labels("401").inc()
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def check_model(self, model: str) -> str | None:
        """The LoRA adapter `model` names (vLLM's convention: an adapter is served as a model
        of its own name), None for the base model; 404 for any other name."""
        if model == self.config.served_model_name:
            return None
        loras = self.engine.loras()
        if model in loras:
            return model
        served = [self.config.served_model_name, *loras]
        raise APIError(404, f"model={model!r} does not exist; this server serves "
                            f"{', '.join(map(repr, served))}", param="model",
                       code="model_not_found")

    def models(self) -> list[dict]:
        """`/v1/models`: the base model, then each LoRA adapter (its `parent` the base)."""
        base = self.config.served_model_name
        entry = {"object": "model", "created": self.created, "owned_by": "jaxinfer"}
        loras = self.engine.loras() if self.engine_loop.ready.is_set() else []
        return [{"id": base, **entry}] + [{"id": name, **entry, "parent": base}
                                          for name in loras]

    def admit(self, num_samples: int) -> None:
        """Reserves `num_samples`, or raises 429/503 (see the module docstring)."""
        retry = self.config.retry_after_s
        if not self.accepting or not self.engine_loop.alive:
            self.metrics.rejected.labels("503").inc()
            raise APIError(503, "the server is shutting down", code="shutting_down",
                           retry_after=retry)
        capacity = self.engine.engine_config.max_slots + self.config.max_waiting_requests
        if self.unfinished and self.unfinished + num_samples > capacity:
            self.metrics.rejected.labels("429").inc()
            raise APIError(429, f"the server is full ({self.unfinished} samples admitted, "
                                f"capacity {capacity}: max_slots + --max_waiting_requests); "
                                "retry later", code="overloaded", retry_after=retry)
        self.unfinished += num_samples

    def generation(self) -> Generation:
        return Generation(self.engine_loop, self._on_done)

    async def start(self, prompts: list[list[int]], sampling: SamplingConfig | list,
                    arrival: float, *, admitted: bool = False) -> Generation:
        """Admits (unless `admitted`: the samples continue ones admitted before) and submits
        the engine requests of one HTTP request. `sampling`: one config, or one per prompt."""
        configs = ([sampling] * len(prompts) if isinstance(sampling, SamplingConfig)
                   else list(sampling))
        num = configs[0].n * len(prompts)
        if admitted:
            self.unfinished += num
        else:
            self.admit(num)
        gen = self.generation()
        try:
            await gen.submit(prompts, configs, arrival)
        except BaseException as e:
            self.unfinished -= configs[0].n * (len(prompts) - len(gen.request_ids))
            if isinstance(e, UnknownAdapter):  # unloaded since the model check
                raise APIError(404, str(e), param="model", code="model_not_found") from None
            if isinstance(e, ValueError):
                raise engine_error(e) from None
            if isinstance(e, RuntimeError):
                raise APIError(503, str(e), code="shutting_down",
                               retry_after=self.config.retry_after_s) from None
            raise
        self.metrics.received.inc(num)
        return gen

    def _on_done(self, done: Done) -> None:
        self.unfinished -= len(done.completions)


async def parse_body(request: Request, model: type[pydantic.BaseModel]) -> Any:
    """The request body as `model`; 400 naming the field on anything invalid."""
    raw = await request.body()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 ({e.reason} at byte "
                            f"{e.start})", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got "
                            f"{type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = f"unknown field; valid fields: {', '.join(sorted(model.model_fields))}"
        elif err["type"] == "missing":
            message = "field required"
        raise APIError(400, f"{param}: {message} (got {_short(err.get('input'))})",
                       param=param, code="invalid_value") from None


def _short(value: Any, width: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."
