"""The serving side by side as a table and one plot: perf/peer/serving.py's two result folders
(kvshare through Triton, vLLM's OpenAI server), point by point.

    python -m perf.peer.serving_report --kvshare DIR --vllm DIR [--md F] [--json F] [--png F]

Per point: each server's sustained output tok/s (serving_load: tokens that arrived while requests
were still being sent) and their ratio, the whole run's tok/s and ratio (drain included), TTFT
p50/p99, ITL p50/p99, errors. Then the goal's two readings on the open-loop points (mixed, Poisson
rates): the most sustained tok/s each server reached with its TTFT p99 within a bound (the bounds:
vLLM's TTFT p99 at each of its points), and kvshare's TTFT p99 against vLLM's at the same offered
rate. The plot: sustained throughput against TTFT p99 and ITL p50 (open loop), and throughput and
TTFT p99 against concurrency (closed loop).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf.peer.serving import POINTS  # noqa: E402

SIDES = ("kvshare", "vllm")
RATE = "sustained_tok_per_s"       # the headline throughput; "tok_per_s" is the whole run's


def load_side(folder: Path) -> dict[str, dict[str, Any]]:
    """point name -> serving_load's summary, for the points that ran."""
    out = {}
    for p in POINTS:
        f = folder / f"{p.name}.json"
        if f.is_file():
            out[p.name] = json.loads(f.read_text())["summary"]
    return out


def _f(v: Optional[float], fmt: str = ",.0f") -> str:
    return "-" if v is None else format(v, fmt)


