"""Scheduler: continuous batching, chunked prefill, admission, preemption, finish in every state."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from core_sim import ShadowRunner, make_runner

from kvshare.core import PageCopy, Scheduler, SeqState


def make(num_pages: int = 16, page_size: int = 4, **kw) -> ShadowRunner:
    return make_runner(num_pages, page_size, **kw)


def shape(plan) -> list[tuple[int, int, int, bool]]:
    return [(c.seq_id, c.start, c.num_tokens, c.samples) for c in plan.chunks]


def test_chunked_prefill_then_decode() -> None:
    sim = make(max_prefill_chunk=4)
    sim.add(1, list(range(10)), max_new_tokens=3)
    assert shape(sim.step()) == [(1, 0, 4, False)]
    assert shape(sim.step()) == [(1, 4, 4, False)]
    assert shape(sim.step()) == [(1, 8, 2, True)]
    assert shape(sim.step()) == [(1, 10, 1, True)]
    assert sim.scheduler.page_table(1) == (0, 1, 2)
    assert shape(sim.step()) == [(1, 11, 1, True)]
    assert sim.scheduler.sequence(1).state is SeqState.DONE  # max_new_tokens reached: pages released
    assert sim.scheduler.stats().active == 0
    sim.finish(1)


def test_continuous_batching_mixes_prefill_chunks_and_decodes_under_the_budget() -> None:
    sim = make(max_step_tokens=5, max_prefill_chunk=4)
    sim.add(1, [1, 2, 3], max_new_tokens=4)
    sim.add(2, [4, 5, 6, 7, 8, 9], max_new_tokens=4)
    assert shape(sim.step()) == [(1, 0, 3, True), (2, 0, 2, False)]
    # prefill chunks first, then decodes; the decode was budgeted first
    assert shape(sim.step()) == [(2, 2, 4, True), (1, 3, 1, True)]
    assert shape(sim.step()) == [(1, 4, 1, True), (2, 6, 1, True)]  # decodes in admission order


def test_fcfs_and_max_running() -> None:
    sim = make(max_running=1)
    sim.add(1, [1, 2], max_new_tokens=2)
    sim.add(2, [3, 4], max_new_tokens=1)
    assert shape(sim.step()) == [(1, 0, 2, True)]
    assert sim.scheduler.num_waiting == 1
    assert shape(sim.step()) == [(1, 2, 1, True)]
    assert shape(sim.step()) == [(2, 0, 2, True)]
    assert sim.run_until_idle() == 0


def test_prefix_hits_share_physical_pages_between_running_sequences() -> None:
    sim = make()
    system = list(range(40, 48))  # two full pages
    sim.add(1, system + [1, 2], max_new_tokens=8)
    sim.step()
    sim.add(2, system + [3], max_new_tokens=8)
    plan = sim.step()
    assert shape(plan) == [(2, 8, 1, True), (1, 10, 1, True)]
    table_1, table_2 = sim.scheduler.page_table(1), sim.scheduler.page_table(2)
    assert table_1[:2] == table_2[:2] == (0, 1)
    assert table_1[2] != table_2[2]
    assert [sim.kv.pool.refcount(p) for p in (0, 1)] == [2, 2]
    assert sim.scheduler.num_cached_tokens(2) == 8
    assert sim.scheduler.num_cached_tokens(1) == 0
    stats = sim.scheduler.stats()
    assert (stats.prefix_queries_tokens_total, stats.prefix_hits_tokens_total) == (19, 8)


def test_cache_salt_as_str_or_bytes_isolates_tenants() -> None:
    sim = make()
    sim.add(1, list(range(9)), salt="tenant-a", max_new_tokens=4)
    sim.step()
    sim.add(2, list(range(9)), salt=b"tenant-a", max_new_tokens=4)
    sim.add(3, list(range(9)), salt="tenant-b", max_new_tokens=4)
    sim.step()
    assert sim.scheduler.num_cached_tokens(2) == 8
    assert sim.scheduler.num_cached_tokens(3) == 0
    assert set(sim.scheduler.page_table(3)).isdisjoint(sim.scheduler.page_table(1))


def test_prompt_ending_inside_a_finished_sequences_page_is_copied() -> None:
    sim = make()
    sim.add(1, list(range(10)), max_new_tokens=1)
    sim.run_until_idle()
    sim.finish(1)
    sim.add(2, list(range(7)), max_new_tokens=2)
    plan = sim.step()
    assert plan.copies == (PageCopy(src=1, dst=3, num_tokens=2),)
    assert shape(plan) == [(2, 6, 1, True)]
    assert sim.scheduler.page_table(2) == (0, 3)
    assert sim.scheduler.num_cached_tokens(2) == 6
    sim.run_until_idle()  # the shadow runner checked every position the attention read


def test_a_follow_up_turn_reuses_the_previous_answer() -> None:
    sim = make()
    sim.add(1, [5, 6, 7, 8, 9], max_new_tokens=4)
    sim.run_until_idle()
    sim.finish(1)
    first_turn = sim.tokens[1]  # 9 tokens; the KV of the last one was never computed
    sim.add(2, first_turn + [3, 3], max_new_tokens=2)
    plan = sim.step()
    # pages 0, 1 are full (8 computed tokens); page 2 would hold the 9th: recomputed, not copied
    assert sim.scheduler.num_cached_tokens(2) == 8
    assert plan.copies == ()
    assert shape(plan) == [(2, 8, 3, True)]
    assert sim.scheduler.page_table(2)[:2] == (0, 1)
    sim.finish(2)
    sim.add(3, [1, 1, 1, 1, 2], max_new_tokens=3)
    sim.run_until_idle()
    sim.finish(3)
    second_turn = sim.tokens[3]  # 8 tokens, 7 computed: page 1 keeps a 3-token tail
    sim.add(4, second_turn + [3, 3], max_new_tokens=2)
    plan = sim.step()
    assert sim.scheduler.num_cached_tokens(4) == 7
    (copy,) = plan.copies
    assert copy.num_tokens == 3
    assert shape(plan) == [(4, 7, 3, True)]


def test_a_request_larger_than_the_pool_is_rejected_up_front() -> None:
    sim = make(num_pages=4, page_size=4)
    sim.add(1, list(range(10)), max_new_tokens=7)  # 16 KV tokens = 4 pages: fits exactly
    sim.add(2, list(range(10)), max_new_tokens=8)  # 17 KV tokens = 5 pages
    plan = sim.step()
    assert plan.rejected == (
        (2, "request needs 5 KV pages (10 prompt + 8 new tokens at page_size 4) but the whole pool has 4 pages"),
    )
    assert shape(plan) == [(1, 0, 10, True)]
    sim.finish(2)  # no-op
    sim.run_until_idle()
    assert len(sim.tokens[1]) == 17
    assert sim.step().rejected == ()


def test_preemption_when_the_pool_runs_dry_and_later_completion() -> None:
    sim = make(num_pages=5, page_size=2, max_running=2)
    sim.add(1, [1, 2, 3], max_new_tokens=6)
    sim.add(2, [4, 5, 6], max_new_tokens=6)
    assert shape(sim.step()) == [(1, 0, 3, True), (2, 0, 3, True)]
    assert shape(sim.step()) == [(1, 3, 1, True), (2, 3, 1, True)]
    plan = sim.step()  # both cross a page boundary, one page is left: the newest yields
    assert shape(plan) == [(1, 4, 1, True)]
    assert plan.preempted == (2,)
    assert sim.scheduler.sequence(2).state is SeqState.WAITING
    assert sim.scheduler.page_table(2) == ()
    assert sim.scheduler.stats().preemptions_total == 1
    for _ in range(3):
        assert [c.seq_id for c in sim.step().chunks] == [1]
    plan = sim.step()  # seq 1 has finished; seq 2 recomputes prompt + generated, page [4, 5] was kept
    assert shape(plan) == [(2, 2, 3, True)]
    assert sim.run_until_idle() == 3
    assert len(sim.tokens[2]) == 9
    assert sim.scheduler.num_cached_tokens(2) == 0  # reported for its first admission
    stats = sim.scheduler.stats()
    assert (stats.active, stats.preemptions_total) == (0, 1)


def test_admission_keeps_a_page_per_running_sequence_in_reserve() -> None:
    sim = make(num_pages=4, page_size=2)
    sim.add(1, [1, 2, 3, 4, 5], max_new_tokens=2)  # 3 pages
    sim.add(2, [6, 7], max_new_tokens=2)  # 1 page fits, but would leave seq 1 no page in reserve
    sim.add(3, [8], max_new_tokens=1)
    assert shape(sim.step()) == [(1, 0, 5, True)]
    assert sim.scheduler.num_waiting == 2  # FCFS: seq 3 does not jump the queue
    assert shape(sim.step()) == [(1, 5, 1, True)]
    assert shape(sim.step()) == [(2, 0, 2, True), (3, 0, 1, True)]


@pytest.mark.parametrize("prompt, admitted", [(2, True), (20, False)])
def test_at_large_pages_the_reserve_covers_only_sequences_near_their_last_pages_end(prompt, admitted) -> None:
    # page 32: seq 1 holds 1 page; with a 2-token prompt it grows 16 tokens (RESERVE_TOKENS) without
    # a new page, with 20 it needs one, so seq 2 (2 pages) fits beside it only in the first case
    sim = make(num_pages=3, page_size=32)
    sim.add(1, list(range(1, prompt + 1)), max_new_tokens=4)
    sim.add(2, list(range(100, 164)), max_new_tokens=1)
    assert [c.seq_id for c in sim.step().chunks] == ([1, 2] if admitted else [1])
    sim.run_until_idle()
    assert len(sim.tokens[1]) == prompt + 4 and len(sim.tokens[2]) == 65
    assert sim.scheduler.stats().active == 0


@given(page_size=st.integers(17, 48), num_pages=st.integers(4, 12), seed=st.integers(0, 2**16),
       requests=st.integers(1, 10))
@settings(max_examples=60, deadline=None)
def test_large_pages_finish_every_request_with_exact_kv_and_no_page_leak(page_size, num_pages, seed,
                                                                        requests) -> None:
    rng = random.Random(seed)
    sim = make(num_pages=num_pages, page_size=page_size, max_running=4, max_step_tokens=96, max_prefill_chunk=48)
    want = {}
    for i in range(requests):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, page_size * 2))]
        new = rng.randint(1, page_size)
        sim.add(i, prompt, max_new_tokens=new)
        want[i] = len(prompt) + new
    sim.run_until_idle()
    assert {i: len(t) for i, t in sim.tokens.items()} == want   # the shadow runner checked every slot read
    assert sim.scheduler.stats().active == 0


@pytest.mark.parametrize("state", ["waiting", "mid-prefill", "decoding", "preempted", "in-flight", "done"])
def test_finish_releases_pages_in_every_state_and_is_idempotent(state: str) -> None:
    sim = make(num_pages=5, page_size=2, max_running=2, max_prefill_chunk=2)
    sim.add(1, [1, 2, 3], max_new_tokens=6)
    sim.add(2, [4, 5, 6, 7, 8], max_new_tokens=5)
    target = 2
    if state == "waiting":
        pass
    elif state == "mid-prefill":
        sim.step()
        assert sim.scheduler.sequence(2).remaining == 3
    elif state == "decoding":
        sim.step()
        sim.step()
        assert sim.scheduler.sequence(2).remaining == 1
    elif state == "preempted":
        while not sim.step().preempted:
            pass
        assert sim.scheduler.sequence(2).num_preemptions == 1
    elif state == "in-flight":
        sim.step()
        sim.schedule()  # the runner is busy with this plan
    elif state == "done":
        target = 1
        sim.scheduler.finish(2)
        sim.run_until_idle()
        assert sim.scheduler.sequence(1).state is SeqState.DONE
    sim.finish(target)
    sim.finish(target)
    if sim.scheduler.has_inflight:
        sim.complete()  # a finished sequence's sampled token is ignored, its copy pins released
    sim.finish(1)
    sim.finish(2)
    stats = sim.scheduler.stats()
    assert stats.active == 0 and stats.free + stats.cached == stats.total
    assert sim.scheduler.num_running == sim.scheduler.num_waiting == 0
    sim.scheduler.check_integrity()


def test_early_stop_on_eos_leaks_no_page() -> None:
    sim = make()
    for seq_id in range(4):
        sim.add(seq_id, [9, 9, 9, 9, seq_id], max_new_tokens=50)
    for _ in range(3):
        sim.step()
    for seq_id in range(4):  # the engine saw <eos>
        sim.finish(seq_id)
    assert sim.scheduler.stats().active == 0


def test_protocol_errors_are_loud() -> None:
    sim = make()
    with pytest.raises(ValueError, match="empty prompt"):
        sim.scheduler.add(1, [], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        sim.scheduler.add(1, [1], max_new_tokens=0)
    sim.add(1, [1, 2])
    with pytest.raises(ValueError, match="already known"):
        sim.scheduler.add(1, [1, 2], max_new_tokens=1)
    sim.scheduler.schedule()
    with pytest.raises(RuntimeError, match="before on_step_done"):
        sim.scheduler.schedule()
    with pytest.raises(ValueError, match=r"no sampled token for sequences \[1\]"):
        sim.scheduler.on_step_done({})
    sim.scheduler.on_step_done({1: 5})
    with pytest.raises(ValueError, match="max_running must be >= 1"):
        Scheduler(sim.kv, max_running=0, max_step_tokens=1, max_prefill_chunk=1)


def test_debug_checks_catch_corruption_after_the_next_call() -> None:
    sim = make()
    sim.add(1, [1, 2, 3, 4, 5])
    sim.step()
    sim.kv.pool._refcount[0] += 1  # a page-table reference that does not exist
    with pytest.raises(AssertionError, match="page 0: refcount 2 but 1 table/pin references"):
        sim.step()
