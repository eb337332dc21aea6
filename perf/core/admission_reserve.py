"""Admission's page reserve at large pages: a page per running sequence vs RESERVE_TOKENS of growth.

    python -m perf.core.admission_reserve [--requests N] [--page-sizes 16,64,128]

Replays the offline benchmark's traces through the Scheduler with no model, as
perf/engine/offline_benchmark.py drives the engine (4,096-token steps, 2,048-token prefill chunks,
prefix caching on), at each page size with two admission reserves:

  page each   the rule up to 2026-12-06: one allocatable page per running sequence
              (Scheduler(reserve_tokens=page_size));
  16 tokens   the default: pages for 16 tokens of growth past the step for each running sequence
              (RESERVE_TOKENS), which is the same rule at page 16 and below.

Pools are the GPU runs' (tokens of Llama-2-7B fp16 KV): fixed-256 in the benchmark's default 40 GiB
(81,920 tokens), shared-prefix's 256 requests at once in the pool an H100 80GB gets (54 GiB,
110,592 tokens) and the mixed trace at 128 in flight in a pool it fills (30,000 tokens).

steps = engine steps, the time proxy (each is one forward); rows = mean chunks per step (the batch);
first token = the step of each request's first sampled token, p50 / p95; preempt = preemptions.
On the H100 on 2026-12-06 (perf/results/peer/2026-12-06/h100/) fixed-256 at page 128 with a page
each ran 9,379 tok/s against 12,026 at page 16, TTFT p95 2,563 vs 753 ms: this replay shows why.
"""
from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.core.workload_traces import make_trace  # noqa: E402

from kvshare.core import KVCacheManager, Scheduler, SeqState  # noqa: E402
from kvshare.core.scheduler import RESERVE_TOKENS  # noqa: E402


@dataclass(frozen=True)
class Workload:
    trace: str
    requests: int
    in_flight: int        # closed loop: requests kept in flight (= max_running)
    pool_tokens: int


WORKLOADS = (
    Workload("fixed-256", 256, 256, 81_920),
    Workload("shared-prefix", 256, 256, 110_592),
    Workload("mixed", 1_000, 128, 30_000),
)


@dataclass(frozen=True)
class Replay:
    steps: int
    mean_rows: float
    first_token_p50: int
    first_token_p95: int
    preemptions: int


def replay(w: Workload, page_size: int, reserve_tokens: int, requests: int | None = None) -> Replay:
    trace = make_trace(w.trace)
    pending = list(reversed(trace.requests[:requests or w.requests]))
    kv = KVCacheManager(w.pool_tokens // page_size, page_size, low_watermark=0.0)
    scheduler = Scheduler(kv, max_running=w.in_flight, max_step_tokens=4096, max_prefill_chunk=2048,
                          reserve_tokens=reserve_tokens)
    rng = random.Random(0)
    live: set[int] = set()
    added: dict[int, int] = {}
    first: list[int] = []
    steps = rows = 0
    while pending or live:
        while pending and len(live) < w.in_flight:
            r = pending.pop()
            scheduler.add(r.request_id, r.prompt_ids, salt=r.salt, max_new_tokens=r.max_new_tokens)
            live.add(r.request_id)
            added[r.request_id] = steps
        plan = scheduler.schedule()
        steps += 1
        rows += len(plan.chunks)
        for c in plan.chunks:
            if c.samples and c.seq_id in added:
                first.append(steps - added.pop(c.seq_id))
        scheduler.on_step_done({c.seq_id: rng.randrange(32_000) for c in plan.chunks if c.samples})
        for seq_id in [s for s in live if scheduler.sequence(s).state is SeqState.DONE]:
            live.discard(seq_id)
            scheduler.finish(seq_id)
    stats = scheduler.stats()
    assert stats.active == 0 and not added, f"leak: {stats}; never sampled: {sorted(added)[:8]}"
    first.sort()
    return Replay(steps, rows / steps, first[len(first) // 2], first[int(0.95 * (len(first) - 1))],
                  stats.preemptions_total)


def table(page_sizes: Sequence[int], requests: int | None = None) -> str:
    lines = [f"{'workload':<14} {'page':>4} {'reserve':<10} {'steps':>6} {'rows':>6} {'first token p50/p95':>20} "
             f"{'preempt':>7}"]
    for w in WORKLOADS:
        for page in page_sizes:
            rules = (("page each", page), (f"{RESERVE_TOKENS} tokens", RESERVE_TOKENS))
            for label, reserve in rules[1:] if page <= RESERVE_TOKENS else rules:   # one rule up to page 16
                r = replay(w, page, reserve, requests)
                lines.append(f"{w.trace:<14} {page:>4} {label:<10} {r.steps:>6} {r.mean_rows:>6.1f} "
                             f"{f'{r.first_token_p50} / {r.first_token_p95}':>20} {r.preemptions:>7}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m perf.core.admission_reserve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=None, help="cut every trace to its first N requests")
    ap.add_argument("--page-sizes", default="16,64,128")
    a = ap.parse_args(argv)
    print(table([int(p) for p in a.page_sizes.split(",") if p], a.requests))


if __name__ == "__main__":
    main()
