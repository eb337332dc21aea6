#!/usr/bin/env python3
"""perf_analyzer over gRPC streaming on `llm_engine`, with the server's own token counter around it.

    python perf/server/fullstack_pa.py --pa perf/load/perf_analyzer.sh --url 127.0.0.1:8001 \
        --metrics-url http://127.0.0.1:8002/metrics --requests 256 --concurrency 64 \
        --input-len 128 --output-len 128 --vocab 32000 --out-dir runs/fullstack/pa

Writes the fullstack workload (perf/server/fullstack_common.py) as perf_analyzer --input-data (one
distinct entry per request; perf_analyzer adds the batch dimension), runs
`perf_analyzer --streaming --concurrency-range C:C --request-count N` (a fixed request count instead
of the stability loop, as perf/load/pa_sweep.sh does), and reads the profile export with
perf/load/pa_export_stats.py. The measured window is perf_analyzer's own: first request sent ->
last response received. Server-side tokens = the delta of kvshare_generation_tokens_total between
idle snapshots before and after; a 0.25 s metrics sampler records what the engine was running.
Result: OUT/pa_result.json (+ pa_inputs.json, pa_export.json, pa.csv, pa.log, pa_metrics.csv).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.server import fullstack_common as fc  # noqa: E402

from perf.load import make_pa_inputs as mpi  # noqa: E402
from perf.load import pa_export_stats as pes  # noqa: E402
from perf.report.metrics_sampler import MetricsSampler  # noqa: E402


def pa_requests(args: argparse.Namespace) -> list[Any]:
    from kvshare_client import GenerationRequest

    return [GenerationRequest(**fc.request_fields(p, args.output_len, args.cache_salt))
            for p in fc.prompts(args.requests, args.input_len, args.vocab, args.seed)]


def sampled_window(rows: list[dict[str, Any]]) -> dict[str, Optional[float]]:
    """From the sampler's rows: peak running/waiting and the rate between the first and the last
    sample at which the generated-token counter moved (a coarse, engine-side cross-check)."""
    pts = [(r["time_s"], r["generation_tokens_total"]) for r in rows if r.get("generation_tokens_total") is not None]
    running = [r["requests_running"] for r in rows if r.get("requests_running") is not None]
    waiting = [r["requests_waiting"] for r in rows if r.get("requests_waiting") is not None]
    moved = [i for i in range(1, len(pts)) if pts[i][1] > pts[i - 1][1]]
    out: dict[str, Optional[float]] = {"peak_running": max(running) if running else None,
                                       "peak_waiting": max(waiting) if waiting else None,
                                       "sampled_tok_per_s": None}
    if moved:
        a, b = pts[moved[0] - 1], pts[moved[-1]]
        out["sampled_tok_per_s"] = fc.rate(b[1] - a[1], b[0] - a[0])
    return out


def export_tokens(export: dict[str, Any]) -> int:
    """Generated tokens in a profile export, counted from output_ids (llm_engine sends them in every
    response; perf_analyzer writes a one-id list as a bare number).

    pa_export_stats counts a last response with empty text as empty, which drops one token per
    request for models without a tokenizer (dummy weights: text is always ''). A flag-only final
    response (stale outputs) is recognised here by its empty finish_reason instead."""
    return _export_counts(export)[0]


def _export_counts(export: dict[str, Any]) -> tuple[int, int]:
    """(tokens, responses that carried tokens)."""
    total = responses = 0
    for exp in export.get("experiments", []):
        for req in exp.get("requests", []):
            outs = req.get("response_outputs") or []
            for i, out in enumerate(outs):
                if not out or (i == len(outs) - 1 and not out.get("finish_reason")):
                    continue
                ids = out.get("output_ids")
                n = len(ids) if isinstance(ids, list) else (0 if ids is None else 1)
                total += n
                responses += n > 0
    return total, responses


def summarize(export: dict[str, Any], before: dict, after: dict, *, requests: int, concurrency: int,
              output_len: int) -> dict[str, Any]:
    stats = pes.export_stats(export)
    if not stats:
        raise SystemExit("perf_analyzer's export holds no experiment")
    s = stats[0]
    deltas = fc.counter_deltas(before, after)
    server_tokens = deltas["generation_tokens"]
    tokens, responses = _export_counts(export)
    return {
        "tool": "perf_analyzer",
        "requests_sent": requests,
        "requests_done": s.requests,
        "concurrency": concurrency,
        "expected_tokens": requests * output_len,
        "client_tokens": tokens,
        "pa_export_stats_tokens": s.output_tokens,
        "server_tokens": server_tokens,
        "window_s": s.duration_s,
        "client_tok_per_s": fc.rate(tokens, s.duration_s),
        "server_tok_per_s": fc.rate(server_tokens, s.duration_s),
        "requests_per_s": s.requests_per_s,
        "tokens_per_response": tokens / responses if responses else None,
        "ttft_ms": {str(k): v for k, v in s.ttft_ms.items()},
        "itl_ms": {str(k): v for k, v in s.itl_ms.items()},
        "tpot_ms": {str(k): v for k, v in s.tpot_ms.items()},
        "e2e_ms": {str(k): v for k, v in s.e2e_ms.items()},
        "counter_deltas": deltas,
        "metrics_not_quiet": bool(after.get("not_quiet")),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pa", required=True, help="perf_analyzer binary (or perf/load/perf_analyzer.sh)")
    ap.add_argument("--pa-ld-path", default="", help="prepended to LD_LIBRARY_PATH for perf_analyzer only")
    ap.add_argument("--url", required=True, help="gRPC host:port")
    ap.add_argument("--metrics-url", required=True)
    ap.add_argument("--model", default="llm_engine")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-salt", default="pa", help="'' for none")
    ap.add_argument("--timeout", type=float, default=300.0, help="perf_analyzer's own limit, s")
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    inputs = out / "pa_inputs.json"
    inputs.write_text(json.dumps(mpi.pa_document(pa_requests(args))), encoding="utf-8")

    cmd = [args.pa, "-m", args.model, "-u", args.url, "-i", "grpc", "--streaming",
           "--concurrency-range", f"{args.concurrency}:{args.concurrency}", "--input-data", str(inputs),
           "--request-count", str(args.requests), "--profile-export-file", str(out / "pa_export.json"),
           "-f", str(out / "pa.csv")]
    env = dict(os.environ)
    if args.pa_ld_path:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (args.pa_ld_path, env.get("LD_LIBRARY_PATH", "")) if p)
    for stale in ("pa_export.json", "pa.csv"):   # perf_analyzer refuses an existing export file
        (out / stale).unlink(missing_ok=True)
    before = fc.quiet_snapshot(args.metrics_url)
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with MetricsSampler(args.metrics_url, out / "pa_metrics.csv", interval_s=0.25) as sampler, \
            open(out / "pa.log", "wb") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        rows = list(sampler.rows)
    wall = time.perf_counter() - t0
    after = fc.quiet_snapshot(args.metrics_url)
    tail = (out / "pa.log").read_text(errors="replace")[-3000:]
    print(tail, flush=True)
    if rc != 0 or not (out / "pa_export.json").exists():
        print(f"perf_analyzer failed (rc={rc}); log: {out / 'pa.log'}", file=sys.stderr)
        fc.write_json(out / "pa_result.json", {"tool": "perf_analyzer", "error": f"rc={rc}", "log_tail": tail[-800:]})
        return 1
    export = json.loads((out / "pa_export.json").read_text(encoding="utf-8"))
    result = summarize(export, before, after, requests=args.requests, concurrency=args.concurrency,
                       output_len=args.output_len)
    result.update(sampled_window(rows), wall_s=wall, command=" ".join(cmd))
    fc.write_json(out / "pa_result.json", result)
    print(f"perf_analyzer: {result['requests_done']}/{args.requests} requests, window {result['window_s']:.2f} s, "
          f"client {result['client_tokens']} tokens = {result['client_tok_per_s']:.1f} tok/s, server "
          f"{result['server_tokens']} tokens = {result['server_tok_per_s'] or 0:.1f} tok/s, TTFT p50 "
          f"{result['ttft_ms']['50']:.1f} ms, ITL p50 {result['itl_ms']['50']:.2f} ms, peak running "
          f"{result['peak_running']}", flush=True)
    ok = result["requests_done"] == args.requests and result["client_tokens"] == result["expected_tokens"]
    if not ok:
        print("WARNING: perf_analyzer did not get every request/token back", file=sys.stderr)
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
