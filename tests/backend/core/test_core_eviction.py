"""Eviction policies: exact victim order, history across revive/release, the factory."""

from __future__ import annotations

import pytest

from kvshare.core import (
    POLICY_NAMES,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    SecondChancePolicy,
    make_policy,
)


def drain(policy: EvictionPolicy) -> list[int]:
    order = []
    while len(policy):
        order.append(policy.pop_victim())
    policy.check_integrity()
    return order


def test_lru_evicts_least_recently_released_first() -> None:
    lru = LRUPolicy()
    for page in (1, 2, 3):
        lru.insert(page)
    lru.remove(1)  # a prefix hit revives page 1 ...
    lru.insert(1)  # ... and its sequence releases it again: now the most recent
    lru.touch(2)  # a hit on a cached page counts as a use
    assert drain(lru) == [3, 1, 2]


def test_lfu_evicts_fewest_uses_first_and_breaks_ties_by_recency() -> None:
    lfu = LFUPolicy()
    for page in (1, 2, 3):
        lfu.insert(page)
    for _ in range(2):
        lfu.remove(3)
        lfu.touch(3)
        lfu.insert(3)
    lfu.touch(1)  # 1: 2 uses, 3: 3 uses, 2: 1 use
    lfu.insert(4)
    lfu.insert(5)  # 1 use each, released after 2
    assert drain(lfu) == [2, 4, 5, 1, 3]


def test_lfu_history_survives_revive_and_is_forgotten_on_eviction() -> None:
    lfu = LFUPolicy()
    lfu.insert(7)
    lfu.touch(7)
    lfu.touch(7)  # 3 uses
    lfu.remove(7)  # active for a while
    lfu.insert(8)
    lfu.insert(7)
    assert lfu.pop_victim() == 8
    assert lfu.pop_victim() == 7
    lfu.insert(7)  # page 7 was evicted: its new content starts at 1 use
    lfu.insert(9)
    assert drain(lfu) == [7, 9]


def test_fifo_keeps_first_cached_order_regardless_of_hits() -> None:
    fifo = FIFOPolicy()
    for page in (1, 2, 3):
        fifo.insert(page)
    fifo.remove(1)
    fifo.touch(1)
    fifo.insert(1)
    fifo.touch(2)
    assert drain(fifo) == [1, 2, 3]


def test_second_chance_skips_a_referenced_page_once() -> None:
    clock = SecondChancePolicy()
    for page in (1, 2, 3):
        clock.insert(page)
    clock.touch(1)
    assert clock.pop_victim() == 2  # 1 was referenced: its bit is cleared and it goes to the back
    clock.insert(4)
    assert drain(clock) == [3, 1, 4]


def test_second_chance_reference_bit_set_while_active_counts() -> None:
    clock = SecondChancePolicy()
    clock.insert(1)
    clock.insert(2)
    clock.remove(1)
    clock.touch(1)  # hit while the page was in use
    clock.insert(1)
    assert drain(clock) == [2, 1]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_remove_and_discard_take_pages_out(name: str) -> None:
    policy = make_policy(name)
    for page in range(5):
        policy.insert(page)
    policy.remove(3)
    policy.discard(1)
    policy.discard(42)  # unknown pages are ignored
    assert 3 not in policy and 1 not in policy and len(policy) == 3
    assert sorted(drain(policy)) == [0, 2, 4]
    with pytest.raises(LookupError):
        policy.pop_victim()


@pytest.mark.parametrize("name", ["lfu", "fifo", "second-chance"])
def test_heap_policies_stay_compact_under_churn(name: str) -> None:
    policy = make_policy(name)
    for page in range(4):
        policy.insert(page)
    for _ in range(10_000):
        policy.remove(2)
        policy.touch(2)
        policy.insert(2)
    assert len(policy._heap) < 200  # type: ignore[attr-defined]
    policy.check_integrity()
    assert sorted(drain(policy)) == [0, 1, 2, 3]


def test_make_policy_names_aliases_and_errors() -> None:
    assert isinstance(make_policy("LRU"), LRUPolicy)
    assert isinstance(make_policy("lfu"), LFUPolicy)
    assert isinstance(make_policy("fifo"), FIFOPolicy)
    assert isinstance(make_policy("second_chance"), SecondChancePolicy)
    assert isinstance(make_policy("clock"), SecondChancePolicy)
    with pytest.raises(ValueError, match=r"unknown eviction policy 'mru'.*lru, lfu, fifo, second-chance"):
        make_policy("mru")
