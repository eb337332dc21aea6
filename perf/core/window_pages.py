"""KV pages a request holds with a sliding window (pages before it go back to the pool) vs full attention.

    python perf/core/window_pages.py [--window 4096] [--page-size 16] [--context 32768] [--plot PATH]

A pure kvshare.core replay (Scheduler + KVCacheManager, no model, a few seconds on the CPU), with the
engine's default chunking (max_prefill_chunk 512, max_step_tokens 2048):

1. one request whose context grows to --context tokens (prompt, then decodes): the pages it holds
   while each step runs, at a few context lengths, with the window and with full attention;
2. --requests such requests at once in a pool of --pool-pages pages: steps to finish them all,
   preemptions, the most running at once, the pool's peak active pages.

--plot writes pages held against context length as a PNG (matplotlib, when installed).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `kvshare`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backend"))

from kvshare.core import KVCacheManager, Scheduler
from kvshare.core.window import max_pages_held

DECODE_TOKENS = 1024   # the last tokens of the context are generated one a step


@dataclass(frozen=True)
class Growth:
    held: tuple[tuple[int, int], ...]   # (context after the step, pages the request held while it ran)
    steps: int


@dataclass(frozen=True)
class Crowd:
    finished: int
    steps: int
    preemptions: int
    max_running: int
    peak_active: int


def scheduler(num_pages: int, page_size: int, window: int, max_running: int = 64) -> Scheduler:
    kv = KVCacheManager(num_pages, page_size, window=window, low_watermark=0.0)
    return Scheduler(kv, max_running=max_running, max_step_tokens=2048, max_prefill_chunk=512)


def grow_one(context: int, window: int, page_size: int) -> Growth:
    """One request alone in a pool that holds it whole: pages held while each step runs."""
    s = scheduler(-(-context // page_size) + 8, page_size, window)
    rng = random.Random(0)
    prompt = [rng.randrange(32000) for _ in range(context - DECODE_TOKENS)]
    s.add(0, prompt, max_new_tokens=DECODE_TOKENS + 1)     # the last sampled token is never fed back
    held, steps = [], 0
    while s.num_running or s.num_waiting:
        plan = s.schedule()
        chunk = plan.chunks[0]
        held.append((chunk.start + chunk.num_tokens, s.kv.pages_held(0)))
        s.on_step_done({0: rng.randrange(32000)} if chunk.samples else {})
        steps += 1
    s.finish(0)
    assert s.kv.pool.num_active == 0
    return Growth(tuple(held), steps)


def crowd(requests: int, context: int, window: int, page_size: int, pool_pages: int) -> Crowd:
    """requests such requests added at once to a pool of pool_pages."""
    s = scheduler(pool_pages, page_size, window)
    rng = random.Random(1)
    for seq_id in range(requests):
        prompt = [rng.randrange(32000) for _ in range(context - DECODE_TOKENS)]
        s.add(seq_id, prompt, max_new_tokens=DECODE_TOKENS + 1)
    finished = steps = most = peak = 0
    while s.num_running or s.num_waiting:
        plan = s.schedule()
        finished += len(plan.rejected)
        most, peak = max(most, s.num_running), max(peak, s.kv.pool.num_active)
        s.on_step_done({c.seq_id: rng.randrange(32000) for c in plan.chunks if c.samples})
        steps += 1
    finished = sum(1 for seq_id in range(requests) if s.sequence(seq_id).num_generated == DECODE_TOKENS + 1)
    for seq_id in range(requests):
        s.finish(seq_id)
    assert s.kv.pool.num_active == 0
    return Crowd(finished, steps, s.preemptions_total, most, peak)


def at(growth: Growth, context: int) -> int:
    """Pages held by the step that reached `context` tokens (or the first past it)."""
    return next(held for end, held in growth.held if end >= context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--pool-pages", type=int, default=4096)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    w, size, ctx = args.window, args.page_size, args.context
    started = time.monotonic()
    full, windowed = grow_one(ctx, 0, size), grow_one(ctx, w, size)

    print(f"one request growing to {ctx:,} tokens, page_size {size}, window {w:,} "
          f"(prefill chunks of 512, then {DECODE_TOKENS} decodes): pages held while a step runs")
    print(f"{'context':>8} {'full':>7} {'window':>7} {'window/full':>11}")
    marks = sorted({m for m in (1024, 2048, 4096, 8192, 16384, ctx) if m <= ctx})
    for m in marks:
        f, g = at(full, m), at(windowed, m)
        print(f"{m:>8,} {f:>7,} {g:>7,} {g / f:>11.3f}")
    pf, pw = max(h for _, h in full.held), max(h for _, h in windowed.held)
    decode_w = max(h for end, h in windowed.held if end > ctx - DECODE_TOKENS)
    print(f"{'peak':>8} {pf:>7,} {pw:>7,} {pw / pf:>11.3f}")
    print(f"bounds: ceil(context/page) = {-(-ctx // size):,}; window + chunk of 512 = "
          f"{max_pages_held(ctx, w, size, chunk=512):,}; window + a decode = {max_pages_held(ctx, w, size):,} "
          f"(decode steps held at most {decode_w:,})")
    print(f"KV at 32 layers x 8 KV heads x 128 dims x 2 bytes (a Llama-3-8B shape): "
          f"{pf * size * 131072 / 2**30:.2f} GiB full vs {pw * size * 131072 / 2**30:.2f} GiB windowed per request")

    print(f"\n{args.requests} such requests at once in a pool of {args.pool_pages:,} pages "
          f"({args.pool_pages * size:,} tokens):")
    print(f"{'attention':<10} {'finished':>8} {'steps':>7} {'preempt':>7} {'most running':>12} {'peak active':>11}")
    for label, window in (("full", 0), (f"window {w}", w)):
        c = crowd(args.requests, ctx, window, size, args.pool_pages)
        print(f"{label:<10} {c.finished:>8} {c.steps:>7,} {c.preemptions:>7} {c.max_running:>12} {c.peak_active:>11,}")
    print(f"({time.monotonic() - started:.1f} s)")

    if args.plot is not None:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)
            return
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        for growth, label in ((full, "full attention"), (windowed, f"window {w:,}")):
            ax.plot([e for e, _ in growth.held], [h for _, h in growth.held], label=label)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"pages held (page_size {size})")
        ax.set_title("KV pages one request holds while its steps run")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
