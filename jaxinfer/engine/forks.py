"""Forks: n samples of one prompt share its prefill (`jaxinfer.engine.scheduler` module doc).

A prefill-only parent computes the prompt once; each sample (child) is admitted either in the
step that computes the parent's last prompt token (fanned out: no token row of its own) or later
from the forking parent's pages (it computes the last prompt token itself). These functions are
the scheduler's fork bookkeeping; they act on a `Scheduler`'s queues, pools and slots. Host-only.

Hybrid pools: a child shares the parent's local pages of the full blocks its window still sees
(the parent's are all still held: it released only behind the window of its last chunk, which
starts before the child's first position) and copies the partial block's local page as it copies
the global one (`SchedulerOutput.local_copies`, `local_post_copies`).
"""

from __future__ import annotations

from jaxinfer.engine.request import FINISHED, FORKING, RUNNING, Request, SchedulerOutput
from jaxinfer.engine.sched_state import SchedulerState


def start_forking(sched: SchedulerState, parent: Request) -> None:
    """The parent's prompt is computed: it gives its slot back and keeps its pages (no longer
    running) until every child has been admitted."""
    sched.register_blocks(parent)
    sched.slots.give_back(parent.slot)
    parent.slot = None
    sched.running.remove(parent)
    parent.status = FORKING
    sched.forking.append(parent)
    if parent.children_left == 0:
        end_fork(sched, parent)


def admit_child(sched: SchedulerState, req: Request, budget: int,
                out: SchedulerOutput) -> int | None:
    """Admits `req`, the first waiting request and a child of a fork: fanned out of its parent's
    chunk in this step if that computes the last prompt token, else from a forking parent's
    pages. Returns the token rows it took from `budget`, or None if it has to wait."""
    parent = req.fork_of
    if (sched.fanout and parent.status == RUNNING
            and parent.num_computed == len(parent.prompt_ids)
            and any(c.request is parent for c in out.chunks)):
        return 0 if _fan_out(sched, req, out) else None  # costs no token row, so no budget
    if parent.status != FORKING or budget == 0:
        return None  # the parent's prompt is not computed yet (or no budget left)
    if not _admit_fork(sched, req, out):
        return None
    return sched.add_chunk(req, 1, out)


def _fan_out(sched: SchedulerState, req: Request, out: SchedulerOutput) -> bool:
    """Admits a child in the step that computes its parent's last prompt token: it holds the
    parent's full pages, gets a page of its own that the device fills with a copy of the
    parent's partial last page after this step (copy-on-write), and samples its first token
    from the parent's last logits with its own seed. False if the pool has no page now."""
    parent, ps = req.fork_of, sched.config.page_size
    length = len(parent.prompt_ids)  # = len(req.prompt_ids)
    full, partial = divmod(length, ps)
    if not sched.slots.has(parent.shard) or (partial and not _has_page(sched, parent.shard)):
        return False
    own, own_local = [], []
    if partial:
        own, own_local = _own_page(sched, parent, full, out.post_copies, out.local_post_copies)
    _adopt(sched, req, parent, full, own, own_local, length)
    req.num_pending += 1  # its first token, sampled by this step
    req.device_token = True
    out.fanouts.append((req, parent))
    child_done(sched, parent)  # the parent still runs: it ends when it would start forking
    return True


def _admit_fork(sched: SchedulerState, req: Request, out: SchedulerOutput) -> bool:
    """Admits a child of a forking parent (one that was not fanned out): it holds the parent's
    full pages up to its last prompt token, gets a page of its own that the device first fills
    with a copy of the parent's page holding that token (copy-on-write), and computes just that
    token, which samples its first token with its own seed. False if the pool has no page for it
    now."""
    parent, ps = req.fork_of, sched.config.page_size
    length = len(parent.prompt_ids) - 1
    full, partial = divmod(length, ps)
    if not sched.slots.has(parent.shard) or not _has_page(sched, parent.shard):
        return False
    own, own_local = _own_page(sched, parent, full, out.copies if partial else None,
                               out.local_copies)
    _adopt(sched, req, parent, full, own, own_local, length)
    req.device_token = False
    child_done(sched, parent)
    return True


