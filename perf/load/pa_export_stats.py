#!/usr/bin/env python3
"""TTFT / inter-token latency / end-to-end percentiles from perf_analyzer profile exports.

    python perf/load/pa_export_stats.py runs/pa/c1.json runs/pa/c8.json [--csv out.csv] [--json]

perf_analyzer's ``--profile-export-file`` records, per request, the send ``timestamp`` and the
``response_timestamps`` (ns) of every streamed response with its ``response_outputs``. From them:
  TTFT = first response with content - send time
  ITL  = gap between consecutive content responses / tokens in the later one (one sample per gap)
  TPOT = per request (last - first content response) / (output tokens - 1)
  E2E  = last response - send time
Tokens per response: num_output_tokens when the request asked for it (return_num_output_tokens),
else the length of output_ids, else 1 per non-empty text delta. Empty responses are skipped.

perf_analyzer 2.51 exports every output of the model config for every response, and fills the ones
a response lacks with stale or uninitialised memory (seen: num_output_tokens 1575638417 on responses
that had none, num_input_tokens 365879811 on the flag-only final one). So counts are read only when
requested, and the last response counts as empty when its text (or id list) is empty.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class RequestTiming:
    ttft_ns: int
    e2e_ns: int
    token_gaps_ns: tuple[float, ...]  # per content-response gap, divided by its token count
    output_tokens: int
    start_ns: int
    end_ns: int
    last_content_ns: int

    @property
    def tpot_ns(self) -> Optional[float]:
        # (last content - first content) / (tokens - 1), as genai-perf defines it.
        if self.output_tokens < 2 or self.last_content_ns == self.ttft_ns + self.start_ns:
            return None
        return (self.last_content_ns - self.start_ns - self.ttft_ns) / (self.output_tokens - 1)


@dataclass(frozen=True)
class ExperimentStats:
    mode: str
    value: Any
    requests: int
    output_tokens: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms: dict[int, float]
    itl_ms: dict[int, float]
    tpot_ms: dict[int, float]
    e2e_ms: dict[int, float]


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


MAX_TOKENS_PER_RESPONSE = 65536  # above this a count is perf_analyzer's garbage, not a count


def _looks_empty(output: dict[str, Any]) -> bool:
    text = output.get("text_output")
    if isinstance(text, str):
        return text == ""
    ids = output.get("output_ids")
    return isinstance(ids, list) and not ids


def response_tokens(output: Any, *, is_last: bool = False, counts_requested: bool = False) -> int:
    """Tokens carried by one exported response (0 for an empty one).

    num_output_tokens is only read when the request asked for it (return_num_output_tokens):
    otherwise the server leaves it out and perf_analyzer exports whatever its buffer held.
    """
    if not output or (is_last and _looks_empty(output)):
        return 0
    n = output.get("num_output_tokens")
    if isinstance(n, list):
        n = n[0] if n else None
    if counts_requested and isinstance(n, int) and 0 <= n <= MAX_TOKENS_PER_RESPONSE:
        return n
    ids = output.get("output_ids")
    if ids is not None:
        return len(ids) if isinstance(ids, list) else 1
    text = output.get("text_output")
    if text is not None:
        return 1 if (text if isinstance(text, str) else any(text)) else 0
    return 1


def request_timing(req: dict[str, Any]) -> Optional[RequestTiming]:
    """Timing of one exported request; None when it got no content (failed or empty)."""
    times = req.get("response_timestamps") or []
    outputs = req.get("response_outputs")
    if outputs is None or len(outputs) != len(times):
        outputs = [{"_": 1}] * len(times)  # no outputs recorded: count every response as one token
    last = len(times) - 1
    asked = bool((req.get("request_inputs") or {}).get("return_num_output_tokens"))
    content = [
        (int(t), response_tokens(o, is_last=i == last, counts_requested=asked))
        for i, (t, o) in enumerate(zip(times, outputs))
    ]
    content = [(t, n) for t, n in content if n > 0]
    if not content:
        return None
    start = int(req["timestamp"])
    gaps: list[float] = []
    for (t0, _), (t1, n1) in zip(content, content[1:]):
        gaps.append((t1 - t0) / n1)
    tokens = sum(n for _, n in content)
    end = max(int(t) for t in times)
    return RequestTiming(content[0][0] - start, end - start, tuple(gaps), tokens, start, end, content[-1][0])


def _pcts(values: Sequence[float], scale: float) -> dict[int, float]:
    return {p: percentile(values, p) * scale for p in PERCENTILES}


def experiment_stats(exp: dict[str, Any], *, in_windows: bool = False) -> ExperimentStats:
    reqs = exp.get("requests", [])
    bounds = exp.get("window_boundaries") or []
    if in_windows and len(bounds) >= 2:
        lo, hi = int(bounds[0]), int(bounds[-1])
        reqs = [r for r in reqs if lo <= int(r["timestamp"]) <= hi]
    timings = [t for t in (request_timing(r) for r in reqs) if t is not None]
    tokens = sum(t.output_tokens for t in timings)
    duration = (max(t.end_ns for t in timings) - min(t.start_ns for t in timings)) / 1e9 if timings else 0.0
    ms = 1e-6
    info = exp.get("experiment", {})
    return ExperimentStats(
        mode=str(info.get("mode", "")),
        value=info.get("value"),
        requests=len(timings),
        output_tokens=tokens,
        duration_s=duration,
        requests_per_s=len(timings) / duration if duration > 0 else 0.0,
        output_tokens_per_s=tokens / duration if duration > 0 else 0.0,
        ttft_ms=_pcts([t.ttft_ns for t in timings], ms),
        itl_ms=_pcts([g for t in timings for g in t.token_gaps_ns], ms),
        tpot_ms=_pcts([t.tpot_ns for t in timings if t.tpot_ns is not None], ms),
        e2e_ms=_pcts([t.e2e_ns for t in timings], ms),
    )


def export_stats(export: dict[str, Any], *, in_windows: bool = False) -> list[ExperimentStats]:
    return [experiment_stats(e, in_windows=in_windows) for e in export.get("experiments", [])]


def flat_row(source: str, s: ExperimentStats) -> dict[str, Any]:
    row: dict[str, Any] = {
        "source": source,
        "mode": s.mode,
        "value": s.value,
        "requests": s.requests,
        "output_tokens": s.output_tokens,
        "duration_s": round(s.duration_s, 3),
        "requests_per_s": round(s.requests_per_s, 3),
        "output_tokens_per_s": round(s.output_tokens_per_s, 2),
    }
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        for p, v in getattr(s, name).items():
            row[f"{name[:-3]}_p{p}_ms"] = round(v, 3)
    return row


def format_table(rows: Iterable[dict[str, Any]]) -> str:
    cols = (
        "value",
        "requests",
        "output_tokens_per_s",
        "ttft_p50_ms",
        "ttft_p95_ms",
        "itl_p50_ms",
        "itl_p95_ms",
        "e2e_p95_ms",
    )
    head = ("conc", "reqs", "out tok/s", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95", "E2E p95")
    lines = ["  ".join(f"{h:>10}" for h in head)]
    for r in rows:
        lines.append("  ".join(f"{r[c]:>10.2f}" if isinstance(r[c], float) else f"{str(r[c]):>10}" for c in cols))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("exports", nargs="+", help="perf_analyzer --profile-export-file JSON files")
    ap.add_argument("--csv", help="write one row per experiment to this CSV file")
    ap.add_argument("--json", action="store_true", help="print rows as JSON instead of a table")
    ap.add_argument("--in-windows", action="store_true", help="only requests sent inside the measurement windows")
    args = ap.parse_args(argv)
    rows = []
    for path in args.exports:
        with open(path, encoding="utf-8") as f:
            export = json.load(f)
        rows += [flat_row(path, s) for s in export_stats(export, in_windows=args.in_windows)]
    if args.csv and rows:
        with open(args.csv, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0 if rows and all(r["requests"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
