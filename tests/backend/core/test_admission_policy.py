"""Admission policy: cache_aware ordering, ties, the starvation bound, read-only probing, fcfs as before."""

from __future__ import annotations

import pytest
from core_sim import ShadowRunner, make_runner
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvshare.core import POLICY_NAMES, KVCacheManager, Scheduler, SeqState

SYSTEM = list(range(100, 108))  # two full pages at page_size 4


def make(admission: str = "cache_aware", *, num_pages: int = 32, **kw) -> ShadowRunner:
    return make_runner(num_pages, admission=admission, **kw)


def admitted(sim: ShadowRunner) -> list[int]:
    """One step; the sequences it admitted, in admission order (admissions are the last prefill chunks)."""
    before = set(sim.scheduler._running)
    return [c.seq_id for c in sim.step().chunks if c.seq_id not in before]


def cache_system_prompt(sim: ShadowRunner, seq_id: int = 0, prefix: list[int] = SYSTEM) -> None:
    sim.add(seq_id, prefix + [1], max_new_tokens=1)
    sim.run_until_idle()
    sim.finish(seq_id)


def test_cache_aware_admits_the_cached_prefix_first_and_fcfs_does_not() -> None:
    for admission, first in (("cache_aware", 2), ("fcfs", 1)):
        sim = make(admission, max_running=1)
        cache_system_prompt(sim)
        sim.add(1, [7, 7, 7, 7, 7, 7, 7, 7, 7], max_new_tokens=1)  # cold, arrived first
        sim.add(2, SYSTEM + [2], max_new_tokens=1)
        assert admitted(sim) == [first], admission
        assert sim.run_until_idle() == 1
        assert sim.scheduler.num_cached_tokens(2) == 8


def test_longest_cached_prefix_first_ties_by_arrival() -> None:
    sim = make()
    cache_system_prompt(sim)
    sim.add(1, [50, 51, 52, 53, 54], max_new_tokens=2)  # cold
    sim.add(2, SYSTEM[:4] + [9, 9, 9, 9, 9], max_new_tokens=2)  # one cached page
    sim.add(3, SYSTEM + [3], max_new_tokens=2)  # two
    sim.add(4, [60, 61, 62, 63, 64], max_new_tokens=2)  # cold
    sim.add(5, SYSTEM + [5, 5], max_new_tokens=2)  # two
    assert admitted(sim) == [3, 5, 2, 1, 4]
    assert [sim.scheduler.num_cached_tokens(s) for s in (3, 5, 2, 1, 4)] == [8, 8, 4, 0, 0]


def test_fcfs_head_blocks_and_a_later_hit_never_overtakes() -> None:
    sim = make("fcfs", num_pages=6, max_running=4)
    cache_system_prompt(sim)
    sim.add(1, list(range(20, 36)), max_new_tokens=2)  # 4 pages + reserve: evicts the cached prompt to fit
    sim.add(2, SYSTEM + [2], max_new_tokens=2)
    sim.add(3, [9], max_new_tokens=2)
    assert admitted(sim) == [1]
    order: list[int] = []
    while sim.scheduler.num_waiting:
        order += admitted(sim)
    assert order == [2, 3]
    sim.run_until_idle()


def test_preempted_sequences_keep_absolute_priority_over_cache_hits() -> None:
    sim = make(num_pages=5, page_size=2, max_running=2)
    sim.add(1, [1, 2, 3], max_new_tokens=6)
    sim.add(2, [4, 5, 6], max_new_tokens=6)
    sim.step()
    sim.step()
    assert sim.step().preempted == (2,)
    sim.add(3, [1, 2, 9], max_new_tokens=2)  # shares seq 1's first page, which is cached
    order: list[int] = []
    while sim.scheduler.num_waiting:
        order += admitted(sim)
    assert order.index(2) < order.index(3)
    sim.run_until_idle()


def test_a_cold_prefix_being_computed_is_shared_not_computed_twice() -> None:
    cold = list(range(200, 212))  # three pages nobody has computed yet
    for admission in ("cache_aware", "fcfs"):
        sim = make(admission)
        sim.add(1, cold + [1], max_new_tokens=2)
        sim.add(2, cold + [2], max_new_tokens=2)
        sim.add(3, [9, 9, 9], max_new_tokens=2)  # not held up by the deferred one
        assert admitted(sim) == ([1, 3] if admission == "cache_aware" else [1, 2, 3]), admission
        sim.run_until_idle()
        # seq 2 reuses the three pages seq 1 computed (lookups stop one token short: 12 of 13 -> 3 pages)
        assert sim.scheduler.num_cached_tokens(2) == (12 if admission == "cache_aware" else 0), admission


