"""One load generator for two servers: Triton's gRPC streaming (kvshare) and an OpenAI streaming
HTTP endpoint (`vllm serve`), on the same workload file, closed or open loop.

    python -m perf.load.serving_load --target triton --url 127.0.0.1:8001 --model ensemble \
        --workload runs/workloads/seed-12x128.jsonl --concurrency 12 --json runs/load/kvshare.json
    python -m perf.load.serving_load --target openai --url http://127.0.0.1:8000 --model MODEL \
        --workload runs/workloads/seed-12x128.jsonl --rate 8 --seed 0 --json runs/load/vllm.json

The workload is perf/workloads/generate.py's (one tokenizer made the text prompts, NAME.jsonl; or
their token ids, NAME.ids.jsonl), so both servers get the same prompts and lengths; or --trace NAME,
a perf/core/workload_traces.py trace as token ids (servers with dummy weights: Triton's llm_engine,
`vllm serve --skip-tokenizer-init`, whose token ids come back through `return_token_ids`). Every request
is greedy with its output length forced (ignore_eos, min_tokens = max_tokens), streamed.
Closed loop (--concurrency C): C requests in flight, the next sent when one ends. Open loop
(--rate R): Poisson arrivals at R requests/s from --seed (inf: all at once), sent whatever is in
flight. Bounded: at most --requests requests, each within --timeout-s, the whole run within
--max-seconds. --processes P spreads the requests over P client processes (request i to process
i mod P; the closed loop's C split among them, the open loop's arrival times kept), so that one
Python event loop parsing every streamed token does not become the bottleneck at high rates; the
processes share one start time on the system's monotonic clock. --id-offset K shifts a trace's
token ids by K (mod the vocabulary): runs on one server then share no prefix with each other.

Reported: output tok/s over the window (first request sent -> last one done); sustained output
tok/s (the tokens that arrived while requests were still being sent, over that time: the closed
loop still has all its requests in flight, the open loop's arrivals still come; the drain after it,
paced by the longest requests' own decode, left out); requests/s, TTFT
(sent -> first content) p50/p99, ITL (gap between content messages / tokens in the later one)
p50/p99, end-to-end p50/p99, errors, and each client process's CPU seconds per wall second
(client_cpu_per_s: near 1 or above, that process, not the server, set its streams' pace).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional, Sequence

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it (time.perf_counter seconds)."""
    index: int
    sent_at: float
    finished_at: float
    output_tokens: int = 0
    content_times: tuple[float, ...] = field(default=())
    content_tokens: tuple[int, ...] = field(default=())
    error: Optional[str] = None


Send = Callable[[int, Any], Awaitable[Outcome]]


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def sustained(outcomes: Sequence[Outcome]) -> tuple[float, Optional[float]]:
    """(window, tok/s) from the first request sent to the last one sent, counting the tokens that
    arrived in it. The whole run's tok/s also holds the drain, where a few long outputs decode at a
    small batch: with lognormal lengths that tail is a single request's serial decode, the same for
    any server, and it pulls every server's ratio towards 1. None without such a window: also when no
    request finished inside it (all sent at once, as a closed loop as wide as its request count does),
    as the window then holds the ramp-up only and no steady state."""
    sends = [o.sent_at for o in outcomes]
    if len(sends) < 2 or max(sends) <= min(sends):
        return 0.0, None
    start, end = min(sends), max(sends)
    if not any(o.error is None and o.finished_at <= end for o in outcomes):
        return end - start, None
    tokens = sum(n for o in outcomes if o.error is None
                 for t, n in zip(o.content_times, o.content_tokens) if start <= t <= end)
    return end - start, tokens / (end - start)


def summarize(outcomes: Sequence[Outcome], expected_tokens: Optional[int] = None) -> dict[str, Any]:
    done = [o for o in outcomes if o.error is None]
    start = min((o.sent_at for o in outcomes), default=0.0)
    end = max((o.finished_at for o in outcomes), default=0.0)
    window = end - start
    tokens = sum(o.output_tokens for o in done)
    ttft = [o.content_times[0] - o.sent_at for o in done if o.content_times]
    itl = [(t1 - t0) / n for o in done
           for t0, t1, n in zip(o.content_times, o.content_times[1:], o.content_tokens[1:]) if n > 0]
    e2e = [o.finished_at - o.sent_at for o in done]
    sustained_s, sustained_tok_s = sustained(outcomes)

    def ms(values, q):
        p = percentile(values, q)
        return None if p is None else round(1e3 * p, 3)

    return dict(requests=len(outcomes), done=len(done), errors=len(outcomes) - len(done),
                error_samples=[o.error for o in outcomes if o.error][:5], window_s=round(window, 4),
                output_tokens=tokens, expected_tokens=expected_tokens,
                tok_per_s=tokens / window if window > 0 else None,
                req_per_s=len(done) / window if window > 0 else None,
                sustained_window_s=round(sustained_s, 4), sustained_tok_per_s=sustained_tok_s,
                ttft_p50_ms=ms(ttft, 50), ttft_p99_ms=ms(ttft, 99), itl_p50_ms=ms(itl, 50), itl_p99_ms=ms(itl, 99),
                e2e_p50_ms=ms(e2e, 50), e2e_p99_ms=ms(e2e, 99))


