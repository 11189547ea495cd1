"""The engine thread: the one thread that owns the `Engine` and the device.

The engine is not thread-safe, so every call on it happens here. HTTP handlers (on the asyncio
event loop) talk to it through a command queue: `submit` (add a request; validation errors come
back through the returned future, so the handler answers 400) and `abort`. The thread drains the
queue, steps while anything runs, and blocks on the queue when nothing does (no spinning). Each
request's outputs go to its `Sink`, a callable the thread invokes with a list of messages
(`Token`, `Done`, `Failed`) per step; `AsyncSink` hands them to an asyncio queue with one
`loop.call_soon_threadsafe` per step and request.

A request ends with exactly one `Done` (every sample's `Completion`, aborted ones with
finish_reason "abort"), after which the engine has forgotten it and its pages are back in the
pool. `abort` works at any point: still queued here, waiting in the scheduler or running; each
sample it ends gets a last `Token` first (no token id, finish_reason "abort", the text its
stream held back), so every sample's tokens end with a finished one and add up to its text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from jaxinfer.config import SamplingConfig
from jaxinfer.engine.outputs import Completion, RequestOutput

log = logging.getLogger("jaxinfer.serve")

# How often (seconds) the thread publishes `Engine.stats()` while it steps (always when idle).
STATS_PERIOD_S = 0.05


@dataclasses.dataclass(frozen=True)
class Token:
    request_id: str
    sample: int  # which of the request's n samples
    output: RequestOutput


@dataclasses.dataclass(frozen=True)
class Done:
    request_id: str
    completions: list[Completion]  # one per sample, in sample order


@dataclasses.dataclass(frozen=True)
class Failed:
    request_id: str
    message: str


Sink = Callable[[list], None]


class AsyncSink:
    """Delivers messages to an `asyncio.Queue` on `loop` (thread-safe); `on_end` runs on the
    loop with each `Done` or `Failed` as it arrives, whether or not anyone reads the queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_end: Callable[[Done | Failed], None] | None = None):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.on_end = on_end

    def __call__(self, messages: list) -> None:
        self.loop.call_soon_threadsafe(self._put_all, messages)

    def _put_all(self, messages: list) -> None:
        for m in messages:
            self.queue.put_nowait(m)
            if self.on_end is not None and isinstance(m, (Done, Failed)):
                self.on_end(m)


@dataclasses.dataclass
class _Open:
    sink: Sink
    samples: dict[str, int]  # sample id -> sample index, for the unfinished samples


@dataclasses.dataclass(frozen=True)
class _Submit:
    prompt: Sequence[int]
    sampling: SamplingConfig
    sink: Sink
    arrival: float
    future: concurrent.futures.Future


