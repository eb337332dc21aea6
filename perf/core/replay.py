"""Replay a workload trace through kvshare.core's Scheduler, as the engine would, without a model.

Each engine step is one schedule() / on_step_done(); sampled tokens are seeded random ids and
outputs are forced to max_new_tokens. Closed-loop traces keep trace.concurrency requests in
flight; open-loop traces submit a request once step * step_time_s reaches its arrival_s.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass

from perf.core.workload_traces import Trace

from kvshare.core import KVCacheManager, Scheduler, SeqState


@dataclass(frozen=True)
class ReplayResult:
    trace: str
    policy: str
    page_size: int
    num_pages: int
    sharing: bool
    requests: int
    steps: int
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the cache at first admission (engine's cached_tokens)
    prefill_tokens: int  # tokens computed in prefill chunks, recomputation after preemption included
    copies: int
    evictions: int
    preemptions: int
    peak_active_pages: int
    active_page_steps: int  # sum over steps of active pages
    running_seq_steps: int  # sum over steps of running sequences
    allocated_slots: int  # sampled: active pages * page_size
    used_slots: int  # sampled: tokens actually held in those pages
    page_table_entries: int  # sum over requests of the largest page table

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def pages_per_request(self) -> float:
        return self.active_page_steps / max(self.running_seq_steps, 1)

    @property
    def waste(self) -> float:
        return 1 - self.used_slots / self.allocated_slots if self.allocated_slots else 0.0


def replay(
    trace: Trace,
    *,
    num_pages: int,
    page_size: int,
    policy: str = "lru",
    sharing: bool = True,
    max_running: int = 256,
    max_step_tokens: int = 4096,
    max_prefill_chunk: int = 2048,
    step_time_s: float = 0.02,
    waste_every: int = 0,
    seed: int = 0,
) -> ReplayResult:
    kv = KVCacheManager(num_pages, page_size, policy=policy, enable_prefix_caching=sharing, low_watermark=0.0)
    scheduler = Scheduler(kv, max_running=max_running, max_step_tokens=max_step_tokens,
                          max_prefill_chunk=max_prefill_chunk)
    rng = random.Random(seed)
    pending = list(reversed(trace.requests))
    in_flight: dict[int, int] = {}  # seq id -> prompt length
    cached = prefill = copies = steps = peak = page_steps = seq_steps = allocated = used = entries = 0
    started = time.monotonic()
    while pending or in_flight:
        while pending and _may_submit(trace, pending[-1].arrival_s, len(in_flight), steps, step_time_s):
            request = pending.pop()
            scheduler.add(request.request_id, request.prompt_ids, salt=request.salt,
                          max_new_tokens=request.max_new_tokens)
            in_flight[request.request_id] = len(request.prompt_ids)
            entries += kv.pages_for(len(request.prompt_ids) + request.max_new_tokens - 1)
        plan = scheduler.schedule()
        assert not plan.rejected, plan.rejected
        steps += 1
        copies += len(plan.copies)
        prefill += sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1 or not c.samples)
        scheduler.on_step_done({c.seq_id: rng.randrange(32_000) for c in plan.chunks if c.samples})
        active = kv.pool.num_active
        peak = max(peak, active)
        page_steps += active
        seq_steps += scheduler.num_running
        if waste_every and steps % waste_every == 0:
            slots, held = _occupancy(scheduler, in_flight, page_size)
            allocated += slots
            used += held
        for seq_id in [s for s in in_flight if scheduler.sequence(s).state is SeqState.DONE]:
            cached += scheduler.num_cached_tokens(seq_id)
            del in_flight[seq_id]
            scheduler.finish(seq_id)
        if steps % 2000 == 0 and time.monotonic() - started > 3:
            done = len(trace.requests) - len(pending) - len(in_flight)
            print(f"\r  {trace.name} p={page_size} {policy}: {done}/{len(trace.requests)} requests",
                  end="", file=sys.stderr, flush=True)
    if time.monotonic() - started > 3:
        print("\r" + " " * 70 + "\r", end="", file=sys.stderr, flush=True)
    stats = scheduler.stats()
    assert stats.active == 0, f"leak: {stats}"
    return ReplayResult(
        trace.name, policy, page_size, num_pages, sharing, len(trace.requests), steps,
        sum(len(r.prompt_ids) for r in trace.requests), cached, prefill, copies, stats.evictions_total,
        stats.preemptions_total, peak, page_steps, seq_steps, allocated, used, entries,
    )


def _may_submit(trace: Trace, arrival_s: float, in_flight: int, steps: int, step_time_s: float) -> bool:
    if trace.concurrency is not None:
        return in_flight < trace.concurrency
    return arrival_s <= steps * step_time_s


def _occupancy(scheduler: Scheduler, in_flight: dict[int, int], page_size: int) -> tuple[int, int]:
    """(slots of pages referenced by running sequences, tokens those pages hold); shared pages once."""
    fill: dict[int, int] = {}
    for seq_id in in_flight:
        table = scheduler.page_table(seq_id)
        computed = scheduler.sequence(seq_id).num_computed
        for index, page in enumerate(table):
            held = min(page_size, max(0, computed - index * page_size))
            if held > fill.get(page, -1):
                fill[page] = held
    return len(fill) * page_size, sum(fill.values())
