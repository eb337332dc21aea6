"""perf/engine/offline_benchmark.py's JSON rows as one Markdown table with ratios and ceilings.

    python -m perf.report.engine_table perf/results/engine/DATE/table.json [--md table.md]

(the `engine` suite of `python -m perf.gpu` runs it on its table.json)

Ceiling (benchmarks.md's physical limit, Llama-2-7B fp16 on one H200): prefill at 790 TFLOP/s
(2 x 6.74e9 FLOPs per prompt token) plus, per decode step, the weights (13.2 GB) and the batch's
KV at its mean context read at 4.4 TB/s. It reproduces benchmarks.md's 3,600 / 11,400 / 19,300
tok/s at 12 / 64 / 256 concurrent 128 -> 128 requests.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

PARAMS, WEIGHT_BYTES, KV_BYTES_PER_TOKEN = 6.74e9, 13.2e9, 524288      # Llama-2-7B, fp16
FLOPS, BANDWIDTH = 790e12, 4.4e12
SHAPES = {"fixed-1": (1, 128), "seed-12x128": (12, 128), "seed-hot10": (12, 128), "seed-long": (12, 1024),
          "fixed-64": (64, 128), "fixed-256": (256, 128)}        # (concurrency, prompt tokens); 128 out


def ceiling_tok_s(concurrency: int, prompt: int, out: int = 128) -> float:
    prefill = 2 * PARAMS * concurrency * prompt / FLOPS
    decode = out * (WEIGHT_BYTES + concurrency * (prompt + out / 2) * KV_BYTES_PER_TOKEN) / BANDWIDTH
    return concurrency * out / (prefill + decode)


def table(rows: list[dict]) -> str:
    by = {(r["workload"], r["system"]): r for r in rows}
    lines = ["| workload | system | tok/s | TTFT p50 / p95 ms | peak KV GB | prefix hit | vs HF generate | "
             "vs HF generate_batch | vs no sharing | % of ceiling |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def no_sharing_ratio(r):
        """Against the no-sharing row with the same settings."""
        return ratio(r, r["system"].replace("kvshare", "kvshare-no-sharing", 1))

    def ratio(r, system):
        b = by.get((r["workload"], system))
        return f"{r['tok_per_s'] / b['tok_per_s']:.2f}×" if b and b is not r else ""

    for r in rows:
        shape = SHAPES.get(r["workload"])
        ceil = f"{100 * r['tok_per_s'] / ceiling_tok_s(*shape):.0f}% of {ceiling_tok_s(*shape):,.0f}" \
            if shape and r["system"].startswith("kvshare") else ""
        ttft = "" if r["ttft_p50_ms"] is None else f"{r['ttft_p50_ms']:,.0f} / {r['ttft_p95_ms']:,.0f}"
        kv = "" if r.get("peak_kv_gb") is None else f"{r['peak_kv_gb']:.1f}"
        hit = "" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.0%}"
        # "kvshare (settings)" rows compare like "kvshare"; a bf16 row has no same-dtype baseline
        base_system, _, settings = r["system"].partition(" (")
        kvs = base_system in ("kvshare", "kvshare-no-sharing") and "bf16" not in settings
        lines.append(f"| {r['workload']} | {r['system']} | {r['tok_per_s']:,.0f} | {ttft} | {kv} | {hit} | "
                     f"{ratio(r, 'hf-generate') if kvs else ''} | {ratio(r, 'hf-generate_batch') if kvs else ''} | "
                     f"{no_sharing_ratio(r) if kvs and base_system == 'kvshare' else ''} | {ceil} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", type=Path)
    ap.add_argument("--md", type=Path, default=None, help="also write the table here")
    a = ap.parse_args()
    rows: list[dict] = []
    for path in a.json:
        for r in json.loads(path.read_text()):
            r.setdefault("workload", "?")
            if "bf16" in path.name:
                r["system"] += " (bf16)"
            rows.append(r)
    md = table(rows)
    print(md)
    if a.md:
        a.md.parent.mkdir(parents=True, exist_ok=True)
        a.md.write_text(md + "\n")


if __name__ == "__main__":
    main()
