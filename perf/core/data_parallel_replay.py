"""Replay a workload trace over N engines behind kvshare.core's Router, without a model: prefix hit
rate and prefill work of cache-aware routing vs round robin.

Each engine is a real Scheduler over its own KVCacheManager (the engine's bookkeeping; sampled
tokens are seeded random ids, outputs forced to max_new_tokens), the engines step in lockstep, and
the router sees exactly what the server's router sees: each engine's prefix index (probed
read-only) and the prompts in flight. Closed-loop traces keep trace.concurrency requests in flight
over all engines together.

    python -m perf.core.data_parallel_replay                      # seed-hot10 and shared-prefix, 2 engines
    python -m perf.core.data_parallel_replay --engines 4 --pages 4096 16384 --traces shared-prefix
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass

from perf.core.workload_traces import Trace, make_trace

from kvshare.core import KVCacheManager, Scheduler, SeqState
from kvshare.core.router import Router, RouterSettings

# (label, routing policy, track prompts in flight)
POLICIES = (("cache_aware", "cache_aware", True), ("cache_aware, index only", "cache_aware", False),
            ("round_robin", "round_robin", False))


@dataclass(frozen=True)
class DataParallelResult:
    trace: str
    policy: str
    engines: int
    pages_per_engine: int
    requests: int
    steps: int                      # lockstep steps until the last request finished
    prompt_tokens: int
    cached_tokens: int              # prompt tokens served from an engine's cache at first admission
    prefill_tokens: int             # tokens computed in prefill chunks (recomputation included)
    requests_per_engine: tuple[int, ...]
    reasons: dict[str, int]
    evictions: int
    preemptions: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens


def replay_data_parallel(trace: Trace, *, engines: int, pages_per_engine: int, page_size: int = 16,
                         policy: str = "cache_aware", track_in_flight: bool = True,
                         settings: RouterSettings | None = None, max_running: int = 256, max_step_tokens: int = 4096,
                         max_prefill_chunk: int = 2048, step_time_s: float = 0.02, seed: int = 0,
                         label: str | None = None) -> DataParallelResult:
    kvs = [KVCacheManager(pages_per_engine, page_size, low_watermark=0.0) for _ in range(engines)]
    schedulers = [Scheduler(kv, max_running=max_running, max_step_tokens=max_step_tokens,
                            max_prefill_chunk=max_prefill_chunk) for kv in kvs]
    base = settings or RouterSettings()
    router = Router(kvs, page_size, RouterSettings(policy, base.balance_abs, base.balance_ratio, base.min_match_tokens),
                    track_in_flight=track_in_flight)
    rng = random.Random(seed)
    pending = list(reversed(trace.requests))
    in_flight: dict[int, int] = {}          # request id -> engine
    per_engine = [0] * engines
    cached = prefill = steps = 0
    started = time.monotonic()
    while pending or in_flight:
        while pending and _may_submit(trace, pending[-1].arrival_s, len(in_flight), steps, step_time_s):
            request = pending.pop()
            decision = router.route(str(request.request_id), kvs[0].page_keys(request.prompt_ids, request.salt),
                                    request.salt)
            schedulers[decision.engine].add(request.request_id, request.prompt_ids, salt=request.salt,
                                            max_new_tokens=request.max_new_tokens)
            in_flight[request.request_id] = decision.engine
            per_engine[decision.engine] += 1
        steps += 1
        for scheduler in schedulers:
            plan = scheduler.schedule()
            assert not plan.rejected, plan.rejected
            prefill += sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1 or not c.samples)
            scheduler.on_step_done({c.seq_id: rng.randrange(32_000) for c in plan.chunks if c.samples})
        for rid in [r for r, e in in_flight.items() if schedulers[e].sequence(r).state is SeqState.DONE]:
            scheduler = schedulers[in_flight.pop(rid)]
            cached += scheduler.num_cached_tokens(rid)
            scheduler.finish(rid)
            router.release(str(rid))
        if steps % 2000 == 0 and time.monotonic() - started > 3:
            done = len(trace.requests) - len(pending) - len(in_flight)
            print(f"\r  {trace.name} {label or policy} x{engines}: {done}/{len(trace.requests)} requests",
                  end="", file=sys.stderr, flush=True)
    if time.monotonic() - started > 3:
        print("\r" + " " * 78 + "\r", end="", file=sys.stderr, flush=True)
    stats = [s.stats() for s in schedulers]
    assert all(s.active == 0 for s in stats), f"leak: {stats}"
    router.check_integrity()
    reasons: dict[str, int] = {}
    for (_, reason), count in router.decisions.items():
        reasons[reason] = reasons.get(reason, 0) + count
    return DataParallelResult(trace.name, label or policy, engines, pages_per_engine, len(trace.requests), steps,
                              sum(len(r.prompt_ids) for r in trace.requests), cached, prefill, tuple(per_engine),
                              reasons, sum(s.evictions_total for s in stats), sum(s.preemptions_total for s in stats))


def _may_submit(trace: Trace, arrival_s: float, in_flight: int, steps: int, step_time_s: float) -> bool:
    if trace.concurrency is not None:
        return in_flight < trace.concurrency
    return arrival_s <= steps * step_time_s


def format_table(results: list[DataParallelResult]) -> str:
    head = (f"| trace | engines | pages/engine | routing | hit rate | prefill tokens | vs round robin | steps | "
            f"requests per engine | decisions |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    rr = {(r.trace, r.engines, r.pages_per_engine): r for r in results if r.policy == "round_robin"}
    for r in results:
        base = rr.get((r.trace, r.engines, r.pages_per_engine))
        vs = f"{r.prefill_tokens / base.prefill_tokens:.2f}x" if base else "-"
        decisions = ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items()))
        lines.append(f"| {r.trace} | {r.engines} | {r.pages_per_engine} | {r.policy} | {r.hit_rate:.1%} | "
                     f"{r.prefill_tokens:,} | {vs} | {r.steps:,} | {' / '.join(map(str, r.requests_per_engine))} | "
                     f"{decisions} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", nargs="+", default=["seed-hot10", "shared-prefix"])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--pages", type=int, nargs="+", default=[2048, 8192],
                        help="pages per engine (16 tokens each); one table row group per value")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--balance-abs", type=int, default=RouterSettings.balance_abs)
    parser.add_argument("--balance-ratio", type=float, default=RouterSettings.balance_ratio)
    args = parser.parse_args(argv)
    settings = RouterSettings(balance_abs=args.balance_abs, balance_ratio=args.balance_ratio)
    results = []
    for name in args.traces:
        trace = make_trace(name)
        for pages in args.pages:
            one = replay_data_parallel(trace, engines=1, pages_per_engine=pages * args.engines, page_size=args.page_size,
                                       policy="round_robin", label="one engine, pool of all")
            results.append(one)
            for label, policy, track in POLICIES:
                results.append(replay_data_parallel(trace, engines=args.engines, pages_per_engine=pages,
                                                    page_size=args.page_size, policy=policy, track_in_flight=track,
                                                    settings=settings, label=label))
    print(f"Data-parallel replay: {args.engines} engines, page size {args.page_size}, router balance_abs "
          f"{args.balance_abs}, balance_ratio {args.balance_ratio} (perf/core/data_parallel_replay.py)\n")
    print(format_table(results))
    print("\nhit rate: prompt tokens served from the chosen engine's pages at admission; prefill tokens: tokens "
          "computed, recomputation after preemption included; steps: lockstep engine steps to drain the trace "
          "(the slowest engine sets it); 'one engine, pool of all' is a single pool as large as all engines' together.")


if __name__ == "__main__":
    main()
