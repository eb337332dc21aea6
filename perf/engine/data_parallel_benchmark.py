"""Data-parallel throughput: a trace through EngineGroup (one engine per device, each on its own
thread, the router in front), as llm_engine drives them, without the Triton server.

    python perf/engine/data_parallel_benchmark.py --model dummy:llama-2-7b --devices cuda:0,cuda:1 \
        --workloads fixed-256,shared-prefix --routing cache_aware,round_robin --json out.json
    python perf/engine/data_parallel_benchmark.py --model dummy:tiny-llama --devices cpu,cpu \
        --workloads seed-hot10:24 --kv-gb 0.01      # a CPU smoke run

Closed loop: the trace's concurrency in flight over all engines together (shared-prefix: every
request at once, --open-loop). Output tok/s over the whole run, each engine's share of requests and
prefix hits, the router's decisions. Engines on one device share the weights. One row per
(workload, device count, routing); --devices 'cuda:0' is the one-GPU baseline through the same code.
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvshare.core.router import RouterSettings
from kvshare.engine.data_parallel import EngineGroup
from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.engine.engine_loop import Submission
from kvshare.runtime.weights import load_model
from kvshare.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.core.workload_traces import make_trace  # noqa: E402


@dataclass(frozen=True)
class DataParallelRow:
    workload: str
    devices: str
    routing: str
    requests: int
    output_tokens: int
    seconds: float
    tok_s: float
    hit_rate: float                    # prompt tokens served from cached pages, all engines
    requests_per_engine: tuple[int, ...]
    decisions: dict[str, int]


def run(loaded_by_device: dict, devices: list[str], args, workload: str, routing: str) -> DataParallelRow:
    name, _, count = workload.partition(":")
    trace = make_trace(name)
    requests = list(trace.requests[: int(count)] if count else trace.requests)
    vocab = next(iter(loaded_by_device.values())).config.vocab_size
    concurrency = len(requests) if args.open_loop or trace.concurrency is None else trace.concurrency
    engines = [LLMEngine(EngineConfig(model=args.model, device=d, dtype=args.dtype, page_size=args.page_size,
                                      kv_cache_memory_gb=args.kv_gb, max_running=args.max_running or max(concurrency, 1),
                                      max_step_tokens=args.max_step_tokens, max_prefill_chunk=args.max_prefill_chunk),
                         loaded_by_device[d]) for d in devices]
    group = EngineGroup(engines, RouterSettings(policy=routing))
    done: queue.SimpleQueue = queue.SimpleQueue()
    try:
        _warm_up(group, vocab)
        before = [e.stats().pool for e in engines]
        decisions_before = dict(group.router.decisions)
        pending = list(reversed(requests))
        in_flight = out_tokens = 0
        per_engine = [0] * len(engines)
        start = time.perf_counter()
        while pending or in_flight:
            while pending and in_flight < concurrency:
                r = pending.pop()
                rid = f"r{r.request_id}"
                params = SamplingParams(max_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=True)
                sub = Submission(rid, [t % vocab for t in r.prompt_ids], params, "", False, None, None,
                                 batch_sink=done.put)
                decision = group.try_submit_all(rid, [sub])
                assert decision is not None, "every engine refused: raise max_queued_requests"
                per_engine[decision.engine] += 1
                in_flight += 1
            for out in done.get():
                out_tokens += len(out.token_ids)
                in_flight -= out.finished
        secs = time.perf_counter() - start
        after = [e.stats().pool for e in engines]
    finally:
        group.shutdown()
    queried = sum(a.prefix_queries_tokens_total - b.prefix_queries_tokens_total for a, b in zip(after, before))
    hits = sum(a.prefix_hits_tokens_total - b.prefix_hits_tokens_total for a, b in zip(after, before))
    decisions: dict[str, int] = {}
    for (engine, reason), n in group.router.decisions.items():
        n -= decisions_before.get((engine, reason), 0)
        if n:
            decisions[reason] = decisions.get(reason, 0) + n
    row = DataParallelRow(trace.name, ",".join(devices), routing, len(requests), out_tokens, round(secs, 3),
                          round(out_tokens / secs, 1), round(hits / queried, 4) if queried else 0.0,
                          tuple(per_engine), decisions)
    print(f"   {row.workload:<14} {len(devices)} engine(s) {routing:<12} {row.tok_s:>10,.1f} tok/s  hit rate "
          f"{row.hit_rate:.1%}  requests per engine {per_engine}  {decisions}", flush=True)
    return row


def _warm_up(group: EngineGroup, vocab: int) -> None:
    """Untimed: each engine compiles its kernel variants on a few requests of its own (salted apart)."""
    sink: queue.SimpleQueue = queue.SimpleQueue()
    left = 0
    for e in range(len(group.engines)):
        for i in range(4):
            prompt = [(7 * i + j) % vocab for j in range(64 + 16 * i)]
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            sub = Submission(f"warm-{e}-{i}", prompt, params, f"warm-{e}", False, None, None, batch_sink=sink.put)
            assert group.loops[e].try_submit_all([sub])
            left += 1
    while left:
        left -= sum(out.finished for out in sink.get())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-2-7b")
    ap.add_argument("--devices", default="cuda:0,cuda:1", help="the widest engine set; --counts picks prefixes")
    ap.add_argument("--counts", default=None, help="engine counts to run (default: 1 and all the devices)")
    ap.add_argument("--dtype", default=None, help="default float16 on CUDA, float32 on the CPU")
    ap.add_argument("--workloads", default="fixed-256,shared-prefix", help="trace[:requests],...")
    ap.add_argument("--routing", default="cache_aware,round_robin", help="policies for the multi-engine rows")
    ap.add_argument("--kv-gb", type=float, default=40.0, help="each engine's pool")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=None, help="per engine; default the trace's concurrency")
    ap.add_argument("--max-step-tokens", type=int, default=4096)
    ap.add_argument("--max-prefill-chunk", type=int, default=2048)
    ap.add_argument("--open-loop", action="store_true", help="every request at once")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    args.dtype = args.dtype or ("float16" if devices[0].startswith("cuda") else "float32")
    counts = [int(c) for c in args.counts.split(",")] if args.counts else sorted({1, len(devices)})
    loaded = {}
    for d in dict.fromkeys(devices):
        loaded[d] = load_model(args.model, dtype=getattr(torch, args.dtype), device=d)
    rows = []
    for workload in [w for w in args.workloads.split(",") if w]:
        print(f"== {workload}", flush=True)
        for n in counts:
            for routing in (["round_robin"] if n == 1 else [r for r in args.routing.split(",") if r]):
                rows.append(run(loaded, devices[:n], args, workload, routing))
                if args.json:
                    args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    base = {r.workload: r.tok_s for r in rows if len(r.devices.split(",")) == 1}
    print("\n| workload | engines | routing | tok/s | vs 1 engine | hit rate | requests per engine |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r.tok_s / base[r.workload]:.2f}x" if base.get(r.workload) else "-"
        print(f"| {r.workload} | {r.devices} | {r.routing} | {r.tok_s:,.1f} | {ratio} | {r.hit_rate:.1%} | "
              f"{' / '.join(map(str, r.requests_per_engine))} |")
    dev = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if devices[0].startswith("cuda") else "cpu"
    print(f"\nmachine: {dev}; torch {torch.__version__}; model {args.model} {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
