"""kvshare's paged attention kernels beside the peer's: vLLM 0.25.0's FlashAttention 3 (the
`vllm.vllm_flash_attn` build vLLM runs on Hopper, paged through its block table) on the same pages,
page tables and lengths, one process, one GPU.

    python perf/kernels/bench_peer_attention.py [--json F] [--md F]    # vllm importable (perf/peer)
    python perf/kernels/bench_peer_attention.py --dry-run               # CPU: this script only

Decode: K+V bytes read over the median time of a CUDA-graph replay (L2 flushed), TB/s. Prefill
(queries are each request's last tokens, bottom-right causal): causal FLOPs over the median time of
a graph replay too (and kvshare's launch eagerly, beside it), TFLOP/s. Both sides read a shuffled
bf16 pool, head_dim 128; each case also compares the two outputs (max |difference|), so both
compute the same attention. Heads: Llama-3-8B (32/8) and
Llama-2-7B (32/32); the 32k rows are the seed-long-32k row's chunks (2,048 new tokens after 30k).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.kernels import bench_common as bc  # noqa: E402

D = 128
DTYPE = torch.bfloat16
HEADS = [(32, 8), (32, 32)]
DECODE = [(b, ctx, ps) for ps in (16, 64) for b, ctx in ((16, 2048), (64, 2048), (64, 8192), (256, 2048), (8, 32768))]
# (name, batch, prefix tokens cached, new tokens per request)
PREFILL = [("prompt 1x4096", 1, 0, 4096), ("prompt 4x8192", 4, 0, 8192), ("extend 4x(2048+512)", 4, 2048, 512),
           ("chunk 1x(8192+2048)", 1, 8192, 2048), ("chunk 1x(30720+2048)", 1, 30720, 2048),
           ("chunk 8x(14336+2048)", 8, 14336, 2048)]
PREFILL_PAGE = 16
MAX_BYTES = 40e9


def fa3():
    """vLLM's FA3 varlen entry point, or None with the reason."""
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fai
    except Exception as exc:  # not importable here (the CPU machine): kvshare's side only
        return None, f"{type(exc).__name__}: {exc}"[:200]
    if not fai.is_fa_version_supported(3):
        return None, fai.fa_version_unsupported_reason(3)
    return fai.flash_attn_varlen_func, None


def paged_pool(b, hkv, ctx, page_size, dev):
    pages_per = math.ceil(ctx / page_size)
    k = torch.empty(b * pages_per, page_size, hkv, D, dtype=DTYPE, device=dev).normal_()
    v = torch.empty_like(k).normal_()
    pt = torch.randperm(b * pages_per, device=dev).to(torch.int32).view(b, pages_per).contiguous()
    return k, v, pt


def shrink_decode(b, ctx, ps):
    return (min(b, 2), min(ctx, 40), ps) if bc.DRY_RUN else (b, ctx, ps)


def shrink_prefill(b, prefix, q_len):
    return (min(b, 2), min(prefix, 16), min(q_len, 24)) if bc.DRY_RUN else (b, prefix, q_len)


def decode_case(flash, hq, hkv, b, ctx, ps):
    from kvshare_kernels import kernels
    dev = bc.device()
    k, v, pt = paged_pool(b, hkv, ctx, ps, dev)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, D, dtype=DTYPE, device=dev)
    ours, theirs = torch.empty_like(q), torch.empty_like(q)
    run_ours = lambda: kernels.paged_decode_attention(q, k, v, pt, lens, D ** -0.5, ours, max_context=ctx)  # noqa: E731
    rec = dict(kind="decode", hq=hq, hkv=hkv, batch=b, context=ctx, page_size=ps,
               bytes=2 * b * ctx * hkv * D * DTYPE.itemsize, kvshare_s=bc.bench_graph(run_ours))
    if flash is not None:
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
        run_theirs = lambda: flash(q, k, v, 1, cu_q, ctx, seqused_k=lens, softmax_scale=D ** -0.5,  # noqa: E731
                                   causal=True, block_table=pt, out=theirs, fa_version=3)
        rec["fa3_s"] = bc.bench_graph(run_theirs)
        run_ours(), run_theirs()
        rec["max_abs_diff"] = (ours.float() - theirs.float()).abs().max().item()
    del k, v, q, ours, theirs
    bc.free()
    return rec


