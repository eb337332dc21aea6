#!/usr/bin/env python3
"""Poll kvshare's Prometheus metrics (Triton's metrics port) and write a CSV time series.

    python -m perf.report.metrics_sampler --url http://127.0.0.1:8002/metrics -o run/metrics.csv \
        [--interval 0.5] [--duration 120]            # until Ctrl-C / SIGTERM without --duration

In code (the server benchmark does this):

    with MetricsSampler("http://127.0.0.1:8002/metrics", "run/metrics.csv", interval_s=0.5) as s:
        ...                                          # s.rows holds the samples so far
Columns: time_s (unix), elapsed_s, then the kvshare gauges (KV pages active/cached/free/total,
requests running/waiting) and counters (prefix-cache query/hit tokens, generated tokens,
evictions, preemptions), each summed over label sets; empty when the server does not export it.
A failed scrape is skipped (counted in `errors`), not fatal: the server may be starting or gone.
"""
from __future__ import annotations

import argparse
import csv
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from kvshare_client.metrics import fetch_metrics, metric_total, parse_samples

COLUMNS = {
    "kv_pages_active": "kvshare_kv_pages_active",
    "kv_pages_cached": "kvshare_kv_pages_cached",
    "kv_pages_free": "kvshare_kv_pages_free",
    "kv_pages_total": "kvshare_kv_pages_total",
    "requests_running": "kvshare_requests_running",
    "requests_waiting": "kvshare_requests_waiting",
    "prefix_query_tokens_total": "kvshare_prefix_cache_queries_tokens_total",
    "prefix_hit_tokens_total": "kvshare_prefix_cache_hits_tokens_total",
    "generation_tokens_total": "kvshare_generation_tokens_total",
    "evictions_total": "kvshare_kv_evictions_total",
    "preemptions_total": "kvshare_preemptions_total",
}
FIELDS = ["time_s", "elapsed_s", *COLUMNS]


def parse_row(text: str) -> dict[str, Optional[float]]:
    """The sampled values of one metrics exposition (None where a metric is absent)."""
    samples = parse_samples(text)
    return {col: metric_total(samples, name) for col, name in COLUMNS.items()}


def read_csv(path: str | Path) -> list[dict[str, Optional[float]]]:
    """A sampler CSV back as rows of floats (None for empty cells)."""
    with open(path, newline="", encoding="utf-8") as f:
        return [{k: (float(v) if v not in ("", None) else None) for k, v in row.items()} for row in csv.DictReader(f)]


def is_metrics_csv(path: str | Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            head = f.readline()
    except (OSError, UnicodeDecodeError):
        return False
    return head.startswith("time_s,") and "kv_pages_active" in head


class MetricsSampler:
    """A daemon thread that scrapes `url` every `interval_s` and appends a CSV row per scrape."""

    def __init__(self, url: str, out: str | Path | None = None, interval_s: float = 0.5, timeout_s: float = 2.0):
        self.url, self.interval_s, self.timeout_s = url, interval_s, timeout_s
        self.out = Path(out) if out else None
        self.rows: list[dict[str, Any]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._file = None
        self._writer = None
        self._t0 = 0.0

    def sample_once(self) -> Optional[dict[str, Any]]:
        try:
            text = fetch_metrics(self.url, timeout=self.timeout_s)
        except Exception:
            self.errors += 1
            return None
        now = time.time()
        row = {"time_s": round(now, 3), "elapsed_s": round(now - self._t0, 3), **parse_row(text)}
        self.rows.append(row)
        if self._writer:
            self._writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
            self._file.flush()
        return row

    def _loop(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def start(self) -> "MetricsSampler":
        self._t0 = time.time()
        if self.out:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.out, "w", newline="", encoding="utf-8")
            self._writer = csv.DictWriter(self._file, fieldnames=FIELDS)
            self._writer.writeheader()
        self._thread = threading.Thread(target=self._loop, name="metrics-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=self.interval_s + self.timeout_s + 1)
        if self._file:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsSampler":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8002/metrics", help="metrics URL or host:port")
    ap.add_argument("-o", "--out", required=True, type=Path)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--duration", type=float, default=None, help="seconds; default: until interrupted")
    args = ap.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    sampler = MetricsSampler(args.url, args.out, args.interval).start()
    try:
        stop.wait(args.duration)
    except KeyboardInterrupt:
        pass
    finally:
        sampler.stop()
    print(f"{args.out}: {len(sampler.rows)} samples, {sampler.errors} failed scrapes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
