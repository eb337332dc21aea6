"""Samples the server through the run: the pool gauges and counters on the metrics port, the TTFT
histogram, the RSS of the server and of its Python-backend stubs, and the machine's load average.

    python -m perf.load.soak.probe --metrics-url URL [--pid PID] -o samples.csv [--interval 2]

The soak runs it as a process of its own (until SIGTERM): in the Locust process a sampling greenlet
went 30 s without a turn while the users were busy, and the RSS windows need regular samples.

The server's processes are found from its pid (own server) or from the process listening on the
gRPC port (a server given by URL); without them RSS is not measured and the summary says so.
"""
from __future__ import annotations

import argparse
import csv
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import psutil

from kvshare_client.metrics import fetch_metrics, parse_samples

from perf.report.metrics_sampler import parse_row

TTFT = "kvshare_time_to_first_token_seconds"
FIELDS = ["time_s", "elapsed_s", "kv_pages_total", "kv_pages_free", "kv_pages_active", "kv_pages_cached",
          "requests_running", "requests_waiting", "generation_tokens_total", "evictions_total", "preemptions_total",
          "rss_server_mb", "rss_stubs_mb", "rss_total_mb", "stubs", "load_1m", "scrape_ms"]


def histogram(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts {le: count} of a histogram, summed over label sets."""
    out: dict[float, float] = {}
    for s in parse_samples(text):
        if s.name == name + "_bucket":
            le = dict(s.labels).get("le", "+Inf")
            key = float("inf") if le == "+Inf" else float(le)
            out[key] = out.get(key, 0.0) + s.value
    return out


def pid_listening_on(port: int) -> Optional[int]:
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return conn.pid
    return None


def rss_mb(server_pid: int) -> tuple[float, float, int]:
    """(server RSS, sum of its children's RSS, number of children) in MiB."""
    proc = psutil.Process(server_pid)
    server = proc.memory_info().rss
    stubs = 0
    kids = proc.children(recursive=True)
    for kid in kids:
        try:
            stubs += kid.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return server / 2**20, stubs / 2**20, len(kids)


class ServerProbe:
    """One row per sample(): metrics, RSS of the server's process tree, load average."""

    def __init__(self, metrics_url: str, server_pid: Optional[int], t0: Optional[float] = None) -> None:
        self.metrics_url, self.server_pid = metrics_url, server_pid
        self._t0 = time.time() if t0 is None else t0

    def sample(self) -> Optional[dict[str, Any]]:
        """A row, or None when the metrics port did not answer."""
        now = time.time()
        row: dict[str, Any] = {"time_s": round(now, 2), "elapsed_s": round(now - self._t0, 2)}
        try:
            row.update(parse_row(fetch_metrics(self.metrics_url, timeout=5)))
        except Exception:
            return None
        row["scrape_ms"] = round((time.time() - now) * 1e3, 1)
        if self.server_pid:
            try:
                server, stubs, n = rss_mb(self.server_pid)
                row.update(rss_server_mb=round(server, 1), rss_stubs_mb=round(stubs, 1),
                           rss_total_mb=round(server + stubs, 1), stubs=n)
            except psutil.Error:
                pass
        row["load_1m"] = round(os.getloadavg()[0], 2)
        return {k: row.get(k) for k in FIELDS}


def ttft_histogram(metrics_url: str) -> dict[float, float]:
    return histogram(fetch_metrics(metrics_url, timeout=5), TTFT)


def read_rows(path: Path) -> list[dict[str, Optional[float]]]:
    """The probe's CSV back as floats (None for empty cells); [] before the first row."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return [{k: (float(v) if v not in ("", None) else None) for k, v in row.items()}
                    for row in csv.DictReader(f)]
    except FileNotFoundError:
        return []


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metrics-url", required=True)
    ap.add_argument("--pid", type=int, default=None, help="tritonserver's pid (RSS of it and its stubs)")
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--t0", type=float, default=None, help="unix time elapsed_s counts from (default: now)")
    args = ap.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    probe = ServerProbe(args.metrics_url, args.pid, args.t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    errors = 0
    with open(args.out, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        f.flush()
        next_t = time.monotonic()
        while not stop.is_set():
            row = probe.sample()
            if row is None:
                errors += 1
            else:
                writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
                f.flush()
            next_t += args.interval
            stop.wait(max(0.0, next_t - time.monotonic()))
    print(f"{args.out}: {errors} failed scrapes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