def prefill_case(flash, hq, hkv, name, b, prefix, q_len):
    from kvshare_kernels import kernels
    dev = bc.device()
    ctx = prefix + q_len
    k, v, pt = paged_pool(b, hkv, ctx, PREFILL_PAGE, dev)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, b + 1, dtype=torch.int32, device=dev) * q_len
    q = torch.randn(b * q_len, hq, D, dtype=DTYPE, device=dev)
    ours, theirs = torch.empty_like(q), torch.empty_like(q)
    # the engine's launch: the chunk's own keys from the step's K/V (runtime/llama.py), its work list
    k_new, v_new = bc.step_kv(k, v, pt, prefix, ctx, hq)
    tiles = bc.prefill_tiles(hq, hkv, b, q_len, ctx, dev, new_kv=True)
    run_ours = lambda: kernels.paged_prefill_attention(q, k, v, pt, qsl, lens, D ** -0.5, ours,  # noqa: E731
                                                       tiles=tiles, k_new=k_new, v_new=v_new)
    # the same with the kernel's own grid, and the launch before: every key read back from the pool
    run_grid = lambda: kernels.paged_prefill_attention(q, k, v, pt, qsl, lens, D ** -0.5, ours,  # noqa: E731
                                                       max_query_len=q_len, k_new=k_new, v_new=v_new)
    pool_tiles = bc.prefill_tiles(hq, hkv, b, q_len, ctx, dev)
    run_pool = lambda: kernels.paged_prefill_attention(q, k, v, pt, qsl, lens, D ** -0.5, ours,  # noqa: E731
                                                       tiles=pool_tiles)
    # Both sides timed as CUDA-graph replays, as the engine's mixed-step graphs run prefill: eager, a
    # 0.2 ms extend also times each launcher's host work; the engine's launch eagerly is a column.
    rec = dict(kind="prefill", case=name, hq=hq, hkv=hkv, batch=b, prefix=prefix, q_len=q_len,
               flops=4 * hq * D * b * (q_len * prefix + q_len * (q_len + 1) / 2), kvshare_s=bc.bench_graph(run_ours),
               kvshare_eager_s=bc.bench(run_ours), kvshare_grid_s=bc.bench_graph(run_grid),
               kvshare_pool_s=bc.bench_graph(run_pool))
    if flash is not None:
        run_theirs = lambda: flash(q, k, v, q_len, qsl, ctx, seqused_k=lens, softmax_scale=D ** -0.5,  # noqa: E731
                                   causal=True, block_table=pt, out=theirs, fa_version=3)
        rec["fa3_s"] = bc.bench_graph(run_theirs)
        run_pool(), run_theirs()
        rec["max_abs_diff_pool"] = (ours.float() - theirs.float()).abs().max().item()
        run_ours()
        rec["max_abs_diff"] = (ours.float() - theirs.float()).abs().max().item()
    del k_new, v_new
    del k, v, q, ours, theirs
    bc.free()
    return rec


def _ratio(rec):
    return rec["fa3_s"] / rec["kvshare_s"] if rec.get("fa3_s") else None


def _cell(x, fmt):
    return "-" if x is None else format(x, fmt)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--only", choices=["decode", "prefill"], default=None)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    bc.set_dry_run(a.dry_run)
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("bench_peer_attention: needs a CUDA GPU (or --dry-run)")
    flash, why = fa3()
    print(f"vLLM FA3: {'available' if flash else 'not available: ' + str(why)}", flush=True)
    records = []
    if a.only != "prefill":
        rows = []
        for (hq, hkv), (b, ctx, ps) in ((h, c) for h in HEADS for c in DECODE):
            b, ctx, ps = shrink_decode(b, ctx, ps)
            if 2 * b * ctx * hkv * D * 2 > MAX_BYTES:
                continue
            r = decode_case(flash, hq, hkv, b, ctx, ps)
            records.append(r)
            rows.append([f"{hq}/{hkv}", f"{b} x {ctx}", ps, _cell(r["bytes"] / r["kvshare_s"] / 1e12, ".2f"),
                         _cell(r["bytes"] / r["fa3_s"] / 1e12 if r.get("fa3_s") else None, ".2f"),
                         _cell(_ratio(r), ".2f"), _cell(r.get("max_abs_diff"), ".1e")])
            print("  " + " | ".join(map(str, rows[-1])), flush=True)
        bc.print_table("paged decode, bf16, head_dim 128, CUDA-graph replay: kvshare vs vLLM's FA3 (TB/s)",
                       ["heads", "batch x context", "page", "kvshare TB/s", "FA3 TB/s", "kvshare / FA3", "max abs diff"],
                       rows, a.md)
    if a.only != "decode":
        rows = []
        for (hq, hkv), (name, b, prefix, q_len) in ((h, c) for h in HEADS for c in PREFILL):
            b, prefix, q_len = shrink_prefill(b, prefix, q_len)
            r = prefill_case(flash, hq, hkv, name, b, prefix, q_len)
            records.append(r)
            rows.append([f"{hq}/{hkv}", name, _cell(r["flops"] / r["kvshare_s"] / 1e12, ".0f"),
                         _cell(r["flops"] / r["kvshare_eager_s"] / 1e12, ".0f"),
                         _cell(r["flops"] / r["kvshare_grid_s"] / 1e12, ".0f"),
                         _cell(r["flops"] / r["kvshare_pool_s"] / 1e12, ".0f"),
                         _cell(r["flops"] / r["fa3_s"] / 1e12 if r.get("fa3_s") else None, ".0f"),
                         _cell(_ratio(r), ".2f"), _cell(r.get("max_abs_diff"), ".1e")])
            print("  " + " | ".join(map(str, rows[-1])), flush=True)
        bc.print_table(f"paged prefill, bf16, head_dim 128, page {PREFILL_PAGE}, causal FLOPs: kvshare vs vLLM's FA3 "
                       "(TFLOP/s, CUDA-graph replay; kvshare as the engine launches it: the chunk's keys from the step's K/V, "
                       "the cached prefix through the pages, its work list; the same launched eagerly; with the "
                       "kernel's own grid; and the launch before, every key read back from the pool)",
                       ["heads", "case", "kvshare TFLOP/s", "eager", "grid launch", "all keys from the pool", "FA3 TFLOP/s",
                        "kvshare / FA3", "max abs diff"],
                       rows, a.md)
    bc.dump_json(a.json, dict(fa3=flash is not None, fa3_reason=why, records=records))


if __name__ == "__main__":
    main()
