#!/usr/bin/env python3
"""The project's own asyncio client (kvshare_client.AsyncKvshareClient) as a closed-loop load
generator on `llm_engine` over gRPC streaming, with the server's token counter around it.

    python perf/server/fullstack_client_load.py --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics \
        --requests 256 --concurrency 64 --input-len 128 --output-len 128 --vocab 32000 \
        [--processes 4] --out-json runs/fullstack/client.json

The requests are the fullstack workload (perf/server/fullstack_common.py: the offline benchmark's fixed
shape, greedy, exactly --output-len tokens). `--concurrency` streams are kept in flight; with
`--processes P` they are split over P processes (concurrency/P each, requests dealt round-robin),
which start together behind a barrier, so one Python process parsing every response is not what
limits the rate. Window = first request sent -> last final response (time.perf_counter, which is
CLOCK_MONOTONIC and comparable across processes). Server-side tokens = delta of
kvshare_generation_tokens_total between idle snapshots before and after.
`--warmup` sends the requests and prints one line (first-call costs: kernels, allocator, streams).
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.server import fullstack_common as fc  # noqa: E402

from perf.load.pa_export_stats import percentile  # noqa: E402


async def _drive(url: str, requests: list[dict[str, Any]], concurrency: int, model: str,
                 timeout_s: float) -> list[dict[str, Any]]:
    from kvshare_client import AsyncKvshareClient, GenerationRequest

    results: list[dict[str, Any]] = []
    queue = list(enumerate(requests))
    queue.reverse()
    async with AsyncKvshareClient(url, stream_timeout=timeout_s) as client:
        async def worker() -> None:
            while queue:
                i, fields = queue.pop()
                sent = time.perf_counter()
                try:
                    c = await client.generate(GenerationRequest(**fields), model=model)
                except Exception as exc:  # counted and reported; the run goes on
                    results.append({"index": i, "sent_at": sent, "finished_at": time.perf_counter(),
                                    "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                results.append({"index": i, "sent_at": c.sent_at, "finished_at": c.finished_at,
                                "tokens": c.output_tokens or 0, "finish_reason": c.finish_reason,
                                "cached_tokens": c.cached_tokens, "responses": c.num_responses,
                                "content_times": list(c.content_times), "content_tokens": list(c.content_tokens)})
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def _shard(args: tuple) -> tuple[list[dict[str, Any]], float]:
    """This process's results and its CPU seconds per second of wall time while it drove them (near 1:
    the client, one Python thread parsing every response, set its streams' pace, not the server)."""
    url, requests, concurrency, model, timeout_s, barrier = args
    import kvshare_client  # noqa: F401  (imports before the barrier: processes start sending together)
    import tritonclient.grpc.aio  # noqa: F401
    if barrier is not None:
        barrier.wait()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    results = asyncio.run(_drive(url, requests, concurrency, model, timeout_s))
    return results, (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)


