"""Cascade (shared-prefix) decode against plain paged decode on the shared-prefix workload.

    python perf/kernels/bench_cascade_decode.py [--sweep] [--json F] [--md F]
    python perf/kernels/bench_cascade_decode.py --dry-run   # CPU: checks this script only

Workload "shared-prefix": G groups x 16 requests; each request = the group's 2048-token system
prompt (the same physical pages for all members, as the prefix cache leaves them) + its own
128..384 tokens (a 128-token question and 0..256 generated ones). Heads of Llama-2-7B (32 q / 32 kv)
and Llama-3-8B (32 / 8), head_dim 128, fp16, page size 16, pages shuffled in the pool. Control:
the same lengths with nothing shared (the plan is empty and cascade is plain decode).

Columns: "bytes needed" = K+V bytes of every distinct token a row attends to, counting a shared
page once (what cascade reads); "plain bytes" = what plain decode reads (shared pages once per
row). Times are do_bench medians (eager: the host launches included) and CUDA-graph replays with
the L2 flushed (the GPU time a graphed decode step sees). "needed TB/s" = bytes needed / time:
the bandwidth each implementation effectively delivers for this work; "plain read TB/s" counts
plain's own reads (above the HBM rate where shared pages hit in L2). "host us" = host time of one
eager call (Triton launches). Outputs of the two are compared on the GPU (max abs diff). Also
times plan_cascade on the host at B = 256.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path
import time

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.kernels import bench_common as bc  # noqa: E402

D = 128
DTYPE = torch.float16
PAGE = 16
HEADS = [(32, 32), (32, 8)]             # Llama-2-7B, Llama-3-8B
PREFIX = 2048
MEMBERS = 16
SUFFIX = (128, 384)
CASES = [("4 groups x 16", 4, True), ("16 groups x 16", 16, True), ("control: 64 rows, no sharing", 4, False)]


def page_tables(groups: int, members: int, prefix: int, suffix: tuple[int, int], share: bool,
                page_size: int = PAGE, seed: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """Host page table and lengths (rows shuffled), and the pool size: each group's prompt pages are
    the same physical pages for all its members (share) or every row has its own copy (control)."""
    rnd = random.Random(seed)
    b = groups * members
    lens = [prefix + rnd.randint(*suffix) for _ in range(b)]
    pages_per = [-(-n // page_size) for n in lens]
    prefix_pages = prefix // page_size
    num_pages = (groups * prefix_pages if share else 0) + sum(pages_per) + 1
    ids = np.random.default_rng(seed).permutation(num_pages).tolist()     # a fragmented pool
    shared = [[ids.pop() for _ in range(prefix_pages)] for _ in range(groups)] if share else None
    pt = np.zeros((b, max(pages_per)), dtype=np.int32)
    for i in range(b):
        own = shared[i // members] if share else []
        pt[i, : pages_per[i]] = own + [ids.pop() for _ in range(pages_per[i] - len(own))]
    order = np.random.default_rng(seed + 1).permutation(b)       # group members are not adjacent in a batch
    return pt[order], np.asarray(lens, dtype=np.int32)[order], num_pages


def build(groups: int, members: int, prefix: int, suffix: tuple[int, int], hkv: int, share: bool, dev: str):
    pt, lens, num_pages = page_tables(groups, members, prefix, suffix, share)
    k = torch.empty(num_pages, PAGE, hkv, D, dtype=DTYPE, device=dev).normal_()
    v = torch.empty_like(k).normal_()
    return k, v, pt, lens


def bytes_per_token(hkv: int) -> int:
    return 2 * hkv * D * DTYPE.itemsize


def time_case(name, groups, share, hq, hkv, rows_out, results):
    from kvshare_kernels import kernels
    from kvshare_kernels.cascade_decode import cascade_decode_attention, plan_cascade
    dev = bc.device()
    prefix, suffix, members = PREFIX, SUFFIX, MEMBERS
    if bc.DRY_RUN:
        prefix, suffix, members = 64, (3, 40), 3
    k, v, pt_host, lens_host = build(groups, members, prefix, suffix, hkv, share, dev)
    plan = plan_cascade(pt_host, lens_host, PAGE)
    pt = torch.from_numpy(pt_host).to(dev)
    lens = torch.from_numpy(lens_host).to(dev)
    dplan = plan.to(dev)
    b = pt.shape[0]
    q = torch.randn(b, hq, D, dtype=DTYPE, device=dev)
    out_plain, out_casc = torch.empty_like(q), torch.empty_like(q)
    max_ctx = int(lens_host.max())
    plain = lambda: kernels.paged_decode_attention(q, k, v, pt, lens, D ** -0.5, out_plain, max_context=max_ctx)  # noqa: E731
    casc = lambda: cascade_decode_attention(q, k, v, pt, lens, dplan, D ** -0.5, out_casc, max_context=max_ctx)  # noqa: E731
    plain()
    casc()
    diff = float((out_plain.float() - out_casc.float()).abs().max())
    t_plain, t_casc = bc.bench(plain), bc.bench(casc)
    # graph timings twice in A B B A order, best of each: the clocks drift by a few % over a run
    g_plain, g_casc = bc.bench_graph(plain), bc.bench_graph(casc)
    g_casc, g_plain = min(g_casc, bc.bench_graph(casc)), min(g_plain, bc.bench_graph(plain))
    h_plain, h_casc = bc.host_overhead(plain), bc.host_overhead(casc)
    bpt = bytes_per_token(hkv)
    plain_bytes = int(lens_host.astype(np.int64).sum()) * bpt
    needed = (plan.shared_tokens_read() + int(lens_host.astype(np.int64).sum())
              - int(plan.row_shared_len.sum())) * bpt
    row = [f"{hq}/{hkv}", name, b, plan.num_groups, f"{needed / 1e9:.3f}", f"{plain_bytes / 1e9:.3f}",
           f"{t_plain * 1e6:.1f}", f"{t_casc * 1e6:.1f}", f"{t_plain / t_casc:.2f}",
           f"{g_plain * 1e6:.1f}", f"{g_casc * 1e6:.1f}", f"{g_plain / g_casc:.2f}",
           f"{needed / g_plain / 1e12:.2f}", f"{needed / g_casc / 1e12:.2f}", f"{plain_bytes / g_plain / 1e12:.2f}",
           f"{h_plain * 1e6:.0f} / {h_casc * 1e6:.0f}", f"{diff:.1e}"]
    rows_out.append(row)
    results.append(dict(hq=hq, hkv=hkv, case=name, batch=b, groups=plan.num_groups, needed_bytes=needed,
                        plain_bytes=plain_bytes, eager_plain_s=t_plain, eager_cascade_s=t_casc,
                        graph_plain_s=g_plain, graph_cascade_s=g_casc, host_plain_s=h_plain, host_cascade_s=h_casc,
                        max_abs_diff=diff))
    print("  " + " | ".join(str(x) for x in row), flush=True)
    tol = 2e-2 if not bc.DRY_RUN else 1e-2
    if not diff <= tol:
        print(f"  !! outputs differ: max abs diff {diff} > {tol}", flush=True)
    del k, v, pt, lens, q, out_plain, out_casc
    bc.free()


def table(md=None):
    rows, results = [], []
    for (hq, hkv) in HEADS:
        if bc.DRY_RUN:
            hq, hkv = (2, 2) if hq == hkv else (4, 2)
        for name, groups, share in CASES:
            time_case(name, groups, share, hq, hkv, rows, results)
    header = ["heads q/kv", "case", "rows", "groups", "GB needed", "GB plain reads", "plain us (eager)",
              "cascade us (eager)", "speed-up (eager)", "plain us (graph)", "cascade us (graph)",
              "speed-up (graph)", "plain needed TB/s", "cascade needed TB/s", "plain read TB/s",
              "host us per call plain / cascade", "max abs diff"]
    bc.print_table(f"cascade vs plain paged decode, fp16, page {PAGE}, prefix {PREFIX} + suffix "
                   f"{SUFFIX[0]}..{SUFFIX[1]}", header, rows, md)
    return results


def sweep(md=None):
    """Prefix-kernel knobs, the side-stream overlap and the suffix split on both cases (graph-timed)."""
    from kvshare_kernels.cascade_decode import cascade_decode_attention, plan_cascade
    dev = bc.device()
    variants = [dict(overlap=False)] + [dict(prefix_splits=s) for s in (1, 2, 4, 8)]
    variants += [dict(block_n=32, num_warps=4), dict(block_n=64, num_warps=8), dict(block_n=128, num_warps=8),
                 dict(num_stages=2), dict(num_stages=4), dict(num_splits=2)]
    res, rows = [], []
    for (hq, hkv), groups in itertools.product(HEADS, (4, 16)):
        members, prefix, suffix = MEMBERS, PREFIX, SUFFIX
        if bc.DRY_RUN:
            if groups == 16:
                continue
            hq, hkv = (2, 2) if hq == hkv else (4, 2)
            groups, members, prefix, suffix = 2, 3, 64, (3, 40)
        k, v, pt_host, lens_host = build(groups, members, prefix, suffix, hkv, True, dev)
        plan = plan_cascade(pt_host, lens_host, PAGE).to(dev)
        pt, lens = torch.from_numpy(pt_host).to(dev), torch.from_numpy(lens_host).to(dev)
        q = torch.randn(pt.shape[0], hq, D, dtype=DTYPE, device=dev)
        out = torch.empty_like(q)
        extra = [dict(heads_per_program=2)] if hq == hkv else []
        for cfg in ([dict()] + variants + extra)[: 3 if bc.DRY_RUN else None]:
            try:
                t = bc.bench_graph(lambda: cascade_decode_attention(q, k, v, pt, lens, plan, D ** -0.5, out, **cfg))
            except Exception as e:   # out of shared memory etc.: a result
                print(f"  failed {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                t = float("nan")
            rows.append([f"{hq}/{hkv}", str(groups), str(cfg or "default"), f"{t * 1e6:.1f}"])
            res.append(dict(hq=hq, hkv=hkv, groups=groups, cfg=cfg, s=t))
            print("  " + " | ".join(rows[-1]), flush=True)
        del k, v, pt, lens, q, out
        bc.free()
    bc.print_table("cascade sweep, groups x 16 rows (graph us)", ["heads", "groups", "config", "us"], rows, md)
    return res


def plan_timing(md=None):
    """plan_cascade on the host, B = 256: the shared-prefix batch, the control, and P = 256 columns."""
    from kvshare_kernels.cascade_decode import plan_cascade
    rng = np.random.default_rng(0)
    res, rows = {}, []
    pt, lens, _ = page_tables(16, 16, PREFIX, SUFFIX, True)
    pt0, lens0, _ = page_tables(16, 16, PREFIX, SUFFIX, False)
    wide = (rng.permutation(256 * 256).reshape(256, 256) + 100_000).astype(np.int32)
    wide[:, 0] = 7                       # a template page everyone shares
    wide[:, 1:129] = np.repeat(rng.permutation(16 * 128).reshape(16, 128), 16, axis=0)
    cases = [("16 groups x 16, P = 152", pt, lens), ("no sharing, P = 152", pt0, lens0),
             ("16 x 16 behind a template page, P = 256", wide, np.full(256, 4096))]
    for name, t_pt, t_lens in cases:
        plan_cascade(t_pt, t_lens, PAGE)
        n = 200
        t = time.perf_counter()
        for _ in range(n):
            plan = plan_cascade(t_pt, t_lens, PAGE)
        us = (time.perf_counter() - t) / n * 1e6
        rows.append([name, plan.num_groups, f"{us:.0f}"])
        res[name] = us
        print("  " + " | ".join(str(x) for x in rows[-1]), flush=True)
    bc.print_table("plan_cascade on the host, B = 256", ["page tables", "groups", "us per call"], rows, md)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also the prefix-kernel tuning sweep")
    ap.add_argument("--json", help="write all timings here")
    ap.add_argument("--md", help="append the markdown tables here")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (interpreter): checks the script")
    a = ap.parse_args(argv)
    bc.set_dry_run(a.dry_run)
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("bench_cascade_decode: needs a CUDA GPU (or --dry-run)")
    if not a.dry_run:
        print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
              f"triton {__import__('triton').__version__}", flush=True)
    t0 = time.perf_counter()
    out = {"plan": plan_timing(a.md), "table": table(a.md)}
    if a.sweep:
        out["sweep"] = sweep(a.md)
    print(f"total {time.perf_counter() - t0:.1f} s", flush=True)
    bc.dump_json(a.json, out)


if __name__ == "__main__":
    main()