async def _guarded(send: Send, index: int, request: Any) -> Outcome:
    t0 = time.perf_counter()
    try:
        return await send(index, request)
    except Exception as exc:  # counted and reported; the run goes on
        return Outcome(index, t0, time.perf_counter(), error=f"{type(exc).__name__}: {exc}"[:300])


async def closed_loop(send: Send, requests: Sequence[Any], concurrency: int) -> list[Outcome]:
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    queue = list(enumerate(requests))[::-1]
    out: list[Outcome] = []

    async def worker() -> None:
        while queue:
            i, r = queue.pop()
            out.append(await _guarded(send, i, r))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return sorted(out, key=lambda o: o.index)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start of each of n arrivals at `rate` per second (inf: all at 0)."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def open_loop(send: Send, requests: Sequence[Any], arrivals: Sequence[float]) -> list[Outcome]:
    start = time.perf_counter()

    async def one(i: int, r: Any, at: float) -> Outcome:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return await _guarded(send, i, r)

    return list(await asyncio.gather(*(one(i, r, at) for i, (r, at) in enumerate(zip(requests, arrivals)))))


def openai_body(request, model: str) -> dict[str, Any]:
    """An OpenAI /v1/completions streaming body for a kvshare_client GenerationRequest."""
    prompt = request.prompt if request.prompt is not None else list(request.input_ids or ())
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": request.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "return_token_ids": True,
                            "temperature": 0.0 if request.temperature is None else request.temperature,
                            "ignore_eos": bool(request.ignore_eos)}
    if request.min_tokens is not None:
        body["min_tokens"] = request.min_tokens
    return body


def openai_sender(url: str, model: str, timeout_s: float) -> Send:
    from perf.load.openai_stream import stream_completion

    async def send(index: int, request: Any) -> Outcome:
        c = await stream_completion(url, openai_body(request, model), timeout_s=timeout_s)
        return Outcome(index, c.sent_at, c.finished_at, c.output_tokens, c.content_times, c.content_tokens)

    return send


def triton_sender(client, model: str) -> Send:
    async def send(index: int, request: Any) -> Outcome:
        c = await client.generate(request, model=model)
        return Outcome(index, c.sent_at, c.finished_at, c.output_tokens or 0, tuple(c.content_times),
                       tuple(c.content_tokens))

    return send


def trace_requests(name: str, id_offset: int = 0, vocab: Optional[int] = None) -> list:
    """A perf/core/workload_traces.py trace as token-id requests (ids < 32000: any model of that
    vocabulary or larger; the offline rows' prompts, for servers with dummy weights and no tokenizer),
    every id shifted by id_offset within that vocabulary (or folded into a smaller `vocab`)."""
    from kvshare_client import GenerationRequest

    from perf.core.workload_traces import VOCAB, make_trace

    v = min(vocab or VOCAB, VOCAB)
    return [GenerationRequest(input_ids=[(t + id_offset) % VOCAB % v for t in r.prompt_ids], max_tokens=r.max_new_tokens)
            for r in make_trace(name).requests]


def load_requests(path: Optional[Path], count: Optional[int], output_tokens: Optional[int],
                  trace: Optional[str] = None, id_offset: int = 0, vocab: Optional[int] = None) -> list:
    """The workload's (or trace's) requests, greedy and streamed, each forced to its output length."""
    from kvshare_client.workload import load_workload

    reqs = (trace_requests(trace, id_offset, vocab) if trace else list(load_workload(path)))[: count or None]
    out = []
    for r in reqs:
        n = output_tokens or r.max_tokens
        out.append(replace(r, max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, stream=True))
    return out


@dataclass(frozen=True)
class Share:
    """One client process's part of a run: global request indices, their requests, and for the
    open loop their arrival offsets from `start_at` (time.perf_counter, system-wide monotonic)."""
    indices: tuple[int, ...]
    requests: tuple[Any, ...]
    concurrency: Optional[int] = None
    arrivals: Optional[tuple[float, ...]] = None
    start_at: Optional[float] = None


