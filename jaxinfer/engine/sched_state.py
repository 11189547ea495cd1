"""The scheduler's configuration and the state its helpers share.

`Scheduler` (`jaxinfer.engine.scheduler`) owns the waiting and running requests, the page pools
and the slots; its helper modules (`forks`: n samples of one prompt, `windows`: the hybrid pool's
sliding windows) work on that state through `SchedulerState`, so they import this module, not
the scheduler, and the scheduler imports them. Host-only: no jax.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Protocol

from jaxinfer.config import SCHEDULING_POLICIES, check_data_split, local_pages_bound
from jaxinfer.engine.pages import PagePool, window_start_block
from jaxinfer.engine.request import Request, SchedulerOutput


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """max_slots: running requests at most (rows of the device batch).
    token_budget: token rows computed per step at most (all chunks and decodes together).
    chunk_size: prompt tokens one request computes per step at most (chunked prefill).
    page_size, num_pages: the KV pool; pages_per_seq: page-table width (max_seq_len / page_size).
    enable_prefix_caching: share full prompt pages through the radix tree.
    policy: "continuous" (admit whenever a slot and the budget allow) or "static" (admit a new
      batch only when the running one has finished: the baseline continuous batching beats).
    data_shards: D, the mesh's "data" axis. The slots and the pool are split into D equal
      groups (`shard_pages`): a request runs in a slot of one group and holds only pages of
      the same group, each with its own prefix cache (the pages live on that shard's devices).
    window, num_local_pages: a hybrid pool (module doc): the local layers' sliding window and
      their pool's usable pages (split over the data shards like `num_pages`); 0 = no local pool.
    watermark: the fraction of each data shard's pages that admission keeps free for the
      decoding of the requests running there (module doc, `admission_reserve`), in [0, 1).
    """

    max_slots: int
    token_budget: int
    chunk_size: int
    page_size: int
    num_pages: int
    pages_per_seq: int
    enable_prefix_caching: bool = True
    policy: str = "continuous"
    data_shards: int = 1
    window: int | None = None
    num_local_pages: int = 0
    watermark: float = 0.01

    def __post_init__(self):
        for name in ("max_slots", "token_budget", "chunk_size", "page_size", "num_pages",
                     "pages_per_seq", "data_shards"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy={self.policy!r} must be one of {SCHEDULING_POLICIES}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark={self.watermark} must be in [0, 1) (a fraction of the "
                             "pool's pages)")
        if self.token_budget < self.max_slots:
            raise ValueError(f"token_budget={self.token_budget} must be >= max_slots="
                             f"{self.max_slots}: every running request decodes one token a step")
        check_data_split(max_slots=self.max_slots, num_pages=self.num_pages,
                         data_shards=self.data_shards)
        if self.num_local_pages:
            if self.window is None or self.window <= 0:
                raise ValueError(f"num_local_pages={self.num_local_pages} needs a window > 0, "
                                 f"got window={self.window}")
            check_data_split(max_slots=self.max_slots, num_pages=self.num_local_pages,
                             data_shards=self.data_shards)
            least = min(local_pages_bound(self.window, self.page_size, self.chunk_size),
                        self.pages_per_seq)
            if self.num_local_pages // self.data_shards < least:
                raise ValueError(
                    f"num_local_pages={self.num_local_pages} gives each of the {self.data_shards}"
                    f" data shard(s) fewer local pages than one sequence's window needs ({least}"
                    f" = ceil((window {self.window} - 1 + chunk {self.chunk_size}) / page size "
                    f"{self.page_size}) + 1, at most pages_per_seq)")

    @property
    def hybrid(self) -> bool:
        return self.num_local_pages > 0

    def shard_local_pages(self, shard: int) -> range:
        """`shard_pages` of the local pool (hybrid): each shard's part ends with its trash page."""
        n = self.num_local_pages // self.data_shards
        return range(shard * (n + 1), shard * (n + 1) + n)

    def window_block(self, position: int) -> int:
        """Hybrid: the first block a query at `position` or later still sees."""
        return window_start_block(position, self.window, self.page_size)

    @property
    def pages_per_shard(self) -> int:
        return self.num_pages // self.data_shards

    def shard_pages(self, shard: int) -> range:
        """Global ids of the usable pages of data shard `shard`: its part of the device pool
        is [shard * (N + 1), (shard + 1) * (N + 1)), N usable pages then its trash page
        (`kv_cache` module doc). One shard: range(num_pages), the trash page after it."""
        n = self.pages_per_shard
        return range(shard * (n + 1), shard * (n + 1) + n)

    def shard_of_slot(self, slot: int) -> int:
        return slot // (self.max_slots // self.data_shards)


class AdapterPins(Protocol):
    """The LoRA adapter pool as the scheduler sees it (`jaxinfer.engine.adapters.AdapterSlots`):
    a request holds its adapter's pool slot while it holds an engine slot."""

    def available(self, key: str | None) -> bool: ...

    def acquire(self, key: str | None) -> int: ...

    def release(self, pool_slot: int) -> None: ...


class FreeSlots:
    """The slots no request runs in, a stack: a data shard's next slot is the one it got back
    last (its lowest one at first). With `adapters`, taking a slot for a request pins its LoRA
    adapter in the device pool (paging it in) and giving the slot back unpins it."""

    def __init__(self, config: SchedulerConfig, adapters: AdapterPins | None = None):
        self.shard_of = config.shard_of_slot
        self.free = list(range(config.max_slots))[::-1]
        self.adapters = adapters
        self.lora_slots: dict[int, int] = {}  # engine slot -> its request's adapter pool slot

    def has(self, shard: int) -> bool:
        return any(self.shard_of(s) == shard for s in self.free)

    def can_serve(self, req: Request) -> bool:
        """The request's adapter is in the pool or can be paged in now (always without one)."""
        return req.lora is None or (self.adapters is not None
                                    and self.adapters.available(req.lora))

    def take(self, shard: int, req: Request) -> int:
        """The next free slot of data shard `shard` (there is one) for `req`, whose adapter
        it pins (`req.lora_slot`; `can_serve` said it can)."""
        i = max(i for i, s in enumerate(self.free) if self.shard_of(s) == shard)
        slot = self.free.pop(i)
        if req.lora is not None:
            req.lora_slot = self.lora_slots[slot] = self.adapters.acquire(req.lora)
        return slot

    def give_back(self, slot: int) -> None:
        self.free.append(slot)
        pool_slot = self.lora_slots.pop(slot, None)
        if pool_slot is not None:
            self.adapters.release(pool_slot)


class SchedulerState(Protocol):
    """What `forks` and `windows` read and change of a `Scheduler` (its attributes there)."""

    config: SchedulerConfig
    fanout: bool
    pools: list[PagePool]
    local_pools: list[PagePool]
    slots: FreeSlots
    waiting: collections.deque[Request]
    running: list[Request]
    forking: list[Request]
    requests: dict[str, Request]
    reused_tokens: int

    def add_chunk(self, req: Request, n: int, out: SchedulerOutput) -> int: ...

    def register_blocks(self, req: Request) -> None: ...
