"""Soak: Locust over gRPC streaming at saturation for a given time, with a mix of request kinds.

    python -m perf.load.soak --minutes 30 --out runs/soak            # starts its own server
    python -m perf.load.soak --minutes 5 --grpc-url 127.0.0.1:8001 --metrics-url 127.0.0.1:8002 --out DIR

The mix (perf/load/soak/users.py): streams, non-streamed requests, cancels mid-stream, channels
closed mid-stream, killed client processes, bad inputs, and bursts past max_queued_requests, over
ensemble, llm_bls, vllm_model and llm_engine. A progress line every --progress-every seconds. At the
end it stops the load, waits for the server to go idle and checks the criteria of criteria.py.
Writes DIR/summary.json, DIR/samples.csv (metrics + RSS + load average over time), DIR/soak.png;
exits 1 when a criterion fails, 2 when the run itself could not happen.
"""
from __future__ import annotations

# Locust first: it patches the standard library with gevent before grpc makes a channel.
from . import users  # isort: skip  # noqa: I001

import argparse
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any, Optional, Sequence

import gevent
from locust.env import Environment

from kvshare_client.raw_stream import RawStreamSession

from . import criteria, mix
from .outcomes import KINDS, OutcomeLog
from .plot import plot
from .probe import ServerProbe, pid_listening_on, read_rows, ttft_histogram

ROOT = Path(__file__).resolve().parents[3]
# Settings of the server the soak starts: a queue small enough for a burst to overflow, a pool small
# enough to be recycled many times (evictions), the pool's integrity checked after every step.
OWN_SERVER_ENV = {"KVSHARE_MAX_QUEUED_REQUESTS": "24", "KVSHARE_MAX_RUNNING": "8", "KVSHARE_NUM_PAGES": "192",
                  "KVSHARE_DEBUG_CHECKS": "true", "KVSHARE_LOG_LEVEL": "WARNING"}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    ap.add_argument("--out", type=Path, required=True, help="folder for summary.json, samples.csv, soak.png")
    ap.add_argument("--grpc-url", default=None, help="a running server (default: start one on free ports)")
    ap.add_argument("--metrics-url", default=None, help="its metrics port (with --grpc-url)")
    ap.add_argument("--server-pid", type=int, default=None,
                    help="its tritonserver pid for RSS (default: the process listening on the gRPC port)")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="more environment of the own server (e.g. KVSHARE_LOG_LEVEL=DEBUG); repeatable")
    ap.add_argument("--max-queued", type=int, default=int(OWN_SERVER_ENV["KVSHARE_MAX_QUEUED_REQUESTS"]),
                    help="the server's max_queued_requests (bursts send this + 4)")
    ap.add_argument("--users", type=int, default=10, help="closed-loop users of the mix, no think time")
    ap.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts")
    ap.add_argument("--kill-every", type=float, default=20.0, help="seconds between killed client processes")
    ap.add_argument("--warmup-fraction", type=float, default=0.25, help="RSS is compared from the end of warm-up")
    ap.add_argument("--rss-limit", type=float, default=0.05, help="largest RSS growth after warm-up")
    ap.add_argument("--ttft-p99-bound", type=float, default=120.0,
                    help="seconds; client-side TTFT of completed streams (see docs/develop/testing.md, Soak)")
    ap.add_argument("--idle-timeout", type=float, default=240.0, help="seconds to wait for idle at the end")
    ap.add_argument("--progress-every", type=float, default=30.0)
    ap.add_argument("--sample-every", type=float, default=2.0)
    return ap.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(out: Path, env: dict[str, str]) -> tuple[Any, Any]:
    from kvshare import launch

    addr = launch.ServerAddress("127.0.0.1", free_port(), free_port(), free_port())
    proc = launch.start(ROOT / "model_repository", addr, log_path=out / "tritonserver.log", extra_env=env,
                        extra_args=["--exit-timeout-secs=10"])
    try:
        launch.wait_ready(proc, addr, timeout_s=float(os.environ.get("KVSHARE_TEST_SERVER_TIMEOUT", "400")))
    except Exception:
        launch.stop(proc)
        raise
    return proc, addr


def wait_idle(probe: ServerProbe, timeout_s: float) -> dict[str, Any]:
    """The first of two consecutive samples with nothing running, waiting or referenced."""
    deadline = time.monotonic() + timeout_s
    last: Optional[dict[str, Any]] = None
    while True:
        row = probe.sample()
        idle = row is not None and row["kv_pages_active"] == 0 and not row["requests_running"] \
            and not row["requests_waiting"]
        if idle and last is not None:
            return last
        last = row if idle else None
        if time.monotonic() > deadline:
            return row or {}
        time.sleep(1.0)


def answers_every_model(grpc_url: str) -> tuple[bool, str]:
    """One short request per model after the soak: the server still serves all of them."""
    rng = random.Random(0)
    failed = []
    with RawStreamSession(grpc_url, stream_timeout=120) as session:
        for model in mix.MODELS:
            try:
                session.generate(model, mix.request_tensors(model, mix.Shape(max_tokens=4), rng))
            except Exception as exc:
                failed.append(f"{model}: {exc}")
    return not failed, "; ".join(failed) or "every model answered"