def split(requests: Sequence[Any], processes: int, concurrency: Optional[int],
          arrivals: Optional[Sequence[float]], start_at: Optional[float] = None) -> list[Share]:
    """Request i to process i mod P; the closed loop's concurrency divided as evenly as it goes
    (every process at least 1); empty shares dropped."""
    if processes < 1:
        raise ValueError("processes must be >= 1")
    shares = []
    for p in range(processes):
        idx = tuple(range(p, len(requests), processes))
        if not idx:
            continue
        conc = None
        if concurrency is not None:
            conc = max(1, concurrency // processes + (1 if p < concurrency % processes else 0))
        shares.append(Share(idx, tuple(requests[i] for i in idx), conc,
                            None if arrivals is None else tuple(arrivals[i] for i in idx), start_at))
    return shares


def _reindex(outcomes: Sequence[Outcome], indices: Sequence[int]) -> list[Outcome]:
    return [replace(o, index=indices[o.index]) for o in outcomes]


async def run_share(args: argparse.Namespace, share: Share) -> list[Outcome]:
    async def drive(send: Send) -> list[Outcome]:
        if share.arrivals is not None:
            if share.start_at is not None:
                await asyncio.sleep(max(0.0, share.start_at - time.perf_counter()))
            return await open_loop(send, share.requests, share.arrivals)
        return await closed_loop(send, share.requests, share.concurrency)

    if args.target == "openai":
        out = await asyncio.wait_for(drive(openai_sender(args.url, args.model, args.timeout_s)), args.max_seconds)
        return _reindex(out, share.indices)
    from kvshare_client import AsyncKvshareClient

    async with AsyncKvshareClient(args.url, stream_timeout=args.timeout_s) as client:
        out = await asyncio.wait_for(drive(triton_sender(client, args.model)), args.max_seconds)
    return _reindex(out, share.indices)


def _run_share_in_process(args: argparse.Namespace, share: Share) -> tuple[list[Outcome], float]:
    """The share's outcomes and the CPU this client process spent per second of wall time while it
    ran them (gRPC's own threads included): near 1.0 or above, the client paced its share, not the
    server, and its ITL is the client's."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    outcomes = asyncio.run(run_share(args, share))
    return outcomes, (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)


def run(args: argparse.Namespace, requests: list) -> tuple[list[Outcome], list[float]]:
    """Every request's outcome, in order, and each client process's CPU per wall second."""
    arrivals = poisson_arrivals(len(requests), args.rate, args.seed) if args.rate is not None else None
    processes = max(1, min(getattr(args, "processes", 1) or 1, len(requests)))
    if processes == 1:
        out, busy = _run_share_in_process(args, Share(tuple(range(len(requests))), tuple(requests), args.concurrency,
                                                      None if arrivals is None else tuple(arrivals)))
        return out, [busy]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: gRPC's threads do not survive a fork. The shared start leaves the children time to import.
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        shares = split(requests, processes, args.concurrency, arrivals, time.perf_counter() + SPAWN_LEAD_S)
        results = list(pool.map(_run_share_in_process, [args] * len(shares), shares))
    outcomes = sorted((o for out, _ in results for o in out), key=lambda o: o.index)
    return outcomes, [busy for _, busy in results]


SPAWN_LEAD_S = 3.0   # seconds the open loop's children get to start before the first arrival


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.load.serving_load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["triton", "openai"], required=True,
                    help="triton: gRPC streaming (host:port); openai: /v1/completions streaming (http://host:port)")
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True, help="Triton model (ensemble: text, llm_engine: ids) or served name")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", type=Path, help="perf/workloads/generate.py's NAME.jsonl or .ids.jsonl")
    source.add_argument("--trace", help="a perf/core/workload_traces.py trace, as token ids (dummy weights)")
    ap.add_argument("--requests", type=int, default=None, help="the workload's first N requests")
    ap.add_argument("--output-tokens", type=int, default=None, help="override every request's output length")
    loop = ap.add_mutually_exclusive_group(required=True)
    loop.add_argument("--concurrency", type=int, help="closed loop: requests kept in flight")
    loop.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second (inf: all at once)")
    ap.add_argument("--seed", type=int, default=0, help="of the open loop's arrival times")
    ap.add_argument("--vocab", type=int, default=None, help="fold a trace's ids into a smaller vocabulary (tiny models)")
    ap.add_argument("--processes", type=int, default=1, help="client processes sharing the requests")
    ap.add_argument("--id-offset", type=int, default=0, help="shift a trace's token ids (no prefix shared "
                    "with another run's)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="the whole run")
    ap.add_argument("--json", type=Path, default=None, help="write the summary and every request's timings here")
    args = ap.parse_args(argv)
    if args.concurrency is not None and args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    if args.rate is not None and not args.rate > 0:
        ap.error("--rate must be > 0 (inf: all at once)")
    if args.processes < 1:
        ap.error("--processes must be >= 1")
    if args.id_offset and not args.trace:
        ap.error("--id-offset shifts a --trace's token ids")
    try:
        requests = load_requests(args.workload, args.requests, args.output_tokens, args.trace, args.id_offset, args.vocab)
    except ValueError as exc:
        ap.error(str(exc))
    outcomes, client_busy = run(args, requests)
    summary = summarize(outcomes, sum(r.max_tokens for r in requests))
    summary["client_cpu_per_s"] = [round(b, 3) for b in client_busy]
    summary.update(target=args.target, url=args.url, model=args.model, workload=args.trace or str(args.workload),
                   loop="open" if args.rate is not None else "closed", concurrency=args.concurrency, rate=args.rate,
                   seed=args.seed, processes=args.processes, id_offset=args.id_offset)
    print(json.dumps({k: v for k, v in summary.items() if k != "error_samples"}), flush=True)
    for e in summary["error_samples"]:
        print(f"   error: {e}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "requests": [asdict(o) for o in outcomes]}, indent=1) + "\n")
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
