"""Random add / schedule / step / finish (cancel) interleavings against every invariant.

The shadow runner checks every KV slot the attention reads, so this also proves that sharing,
copy on write, salts, eviction and preemption never hand a sequence another prefix's KV.
"""

from __future__ import annotations

from core_sim import ShadowRunner
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvshare.core import POLICY_NAMES, KVCacheManager, Scheduler
from kvshare.core.prefix_cache import blake2b_128

BASES = ([1, 2, 1, 2, 3, 1, 2, 1], [1, 2, 3, 3, 3, 2, 1, 0, 1], [2, 0, 2, 0])


def colliding_hash(data: bytes) -> bytes:
    return bytes([blake2b_128(data)[0] & 3])  # 4 keys: most registrations collide


class SchedulerMachine(RuleBasedStateMachine):
    sim: ShadowRunner

    @initialize(
        page_size=st.sampled_from([1, 2, 3, 4]),
        num_pages=st.integers(3, 12),
        policy=st.sampled_from(POLICY_NAMES),
        collide=st.booleans(),
        max_running=st.integers(1, 4),
        max_step_tokens=st.integers(1, 12),
        max_prefill_chunk=st.integers(1, 6),
    )
    def setup(self, page_size, num_pages, policy, collide, max_running, max_step_tokens, max_prefill_chunk):
        kv = KVCacheManager(
            num_pages, page_size, policy=policy, low_watermark=0.0, max_partial_candidates=3,
            hash_fn=colliding_hash if collide else blake2b_128,
        )
        scheduler = Scheduler(
            kv, max_running=max_running, max_step_tokens=max_step_tokens,
            max_prefill_chunk=max_prefill_chunk, debug_checks=True,
        )
        self.sim = ShadowRunner(scheduler, vocab=4)
        self.next_id = 0

    @rule(
        base=st.sampled_from(BASES),
        keep=st.integers(0, 9),
        tail=st.lists(st.integers(0, 3), max_size=3),
        salt=st.sampled_from([b"", b"", b"other"]),
        max_new_tokens=st.integers(1, 6),
    )
    def add(self, base, keep, tail, salt, max_new_tokens):
        prompt = base[:keep] + tail or [0]
        self.sim.add(self.next_id, prompt, salt=salt, max_new_tokens=max_new_tokens)
        self.next_id += 1

    @precondition(lambda self: self.next_id > 0)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 3), max_size=2))
    def add_follow_up(self, data, tail):
        """A next turn: an earlier sequence's prompt + generated tokens (possibly cut) + new tokens."""
        earlier = self.sim.tokens[data.draw(st.integers(0, self.next_id - 1), label="earlier")]
        keep = data.draw(st.one_of(st.just(len(earlier)), st.integers(1, len(earlier))), label="keep")
        self.sim.add(self.next_id, earlier[:keep] + tail, max_new_tokens=data.draw(st.integers(1, 4)))
        self.next_id += 1

    @precondition(lambda self: not self.sim.scheduler.has_inflight and not self.sim.scheduler.num_unresolved)
    @rule()
    def step(self):
        self.sim.step()

    @precondition(lambda self: not self.sim.scheduler.has_inflight and not self.sim.scheduler.num_unresolved)
    @rule()
    def schedule_only(self):
        self.sim.schedule()

    # Overlap scheduling, as the engine drives it: schedule the next step with at most one step
    # unresolved, advance it, then resolve the older one.
    @precondition(lambda self: not self.sim.scheduler.has_inflight and self.sim.scheduler.num_unresolved <= 1)
    @rule()
    def launch(self):
        self.sim.launch()

    @precondition(lambda self: self.sim.scheduler.num_unresolved > 0)
    @rule()
    def resolve(self):
        self.sim.resolve()

    @precondition(lambda self: self.sim.scheduler.has_inflight)
    @rule()
    def complete(self):
        self.sim.complete()

    @precondition(lambda self: self.next_id > 0)
    @rule(data=st.data())
    def finish(self, data):
        self.sim.finish(data.draw(st.integers(0, self.next_id - 1), label="seq_id"))

    @invariant()
    def pool_is_consistent(self):
        if not hasattr(self, "sim"):
            return
        scheduler = self.sim.scheduler
        scheduler.check_integrity()
        stats = scheduler.stats()
        assert stats.free + stats.active + stats.cached == stats.total
        if not scheduler.num_running and not scheduler.has_inflight and not scheduler.num_unresolved:
            assert stats.active == 0, f"nothing in flight but {stats.active} pages active"

    def teardown(self):
        if not hasattr(self, "sim"):
            return
        if self.sim.scheduler.has_inflight:
            self.sim.complete()
        while self.sim.scheduler.num_unresolved:
            self.sim.resolve()
        self.sim.run_until_idle(max_steps=2_000)  # everything left completes
        for seq_id in range(self.next_id):
            self.sim.finish(seq_id)
        assert self.sim.scheduler.stats().active == 0


SchedulerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerMachine = SchedulerMachine.TestCase
