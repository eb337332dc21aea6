"""How close each server came to what the GPU allows on the serving points: a roofline per point.

    python -m perf.peer.serving_ceiling perf/results/peer-serving/DATE/.../serving.json [--gpu H100] [--md F]

For a closed-loop point of a trace without shared prefixes (the `mixed` points), with c requests
always in flight: every prompt token costs 2 x parameters FLOPs at the GPU's dense fp16 peak, and
every output token its share of one decode step, which reads the weights once for the c sequences
and each sequence's K/V at its context then (the token-weighted mean over the trace's outputs), at
the GPU's peak memory bandwidth, or the step's FLOPs, whichever takes longer. The model's counts are
the engine table's (Llama-2-7B fp16). Datasheet peaks, not measured rates: the result is a bound no
server can pass at 16-bit weights and KV. It answers whether "1.2x the peer" is reachable at a point:
the table gives what 1.2x the peer's throughput would be as a share of that bound, and the bound
with fp8 KV pages (half the K/V bytes).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from perf.core.workload_traces import make_trace
from perf.report.engine_table import KV_BYTES_PER_TOKEN, PARAMS, WEIGHT_BYTES


@dataclass(frozen=True)
class Roofline:
    """A GPU's datasheet peaks: memory bandwidth (bytes/s) and dense fp16 tensor FLOP/s."""
    name: str
    bandwidth: float
    flops: float


ROOFLINES = {"H100": Roofline("H100 SXM", 3.35e12, 989e12), "H200": Roofline("H200", 4.8e12, 989e12)}


@dataclass(frozen=True)
class ModelShape:
    """What a step computes per token and reads: Llama-2-7B in fp16 by default, as the engine table
    counts it (perf/report/engine_table.py)."""
    flops_per_token: float = 2 * PARAMS
    weight_bytes: float = WEIGHT_BYTES
    kv_bytes_per_token: float = KV_BYTES_PER_TOKEN


KV8 = ModelShape(kv_bytes_per_token=KV_BYTES_PER_TOKEN / 2)     # fp8 e4m3 pages: one byte per element


def closed_loop_ceiling(prompts: list[int], outputs: list[int], concurrency: int, gpu: Roofline,
                        shape: ModelShape = ModelShape()) -> float:
    """Output tok/s no server can pass on these requests with `concurrency` always in flight."""
    tokens = sum(outputs)
    mean_ctx = sum(p * o + o * (o - 1) / 2 for p, o in zip(prompts, outputs)) / tokens
    prefill_s = shape.flops_per_token * sum(prompts) / gpu.flops
    step_bytes = shape.weight_bytes + concurrency * mean_ctx * shape.kv_bytes_per_token
    step_s = max(step_bytes / gpu.bandwidth, shape.flops_per_token * concurrency / gpu.flops)
    return tokens / (prefill_s + tokens * step_s / concurrency)


def gpu_of(report: dict, override: str | None) -> Roofline:
    text = override or " ".join(report.get("info", []))
    for key, roof in ROOFLINES.items():
        if key in text:
            return roof
    raise SystemExit(f"serving_ceiling: no known GPU in {text[:80]!r}: pass --gpu {'|'.join(ROOFLINES)}")


def rows(report: dict, gpu: Roofline) -> list[dict]:
    out = []
    for p in report["points"]:
        if p["loop"] != "closed" or not p["trace"].startswith("mixed"):
            continue
        reqs = make_trace(p["trace"]).requests[: p["requests"]]
        prompts, outputs = [len(r.prompt_ids) for r in reqs], [r.max_new_tokens for r in reqs]
        ceiling = closed_loop_ceiling(prompts, outputs, p["concurrency"], gpu)
        k, v = p["kvshare"]["sustained_tok_per_s"], p["vllm"]["sustained_tok_per_s"]
        out.append(dict(point=p["point"], concurrency=p["concurrency"], ceiling=ceiling, kvshare=k, vllm=v,
                        kvshare_share=k / ceiling, vllm_share=v / ceiling, goal_share=1.2 * v / ceiling,
                        ceiling_kv8=closed_loop_ceiling(prompts, outputs, p["concurrency"], gpu, KV8)))
    return out


def markdown(rs: list[dict], gpu: Roofline) -> str:
    lines = [f"Roofline per closed-loop mixed point ({gpu.name}: {gpu.bandwidth / 1e12:.2f} TB/s, "
             f"{gpu.flops / 1e12:.0f} TFLOP/s; perf/peer/serving_ceiling.py)", "",
             "| point | in flight | ceiling tok/s | kvshare tok/s (share) | vLLM tok/s (share) | 1.2x vLLM as a share | "
             "ceiling with fp8 KV pages |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rs:
        lines.append(f"| {r['point']} | {r['concurrency']} | {r['ceiling']:,.0f} | {r['kvshare']:,.0f} "
                     f"({r['kvshare_share']:.0%}) | {r['vllm']:,.0f} ({r['vllm_share']:.0%}) | {r['goal_share']:.0%} | "
                     f"{r['ceiling_kv8']:,.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", type=Path, help="serving.json of perf.peer.serving_report")
    ap.add_argument("--gpu", choices=sorted(ROOFLINES), default=None, help="default: the report's GPU line")
    ap.add_argument("--md", type=Path, default=None)
    a = ap.parse_args(argv)
    report = json.loads(a.report.read_text())
    gpu = gpu_of(report, a.gpu)
    text = markdown(rows(report, gpu), gpu)
    print(text)
    if a.md:
        a.md.write_text(text + "\n")


if __name__ == "__main__":
    main()
