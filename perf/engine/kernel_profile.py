"""Kernel time by category for the perf/engine profilers: one torch.profiler pass over a callable."""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

CATEGORIES = (  # first match wins; names of cuBLAS/cutlass GEMMs vary by version
    ("cascade prefix", ("_cascade_prefix",)),
    ("cascade merge", ("_cascade_merge",)),
    ("cascade suffix table", ("_suffix_table",)),
    ("attention", ("_decode_split", "_decode_merge", "_prefill_kernel")),
    ("kv_write", ("_write_kv",)),
    ("norm", ("_rms_norm",)),
    ("rotary (+kv_write)", ("_rotary",)),   # on CUDA the engine fuses the KV write into the rotary
    ("gemm", ("gemm", "sm90", "cutlass", "xmma", "nvjet", "cublas")),
    ("silu_mul", ("silu", "mul")),
    ("argmax/copy", ("argmax", "reduce", "copy", "index", "cat", "fill", "embedding")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k.lower() in low for k in keys):
            return cat
    return "other"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def kernel_table(fn: Callable[[], object], device: torch.device, reps: int = 3, warm: bool = True) -> dict:
    """Time per call of fn by category and its top kernels: CUDA time on the GPU, CPU op time on the
    CPU (dry runs). warm: one untimed call first (compiles, allocator)."""
    if warm:
        fn()
    sync(device)
    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        sync(device)
    per_cat: dict[str, float] = defaultdict(float)
    kernels = []
    for e in prof.key_averages():
        t = (e.device_time_total if device.type == "cuda" else e.self_cpu_time_total) / reps / 1e3
        if t <= 0:
            continue
        per_cat[category(e.key)] += t
        kernels.append((t, e.count // reps, e.key[:90]))
    kernels.sort(reverse=True)
    return {"ms_by_category": {k: round(v, 3) for k, v in sorted(per_cat.items(), key=lambda x: -x[1])},
            "ms_total": round(sum(per_cat.values()), 3),
            "top_kernels": [{"ms": round(t, 4), "calls": c, "name": n} for t, c, n in kernels[:25]]}


def print_kernel_table(title: str, table: dict, top: int = 15) -> None:
    print(f"\n== {title}")
    for k, v in table["ms_by_category"].items():
        print(f"   {k:22s} {v:8.3f} ms")
    for k in table["top_kernels"][:top]:
        print(f"   {k['ms']:8.4f} ms x{k['calls']:4d}  {k['name']}")


def host_profile(fn: Callable[[], object], reps: int, top: int = 30) -> list[dict]:
    """Python functions by own time over reps calls of fn (cProfile): where a step's host time goes.
    Time blocked on the device shows up in the waiting call (an event's synchronize, a blocking copy)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():
        rows.append({"own_ms": round(1e3 * own / reps, 3), "cum_ms": round(1e3 * cum / reps, 3),
                     "calls": round(calls / reps, 1), "where": f"{file.rsplit('/', 2)[-1]}:{line}({name})"})
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:top]


def print_host_profile(title: str, rows: list[dict]) -> None:
    print(f"\n== {title} (per call: own ms, cumulative ms, calls)")
    for r in rows:
        print(f"   {r['own_ms']:8.3f} {r['cum_ms']:8.3f} x{r['calls']:7.1f}  {r['where']}")


def save_json(out_dir, name: str, result: dict) -> None:
    """result as out_dir/name (a profiler's --out); nothing when out_dir is None."""
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(json.dumps(result, indent=1))
