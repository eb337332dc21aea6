"""Prefix hit rate per eviction policy when the pool is smaller than the working set.

    python perf/core/eviction_hit_rate.py [--page-size 16]

Replays seed-hot10 and prefix-repetition through the Scheduler for each policy at two pool sizes
below the working set (peak active pages + the pages of every reusable prompt). hit = prompt tokens
served from the cache at admission / prompt tokens; prefill = tokens computed in prefill chunks
(recomputation after preemption included); both come from one deterministic replay per cell.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.core.replay import replay
from perf.core.workload_traces import make_trace

from kvshare.core import POLICY_NAMES

# (trace, pool sizes in pages of 16 tokens): seed-hot10 peaks at ~197 active pages and its hot
# prompts need ~80 more; prefix-repetition needs ~640 active pages + 160 for its 10 prefixes.
CASES = (("seed-hot10", (220, 280)), ("prefix-repetition", (480, 640)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    scale = 16 / args.page_size
    print(f"{'trace':<18} {'pages':>5} {'policy':<14} {'hit':>6} {'prefill tok':>11} {'evictions':>9} {'preempt':>7}")
    for name, sizes in CASES:
        trace = make_trace(name)
        for size in sizes:
            pages = round(size * scale)
            for policy in POLICY_NAMES:
                r = replay(trace, num_pages=pages, page_size=args.page_size, policy=policy)
                print(f"{name:<18} {pages:>5} {policy:<14} {r.hit_rate:>6.1%} {r.prefill_tokens:>11} "
                      f"{r.evictions:>9} {r.preemptions:>7}")


if __name__ == "__main__":
    main()
