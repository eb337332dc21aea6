#!/usr/bin/env python3
"""One command from a benchmark run to a Markdown report with plots.

    python -m perf.report RUN_DIR_OR_FILES... -o docs/reports/NAME [--title T] [--copy-data]
    python perf/report/make_report.py runs/locust-16 runs/pa-sweep runs/server-bench -o docs/reports/x

Inputs (directories are searched recursively; the kind of each file is recognised by its content):
  Locust CSV          <prefix>_stats.csv (+ <prefix>_stats_history.csv), from perf/load/run_locust.sh
  perf_analyzer       --profile-export-file JSON (perf/load/pa_sweep.sh's c<N>.json), summarised
                      with perf/load/pa_export_stats.py; its sweep.csv when no export is given
  server benchmark    server_benchmark.json from perf/server/server_benchmark.py
  offline benchmark   the --json of perf/engine/offline_benchmark.py
  metrics samples     CSV from perf/report/metrics_sampler.py (KV pages, requests running/waiting)
Writes OUT/README.md and OUT/*.png: throughput vs concurrency, TTFT and ITL percentiles, the
server benchmark against HF transformers, Locust over time, KV pages in use over time.
With --copy-data the inputs (files up to 5 MB) are copied to OUT/data/ so the report stands alone.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from perf.load import pa_export_stats as pas  # noqa: E402
from perf.report.metrics_sampler import is_metrics_csv, read_csv  # noqa: E402

COPY_LIMIT = 5 * 1024 * 1024


# ---------------------------------------------------------------- inputs

@dataclass
class LocustRun:
    label: str
    stats: list[dict[str, str]]
    history: list[dict[str, str]] = field(default_factory=list)


@dataclass
class Inputs:
    locust: list[LocustRun] = field(default_factory=list)
    pa_rows: list[dict[str, Any]] = field(default_factory=list)      # pa_export_stats.flat_row dicts
    server: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    offline: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)
    metrics: list[tuple[str, list[dict[str, Optional[float]]], Optional[dict[str, Any]]]] = field(default_factory=list)
    used: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)


def _read_dicts(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _label(path: Path) -> str:
    return path.parent.name or path.stem


def _files(paths: Sequence[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(p)
    return out


def collect(paths: Sequence[Path]) -> Inputs:
    """Sort the input files by kind (see the module doc); unknown files are listed as skipped."""
    inp = Inputs()
    files = _files(paths)
    pa_sweeps: list[Path] = []
    server_dirs: dict[Path, dict[str, Any]] = {}
    pending_metrics: list[Path] = []
    for f in files:
        name = f.name
        if name.endswith("_stats.csv"):
            hist = f.with_name(name[: -len("_stats.csv")] + "_stats_history.csv")
            inp.locust.append(LocustRun(_label(f), _read_dicts(f), _read_dicts(hist) if hist.exists() else []))
            inp.used += [f] + ([hist] if hist.exists() else [])
        elif name.endswith("_stats_history.csv"):
            continue  # read with its _stats.csv
        elif f.suffix == ".csv" and is_metrics_csv(f):
            pending_metrics.append(f)
        elif f.suffix == ".csv":
            head = f.open(encoding="utf-8", errors="replace").readline()
            if head.startswith("source,mode,value,") and "output_tokens_per_s" in head:
                pa_sweeps.append(f)
            else:
                inp.skipped.append(f)
        elif f.name == "phases.json":
            continue  # read with the metrics CSV next to it
        elif f.suffix == ".json":
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError):
                inp.skipped.append(f)
                continue
            if isinstance(data, dict) and "experiments" in data:
                for s in pas.export_stats(data):
                    inp.pa_rows.append(pas.flat_row(str(f), s))
                inp.used.append(f)
            elif isinstance(data, dict) and data.get("kind") == "kvshare-server-benchmark":
                inp.server.append((_label(f), data))
                server_dirs[f.parent] = data
                inp.used.append(f)
            elif isinstance(data, list) and data and isinstance(data[0], dict) and {"system", "tok_per_s"} <= set(data[0]):
                inp.offline.append((_label(f), data))
                inp.used.append(f)
            else:
                inp.skipped.append(f)
        else:
            inp.skipped.append(f)
    if not inp.pa_rows:  # a sweep.csv alone stands for its exports
        for f in pa_sweeps:
            for r in _read_dicts(f):
                inp.pa_rows.append({k: _num(v) for k, v in r.items()})
            inp.used.append(f)
    else:
        inp.skipped += pa_sweeps
    for f in pending_metrics:
        rows = read_csv(f)
        inp.metrics.append((_label(f), rows, server_dirs.get(f.parent) or _phases_file(f.parent / "phases.json", rows)))
        inp.used.append(f)
        if (f.parent / "phases.json").exists():
            inp.used.append(f.parent / "phases.json")
    inp.pa_rows.sort(key=lambda r: (str(r.get("source", "")).rsplit("/", 2)[0], _num(r.get("value")) or 0))
    return inp


def _phases_file(path: Path, rows: list[dict[str, Optional[float]]]) -> Optional[dict[str, Any]]:
    """phases.json next to a metrics CSV: [{"label", "start_unix", "end_unix"}] -> seconds since its first sample."""
    if not path.exists() or not rows:
        return None
    t0 = (rows[0]["time_s"] or 0.0) - (rows[0]["elapsed_s"] or 0.0)
    return {"phases": [{"workload": p.get("label", ""), "start_s": p["start_unix"] - t0, "end_s": p["end_unix"] - t0}
                       for p in json.loads(path.read_text())]}


def _num(v: Any) -> Any:
    if isinstance(v, (int, float)) or v is None:
        return v
    try:
        x = float(v)
    except (TypeError, ValueError):
        return v
    return int(x) if x.is_integer() and "." not in str(v) else x


def _f(v: Any, fmt: str = ".1f") -> str:
    if v is None or v == "" or (isinstance(v, float) and math.isnan(v)):
        return "–"
    try:
        return format(float(v), fmt)
    except (TypeError, ValueError):
        return str(v)


def _md_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- Locust

def _lf(row: dict[str, str], key: str) -> Optional[float]:
    v = row.get(key)
    try:
        return float(v) if v not in (None, "", "N/A") else None
    except ValueError:
        return None


def locust_summary(run: LocustRun) -> dict[str, Any]:
    """Per model: requests, failures, output tokens/s, and stream/ttft/itl percentiles (ms)."""
    by_type = {(r["Type"], r["Name"]): r for r in run.stats if r.get("Type")}
    stream = [(n, r) for (t, n), r in by_type.items() if t == "stream"]
    times = [int(float(h["Timestamp"])) for h in run.history if h.get("Timestamp")]
    users = [int(float(h["User Count"])) for h in run.history if h.get("User Count")]
    duration = (max(times) - min(times)) if len(times) > 1 else None
    out: dict[str, Any] = {"label": run.label, "models": {}, "users": max(users) if users else None,
                           "duration_s": duration}
    for model, r in stream:
        reqs = int(float(r["Request Count"]))
        tokens = reqs * (_lf(r, "Average Content Size") or 0.0)
        rps = _lf(r, "Requests/s")
        secs = reqs / rps if rps else duration
        m = {"requests": reqs, "failures": int(float(r["Failure Count"])), "output_tokens": round(tokens),
             "tok_per_s": tokens / secs if secs else None, "req_per_s": rps}
        for t in ("stream", "ttft", "itl"):
            row = by_type.get((t, model))
            if row:
                m[t] = {p: _lf(row, f"{p}%") for p in (50, 95, 99)} | {"avg": _lf(row, "Average Response Time")}
        out["models"][model] = m
    return out


def plot_locust_history(run: LocustRun, out: Path) -> Optional[Path]:
    rows = [h for h in run.history if h.get("Type") in ("stream", "ttft", "itl")]
    if not rows:
        return None
    t0 = min(int(float(h["Timestamp"])) for h in run.history)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    streams = [h for h in rows if h["Type"] == "stream"]
    # output tokens/s from the cumulative counters: d(requests * mean content size) / dt
    cum = [(int(float(h["Timestamp"])) - t0, float(h["Total Request Count"]) * (_lf(h, "Total Average Content Size") or 0))
           for h in streams]
    # completions arrive in bursts (closed-loop users finish together): rate over a trailing 15 s window
    win = 15
    ts = [b for b, _ in cum if b - cum[0][0] >= win]
    tps = []
    for b in ts:
        a, ca = next((a, ca) for a, ca in cum if a >= b - win)
        cb = next(cb for t, cb in cum if t == b)
        tps.append((cb - ca) / max(b - a, 1))
    if ts:
        ax1.plot(ts, tps, color="tab:blue", label=f"output tok/s (trailing {win} s)")
    ax1.set_ylabel("output tokens/s")
    ax1.set_ylim(bottom=0)
    axu = ax1.twinx()
    users_t = [(int(float(h["Timestamp"])) - t0, int(float(h["User Count"]))) for h in run.history if h.get("Name") == "Aggregated"]
    if users_t:
        axu.step([u[0] for u in users_t], [u[1] for u in users_t], where="post", color="tab:gray", ls="--", label="users")
    axu.set_ylabel("users")
    axu.set_ylim(bottom=0)
    h1, l1 = ax1.get_legend_handles_labels()
    h2, l2 = axu.get_legend_handles_labels()
    ax1.legend(h1 + h2, l1 + l2, loc="lower right")
    ax1.set_title(f"Locust run {run.label}: throughput and latency over time")
    ax1.grid(alpha=0.3)
    for typ, color in (("ttft", "tab:orange"), ("itl", "tab:green")):
        hs = [h for h in rows if h["Type"] == typ]
        x = [int(float(h["Timestamp"])) - t0 for h in hs]
        for p, ls in (("50%", "-"), ("95%", ":")):
            y = [_lf(h, p) for h in hs]
            pts = [(a, b) for a, b in zip(x, y) if b is not None and b > 0]
            if pts:
                ax2.plot([a for a, _ in pts], [b for _, b in pts], ls, color=color, label=f"{typ.upper()} p{p[:-1]}")
    ax2.set_yscale("log")
    ax2.set_ylabel("ms (log scale; Locust's recent window)")
    ax2.set_xlabel("seconds since start")
    ax2.grid(alpha=0.3, which="both")
    ax2.legend(loc="upper right", ncol=2)
    fig.tight_layout()
    path = out / f"locust_{_slug(run.label)}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in s)


# ---------------------------------------------------------------- plots across inputs

def plot_throughput(inp: Inputs, out: Path) -> Optional[Path]:
    fig, ax = plt.subplots(figsize=(8, 5))
    drawn = False
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in inp.pa_rows:
        groups.setdefault(str(Path(str(r.get("source", ""))).parent.name or "perf_analyzer"), []).append(r)
    for g, rows in groups.items():
        rows = sorted(rows, key=lambda r: float(r["value"]))
        ax.plot([float(r["value"]) for r in rows], [float(r["output_tokens_per_s"]) for r in rows], "o-",
                label=f"kvshare, perf_analyzer sweep ({g})")
        drawn = True
    for run in inp.locust:
        s = locust_summary(run)
        for model, m in s["models"].items():
            if s["users"] and m["tok_per_s"]:
                ax.plot([s["users"]], [m["tok_per_s"]], "s", ms=9, label=f"kvshare, Locust {run.label} ({model})")
                drawn = True
    markers = {"kvshare-server": "*", "hf-generate": "v", "hf-generate_batch": "^", "kvshare": "*",
               "kvshare-no-sharing": "x"}
    for label, data in inp.server:
        for r in data["rows"]:
            ax.plot([r["concurrency"]], [r["tok_per_s"]], markers.get(r["system"], "d"), ms=10,
                    label=f"{r['system']} · {r['workload']} (server benchmark)")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xscale("log", base=2)
    xs = sorted({float(x) for line in ax.get_lines() for x in line.get_xdata()})
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x:g}" for x in xs])
    ax.minorticks_off()
    if len(xs) == 1:
        ax.set_xlim(xs[0] / 2, xs[0] * 2)
    ax.set_xlabel("concurrency (requests in flight / users)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput vs concurrency")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7.5, loc="best")
    fig.tight_layout()
    path = out / "throughput_vs_concurrency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency(inp: Inputs, out: Path) -> Optional[Path]:
    """TTFT and ITL p50/p95: lines over concurrency for perf_analyzer, bars for the benchmarks/Locust."""
    bars: list[tuple[str, dict[str, Optional[float]]]] = []
    for label, data in inp.server:
        for r in data["rows"]:
            if r.get("ttft_p50_ms") is not None:
                bars.append((f"{r['system']}\n{r['workload']}", {k: r.get(k) for k in
                             ("ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms")}))
    for run in inp.locust:
        for model, m in locust_summary(run)["models"].items():
            bars.append((f"Locust {run.label}\n{model}", {
                "ttft_p50_ms": (m.get("ttft") or {}).get(50), "ttft_p95_ms": (m.get("ttft") or {}).get(95),
                "itl_p50_ms": (m.get("itl") or {}).get(50), "itl_p95_ms": (m.get("itl") or {}).get(95)}))
    if not inp.pa_rows and not bars:
        return None
    ncols = (1 if inp.pa_rows else 0) + (1 if bars else 0)
    fig, axes = plt.subplots(2, ncols, figsize=(6.5 * ncols, 7.5), squeeze=False)
    col = 0
    if inp.pa_rows:
        rows = sorted(inp.pa_rows, key=lambda r: float(r["value"]))
        x = [float(r["value"]) for r in rows]
        for i, metric in enumerate(("ttft", "itl")):
            ax = axes[i][col]
            for p, ls in (("p50", "o-"), ("p95", "s--")):
                ax.plot(x, [float(r[f"{metric}_{p}_ms"]) for r in rows], ls, label=f"{metric.upper()} {p}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(set(x)))
            ax.set_xticklabels([f"{v:g}" for v in sorted(set(x))])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_xlabel("concurrency (perf_analyzer)")
            ax.set_ylabel("ms")
            ax.set_title(f"{metric.upper()} vs concurrency (perf_analyzer)")
            ax.grid(alpha=0.3)
            ax.legend()
        col += 1
    if bars:
        for i, metric in enumerate(("ttft", "itl")):
            ax = axes[i][col]
            have = [b for b in bars if any(b[1].get(f"{metric}_{p}_ms") is not None for p in ("p50", "p95"))]
            if not have:
                ax.set_axis_off()
                continue
            xs = range(len(have))
            w = 0.38
            vals_all = []
            for j, p in enumerate(("p50", "p95")):
                vals = [b[1].get(f"{metric}_{p}_ms") or 0.0 for b in have]
                vals_all += [v for v in vals if v > 0]
                rects = ax.bar([x + (j - 0.5) * w for x in xs], vals, w, label=p)
                ax.bar_label(rects, fmt="%.0f", fontsize=7)
            if vals_all and max(vals_all) > 10 * min(vals_all):
                ax.set_yscale("log")
                ax.set_ylabel("ms (log scale)")
            else:
                ax.set_ylabel("ms")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([b[0] for b in have], fontsize=7.5)
            ax.set_title(f"{metric.upper()} percentiles (client side; systems without it left out)", fontsize=10)
            ax.grid(alpha=0.3, axis="y")
            ax.legend()
    fig.tight_layout()
    path = out / "latency_percentiles.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_server_benchmark(label: str, data: dict[str, Any], out: Path) -> Path:
    rows = data["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    w = 0.8 / max(len(systems), 1)
    for j, s in enumerate(systems):
        vals = [next((r["tok_per_s"] for r in rows if r["workload"] == wl and r["system"] == s), 0.0) for wl in workloads]
        rects = ax.bar([i + (j - (len(systems) - 1) / 2) * w for i in range(len(workloads))], vals, w, label=s)
        ax.bar_label(rects, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads)
    ax.set_ylabel("output tokens/s")
    cfg = data.get("config", {})
    ax.set_title(f"Server benchmark: {cfg.get('requests')} req × {cfg.get('output_tokens')} tokens, "
                 f"concurrency {cfg.get('concurrency')} ({cfg.get('model')})", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    path = out / f"server_benchmark_{_slug(label)}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_kv_pages(label: str, rows: list[dict[str, Optional[float]]], server: Optional[dict[str, Any]],
                  out: Path) -> Optional[Path]:
    rows = [r for r in rows if r.get("kv_pages_active") is not None]
    if not rows:
        return None
    t = [r["elapsed_s"] for r in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    active = [r["kv_pages_active"] or 0 for r in rows]
    cached = [r.get("kv_pages_cached") or 0 for r in rows]
    free = [r.get("kv_pages_free") or 0 for r in rows]
    ax.stackplot(t, active, cached, labels=["active (referenced by running requests)", "cached (reusable prefixes)"],
                 colors=["tab:red", "tab:blue"], alpha=0.75)
    ax.set_ylabel("KV pages")
    total = rows[-1].get("kv_pages_total")
    peak = max(a + c for a, c in zip(active, cached))
    ax.set_ylim(0, max(peak * 1.2, 1))
    title = f"KV pages in use over time ({label})"
    if total:
        title += f" — pool {int(total)} pages, min free {int(min(free))}"
    ax.set_title(title)
    ax.grid(alpha=0.3)
    for i, ph in enumerate((server or {}).get("phases", [])):
        for a in (ax, ax2):
            a.axvspan(ph["start_s"], ph["end_s"], color=("tab:gray" if i % 2 else "gold"), alpha=0.15, lw=0)
        ax.text((ph["start_s"] + ph["end_s"]) / 2, 0.97, ph.get("workload") or ph.get("label", ""), ha="center",
                va="top", fontsize=8, transform=ax.get_xaxis_transform())
    ax2.plot(t, [r.get("requests_running") or 0 for r in rows], label="requests running", color="tab:green")
    ax2.plot(t, [r.get("requests_waiting") or 0 for r in rows], label="requests waiting", color="tab:purple")
    ax2.set_ylabel("requests")
    ax2.set_xlabel("seconds since sampling started (every 0.5 s)")
    ax2.grid(alpha=0.3)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    fig.legend(h1 + h2, l1 + l2, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path = out / f"kv_pages_{_slug(label)}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- Markdown

def _server_section(label: str, data: dict[str, Any], png: Path) -> list[str]:
    cfg = data.get("config", {})
    mach = data.get("machine", {})
    lines = [f"## Server benchmark ({label})", "",
             f"`{data.get('command', 'python perf/server/server_benchmark.py')}` — {data.get('created', '')}; "
             f"{cfg.get('requests')} requests × {cfg.get('output_tokens')} forced output tokens per workload, "
             f"{cfg.get('concurrency')} in flight, model `{cfg.get('model')}` via `{cfg.get('model_name')}`; "
             f"machine: {mach.get('cpus')} CPUs, torch {mach.get('torch')} ({mach.get('torch_threads')} threads), "
             f"transformers {mach.get('transformers')}. kvshare runs through the Triton server (client-side "
             "timings); the HF baselines run in-process on the same token ids after the server stopped.", ""]
    head = ["workload", "system", "reqs", "out tokens", "s", "out tok/s", "req/s", "TTFT p50", "TTFT p95",
            "ITL p50", "ITL p95", "prefix hit", "peak KV pages"]
    body = [[r["workload"], r["system"], r["requests"], r["output_tokens"], _f(r["seconds"]), _f(r["tok_per_s"]),
             _f(r.get("req_per_s"), ".2f"), _f(r.get("ttft_p50_ms"), ".0f"), _f(r.get("ttft_p95_ms"), ".0f"),
             _f(r.get("itl_p50_ms")), _f(r.get("itl_p95_ms")), _f(r.get("prefix_hit_rate"), ".1%"),
             _f(r.get("peak_kv_pages"), ".0f")] for r in data["rows"]]
    lines += [_md_table(head, body), "", "Latencies in ms. HF `generate` runs static batches: every token of a batch "
              "arrives when the batch ends, so its TTFT is the batch time; `generate_batch` reports no per-request "
              "timings.", ""]
    rat = data.get("ratios", {})
    if rat:
        lines += ["**Throughput ratios (same prompts, same forced lengths):**", ""]
        lines += [f"- `{w}`: " + ", ".join(f"{k} = **{v:.2f}×**" for k, v in d.items()) for w, d in rat.items()]
        lines.append("")
    lines += [f"![server benchmark]({png.name})", ""]
    return lines


def build_report(paths: Sequence[Path], out: Path, *, title: str = "kvshare benchmark report",
                 copy_data: bool = False, command: Optional[str] = None, note: str = "") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    inp = collect(paths)
    if not (inp.locust or inp.pa_rows or inp.server or inp.offline or inp.metrics):
        raise SystemExit(f"nothing to report in {', '.join(map(str, paths))}")
    md = [f"# {title}", "",
          f"Made by `{command or 'python -m perf.report ' + ' '.join(map(str, paths)) + ' -o ' + str(out)}` "
          f"on {time.strftime('%Y-%m-%d %H:%M')}.", ""]
    if note:
        md += [note, ""]
    summary = []
    for label, data in inp.server:
        for w, d in data.get("ratios", {}).items():
            summary.append(f"- server benchmark `{w}`: " + ", ".join(f"{k} {v:.2f}×" for k, v in d.items()))
    if inp.pa_rows:
        best = max(inp.pa_rows, key=lambda r: float(r["output_tokens_per_s"]))
        summary.append(f"- perf_analyzer sweep: peak {float(best['output_tokens_per_s']):.1f} output tok/s at "
                       f"concurrency {best['value']}")
    for run in inp.locust:
        s = locust_summary(run)
        for model, m in s["models"].items():
            summary.append(f"- Locust `{run.label}` ({s['users']} users, {model}): {m['requests']} requests, "
                           f"{m['failures']} failures, {_f(m['tok_per_s'])} output tok/s, TTFT p95 "
                           f"{_f((m.get('ttft') or {}).get(95), '.0f')} ms")
    if summary:
        md += ["## Summary", "", *summary, ""]
    thr = plot_throughput(inp, out)
    lat = plot_latency(inp, out)
    if thr or lat:
        md += ["## Throughput and latency", ""]
        if thr:
            md += [f"![throughput vs concurrency]({thr.name})", ""]
        if lat:
            md += [f"![TTFT and ITL percentiles]({lat.name})", ""]
    for label, data in inp.server:
        md += _server_section(label, data, plot_server_benchmark(label, data, out))
    for label, rows in inp.offline:
        md += [f"## Offline benchmark ({label})", "", "`perf/engine/offline_benchmark.py` (engine in-process, no server).", "",
               _md_table(["workload", "system", "reqs", "out tok/s", "TTFT p50", "TTFT p95", "peak pages", "hit"],
                         [[r["workload"], r["system"], r["requests"], _f(r["tok_per_s"]), _f(r.get("ttft_p50_ms"), ".0f"),
                           _f(r.get("ttft_p95_ms"), ".0f"), _f(r.get("peak_kv_pages"), ".0f"),
                           _f(r.get("prefix_hit_rate"), ".2f")] for r in rows]), ""]
    if inp.pa_rows:
        md += ["## perf_analyzer sweep", "",
               "Streaming, one level per concurrency; percentiles from the profile exports' response timestamps "
               "(`perf/load/pa_export_stats.py`: ITL = gap between content responses ÷ their tokens).", "",
               _md_table(["source", "concurrency", "requests", "out tokens", "out tok/s", "req/s", "TTFT p50", "TTFT p95",
                          "ITL p50", "ITL p95", "E2E p95"],
                         [[Path(str(r.get("source", ""))).name, r["value"], r["requests"], r["output_tokens"],
                           _f(r["output_tokens_per_s"]), _f(r["requests_per_s"], ".2f"), _f(r["ttft_p50_ms"], ".0f"),
                           _f(r["ttft_p95_ms"], ".0f"), _f(r["itl_p50_ms"]), _f(r["itl_p95_ms"]), _f(r["e2e_p95_ms"], ".0f")]
                          for r in inp.pa_rows]), ""]
    for run in inp.locust:
        s = locust_summary(run)
        md += [f"## Locust run `{run.label}`", "",
               f"{s['users']} users, closed loop, {s['duration_s']} s of history. Rows per model: `stream` "
               "(end-to-end), `ttft`, `itl` (mean inter-token latency per request).", ""]
        rows = []
        for model, m in s["models"].items():
            for t in ("stream", "ttft", "itl"):
                if t in m:
                    rows.append([model, t, m["requests"] if t == "stream" else "", m["failures"] if t == "stream" else "",
                                 _f(m["tok_per_s"]) if t == "stream" else "", _f(m[t]["avg"]), _f(m[t][50], ".0f"),
                                 _f(m[t][95], ".0f"), _f(m[t][99], ".0f")])
        md += [_md_table(["model", "row", "requests", "failures", "out tok/s", "avg ms", "p50 ms", "p95 ms", "p99 ms"], rows), ""]
        png = plot_locust_history(run, out)
        if png:
            md += [f"![Locust over time]({png.name})", ""]
    if inp.metrics:
        md += ["## KV cache pages over time", "",
               "Sampled from the server's metrics port every 0.5 s (`perf/report/metrics_sampler.py`): pages "
               "referenced by running requests (active) and unreferenced pages that still hold a reusable prefix "
               "(cached), with requests running / waiting below.", ""]
        for label, rows, server in inp.metrics:
            png = plot_kv_pages(label, rows, server, out)
            if png:
                act = [r["kv_pages_active"] for r in rows if r.get("kv_pages_active") is not None]
                md += [f"### {label}", "", f"{len(rows)} samples over {_f(rows[-1]['elapsed_s'], '.0f')} s; peak active "
                       f"{_f(max(act), '.0f')} pages.", "", f"![KV pages]({png.name})", ""]
    if copy_data:
        data_dir = out / "data"
        copied = []
        for f in inp.used:
            if f.stat().st_size <= COPY_LIMIT and data_dir not in f.resolve().parents:
                dest = data_dir / _slug(f.parent.name) / f.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dest)
                copied.append(dest.relative_to(out))
        md += ["## Data", "", "Inputs copied next to this report:", "", *[f"- `{c}`" for c in copied], ""]
    md += ["## Inputs", "", *[f"- `{f}`" for f in inp.used]]
    if inp.skipped:
        md += ["", f"Not used ({len(inp.skipped)}): " + ", ".join(f"`{f.name}`" for f in inp.skipped[:20])]
    report = out / "README.md"
    report.write_text("\n".join(md) + "\n", encoding="utf-8")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", type=Path, help="run directories and/or files")
    ap.add_argument("-o", "--out", type=Path, required=True, help="report directory (README.md + PNGs)")
    ap.add_argument("--title", default="kvshare benchmark report")
    ap.add_argument("--note", default="", help="a paragraph (Markdown) placed under the title")
    ap.add_argument("--copy-data", action="store_true", help="copy the inputs (<= 5 MB each) to OUT/data/")
    args = ap.parse_args(argv)
    command = "python -m perf.report " + " ".join(map(str, args.inputs)) + f" -o {args.out}" + \
        (" --copy-data" if args.copy_data else "") + (" --title ... --note ..." if args.note else "")
    report = build_report(args.inputs, args.out, title=args.title, copy_data=args.copy_data, note=args.note,
                          command=command)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
