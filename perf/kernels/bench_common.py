"""Timing and table helpers shared by the kernel benchmarks.

On CUDA a time is triton.testing.do_bench's median (events, L2 flushed before every call). With
--dry-run (no GPU: checks the benchmark's own code at tiny shapes under the Triton interpreter)
it is one wall-clock call and the numbers mean nothing.
"""

from __future__ import annotations

import json
import os
import time

import torch

DRY_RUN = False


def set_dry_run(flag: bool) -> None:
    global DRY_RUN
    DRY_RUN = flag
    if flag:
        os.environ["TRITON_INTERPRET"] = "1"     # before the kernels are imported


def device() -> str:
    return "cpu" if DRY_RUN else "cuda"


def bench(fn, rep_ms: int = 100) -> float:
    """Median seconds of fn()."""
    if DRY_RUN:
        fn()
        t = time.perf_counter()
        fn()
        return max(time.perf_counter() - t, 1e-9)
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e-3


def free() -> None:
    if not DRY_RUN:
        torch.cuda.empty_cache()


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy, bytes read + written per second (the 4.3 TB/s of environment.md)."""
    n = int(gib * 2**30) // 2 if not DRY_RUN else 1 << 16
    src = torch.empty(n, dtype=torch.bfloat16, device=device()).normal_()
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    del src, dst
    free()
    return 2 * n * 2 / t


def print_table(title: str, header: list[str], rows: list[list], out=None) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(str(x) for x in r) + " |")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")
    return text


def dump_json(path: str | None, obj) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
