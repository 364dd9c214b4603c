"""Host-side allocators and the prefix cache, without JAX."""
import pytest

from jaxoverlap.page_allocator import EntryAllocator, PageAllocator
from jaxoverlap.prefix_cache import PrefixCache


def test_page_allocator_verbs_and_integrity():
    a = PageAllocator(num_pages=9, page_size=4)
    assert a.capacity == 8 and a.num_free == 8
    assert a.can_allocate(8) and not a.can_allocate(9)
    got = a.allocate(5)
    assert 0 not in got and len(set(got)) == 5
    a.check_integrity(got)
    with pytest.raises(MemoryError):
        a.allocate(4)
    a.free(got[:2])
    with pytest.raises(ValueError, match="double free"):
        a.free(got[:1])
    with pytest.raises(ValueError):
        a.free([0])  # the dummy page is never handed out
    a.check_integrity(got[2:])
    with pytest.raises(AssertionError, match="leaked"):
        a.check_integrity(got[3:])


def test_entry_allocator():
    e = EntryAllocator(3)
    got = [e.allocate() for _ in range(3)]
    assert sorted(got) == [1, 2, 3] and not e.can_allocate()
    e.free(got[0])
    e.check_integrity(got[1:])
    with pytest.raises(ValueError):
        e.free(got[0])


def test_prefix_cache_match_insert_lock_evict():
    pc = PrefixCache(page_size=2)
    toks = [1, 2, 3, 4, 5, 6, 7]
    assert pc.insert(toks, [10, 11, 12]) == []  # 3 full pages; the 7th token is not a full page
    assert pc.num_pages == 3
    assert [n.page for n in pc.match([1, 2, 3, 4, 9, 9])] == [10, 11]
    # An equal page inserted again is handed back to the caller to free.
    assert pc.insert([1, 2, 3, 4, 8, 8], [20, 21, 22]) == [20, 21]
    assert pc.num_pages == 4
    path = pc.match([1, 2, 3, 4, 5, 6])
    pc.lock(path)
    assert pc.num_evictable == 1
    # Only the unlocked leaf [8, 8] can go.
    assert pc.evict(10) == [22]
    pc.unlock(path)
    pc.check_integrity()
    # LRU: leaves go first, then their parents.
    assert sorted(pc.evict(10)) == [10, 11, 12]
    assert pc.num_pages == 0


def test_prefix_cache_disabled():
    pc = PrefixCache(page_size=2, enabled=False)
    assert pc.insert([1, 2, 3, 4], [5, 6]) == [5, 6]
    assert pc.match([1, 2, 3, 4]) == []


def _evictable_leaves(pc):
    """The unlocked leaves, found by walking the whole tree (what evict must not do)."""
    return {n.page: n for n in pc._leaves() if n.lock_count == 0}


@pytest.mark.parametrize("seed", range(20))
def test_prefix_cache_eviction_is_lru_over_random_operations(seed):
    """Random inserts, matches, locks, unlocks and evictions over a small token alphabet (so
    paths share prefixes): every page evict returns is, at that moment, an unlocked leaf with
    the oldest last access; evict takes as many as it can; the queue of evictable leaves stays
    complete (check_integrity)."""
    import random

    rng = random.Random(seed)
    pc = PrefixCache(page_size=2)
    next_page, locked = 1, []
    for _ in range(300):
        op = rng.random()
        if op < 0.35:
            toks = [rng.randrange(3) for _ in range(2 * rng.randrange(1, 6))]
            n = len(toks) // 2
            pc.insert(toks, list(range(next_page, next_page + n)))
            next_page += n
        elif op < 0.55:
            path = pc.match([rng.randrange(3) for _ in range(2 * rng.randrange(1, 6))])
            pc.lock(path)
            locked.append(path)
        elif op < 0.7 and locked:
            pc.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            want = rng.randrange(1, 4)
            for _ in range(want):
                leaves = _evictable_leaves(pc)
                got = pc.evict(1)
                if not leaves:
                    assert got == []
                    break
                (page,) = got
                assert page in leaves
                assert leaves[page].last_access == min(n.last_access for n in leaves.values())
        pc.check_integrity()
    for path in locked:
        pc.unlock(path)
    total = pc.num_pages
    assert len(pc.evict(total + 5)) == total and pc.num_pages == 0  # everything goes, once


def test_prefix_cache_evict_does_not_walk_the_tree():
    """With thousands of cached pages, evicting one page touches the queue, not the tree."""
    pc = PrefixCache(page_size=2)
    for i in range(3000):
        pc.insert([i, i, 1, 1], [2 * i + 1, 2 * i + 2])
    calls = 0
    walk = pc._leaves

    def counting_walk():
        nonlocal calls
        calls += 1
        return walk()

    pc._leaves = counting_walk
    assert pc.evict(1) == [2]  # the oldest insert's leaf
    assert pc.evict(1) == [1]  # then its parent, now a leaf with the same last access
    assert calls == 0


def test_prefix_cache_queue_rebuilds_keep_lru_order():
    """Each match queues its leaves again (stale entries stay behind), and the queue is
    rebuilt from the tree once it outgrows 4 entries per page: it stays bounded, holds every
    evictable leaf, and eviction still goes least recently used first, locked leaves last."""
    import random

    rng = random.Random(0)
    pc = PrefixCache(page_size=2)
    paths = [[a, a, b, b] for a in range(3) for b in range(4)]  # 3 roots x 4 leaves: 15 pages
    for i, toks in enumerate(paths):
        pc.insert(toks, [2 * i + 1, 2 * i + 2])
    pages = pc.num_pages
    held = pc.match(paths[5])
    pc.lock(held)
    longest = 0
    for _ in range(2000):
        pc.match(rng.choice(paths))
        longest = max(longest, len(pc._lru))
        pc.check_integrity()
    assert longest <= 4 * pages + 64 + 1  # rebuilt, not grown with every match
    order = []
    while (leaves := _evictable_leaves(pc)):
        oldest = min(n.last_access for n in leaves.values())
        (page,) = pc.evict(1)
        assert leaves[page].last_access == oldest
        order.append(page)
        pc.check_integrity()
    assert pc.num_pages == len(held) and set(order).isdisjoint(n.page for n in held)
    pc.unlock(held)
    assert len(pc.evict(pages)) == len(held) and pc.num_pages == 0
