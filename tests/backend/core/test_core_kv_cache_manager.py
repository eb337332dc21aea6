"""KVCacheManager: shared physical pages, copy on write, salts, collisions, all-or-nothing."""

from __future__ import annotations

import logging

import pytest

from kvshare.core import KVCacheManager, PageCopy

PROMPT = list(range(100, 110))  # 10 tokens = 2 full pages of 4 + 2 tokens


def admit(kv: KVCacheManager, seq_id: int, tokens: list[int], salt: bytes = b"", budget: int = 1000):
    admission = kv.admit(seq_id, tokens, salt, token_budget=budget)
    assert admission is not None
    return admission


def run_prompt(kv: KVCacheManager, seq_id: int, tokens: list[int], salt: bytes = b""):
    """Admit and compute the whole prompt (what one prefill step does)."""
    admission = admit(kv, seq_id, tokens, salt)
    kv.release_pins()
    kv.commit(seq_id, tokens, len(tokens))
    return admission


def test_two_sequences_share_physical_pages() -> None:
    kv = KVCacheManager(16, 4)
    first = run_prompt(kv, 1, PROMPT)
    assert (first.num_cached_tokens, first.num_tokens, first.copy) == (0, 10, None)
    assert kv.page_table(1) == (0, 1, 2)
    second = admit(kv, 2, PROMPT)
    assert (second.num_cached_tokens, second.num_tokens, second.copy) == (8, 2, None)
    assert kv.page_table(2) == (0, 1, 3)  # pages 0 and 1 are the same physical pages
    assert [kv.pool.refcount(p) for p in range(4)] == [2, 2, 1, 1]
    stats = kv.stats()
    assert (stats.prefix_queries_tokens_total, stats.prefix_hits_tokens_total) == (20, 8)
    assert (stats.free, stats.active, stats.cached) == (12, 4, 0)
    kv.check_integrity()


def test_different_salts_never_share() -> None:
    kv = KVCacheManager(16, 4)
    run_prompt(kv, 1, PROMPT, salt=b"tenant-a")
    other = admit(kv, 2, PROMPT, salt=b"tenant-b")
    assert other.num_cached_tokens == 0
    assert set(kv.page_table(1)).isdisjoint(kv.page_table(2))
    same = admit(kv, 3, PROMPT, salt=b"tenant-a")
    assert same.num_cached_tokens == 8
    kv.check_integrity()


def test_a_forced_collision_never_serves_another_prompts_page() -> None:
    kv = KVCacheManager(16, 4, hash_fn=lambda data: b"\x07" * 16)  # every key collides
    run_prompt(kv, 1, [1, 2, 3, 4, 5])
    other = admit(kv, 2, [9, 9, 9, 9, 5])  # same key as page 0, different tokens
    assert other.num_cached_tokens == 0
    assert 0 not in kv.page_table(2)
    same = admit(kv, 3, [1, 2, 3, 4, 5])
    assert same.num_cached_tokens == 4 and kv.page_table(3)[0] == 0
    kv.check_integrity()


def test_prompt_ending_inside_a_cached_page_copies_its_leading_tokens() -> None:
    kv = KVCacheManager(16, 4)
    run_prompt(kv, 1, list(range(12)))  # 3 full pages: 0, 1, 2
    kv.free(1, list(range(12)))
    assert kv.stats().cached == 3
    short = admit(kv, 2, list(range(11)))  # ends inside page 2: cap 10 = 2 pages + 2 tokens of page 2
    assert short.num_cached_tokens == 10 and short.num_tokens == 1
    assert short.copy == PageCopy(src=2, dst=3, num_tokens=2)
    assert kv.page_table(2) == (0, 1, 3)
    assert kv.pool.refcount(2) == 1  # pinned until the copies of this step are done
    kv.check_integrity()
    kv.release_pins()
    assert kv.pool.is_cached(2)
    kv.check_integrity()


def test_identical_prompt_recomputes_exactly_its_last_token() -> None:
    kv = KVCacheManager(16, 4)
    run_prompt(kv, 1, list(range(8)))
    again = admit(kv, 2, list(range(8)))
    assert (again.num_cached_tokens, again.num_tokens) == (7, 1)  # the model needs its logits
    assert again.copy == PageCopy(src=1, dst=2, num_tokens=3)  # page 1 is shared by seq 1: never written
    assert kv.page_table(2) == (0, 2)


def test_released_tail_page_is_kept_for_copy_on_write() -> None:
    kv = KVCacheManager(16, 4)
    run_prompt(kv, 1, PROMPT)
    kv.free(1, PROMPT)
    assert kv.stats().cached == 3  # two full pages + the 2-token tail page 2
    diverging = PROMPT[:9] + [7, 7]
    admission = admit(kv, 2, diverging)
    assert admission.num_cached_tokens == 9
    assert admission.copy == PageCopy(src=2, dst=3, num_tokens=1)
    kv.check_integrity()


