"""DiskTier bookkeeping and the host slots it keeps busy: a page is loadable only once its write
finished, a page being read is never evicted, the budget holds, evicted and bad pages are deleted,
and a host slot under a disk job is never handed out; random operations against a shadow model
(Hypothesis) with check_integrity() after each."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.core.disk_tier import DiskTier, IndexedPage
from kvshare.core.host_tier import HostTier
from kvshare.core.kv_cache_manager import KVCacheManager


def key(i: int) -> bytes:
    return i.to_bytes(4, "little")


def test_write_then_loadable_then_evicted_oldest_first():
    tier = DiskTier(2)
    assert tier.want_write(key(1), b"r", b"", (1,))
    assert not tier.want_write(key(1), b"r", b"", (1,))                 # already being written
    assert tier.match([key(1)], b"r", b"", [(1,)]) == []                 # not loadable until written
    tier.write_done(key(1), ok=True)
    assert len(tier.match([key(1)], b"r", b"", [(1,)])) == 1
    assert tier.match([key(1)], b"r", b"salt", [(1,)]) == [] and tier.match([key(1)], b"x", b"", [(1,)]) == []
    assert tier.match([key(1)], b"r", b"", [(9,)]) == []                 # same key, other tokens
    assert tier.want_write(key(2), b"r", b"", (2,))
    tier.write_done(key(2), ok=True)
    assert tier.want_write(key(3), b"r", b"", (3,))                      # full: key(1) goes
    assert key(1) not in tier and tier.take_deletes() == (key(1),) and tier.evictions_total == 1
    tier.check_integrity()


def test_a_page_being_read_stays_and_a_failed_read_drops_it():
    tier = DiskTier(1)
    tier.want_write(key(1), b"r", b"", (1,))
    tier.write_done(key(1), ok=True)
    tier.begin_read(key(1))
    assert not tier.want_write(key(2), b"r", b"", (2,))                  # the only page is being read
    tier.read_done(key(1), ok=False)                                     # torn, stale or foreign
    assert key(1) not in tier and tier.take_deletes() == (key(1),) and tier.read_failures_total == 1
    assert tier.want_write(key(2), b"r", b"", (2,))
    tier.write_done(key(2), ok=False)                                    # a failed write: never loadable
    assert key(2) not in tier and tier.write_failures_total == 1
    tier.check_integrity()


def test_warm_index_keeps_the_newest_within_the_budget():
    tier = DiskTier(2)
    found = [IndexedPage(key(i), b"r", b"", (i,)) for i in range(4)]    # oldest first
    assert tier.warm(found) == 2
    assert set(tier.take_deletes()) == {key(0), key(1)}
    assert len(tier.match([key(2)], b"r", b"", [(2,)])) == 1 and key(3) in tier


def test_writes_in_flight_are_bounded():
    tier = DiskTier(10, max_inflight_writes=2)
    assert tier.want_write(key(1), b"r", b"", (1,)) and tier.want_write(key(2), b"r", b"", (2,))
    assert not tier.want_write(key(3), b"r", b"", (3,))
    tier.write_done(key(1), ok=True)
    assert tier.want_write(key(3), b"r", b"", (3,))


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_pages"):
        DiskTier(0)
    with pytest.raises(ValueError, match="max_inflight_writes"):
        DiskTier(1, max_inflight_writes=0)
    with pytest.raises(ValueError, match="host tier"):
        KVCacheManager(8, 4, disk_tier=DiskTier(4))


def test_host_slot_busy_with_a_disk_job_is_never_reused():
    host = HostTier(1)
    slot = host.store(key(1), b"r", b"", (1,))
    host.mark_busy(slot)                                                 # its write-through is running
    host.release_pins()
    assert host.store(key(2), b"r", b"", (2,)) is None                   # the only entry's slot is busy
    host.take(key(1))
    host.release_pins()                                                  # loaded back: no entry, still busy
    assert host.store(key(2), b"r", b"", (2,)) is None
    host.check_integrity()
    host.io_done(slot)
    assert host.store(key(2), b"r", b"", (2,)) == slot
    host.check_integrity()


def test_fill_is_matchable_only_when_done():
    host = HostTier(2)
    slot = host.reserve_fill(key(1), b"r", b"", (1,))
    assert slot is not None and host.is_filling(key(1)) and host.match([key(1)], b"r", b"", [(1,)]) == []
    assert host.reserve_fill(key(1), b"r", b"", (1,)) is None and host.store(key(1), b"r", b"", (1,)) is None
    host.fill_done(key(1), ok=True)
    (entry,) = host.match([key(1)], b"r", b"", [(1,)])
    assert entry.from_disk and entry.slot == slot
    other = host.reserve_fill(key(2), b"r", b"", (2,))
    host.fill_done(key(2), ok=False)                                     # a bad file: the slot is free again
    assert key(2) not in host and host.store(key(3), b"r", b"", (3,)) == other
    host.check_integrity()


# -- random operations against a shadow model ---------------------------------------------------

disk_ops = st.lists(st.tuples(st.sampled_from(["write", "written", "failed_write", "read", "read_ok", "read_bad",
                                               "deletes"]), st.integers(0, 9)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), disk_ops)
def test_random_disk_operations_keep_the_index_consistent(num_pages, max_writes, operations):
    tier = DiskTier(num_pages, max_inflight_writes=max_writes)
    decided: set[bytes] = set()            # want_write said yes; handed to the worker at the next "deletes"
    submitted: set[bytes] = set()          # ... handed over (with that call's deletes, which run first)
    reading: dict[bytes, int] = {}
    on_disk: set[bytes] = set()            # complete files
    for op, i in operations:
        k = key(i)
        if op == "write":
            if tier.want_write(k, b"r", b"", (i,)):
                assert k not in decided | submitted
                decided.add(k)
        elif op in ("written", "failed_write") and k in submitted:
            tier.write_done(k, ok=op == "written")
            submitted.discard(k)
            if op == "written":
                on_disk.add(k)
        elif op == "read" and tier.match([k], b"r", b"", [(i,)]):
            assert k in on_disk, "a page is loadable before its write finished"
            tier.begin_read(k)
            reading[k] = reading.get(k, 0) + 1
        elif op in ("read_ok", "read_bad") and reading.get(k):
            tier.read_done(k, ok=op == "read_ok")
            reading[k] -= 1
        elif op == "deletes":        # KVCacheManager.take_disk_work: deletes, then the writes decided
            for gone in tier.take_deletes():
                assert not reading.get(gone), "a file deleted while being read"
                assert gone in decided or gone not in tier, "a complete, indexed page's file deleted"
                on_disk.discard(gone)
            submitted |= decided
            decided.clear()
        tier.check_integrity()
        assert len(tier) <= num_pages and tier.num_writing <= max_writes
        for k in decided | submitted:
            assert k in tier and not tier.match([k], b"r", b"", [(int.from_bytes(k, "little"),)])


host_ops = st.lists(st.tuples(st.sampled_from(["store", "busy", "io_done", "fill", "fill_ok", "fill_bad", "take",
                                               "release"]), st.integers(0, 7)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), host_ops)
def test_random_host_operations_with_disk_jobs_never_reuse_a_busy_slot(num_slots, operations):
    host = HostTier(num_slots)
    busy: set[int] = set()                 # slots a (shadow) disk job reads or writes now
    held: dict[bytes, int] = {}
    for op, i in operations:
        k = key(i)
        if op == "store":
            slot = host.store(k, b"r", b"", (i,))
            if slot is not None:
                assert slot not in busy, "a busy slot was handed out"
                held[k] = slot
        elif op == "busy" and k in host and host.match([k], b"r", b"", [(i,)]):
            slot = host.match([k], b"r", b"", [(i,)])[0].slot
            if slot not in busy:
                host.mark_busy(slot)
                busy.add(slot)
        elif op == "io_done" and busy and not any(host.is_filling(key(j)) for j in range(8)):
            slot = sorted(busy)[i % len(busy)]
            host.io_done(slot)
            busy.discard(slot)
        elif op == "fill":
            slot = host.reserve_fill(k, b"r", b"", (i,))
            if slot is not None:
                assert slot not in busy, "a busy slot was handed out"
                busy.add(slot)
        elif op in ("fill_ok", "fill_bad") and host.is_filling(k):
            slot = host._filling[k].slot
            host.fill_done(k, ok=op == "fill_ok")
            busy.discard(slot)
        elif op == "take" and k in host:
            host.take(k)
        elif op == "release":
            host.release_pins()
        host.check_integrity()


@pytest.mark.parametrize("admission", ["fcfs", "cache_aware"])
def test_a_queued_prompt_waits_for_its_disk_pages_and_lets_the_next_go_first(admission):
    from kvshare.core.scheduler import Scheduler

    kv = KVCacheManager(16, 4, host_tier=HostTier(8), disk_tier=DiskTier(32))
    prompt = list(range(10, 23))                                         # 3 full pages + its last token
    keys = kv.page_keys(prompt, b"")
    parents = [kv.prefix.root_key(b""), *keys[:-1]]
    kv.disk.warm(IndexedPage(k, p, b"", tuple(prompt[4 * j:4 * j + 4])) for j, (k, p) in enumerate(zip(keys, parents)))
    sched = Scheduler(kv, max_running=4, max_step_tokens=64, max_prefill_chunk=64, debug_checks=True,
                      admission=admission)
    sched.add(1, prompt, max_new_tokens=2)
    sched.add(2, list(range(100, 106)), max_new_tokens=2)
    plan = sched.schedule()
    assert [r.key for r in plan.disk_reads] == list(keys)                # staged while it waits
    assert [c.seq_id for c in plan.chunks] == [2]                        # the next request goes first
    sched.on_step_done({2: 7})
    reads = plan.disk_reads
    for read in reads:
        kv.on_disk_read(read, ok=True)
    plan = sched.schedule()
    (chunk,) = [c for c in plan.chunks if c.seq_id == 1]
    assert chunk.start == 12                                             # the 3 pages came back, not computed
    assert [slot for slot, _ in plan.loads] == [r.slot for r in reads]   # filled slots -> its first fresh pages
    assert kv.disk_hits_tokens_total == 12 and not plan.disk_reads
    sched.on_step_done({1: 5, 2: 8})
    sched.check_integrity()