@pytest.mark.parametrize("skips", [0, 2, 5])
def test_a_cold_request_is_admitted_within_the_starvation_bound(skips: int) -> None:
    """A stream of cache hits (one new every step) overtakes a cold request at most skips + 1 times."""
    sim = make(max_running=1, max_admission_skips=skips)
    cache_system_prompt(sim)
    sim.add(1, [7, 7, 7, 7, 7], max_new_tokens=1)
    next_id, overtaken = 2, 0
    for _ in range(50):
        sim.add(next_id, SYSTEM + [next_id], max_new_tokens=1)
        next_id += 1
        got = admitted(sim)
        if 1 in got:
            break
        overtaken += len(got)
    else:
        pytest.fail("the cold request starved")
    assert overtaken == skips + 1
    sim.run_until_idle()


def test_without_a_bound_the_same_stream_would_starve_it() -> None:
    sim = make(max_running=1, max_admission_skips=10_000)
    cache_system_prompt(sim)
    sim.add(1, [7, 7, 7, 7, 7], max_new_tokens=1)
    for seq_id in range(2, 40):
        sim.add(seq_id, SYSTEM + [seq_id], max_new_tokens=1)
        assert 1 not in admitted(sim)
    assert sim.run_until_idle() == 1


@pytest.mark.parametrize(("limit", "expected"), [(2, [1, 2, 4, 3]), (4, [4, 1, 2, 3])])
def test_only_the_probe_window_is_reordered(limit: int, expected: list[int]) -> None:
    sim = make(max_running=1, admission_probe_limit=limit)
    cache_system_prompt(sim)
    for seq_id, prompt in ((1, [7, 7, 7]), (2, [8, 8, 8]), (3, [9, 9, 9]), (4, SYSTEM + [4])):
        sim.add(seq_id, prompt, max_new_tokens=1)
    order = [s for _ in range(4) for s in admitted(sim)]
    assert order == expected  # seq 4's hit counts only once it is among the first `limit` by arrival


def keys_of(kv: KVCacheManager, seq_table: tuple[int, ...]) -> list[bytes]:
    return [kv.prefix.entry_of(page).key for page in seq_table]  # type: ignore[union-attr]


def test_page_keys_are_the_prefix_cache_keys_and_need_no_root() -> None:
    kv = KVCacheManager(16, 4, low_watermark=0.0)
    prompt = SYSTEM + [1, 2, 3, 4, 5]
    keys = kv.page_keys(prompt, b"tenant")  # before the salt has a root
    assert len(keys) == 3 and not kv.prefix._roots
    assert kv.probe_cached_tokens(keys, b"tenant") == 0
    assert kv.admit(1, prompt, b"tenant", token_budget=64) is not None
    kv.commit(1, prompt, len(prompt))
    assert keys == tuple(keys_of(kv, kv.page_table(1)[:3]))
    assert kv.probe_cached_tokens(keys, b"tenant") == 12
    assert kv.probe_cached_tokens(kv.page_keys(prompt, b"other"), b"other") == 0
    assert kv.probe_cached_tokens(kv.page_keys(SYSTEM + [9, 9, 9, 9, 9], b"tenant"), b"tenant") == 8
    assert kv.page_keys(prompt[:12], b"tenant") == keys[:2]  # the last token is never a hit
    assert KVCacheManager(16, 4, enable_prefix_caching=False).page_keys(prompt, b"") == ()


def _pressure(policy: str, probe: bool) -> ShadowRunner:
    """Cached chains at rc 0 (some touched more often), a running sequence, and (if probe) waiting
    sequences whose cache_aware probe runs but whose admission does not fit."""
    sim = make(num_pages=11, max_running=4, policy=policy)
    prompts = [[10 + i] * 12 for i in range(2)] + [[10] * 4 + [40] * 8]
    for seq_id, prompt in enumerate(prompts):
        sim.add(seq_id, prompt, max_new_tokens=1)
        sim.run_until_idle()
        sim.finish(seq_id)
    sim.add(9, list(range(60, 76)), max_new_tokens=12)
    sim.step()
    if probe:
        sim.add(20, [10] * 8 + list(range(80, 100)), max_new_tokens=1)  # a hit, but too long to fit
        sim.add(21, [11] * 4 + list(range(80, 100)), max_new_tokens=1)
    for _ in range(3):
        sim.step()
    return sim


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_probing_changes_no_refcount_recency_or_eviction_order(policy: str) -> None:
    probed, reference = _pressure(policy, probe=True), _pressure(policy, probe=False)
    assert probed.scheduler._fresh[20].cached_pages > 0  # the probe ran and saw a hit ...
    assert probed.scheduler.num_waiting == 2  # ... and nobody was admitted
    probed.scheduler.check_integrity()
    for sim in (probed, reference):
        sim.scheduler.finish(9)
    pool_a, pool_b = probed.kv.pool, reference.kv.pool
    assert [pool_a.refcount(p) for p in range(11)] == [pool_b.refcount(p) for p in range(11)]
    assert (pool_a.num_cached, pool_a.evictions_total) == (pool_b.num_cached, pool_b.evictions_total)
    assert len(probed.kv.prefix._roots) == len(reference.kv.prefix._roots)
    victims_a = [pool_a.policy.pop_victim() for _ in range(pool_a.num_cached)]
    victims_b = [pool_b.policy.pop_victim() for _ in range(pool_b.num_cached)]
    assert victims_a == victims_b and victims_a


