"""Host-side allocator of KV-cache pages. Pure Python: no JAX.

Slots are handed out in whole pages (slot = page * page_size + offset). Page 0 is the
dummy page of entry 0 and padded tokens; it is never allocated.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("the KV cache needs at least 2 pages (page 0 is the dummy page)")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))
        self._is_free = [False] + [True] * (num_pages - 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Allocatable pages (all but the dummy page)."""
        return self.num_pages - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if not 0 < p < self.num_pages:
                raise ValueError(f"page {p} is not an allocatable page")
            if self._is_free[p]:
                raise ValueError(f"double free of page {p}")
            self._is_free[p] = True
            self._free.append(p)

    def check_integrity(self, held: Iterable[int]) -> None:
        """Every page is exactly one of: free, or held (by a request or the prefix cache)."""
        held = list(held)
        held_set = set(held)
        assert len(held_set) == len(held), "a page is held twice"
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a page is on the free list twice"
        assert 0 not in held_set and 0 not in free_set, "the dummy page escaped"
        assert not (held_set & free_set), f"pages both free and held: {sorted(held_set & free_set)[:8]}"
        missing = set(range(1, self.num_pages)) - held_set - free_set
        assert not missing, f"leaked pages: {sorted(missing)[:8]} (+{max(0, len(missing) - 8)})"
        assert all(self._is_free[p] == (p in free_set) for p in range(self.num_pages))


class EntryAllocator:
    """Relay entries 1..max_running (entry 0 is the dummy entry of padded rows)."""

    def __init__(self, max_running: int):
        self.num_entries = max_running + 1
        self._free: deque[int] = deque(range(1, max_running + 1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        e = self._free.popleft()
        self._used.add(e)
        return e

    def free(self, entry: int) -> None:
        if entry not in self._used:
            raise ValueError(f"entry {entry} is not in use")
        self._used.remove(entry)
        self._free.append(entry)

    def check_integrity(self, held: Iterable[int]) -> None:
        held = list(held)
        assert len(set(held)) == len(held), "an entry is held by two requests"
        assert set(held) == self._used, f"entries in use {sorted(self._used)} != held by requests {sorted(held)}"
        assert len(self._free) + len(self._used) == self.num_entries - 1
