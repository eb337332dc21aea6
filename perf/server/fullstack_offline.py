#!/usr/bin/env python3
"""perf/engine/offline_benchmark.py on the full-stack run's exact requests: the offline engine reference.

    python perf/server/fullstack_offline.py --requests 256 --concurrency 64 --input-len 128 --output-len 128 \
        -- --model dummy:llama-2-7b --device cuda --dtype float16 --kv-gb 40 --max-running 256 --json offline.json

Registers two traces in perf/core/workload_traces.py's table and runs offline_benchmark.main on them
(its own run_kvshare loop, nothing re-implemented):
  fullstack-warmup  the same shape, one request per slot and 16 output tokens (Triton kernels
                    compiled, allocator and graphs warmed; untimed in the comparison)
  fullstack         the measured requests: fullstack_common.prompts(), the same ids as the server
                    runs, `concurrency` in flight, exactly --output-len tokens, greedy, EOS ignored.
With 128 requests of 128 ids these are exactly offline_benchmark's `fixed-64` prompts; more requests
continue fixed_b's seeded sequence. Pass --max-running (after `--`) to match the server's engine;
offline_benchmark's default is the trace's concurrency.
Arguments after `--` go to offline_benchmark (model, device, dtype, KV size, step limits, --json).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.server import fullstack_common as fc  # noqa: E402

MEASURED = "fullstack"
WARMUP = "fullstack-warmup"


def register(requests: int, concurrency: int, input_len: int, output_len: int, vocab: int, seed: int = 0) -> None:
    fc.wt.TRACES[MEASURED] = lambda: fc.make_trace(MEASURED, requests, concurrency, input_len, output_len, vocab,
                                                   seed)
    fc.wt.TRACES[WARMUP] = lambda: fc.make_trace(WARMUP, concurrency, concurrency, input_len,
                                                 min(16, output_len), vocab, seed + 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, rest = argv[:k], argv[k + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000, help="ids are folded into it (offline_benchmark folds too)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup", action="store_true")
    args = ap.parse_args(argv)
    register(args.requests, args.concurrency, args.input_len, args.output_len, args.vocab, args.seed)
    from perf.engine import offline_benchmark

    workloads = MEASURED if args.no_warmup else f"{WARMUP},{MEASURED}"
    return offline_benchmark.main(["--workloads", workloads, "--baselines", "", *rest])


if __name__ == "__main__":
    sys.exit(main())