def test_constructor_validates_the_policy() -> None:
    kv = KVCacheManager(4, 4)
    assert Scheduler(kv, max_running=1, max_step_tokens=1, max_prefill_chunk=1, admission="Cache-Aware").admission == (
        "cache_aware"
    )
    with pytest.raises(ValueError, match="unknown admission policy 'lpm'"):
        Scheduler(kv, max_running=1, max_step_tokens=1, max_prefill_chunk=1, admission="lpm")
    with pytest.raises(ValueError, match="max_admission_skips must be >= 0"):
        Scheduler(kv, max_running=1, max_step_tokens=1, max_prefill_chunk=1, max_admission_skips=-1)


# -- property: random add / schedule / finish under either policy -------------------------------

GROUPS = ([1, 2, 1, 2, 3, 1, 2, 1], [3, 3, 0, 1, 2, 2, 1, 0, 1], [2, 0, 2, 0, 1, 1])


class AdmissionMachine(RuleBasedStateMachine):
    sim: ShadowRunner

    @initialize(
        admission=st.sampled_from(["cache_aware", "fcfs"]),
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(4, 16),
        policy=st.sampled_from(POLICY_NAMES),
        max_running=st.integers(1, 4),
        max_step_tokens=st.integers(1, 16),
        max_prefill_chunk=st.integers(1, 8),
        max_admission_skips=st.integers(0, 3),
        admission_probe_limit=st.integers(1, 4),
    )
    def setup(self, admission, page_size, num_pages, policy, max_running, max_step_tokens, max_prefill_chunk,
              max_admission_skips, admission_probe_limit):
        kv = KVCacheManager(num_pages, page_size, policy=policy, low_watermark=0.0, max_partial_candidates=3)
        scheduler = Scheduler(
            kv, max_running=max_running, max_step_tokens=max_step_tokens, max_prefill_chunk=max_prefill_chunk,
            debug_checks=True, admission=admission, max_admission_skips=max_admission_skips,
            admission_probe_limit=admission_probe_limit,
        )
        self.sim = ShadowRunner(scheduler, vocab=4)
        self.next_id = 0
        self.cancelled: set[int] = set()
        self.ever_admitted: set[int] = set()

    @rule(group=st.sampled_from(GROUPS), keep=st.integers(0, 9), tail=st.lists(st.integers(0, 3), max_size=4),
          salt=st.sampled_from([b"", b"", b"t"]), max_new_tokens=st.integers(1, 5))
    def add(self, group, keep, tail, salt, max_new_tokens):
        self.sim.add(self.next_id, group[:keep] + tail or [0], salt=salt, max_new_tokens=max_new_tokens)
        self.next_id += 1

    @precondition(lambda self: not self.sim.scheduler.has_inflight)
    @rule()
    def step(self):
        self.sim.schedule()
        self.ever_admitted.update(self.sim.scheduler._running)
        self.sim.complete()

    @precondition(lambda self: not self.sim.scheduler.has_inflight)
    @rule()
    def schedule_only(self):
        self.sim.schedule()
        self.ever_admitted.update(self.sim.scheduler._running)

    @precondition(lambda self: self.sim.scheduler.has_inflight)
    @rule()
    def complete(self):
        self.sim.complete()

    @precondition(lambda self: self.next_id > 0)
    @rule(data=st.data())
    def cancel(self, data):
        seq_id = data.draw(st.integers(0, self.next_id - 1), label="seq_id")
        self.sim.finish(seq_id)
        self.cancelled.add(seq_id)

    @invariant()
    def fcfs_never_lets_a_later_arrival_in_first(self):
        if not hasattr(self, "sim") or self.sim.scheduler.admission != "fcfs":
            return
        scheduler = self.sim.scheduler
        never = [s for s, seq in scheduler._waiting.items() if seq.num_preemptions == 0]
        if never:
            assert not any(s > min(never) for s in self.ever_admitted), "fcfs admitted a later arrival first"

    def teardown(self):
        if not hasattr(self, "sim"):
            return
        scheduler = self.sim.scheduler
        if scheduler.has_inflight:
            self.sim.complete()
        self.sim.run_until_idle(max_steps=2_000)  # everything left completes: nobody starves
        for seq_id in range(self.next_id):
            if seq_id in self.cancelled:
                continue
            try:
                seq = scheduler.sequence(seq_id)
            except KeyError:
                continue  # rejected up front: larger than the whole pool
            assert seq.state is SeqState.DONE and seq.num_generated == seq.max_new_tokens
        for seq_id in range(self.next_id):
            self.sim.finish(seq_id)
        assert scheduler.stats().active == 0
        scheduler.check_integrity()


AdmissionMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
TestAdmissionMachine = AdmissionMachine.TestCase
