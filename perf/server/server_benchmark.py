#!/usr/bin/env python3
"""kvshare THROUGH THE REAL TRITON SERVER beside HF transformers on the same prompts (CPU by default).

    python perf/server/server_benchmark.py                      # seed-12x128 + seed-hot10, 24 req x 64 tokens, conc. 12
    python perf/server/server_benchmark.py --requests 96 --output-tokens 128 --workloads seed-12x128,seed-hot10,seed-long
    python perf/server/server_benchmark.py --ports 18200,18201,18202 --out docs/reports/example/server-bench

1. Starts the Triton Inference Server on model_repository/ (kvshare.launch; free ports unless
   --ports), samples its metrics port every 0.5 s (perf/report/metrics_sampler.py -> metrics.csv).
2. Per workload (perf/workloads: benchmarks.md's shapes as text + token ids made with the served
   model's tokenizer), sends the first --requests requests closed-loop with --concurrency in
   flight through kvshare_client's AsyncKvshareClient (llm_engine with token ids by default,
   --model-name ensemble for text), output length forced (max_tokens = min_tokens, ignore_eos).
   TTFT and inter-token latency are measured at the client; the prefix-cache hit rate is the
   delta of the server's prefix-cache counters over the workload; peak KV pages from the sampler.
3. Stops the server, then in this process runs HF transformers `generate` (static batches of
   --concurrency) and `generate_batch` (HF's continuous batching) on the same token ids with the
   same forced lengths (perf/engine/offline_benchmark.py's baselines, imported).
Prints a table (output tok/s, TTFT/ITL p50/p95, hit rate, ratios kvshare/HF) and writes
OUT/server_benchmark.json (+ metrics.csv, server.log). `python -m perf.report OUT` makes a report.
The server and the baselines run one after the other on the same cores, never together.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from perf.load.pa_export_stats import percentile  # noqa: E402
from perf.report.metrics_sampler import MetricsSampler  # noqa: E402
from perf.workloads import generate as wgen  # noqa: E402

SYSTEM_KVSHARE = "kvshare-server"
SYSTEM_HF_GENERATE = "hf-generate"
SYSTEM_HF_BATCH = "hf-generate_batch"


@dataclass
class Row:
    workload: str
    system: str
    requests: int
    concurrency: int
    output_tokens: int
    seconds: float
    tok_per_s: float
    req_per_s: float
    ttft_p50_ms: Optional[float] = None
    ttft_p95_ms: Optional[float] = None
    itl_p50_ms: Optional[float] = None
    itl_p95_ms: Optional[float] = None
    e2e_p50_ms: Optional[float] = None
    e2e_p95_ms: Optional[float] = None
    prefix_hit_rate: Optional[float] = None      # server counters: hit tokens / looked-up prompt tokens
    cached_prompt_share: Optional[float] = None  # client: sum(cached_tokens) / sum(prompt tokens)
    peak_kv_pages: Optional[int] = None
    failures: int = 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ms(values: Sequence[float], p: float) -> Optional[float]:
    return round(percentile(values, p) * 1e3, 2) if values else None


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[dict[str, Any]]   # what is sent: GenerationRequest fields (input_ids or prompt, forced lengths)
    ids: list[dict[str, Any]]        # the same requests as token ids (for the HF baselines)
    concurrency: int

    @property
    def prompt_tokens(self) -> list[int]:
        return [len(e["input_ids"]) for e in self.ids]


def load_workload(workload_dir: Path, name: str, *, requests: int, output_tokens: Optional[int], concurrency: int,
                  text: bool) -> Workload:
    """The first `requests` requests of a generated workload, output length forced to `output_tokens`."""
    def read(fname: str) -> list[dict[str, Any]]:
        entries = [dict(e) for e in wgen.load_requests(workload_dir / fname)[:requests]]
        for e in entries:
            if output_tokens:
                e.update(max_tokens=output_tokens, min_tokens=output_tokens, ignore_eos=True)
        return entries

    ids = read(f"{name}.ids.jsonl")
    return Workload(name, read(f"{name}.jsonl") if text else ids, ids, concurrency)


# ---------------------------------------------------------------- kvshare through the server

async def _drive(url: str, wl: Workload, model: Optional[str], progress: bool) -> tuple[list[Any], list[str], float]:
    from kvshare_client import AsyncKvshareClient, GenerationRequest

    try:
        from tqdm import tqdm
        bar = tqdm(total=len(wl.requests), desc=f"kvshare {wl.name}", unit="req", disable=not progress)
    except ImportError:
        bar = None
    completions: list[Any] = [None] * len(wl.requests)
    errors: list[str] = []
    next_i = 0
    async with AsyncKvshareClient(url, stream_timeout=600) as client:
        async def worker() -> None:
            nonlocal next_i
            while next_i < len(wl.requests):
                i = next_i
                next_i += 1
                req = GenerationRequest(stream=True, return_num_output_tokens=True,
                                        return_num_input_tokens=True, temperature=0.0, **wl.requests[i])
                try:
                    completions[i] = await client.generate(req, model=model)
                except Exception as exc:  # counted, reported; the run goes on
                    errors.append(f"request {i}: {type(exc).__name__}: {exc}")
                if bar:
                    bar.update(1)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(wl.concurrency)))
        secs = time.perf_counter() - t0
    if bar:
        bar.close()
    return completions, errors, secs


def run_kvshare(url: str, wl: Workload, sampler: MetricsSampler, model: Optional[str], progress: bool) -> Row:
    before = sampler.sample_once() or {}
    n_rows = len(sampler.rows)
    completions, errors, secs = asyncio.run(_drive(url, wl, model, progress))
    after = sampler.sample_once() or {}
    for e in errors[:5]:
        print(f"   {e}", file=sys.stderr)
    done = [c for c in completions if c is not None]
    ttft = [c.ttft_s for c in done if c.ttft_s is not None]
    itl = [(t1 - t0) / n for c in done
           for (t0, t1, n) in zip(c.content_times, c.content_times[1:], c.content_tokens[1:]) if n > 0]
    e2e = [c.e2e_s for c in done]
    tokens = sum(c.output_tokens or 0 for c in done)

    def delta(col: str) -> Optional[float]:
        a, b = before.get(col), after.get(col)
        return None if a is None or b is None else b - a

    q, h = delta("prefix_query_tokens_total"), delta("prefix_hit_tokens_total")
    window = [r.get("kv_pages_active") for r in sampler.rows[n_rows - 1:] if r.get("kv_pages_active") is not None]
    prompt = sum(p for p, c in zip(wl.prompt_tokens, completions) if c is not None)
    cached = sum(c.cached_tokens or 0 for c in done)
    return Row(wl.name, SYSTEM_KVSHARE, len(done), wl.concurrency, tokens, round(secs, 3), round(tokens / secs, 2),
               round(len(done) / secs, 3), _ms(ttft, 50), _ms(ttft, 95), _ms(itl, 50), _ms(itl, 95), _ms(e2e, 50),
               _ms(e2e, 95), round(h / q, 4) if q else None, round(cached / prompt, 4) if prompt else None,
               int(max(window)) if window else None, len(errors))


def warm_up(url: str, model: Optional[str], text: bool) -> None:
    """Two short requests outside the workloads (first-call costs: kernels, allocator, tokenizer)."""
    from kvshare_client import GenerationRequest, KvshareClient

    with KvshareClient(url) as client:
        for k in range(2):
            body = {"prompt": f"warm up {k}: the quick brown fox"} if text else {"input_ids": [900 + k] * 20}
            client.generate(GenerationRequest(max_tokens=4, min_tokens=4, ignore_eos=True, stream=True, **body),
                            model=model)


# ---------------------------------------------------------------- HF baselines (perf/engine/offline_benchmark.py)

def _trace(wl: Workload):
    from perf.core import workload_traces as wt

    reqs = tuple(wt.Request(i, tuple(e["input_ids"]), e["max_tokens"]) for i, e in enumerate(wl.ids))
    return wt.Trace(wl.name, reqs, wl.concurrency, "server benchmark prompts")


def run_hf(wls: list[Workload], baselines: list[str], model_source: str, max_step_tokens: int,
           progress: bool) -> list[Row]:
    import torch

    from perf.engine import offline_benchmark as ob

    args = SimpleNamespace(device="cpu", dtype="float32", max_step_tokens=max_step_tokens)
    torch.backends.mkldnn.enabled = True
    model = ob.hf_model(SimpleNamespace(source=model_source), args)
    # Untimed warm-up of each baseline (first-call costs), as the server got two warm-up requests.
    from perf.core import workload_traces as wt

    tiny = wt.Trace("warm-up", tuple(wt.Request(i, tuple(wls[0].ids[i % len(wls[0].ids)]["input_ids"][:32]), 4)
                                     for i in range(2)), 2, "")
    for base in baselines:
        try:
            (ob.run_hf_generate if base == "generate" else ob.run_hf_generate_batch)(model, tiny, args)
        except Exception:
            pass  # reported by the timed run below
    rows: list[Row] = []
    try:
        from tqdm import tqdm
        jobs = tqdm([(w, b) for w in wls for b in baselines], desc="HF baselines", disable=not progress)
    except ImportError:
        jobs = [(w, b) for w in wls for b in baselines]
    for wl, base in jobs:
        trace = _trace(wl)
        try:
            r = ob.run_hf_generate(model, trace, args) if base == "generate" else ob.run_hf_generate_batch(model, trace, args)
        except Exception as exc:  # generate_batch's API moves between releases: report it
            print(f"   HF {base} on {wl.name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        rows.append(Row(wl.name, r.system, r.requests, wl.concurrency, r.output_tokens, round(r.seconds, 3),
                        round(r.tok_per_s, 2), round(r.requests / r.seconds, 3),
                        None if r.ttft_p50_ms is None else round(r.ttft_p50_ms, 2),
                        None if r.ttft_p95_ms is None else round(r.ttft_p95_ms, 2)))
    return rows


# ---------------------------------------------------------------- output

def ratios(rows: list[Row]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    by = {(r.workload, r.system): r for r in rows}
    for (w, s), r in by.items():
        if s != SYSTEM_KVSHARE:
            continue
        for base in (SYSTEM_HF_GENERATE, SYSTEM_HF_BATCH):
            b = by.get((w, base))
            if b and b.tok_per_s:
                out.setdefault(w, {})[f"kvshare/{base}"] = round(r.tok_per_s / b.tok_per_s, 3)
    return out


def format_table(rows: list[Row]) -> str:
    rat = ratios(rows)

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    head = (f"{'workload':<14}{'system':<19}{'reqs':>5}{'conc':>5}{'out tok':>8}{'s':>7}{'tok/s':>8}"
            f"{'TTFT p50':>9}{'p95':>8}{'ITL p50':>8}{'p95':>7}{'hit':>6}{'pages':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.workload:<14}{r.system:<19}{r.requests:>5}{r.concurrency:>5}{r.output_tokens:>8}"
                     f"{r.seconds:>7.1f}{r.tok_per_s:>8.1f}{f(r.ttft_p50_ms, '.0f'):>9}{f(r.ttft_p95_ms, '.0f'):>8}"
                     f"{f(r.itl_p50_ms, '.1f'):>8}{f(r.itl_p95_ms, '.1f'):>7}{f(r.prefix_hit_rate, '.2f'):>6}"
                     f"{f(r.peak_kv_pages, 'd'):>6}")
    for w, d in rat.items():
        lines.append(f"{w}: " + ", ".join(f"{k} = {v:.2f}x" for k, v in d.items()))
    lines.append("TTFT/ITL in ms (client side); hf-generate's TTFT = its whole static batch (tokens come at the end);"
                 " hit = server prefix-cache hit rate over the workload; pages = peak KV pages in use")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="seed-12x128,seed-hot10")
    ap.add_argument("--requests", type=int, default=24, help="first N requests of each workload")
    ap.add_argument("--output-tokens", type=int, default=64, help="forced output length (0: the workload's)")
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--model-name", default="llm_engine", choices=["llm_engine", "ensemble"],
                    help="llm_engine: token ids; ensemble: the same prompts as text (tokenized by the server)")
    ap.add_argument("--baselines", default="generate,generate_batch", help="HF baselines; '' for none")
    ap.add_argument("--model", default=None, help="served model (.gguf / HF dir); sets KVSHARE_MODEL, the HF "
                                                   "baseline and the workload tokenizer. Default SmolLM2-135M")
    ap.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    ap.add_argument("--ports", default=None, help="HTTP,GRPC,METRICS (default: free ports)")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra server environment, e.g. KVSHARE_ENABLE_PREFIX_CACHING=false")
    ap.add_argument("--workload-dir", type=Path, default=wgen.DEFAULT_OUT, help="generated here when missing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-step-tokens", type=int, default=2048, help="generate_batch's max_batch_tokens")
    ap.add_argument("--interval", type=float, default=0.5, help="metrics sampling period, s")
    ap.add_argument("-o", "--out", type=Path, default=None, help="default runs/server-bench-<time>")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    progress = not args.no_progress
    out = args.out or ROOT / "runs" / f"server-bench-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.workloads.split(",") if n]
    baselines = [b for b in args.baselines.split(",") if b]

    from kvshare import launch
    from kvshare.runtime.tokenizer import default_model_source

    model_source = args.model or default_model_source()
    wgen.ensure(args.workload_dir, names, seed=args.seed, model=args.model)
    wls = [load_workload(args.workload_dir, n, requests=args.requests, output_tokens=args.output_tokens or None,
                         concurrency=args.concurrency, text=args.model_name == "ensemble") for n in names]

    ports = [int(p) for p in args.ports.split(",")] if args.ports else [_free_port() for _ in range(3)]
    addr = launch.ServerAddress("127.0.0.1", *ports)
    env = dict(kv.split("=", 1) for kv in args.server_env)
    if args.model:
        env["KVSHARE_MODEL"] = args.model
    log_path = out / "server.log"
    print(f"== starting Triton on {addr.grpc_url} (metrics {addr.metrics_url}); log {log_path}", flush=True)
    t_start = time.perf_counter()
    proc = launch.start(args.repository.resolve(), addr, log_path=log_path, extra_env=env)
    rows: list[Row] = []
    phases: list[dict[str, Any]] = []
    try:
        launch.wait_ready(proc, addr, timeout_s=600)
        print(f"   ready after {time.perf_counter() - t_start:.0f} s", flush=True)
        warm_up(addr.grpc_url, args.model_name, args.model_name == "ensemble")
        with MetricsSampler(addr.metrics_url, out / "metrics.csv", args.interval) as sampler:
            for wl in wls:
                print(f"== {wl.name}: {len(wl.requests)} requests x {wl.requests[0]['max_tokens']} tokens, "
                      f"concurrency {wl.concurrency}, model {args.model_name}", flush=True)
                t0 = time.time() - sampler._t0
                rows.append(run_kvshare(addr.grpc_url, wl, sampler, args.model_name, progress))
                phases.append({"workload": wl.name, "start_s": round(t0, 2), "end_s": round(time.time() - sampler._t0, 2)})
                print(format_table(rows), flush=True)
                time.sleep(2 * args.interval)
    finally:
        launch.stop(proc)
    if baselines:
        print(f"== server stopped; HF transformers baselines in-process: {', '.join(baselines)}", flush=True)
        rows += run_hf(wls, baselines, model_source, args.max_step_tokens, progress)
    order = {n: i for i, n in enumerate(names)}
    rows.sort(key=lambda r: (order[r.workload], [SYSTEM_KVSHARE, SYSTEM_HF_GENERATE, SYSTEM_HF_BATCH].index(r.system)
                             if r.system in (SYSTEM_KVSHARE, SYSTEM_HF_GENERATE, SYSTEM_HF_BATCH) else 9))
    table = format_table(rows)
    print("\n" + table)
    import torch
    import transformers

    result = {
        "kind": "kvshare-server-benchmark",
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": "python perf/server/server_benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__},
        "config": {"workloads": names, "requests": args.requests, "output_tokens": args.output_tokens,
                   "concurrency": args.concurrency, "model_name": args.model_name, "model": Path(model_source).name,
                   "server_env": env, "ports": ports, "seed": args.seed},
        "rows": [asdict(r) for r in rows],
        "ratios": ratios(rows),
        "phases": phases,
        "metrics_csv": "metrics.csv",
        "table": table,
    }
    text = json.dumps(result, indent=1) + "\n"
    (out / "server_benchmark.json").write_text(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(f"wrote {out / 'server_benchmark.json'}", file=sys.stderr)
    failed = sum(r.failures for r in rows)
    return 1 if failed or not any(r.system == SYSTEM_KVSHARE and r.requests for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
