"""KV pages held per running request with prefix sharing on vs off (seed 000: 14.2 -> 9.8 GB).

    python perf/core/kv_pages_per_request.py [--page-size 16] [--pages 4096]

pages/req = active pages summed over steps / running requests summed over steps (a shared page
counts once, however many requests reference it); mean active = active pages averaged over steps. The pool
is large enough that nothing is evicted or preempted, so the difference is sharing alone.
seed-12x128 (all prompts distinct) is the control: its ratio should be ~1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.core.replay import replay
from perf.core.workload_traces import make_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--pages", type=int, default=4096)
    args = parser.parse_args()
    print(f"{'trace':<14} {'sharing':<8} {'pages/req':>9} {'mean active':>11} {'hit':>6} {'steps':>6}")
    for name in ("seed-hot10", "seed-12x128"):
        trace = make_trace(name)
        on, off = (replay(trace, num_pages=args.pages, page_size=args.page_size, sharing=s) for s in (True, False))
        for label, r in (("on", on), ("off", off)):
            print(f"{name:<14} {label:<8} {r.pages_per_request:>9.2f} {r.active_page_steps / r.steps:>11.1f} "
                  f"{r.hit_rate:>6.1%} {r.steps:>6}")
        print(f"{name:<14} {'on/off':<8} {on.pages_per_request / off.pages_per_request:>9.3f} "
              f"{on.active_page_steps / off.active_page_steps:>11.3f}")


if __name__ == "__main__":
    main()
