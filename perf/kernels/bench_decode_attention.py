"""Paged decode attention: achieved HBM bandwidth (K+V bytes read / median time), side by side with
torch's scaled_dot_product_attention on contiguous K/V (the unpaged best case) and a device copy.

    python perf/kernels/bench_decode_attention.py [--sweep] [--table] [--kv-dtypes] [--json F] [--md F]
    python perf/kernels/bench_decode_attention.py --dry-run   # CPU: checks this script only

Heads: Llama-3-8B (32 q / 8 kv) and Llama-2-7B (32 / 32), head_dim 128, bf16; batch 1/16/64/256 x
context 512/2k/8k; page sizes 16 and 64; pages shuffled in the pool (a fragmented pool, as after
hours of serving). --kv-dtypes times the same kernel on bf16, fp8 e4m3 and int8 pages (bytes actually
read: 8-bit K/V plus int8's float32 scale per token and KV head), and the 8-bit pages again under
other tiles (KV8_VARIANTS). The bar: the public Triton paged decode kernel shared by vLLM/SGLang measured
3.5 TB/s (32/8, 64 x 2k) and 2.9 (32/32) on the same H200 (docs/develop/kernels.md).
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


def time_kvshare(b, hq, hkv, ctx, page_size, rep_ms=100, eager=False, **cfg):
    """Median seconds: GPU time (graph replay), and with eager=True also the eager call's time."""
    from kvshare_kernels import kernels
    q, k, v, pt, lens = make_paged(b, hq, hkv, ctx, page_size, bc.device())
    out = torch.empty_like(q)
    fn = lambda: kernels.paged_decode_attention(q, k, v, pt, lens, D ** -0.5, out, max_context=ctx, **cfg)  # noqa: E731
    try:
        t = bc.bench_graph(fn, rep_ms=rep_ms)
        t_eager = bc.bench(fn, rep_ms=rep_ms) if eager else None
    except Exception as e:   # a config out of resources (shared memory) is a result, not a crash
        print(f"  failed {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        t = t_eager = float("nan")
    del q, k, v, pt, lens, out
    bc.free()
    return (t, t_eager) if eager else t


def heuristic_splits(b, hq, hkv, ctx):
    from kvshare_kernels.decode_attention import choose_num_splits, default_config
    cfg = default_config(hq, hkv)     # 16-bit pages
    return choose_num_splits(b, hkv // cfg["heads_per_program"], ctx, torch.device(bc.device()), cfg["block_n"])


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
    best = (float("inf"), "")
    for name, fn in ways.items():
        try:
            best = min(best, (bc.bench_graph(fn), name))
        except Exception as e:      # not capturable: time it eagerly and say so
            print(f"  sdpa {name} in a graph failed ({type(e).__name__}), eager", flush=True)
            best = min(best, (bc.bench(fn), name + " eager"))
    del q, k, v
    bc.free()
    return best


def table(md=None):
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
        ts, eager = {}, None
        for ps in PAGE_SIZES:
            if ps == PAGE_SIZES[0]:
                ts[ps], eager = time_kvshare(b, hq, hkv, ctx, ps, eager=True)
            else:
                ts[ps] = time_kvshare(b, hq, hkv, ctx, ps)
        t_sdpa, how = time_sdpa(b, hq, hkv, ctx)
        bw = {ps: nbytes / t / 1e12 for ps, t in ts.items()}
        bw_sdpa = nbytes / t_sdpa / 1e12
        splits = heuristic_splits(b, hq, hkv, ctx)
        row = [f"{hq}/{hkv}", b, ctx, f"{nbytes / 1e9:.2f}"]
        row += [f"{bw[ps]:.2f}" for ps in PAGE_SIZES] + [f"{bw_sdpa:.2f} ({how})"]
        row += [f"{bw[ps] / bw_sdpa:.2f}" for ps in PAGE_SIZES]
        row += [f"{ts[PAGE_SIZES[0]] * 1e6:.1f}", f"{eager * 1e6:.1f}", splits]
        rows.append(row)
        results.append(dict(hq=hq, hkv=hkv, batch=b, ctx=ctx, bytes=nbytes, sdpa_s=t_sdpa, sdpa_how=how,
                            splits=splits, eager_p16_s=eager, **{f"kvshare_p{ps}_s": t for ps, t in ts.items()}))
        print("  " + " | ".join(str(x) for x in row), flush=True)
    header = ["heads q/kv", "batch", "ctx", "K+V GB"] + [f"kvshare p{ps} TB/s" for ps in PAGE_SIZES]
    header += ["SDPA TB/s"] + [f"p{ps}/SDPA" for ps in PAGE_SIZES]
    header += [f"p{PAGE_SIZES[0]} us", f"p{PAGE_SIZES[0]} eager us", "splits"]
    bc.print_table(f"paged decode attention, bf16, head_dim 128 (copy {copy_bw / 1e12:.2f} TB/s)", header, rows, md)
    return dict(copy_bw=copy_bw, rows=results)


KV_DTYPE_SHAPES = [(32, 8, 64, 2048), (32, 8, 256, 2048), (32, 8, 16, 8192), (32, 32, 64, 2048), (32, 32, 256, 2048)]
# Tiles for 8-bit pages beside their defaults (GQA: 128 tokens, 4 warps; MHA: 4 KV heads per program,
# 32 tokens): a tile of 8-bit K/V holds half the bytes, so longer tiles or more KV heads per program
# pay off where they did not for 16-bit. The first variant of each is the 16-bit tile.
KV8_VARIANTS = {
    "gqa": [dict(block_n=64, num_warps=4), dict(block_n=128, num_warps=8), dict(block_n=64, num_warps=8),
            dict(block_n=128, num_stages=4)],
    "mha": [dict(heads_per_program=2, block_n=32, num_warps=4), dict(heads_per_program=4, block_n=32, num_warps=8),
            dict(heads_per_program=2, block_n=64, num_warps=4), dict(heads_per_program=2, block_n=64, num_warps=8),
            dict(heads_per_program=1, block_n=64, num_warps=4)],
}


def _time_decode(q, kc, vc, pt, lens, out, ctx, scales, cfg):
    from kvshare_kernels import kernels
    fn = lambda: kernels.paged_decode_attention(q, kc, vc, pt, lens, D ** -0.5, out, max_context=ctx,  # noqa: E731
                                                **scales, **cfg)
    try:
        return bc.bench_graph(fn)
    except Exception as e:   # a config out of resources (shared memory) is a result, not a crash
        print(f"  {cfg} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return float("nan")


def kv_dtype_table(md=None):
    """Decode attention at page 16 over bf16, fp8 e4m3 and int8 pages: time, bytes read, TB/s, speedup;
    then the 8-bit pages under KV8_VARIANTS' tiles."""
    from kvshare_kernels import kv_quant
    rows, results, vrows = [], [], []
    for hq, hkv, b, ctx in KV_DTYPE_SHAPES:
        if bc.DRY_RUN:
            b, ctx = min(b, 2), min(ctx, 64)
        q, k, v, pt, lens = make_paged(b, hq, hkv, ctx, 16, bc.device())
        out = torch.empty_like(q)
        base = None
        variants = KV8_VARIANTS["mha" if hq == hkv else "gqa"]
        if bc.DRY_RUN:
            variants = variants[:1]
        for name, dt in (("bf16", None), ("fp8_e4m3", kv_quant.FP8), ("int8", torch.int8)):
            if dt is None:
                kc, vc, scales = k, v, {}
            else:
                kc, ks = kv_quant.quantize(k, dt)
                vc, vs = kv_quant.quantize(v, dt)
                scales = dict(k_scale=ks, v_scale=vs) if dt == torch.int8 else dict(k_scale=1.0, v_scale=1.0)
            nbytes = b * ctx * 2 * hkv * kv_quant.bytes_per_token_head(D, kc.dtype)
            t = _time_decode(q, kc, vc, pt, lens, out, ctx, scales, {})
            base = t if base is None else base
            row = [f"{hq}/{hkv}", b, ctx, name, f"{nbytes / 1e9:.3f}", f"{t * 1e6:.1f}", f"{nbytes / t / 1e12:.2f}",
                   f"{base / t:.2f}"]
            rows.append(row)
            results.append(dict(hq=hq, hkv=hkv, batch=b, ctx=ctx, kv_dtype=name, bytes=nbytes, seconds=t))
            print("  " + " | ".join(str(x) for x in row), flush=True)
            for cfg in variants if dt is not None else ():
                tv = _time_decode(q, kc, vc, pt, lens, out, ctx, scales, cfg)
                vrows.append([f"{hq}/{hkv}", b, ctx, name, str(cfg), f"{tv * 1e6:.1f}", f"{nbytes / tv / 1e12:.2f}",
                              f"{base / tv:.2f}", f"{t / tv:.2f}"])
                results.append(dict(hq=hq, hkv=hkv, batch=b, ctx=ctx, kv_dtype=name, bytes=nbytes, seconds=tv, cfg=cfg))
                print("  " + " | ".join(str(x) for x in vrows[-1]), flush=True)
            del kc, vc, scales
        del q, k, v, pt, lens, out
        bc.free()
    header = ["heads q/kv", "batch", "ctx", "pages", "bytes read GB", "us", "TB/s", "speedup vs bf16"]
    bc.print_table("paged decode attention by KV dtype, page 16, head_dim 128, bf16 queries (graph-timed)", header,
                   rows, md)
    bc.print_table("8-bit pages under other tiles (same shapes; the defaults above: GQA 128 tokens x 4 warps, MHA 4 KV heads x 32 tokens)",
                   ["heads q/kv", "batch", "ctx", "pages", "config", "us", "TB/s", "speedup vs bf16",
                    "vs this dtype's default"], vrows, md)
    return results


TILE_VARIANTS = [
    dict(block_n=64, num_warps=4, num_stages=3),
    dict(block_n=64, num_warps=4, num_stages=3, head_fastest=True),
    dict(block_n=128, num_warps=8, num_stages=3),
    dict(block_n=128, num_warps=8, num_stages=3, head_fastest=True),
    dict(block_n=32, num_warps=4, num_stages=3, heads_per_program=2),
    dict(block_n=32, num_warps=4, num_stages=3, heads_per_program=2, head_fastest=True),
    dict(block_n=64, num_warps=8, num_stages=3, heads_per_program=2),
    dict(block_n=32, num_warps=8, num_stages=3, heads_per_program=4),
    dict(block_n=32, num_warps=8, num_stages=3, heads_per_program=4, head_fastest=True),
    dict(block_n=16, num_warps=4, num_stages=4, heads_per_program=4),
    dict(block_n=16, num_warps=8, num_stages=4, heads_per_program=8),
]


PAGE16_SHAPES = [(32, 32, 16, 2048), (32, 32, 64, 2048), (32, 32, 64, 8192), (32, 32, 256, 2048), (32, 8, 64, 2048),
                 (32, 8, 64, 8192)]
PAGE16_VARIANTS = [dict(), dict(page_ids=False), dict(page_ids=True),
                   dict(block_n=16, num_warps=4, num_stages=4),
                   dict(block_n=64, num_warps=4, num_stages=3, page_ids=True),
                   dict(block_n=64, num_warps=8, num_stages=3, page_ids=True),
                   dict(block_n=32, num_warps=4, num_stages=4, page_ids=True)]


def sweep_page16(md=None):
    """Page 16 with tiles over several pages: a table read per token or per page (page_ids; the
    default with 32/32 heads), and tiles of one page; the default config's heads per program."""
    shapes, variants = PAGE16_SHAPES, PAGE16_VARIANTS
    if bc.DRY_RUN:
        shapes, variants = [(2, 2, 2, 64)], [dict(block_n=32), dict(block_n=32, page_ids=True)]
    rows, res = [], []
    for hq, hkv, b, ctx in shapes:
        base = None
        for cfg in variants:
            t = time_kvshare(b, hq, hkv, ctx, 16, **cfg)
            base = base or t
            rows.append([f"{hq}/{hkv} {b}x{ctx} p16", str(cfg or "default"), f"{kv_bytes(b, hkv, ctx) / t / 1e12:.2f}",
                         f"{base / t:.3f}"])
            res.append(dict(hq=hq, hkv=hkv, batch=b, ctx=ctx, page=16, cfg=cfg, s=t))
            print("  " + " | ".join(rows[-1]), flush=True)
    bc.print_table("decode at page 16: table reads per token vs per page (TB/s, graph-timed)",
                   ["shape", "config", "TB/s", "vs default"], rows, md)
    return res


# fixed-64 / fixed-256's decode: every sequence at 129-256 tokens (a 128-token prompt, 128 generated),
# where a context is a few tiles and the loop's prologue, epilogue and partial last tile weigh more
# than at 2k. The defaults beside shorter tiles, more heads per program, fewer stages.
SHORT_SHAPES = [(32, 32, 256, 160), (32, 32, 256, 224), (32, 32, 64, 192), (32, 8, 256, 192)]
SHORT_VARIANTS = [dict(), dict(page_ids=False), dict(num_stages=2), dict(num_stages=4),
                  dict(block_n=16, num_warps=4, num_stages=4), dict(block_n=16, num_warps=4, num_stages=4, heads_per_program=4),
                  dict(block_n=16, num_warps=4, num_stages=3, heads_per_program=8),
                  dict(block_n=32, num_warps=4, num_stages=3, heads_per_program=4),
                  dict(block_n=64, num_warps=4, num_stages=2, heads_per_program=2),
                  dict(block_n=32, num_warps=2, num_stages=3),
                  dict(head_fastest=False)]


def sweep_short(md=None):
    """Decode at fixed-256's contexts (129-256 tokens), page 16: the default config against others."""
    shapes, variants = SHORT_SHAPES, SHORT_VARIANTS
    if bc.DRY_RUN:
        shapes, variants = [(2, 2, 2, 40)], [dict(), dict(block_n=16, num_warps=4, num_stages=4)]
    rows, res = [], []
    for hq, hkv, b, ctx in shapes:
        base = None
        for cfg in variants:
            if hq != hkv and cfg.get("heads_per_program", 1) > 1:
                continue
            t = time_kvshare(b, hq, hkv, ctx, 16, **cfg)
            base = base or t
            rows.append([f"{hq}/{hkv} {b}x{ctx} p16", str(cfg or "default"), f"{t * 1e6:.1f}",
                         f"{kv_bytes(b, hkv, ctx) / t / 1e12:.2f}", f"{base / t:.3f}"])
            res.append(dict(hq=hq, hkv=hkv, batch=b, ctx=ctx, page=16, cfg=cfg, s=t))
            print("  " + " | ".join(rows[-1]), flush=True)
    bc.print_table("decode at short contexts (fixed-64/256's 129-256 tokens), page 16 (graph-timed)",
                   ["shape", "config", "us", "TB/s", "vs default"], rows, md)
    return res


def sweep(md=None):
    """Tile / grid-order / heads-per-program variants on representative shapes, then split counts."""
    res = {"tiles": [], "splits": []}
    shapes = [(32, 8, 64, 2048, 16), (32, 32, 64, 2048, 16), (32, 32, 256, 2048, 16), (32, 8, 256, 2048, 64)]
    variants = TILE_VARIANTS
    if bc.DRY_RUN:
        shapes, variants = [(4, 2, 2, 64, 16), (2, 2, 2, 64, 16)], [dict(v, block_n=16) for v in TILE_VARIANTS[:6]]
    rows = []
    for hq, hkv, b, ctx, ps in shapes:
        for cfg in variants:
            t = time_kvshare(b, hq, hkv, ctx, ps, rep_ms=50, **cfg)
            bw = kv_bytes(b, hkv, ctx) / t / 1e12
            rows.append([f"{hq}/{hkv} {b}x{ctx} p{ps}", str(cfg), f"{bw:.2f}"])
            res["tiles"].append(dict(hq=hq, hkv=hkv, batch=b, ctx=ctx, page=ps, cfg=cfg, s=t))
            print("  " + " | ".join(rows[-1]), flush=True)
    bc.print_table("decode variant sweep (TB/s, graph-timed)", ["shape", "config", "TB/s"], rows, md)

    rows = []
    split_shapes = [(32, 8, 1, 512), (32, 8, 1, 2048), (32, 8, 1, 8192), (32, 8, 16, 512), (32, 8, 16, 2048),
                    (32, 8, 16, 8192), (32, 32, 1, 2048), (32, 32, 1, 8192), (32, 32, 16, 2048), (32, 8, 64, 512),
                    (32, 8, 64, 2048)]
    splits_list = [1, 2, 4, 8, 16, 32, 64]
    if bc.DRY_RUN:
        split_shapes, splits_list = [(4, 2, 1, 64)], [1, 2]
    for hq, hkv, b, ctx in split_shapes:
        cells = []
        for sp in splits_list:
            t = time_kvshare(b, hq, hkv, ctx, 16, rep_ms=50, num_splits=sp)
            cells.append(kv_bytes(b, hkv, ctx) / t / 1e12)
            res["splits"].append(dict(hq=hq, hkv=hkv, batch=b, ctx=ctx, splits=sp, s=t))
        h = heuristic_splits(b, hq, hkv, ctx)
        rows.append([f"{hq}/{hkv} {b}x{ctx}"] + [f"{x:.2f}" for x in cells] + [h])
        print("  " + " | ".join(str(x) for x in rows[-1]), flush=True)
    bc.print_table("split-K sweep, page 16, default tile (TB/s, graph-timed)", ["shape"]
                   + [f"S={sp}" for sp in splits_list] + ["heuristic S"], rows, md)

    # host cost of one eager call (what a graph replay saves)
    from kvshare_kernels import kernels
    q, k, v, pt, lens = make_paged(2, 32, 8, 512 if not bc.DRY_RUN else 64, 16, bc.device())
    for sp in (1, 4):
        us = bc.host_overhead(lambda: kernels.paged_decode_attention(q, k, v, pt, lens, 0.1, num_splits=sp)) * 1e6
        print(f"host time per eager paged_decode_attention call, {sp} split(s): {us:.1f} us", flush=True)
        res[f"host_us_splits{sp}"] = us
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="tile and split-K sweeps")
    ap.add_argument("--table", action="store_true", help="the main table (default when nothing is chosen)")
    ap.add_argument("--kv-dtypes", action="store_true", help="bf16 vs fp8 e4m3 vs int8 pages")
    ap.add_argument("--page16", action="store_true", help="page-16 variants: table reads per token vs per page")
    ap.add_argument("--short", action="store_true", help="short contexts (fixed-256's 129-256 tokens): config variants")
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
    if a.kv_dtypes:
        out["kv_dtypes"] = kv_dtype_table(a.md)
    if a.page16:
        out["page16"] = sweep_page16(a.md)
    if a.short:
        out["short"] = sweep_short(a.md)
    if a.table or not (a.sweep or a.kv_dtypes or a.page16 or a.short):
        out["table"] = table(a.md)
    bc.dump_json(a.json, out)


if __name__ == "__main__":
    main()
