"""Paged prefill (varlen extend) attention: TFLOP/s, side by side with torch SDPA (causal) on
contiguous Q/K/V.

    python perf/kernels/bench_prefill_attention.py [--sweep] [--json F] [--md F] [--dry-run]

FLOPs counted = 4 * Hq * D * (visible query-key pairs), the causal half only, for both sides.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.kernels import bench_common as bc  # noqa: E402

D = 128
DTYPE = torch.bfloat16
HEADS = [(32, 8), (32, 32)]
# (name, batch, prefix tokens already cached, new tokens per request)
CASES = [("prompt 1x4096", 1, 0, 4096), ("prompt 8x1024", 8, 0, 1024), ("prompt 4x8192", 4, 0, 8192),
         ("extend 4x(2048+512)", 4, 2048, 512), ("chunk 1x(8192+2048)", 1, 8192, 2048)]
PAGE_SIZES = [16, 64]
SWEEP = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s) for bm, bn, w, s in
         [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4),
          (128, 128, 8, 2), (128, 32, 8, 3), (64, 128, 4, 2)]]   # (128, 64, 4, *) spills (ptxas -v)


def flops(hq, b, prefix, q_len):
    return 4 * hq * D * b * (q_len * prefix + q_len * (q_len + 1) / 2)


def time_kvshare(hq, hkv, b, prefix, q_len, page_size, **cfg):
    from kvshare_kernels import kernels
    dev = bc.device()
    ctx = prefix + q_len
    pages_per = math.ceil(ctx / page_size)
    k = torch.empty(b * pages_per, page_size, hkv, D, dtype=DTYPE, device=dev).normal_()
    v = torch.empty_like(k).normal_()
    pt = torch.randperm(b * pages_per, device=dev).to(torch.int32).view(b, pages_per).contiguous()
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, b + 1, dtype=torch.int32, device=dev) * q_len
    q = torch.randn(b * q_len, hq, D, dtype=DTYPE, device=dev)
    out = torch.empty_like(q)
    tiles = bc.prefill_tiles(hq, hkv, b, q_len, ctx, dev, cfg.get("block_m"), page_size=page_size)  # the engine's
    fn = lambda: kernels.paged_prefill_attention(q, k, v, pt, qsl, lens, D ** -0.5, out,  # noqa: E731
                                                 tiles=tiles, **cfg)
    try:
        t = bc.bench(fn)
    except Exception as e:
        print(f"  failed {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        t = float("nan")
    del k, v, q, out
    bc.free()
    return t


def time_sdpa(hq, hkv, b, prefix, q_len):
    dev = bc.device()
    q = torch.randn(b, hq, q_len, D, dtype=DTYPE, device=dev)
    k = torch.randn(b, hkv, prefix + q_len, D, dtype=DTYPE, device=dev)
    v = torch.randn_like(k)
    if prefix == 0:
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)  # noqa: E731
    else:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(q_len, prefix + q_len)
        kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        fn = lambda: F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)  # noqa: E731
    try:
        t = bc.bench(fn)
    except Exception as e:
        print(f"  sdpa failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        t = float("nan")
    del q, k, v
    bc.free()
    return t


def shrink(b, prefix, q_len):
    return (min(b, 2), min(prefix, 16), min(q_len, 24)) if bc.DRY_RUN else (b, prefix, q_len)


def table(md=None):
    rows, res = [], []
    for (hq, hkv), (name, b, prefix, q_len) in itertools.product(HEADS, CASES):
        b, prefix, q_len = shrink(b, prefix, q_len)
        fl = flops(hq, b, prefix, q_len)
        ts = {ps: time_kvshare(hq, hkv, b, prefix, q_len, ps) for ps in PAGE_SIZES}
        t_sdpa = time_sdpa(hq, hkv, b, prefix, q_len)
        row = [f"{hq}/{hkv}", name] + [f"{fl / ts[ps] / 1e12:.0f}" for ps in PAGE_SIZES]
        row += [f"{fl / t_sdpa / 1e12:.0f}", f"{t_sdpa / ts[PAGE_SIZES[0]]:.2f}"]
        rows.append(row)
        res.append(dict(hq=hq, hkv=hkv, case=name, flops=fl, sdpa_s=t_sdpa, **{f"kvshare_p{p}_s": t for p, t in ts.items()}))
        print("  " + " | ".join(row), flush=True)
    header = ["heads", "case"] + [f"kvshare p{p} TFLOP/s" for p in PAGE_SIZES] + ["SDPA TFLOP/s", "p16/SDPA"]
    bc.print_table("paged prefill attention, bf16, head_dim 128, causal FLOPs", header, rows, md)
    return res


def sweep(md=None, shape=(1, 0, 4096), heads=HEADS):
    rows, res = [], []
    for (hq, hkv) in heads:
        b, prefix, q_len = shrink(*shape)
        for cfg in (SWEEP if not bc.DRY_RUN else SWEEP[:2]):
            t = time_kvshare(hq, hkv, b, prefix, q_len, 16, **cfg)
            rows.append([f"{hq}/{hkv} {b}x({prefix}+{q_len}) p16", str(cfg), f"{flops(hq, b, prefix, q_len) / t / 1e12:.0f}",
                         f"{t * 1e3:.3f}"])
            res.append(dict(hq=hq, hkv=hkv, cfg=cfg, s=t))
            print("  " + " | ".join(rows[-1]), flush=True)
    bc.print_table("prefill tile sweep (TFLOP/s)", ["shape", "config", "TFLOP/s", "ms"], rows, md)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-shape", default="1,0,4096", help="batch,prefix,new tokens of the sweep (fixed-256's "
                    "prefill chunks: 32,0,128)")
    ap.add_argument("--sweep-only", action="store_true", help="skip the table")
    ap.add_argument("--mha-only", action="store_true", help="32/32 heads only (Llama-2-7B)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    bc.set_dry_run(a.dry_run)
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("bench_prefill_attention: needs a CUDA GPU (or --dry-run)")
    out = {}
    heads = [(32, 32)] if a.mha_only else HEADS
    if a.sweep:
        out["sweep"] = sweep(a.md, tuple(int(x) for x in a.sweep_shape.split(",")), heads)
    if not a.sweep_only:
        out["table"] = table(a.md)
    bc.dump_json(a.json, out)


if __name__ == "__main__":
    main()
