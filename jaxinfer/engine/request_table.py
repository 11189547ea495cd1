"""`RequestTable`: the ids `Engine.add_request` returned and the scheduler requests each names.

A request of n samples is one id "<id>" for its n sample requests "<id>/0" .. "<id>/<n-1>"
(`request.sample_ids`) and, when its prompt is prefilled once for them, a prefill-only parent
request under "<id>" itself; a request of one sample is one request under its id. The table
hands out free ids, resolves an id to its requests, and reads and drops finished results.
"""

from __future__ import annotations

import itertools

from jaxinfer.config import short_repr
from jaxinfer.engine.outputs import Completion, completion_of
from jaxinfer.engine.request import Request, sample_ids
from jaxinfer.engine.scheduler import Scheduler


class RequestTable:
    """The engine's request ids (module doc); `scheduler` holds the requests themselves."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._ids = itertools.count()
        # id add_request returned -> the scheduler requests it made (parent first, if any)
        self._requests: dict[str, list[Request]] = {}

    def new_id(self, request_id: str | None, n: int) -> str:
        """`request_id` once checked to be free (for it and its sample ids), or the next free
        "req-<k>"."""
        if request_id is None:
            while self._taken(rid := f"req-{next(self._ids)}", n):
                pass
            return rid
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={short_repr(request_id)} must be a non-empty string")
        taken = self._taken(request_id, n)
        if taken:
            raise ValueError(f"request id {taken!r} is already in use")
        return request_id

    def _taken(self, request_id: str, n: int) -> str | None:
        for i in (request_id, *sample_ids(request_id, n)):
            if i in self._requests or i in self.scheduler.requests:
                return i
        return None

    def add(self, request_id: str, requests: list[Request]) -> None:
        """Records the requests `request_id` (from `new_id`) made, parent first."""
        self._requests[request_id] = requests

    def resolve(self, request_id: str, *, with_parent: bool = False) -> list[Request]:
        """The scheduler requests a request id names: its samples (and with `with_parent` its
        prefill-only parent, first), or the one sample a sample id names."""
        if isinstance(request_id, str) and request_id in self._requests:
            return [r for r in self._requests[request_id] if with_parent or not r.prefill_only]
        req = self.scheduler.requests.get(request_id) if isinstance(request_id, str) else None
        if req is None or req.prefill_only:
            raise ValueError(f"unknown request id {short_repr(request_id)}")
        return [req]

    def result(self, request_id: str) -> Completion:
        """The result of a finished request of one sample (or of the sample "<id>/<i>"
        names). A request with n > 1 samples has `results`; an unfinished one raises
        ValueError (step the engine until its `RequestOutput.finished`, or abort it)."""
        samples = self.resolve(request_id)
        if len(samples) > 1:
            raise ValueError(f"request {request_id!r} has {len(samples)} samples: "
                             f"results({request_id!r}) returns them all")
        return self.results(request_id)[0]

    def results(self, request_id: str) -> list[Completion]:
        """The results of a finished request: one `Completion` per sample, in sample order.
        Raises ValueError while any sample still runs."""
        requests = self.resolve(request_id)
        running = [r for r in requests if not r.finished]
        if running:
            raise ValueError(f"request {running[0].request_id!r} has not finished (status "
                             f"{running[0].status}); step the engine until its RequestOutput "
                             "says finished, or abort it")
        return [completion_of(r) for r in requests]

    def forget(self, request_id: str) -> None:
        """Drops a finished request's records, all its samples' (a long-running server calls
        this after reading its results)."""
        if not isinstance(request_id, str) or request_id not in self._requests:
            raise ValueError(f"unknown request id {short_repr(request_id)} (forget takes the "
                             "id add_request returned)")
        self.results(request_id)  # raises unless every sample has finished
        for req in self._requests.pop(request_id):
            self.scheduler.requests.pop(req.request_id, None)