def _has_page(sched: SchedulerState, shard: int) -> bool:
    """Whether data shard `shard` can give a page now (hybrid: a local one too)."""
    return sched.pools[shard].num_available() >= 1 and (
        not sched.config.hybrid or sched.local_pools[shard].num_available() >= 1)


def _own_page(sched: SchedulerState, parent: Request, block: int, copies: list | None,
              local_copies: list) -> tuple[list[int], list[int]]:
    """A child's own page for block `block` (and its local page, hybrid), filled with a copy of
    the parent's (appended to `copies` / `local_copies`; `copies` None: a fresh block, no copy).
    Returns ([page], [local page] or [])."""
    page = sched.pools[parent.shard].allocate()
    if copies is not None:
        copies.append((parent.pages[block], page))
    if not sched.config.hybrid:
        return [page], []
    local = sched.local_pools[parent.shard].allocate()
    if copies is not None:
        local_copies.append((parent.local_pages[block], local))
    return [page], [local]


def _adopt(sched: SchedulerState, req: Request, parent: Request, shared: int, own: list[int],
           own_local: list[int], length: int) -> None:
    """The admission a fork's child shares: the parent's first `shared` pages (retained; hybrid:
    with the local pages its window sees), then its `own` new pages (and `own_local`), `length`
    tokens computed, a slot (all in the parent's data shard)."""
    sched.waiting.popleft()
    for p in parent.pages[:shared]:
        sched.pools[parent.shard].retain(p)
    req.pages = parent.pages[:shared] + own
    if sched.config.hybrid:
        lo = sched.config.window_block(length)
        shared_local = [p if j >= lo else None for j, p in enumerate(parent.local_pages[:shared])]
        for p in shared_local[lo:]:
            sched.local_pools[parent.shard].retain(p)
        req.local_pages = shared_local + own_local
    req.num_computed = length
    req.num_cached_blocks = 0
    # The first sample admitted is charged the parent's prefill (metrics add up to what was
    # computed); the others reuse all of it.
    charged = parent.prompt_computed
    parent.prompt_computed = 0
    req.prompt_computed += charged
    reused = max(0, length - charged)
    req.prompt_reused += reused
    sched.reused_tokens += reused
    req.slot, req.shard = sched.slots.take(parent.shard, req), parent.shard
    req.status = RUNNING
    req.fork_of = None
    sched.running.append(req)


def child_done(sched: SchedulerState, parent: Request) -> None:
    """One child of `parent` needs it no more (admitted, or finished while waiting); a forking
    parent ends with its last child."""
    parent.children_left -= 1
    if parent.children_left == 0 and parent.status == FORKING:
        end_fork(sched, parent)


def dissolve_blocking_forks(sched: SchedulerState, out: SchedulerOutput) -> bool:
    """When nothing runs this step (`out`) and nothing can start while fork parents hold their
    pages (the pool is too small for a parent and a sample), dissolves the forks: their samples
    then compute the prompt themselves (from the prefix cache, if on). True if it did."""
    if (out.chunks or out.fanouts or sched.running or not sched.forking or not sched.waiting
            or sched.waiting[0].num_pending):
        return False
    for parent in list(sched.forking):
        dissolve_fork(sched, parent)
    return True


def dissolve_fork(sched: SchedulerState, parent: Request) -> None:
    """Ends a fork before every sample was admitted: the samples still waiting compute the
    prompt themselves (from the prefix cache, where it holds the parent's full pages)."""
    for req in sched.waiting:
        if req.fork_of is parent:
            req.fork_of = None
    parent.children_left = 0
    end_fork(sched, parent)


def end_fork(sched: SchedulerState, parent: Request) -> None:
    """Every child holds what it needs: the parent releases its pages and is forgotten."""
    release_pages(sched, parent)
    parent.shard = None
    sched.forking.remove(parent)
    parent.status = FINISHED
    parent.finish_reason = "forked"
    sched.requests.pop(parent.request_id, None)


def release_pages(sched: SchedulerState, req: Request) -> None:
    """Returns every page `req` holds, global and local, to its data shard's pools (pages in the
    prefix cache stay cached)."""
    for p in req.pages:
        sched.pools[req.shard].release(p)
    for p in req.local_pages:
        if p is not None:
            sched.local_pools[req.shard].release(p)
    req.pages, req.local_pages = [], []
