"""Paged decode attention: achieved HBM bandwidth (K+V bytes read / median time), side by side with
torch's scaled_dot_product_attention on contiguous K/V (the unpaged best case) and a device copy.

    PYTHONPATH=src python perf/kernels/bench_decode_attention.py [--sweep] [--table] [--json F] [--md F]
    PYTHONPATH=src python perf/kernels/bench_decode_attention.py --dry-run   # CPU: checks this script only

Heads: Llama-3-8B (32 q / 8 kv) and Llama-2-7B (32 / 32), head_dim 128, bf16; batch 1/16/64/256 x
context 512/2k/8k; page sizes 16 and 64; pages shuffled in the pool (a fragmented pool, as after
hours of serving). The bar: the public Triton paged decode kernel shared by vLLM/SGLang measured
3.5 TB/s (32/8, 64 x 2k) and 2.9 (32/32) on the same H200 (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys

import torch
import torch.nn.functional as F

import bench_common as bc

D = 128
DTYPE = torch.bfloat16
HEADS = [(32, 8), (32, 32)]
BATCHES = [1, 16, 64, 256]
CONTEXTS = [512, 2048, 8192]
PAGE_SIZES = [16, 64]
MAX_BYTES = 40e9


def kv_bytes(b, hkv, ctx):
    return 2 * b * ctx * hkv * D * DTYPE.itemsize


def make_paged(b, hq, hkv, ctx, page_size, dev):
    pages_per = math.ceil(ctx / page_size)
    num_pages = b * pages_per
    k = torch.empty(num_pages, page_size, hkv, D, dtype=DTYPE, device=dev).normal_()
    v = torch.empty_like(k).normal_()
    pt = torch.randperm(num_pages, device=dev).to(torch.int32).view(b, pages_per).contiguous()
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, D, dtype=DTYPE, device=dev)
    return q, k, v, pt, lens


def time_kvshare(b, hq, hkv, ctx, page_size, rep_ms=100, **cfg):
    from kvshare_kernels import kernels
    q, k, v, pt, lens = make_paged(b, hq, hkv, ctx, page_size, bc.device())
    out = torch.empty_like(q)
    fn = lambda: kernels.paged_decode_attention(q, k, v, pt, lens, D ** -0.5, out, max_context=ctx, **cfg)  # noqa: E731
    try:
        t = bc.bench(fn, rep_ms=rep_ms)
    except Exception as e:   # a config out of resources (shared memory) is a result, not a crash
        print(f"  failed {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        t = float("nan")
    del q, k, v, pt, lens, out
    bc.free()
    return t


def time_sdpa(b, hq, hkv, ctx):
    """Best of two ways to run GQA decode through SDPA on contiguous [B, H, L, D] K/V."""
    dev = bc.device()
    q = torch.randn(b, hq, 1, D, dtype=DTYPE, device=dev)
    k = torch.empty(b, hkv, ctx, D, dtype=DTYPE, device=dev).normal_()
    v = torch.empty_like(k).normal_()
    ways = {"gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv)}
    if hq != hkv:   # the G query heads of a KV head as G query rows: one pass over K/V per KV head
        qf = q.view(b, hkv, hq // hkv, D)
        ways["fold"] = lambda: F.scaled_dot_product_attention(qf, k, v)
    best = min((bc.bench(fn), name) for name, fn in ways.items())
    del q, k, v
    bc.free()
    return best


def table(md=None):
    from kvshare_kernels.decode_attention import choose_num_splits
    rows, results = [], []
    copy_bw = bc.copy_bandwidth()
    print(f"device copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s", flush=True)
    for (hq, hkv), b, ctx in itertools.product(HEADS, BATCHES, CONTEXTS):
        nbytes = kv_bytes(b, hkv, ctx)
        if nbytes > MAX_BYTES:
            continue
        if bc.DRY_RUN:
            b, ctx = min(b, 2), min(ctx, 64)
            nbytes = kv_bytes(b, hkv, ctx)
        ts = {ps: time_kvshare(b, hq, hkv, ctx, ps) for ps in PAGE_SIZES}
        t_sdpa, how = time_sdpa(b, hq, hkv, ctx)
        bw = {ps: nbytes / t / 1e12 for ps, t in ts.items()}
        bw_sdpa = nbytes / t_sdpa / 1e12
        splits = choose_num_splits(b, hkv, ctx, torch.device(bc.device()))
        row = [f"{hq}/{hkv}", b, ctx, f"{nbytes / 1e9:.2f}"]
        row += [f"{bw[ps]:.2f}" for ps in PAGE_SIZES] + [f"{bw_sdpa:.2f} ({how})"]
        row += [f"{bw[ps] / bw_sdpa:.2f}" for ps in PAGE_SIZES] + [f"{ts[PAGE_SIZES[0]] * 1e6:.1f}", splits]
        rows.append(row)
        results.append(dict(hq=hq, hkv=hkv, batch=b, ctx=ctx, bytes=nbytes, sdpa_s=t_sdpa, sdpa_how=how,
                            splits=splits, **{f"kvshare_p{ps}_s": t for ps, t in ts.items()}))
        print("  " + " | ".join(str(x) for x in row), flush=True)
    header = ["heads q/kv", "batch", "ctx", "K+V GB"] + [f"kvshare p{ps} TB/s" for ps in PAGE_SIZES]
    header += ["SDPA TB/s"] + [f"p{ps}/SDPA" for ps in PAGE_SIZES] + [f"p{PAGE_SIZES[0]} us", "splits"]
    bc.print_table(f"paged decode attention, bf16, head_dim 128 (copy {copy_bw / 1e12:.2f} TB/s)", header, rows, md)
    return dict(copy_bw=copy_bw, rows=results)


def sweep(md=None):
    """Tile configs on representative shapes, then split counts with the best tile config."""
    res = {"tiles": [], "splits": []}
    tiles = [dict(block_n=bn, num_warps=w, num_stages=s) for bn, w, s in itertools.product([32, 64, 128], [4, 8], [2, 3])]
    shapes = [(32, 8, 64, 2048, 16), (32, 8, 64, 2048, 64), (32, 32, 64, 2048, 16)]
    if bc.DRY_RUN:
        tiles, shapes = tiles[:2], [(4, 2, 2, 64, 16), (2, 2, 2, 64, 16)]
    rows = []
    score = {}
    for hq, hkv, b, ctx, ps in shapes:
        variants = [dict(t) for t in tiles]
        if hq == hkv:
            variants += [dict(t, use_dot=False) for t in tiles]
        for cfg in variants:
            t = time_kvshare(b, hq, hkv, ctx, ps, rep_ms=50, **cfg)
            bw = kv_bytes(b, hkv, ctx) / t / 1e12
            rows.append([f"{hq}/{hkv} {b}x{ctx} p{ps}", str(cfg), f"{bw:.2f}"])
            res["tiles"].append(dict(hq=hq, hkv=hkv, batch=b, ctx=ctx, page=ps, cfg=cfg, s=t))
            if cfg.get("use_dot", True) and not math.isnan(bw):
                key = tuple(sorted(cfg.items()))
                score[key] = score.get(key, 0.0) + math.log(bw)
            print("  " + " | ".join(rows[-1]), flush=True)
    bc.print_table("decode tile sweep (TB/s)", ["shape", "config", "TB/s"], rows, md)
    best = dict(max(score.items(), key=lambda kv: kv[1])[0]) if score else {}
    print(f"best tile config (geomean over shapes): {best}", flush=True)

    rows = []
    split_shapes = [(32, 8, 1, 8192), (32, 8, 1, 512), (32, 8, 16, 2048), (32, 8, 16, 512), (32, 32, 1, 8192),
                    (32, 32, 16, 2048), (32, 8, 64, 2048), (32, 8, 64, 8192)]
    splits_list = [1, 2, 4, 8, 16, 32]
    if bc.DRY_RUN:
        split_shapes, splits_list = [(4, 2, 1, 64)], [1, 2]
    from kvshare_kernels.decode_attention import choose_num_splits
    for hq, hkv, b, ctx in split_shapes:
        cells = []
        for s in splits_list:
            t = time_kvshare(b, hq, hkv, ctx, 16, rep_ms=50, num_splits=s, **best)
            cells.append(kv_bytes(b, hkv, ctx) / t / 1e12)
            res["splits"].append(dict(hq=hq, hkv=hkv, batch=b, ctx=ctx, splits=s, cfg=best, s=t))
        h = choose_num_splits(b, hkv, ctx, torch.device(bc.device()), best.get("block_n", 64))
        rows.append([f"{hq}/{hkv} {b}x{ctx}"] + [f"{x:.2f}" for x in cells] + [h])
        print("  " + " | ".join(str(x) for x in rows[-1]), flush=True)
    bc.print_table(f"split-K sweep, page 16, {best} (TB/s)", ["shape"] + [f"S={s}" for s in splits_list]
                   + ["heuristic S"], rows, md)
    res["best"] = best
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="tile and split-K sweeps")
    ap.add_argument("--table", action="store_true", help="the main table (default when nothing is chosen)")
    ap.add_argument("--json", help="write all timings here")
    ap.add_argument("--md", help="append the markdown tables here")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (interpreter): checks the script")
    a = ap.parse_args(argv)
    bc.set_dry_run(a.dry_run)
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("bench_decode_attention: needs a CUDA GPU (or --dry-run)")
    if not a.dry_run:
        print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
              f"triton {__import__('triton').__version__}", flush=True)
    out = {}
    if a.sweep:
        out["sweep"] = sweep(a.md)
    if a.table or not a.sweep:
        out["table"] = table(a.md)
    bc.dump_json(a.json, out)


if __name__ == "__main__":
    main()
