"""Admission delay: arrivals wait up to d decode-only steps so that they share one mixed step."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from core_sim import ShadowRunner, make_runner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare.core import KVCacheManager, Scheduler, SeqState, StepPlan


def make(delay: int, *, max_running: int = 8, num_pages: int = 256, max_prefill_chunk: int = 64,
         **kw) -> ShadowRunner:
    return make_runner(num_pages, 4, max_running=max_running, max_step_tokens=256,
                       max_prefill_chunk=max_prefill_chunk, admission_delay_steps=delay, **kw)


def admitted(sim: ShadowRunner) -> list[int]:
    """One step; the sequences it admitted (admissions are the step's chunks of non-running sequences)."""
    before = set(sim.scheduler._running)
    return [c.seq_id for c in sim.step().chunks if c.seq_id not in before]


def start_decoding(sim: ShadowRunner, count: int, *, max_new_tokens: int | list[int] = 50) -> None:
    """count sequences admitted together (nothing runs yet: no delay) and now decoding."""
    news = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * count
    for seq_id, new in enumerate(news):
        sim.add(seq_id, [1000 + seq_id, 7], max_new_tokens=new)
    assert admitted(sim) == list(range(count))
    assert all(sim.scheduler.sequence(s).remaining == 1 for s in range(count))


@pytest.mark.parametrize("admission", ["fcfs", "cache_aware"])
@pytest.mark.parametrize("delay", [0, 1, 3])
def test_an_arrival_waits_delay_decode_steps_when_few_slots_are_free(delay: int, admission: str) -> None:
    sim = make(delay, admission=admission)
    start_decoding(sim, 7)  # 1 of 8 slots free: under a quarter
    sim.add(100, [5, 6, 7], max_new_tokens=2)
    for _ in range(delay):
        assert admitted(sim) == []
    assert admitted(sim) == [100]
    assert sim.run_until_idle() > 0


def test_arrivals_during_the_delay_share_one_mixed_step_and_the_count_restarts() -> None:
    sim = make(3, max_running=16)
    start_decoding(sim, 13)  # 3 of 16 free: under a quarter (4)
    sim.add(100, [5, 6, 7], max_new_tokens=20)
    assert admitted(sim) == []
    sim.add(101, [8, 9], max_new_tokens=20)
    assert admitted(sim) == []
    assert admitted(sim) == []
    before = set(sim.scheduler._running)
    plan = sim.step()  # after 3 deferred steps: both in one mixed step, beside all 13 decodes
    assert sorted(c.seq_id for c in plan.chunks if c.seq_id not in before) == [100, 101]
    assert len(plan.chunks) == 15
    sim.add(102, [4, 4], max_new_tokens=2)  # a new arrival waits the full delay again
    for _ in range(3):
        assert admitted(sim) == []
    assert admitted(sim) == [102]


def test_a_quarter_of_free_slots_admits_at_once() -> None:
    sim = make(5)
    start_decoding(sim, 6)  # 2 of 8 free == 8 // 4: the batch is draining
    sim.add(100, [5, 6], max_new_tokens=2)
    assert admitted(sim) == [100]
    small = make(5, max_running=4)
    start_decoding(small, 3)  # max(1, 4 // 4) == 1 free slot already counts as a quarter
    small.add(100, [5, 6], max_new_tokens=2)
    assert admitted(small) == [100]


def test_nothing_running_or_a_running_prefill_admits_at_once() -> None:
    sim = make(5)
    sim.add(1, [1, 2, 3], max_new_tokens=2)
    assert admitted(sim) == [1]  # no decodes: the step is a prefill step anyway
    sim = make(5, max_prefill_chunk=2)
    start_decoding(sim, 6)
    sim.add(50, list(range(20, 30)), max_new_tokens=4)  # 2 of 8 free: admitted, prefills 2 tokens a step
    assert admitted(sim) == [50]
    sim.add(100, [5, 6], max_new_tokens=2)  # 1 free, but seq 50's next chunk makes the step mixed anyway
    plan = sim.step()
    assert [(c.seq_id, c.num_tokens) for c in plan.chunks][:2] == [(50, 2), (100, 2)]


def test_steps_without_a_free_slot_do_not_use_up_the_delay() -> None:
    sim = make(2)
    start_decoding(sim, 8, max_new_tokens=[2] + [50] * 7)
    sim.add(100, [5, 6], max_new_tokens=2)
    assert admitted(sim) == []  # full; seq 0 samples its 2nd and last token and leaves at this step's end
    assert sim.scheduler.sequence(0).state is SeqState.DONE
    assert admitted(sim) == []  # 1 free slot: the delay starts only now
    assert admitted(sim) == []
    assert admitted(sim) == [100]


def test_a_cancelled_waiter_leaves_no_delay_behind() -> None:
    sim = make(3)
    start_decoding(sim, 7)
    sim.add(100, [5, 6], max_new_tokens=2)
    assert admitted(sim) == []
    assert admitted(sim) == []
    sim.finish(100)  # cancelled while deferred: the queue is empty
    assert admitted(sim) == []
    sim.add(101, [8, 9], max_new_tokens=2)  # waits its own 3 steps, not the 1 left of seq 100's
    for _ in range(3):
        assert admitted(sim) == []
    assert admitted(sim) == [101]


def test_a_preempted_head_is_readmitted_as_without_the_delay() -> None:
    """A tight pool preempts; the preempted sequence comes back in a decode-only step with few free
    slots, where a fresh arrival would wait. Plans are identical with and without the delay (all
    requests arrive at once, so only preempted sequences ever wait while others decode)."""
    lengths = [28, 4, 4, 2, 3, 2, 2, 2, 2, 2, 1, 2]
    news = [6, 28, 29, 23, 17, 14, 19, 18, 22, 26, 28, 21]

    def run(delay: int) -> tuple[list[StepPlan], int]:
        sim = make_runner(59, 2, max_running=12, max_step_tokens=256, max_prefill_chunk=64,
                          admission_delay_steps=delay)
        for seq_id, (length, new) in enumerate(zip(lengths, news)):
            sim.add(seq_id, [100 + seq_id] * length, max_new_tokens=new)
        plans: list[StepPlan] = []
        readmitted_where_a_fresh_one_would_wait = 0
        while sim.scheduler.num_running or sim.scheduler.num_waiting:
            running = {s: seq.remaining for s, seq in sim.scheduler._running.items()}
            plan = sim.step()
            plans.append(plan)
            back = [c.seq_id for c in plan.chunks if c.seq_id not in running]
            decodes = [c for c in plan.chunks if running.get(c.seq_id) == 1]
            prefills = [c for c in plan.chunks if running.get(c.seq_id, 1) > 1]
            if (back and sim.scheduler.sequence(back[0]).num_preemptions and decodes and not prefills
                    and 12 - len(running) < 12 // 4):
                readmitted_where_a_fresh_one_would_wait += 1
        return plans, readmitted_where_a_fresh_one_would_wait

    plans, cases = run(0)
    delayed, _ = run(8)
    assert sum(len(p.preempted) for p in plans) > 0
    assert cases > 0, "the scenario no longer exercises the rule"
    assert delayed == plans


def test_invalid_delay_is_rejected_by_name() -> None:
    kv = KVCacheManager(8, 4, low_watermark=0.0)
    with pytest.raises(ValueError, match="admission_delay_steps must be >= 0, got -1"):
        Scheduler(kv, max_running=4, max_step_tokens=8, max_prefill_chunk=8, admission_delay_steps=-1)


# -- property: the rule, checked step by step against a model of it ---------------------------


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt: list[int]
    max_new_tokens: int


PREFIXES = ([3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [])
prompt_st = st.builds(lambda prefix, tail: prefix + tail, st.sampled_from(PREFIXES),
                      st.lists(st.integers(0, 9), min_size=1, max_size=6))


def arrivals_st(steps: st.SearchStrategy[int], new_tokens: st.SearchStrategy[int], max_size: int,
                min_size: int = 0) -> st.SearchStrategy[list[Arrival]]:
    return st.lists(st.builds(Arrival, step=steps, prompt=prompt_st, max_new_tokens=new_tokens),
                    min_size=min_size, max_size=max_size)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    stream=arrivals_st(st.integers(1, 40), st.integers(1, 16), 40),
    delay=st.integers(0, 6),
    max_running=st.integers(6, 16),  # below 8 a quarter is one slot: never deferred
    spare_slots=st.integers(0, 4),
    max_step_tokens=st.integers(8, 64),
    max_prefill_chunk=st.integers(1, 16),
    pool_eighths=st.one_of(st.just(8), st.integers(1, 7)),  # 8: roomy; less: tighter, preemptions
    admission=st.sampled_from(["fcfs", "cache_aware"]),
    overlap=st.booleans(),
)
def test_every_request_finishes_and_admission_follows_the_rule(
    data: st.DataObject, stream: list[Arrival], delay: int, max_running: int, spare_slots: int, max_step_tokens: int,
    max_prefill_chunk: int, pool_eighths: int, admission: str, overlap: bool,
) -> None:
    """Random arrivals, pool sizes, policies, synchronous or overlapped steps. Each step is checked
    against a model of the rule: a deferred step admits nobody, at most `delay` steps in a row are
    deferred, and (in a pool where the head always fits) a step the rule does not defer admits.
    Every request finishes with all its tokens; debug_checks runs check_integrity after each call."""
    # Long requests at step 0 fill all but spare_slots of the batch and keep it decoding while the
    # stream arrives: few free slots and decode-only steps are where the delay applies.
    residents = data.draw(arrivals_st(st.just(0), st.integers(8, 30), max(0, max_running - spare_slots),
                                      min_size=max(0, max_running - spare_slots)), label="residents")
    arrivals = sorted(residents + stream, key=lambda a: a.step)
    page_size = 2
    # roomy: every request (at most 43 KV tokens: 22 pages) fits beside max_running others plus the
    # reserve, so nothing is preempted; a smaller pool still holds the largest request alone
    roomy = pool_eighths == 8
    num_pages = max(22, (max_running + 1) * 24 * pool_eighths // 8)
    sim = make_runner(num_pages, page_size, max_running=max_running, max_step_tokens=max_step_tokens,
                      max_prefill_chunk=max_prefill_chunk, admission=admission, admission_delay_steps=delay)
    scheduler = sim.scheduler
    ids: list[int] = []
    pending = list(reversed(arrivals))
    deferred_in_a_row = 0  # the model's counter
    quarter = max(1, max_running // 4)
    for step in range(3_000):
        while pending and pending[-1].step <= step:
            arrival = pending.pop()
            sim.add(len(ids), arrival.prompt, max_new_tokens=arrival.max_new_tokens)
            ids.append(len(ids))
        live = [s for s in ids if s in scheduler._seqs]
        if not pending and not (scheduler.num_running or scheduler.num_waiting):
            break
        running = {s: scheduler.sequence(s).remaining for s in live if scheduler.sequence(s).state is SeqState.RUNNING}
        waiting = [s for s in live if scheduler.sequence(s).state is SeqState.WAITING]
        preempted_waiting = any(scheduler.sequence(s).num_preemptions for s in waiting)
        plan = sim.launch() if overlap else sim.step()
        if overlap and scheduler.num_unresolved > 1:
            sim.resolve()
        ran = [c for c in plan.chunks if c.seq_id in running]
        got_in = [c.seq_id for c in plan.chunks if c.seq_id not in running]
        budget_left = max_step_tokens - sum(c.num_tokens for c in ran)
        free = max_running - len(running)
        if not waiting:
            deferred_in_a_row = 0
            assert not got_in
        elif plan.preempted or not free or not budget_left:
            assert not got_in  # no room: neither an admission round nor a deferred step
        else:
            defer = (deferred_in_a_row < delay and any(running[c.seq_id] == 1 for c in ran)
                     and not any(running[c.seq_id] > 1 for c in ran) and free < quarter and not preempted_waiting)
            if defer:
                deferred_in_a_row += 1
                assert not got_in, f"step {step}: admitted {got_in} during the delay ({deferred_in_a_row}/{delay})"
            else:
                deferred_in_a_row = 0
                if roomy and admission == "fcfs":  # cache_aware may hold back prompts being computed
                    assert got_in, f"step {step}: admission was due, nobody admitted"
        assert scheduler._admission_deferrals == deferred_in_a_row
        if roomy:
            assert not plan.preempted
    else:
        raise AssertionError("not idle after 3,000 steps")
    while scheduler.num_unresolved:
        sim.resolve()
    for seq_id, arrival in zip(ids, arrivals):
        seq = scheduler.sequence(seq_id)
        assert seq.state is SeqState.DONE and seq.num_generated == arrival.max_new_tokens
        sim.finish(seq_id)
    assert scheduler.stats().active == 0
