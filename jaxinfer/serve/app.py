"""The OpenAI-compatible HTTP API (FastAPI): the routes.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both streamed as server-sent
events with `"stream": true`; `jaxinfer.serve.handlers`; `model` names the base model or a
LoRA adapter), `GET /v1/models` (the base model and the adapters), `POST
/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (adapters at run time), `GET /health` (200
once the engine is warmed up, 503 before and after it stops), `GET /metrics` (Prometheus text).
Errors: `jaxinfer.serve.server`.
"""

from __future__ import annotations

import contextlib
import socket
import threading

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from jaxinfer.serve import handlers
from jaxinfer.serve.server import APIError, Server


def _add_error_handlers(app: FastAPI, server: Server) -> None:
    """Every error answers in the OpenAI error shape (`APIError`); a 400 counts as rejected."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        if exc.status == 400:
            server.metrics.rejected.labels("400").inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return APIError(400, str(exc)).response()


def build_app(server: Server) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread (if not started) and, on
    shutdown, stops admitting and aborts what still runs."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not server.engine_loop.started:
            server.engine_loop.start()
        yield
        server.accepting = False
        server.engine_loop.stop()

    app = FastAPI(title="jaxinfer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    _add_error_handlers(app, server)

    @app.get("/health")
    async def health():
        if server.engine_loop.error is not None or not server.engine_loop.alive:
            return Response("engine stopped", status_code=503)
        if not server.engine_loop.ready.is_set():
            return Response("loading", status_code=503)
        return Response("ok", status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_auth(request)
        return {"object": "list", "data": server.models()}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return await handlers.load_lora_adapter(server, request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return await handlers.unload_lora_adapter(server, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handlers.completions(server, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handlers.chat_completions(server, request)

    return app


# Past the grace period the engine aborts what still runs, and each stream ends with its "abort"
# chunk and [DONE] as soon as the engine thread is between steps (a step that compiles a variant
# warm-up skipped takes seconds on a busy CPU). uvicorn's own deadline cancels handlers
# mid-response (no finish chunk, a traceback in the log), so it comes this much later: it only
# ends connections whose client stopped reading.
STUCK_CLIENT_S = 60.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server (SIGTERM/SIGINT: stop accepting connections, wait for the open ones),
    whose shutdown also stops admission at once and aborts the engine's requests when the
    grace period ends."""

    def __init__(self, config: uvicorn.Config, *, server: Server, grace_s: float):
        super().__init__(config)
        self.server, self.grace_s = server, grace_s

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's periodic check (every 0.1 s): also stop when the engine thread has failed
        (e.g. a model that cannot load with this config), since it will never serve."""
        if self.server.engine_loop.error is not None:
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.server.accepting = False
            timer = threading.Timer(self.grace_s, self.server.engine_loop.abort_all)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)


def serve(server: Server, *, sock: socket.socket, grace_s: float) -> None:
    """Serves `server` on the listening socket `sock` until SIGTERM/SIGINT, then shuts down:
    no new requests, `grace_s` for the running ones, then the rest are aborted; returns once
    every connection and the engine thread have ended."""
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(build_app(server), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=grace_s + STUCK_CLIENT_S)
    GracefulServer(config, server=server, grace_s=grace_s).run(sockets=[sock])
