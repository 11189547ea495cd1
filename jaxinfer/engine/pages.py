"""Host-side KV pages: `PagePool` hands out page ids and counts their references, and
`PrefixCache`, a radix tree over page-sized token blocks, keeps full pages for later requests to
share (`jaxinfer.engine.scheduler` module docstring). The scheduler holds one of each per data
shard. Host-only: imports no jax.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence


class _Node:
    __slots__ = ("key", "page", "parent", "children", "last_used")

    def __init__(self, key, page, parent):
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_used = 0


class PrefixCache:
    """Radix tree over page-sized token blocks: a path from the root spells a token prefix, one
    node per full page, and each node names the page holding that block's K/V."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = _Node((), -1, None)
        self.nodes: dict[int, _Node] = {}  # page -> node
        self._clock = 0

    def __contains__(self, page: int) -> bool:
        return page in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Pages of the longest cached run of full blocks that `tokens` starts with."""
        node, pages, now, ps = self.root, [], self._tick(), self.page_size
        for i in range(len(tokens) // ps):
            node = node.children.get(tuple(tokens[i * ps:(i + 1) * ps]))
            if node is None:
                break
            node.last_used = now
            pages.append(node.page)
        return pages

    def insert(self, tokens: Sequence[int], pages: Sequence[int], start_block: int = 0) -> int:
        """Registers the full blocks of `tokens` (held in `pages`) from block `start_block` on.
        Returns the number of leading blocks registered under the caller's pages.

        The walk stops at a block already cached under another page (the caller's copy stays
        its own and so do the blocks after it). That keeps the invariant the pool's accounting
        relies on: a node's ancestors are held by every request that holds the node, so every
        cached page no request holds can be evicted (leaves first)."""
        node, now, ps = self.root, self._tick(), self.page_size
        num_blocks = min(len(tokens) // ps, len(pages))
        for i in range(num_blocks):
            key = tuple(tokens[i * ps:(i + 1) * ps])
            child = node.children.get(key)
            if child is not None and child.page != pages[i]:
                return i
            if child is None:
                if i < start_block or pages[i] in self.nodes:
                    return i  # an ancestor was evicted meanwhile, or the page is another block
                child = _Node(key, pages[i], node)
                node.children[key] = child
                self.nodes[pages[i]] = child
            child.last_used = now
            node = child
        return num_blocks

    def evict(self, unreferenced: Callable[[int], bool]) -> int | None:
        """Removes the least recently used leaf whose page no request holds; returns its page."""
        best = None
        for node in self.nodes.values():
            if not node.children and unreferenced(node.page) and (
                    best is None or node.last_used < best.last_used):
                best = node
        if best is None:
            return None
        del best.parent.children[best.key]
        del self.nodes[best.page]
        return best.page


class PagePool:
    """Page ids with reference counts. A page is free, held (refcount > 0), or cached (in the
    prefix cache with refcount 0: evictable). free + held + cached-unheld == num_pages always.
    `pages`: the ids it manages, a range (one data shard's, `SchedulerConfig.shard_pages`);
    `refcount[p - pages.start]` is page p's count."""

    def __init__(self, pages: range, cache: PrefixCache | None):
        self.pages = pages
        self.num_pages = len(pages)
        self.refcount = [0] * len(pages)
        self.free: collections.deque[int] = collections.deque(pages)
        self.cache = cache
        self.num_evictions = 0

    def refs(self, page: int) -> int:
        return self.refcount[page - self.pages.start]

    def num_cached_unheld(self) -> int:
        if self.cache is None:
            return 0
        return sum(1 for p in self.cache.nodes if self.refs(p) == 0)

    def num_available(self) -> int:
        return len(self.free) + self.num_cached_unheld()

    def num_used(self) -> int:
        """Pages held by requests (cached-but-unheld pages count as available)."""
        return self.num_pages - self.num_available()

    def allocate(self) -> int | None:
        """A fresh page with refcount 1 (evicting an LRU cached block if none is free)."""
        if not self.free and self.cache is not None:
            page = self.cache.evict(lambda p: self.refs(p) == 0)
            if page is not None:
                self.num_evictions += 1
                self.free.append(page)
        if not self.free:
            return None
        page = self.free.popleft()
        assert self.refs(page) == 0, page
        self.refcount[page - self.pages.start] = 1
        return page

    def retain(self, page: int) -> None:
        self.refcount[page - self.pages.start] += 1

    def release(self, page: int) -> None:
        i = page - self.pages.start
        self.refcount[i] -= 1
        if self.refcount[i] < 0:
            raise AssertionError(f"page {page} released more often than retained")
        if self.refcount[i] == 0 and (self.cache is None or page not in self.cache):
            self.free.append(page)
