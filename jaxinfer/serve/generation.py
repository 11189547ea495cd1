"""The handler's side of one HTTP request: its engine requests (one per prompt, each with n
samples), their messages from the engine thread, and aborting them when the client goes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from starlette.requests import Request

from jaxinfer.config import SamplingConfig
from jaxinfer.engine.outputs import Completion
from jaxinfer.serve.engine_loop import AsyncSink, Done, EngineLoop, Failed, Token

T = TypeVar("T")


class EngineFailed(Exception):
    """The engine thread stopped (its error is the message)."""


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


class Generation:
    """Engine requests of one HTTP request. Choice index of (prompt i, sample j) is i * n + j,
    as OpenAI numbers the choices of several prompts.

    Args:
      engine_loop: the engine thread.
      on_done: runs on the event loop with each finished engine request's `Done`, whether or
        not the handler still reads (the server's admission count).
    """

    def __init__(self, engine_loop: EngineLoop, on_done: Callable[[Done], None]):
        self.engine_loop = engine_loop
        self.sink = AsyncSink(asyncio.get_running_loop(), on_end=self._on_end)
        self._on_done = on_done
        self.request_ids: list[str] = []
        self.n = 1
        self._ended: set[str] = set()
        self._finished: set[tuple[str, int]] = set()  # (request id, sample) with a last Token

    def _on_end(self, message: Done | Failed) -> None:
        self._ended.add(message.request_id)
        if isinstance(message, Done):
            self._on_done(message)

    async def submit(self, prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig],
                     arrival: float) -> None:
        """Adds every prompt with its config (all with the same n); a ValueError for one aborts
        the ones already added, then propagates (the request is refused as a whole)."""
        self.n = configs[0].n
        for ids, config in zip(prompts, configs):
            future = self.engine_loop.submit(ids, config, self.sink, arrival)
            try:
                self.request_ids.append(await asyncio.wrap_future(future))
            except BaseException:
                self.abort()
                # Cancelled while the engine thread adds it: abort it once it is added.
                future.add_done_callback(self._abort_added)
                raise

    def _abort_added(self, future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.engine_loop.abort(future.result())

    def choice(self, request_id: str, sample: int) -> int:
        return self.request_ids.index(request_id) * self.n + sample

    def abort(self) -> None:
        """Aborts every engine request that has not ended (no-op after the end)."""
        for rid in self.request_ids:
            if rid not in self._ended:
                self.engine_loop.abort(rid)

    async def messages(self) -> AsyncIterator:
        """Every `Token` and `Done` until each engine request is done; raises EngineFailed."""
        left = len(self.request_ids)
        while left:
            message = await self.sink.queue.get()
            if isinstance(message, Failed):
                raise EngineFailed(message.message)
            left -= isinstance(message, Done)
            if isinstance(message, Token) and message.output.finished:
                self._finished.add((message.request_id, message.sample))
            yield message

    def unended(self, done: Done) -> list[tuple[int, Completion]]:
        """(sample, completion) of each sample of `done` whose last `Token` (the one with its
        finish reason) never came, for `messages`' reader to end it: an aborted sample (a
        shutdown's deadline, `EngineLoop.abort_all`) ends between tokens."""
        return [(j, c) for j, c in enumerate(done.completions)
                if (done.request_id, j) not in self._finished]

    async def results(self, request: Request) -> list[list[Completion]]:
        """Every prompt's completions (prompt order). If the client disconnects first, aborts
        and raises ClientGone."""

        async def collect() -> list[list[Completion]]:
            done = {}
            async for m in self.messages():
                if isinstance(m, Done):
                    done[m.request_id] = m.completions
            return [done[rid] for rid in self.request_ids]

        return await until_disconnect(request, collect(), self.abort)


async def until_disconnect(request: Request, work: Awaitable[T], abort: Callable[[], None]) -> T:
    """`work`'s result. If the client disconnects first (or the handler is cancelled), `work`
    is cancelled and `abort` called; a disconnect then raises ClientGone."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            abort()
    if task.cancelled():
        raise ClientGone
    return task.result()


async def wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
