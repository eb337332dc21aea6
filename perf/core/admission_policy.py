"""Admission policy on the shared-prefix trace: fcfs vs cache_aware, pools below and above the working set.

    python perf/core/admission_policy.py [--requests N] [--skips 4,16,32,64,256]
    python perf/core/admission_policy.py --admission-delay 0,2,4,8
    python perf/core/admission_policy.py --host-pages 0,2000,7629 [--host-min-hits 0]

Replays SGLang's generated-shared-prefix shape (perf/core/workload_traces.py "shared-prefix": 64
groups x 16 requests, a 2048-token group prefix + a 128-token question, shuffled so the groups
interleave) through the Scheduler with no model, as the H200 run drives the engine: closed loop, 64
requests in flight, max_running 64, 4096-token steps, 2048-token prefill chunks, 128 output tokens
(the trace's 256 cut to the GPU run's 128). Pools: 5,120 pages (40 GB of llama-2-7b fp16 KV at page
16: the 64 prefixes, 8,192 pages, do not fit) and 12,800 (100 GB).

hit = prompt tokens served from the cache at first admission / prompt tokens; prefill = tokens
actually computed in prefill chunks (recomputation after preemption included); steps = engine steps
(a proxy for time: each step is one forward); wait = steps from add() to first admission. The
"off" rows (prefix caching disabled) are the no-sharing reference. A last table keeps 256 requests
in flight (max_running still 64), as a loaded server does, so the policy has more to choose from.

--admission-delay sweeps Scheduler(admission_delay_steps=d) instead, in the H200 run's shape (the
whole trace with its 256 output tokens, sent at once, max_running 256, 12,800 pages, cache_aware):
steps by kind (decode-only / mixed / prefill-only), prefill tokens per mixed step, and a time
estimate from that run's step costs (see DECODE_STEP_S).

--host-pages replays that shape with a pool too small for the 64 prefixes (2,384 pages: 20 GB of
llama-2-7b fp16 KV) and a host tier of N pages below it (7,629 pages: 64 GB): prompt tokens computed,
served from the GPU pool, loaded from the host, and the pages spilled (bookkeeping only: what
`python -m perf.gpu tier` measures in time).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from dataclasses import dataclass
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.core.workload_traces import Trace, make_trace

from kvshare.core import KVCacheManager, Scheduler, SeqState
from kvshare.core.host_tier import HostTier

CONCURRENCY = 64
DEEP = 256  # the deeper-queue rows: requests in flight beyond max_running
OUTPUT_TOKENS = 128
POOLS = (5_120, 12_800)
PAGE_SIZE = 16
# A crude H200 step-cost model for --admission-delay, from the whole-trace shared-prefix run
# (docs/results/h200.md): decode-only cascade-graph steps 28.0 ms; 167 mixed steps of 100.6 ms
# carried 323k prefill tokens (~1,930 each), about half of a mixed step being the decode rows'
# attention whatever the prefill carries: ~50 ms fixed + ~26 us per prefill token.
DECODE_STEP_S = 0.028
MIXED_STEP_FIXED_S = 0.050
PREFILL_TOKEN_S = 0.050 / 1_930


@dataclass(frozen=True)
class Result:
    hit: float
    evictions: int
    prefill: int
    steps: int
    preemptions: int
    max_wait: int
    mean_wait: float
    decode_steps: int = 0  # steps with decode chunks only
    mixed_steps: int = 0  # steps with prefill and decode chunks
    mixed_prefill: int = 0  # prefill tokens computed in mixed steps
    host_hits: int = 0  # prompt tokens loaded back from the host tier
    host_spills: int = 0  # pages copied to the host tier

    @property
    def estimated_s(self) -> float:
        """The H200 step-cost model above; prefill-only steps are charged as mixed ones."""
        prefill_steps = self.steps - self.decode_steps - self.mixed_steps
        return (self.decode_steps * DECODE_STEP_S + (self.mixed_steps + prefill_steps) * MIXED_STEP_FIXED_S
                + self.prefill * PREFILL_TOKEN_S)


def replay(trace: Trace, *, num_pages: int, policy: str, admission: str, sharing: bool = True,
           max_admission_skips: int | None = None, in_flight_limit: int = CONCURRENCY, seed: int = 0,
           max_running: int = CONCURRENCY, admission_delay_steps: int = 0, host_pages: int = 0,
           host_min_hits: int = 1) -> Result:
    kv = KVCacheManager(num_pages, PAGE_SIZE, policy=policy, enable_prefix_caching=sharing, low_watermark=0.0,
                        host_tier=HostTier(host_pages) if host_pages else None, host_min_hits=host_min_hits)
    extra = {} if max_admission_skips is None else {"max_admission_skips": max_admission_skips}
    scheduler = Scheduler(kv, max_running=max_running, max_step_tokens=4096, max_prefill_chunk=2048,
                          admission=admission, admission_delay_steps=admission_delay_steps, **extra)
    rng = random.Random(seed)
    pending = list(reversed(trace.requests))
    in_flight: set[int] = set()
    added_at: dict[int, int] = {}  # seq id -> step of add(), until its first admission
    waits: list[int] = []
    cached = prefill = steps = decode_steps = mixed_steps = mixed_prefill = 0
    while pending or in_flight:
        while pending and len(in_flight) < in_flight_limit:
            request = pending.pop()
            scheduler.add(request.request_id, request.prompt_ids, salt=request.salt,
                          max_new_tokens=request.max_new_tokens)
            in_flight.add(request.request_id)
            added_at[request.request_id] = steps
        plan = scheduler.schedule()
        steps += 1
        step_prefill = sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1 or not c.samples)
        decodes = sum(1 for c in plan.chunks if c.num_tokens == 1 and c.samples)
        prefill += step_prefill
        decode_steps += bool(decodes and not step_prefill)
        if decodes and step_prefill:
            mixed_steps += 1
            mixed_prefill += step_prefill
        for chunk in plan.chunks:
            if chunk.seq_id in added_at and chunk.start == scheduler.num_cached_tokens(chunk.seq_id):
                waits.append(steps - 1 - added_at.pop(chunk.seq_id))
        scheduler.on_step_done({c.seq_id: rng.randrange(32_000) for c in plan.chunks if c.samples})
        for seq_id in [s for s in in_flight if scheduler.sequence(s).state is SeqState.DONE]:
            cached += scheduler.num_cached_tokens(seq_id)
            in_flight.discard(seq_id)
            scheduler.finish(seq_id)
    stats = scheduler.stats()
    assert stats.active == 0 and not added_at, f"leak: {stats}, never admitted: {sorted(added_at)[:8]}"
    prompt = sum(len(r.prompt_ids) for r in trace.requests)
    return Result(cached / prompt, stats.evictions_total, prefill, steps, stats.preemptions_total,
                  max(waits), sum(waits) / len(waits), decode_steps, mixed_steps, mixed_prefill,
                  stats.host_hits_tokens_total, stats.host_spills_total)


HEADER = (f"{'pages':>6} {'evic':<4} {'admission':<12} {'hit':>6} {'evictions':>9} {'prefill':>10} "
          f"{'steps':>6} {'preempt':>7} {'max wait':>8} {'mean wait':>9}")


def row(pages: int, policy: str, admission: str, r: Result) -> str:
    return (f"{pages:>6} {policy:<4} {admission:<12} {r.hit:>6.1%} {r.evictions:>9} {r.prefill:>10} "
            f"{r.steps:>6} {r.preemptions:>7} {r.max_wait:>8} {r.mean_wait:>9.1f}")


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}" if b else "-"


def hot10_closed_loop() -> None:
    """The shape where cache_aware ran 13% slower on the H200: does the policy schedule differently?"""
    trace = make_trace("seed-hot10")
    trace = dataclasses.replace(trace, requests=trace.requests[:36])
    print("seed-hot10: 36 requests, 12 in flight, max_running 12, 20,000 pages")
    print(HEADER)
    for admission in ("fcfs", "cache_aware"):
        r = replay(trace, num_pages=20_000, policy="lru", admission=admission, in_flight_limit=12, max_running=12)
        print(row(20_000, "lru", admission, r))


H200_RUNNING = 256   # the H200 shared-prefix run: the whole trace sent at once, cache_aware, LRU


def h200_trace(requests: int | None) -> Trace:
    trace = make_trace("shared-prefix")
    return dataclasses.replace(trace, requests=trace.requests[: requests or len(trace.requests)])


def h200_replay(trace: Trace, num_pages: int, **kw) -> Result:
    return replay(trace, num_pages=num_pages, policy="lru", admission="cache_aware",
                  in_flight_limit=len(trace.requests), max_running=H200_RUNNING, **kw)


def admission_delay_sweep(delays: list[int], requests: int | None) -> None:
    """The H200 shared-prefix run's shape, with and without the admission delay."""
    trace = h200_trace(requests)
    pages, running = 12_800, H200_RUNNING
    print(f"shared-prefix: {len(trace.requests)} requests sent at once, {trace.requests[0].max_new_tokens} output "
          f"tokens, max_running {running}, {pages:,} pages, cache_aware, lru")
    print(f"{'delay':>5} {'steps':>6} {'decode':>6} {'mixed':>6} {'prefill':>7} {'prefill tok':>11} "
          f"{'per mixed':>9} {'hit':>6} {'preempt':>7} {'mean wait':>9} {'max wait':>8} {'est. s':>7}")
    for delay in delays:
        r = h200_replay(trace, pages, admission_delay_steps=delay)
        only_prefill = r.steps - r.decode_steps - r.mixed_steps
        print(f"{delay:>5} {r.steps:>6} {r.decode_steps:>6} {r.mixed_steps:>6} {only_prefill:>7} {r.prefill:>11,} "
              f"{r.mixed_prefill / max(r.mixed_steps, 1):>9,.0f} {r.hit:>6.1%} {r.preemptions:>7} "
              f"{r.mean_wait:>9.1f} {r.max_wait:>8} {r.estimated_s:>7.1f}")
    print(f"est. s: decode-only {DECODE_STEP_S * 1e3:.0f} ms, mixed/prefill {MIXED_STEP_FIXED_S * 1e3:.0f} ms "
          f"+ {PREFILL_TOKEN_S * 1e6:.0f} us per prefill token (H200 profile, whole trace; a model, not a measurement)")