def progress(t0: float, minutes: float, log: OutcomeLog, samples: Path) -> str:
    tot = log.totals()
    rows = read_rows(samples)
    row = rows[-1] if rows else {}
    return (f"[soak {(time.time() - t0) / 60:5.1f}/{minutes:g} min] requests {tot['requests']} "
            f"unexpected {tot['unexpected']} bursts {len(log.bursts)} | pages a/c/f/t "
            f"{row.get('kv_pages_active')}/{row.get('kv_pages_cached')}/{row.get('kv_pages_free')}/"
            f"{row.get('kv_pages_total')} running {row.get('requests_running')} waiting {row.get('requests_waiting')}"
            f" | RSS {row.get('rss_total_mb')} MiB | load {row.get('load_1m')}")


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"host": platform.node(), "cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def run_load(args: argparse.Namespace, grpc_url: str, log: OutcomeLog, samples: Path, t0: float) -> float:
    classes = [users.bind(users.MixUser, grpc_url, log),
               users.bind(users.KillUser, grpc_url, log, pacing_s=args.kill_every),
               users.bind(users.BurstUser, grpc_url, log, pacing_s=args.burst_every, burst_size=args.max_queued + 4)]
    env = Environment(user_classes=classes)
    runner = env.create_local_runner()
    count = args.users + 2
    runner.start(count, spawn_rate=count)

    def report() -> None:
        while True:
            gevent.sleep(args.progress_every)
            print(progress(t0, args.minutes, log, samples), flush=True)

    printer = gevent.spawn(report)
    gevent.sleep(args.minutes * 60)
    log.closing = True   # let a burst in progress finish, start no new one
    deadline = time.monotonic() + 120
    while log.bursts_open and time.monotonic() < deadline:
        gevent.sleep(0.5)
    load_end = time.time() - t0
    runner.quit()
    printer.kill()
    return load_end


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    proc = None
    if args.grpc_url:
        grpc_url, metrics_url = args.grpc_url, args.metrics_url or args.grpc_url.rsplit(":", 1)[0] + ":8002"
        server_pid = args.server_pid or pid_listening_on(int(grpc_url.rsplit(":", 1)[1]))
        settings: dict[str, Any] = {"server": "given", "grpc_url": grpc_url}
    else:
        print("starting the server ...", flush=True)
        env = {**OWN_SERVER_ENV, **dict(kv.split("=", 1) for kv in args.server_env)}
        try:
            proc, addr = start_server(out, env)
        except Exception as exc:
            print(f"the server did not start: {exc}", file=sys.stderr)
            return 2
        grpc_url, metrics_url, server_pid = addr.grpc_url, addr.metrics_url, proc.pid
        settings = {"server": "own", "env": env}
    try:
        return soak(args, grpc_url, metrics_url, server_pid, proc, settings)
    finally:
        if proc is not None:
            from kvshare import launch

            launch.stop(proc)


