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


def bench_graph(fn, rep_ms: int = 100) -> float:
    """Median seconds of one replay of fn captured in a CUDA graph, L2 flushed before each replay.

    This is the GPU time alone, as the engine sees it when it replays its decode step as a graph;
    an eager call of a short kernel measures the host's launch cost instead (bench() shows that).
    """
    if DRY_RUN:
        return bench(fn)
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    n = int(min(1000, max(10, rep_ms / max(start.elapsed_time(end) / 5, 1e-3))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush.zero_()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    del graph, flush
    return times[n // 2] * 1e-3


def host_overhead(fn, n: int = 200) -> float:
    """Seconds of host time per eager call (launch cost), GPU work queued behind."""
    fn()
    if DRY_RUN:
        n = 2
    else:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t
    if not DRY_RUN:
        torch.cuda.synchronize()
    return t / n


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


def step_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor, prefix: int, ctx: int,
            hq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's last ctx - prefix tokens of K and V, read from the pool through its page table,
    laid out as the engine's step holds them: views [T, Hkv, D] of a fused projection
    [T, (hq + 2 Hkv) * D] (the prefill kernel's k_new / v_new), the pool's very values."""
    _, ps, hkv, d = k_pool.shape
    b = page_table.shape[0]
    pos = torch.arange(prefix, ctx, device=k_pool.device)
    pages = page_table[:, pos // ps].long()            # [B, q_len]
    slots = (pos % ps).expand(b, -1)
    t = b * (ctx - prefix)
    qkv = torch.empty(t, (hq + 2 * hkv) * d, dtype=k_pool.dtype, device=k_pool.device)
    k_new = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v_new = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    k_new.copy_(k_pool[pages, slots].reshape(t, hkv, d))
    v_new.copy_(v_pool[pages, slots].reshape(t, hkv, d))
    return k_new, v_new


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


def prefill_tiles(hq: int, hkv: int, b: int, q_len: int, ctx: int, dev, block_m: int | None = None,
                  longest_first: bool = False, page_size: int = 16, new_kv: bool = False):
    """The prefill kernel's work list for b requests of q_len new tokens after ctx - q_len cached
    ones, as the engine builds it (runtime/forward_batch.py): benchmarks time the launch it runs.
    block_m None: the kernel's default launch for a bf16 pool of this page size (head_dim 128),
    with the step's own K/V given or not (new_kv)."""
    import numpy as np
    from kvshare_kernels.prefill_attention import default_launch
    from kvshare_kernels.prefill_tiles import plan_tiles, tokens_per_tile

    block_m = block_m or default_launch(page_size, torch.bfloat16, 128, torch.device(dev), new_kv=new_kv).block_m

    tiles = plan_tiles(np.full(b, q_len), np.full(b, ctx), tokens_per_tile(hq, hkv, block_m),
                       longest_first=longest_first)
    return torch.from_numpy(tiles).to(dev)