def _worker_main(args: tuple, conn) -> None:
    try:
        conn.send(("ok", _shard(args)))
    except BaseException as exc:  # report it to the parent instead of dying silently
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_load(url: str, requests: list[dict[str, Any]], concurrency: int, processes: int, model: str,
             timeout_s: float) -> tuple[list[dict[str, Any]], list[float]]:
    """The results (index = the request's in `requests`) and each process's CPU per wall second."""
    if processes <= 1:
        results, busy = _shard((url, requests, concurrency, model, timeout_s, None))
        return results, [busy]
    if concurrency % processes:
        raise SystemExit("--concurrency must be a multiple of --processes")
    ctx = mp.get_context("spawn")   # no gRPC state crosses a fork
    barrier = ctx.Barrier(processes)
    pipes, procs = [], []
    for k in range(processes):
        index_map = list(range(k, len(requests), processes))
        parent, child = ctx.Pipe(duplex=False)
        shard_args = (url, [requests[i] for i in index_map], concurrency // processes, model, timeout_s, barrier)
        p = ctx.Process(target=_worker_main, args=(shard_args, child), daemon=True)
        p.start()
        child.close()
        pipes.append((parent, index_map))
        procs.append(p)
    results: list[dict[str, Any]] = []
    cpu_per_s: list[float] = []
    for (conn, index_map), p in zip(pipes, procs):
        try:
            status, payload = conn.recv()
        except EOFError:
            status, payload = "error", f"exit code {p.exitcode} before sending its results"
        p.join()
        if status != "ok":
            raise RuntimeError(f"client process failed: {payload}")
        shard, busy = payload
        for r in shard:
            r["index"] = index_map[r["index"]]
        results.extend(shard)
        cpu_per_s.append(busy)
    return results, cpu_per_s


def _ms(values: Sequence[float]) -> dict[str, Optional[float]]:
    return {str(p): (percentile(values, p) * 1e3 if values else None) for p in (50, 90, 95, 99)}


def summarize(results: list[dict[str, Any]], before: dict, after: dict, *, requests: int, concurrency: int,
              processes: int, output_len: int, client_cpu_per_s: Sequence[float] = ()) -> dict[str, Any]:
    done = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    start = min((r["sent_at"] for r in results), default=0.0)
    end = max((r["finished_at"] for r in results), default=0.0)
    window = end - start
    tokens = sum(r["tokens"] for r in done)
    ttft = [r["content_times"][0] - r["sent_at"] for r in done if r["content_times"]]
    itl = [(t1 - t0) / n for r in done
           for t0, t1, n in zip(r["content_times"], r["content_times"][1:], r["content_tokens"][1:]) if n > 0]
    e2e = [r["finished_at"] - r["sent_at"] for r in done]
    deltas = fc.counter_deltas(before, after)
    responses = sum(r["responses"] for r in done)
    return {
        "tool": f"kvshare_client ({processes} process{'es' if processes > 1 else ''})",
        "processes": processes,
        "requests_sent": requests,
        "requests_done": len(done),
        "errors": len(errors),
        "error_samples": errors[:5],
        "concurrency": concurrency,
        "expected_tokens": requests * output_len,
        "client_tokens": tokens,
        "server_tokens": deltas["generation_tokens"],
        "window_s": window,
        "client_tok_per_s": fc.rate(tokens, window),
        "server_tok_per_s": fc.rate(deltas["generation_tokens"], window),
        "requests_per_s": fc.rate(len(done), window),
        "tokens_per_response": tokens / responses if responses else None,
        "client_cpu_per_s": [round(b, 3) for b in client_cpu_per_s],
        "ttft_ms": _ms(ttft),
        "itl_ms": _ms(itl),
        "e2e_ms": _ms(e2e),
        "finish_reasons": sorted({str(r["finish_reason"]) for r in done}),
        "counter_deltas": deltas,
        "metrics_not_quiet": bool(after.get("not_quiet")),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="gRPC host:port")
    ap.add_argument("--metrics-url", required=True)
    ap.add_argument("--model", default="llm_engine")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-salt", default="client", help="'' for none")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-stream limit, s")
    ap.add_argument("--warmup", action="store_true")
    ap.add_argument("--out-json", type=Path, default=None)
    args = ap.parse_args(argv)
    reqs = [fc.request_fields(p, args.output_len, args.cache_salt)
            for p in fc.prompts(args.requests, args.input_len, args.vocab, args.seed)]
    before = fc.quiet_snapshot(args.metrics_url)
    t0 = time.perf_counter()
    results, busy = run_load(args.url, reqs, args.concurrency, args.processes, args.model, args.timeout)
    wall = time.perf_counter() - t0
    after = fc.quiet_snapshot(args.metrics_url)
    res = summarize(results, before, after, requests=args.requests, concurrency=args.concurrency,
                    processes=args.processes, output_len=args.output_len, client_cpu_per_s=busy)
    res["wall_s"] = wall
    if args.out_json:
        fc.write_json(args.out_json, res)
    label = "warm-up" if args.warmup else res["tool"]
    print(f"{label}: {res['requests_done']}/{args.requests} requests ({res['errors']} errors), window "
          f"{res['window_s']:.2f} s, client {res['client_tokens']} tokens = {res['client_tok_per_s'] or 0:.1f} tok/s, "
          f"server {res['server_tokens']} tokens = {res['server_tok_per_s'] or 0:.1f} tok/s, TTFT p50 "
          f"{res['ttft_ms']['50'] or 0:.1f} ms, ITL p50 {res['itl_ms']['50'] or 0:.2f} ms, "
          f"{res['tokens_per_response'] or 0:.2f} tokens/response, client CPU/s "
          f"{', '.join(f'{b:.2f}' for b in res['client_cpu_per_s'])}", flush=True)
    for e in res["error_samples"]:
        print(f"   {e}", file=sys.stderr)
    ok = res["errors"] == 0 and res["client_tokens"] == res["expected_tokens"]
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
