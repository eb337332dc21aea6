"""Host cost of the scheduler's step at batch 256 (CPU, no model): schedule + on_step_done.

256 sequences, random 128-token prompts, 128 new tokens each, page size 16, all admitted in the
first steps (max_step_tokens large), then decoded together. Prints ms per decode step and the
share of kv.commit; --profile adds a cProfile of the decode steps.

    python perf/core/profile_commit.py [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

from kvshare.core.kv_cache_manager import KVCacheManager
from kvshare.core.scheduler import Scheduler


def run(batch: int = 256, prompt: int = 128, new: int = 128, page_size: int = 16, profile: bool = False) -> None:
    rng = random.Random(0)
    kv = KVCacheManager(num_pages=batch * (prompt + new) // page_size + 64, page_size=page_size)
    sched = Scheduler(kv, max_running=batch, max_step_tokens=batch * prompt, max_prefill_chunk=prompt)
    for i in range(batch):
        sched.add(i, [rng.randrange(32000) for _ in range(prompt)], max_new_tokens=new)
    commit_s = [0.0]
    orig = kv.commit

    def timed(*a, **k):
        t0 = time.perf_counter()
        orig(*a, **k)
        commit_s[0] += time.perf_counter() - t0

    kv.commit = timed
    plan = sched.schedule()                       # prefill step: every prompt at once
    sched.on_step_done({c.seq_id: rng.randrange(32000) for c in plan.chunks if c.samples})
    prof = cProfile.Profile() if profile else None
    steps, t0 = 0, time.perf_counter()
    commit_s[0] = 0.0
    if prof:
        prof.enable()
    while True:
        plan = sched.schedule()
        if not plan.chunks:
            break
        sched.on_step_done({c.seq_id: rng.randrange(32000) for c in plan.chunks if c.samples})
        steps += 1
        for c in plan.chunks:
            if sched.sequence(c.seq_id).reached_max_tokens:
                sched.finish(c.seq_id)
    if prof:
        prof.disable()
    dt = time.perf_counter() - t0
    print(f"batch {batch}: {steps} decode steps, {dt / steps * 1e3:.3f} ms/step host "
          f"(kv.commit {commit_s[0] / steps * 1e3:.3f} ms/step)")
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(15)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    run(batch=args.batch, profile=args.profile)
