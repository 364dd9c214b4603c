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
