"""PagePool: exact page ids, refcounts, free/active/cached accounting, all-or-nothing allocation."""

from __future__ import annotations

import pytest

from kvshare.core import PagePool, PoolExhausted


def counts(pool: PagePool) -> tuple[int, int, int]:
    return pool.num_free, pool.num_active, pool.num_cached


def test_allocates_lowest_ids_first_and_reuses_the_last_freed() -> None:
    pool = PagePool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.release(1)
    assert counts(pool) == (2, 2, 0)
    assert pool.allocate(1) == [1]  # LIFO free list: O(1), warm page first
    assert pool.allocate(1) == [3]
    pool.check_integrity()


def test_allocation_is_all_or_nothing() -> None:
    pool = PagePool(3)
    pool.allocate(2)
    with pytest.raises(PoolExhausted, match="need 2 pages, only 1 free"):
        pool.allocate(2)
    assert counts(pool) == (1, 2, 0)
    pool.check_integrity()


def test_refcounts_and_cached_pages() -> None:
    pool = PagePool(3)
    a, b, c = pool.allocate(3)
    pool.retain(a)
    assert pool.refcount(a) == 2
    pool.mark_reusable(a)
    pool.mark_reusable(b)
    pool.release(a)
    assert counts(pool) == (0, 3, 0)
    pool.release(a)
    pool.release(b)
    pool.release(c)
    assert counts(pool) == (1, 0, 2)  # a, b hold a registered prefix: cached, still hits
    assert pool.is_cached(a) and pool.is_cached(b) and not pool.is_cached(c)
    pool.retain(b)  # prefix hit revives it
    assert counts(pool) == (1, 1, 1)
    pool.check_integrity()


def test_eviction_goes_through_the_policy_and_notifies_the_owner() -> None:
    evicted: list[int] = []
    pool = PagePool(3, "lru", on_evict=evicted.append)
    pages = pool.allocate(3)
    for page in pages:
        pool.mark_reusable(page)
    for page in (2, 0, 1):
        pool.release(page)
    assert pool.allocate(2) == [2, 0]  # no free page: evict in LRU order
    assert evicted == [2, 0]
    assert pool.evictions_total == 2
    assert not pool.is_reusable(2)
    assert counts(pool) == (0, 2, 1)
    pool.check_integrity()


def test_free_pages_are_taken_before_cached_ones() -> None:
    evicted: list[int] = []
    pool = PagePool(3, on_evict=evicted.append)
    a, b, c = pool.allocate(3)
    pool.mark_reusable(a)
    pool.release(a)
    pool.release(b)
    assert pool.allocate(1) == [b]
    assert evicted == []
    assert pool.allocate(1) == [a]
    assert evicted == [a]


def test_unmark_reusable_frees_a_cached_page() -> None:
    pool = PagePool(2)
    (a,) = pool.allocate(1)
    pool.mark_reusable(a)
    pool.release(a)
    pool.unmark_reusable(a)
    assert counts(pool) == (2, 0, 0)
    pool.check_integrity()


def test_double_free_and_bad_ids_are_caught() -> None:
    pool = PagePool(2)
    (a,) = pool.allocate(1)
    pool.release(a)
    with pytest.raises(AssertionError, match="double free"):
        pool.release(a)
    with pytest.raises(IndexError, match="outside 0..1"):
        pool.retain(5)


def test_check_integrity_names_the_broken_invariant() -> None:
    pool = PagePool(4)
    pool.allocate(2)
    pool._refcount[1] = 0  # a leak: neither free, nor referenced, nor cached
    with pytest.raises(AssertionError, match="page 1: refcount 0, not free, not reusable"):
        pool.check_integrity()
    pool = PagePool(4)
    pool._free.append(0)
    with pytest.raises(AssertionError, match=r"free list holds duplicates: \[0\]"):
        pool.check_integrity()


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        PagePool(0)
