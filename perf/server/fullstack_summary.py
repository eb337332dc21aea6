#!/usr/bin/env python3
"""The full-stack run's final table: offline engine vs the same engine behind Triton (gRPC streaming).

    python perf/server/fullstack_summary.py --work WORK_DIR --out OUT_DIR [--goal 0.85] [--info key=value ...]

Reads WORK_DIR/offline.json (perf/engine/offline_benchmark.py rows; the `fullstack` row is the reference),
WORK_DIR/pa/pa_result.json (perf/server/fullstack_pa.py) and WORK_DIR/client*.json
(perf/server/fullstack_client_load.py); writes OUT_DIR/summary.json and OUT_DIR/summary.md and prints
the Markdown table. Server tok/s = the engine's own token counter (Prometheus, :8002) over the
client's measured window (first request sent -> last response); client tok/s = tokens the client
received over the same window; ratio = server tok/s / offline tok/s (goal: >= --goal).
Missing inputs become '-' rows: a failed stage still leaves a table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

OFFLINE_ROW = "fullstack"


def _load(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def offline_row(rows: Optional[list[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    for r in rows or []:
        if r.get("workload") == OFFLINE_ROW and r.get("system") == "kvshare":
            return r
    return None


def _pct(d: Optional[dict[str, Any]], p: str) -> Optional[float]:
    if not d:
        return None
    v = d.get(p)
    return None if v is None or v != v else float(v)   # NaN -> None


def build(offline: Optional[list[dict[str, Any]]], server_runs: list[dict[str, Any]], *, goal: float,
          info: dict[str, str]) -> dict[str, Any]:
    off = offline_row(offline)
    off_tps = off.get("tok_per_s") if off else None
    rows: list[dict[str, Any]] = [{
        "path": "offline engine (perf/engine/offline_benchmark.py)",
        "requests": off.get("requests") if off else None,
        "tokens": off.get("output_tokens") if off else None,
        "window_s": off.get("seconds") if off else None,
        "server_tok_per_s": off_tps,
        "client_tok_per_s": None,
        "ttft_p50_ms": off.get("ttft_p50_ms") if off else None,
        "ttft_p95_ms": off.get("ttft_p95_ms") if off else None,
        "itl_p50_ms": None, "itl_p95_ms": None,
        "ratio": 1.0 if off_tps else None,
        "errors": None if off else "no offline result",
    }]
    for run in server_runs:
        tps = run.get("server_tok_per_s")
        rows.append({
            "path": f"Triton gRPC streaming, {run.get('tool', '?')}, c={run.get('concurrency', '?')}",
            "requests": run.get("requests_done"),
            "tokens": run.get("server_tokens"),
            "window_s": run.get("window_s"),
            "server_tok_per_s": tps,
            "client_tok_per_s": run.get("client_tok_per_s"),
            "ttft_p50_ms": _pct(run.get("ttft_ms"), "50"), "ttft_p95_ms": _pct(run.get("ttft_ms"), "95"),
            "itl_p50_ms": _pct(run.get("itl_ms"), "50"), "itl_p95_ms": _pct(run.get("itl_ms"), "95"),
            "ratio": tps / off_tps if tps and off_tps else None,
            "errors": run.get("error") or (run.get("errors") or None),
        })
    ratios = [r["ratio"] for r in rows[1:] if r["ratio"] is not None]
    pa = next((r for r, run in zip(rows[1:], server_runs) if run.get("tool") == "perf_analyzer"), None)
    verdict = None
    if pa is not None and pa["ratio"] is not None:
        verdict = "PASS" if pa["ratio"] >= goal else "FAIL"
    return {"rows": rows, "goal": goal, "perf_analyzer_ratio": pa["ratio"] if pa else None,
            "best_ratio": max(ratios) if ratios else None, "verdict": verdict, "info": info,
            "server_runs": server_runs, "offline_rows": offline}


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(s: dict[str, Any]) -> str:
    head = ("| path | requests | tokens | window s | server tok/s | client tok/s | TTFT p50 / p95 ms "
            "| ITL p50 / p95 ms | server / offline |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in s["rows"]:
        lines.append(f"| {r['path']} | {_f(r['requests'], 'd')} | {_f(r['tokens'], '.0f')} | "
                     f"{_f(r['window_s'], '.2f')} | {_f(r['server_tok_per_s'], ',.0f')} | "
                     f"{_f(r['client_tok_per_s'], ',.0f')} | {_f(r['ttft_p50_ms'], '.0f')} / "
                     f"{_f(r['ttft_p95_ms'], '.0f')} | {_f(r['itl_p50_ms'], '.2f')} / {_f(r['itl_p95_ms'], '.2f')} | "
                     f"{_f(r['ratio'], '.3f')} |")
    goal = s["goal"]
    pa = s["perf_analyzer_ratio"]
    lines.append("")
    lines.append(f"Goal (issue #4): server-side tok/s through gRPC streaming at the same concurrency >= {goal:.0%} "
                 f"of the offline engine. perf_analyzer: {_f(pa, '.3f')} -> {s['verdict'] or 'no result'}.")
    lines.append("server tok/s = delta of kvshare_generation_tokens_total (the engine's counter on the metrics "
                 "port) over the client's window (first request sent -> last response); client tok/s = tokens "
                 "the client received over that window; offline: perf/engine/offline_benchmark.py's own wall time. "
                 "TTFT/ITL measured by each client (offline: TTFT from add_request).")
    for k, v in s["info"].items():
        lines.append(f"- {k}: {v}")
    for run in s["server_runs"]:
        d = run.get("counter_deltas") or {}
        lines.append(f"- {run.get('tool', '?')}: {_f(run.get('requests_done'), 'd')}/"
                     f"{_f(run.get('requests_sent'), 'd')} requests, client got {_f(run.get('client_tokens'), 'd')} of "
                     f"{_f(run.get('expected_tokens'), 'd')} tokens, {_f(run.get('tokens_per_response'), '.2f')} "
                     f"tokens/response, client CPU per wall second {_cpu(run.get('client_cpu_per_s'))}; "
                     "server: prefix-hit tokens "
                     f"{_f(d.get('prefix_hit_tokens'), '.0f')}, evictions {_f(d.get('evictions'), '.0f')}, preemptions "
                     f"{_f(d.get('preemptions'), '.0f')}; peak running {_f(run.get('peak_running'), '.0f')}, sampled "
                     f"{_f(run.get('sampled_tok_per_s'), ',.0f')} tok/s")
    for r in s["rows"]:
        if r["errors"]:
            lines.append(f"- problem in '{r['path']}': {r['errors']}")
    return "\n".join(lines)


def _cpu(per_process: Optional[Sequence[float]]) -> str:
    """Each client process's CPU per wall second (perf_analyzer's run has none)."""
    return ", ".join(f"{x:.2f}" for x in per_process) if per_process else "-"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--goal", type=float, default=0.85)
    ap.add_argument("--info", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    offline = _load(args.work / "offline.json")
    runs = []
    pa = _load(args.work / "pa" / "pa_result.json")
    if pa is not None:
        runs.append(pa)
    for p in sorted(args.work.glob("client_p*.json")):
        r = _load(p)
        if r is not None:
            runs.append(r)
    info = dict(kv.split("=", 1) for kv in args.info if "=" in kv)
    s = build(offline, runs, goal=args.goal, info=info)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(s, indent=1, default=str), encoding="utf-8")
    md = markdown(s)
    (args.out / "summary.md").write_text("# Full stack on the GPU: Triton 2.51 + kvshare vs the offline engine\n\n"
                                         + md + "\n", encoding="utf-8")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