def _x(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{ratio:.2f}×"


def _ratio(k: Optional[dict], v: Optional[dict], key: str) -> Optional[float]:
    return k[key] / v[key] if k and v and k.get(key) and v.get(key) else None


def rows(sides: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for p in POINTS:
        k, v = sides["kvshare"].get(p.name), sides["vllm"].get(p.name)
        if k is None and v is None:
            continue
        out.append(dict(point=p.name, trace=p.trace, loop=p.loop, concurrency=p.concurrency, rate=p.rate,
                        requests=p.requests, kvshare=k, vllm=v, ratio=_ratio(k, v, RATE),
                        ratio_whole_run=_ratio(k, v, "tok_per_s")))
    return out


def best_within(points: Sequence[dict[str, Any]], side: str, ttft_p99_ms: float) -> Optional[float]:
    """The most sustained tok/s of `side` among error-free points whose TTFT p99 is within the bound."""
    ok = [r[side][RATE] for r in points if r[side] and not r[side]["errors"] and r[side].get(RATE)
          and r[side]["ttft_p99_ms"] is not None and r[side]["ttft_p99_ms"] <= ttft_p99_ms]
    return max(ok) if ok else None


def _mixed(row: dict[str, Any]) -> bool:
    return row["trace"].startswith("mixed")


def goal_readings(table: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    open_mixed = [r for r in table if r["loop"] == "open" and _mixed(r) and r["kvshare"] and r["vllm"]]
    out = []
    for r in open_mixed:
        bound = r["vllm"]["ttft_p99_ms"]
        if bound is None:
            continue
        k, v = best_within(open_mixed, "kvshare", bound), best_within(open_mixed, "vllm", bound)
        out.append(dict(rate=r["rate"], ttft_p99_bound_ms=bound, kvshare_tok_s=k, vllm_tok_s=v,
                        throughput_ratio=(k / v) if k and v else None,
                        ttft_p99_ratio=(r["kvshare"]["ttft_p99_ms"] / bound) if r["kvshare"]["ttft_p99_ms"] else None))
    return out


def markdown(table: Sequence[dict[str, Any]], goals: Sequence[dict[str, Any]], info: Sequence[str]) -> str:
    lines = ["# Serving side by side: kvshare (Triton 2.51, gRPC streaming) vs `vllm serve` (OpenAI, SSE)", ""]
    lines += [f"- {i}" for i in info] + [""] if info else []
    lines += ["Sustained: output tokens that arrived while requests were still being sent, over that time. "
              "Whole run: first send to last token (the drain, paced by the longest outputs, included).", ""]
    lines += ["| point | loop | sustained tok/s k / v | kvshare / vLLM | whole run tok/s k / v | whole run k / v "
              "| TTFT p50 ms k / v | TTFT p99 ms k / v | ITL p50 ms k / v | ITL p99 ms k / v | errors k / v |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        k, v = r["kvshare"] or {}, r["vllm"] or {}
        loop = f"c={r['concurrency']}" if r["loop"] == "closed" else f"{r['rate']:g}/s"

        def pair(key, fmt=",.0f"):
            return f"{_f(k.get(key), fmt)} / {_f(v.get(key), fmt)}"

        lines.append(f"| {r['point']} | {loop} | {pair(RATE)} | {_x(r['ratio'])} | {pair('tok_per_s')} | "
                     f"{_x(r['ratio_whole_run'])} | {pair('ttft_p50_ms')} | {pair('ttft_p99_ms')} | "
                     f"{pair('itl_p50_ms', '.1f')} | {pair('itl_p99_ms', '.1f')} | "
                     f"{k.get('errors', '-')} / {v.get('errors', '-')} |")
    if goals:
        lines += ["", "Open loop (mixed): the most sustained tok/s each server reached with TTFT p99 within vLLM's TTFT p99 "
                  "at a rate, and kvshare's TTFT p99 over vLLM's at that rate (goal: ≥ 1.2× throughput; < 1.0 TTFT).",
                  "", "| rate /s | TTFT p99 bound ms | kvshare tok/s | vLLM tok/s | throughput ratio | TTFT p99 kvshare / vLLM |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for g in goals:
            lines.append(f"| {g['rate']:g} | {_f(g['ttft_p99_bound_ms'])} | {_f(g['kvshare_tok_s'])} | "
                         f"{_f(g['vllm_tok_s'])} | {_f(g['throughput_ratio'], '.2f')} | {_f(g['ttft_p99_ratio'], '.2f')} |")
    return "\n".join(lines) + "\n"


def plot(table: Sequence[dict[str, Any]], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    style = {"kvshare": dict(color="tab:blue", marker="o", label="kvshare (Triton, gRPC)"),
             "vllm": dict(color="tab:orange", marker="s", label="vLLM 0.25.0 (vllm serve)")}

    def series(loop, trace, x_key, y_key, side):
        pts = [(r[side].get(x_key), r[side][y_key])
               for r in table if r["loop"] == loop and r["trace"].startswith(trace) and r[side] and not r[side]["errors"]
               and r[side].get(y_key) is not None]
        pts = [p for p in pts if p[0] is not None]
        return zip(*sorted(pts)) if pts else ((), ())

    for side in SIDES:
        x, y = series("open", "mixed", RATE, "ttft_p99_ms", side)
        axes[0, 0].plot(x, y, **style[side])
        x, y = series("open", "mixed", RATE, "itl_p50_ms", side)
        axes[0, 1].plot(x, y, **style[side])
        for trace, ls in (("mixed", "-"), ("shared-prefix", "--")):
            pts = sorted((r["concurrency"], r[side][RATE], r[side]["ttft_p99_ms"]) for r in table
                         if r["loop"] == "closed" and r["trace"].startswith(trace) and r[side] and not r[side]["errors"]
                         and r[side].get(RATE) is not None)
            if pts:
                c, tput, ttft = zip(*pts)
                kw = dict(style[side], linestyle=ls, label=f"{style[side]['label']}, {trace}")
                axes[1, 0].plot(c, tput, **kw)
                axes[1, 1].plot(c, ttft, **kw)
    axes[0, 0].set(title="open loop, mixed (Poisson rates)", xlabel="sustained output tok/s", ylabel="TTFT p99 ms", yscale="log")
    axes[0, 1].set(title="open loop, mixed", xlabel="sustained output tok/s", ylabel="ITL p50 ms")
    axes[1, 0].set(title="closed loop", xlabel="requests in flight", ylabel="sustained output tok/s", xscale="log")
    axes[1, 1].set(title="closed loop", xlabel="requests in flight", ylabel="TTFT p99 ms", xscale="log", yscale="log")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("kvshare vs vLLM, serving: Llama-2-7B shape fp16 (random weights), one H200, token ids, greedy")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def gpu_name() -> Optional[str]:
    """GPU 0's name: the table names the machine it ran on, which a lease does not fix in advance."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvshare", type=Path, required=True)
    ap.add_argument("--vllm", type=Path, required=True)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path)
    ap.add_argument("--info", action="append", default=[], help="a line under the title (machine, versions)")
    ap.add_argument("--gpu-name", action="store_true", help="first line: the GPU this runs on (nvidia-smi)")
    a = ap.parse_args(argv)
    if a.gpu_name:
        a.info = [f"GPU: {gpu_name() or 'unknown (no nvidia-smi)'}", *a.info]
    sides = {"kvshare": load_side(a.kvshare), "vllm": load_side(a.vllm)}
    if not any(sides.values()):
        print("serving_report: no point's JSON in either folder", file=sys.stderr)
        return 1
    table = rows(sides)
    goals = goal_readings(table)
    md = markdown(table, goals, a.info)
    print(md)
    if a.md:
        a.md.write_text(md)
    if a.json:
        a.json.write_text(json.dumps(dict(points=table, goals=goals, info=a.info), indent=1) + "\n")
    if a.png:
        try:
            plot(table, a.png)
        except ImportError as exc:   # the GPU image may lack matplotlib: the JSON replots anywhere
            print(f"serving_report: no plot ({exc})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