class EngineLoop:
    """Runs an engine on its own thread (see the module docstring).

    Args:
      make_engine: builds (or returns) the engine; called on the engine thread, so loading
        and warm-up happen there too, while the HTTP server already answers (not ready).
      on_done: called on the engine thread with each finished request's completions
        (metrics).
    """

    def __init__(self, make_engine: Callable[[], Any], *,
                 on_done: Callable[[list[Completion]], None] | None = None):
        self._make_engine = make_engine
        self._on_done = on_done
        self.engine = None
        self.ready = threading.Event()
        self.error: str | None = None  # why the thread stopped, if it failed
        self.exception: Exception | None = None  # what it raised then
        self.stats: dict[str, Any] = {}  # the latest `Engine.stats()`
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._open: dict[str, _Open] = {}
        self._routes: dict[str, str] = {}  # sample id -> request id
        self._stopping = False
        # Set by `stop` from any thread: `make_engine` may pass `stopping.is_set` to
        # `Engine.warmup` or `Engine.start_warmup` (`cancelled=`), so a shutdown during
        # warm-up does not wait for it.
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._main, name="jaxinfer-engine", daemon=True)

    # ----- the handlers' side (any thread) ----------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, prompt: Sequence[int], sampling: SamplingConfig, sink: Sink,
               arrival: float | None = None) -> concurrent.futures.Future:
        """Queues a request; the future resolves to its id, or raises the ValueError that
        `Engine.add_request` raised (the request was then never queued)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Submit(prompt, sampling, sink,
                                   time.perf_counter() if arrival is None else arrival, future))
        return future

    def abort(self, request_id: str) -> None:
        """Ends a request (no-op if it already ended); its `Done` still arrives."""
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """Aborts every request that runs or waits now (each gets its `Done`)."""
        self._commands.put(("abort_all", None))

    def stop(self, timeout: float | None = None) -> None:
        """Aborts whatever still runs (each gets its `Done`), ends the thread, joins it (the
        thread first finishes the step it is in, or its warm-up if that does not watch
        `stopping`)."""
        self.stopping.set()
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ----- the engine thread ------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.engine = self._make_engine()
            self.stats = self.engine.stats()
            self.ready.set()
            self._run()
        except Exception as e:  # noqa: BLE001 - reported through /health and to every request
            self.error, self.exception = f"{type(e).__name__}: {e}", e
            if self.ready.is_set() or not isinstance(e, (ValueError, FileNotFoundError)):
                log.error("engine thread failed:\n%s", traceback.format_exc())
            self._fail_all(self.error)

    def _run(self) -> None:
        published = 0.0
        while not self._stopping:
            busy = self.engine.has_unfinished()
            if not busy:
                self.stats = self.engine.stats()
            self._drain(block=not busy)
            if self._stopping:
                break
            if not self.engine.has_unfinished():
                continue
            self._deliver(self.engine.step())
            now = time.perf_counter()
            if now - published > STATS_PERIOD_S:
                self.stats, published = self.engine.stats(), now
        for rid in list(self._open):
            self._abort(rid)
        while self.engine.has_unfinished():  # the last dispatched step, if any
            self.engine.step()
        self.stats = self.engine.stats()

    def _drain(self, *, block: bool) -> None:
        """Runs every queued command; with `block`, waits for the first one."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            self._execute(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, command) -> None:
        if isinstance(command, _Submit):
            self._add(command)
        elif command[0] == "abort":
            if command[1] in self._open:
                self._abort(command[1])
        elif command[0] == "abort_all":
            for rid in list(self._open):
                self._abort(rid)
        elif command[0] == "stop":
            self._stopping = True

    def _add(self, c: _Submit) -> None:
        if self._stopping:
            c.future.set_exception(RuntimeError("the server is shutting down"))
            return
        try:
            rid = self.engine.add_request(c.prompt, c.sampling, arrival=c.arrival)
        except ValueError as e:
            c.future.set_exception(e)
            return
        ids = self.engine.sample_ids(rid, c.sampling.n)
        self._open[rid] = _Open(c.sink, {sid: i for i, sid in enumerate(ids)})
        self._routes.update((sid, rid) for sid in ids)
        c.future.set_result(rid)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batches: dict[str, list] = {}
        for out in outputs:
            rid = self._routes.get(out.request_id)
            if rid is None:
                continue
            request = self._open[rid]
            batch = batches.setdefault(rid, [])
            batch.append(Token(rid, request.samples[out.request_id], out))
            if out.finished:
                del request.samples[out.request_id]
                if not request.samples:
                    batch.append(self._finish(rid))
        for rid, batch in batches.items():
            self._send(self._open.pop(rid).sink if isinstance(batch[-1], Done)
                       else self._open[rid].sink, batch)

    def _abort(self, rid: str) -> None:
        request = self._open.pop(rid)
        # Each sample still running ends with its last output (what its stream held back, and
        # finish_reason "abort"), then the request's Done.
        tokens = [Token(rid, request.samples[out.request_id], out)
                  for out in self.engine.abort(rid) if out.request_id in request.samples]
        self._send(request.sink, [*tokens, self._finish(rid)])

    def _finish(self, rid: str) -> Done:
        completions = self.engine.results(rid)
        self.engine.forget(rid)
        for sid in self.engine.sample_ids(rid, len(completions)):
            self._routes.pop(sid, None)
        if self._on_done is not None:
            self._on_done(completions)
        return Done(rid, completions)

    def _send(self, sink: Sink, messages: list) -> None:
        try:
            sink(messages)
        except RuntimeError:  # the handler's event loop has closed (server shutting down)
            pass

    def _fail_all(self, message: str) -> None:
        for rid, request in list(self._open.items()):
            self._send(request.sink, [Failed(rid, message)])
        self._open.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Submit):
                command.future.set_exception(RuntimeError(message))
