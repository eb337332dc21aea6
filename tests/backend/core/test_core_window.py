"""Sliding-window release: pages wholly before a sequence's window go back to the pool while it runs.

Exact page ids for the release, admissions and forks; a scheduler replay whose shadow KV checks
every in-window read; Hypothesis over random requests, windows, page sizes, commits, frees and
forks for the pool invariant and for no page leaking once every request ended.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare.core import KVCacheManager, PageCopy
from kvshare.core.window import RELEASED, first_visible, max_pages_held, pages_before_window

from core_sim import ShadowRunner, make_runner


def totals(kv: KVCacheManager) -> tuple[int, int, int]:
    stats = kv.stats()
    assert stats.free + stats.active + stats.cached == stats.total
    return stats.free, stats.active, stats.cached


def test_window_arithmetic() -> None:
    assert first_visible(54, 20) == 35 and first_visible(10, 20) == 0 and first_visible(54, 0) == 0
    assert [pages_before_window(q, 6, 4) for q in (0, 8, 9, 12, 13, 16, 17)] == [0, 0, 1, 1, 2, 2, 3]
    assert pages_before_window(1000, 0, 4) == 0                        # full attention keeps every page
    # 32k tokens, 4k window, page 16: 256 pages of window plus the page the next token starts
    assert max_pages_held(32768, 4096, 16) == 257
    assert max_pages_held(32768, 0, 16) == 2048
    assert max_pages_held(32768, 4096, 16, chunk=512) == 289
    assert max_pages_held(20, 4096, 16) == 2                          # never more than all its pages


def test_commit_releases_the_pages_before_the_window_exact_ids() -> None:
    kv = KVCacheManager(16, 4, window=6, low_watermark=0.0)
    tokens = list(range(100, 113))                                      # 13 tokens
    admission = kv.admit(1, tokens[:10], b"", token_budget=100)
    assert (admission.num_cached_tokens, admission.num_tokens) == (0, 10)
    assert kv.page_table(1) == (0, 1, 2)
    kv.commit(1, tokens[:10], 10)            # next query 10 sees keys 5..: page 0 (0..3) goes back
    assert kv.page_table(1) == (RELEASED, 1, 2)
    assert kv.pool.is_cached(0) and kv.pages_held(1) == 2
    assert totals(kv) == (13, 2, 1)
    kv.check_integrity()
    assert kv.extend(1, 11)
    kv.commit(1, tokens[:11], 11)            # sees 6..: page 1 (4..7) still needed
    assert kv.page_table(1) == (RELEASED, 1, 2)
    assert kv.extend(1, 13)
    assert kv.page_table(1) == (RELEASED, 1, 2, 3)
    kv.commit(1, tokens[:13], 13)            # sees 8..: page 1 goes back; page 2 (8..11) registered, kept
    assert kv.page_table(1) == (RELEASED, RELEASED, 2, 3)
    assert [kv.pool.is_cached(p) for p in (0, 1, 2)] == [True, True, False]
    assert totals(kv) == (12, 2, 2)
    kv.check_integrity()
    kv.free(1, tokens[:13])
    assert kv.num_sequences == 0 and totals(kv)[1] == 0
    kv.check_integrity()


def test_a_prefix_hit_takes_no_reference_on_pages_before_its_window() -> None:
    kv = KVCacheManager(16, 4, window=6, low_watermark=0.0)
    first = list(range(100, 113))
    kv.admit(1, first[:10], b"", token_budget=100)
    kv.commit(1, first[:10], 10)
    kv.extend(1, 13)
    kv.commit(1, first[:13], 13)                                         # table (-1, -1, 2, 3), 0 and 1 cached
    # the same 10-token prompt: full pages 0 and 1 hit, one token of page 2 is copied; its first
    # query (9) sees keys 4..: page 0 is not taken, page 1 is revived
    second = kv.admit(2, first[:10], b"", token_budget=100)
    assert (second.num_cached_tokens, second.num_tokens) == (9, 1)
    assert second.copy == PageCopy(src=2, dst=4, num_tokens=1)
    assert kv.page_table(2) == (RELEASED, 1, 4)
    assert kv.pool.is_cached(0) and kv.pool.refcount(1) == 1 and kv.pool.refcount(2) == 2   # 2: seq 1 + pin
    assert kv.stats().prefix_hits_tokens_total == 9                        # every cached token counts
    kv.check_integrity()
    kv.release_pins()
    kv.commit(2, first[:10], 10)                                          # sees 5..: page 1 still needed
    assert kv.page_table(2) == (RELEASED, 1, 4)
    kv.free(1, first[:13])
    kv.free(2, first[:10])
    assert totals(kv)[1] == 0
    kv.check_integrity()


def test_a_hit_on_a_long_prefix_fits_a_pool_smaller_than_the_prefix() -> None:
    """A 24-token prompt cached in 6 pages; a pool with 2 free pages still admits its repeat: only
    the hits inside the window are revived."""
    kv = KVCacheManager(8, 4, window=4, low_watermark=0.0)
    prompt = list(range(200, 224))
    for start in range(0, 24, 4):                                         # one page per step
        assert kv.admit(1, prompt, b"", token_budget=4) is not None if start == 0 else kv.extend(1, start + 4)
        kv.commit(1, prompt, start + 4)
    kv.free(1, prompt)
    assert totals(kv) == (2, 0, 6)
    again = kv.admit(2, prompt, b"", token_budget=100, reserve_pages=1)
    # cap 23: five full pages and 3 tokens copied from page 5; first query 23 sees keys 20..
    assert (again.num_cached_tokens, again.num_tokens) == (23, 1)
    assert kv.page_table(2) == (RELEASED,) * 5 + (6,)
    assert again.copy == PageCopy(src=5, dst=6, num_tokens=3)
    kv.check_integrity()


def test_fork_shares_the_window_and_refuses_when_the_parent_released_what_the_child_reads() -> None:
    kv = KVCacheManager(16, 4, window=4, low_watermark=0.0)
    prompt = list(range(100, 110))                                        # 10 tokens
    kv.admit(1, prompt, b"", token_budget=100)
    kv.commit(1, prompt, 10)                                              # sees 7..: page 0 released
    assert kv.page_table(1) == (RELEASED, 1, 2)
    assert kv.can_fork(1, 9)                                              # the child's query 9 sees 6..
    child = kv.fork(2, 1, 9)
    assert child == type(child)(9, 1, PageCopy(src=2, dst=3, num_tokens=1))
    assert kv.page_table(2) == (RELEASED, 1, 3) and kv.pool.refcount(1) == 2
    kv.check_integrity()
    tokens = prompt + [7, 7]
    kv.extend(1, 12)
    kv.commit(1, tokens, 12)                                              # sees 9..: page 1 released by 1
    assert kv.page_table(1) == (RELEASED, RELEASED, 2) and kv.pool.refcount(1) == 1
    assert not kv.can_fork(1, 9)
    with pytest.raises(ValueError, match="released pages inside the window"):
        kv.fork(3, 1, 9)
    kv.free(2)
    kv.free(1, tokens)
    assert totals(kv)[1] == 0
    kv.check_integrity()


def test_window_zero_keeps_every_page() -> None:
    kv = KVCacheManager(16, 4, low_watermark=0.0)
    tokens = list(range(100, 113))
    kv.admit(1, tokens, b"", token_budget=100)
    kv.commit(1, tokens, 13)
    assert kv.page_table(1) == (0, 1, 2, 3) and kv.pages_held(1) == 4
    assert kv.release_window(1, 13) == 0
    kv.check_integrity()


def test_a_request_longer_than_the_pool_runs_with_a_window_and_is_refused_without() -> None:
    prompt = [random.Random(3).randrange(50) for _ in range(40)]
    full = make_runner(num_pages=8, page_size=4, max_prefill_chunk=8)
    full.add(1, prompt, max_new_tokens=30)                                # 70 tokens: 18 pages > 8
    plan = full.step()
    assert [seq for seq, _ in plan.rejected] == [1]
    windowed = make_runner(num_pages=8, page_size=4, max_prefill_chunk=8, window=8)
    windowed.add(1, prompt, max_new_tokens=30)
    peak = 0
    while windowed.scheduler.num_running or windowed.scheduler.num_waiting:
        plan = windowed.schedule()                  # held while the step runs: before its release
        assert not plan.rejected and not plan.preempted
        if windowed.kv.has(1):
            peak = max(peak, windowed.kv.pages_held(1))
        windowed.complete()
    assert len(windowed.tokens[1]) == 70
    # chunks of 8 from position 8k see keys from 8k - 7: pages 2k-2 .. 2k+1; the bound for any
    # alignment of a window of 8 and a chunk of 8 (15 positions) is 5 (the shadow checked every read)
    assert peak == 4 and windowed.kv.max_pages_held(69, chunk=8) == 5
    assert totals(windowed.kv)[1] == 0


def test_overlap_scheduling_releases_at_advance() -> None:
    runner = make_runner(num_pages=16, page_size=4, max_prefill_chunk=8, window=6)
    runner.add(1, list(range(1, 11)), max_new_tokens=12)
    held = []
    while runner.scheduler.num_running or runner.scheduler.num_waiting or runner.launched:
        if runner.scheduler.num_running or runner.scheduler.num_waiting:
            runner.launch()
            if runner.kv.has(1):
                held.append(runner.kv.pages_held(1))
        if len(runner.launched) > 1 or (runner.launched and not runner.scheduler.num_running):
            runner.resolve()
    assert len(runner.tokens[1]) == 22
    assert max(held) <= runner.kv.max_pages_held(21, chunk=8)
    assert max(held[2:]) <= max_pages_held(21, 6, 4)          # decodes: the window's pages only
    assert totals(runner.kv)[1] == 0


# -- properties ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.integers(1, 8), window=st.integers(0, 24), num_pages=st.integers(6, 40),
       seed=st.integers(0, 2**16), caching=st.booleans())
def test_random_operations_keep_the_pool_whole_and_leak_nothing(page_size, window, num_pages, seed, caching) -> None:
    """admit / extend+commit / fork / free at random on one manager: after every operation the
    pool's counts add up and check_integrity holds; no in-window slot is ever RELEASED; once every
    sequence is freed, no page is active."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_pages, page_size, window=window, enable_prefix_caching=caching, low_watermark=0.0)
    stems = [[rng.randrange(6) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
    tokens: dict[int, list[int]] = {}
    computed: dict[int, int] = {}
    next_id = 0
    for _ in range(80):
        op = rng.random()
        if op < 0.3 or not tokens:
            prompt = rng.choice(stems)[: rng.randrange(1, 30)] + [rng.randrange(6) for _ in range(rng.randrange(3))]
            admission = kv.admit(next_id, prompt, b"", token_budget=rng.randrange(1, 12))
            if admission is not None:
                kv.release_pins()
                tokens[next_id] = prompt
                computed[next_id] = admission.num_cached_tokens
                total = admission.num_cached_tokens + admission.num_tokens
                kv.commit(next_id, prompt, total)
                computed[next_id] = total
            next_id += 1
        elif op < 0.75:
            seq = rng.choice(list(tokens))
            more = rng.randrange(1, 8)
            while len(tokens[seq]) < computed[seq] + more:
                tokens[seq].append(rng.randrange(6))
            if kv.extend(seq, computed[seq] + more):
                computed[seq] += more
                kv.commit(seq, tokens[seq], computed[seq])
        elif op < 0.85:
            parent = rng.choice(list(tokens))
            shared = rng.randrange(0, computed[parent] + 1)
            if kv.can_fork(parent, shared):
                admission = kv.fork(next_id, parent, shared)
                if admission is not None:
                    kv.release_pins()
                    tokens[next_id] = tokens[parent][:shared] + [rng.randrange(6)]
                    kv.commit(next_id, tokens[next_id], shared + 1)
                    computed[next_id] = shared + 1
            else:
                assert window > 0
            next_id += 1
        else:
            seq = rng.choice(list(tokens))
            ids, n = tokens.pop(seq), computed.pop(seq)
            kv.free(seq, ids[:n] if rng.random() < 0.5 else None)     # with ids: its partial tail is kept
        kv.check_integrity()
        totals(kv)
        for seq, n in computed.items():
            table = kv.page_table(seq)
            first = first_visible(n, window) // page_size
            assert all(page >= 0 for page in table[first:]), f"seq {seq}: a slot inside its window is RELEASED"
            assert kv.pages_held(seq) <= max_pages_held(max(n, 1), window, page_size)
    for seq in list(tokens):
        kv.free(seq)
    kv.check_integrity()
    assert totals(kv)[1] == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.integers(1, 6), window=st.integers(1, 20), num_pages=st.integers(8, 24),
       seed=st.integers(0, 2**16), overlap=st.booleans())
def test_scheduler_replay_reads_the_right_keys_inside_every_window(page_size, window, num_pages, seed, overlap) -> None:
    """Random requests over shared prefixes, forks (parallel samples) and cancellations through the
    scheduler, with the shadow KV checking that every key inside every query's window holds the
    right prefix (released pages reallocated elsewhere never are): the run ends with no page
    active, the pool whole, nothing rejected that the window lets fit."""
    rng = random.Random(seed)
    runner = make_runner(num_pages=num_pages, page_size=page_size, max_running=4, max_step_tokens=24,
                         max_prefill_chunk=rng.choice([2, 5, 24]), window=window, host_slots=rng.choice([0, 6]))
    stem = [rng.randrange(40) for _ in range(rng.randrange(4, 30))]
    parents: list[int] = []
    needs: dict[int, int] = {}
    prompts: dict[int, list[int]] = {}
    rejected: list[tuple[int, str]] = []
    for seq_id in range(8):
        prompt = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(40) for _ in range(rng.randrange(3))]
        max_new = rng.randrange(1, 25)
        fork_of = rng.choice(parents) if parents and rng.random() < 0.3 else None
        if fork_of is not None:
            prompt = list(prompts[fork_of])
        add(runner, seq_id, prompt, max_new, fork_of)
        prompts[seq_id] = prompt
        needs[seq_id] = len(prompt) + max_new - 1
        if fork_of is None:
            parents.append(seq_id)
    steps = 0
    while runner.scheduler.num_running or runner.scheduler.num_waiting or runner.launched:
        steps += 1
        assert steps < 2000
        if rng.random() < 0.03 and runner.scheduler.num_running:
            runner.finish(rng.choice(list(runner.scheduler._running)))
        if overlap:
            if runner.scheduler.num_running or runner.scheduler.num_waiting:
                rejected += runner.launch().rejected
            if len(runner.launched) > 1 or (runner.launched and not runner.scheduler.num_running):
                runner.resolve()
        else:
            rejected += runner.step().rejected
        totals(runner.kv)
    for seq_id, _ in rejected:        # only a window that does not fit the whole pool is refused
        assert runner.kv.max_pages_held(needs[seq_id]) > num_pages
    for seq_id in range(8):
        runner.finish(seq_id)
    runner.kv.check_integrity()
    assert totals(runner.kv)[1] == 0


def add(runner: ShadowRunner, seq_id: int, prompt: list[int], max_new: int, fork_of: int | None) -> None:
    runner.scheduler.add(seq_id, prompt, max_new_tokens=max_new, fork_of=fork_of)
    runner.tokens[seq_id] = list(prompt)
    runner.salts[seq_id] = b""
    runner.fingerprints[seq_id] = []
