"""Hybrid pools' window bookkeeping (`jaxinfer.engine.scheduler` module doc, "Hybrid pools"):
the local pages a request of a model with sliding-window layers holds, one per block its window
can still see. These functions act on a `Scheduler`'s local pools, as `forks` acts on its
queues; the rule for prefix-cache hits is `pages.usable_blocks`. Host-only.
"""

from __future__ import annotations

from jaxinfer.engine.request import Request
from jaxinfer.engine.sched_state import SchedulerState


def hold_cached_window(sched: SchedulerState, req: Request, start: int) -> None:
    """At admission with a prefix hit of `start` tokens: `req` holds the cached local pages of
    the hit's blocks that the window of position `start` sees (`pages.usable_blocks` made sure
    they are cached), None for the blocks before."""
    lo = sched.config.window_block(start)
    _, local = sched.pools[req.shard].cache.match_local(req.known_tokens()[:start],
                                                        req.lora)
    req.local_pages = [p if j >= lo else None for j, p in enumerate(local)]
    for p in req.local_pages[lo:]:
        sched.local_pools[req.shard].retain(p)


def grow_window(sched: SchedulerState, req: Request, num_blocks: int) -> bool:
    """Local pages for `req`'s blocks from its window's first one (for the step writing from
    `num_computed`) to block `num_blocks` - 1. False if the local pool ran out (what it got is
    kept)."""
    req.local_pages += [None] * (len(req.pages) - len(req.local_pages))
    first_new = req.num_computed // sched.config.page_size
    for j in range(sched.config.window_block(req.num_computed), num_blocks):
        if req.local_pages[j] is None:
            # A block the window still sees holds its local K/V unless this step writes it.
            assert j >= first_new, (req.request_id, j, req.num_computed)
            page = sched.local_pools[req.shard].allocate()
            if page is None:
                return False
            req.local_pages[j] = page
    return True


def release_behind_window(sched: SchedulerState, req: Request) -> None:
    """Releases `req`'s local pages that no query from `num_computed` on can see, registering
    its full blocks first so that the prefix cache keeps them."""
    lo = min(sched.config.window_block(req.num_computed), len(req.local_pages))
    if not any(p is not None for p in req.local_pages[:lo]):
        return
    sched.register_blocks(req)
    for j in range(lo):
        if req.local_pages[j] is not None:
            sched.local_pools[req.shard].release(req.local_pages[j])
            req.local_pages[j] = None
