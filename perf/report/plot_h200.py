"""One picture of the H200 results: kvshare against HF transformers per workload, what prefix
sharing buys on shared-prefix, and the whole stack against the offline engine.

    python perf/report/plot_h200.py --table TABLE [--shared SHARED.json] [--fullstack SUMMARY.json] -o OUT.png

TABLE: perf/engine/offline_benchmark.py's rows, as its --json file or as its printed table (a text file
holding the lines it printed; only rows it recognises are read). SHARED: the shared-prefix run's JSON
(kvshare and kvshare-no-sharing rows). SUMMARY: perf/server/fullstack.sh's summary.json
(the suites engine, shared-prefix and fullstack of `python -m perf.gpu`; perf/results/README.md).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_ROW = re.compile(r"^(?P<workload>[a-z][\w-]*)\s+(?P<system>\S.*?)\s+(?P<reqs>\d+)\s+(?P<out>\d+)\s+"
                  r"(?P<secs>[\d.]+)\s+(?P<tok>[\d.]+)\s")


def rows_from_printed(text: str) -> list[dict]:
    """The rows of perf/engine/offline_benchmark.py's printed table. It reprints the table after each workload,
    and a later run in the same file may print the same workload again: the first row per key wins."""
    rows: dict[tuple[str, str], dict] = {}
    for line in text.splitlines():
        m = _ROW.match(line)
        if m:
            system = re.sub(r"\s*\(median of \d+\)", "", m["system"]).strip()
            rows.setdefault((m["workload"], system), {"workload": m["workload"], "system": system,
                                                      "tok_per_s": float(m["tok"])})
    return list(rows.values())


def load_rows(path: Path) -> list[dict]:
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return rows_from_printed(text)


def _bars(ax, labels: list[str], series: dict[str, list[float | None]], title: str, log: bool = False) -> None:
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        heights = [v or 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=name)
        for bar, v in zip(bars, values):
            if v:
                ax.annotate(f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                            fontsize=7, rotation=90 if len(labels) > 3 else 0)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("output tokens/s")
    if log:
        ax.set_yscale("log")
        ax.set_ylim(top=ax.get_ylim()[1] * 3)     # room for the value labels
    else:
        ax.set_ylim(top=ax.get_ylim()[1] * 1.15)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", type=Path, required=True)
    ap.add_argument("--shared", type=Path, default=None)
    ap.add_argument("--fullstack", type=Path, default=None)
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--title", default="kvshare on one H200 (Llama-2-7B shape, fp16)")
    a = ap.parse_args()

    rows = load_rows(a.table)
    by = {(r["workload"], r["system"]): r["tok_per_s"] for r in rows}
    workloads = list(dict.fromkeys(r["workload"] for r in rows if r["system"] == "kvshare"))
    panels = 1 + (a.shared is not None) + (a.fullstack is not None)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [2] + [1] * (panels - 1)})
    axes = axes[0]
    _bars(axes[0], workloads, {
        "kvshare": [by.get((w, "kvshare")) for w in workloads],
        "HF generate": [by.get((w, "hf-generate")) for w in workloads],
        "HF generate_batch": [by.get((w, "hf-generate_batch")) for w in workloads],
    }, "offline, same requests in one process", log=True)
    k = 1
    if a.shared is not None:
        shared = {r["system"].split(" (")[0]: r["tok_per_s"] for r in load_rows(a.shared)}
        on, off = shared.get("kvshare"), shared.get("kvshare-no-sharing")
        _bars(axes[k], ["sharing off", "sharing + cascade"], {"kvshare": [off, on]},
              f"shared-prefix, 1,024 requests ({on / off:.2f}x)" if on and off else "shared-prefix")
        k += 1
    if a.fullstack is not None:
        summary = json.loads(a.fullstack.read_text())
        names = {"offline engine": "offline", "perf_analyzer": "perf_analyzer",
                 "kvshare_client (4 processes)": "client x4", "kvshare_client (1 process)": "client x1"}
        labels, values = [], []
        for row in summary["rows"]:
            short = next((v for key, v in names.items() if key in row["path"]), None)
            if short is not None:
                labels.append(short)
                values.append(row["server_tok_per_s"])
        _bars(axes[k], labels, {"server tok/s": values}, "whole stack, Triton gRPC streaming, c = 64")
    fig.suptitle(a.title, fontsize=11)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
