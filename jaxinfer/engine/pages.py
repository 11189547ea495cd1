"""Host-side KV pages: `PagePool` hands out page ids and counts their references, and
`PrefixCache`, a radix tree over page-sized token blocks, keeps full pages for later requests to
share (`jaxinfer.engine.scheduler` module docstring). The scheduler holds one of each per data
shard. Host-only: imports no jax.

Hybrid pools (a model with sliding-window layers, `CacheConfig.hybrid`): the local layers' K/V
lives in a second, smaller pool with its own `PagePool`, and a block's node in the tree may also
name the block's local page (`_Node.local`). The global page of a block is what the tree is made
of; its local page is optional, because a request releases the local pages that fall behind its
window. The local pool sees the tree's local pages through `LocalPages`: any of them that no
request holds can be evicted alone (the node stays, without its local page), and a node evicted
from the tree keeps its local page cached, detached, until the local pool evicts it.
`usable_blocks` is the rule that decides how much of a cached prefix a hybrid request can use.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence


class _Node:
    __slots__ = ("key", "page", "local", "parent", "children", "last_used")

    def __init__(self, key, page, parent, local=None):
        self.key, self.page, self.parent, self.local = key, page, parent, local
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_used = 0


class PrefixCache:
    """Radix tree over page-sized token blocks: a path from the root spells a token prefix, one
    node per full page, and each node names the page holding that block's K/V.

    A namespace (the LoRA adapter a request runs with; None = the base model) has a root of its
    own: K/V computed with one adapter is never reused by a request with another, since the
    adapters change every layer's keys and values."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.roots: dict[str | None, _Node] = {None: _Node((), -1, None)}
        self.nodes: dict[int, _Node] = {}  # page -> node
        self.local_nodes: dict[int, _Node] = {}  # local page -> node (hybrid pools)
        self._clock = 0

    def __contains__(self, page: int) -> bool:
        return page in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    @property
    def root(self) -> _Node:
        """The base model's root."""
        return self.roots[None]

    def _root(self, namespace: str | None) -> _Node:
        if namespace not in self.roots:
            self.roots[namespace] = _Node((), -1, None)
        return self.roots[namespace]

    def match(self, tokens: Sequence[int], namespace: str | None = None) -> list[int]:
        """Pages of the longest cached run of full blocks that `tokens` starts with."""
        return [node.page for node in self._walk(tokens, namespace)]

    def match_local(self, tokens: Sequence[int], namespace: str | None = None
                    ) -> tuple[list[int], list[int | None]]:
        """`match` with each block's local page beside its page (None: not cached)."""
        nodes = self._walk(tokens, namespace)
        return [node.page for node in nodes], [node.local for node in nodes]

    def _walk(self, tokens: Sequence[int], namespace: str | None) -> list[_Node]:
        node, nodes, now, ps = self._root(namespace), [], self._tick(), self.page_size
        for i in range(len(tokens) // ps):
            node = node.children.get(tuple(tokens[i * ps:(i + 1) * ps]))
            if node is None:
                break
            node.last_used = now
            nodes.append(node)
        return nodes

    def insert(self, tokens: Sequence[int], pages: Sequence[int], start_block: int = 0,
               local_pages: Sequence[int | None] = (), namespace: str | None = None) -> int:
        """Registers the full blocks of `tokens` (held in `pages`) from block `start_block` on.
        Returns the number of leading blocks registered under the caller's pages.
        `local_pages` (hybrid pools): the caller's local page of each block, None where it has
        released it; a node under the caller's page that has no local page takes the caller's.

        The walk stops at a block already cached under another page (the caller's copy stays
        its own and so do the blocks after it). That keeps the invariant the pool's accounting
        relies on: a node's ancestors are held by every request that holds the node, so every
        cached page no request holds can be evicted (leaves first)."""
        node, now, ps = self._root(namespace), self._tick(), self.page_size
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
            local = local_pages[i] if i < len(local_pages) else None
            if child.local is None and local is not None and local not in self.local_nodes:
                child.local = local
                self.local_nodes[local] = child
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

    def evict_local(self, unreferenced: Callable[[int], bool]) -> int | None:
        """Drops the least recently used local page no request holds (its node, if still in the
        tree, keeps its global page); returns it."""
        best = None
        for page, node in self.local_nodes.items():
            if unreferenced(page) and (best is None or node.last_used < best.last_used):
                best = node
        if best is None:
            return None
        page, best.local = best.local, None
        del self.local_nodes[page]
        return page


class LocalPages:
    """The prefix cache as the local pool's `PagePool` sees it: its cached pages are the tree's
    local pages (`PrefixCache.local_nodes`), evicted one at a time whatever their position."""

    def __init__(self, cache: PrefixCache):
        self.cache = cache

    @property
    def nodes(self) -> dict[int, _Node]:
        return self.cache.local_nodes

    def __contains__(self, page: int) -> bool:
        return page in self.cache.local_nodes

    def __len__(self) -> int:
        return len(self.cache.local_nodes)

    def evict(self, unreferenced: Callable[[int], bool]) -> int | None:
        return self.cache.evict_local(unreferenced)


def window_start_block(position: int, window: int, page_size: int) -> int:
    """The first block a query at `position` or later can see under a sliding window (keys in
    (p - window, p]): blocks before it are behind the window for good."""
    return max(0, position - window + 1) // page_size


def usable_blocks(local_pages: Sequence[int | None], window: int, page_size: int) -> int:
    """The prefix-cache rule of a hybrid pool: of a cached run of n blocks (`local_pages`: each
    block's cached local page, or None), the longest n' <= n such that every block overlapping
    the window of the first token computed after it, positions [n' * page_size - window + 1,
    n' * page_size - 1], still has its local page. Blocks before that need only their global
    page: no local layer reads them again."""
    for n in range(len(local_pages), 0, -1):
        lo = window_start_block(n * page_size, window, page_size)
        if all(local_pages[j] is not None for j in range(lo, n)):
            return n
    return 0


class PagePool:
    """Page ids with reference counts (of the global pool, or of a hybrid cache's local pool,
    whose `cache` is a `LocalPages`). A page is free, held (refcount > 0), or cached (in the
    prefix cache with refcount 0: evictable). free + held + cached-unheld == num_pages always.
    `pages`: the ids it manages, a range (one data shard's, `SchedulerConfig.shard_pages`);
    `refcount[p - pages.start]` is page p's count."""

    def __init__(self, pages: range, cache: PrefixCache | LocalPages | None):
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
