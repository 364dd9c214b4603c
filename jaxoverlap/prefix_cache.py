"""A radix tree of KV pages keyed by the tokens they hold, with reference counts and LRU eviction.

Pure Python. Each node holds one full page: the `page_size` tokens of that page and the page
number. A request that matches a prefix locks the nodes on its path (they can't be evicted
while it runs) and unlocks them when it ends. A request's prompt pages go in, locked for it,
as soon as its prefill is scheduled (Scheduler._share_prefilled_pages), and a finished
request inserts the rest of its full pages.

Eviction runs on the scheduler's path whenever the free pages run short, which in a
long-running server (the cache holding every old prefix) is nearly every step. So it must
not walk the tree: a heap of (last_access, node) entries for evictable leaves is kept as the
tree changes, and entries that went stale (the node was touched, locked, got children or
left the tree) are dropped when they come to the top.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Sequence


class _Node:
    __slots__ = ("key", "page", "parent", "children", "lock_count", "last_access", "in_tree")

    def __init__(self, key: tuple[int, ...], page: int, parent: "_Node | None"):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.lock_count = 0
        self.last_access = 0
        self.in_tree = True


class PrefixCache:
    def __init__(self, page_size: int, enabled: bool = True):
        self.page_size = page_size
        self.enabled = enabled
        self._root = _Node((), -1, None)
        self._clock = itertools.count(1)
        self._num_pages = 0
        self._num_locked = 0  # nodes with lock_count > 0
        # (last_access, push order, node) for every unlocked leaf, plus stale entries.
        self._lru: list[tuple[int, int, _Node]] = []
        self._pushes = itertools.count()

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_evictable(self) -> int:
        return self._num_pages - self._num_locked

    def pages(self) -> list[int]:
        out, stack = [], list(self._root.children.values())
        while stack:
            n = stack.pop()
            out.append(n.page)
            stack.extend(n.children.values())
        return out

    def _chunks(self, tokens: Sequence[int]):
        ps = self.page_size
        for i in range(len(tokens) // ps):
            yield tuple(tokens[i * ps : (i + 1) * ps])

    def match(self, tokens: Sequence[int]) -> list[_Node]:
        """The nodes of the longest cached prefix of `tokens`, in whole pages."""
        if not self.enabled:
            return []
        node, path, now = self._root, [], next(self._clock)
        for key in self._chunks(tokens):
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = now
            self._offer(child)
            path.append(child)
            node = child
        return path

    # -- locking ---------------------------------------------------------------------------
    def lock(self, path: Sequence[_Node]) -> None:
        for n in path:
            if n.lock_count == 0:
                self._num_locked += 1
            n.lock_count += 1

    def unlock(self, path: Sequence[_Node]) -> None:
        now = next(self._clock)
        for n in path:
            assert n.lock_count > 0, "unlock of an unlocked prefix node"
            n.lock_count -= 1
            n.last_access = now
            if n.lock_count == 0:
                self._num_locked -= 1
                self._offer(n)

    # -- insert / evict --------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache the full pages of `tokens` (page i holds tokens[i*ps:(i+1)*ps]).

        Returns the pages that the cache did NOT take (because an equal page is already
        cached): the caller frees them. Pages past the last full page are not considered.
        """
        if not self.enabled:
            return list(pages)
        node, rejected, now = self._root, [], next(self._clock)
        for i, key in enumerate(self._chunks(tokens)):
            if i >= len(pages):
                break
            child = node.children.get(key)
            if child is None:
                child = _Node(key, pages[i], node)
                node.children[key] = child
                self._num_pages += 1
            elif child.page != pages[i]:
                rejected.append(pages[i])
            child.last_access = now
            node = child
        self._offer(node)  # the last page; the nodes above it are no leaves
        return rejected

    def evict(self, num_pages: int) -> list[int]:
        """Remove up to `num_pages` unlocked leaves, least recently used first; return their pages."""
        freed: list[int] = []
        while self._lru and len(freed) < num_pages:
            stamp, _, n = heapq.heappop(self._lru)
            if not self._evictable(n) or stamp != n.last_access:
                continue  # stale: a fresher entry for n exists, or n is no evictable leaf now
            parent = n.parent
            del parent.children[n.key]
            n.in_tree = False
            self._num_pages -= 1
            freed.append(n.page)
            self._offer(parent)  # it may have become a leaf
        return freed

    def _evictable(self, n: _Node) -> bool:
        return n.in_tree and n is not self._root and not n.children and n.lock_count == 0

    def _offer(self, n: _Node) -> None:
        """Queue n for eviction at its current last_access, if it is an unlocked leaf."""
        if self._evictable(n):
            heapq.heappush(self._lru, (n.last_access, next(self._pushes), n))
            if len(self._lru) > 4 * self._num_pages + 64:  # stale entries: rebuild from the tree
                self._lru = [(m.last_access, next(self._pushes), m) for m in self._leaves() if self._evictable(m)]
                heapq.heapify(self._lru)

    def _leaves(self):
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                yield n

    def check_integrity(self) -> None:
        count, locked, stack = 0, 0, list(self._root.children.values())
        while stack:
            n = stack.pop()
            count += 1
            locked += n.lock_count > 0
            assert n.lock_count >= 0
            assert len(n.key) == self.page_size
            for c in n.children.values():
                assert c.parent is n
                assert c.lock_count <= n.lock_count, "a path is locked from the root down"
            stack.extend(n.children.values())
        assert count == self._num_pages, f"node count {count} != {self._num_pages}"
        assert locked == self._num_locked
        queued = {id(n) for stamp, _, n in self._lru if self._evictable(n) and stamp == n.last_access}
        missing = [n.page for n in self._leaves() if self._evictable(n) and id(n) not in queued]
        assert not missing, f"evictable leaves not queued for eviction: pages {missing}"