def soak(args: argparse.Namespace, grpc_url: str, metrics_url: str, server_pid: Optional[int], proc: Any,
         settings: dict[str, Any]) -> int:
    out: Path = args.out
    samples = out / "samples.csv"
    log = OutcomeLog()
    t0 = time.time()
    probe = ServerProbe(metrics_url, server_pid, t0)
    first = probe.sample() or {}
    stubs_at_start = first.get("stubs")
    probe_proc = subprocess.Popen([sys.executable, "-m", "perf.load.soak.probe", "--metrics-url", metrics_url,
                                   "-o", str(samples), "--interval", str(args.sample_every), "--t0", str(t0),
                                   *(["--pid", str(server_pid)] if server_pid else [])], cwd=ROOT)
    try:
        ttft_start = ttft_histogram(metrics_url)
        load_avg_start = os.getloadavg()
        print(f"soak: {args.minutes:g} min against {grpc_url} (server pid {server_pid}, {stubs_at_start} stubs), "
              f"{args.users} users + bursts of {args.max_queued + 4} every {args.burst_every:g} s + a killed client "
              f"every {args.kill_every:g} s", flush=True)
        load_end_s = run_load(args, grpc_url, log, samples, t0)
        ttft_end = ttft_histogram(metrics_url)
        load_avg_end = os.getloadavg()
        print(f"load stopped after {load_end_s / 60:.1f} min; waiting for idle ...", flush=True)
        wait_idle(probe, args.idle_timeout)
        alive_ok, alive_detail = answers_every_model(grpc_url)
        idle = wait_idle(probe, args.idle_timeout)
        stubs_at_end = idle.get("stubs")
        if proc is not None and proc.poll() is not None:
            alive_ok, alive_detail = False, f"tritonserver exited with code {proc.returncode}"
        elif stubs_at_start is not None and stubs_at_end != stubs_at_start:
            alive_ok, alive_detail = False, f"{stubs_at_start} stub processes at the start, {stubs_at_end} at the end"
    finally:
        probe_proc.send_signal(signal.SIGTERM)
        probe_proc.wait(timeout=30)
    rows = read_rows(samples)
    rows_under_load = [r for r in rows if r["elapsed_s"] <= load_end_s]

    warmup_end_s = args.warmup_fraction * load_end_s
    window_s = max(3 * args.sample_every, 0.1 * load_end_s)
    rss = criteria.rss_growth(rows, warmup_end_s, load_end_s, window_s)
    ttfts = [s for _, s in log.ttfts]
    ttft_p99 = criteria.percentile(ttfts, 0.99)
    totals = log.totals()
    kinds_seen = {k: sum(v.values()) for k, v in totals["by_kind"].items()}
    checks = criteria.evaluate(
        unexpected=totals["unexpected"], requests=totals["requests"], bursts=log.bursts,
        bursts_open=log.bursts_open, idle_gauges=idle, rss=rss, rss_limit=args.rss_limit, ttft_p99_s=ttft_p99,
        ttft_bound_s=args.ttft_p99_bound, alive=(alive_ok, alive_detail), kinds_seen=kinds_seen,
        kinds_required=KINDS)
    loads = [r["load_1m"] for r in rows_under_load if r.get("load_1m") is not None]
    third = load_end_s / 3

    def ttft_window(lo: float, hi: float) -> Optional[float]:
        p = criteria.percentile([s for at, s in log.ttfts if lo <= at - t0 < hi], 0.99)
        return None if p is None else round(p, 3)

    last = rows_under_load[-1] if rows_under_load else {}
    summary = {
        "passed": all(c.ok for c in checks),
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks],
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)),
        "load_minutes": round(load_end_s / 60, 2),
        "command": "python -m perf.load.soak " + " ".join(sys.argv[1:]),
        "settings": {**settings, "users": args.users, "burst_size": args.max_queued + 4,
                     "burst_every_s": args.burst_every, "kill_every_s": args.kill_every,
                     "warmup_fraction": args.warmup_fraction, "ttft_p99_bound_s": args.ttft_p99_bound},
        "requests": totals,
        "bursts": {"count": len(log.bursts), "interrupted": log.bursts_interrupted, "each": log.bursts},
        "unexpected_examples": log.unexpected,
        "pages_at_idle": {k: idle.get(k) for k in ("kv_pages_active", "kv_pages_cached", "kv_pages_free",
                                                   "kv_pages_total")},
        "counters_at_end_of_load": {k: last.get(k) for k in ("generation_tokens_total", "evictions_total",
                                                             "preemptions_total")},
        "saturation": {"mean_running": _mean(rows_under_load, "requests_running"),
                       "mean_waiting": _mean(rows_under_load, "requests_waiting"),
                       "tokens_per_s": round(((last.get("generation_tokens_total") or 0)
                                              - (first.get("generation_tokens_total") or 0)) / max(load_end_s, 1e-9), 1)},
        "rss": {**(rss or {}), "at_start_mb": first.get("rss_total_mb"), "at_idle_mb": idle.get("rss_total_mb"),
                "warmup_end_s": round(warmup_end_s, 1), "window_s": round(window_s, 1),
                "stubs_at_start": stubs_at_start, "stubs_at_end": stubs_at_end},
        "ttft_client_s": {"completed_streams": len(ttfts), "p50": _round(criteria.percentile(ttfts, 0.5)),
                          "p99": _round(ttft_p99), "p99_by_third": [ttft_window(i * third, (i + 1) * third)
                                                                   for i in range(3)]},
        "ttft_server_histogram_s": {"p50_bucket": criteria.histogram_quantile(ttft_start, ttft_end, 0.5),
                                    "p99_bucket": criteria.histogram_quantile(ttft_start, ttft_end, 0.99)},
        "load_average": {"at_start": [round(v, 2) for v in load_avg_start],
                         "at_end": [round(v, 2) for v in load_avg_end],
                         "1m_min": min(loads, default=None), "1m_mean": round(mean(loads), 2) if loads else None,
                         "1m_max": max(loads, default=None),
                         "note": "shared machine: other engineers' tests ran during the soak"},
        "machine": machine(),
        "samples": {"count": len(rows), "every_s": args.sample_every,
                    "scrape_ms_max": max((r["scrape_ms"] for r in rows if r.get("scrape_ms") is not None), default=None)},
    }
    note = plot(rows, out / "soak.png", warmup_end_s=warmup_end_s, load_end_s=load_end_s,
                title=f"kvshare soak {summary['started_utc']} UTC, {summary['load_minutes']} min")
    summary["plot"] = note or "soak.png"
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    for u in log.unexpected[:10]:
        print(f"UNEXPECTED {u['kind']} {u['model']} {u['result']}: {u['detail']}", flush=True)
    for c in checks:
        print(f"{'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}", flush=True)
    print(f"soak {'PASSED' if summary['passed'] else 'FAILED'}: {out / 'summary.json'}", flush=True)
    return 0 if summary["passed"] else 1


def _mean(rows: Sequence[dict[str, Any]], key: str) -> Optional[float]:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(mean(vals), 2) if vals else None


def _round(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v, 3)


if __name__ == "__main__":
    sys.exit(main())