def test_writable_tail_is_always_private() -> None:
    kv = KVCacheManager(16, 4)
    run_prompt(kv, 1, list(range(8)))
    admit(kv, 2, list(range(8)) + [50])  # shares both full pages, writes only its own page
    assert kv.page_table(2) == (0, 1, 2)
    assert kv.pool.refcount(2) == 1
    kv.release_pins()
    kv.commit(2, list(range(8)) + [50], 9)
    kv.check_integrity()


def test_failed_admission_changes_nothing() -> None:
    kv = KVCacheManager(4, 4)
    run_prompt(kv, 1, list(range(8)))
    kv.free(1, list(range(8)))  # pages 0, 1 cached; pages 2, 3 free
    before = (kv.stats(), [kv.pool.refcount(p) for p in range(4)])
    # needs 2 cached hits (revived: no longer allocatable) + 3 fresh pages > 4 pages
    assert kv.admit(2, list(range(8)) + list(range(50, 60)), b"", token_budget=100) is None
    assert kv.admit(3, list(range(20, 30)), b"", token_budget=100, reserve_pages=2) is None
    assert (kv.stats(), [kv.pool.refcount(p) for p in range(4)]) == before
    assert not kv.has(2) and not kv.has(3)
    kv.check_integrity()


def test_extend_is_all_or_nothing() -> None:
    kv = KVCacheManager(3, 2)
    admit(kv, 1, [1, 2, 3])
    assert kv.page_table(1) == (0, 1)
    assert not kv.extend(1, 7)  # needs 2 more pages, 1 left
    assert kv.page_table(1) == (0, 1)
    assert kv.extend(1, 5)
    assert kv.page_table(1) == (0, 1, 2)
    kv.check_integrity()


def test_eviction_under_pressure_takes_chain_tails_first() -> None:
    kv = KVCacheManager(4, 2)
    run_prompt(kv, 1, [1, 2, 3, 4, 5, 6, 7])  # 3 full pages + partial
    kv.free(1, [1, 2, 3, 4, 5, 6, 7])
    assert kv.stats().cached == 4
    admit(kv, 2, [9, 9, 9])  # needs 2 pages: evicts the tail page 3, then page 2
    assert kv.page_table(2) == (3, 2)
    assert kv.stats().evictions_total == 2
    hit = kv.prefix.match([1, 2, 3, 4, 5, 6, 7], b"", 6)
    assert [e.page for e in hit.full] == [0, 1] and hit.partial is None
    kv.check_integrity()


def test_evicting_a_parent_frees_its_orphaned_children() -> None:
    kv = KVCacheManager(4, 2, policy="fifo")
    run_prompt(kv, 1, [1, 2, 3, 4, 0])  # pages 0, 1 full; page 2 keeps the 1-token tail
    kv.free(1, [1, 2, 3, 4, 0])  # FIFO birth order (tail first): 2, 1, 0
    run_prompt(kv, 2, [1, 2, 8, 8, 0])  # hits page 0; takes free page 3, evicts page 2
    assert kv.page_table(2) == (0, 3, 2)
    kv.free(2, [1, 2, 8, 8, 0])  # chain 0 -> 3 (full) -> 2 (tail)
    assert kv.stats().evictions_total == 1
    admit(kv, 3, [5, 5, 5, 5, 5, 5, 5])  # 4 pages: FIFO evicts 1, then 0 with its subtree 3, 2
    assert kv.page_table(3) == (1, 2, 3, 0)
    assert kv.stats().evictions_total == 5
    assert len(kv.prefix) == 0
    kv.check_integrity()


def test_free_is_idempotent_and_releases_everything() -> None:
    kv = KVCacheManager(8, 4)
    run_prompt(kv, 1, PROMPT)
    kv.free(1, PROMPT)
    kv.free(1, PROMPT)
    assert kv.stats().active == 0
    kv.check_integrity()


def test_sharing_off_allocates_private_pages() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    run_prompt(kv, 1, PROMPT)
    second = admit(kv, 2, PROMPT)
    assert second.num_cached_tokens == 0
    assert kv.page_table(2) == (3, 4, 5)
    kv.free(1, PROMPT)
    assert kv.stats().cached == 0


def test_low_watermark_warns_once_with_a_pool_dump(caplog: pytest.LogCaptureFixture) -> None:
    kv = KVCacheManager(10, 4, low_watermark=0.3)  # warn below 3 allocatable pages
    with caplog.at_level(logging.WARNING, logger="kvshare.core"):
        admit(kv, 1, list(range(20)))  # 5 pages
        admit(kv, 2, list(range(50, 66)))  # 4 pages: 1 left
        assert kv.extend(2, 17)  # 0 left: still the same dip
    warnings = [r for r in caplog.records if r.name == "kvshare.core"]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "low watermark (3 pages)" in message
    assert "total=10 free=1 active=9 cached=0" in message
    assert "top holders: [seq 1: 5 pages, seq 2: 4 pages]" in message
