"""The scheduler (docs/architecture.md, decision 6): which tokens of which requests each step
computes, in which slots and pages. Requests, step outputs and what a sampled token does to its
request are in `jaxinfer.engine.request`; the page allocator and the prefix cache are in
`jaxinfer.engine.pages`. Host-only: these three modules import no jax, so they are unit-tested
without devices.

One rule schedules everything. Each step, every running request *catches up* the tokens it still
has to compute (`num_tokens - num_computed`), oldest first, each at most `chunk_size` and all
together at most `token_budget`:

- a new prompt is prefilled in chunks of up to `chunk_size` tokens (chunked prefill, Sarathi-Serve),
  side by side with the single tokens of requests that are decoding (continuous batching, Orca);
- a decoding request has exactly one token to catch up: the one it sampled last step. That token
  stays on the device (`Chunk.tokens is None`), so the next step can be scheduled and dispatched
  before the host has seen it (the engine overlaps step n + 1's scheduling with step n);
- a preempted request resumes by recomputing what it had (prompt and output so far), minus
  whatever the prefix cache still holds.

Pages (PagedAttention) are reference counted by `PagePool`. Full pages are registered in
`PrefixCache`, a radix tree keyed by page-sized token blocks (RadixAttention); a page that no
request holds but the tree does stays cached until the pool runs low and least-recently-used
leaves are evicted. A request whose prompt starts with cached blocks holds those pages and
computes only the rest. Only full pages are shared, so a partially filled last page is never
shared: it is recomputed into a page of the request's own (the "recompute" form of copy-on-write),
and no step ever writes into a page that another request holds.

When the pool cannot give a running request the page it needs, the newest running request is
preempted: its pages are released (full ones stay in the prefix cache) and it goes back to the
front of the waiting queue, to be recomputed later. Admission stops for a step that preempted.

Admission leaves room for what is already running (`admission_reserve`), so that a request is
not admitted only to be preempted again a step later. A waiting request starts only where the
pool can hold every token it must compute before its first sample (its prompt, or prompt and
outputs after a preemption; not only its first chunk) on top of a reserve for the running
requests of that pool: the pages they still need for the tokens they know (a prompt being
prefilled, a recompute), which they will take for certain, plus `watermark` of the pool for
their decoding, which they may take (vLLM's watermark). Without the reserve, a small pool under
long prompts thrashes: a request admitted whenever a chunk's pages are free computes one chunk
and is preempted by the growth of the older ones, again and again. Where nothing runs the
reserve is 0, so a request that fits the pool alone always starts once the pool is free.

Forks (n samples of one prompt; `jaxinfer.engine.forks`): a prefill-only
parent computes the whole prompt once; its n children wait behind it. In the step that dispatches
the parent's last chunk, each child that gets a slot is *fanned out*: it holds the parent's full
pages, gets a page of its own that the device fills with a copy of the parent's partial last page
right after that step (`SchedulerOutput.post_copies`), and samples its first token, with its own
seed, from the parent's last-position logits (`SchedulerOutput.fanouts`): it computes no token
row at all. A child admitted later (no slot or page then; or fan-out disabled, as under
speculation) shares the parent's pages up to the last prompt token and computes that one token
itself.

Data parallelism (`SchedulerConfig.data_shards` = D > 1): the slots and the pages are split into
D groups, one per data shard of the mesh, whose devices alone hold that group's part of the KV
pool. Each group has its own `PagePool` and `PrefixCache`. A request is admitted into the group
with a free slot where it finds the longest cached prefix (then the most available pages), and
holds only that group's pages; a fork's samples join their parent's group; preemption and fork
dissolution free pages only within the group that is short of them.

Hybrid pools (`SchedulerConfig.window` and `num_local_pages`: a model with sliding-window
layers): the local layers have a pool of their own, and a request holds a local page beside each
global page only while the block can still be seen (`jaxinfer.engine.windows`). Before each step
that writes positions from q0, it releases the local pages of blocks j with (j + 1) * page_size
<= q0 - window + 1 (a query at p sees keys in (p - window, p]), and holds local pages for every
block from the window's first one to the last it writes. A step writing T tokens therefore holds
at most ceil((window - 1 + T) / page_size) + 1 local pages (`config.local_pages_bound`), however
long the sequence. Released local pages stay in the prefix cache when their block is registered
there; a cached prefix is used only as far as its window's local pages are still cached
(`pages.usable_blocks`). Preemption, aborts and forks release and share both kinds of page alike;
a pool short of local pages preempts as one short of global pages does.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Sequence
from typing import Any

from jaxinfer.engine.forks import (
    admit_child,
    child_done,
    dissolve_blocking_forks,
    dissolve_fork,
    end_fork,
    release_pages,
    start_forking,
)
from jaxinfer.engine.pages import (
    LocalPages,
    PagePool,
    PrefixCache,
    usable_blocks,
)
from jaxinfer.engine.request import (
    FINISHED,
    FORKING,
    RUNNING,
    WAITING,
    Chunk,
    Request,
    SchedulerOutput,
    TokenEvent,
    accept_token,
)
from jaxinfer.engine.sched_state import AdapterPins, FreeSlots, SchedulerConfig
from jaxinfer.engine.windows import grow_window, hold_cached_window, release_behind_window


def check_fits(config: SchedulerConfig, request: Request) -> None:
    """Raises ValueError naming the bad value if `request` can never run: an empty prompt,
    max_new_tokens <= 0, or more cache rows than one sequence can hold."""
    if not request.prompt_ids:
        raise ValueError("empty prompt: give at least one token")
    if request.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={request.max_new_tokens} must be > 0")
    # The last sampled token is never fed back, so the cache holds prompt + max_new - 1.
    need = len(request.prompt_ids) + request.max_new_tokens - 1
    limit = min(config.pages_per_seq, config.pages_per_shard) * config.page_size
    if need > limit:
        raise ValueError(
            f"request {request.request_id!r} can never fit: prompt ({len(request.prompt_ids)}"
            f" tokens) + max_new_tokens ({request.max_new_tokens}) needs {need} cache rows, "
            f"but a sequence can hold at most {limit} ({config.pages_per_seq} pages per "
            f"sequence, {config.pages_per_shard} pages in the pool"
            f"{' of each data shard' if config.data_shards > 1 else ''}, page size "
            f"{config.page_size})")


def admission_reserve(config: SchedulerConfig, running: Sequence[Request]) -> list[int]:
    """Per data shard, the pages admission leaves to the `running` requests there (module
    doc): the pages they lack for the tokens they know (`num_tokens`: a prompt still being
    prefilled, a recompute, the sample in flight), plus `watermark` of the shard's pages for
    their decoding. 0 for a shard where nothing runs."""
    ps = config.page_size
    reserve = [0] * config.data_shards
    for shard in {r.shard for r in running}:
        reserve[shard] = int(config.watermark * config.pages_per_shard)
    for r in running:
        reserve[r.shard] += max(0, -(-r.num_tokens // ps) - len(r.pages))
    return reserve


def place(req: Request, budget: int, pools: list[PagePool], slots: FreeSlots,
          config: SchedulerConfig, local_pools: Sequence[PagePool] = (),
          reserve: Sequence[int] = ()) -> tuple[int, list[int], int, int] | None:
    """Where a new request starts: (data shard, cached pages it holds, tokens they cover, tokens
    of its first chunk, at most `budget`), in the shard with a free slot, the longest cached
    prefix, then the most available pages. None if no shard can hold, besides `reserve[shard]`
    pages (`admission_reserve`; none if empty), the pages of every token the request knows
    (hybrid: the local pages of its first chunk too, from `local_pools`)."""
    ps, known = config.page_size, req.known_tokens()
    lookup = config.enable_prefix_caching and req.cacheable
    best = None
    for shard, pool in enumerate(pools):
        if not slots.has(shard):
            continue
        cached, local = pool.cache.match_local(known, req.lora) if lookup else ([], [])
        # At least one token must be computed to get logits for the next sample; the whole
        # last page is recomputed rather than written into a shared page.
        if len(cached) * ps >= len(known):
            cached = cached[:-1]
        if config.hybrid:  # only as far as the window's local pages are cached
            cached = cached[:usable_blocks(local[:len(cached)], config.window, ps)]
        start = len(cached) * ps
        n = min(len(known) - start, config.chunk_size, budget)
        fresh = -(-(start + n) // ps) - len(cached)
        available = pool.num_available()
        # Everything it must compute before its first sample, not just this chunk: what does
        # not fit beside the running requests' reserve would be preempted again.
        need = -(-len(known) // ps) - len(cached) + (reserve[shard] if reserve else 0)
        if need > available - sum(1 for p in cached if pool.refs(p) == 0):
            continue  # admitting here would lead to preemption
        if config.hybrid:  # its new blocks take local pages too; the window's cached ones held
            lpool, lo = local_pools[shard], config.window_block(start)
            unheld = sum(1 for p in local[lo:len(cached)] if lpool.refs(p) == 0)
            if fresh > lpool.num_available() - unheld:
                continue
        if best is None or (len(cached), available) > best[0]:
            best = ((len(cached), available), shard, cached, start, n)
    return None if best is None else best[1:]


# ----------------------------------------------------------------------------------------------
class Scheduler:
    """FCFS continuous batching with chunked prefill, paging, prefix caching and preemption."""

    def __init__(self, config: SchedulerConfig, *, fanout: bool = True,
                 adapters: AdapterPins | None = None):
        """adapters: the LoRA adapter pool (`FreeSlots`); None = requests run the base model."""
        self.config = config
        # Fan forked children out of their parent's last chunk (False: each computes its last
        # prompt token; the engine needs that under speculation, whose steps have no decode rows).
        self.fanout = fanout
        # One pool and prefix cache per data shard (`SchedulerConfig.data_shards`).
        self.pools = [PagePool(config.shard_pages(d), PrefixCache(config.page_size)
                               if config.enable_prefix_caching else None)
                      for d in range(config.data_shards)]
        # Hybrid: the local layers' pool of each data shard, its cache the tree's local pages.
        self.local_pools = [PagePool(config.shard_local_pages(d), LocalPages(pool.cache)
                                     if pool.cache is not None else None)
                            for d, pool in enumerate(self.pools)] if config.hybrid else []
        self.slots = FreeSlots(config, adapters)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.forking: list[Request] = []  # computed fork parents holding pages for children
        self.requests: dict[str, Request] = {}
        # Counters (docs/architecture.md, decision 10).
        self.num_preemptions = 0
        self.prefix_queries = 0  # admissions that looked up the prefix cache
        self.prefix_hits = 0  # ... and found at least one block
        self.reused_tokens = 0  # token rows taken from the cache instead of computed
        self.computed_tokens = 0  # token rows computed (prefill, recompute, decode)

    @property
    def pool(self) -> PagePool:
        """The page pool (of data shard 0: `pools` has one per shard)."""
        return self.pools[0]

    @property
    def cache(self) -> PrefixCache | None:
        """The prefix cache (of data shard 0: each of `pools` has its own)."""
        return self.pools[0].cache

    @property
    def free_slots(self) -> list[int]:
        return self.slots.free

    # ----- requests ---------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queues a request; raises ValueError if it can never fit (nothing else changes)."""
        self.check(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """Raises ValueError if `add(request)` would: a used id, or `check_fits`."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_fits(self.config, request)

    def abort(self, request_id: str) -> Request:
        """Finishes a request at once ("abort") and frees its pages and slot."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"no request with id {request_id!r}")
        if not request.finished:
            self._finish(request, "abort")
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- scheduling -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.token_budget
        for req in list(self.running):
            if req.prefill_only and req.num_computed == len(req.prompt_ids):
                start_forking(self, req)  # its last chunk was dispatched by an earlier step
        # Every decoding request gets its row: a chunk leaves room for the decodes after it (a
        # sample fanned out behind a longer prompt is newer than that prompt's request).
        owed = sum(1 for r in self.running if r.device_token and not r.done_sampling())
        for req in list(self.running):
            if req.status != RUNNING or req.done_sampling():
                continue  # preempted just now, or waiting for its last tokens to arrive
            owed -= req.device_token
            room = budget - (0 if req.device_token else owed)
            if room <= 0:
                if budget == 0:
                    break
                continue
            n = min(req.num_tokens - req.num_computed, self.config.chunk_size, room)
            if not self._reserve(req, req.num_computed + n, out):
                continue  # it was the newest and got preempted itself
            budget -= self.add_chunk(req, n, out)
        if not out.preempted:
            budget = self._admit(budget, out)
            if dissolve_blocking_forks(self, out):
                budget = self._admit(budget, out)
        return out

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
        """Admits waiting requests in arrival order while slots, pages and `budget` allow, each
        with its first chunk; returns the budget left."""
        if self.config.policy == "static" and self.running:
            return budget
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if req.num_pending:
                break  # its last tokens are still in flight (FCFS: nobody overtakes it)
            if not self.slots.can_serve(req):
                break  # every adapter pool slot is held by running requests: wait for one
            if req.fork_of is not None and req.fork_of.finished:
                req.fork_of = None  # the parent was aborted: compute the prompt itself
            if req.fork_of is not None:
                rows = admit_child(self, req, budget, out)
                if rows is None:
                    break
                budget -= rows
                continue
            if budget == 0:
                break
            where = place(req, budget, self.pools, self.slots, self.config, self.local_pools,
                          admission_reserve(self.config, self.running))
            if where is None:
                break  # wait for pages instead
            budget -= self._start(req, *where, out)
        return budget

    def _start(self, req: Request, shard: int, cached: list[int], start: int, n: int,
               out: SchedulerOutput) -> int:
        """Admits `req` into data shard `shard`, holding the `cached` pages of its first `start`
        tokens, with a first chunk of `n` tokens; returns n."""
        self.waiting.popleft()
        self.prefix_queries += self.config.enable_prefix_caching and req.cacheable
        self.prefix_hits += bool(cached)
        for p in cached:
            self.pools[shard].retain(p)
        req.pages, req.local_pages = list(cached), []
        req.num_computed = start
        req.num_cached_blocks = len(cached)
        req.prompt_reused += min(start, len(req.prompt_ids))
        self.reused_tokens += start
        req.slot, req.shard = self.slots.take(shard, req), shard
        if self.config.hybrid and cached:
            hold_cached_window(self, req, start)
        req.status = RUNNING
        req.device_token = False
        self.running.append(req)
        ok = self._reserve(req, start + n, out)
        assert ok, "pages were counted before admission"
        return self.add_chunk(req, n, out)

    def add_chunk(self, req: Request, n: int, out: SchedulerOutput) -> int:
        start = req.num_computed
        samples = start + n == req.num_tokens and not req.prefill_only
        if req.device_token:
            assert n == 1 and samples, (req.request_id, n, start, req.num_tokens)
            tokens = None
        else:
            known = req.known_tokens()
            assert start + n <= len(known), "a chunk needs the values of its tokens"
            tokens = known[start:start + n]
        req.prompt_computed += max(0, min(start + n, len(req.prompt_ids)) - start)  # prompt rows
        self.computed_tokens += n
        req.num_computed += n
        if samples:
            req.num_pending += 1
            req.device_token = True
        out.chunks.append(Chunk(req, req.slot, start, n, tokens, samples))
        return n

    def _reserve(self, req: Request, end: int, out: SchedulerOutput) -> bool:
        """Gives `req` pages covering positions [0, end) (hybrid: local pages for the window of
        the step writing from `req.num_computed`, releasing those behind it), preempting the
        newest running requests while a pool is short. False if `req` itself was preempted."""
        if self.config.hybrid:
            release_behind_window(self, req)
        while not self._grow(req, end):
            forks = [p for p in self.forking if p.shard == req.shard]
            if forks:  # a fork parent waiting for slots gives its pages up first
                dissolve_fork(self, forks[-1])
                continue
            victim = next(r for r in reversed(self.running)
                          if r.status == RUNNING and r.shard == req.shard)
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _grow(self, req: Request, end: int) -> bool:
        """Allocates what `req` lacks of [0, end): global pages, and (hybrid) local pages from
        the window's first block on. False if a pool ran out (what it got is kept)."""
        num = -(-end // self.config.page_size)
        while len(req.pages) < num:
            page = self.pools[req.shard].allocate()
            if page is None:
                return False
            req.pages.append(page)
        return not self.config.hybrid or grow_window(self, req, num)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.register_blocks(req)
        self._release(req)
        req.status = WAITING
        req.num_computed = 0
        req.device_token = False
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _release(self, req: Request) -> None:
        """Returns the request's pages and slot (pages in the prefix cache stay cached)."""
        release_pages(self, req)
        req.num_cached_blocks = 0
        if req.slot is not None:
            self.slots.give_back(req.slot)
            req.slot = None
        req.shard = None
        if req in self.running:
            self.running.remove(req)

    def register_blocks(self, req: Request) -> None:
        """Puts the request's full, computed pages whose token values are known in the tree."""
        if not self.config.enable_prefix_caching or not req.pages:
            return
        known = req.known_tokens()
        full = min(req.num_computed, len(known)) // self.config.page_size
        if full > req.num_cached_blocks:
            req.num_cached_blocks = self.pools[req.shard].cache.insert(
                known[:full * self.config.page_size], req.pages[:full], req.num_cached_blocks,
                req.local_pages[:full], namespace=req.lora)

    # ----- results ----------------------------------------------------------------------------
    def update(self, sampled: Iterable[tuple[Request, int | Sequence[int]]],
               now: float | None = None) -> list[TokenEvent]:
        """Records the tokens sampled by one dispatched step, (request, token) per sampling
        chunk in order, and finishes requests on EOS, stop string or length. A request that was
        finished (e.g. aborted) while its step was in flight drops its token.

        A speculative verification gives a list instead: the accepted drafts, then the
        correction or bonus token. The drafts' K/V was computed by the step, so num_computed
        grows by all but the last; tokens after one that finishes the request are dropped."""
        now = time.perf_counter() if now is None else now
        events = []
        for req, token in sampled:
            req.num_pending -= 1
            if req.finished:
                continue
            if isinstance(token, (list, tuple)):
                req.num_computed += len(token) - 1
            else:
                token = [token]
            for tok in token:
                event, reason = accept_token(req, int(tok), now)
                events.append(event)
                if reason is not None:
                    self._finish(req, reason)
                    break
        for req in self.running:
            self.register_blocks(req)
        return events

    def _finish(self, req: Request, reason: str) -> None:
        """Ends `req` with `reason`, giving back whatever it holds in its present status."""
        if req.status == RUNNING:
            self.register_blocks(req)
            self._release(req)
        elif req.status == WAITING and req in self.waiting:
            self.waiting.remove(req)
            if req.fork_of is not None and not req.fork_of.finished:
                child_done(self, req.fork_of)
        elif req.status == FORKING:
            end_fork(self, req)
        req.status = FINISHED
        req.finish_reason = reason

    # ----- observability ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "running": len(self.running), "waiting": len(self.waiting),
            "pages_used": sum(p.num_used() for p in self.pools),
            "pages_total": self.config.num_pages,
            "pages_cached": sum(len(p.cache) for p in self.pools if p.cache is not None),
            "local_pages_used": sum(p.num_used() for p in self.local_pools),
            "local_pages_total": self.config.num_local_pages,
            "preemptions": self.num_preemptions,
            "evictions": sum(p.num_evictions for p in self.pools),
            "prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
            "reused_tokens": self.reused_tokens, "computed_tokens": self.computed_tokens,
        }

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent (used by the tests)."""
        check_invariants(self)


def reserve_lookahead(sched: Scheduler, req: Request, extra: int) -> int:
    """Pages for `extra` speculative positions past what `req` computes this step, taken only
    from free or evictable pages of its shard (speculation never preempts). Returns how many
    fit. Pages past the length a verification ends at stay the request's, for its next tokens
    (hybrid: with their local pages; those behind the window are released before the next
    step)."""
    ps, config = sched.config.page_size, sched.config
    fits = len(req.pages) * ps - req.num_computed
    while fits < extra and len(req.pages) < config.pages_per_seq:
        page = sched.pools[req.shard].allocate()
        if page is None:
            break
        if config.hybrid:
            local = sched.local_pools[req.shard].allocate()
            if local is None:
                sched.pools[req.shard].release(page)
                break
            req.local_pages.append(local)
        req.pages.append(page)
        fits += ps
    return max(0, min(extra, fits))


# ----------------------------------------------------------------------------------------------
def check_invariants(sched: Scheduler) -> None:
    """Raises AssertionError if the scheduler's bookkeeping is inconsistent (used by the tests)."""
    holders = sched.running + sched.forking
    held = collections.Counter(p for r in holders for p in r.pages)
    for r in holders:  # a request's pages and slot are its shard's
        pages = sched.pools[r.shard].pages
        assert all(p in pages for p in r.pages), (r.request_id, r.shard, r.pages)
        assert r.slot is None or sched.config.shard_of_slot(r.slot) == r.shard, r.request_id
    _check_pools(sched.pools, held)
    if sched.config.hybrid:
        local_held = collections.Counter(p for r in holders for p in r.local_pages
                                         if p is not None)
        for r in holders:
            assert len(r.local_pages) <= len(r.pages), r.request_id
            pages = sched.local_pools[r.shard].pages
            assert all(p in pages for p in r.local_pages if p is not None), r.request_id
        _check_pools(sched.local_pools, local_held)
    _check_writers(sched, held, local_held if sched.config.hybrid else collections.Counter())


def _check_pools(pools: list[PagePool], held: collections.Counter) -> None:
    """Each pool's refcounts are what the requests hold; free, cached and held pages add up."""
    for pool in pools:
        for p in pool.pages:
            assert pool.refs(p) == held.get(p, 0), (p, pool.refs(p), held.get(p, 0))
        assert len(set(pool.free)) == len(pool.free)
        for p in pool.free:
            assert pool.refs(p) == 0 and (pool.cache is None or p not in pool.cache), p
        cached = set(pool.cache.nodes) if pool.cache is not None else set()
        assert set(pool.free).isdisjoint(cached) and cached <= set(pool.pages)
        mine = {p for p in held if p in pool.pages}
        assert len(pool.free) + len(cached | mine) == pool.num_pages


def _check_writers(sched: Scheduler, held: collections.Counter,
                   local_held: collections.Counter) -> None:
    """A page is written only by its one owner: pages shared by several requests are full
    cached blocks, and every request writes only past its registered blocks. Slots are unique."""
    for r in sched.running:
        ps = sched.config.page_size
        assert len(r.pages) >= -(-r.num_computed // ps), r.request_id
        for i, p in enumerate(r.pages):
            if held[p] > 1:  # a cached block, or a fork parent's full page
                assert (i + 1) * ps <= r.num_computed, (r.request_id, p)
        for i, p in enumerate(r.local_pages):
            if p is not None and local_held[p] > 1:
                assert (i + 1) * ps <= r.num_computed, (r.request_id, "local", p)
    slots = [r.slot for r in sched.running]
    assert len(set(slots)) == len(slots) and None not in slots
    assert len(sched.free_slots) + len(slots) == sched.config.max_slots