def host_tier_sweep(host_pages: list[int], requests: int | None, min_hits: int, pool: int = 2_384) -> None:
    """The H200 shared-prefix shape (delay 8) with a small pool, with and without a host tier."""
    trace = h200_trace(requests)
    prompt = sum(len(r.prompt_ids) for r in trace.requests)
    print(f"shared-prefix: {len(trace.requests)} requests sent at once, max_running {H200_RUNNING}, {pool:,} pages, "
          f"cache_aware, lru, admission delay 8, host_min_hits {min_hits}; {prompt:,} prompt tokens")
    print(f"{'host pages':>10} {'computed':>10} {'from GPU':>10} {'from host':>10} {'spills':>7} {'steps':>6} "
          f"{'preempt':>7} {'est. s':>7}")
    for host in host_pages:
        r = h200_replay(trace, pool, admission_delay_steps=8, host_pages=host, host_min_hits=min_hits)
        from_gpu = round(r.hit * prompt) - r.host_hits
        print(f"{host:>10,} {r.prefill:>10,} {from_gpu:>10,} {r.host_hits:>10,} {r.host_spills:>7,} {r.steps:>6} "
              f"{r.preemptions:>7} {r.estimated_s:>7.1f}")
    print("est. s: the --admission-delay step-cost model; host copies are not charged (a model, not a measurement)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=None, help="cut the trace (default: all 1024)")
    parser.add_argument("--skips", default="", help="also sweep max_admission_skips at 256 in flight, e.g. 4,16,64")
    parser.add_argument("--hot10", action="store_true",
                        help="instead: seed-hot10's first 36 requests in a closed loop of 12 (the H200 run's shape)")
    parser.add_argument("--admission-delay", default="", metavar="D,D,...",
                        help="instead: sweep admission_delay_steps (e.g. 0,2,4,8) in the H200 run's shape")
    parser.add_argument("--host-pages", default="", metavar="N,N,...",
                        help="instead: a host tier of N pages below a 2,384-page pool (e.g. 0,7629)")
    parser.add_argument("--host-min-hits", type=int, default=1,
                        help="with --host-pages: spill only pages that many admissions shared (0: every page)")
    args = parser.parse_args()
    if args.host_pages:
        host_tier_sweep([int(n) for n in args.host_pages.split(",")], args.requests, args.host_min_hits)
        return
    if args.admission_delay:
        admission_delay_sweep([int(d) for d in args.admission_delay.split(",")], args.requests)
        return
    if args.hot10:
        hot10_closed_loop()
        return
    trace = make_trace("shared-prefix")
    requests = tuple(dataclasses.replace(r, max_new_tokens=OUTPUT_TOKENS)
                     for r in trace.requests[: args.requests or len(trace.requests)])
    trace = dataclasses.replace(trace, requests=requests)
    started = time.monotonic()
    print(f"shared-prefix: {len(requests)} requests, {CONCURRENCY} in flight, {OUTPUT_TOKENS} output tokens, "
          f"page {PAGE_SIZE}")
    print(HEADER)
    ratios = []
    for pages in POOLS:
        off = replay(trace, num_pages=pages, policy="lru", admission="fcfs", sharing=False)
        print(row(pages, "-", "off", off))
        for policy in ("lru", "lfu"):
            fcfs = replay(trace, num_pages=pages, policy=policy, admission="fcfs")
            aware = replay(trace, num_pages=pages, policy=policy, admission="cache_aware")
            print(row(pages, policy, "fcfs", fcfs))
            print(row(pages, policy, "cache_aware", aware))
            ratios.append((pages, policy, fcfs, aware, off))
    print("\ncache_aware / fcfs (lower is better but for hit); sharing = steps without sharing / steps")
    print(f"{'pages':>6} {'evic':<4} {'hit':>13} {'evictions':>9} {'prefill':>8} {'steps':>6} {'max wait':>9} "
          f"{'sharing fcfs':>12} {'sharing aware':>13}")
    for pages, policy, fcfs, aware, off in ratios:
        print(f"{pages:>6} {policy:<4} {fcfs.hit:>5.1%}->{aware.hit:>5.1%} "
              f"{_ratio(aware.evictions, fcfs.evictions):>9} {aware.prefill / fcfs.prefill:>8.2f} "
              f"{aware.steps / fcfs.steps:>6.2f} {aware.max_wait / max(fcfs.max_wait, 1):>9.2f} "
              f"{off.steps / fcfs.steps:>11.2f}x {off.steps / aware.steps:>12.2f}x")
    # A server queues past max_running (up to max_queued_requests): more to choose from.
    print(f"\ndeeper queue: {DEEP} in flight, max_running still {CONCURRENCY}, lru")
    print(HEADER)
    for pages in POOLS:
        for admission in ("fcfs", "cache_aware"):
            r = replay(trace, num_pages=pages, policy="lru", admission=admission, in_flight_limit=DEEP)
            print(row(pages, "lru", admission, r))
    if args.skips:
        print(f"\ncache_aware, lru, {DEEP} in flight: max_admission_skips sweep")
        for pages in POOLS:
            for skips in (int(s) for s in args.skips.split(",")):
                r = replay(trace, num_pages=pages, policy="lru", admission="cache_aware", max_admission_skips=skips,
                           in_flight_limit=DEEP)
                print(row(pages, "lru", f"skips={skips}", r))
    print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
