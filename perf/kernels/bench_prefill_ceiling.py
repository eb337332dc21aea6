"""Where paged prefill loses to FlashAttention 3: the load path, the page size, or Triton itself?

    python perf/kernels/bench_prefill_ceiling.py [--json F] [--md F]     # vllm importable: FA3 too
    python perf/kernels/bench_prefill_ceiling.py --dry-run                # CPU: this script only

On the same shapes as bench_peer_attention's prefill rows (bf16, head_dim 128, causal FLOPs,
TFLOP/s), one process:

* kvshare's paged kernel as the engine launches it (page 16, per-thread loads), and at page 16 with
  its 64 x 64, a 128 x 64 and a 128 x 128 tile, each with the tile's page ids read per iteration and
  one ahead;
* the engine's launch at page 16: each chunk's own keys from the step's K/V (views of a fused
  projection, TMA bulk copies), only the cached prefix through the page table, at several tiles,
  the prefix's page ids read a tile ahead (the default) and per tile;
* the same contract at page 16 with each 128-key prefix tile assembled in shared memory from one TMA
  copy per page (prefill_pages_tma.py, Gluon; not in the dry run: the interpreter cannot run Gluon);
* the same kernel on page-64 and page-128 pools, with per-thread loads, with TMA bulk copies (a
  tile is one page's slice, so one descriptor load fetches it), with TMA and each tile's page id
  read one iteration ahead, and (the largest tile) with that and the step's K/V;
* a dense kernel written for this bench: the same FlashAttention-2 loop over contiguous K/V read
  through TMA descriptors, no page table at all. It is the ceiling of this kernel design in Triton
  on this GPU: if it stays far from FA3, no paging change closes the gap;
* torch SDPA (cuDNN) on contiguous K/V and vLLM's FA3 on the page-16 pool.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv:   # the interpreter must be chosen before triton.language is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

if __package__ in (None, ""):  # run as a script: the repo root on sys.path, for `perf`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from perf.kernels import bench_common as bc  # noqa: E402
from perf.kernels.bench_peer_attention import fa3  # noqa: E402

D = 128
DTYPE = torch.bfloat16
HEADS = [(32, 8), (32, 32)]
CASES = [("prompt 1x4096", 1, 0, 4096), ("prompt 4x8192", 4, 0, 8192), ("extend 4x(2048+512)", 4, 2048, 512),
         ("chunk 1x(30720+2048)", 1, 30720, 2048)]
# (block_m, block_n, num_warps, num_stages, warp-specialised) of the dense kernel; block_m query tokens of
# one head. Warp specialisation (Triton's automatic producer/consumer split of the unmasked loop, what
# FA3 does by hand) is tried because without it Hopper's async MMA and softmax do not overlap.
DENSE = [(128, 128, 8, 3, False), (128, 128, 8, 2, False), (128, 64, 8, 3, False), (64, 64, 4, 3, False),
         (128, 128, 8, 2, True)]
# the paged kernel on page-64 and page-128 pools: (block_m rows, block_n, warps, stages), each with
# per-thread loads and with TMA. A page of 128 holds the dense kernel's best tile (128 keys) whole.
PAGED = {64: [(64, 64, 4, 3), (128, 64, 8, 3)],
         128: [(64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2)]}
# the page-16 pool (no TMA: a tile spans pages): the engine's tile and the wide one, each with the
# tile's page ids read per iteration and one iteration ahead
PAGE16 = [(64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 3)]   # the engine's tile, then the TMA launches' shapes
# page 16 with the chunk's keys from the step's K/V (the engine's launch first: NEW_KV_LAUNCH)
NEW_KV = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3)]
LOG2E = 1.4426950408889634


@triton.jit
def _dense_range(acc, l_i, m_i, q, k_desc, v_desc, kv_row, kv_col, pos, start, end, scale_log2,
                 BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, WS: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    for n in tl.range(start, end, BLOCK_N, warp_specialize=WS):
        k = k_desc.load([kv_row + n, kv_col])
        v = v_desc.load([kv_row + n, kv_col])
        if UPCAST:   # the interpreter's tl.dot multiplies bf16 as raw integers
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k))
        if CAUSAL:
            qk = tl.where((n + cols)[None, :] <= pos[:, None], qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            p = tl.exp2(qk - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2)
            p = tl.exp2(qk * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _dense_kernel(q_desc, k_desc, v_desc, o_desc, q_len, ctx, scale_log2, HQ: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
                  WS: tl.constexpr):
    # One program: BLOCK_M query tokens of one head of one request; request b's queries are rows
    # b * q_len.., its keys rows b * ctx.. (the last q_len of them are the new tokens').
    mblk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    prefix = ctx - q_len
    q_row = b * q_len + mblk * BLOCK_M
    kv_row = b * ctx
    kv_col = (h // GROUP) * HEAD_DIM
    q = q_desc.load([q_row, h * HEAD_DIM])
    out_dtype = q.dtype
    if UPCAST:
        q = q.to(tl.float32)
    first = prefix + mblk * BLOCK_M
    pos = first + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end = ((first + 1) // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _dense_range(acc, l_i, m_i, q, k_desc, v_desc, kv_row, kv_col, pos, 0, full_end, scale_log2,
                                 BLOCK_N, False, UPCAST, WS)
    acc, l_i, m_i = _dense_range(acc, l_i, m_i, q, k_desc, v_desc, kv_row, kv_col, pos, full_end, first + BLOCK_M,
                                 scale_log2, BLOCK_N, True, UPCAST, False)
    o_desc.store([q_row, h * HEAD_DIM], (acc / l_i[:, None]).to(out_dtype))


def dense_attention(q, k, v, q_len, ctx, out, block_m, block_n, num_warps, num_stages, ws=False):
    """q/out [B * q_len, Hq, D], k/v [B * ctx, Hkv, D] contiguous; q_len a multiple of block_m."""
    from kvshare_kernels.checks import interpreter_bf16
    from triton.tools.tensor_descriptor import TensorDescriptor

    t, hq, d = q.shape
    hkv = k.shape[1]
    b = t // q_len
    qd = TensorDescriptor.from_tensor(q.view(t, hq * d), [block_m, d])
    od = TensorDescriptor.from_tensor(out.view(t, hq * d), [block_m, d])
    kd = TensorDescriptor.from_tensor(k.view(-1, hkv * d), [block_n, d])
    vd = TensorDescriptor.from_tensor(v.view(-1, hkv * d), [block_n, d])
    _dense_kernel[(q_len // block_m, b * hq)](qd, kd, vd, od, q_len, ctx, d ** -0.5 * LOG2E, HQ=hq, GROUP=hq // hkv,
                                              BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d,
                                              UPCAST=interpreter_bf16(q.dtype), WS=ws, num_warps=num_warps,
                                              num_stages=num_stages)
    return out


def paged_copy(kc, vc, b, ctx, page_size):
    """kc/vc [B * ctx, Hkv, D] copied into a pool of shuffled pages: (k, v, page_table)."""
    per = -(-ctx // page_size)
    hkv = kc.shape[1]
    pt = torch.randperm(b * per, device=kc.device).to(torch.int32).view(b, per).contiguous()
    pools = []
    for c in (kc, vc):
        pool = torch.zeros(b * per, page_size, hkv, D, dtype=c.dtype, device=c.device)
        padded = torch.zeros(b, per * page_size, hkv, D, dtype=c.dtype, device=c.device)
        padded[:, :ctx] = c.view(b, ctx, hkv, D)
        pool[pt.long().flatten()] = padded.view(b * per, page_size, hkv, D)
        pools.append(pool)
    return pools[0], pools[1], pt


def flops(hq, b, prefix, q_len):
    return 4 * hq * D * b * (q_len * prefix + q_len * (q_len + 1) / 2)


def _time(fn):
    # graph replay: the GPU's time alone, as the engine's mixed-step graphs run prefill; an eager call
    # of a 0.2 ms extend also times the launcher's host work (descriptors, checks) on both sides
    try:
        return bc.bench_graph(fn)
    except Exception as exc:   # a config that does not compile (shared memory) is a blank, not a crash
        print(f"    failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return None


def case(flash, hq, hkv, name, b, prefix, q_len, orders=(), gluon_only=False):
    """One shape's record; gluon_only: the page-copy orders beside the engine's launch (and FA3) only."""
    page16, new_kv, dense, paged = ([], NEW_KV[:1], [], {}) if gluon_only else (PAGE16, NEW_KV, DENSE, PAGED)
    from kvshare_kernels import kernels
    from kvshare_kernels.prefill_attention import default_launch

    dev = bc.device()
    ctx = prefix + q_len
    scale = D ** -0.5
    rec = dict(case=name, hq=hq, hkv=hkv, batch=b, prefix=prefix, q_len=q_len, flops=flops(hq, b, prefix, q_len))
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, b + 1, dtype=torch.int32, device=dev) * q_len
    q = torch.randn(b * q_len, hq, D, dtype=DTYPE, device=dev)
    out, ref = torch.empty_like(q), torch.empty_like(q)

    # one set of tokens, contiguous and in two paged pools (pages shuffled), so every output compares
    kc = torch.randn(b * ctx, hkv, D, dtype=DTYPE, device=dev)
    vc = torch.randn_like(kc)
    k16, v16, pt16 = paged_copy(kc, vc, b, ctx, 16)
    tiles = bc.prefill_tiles(hq, hkv, b, q_len, ctx, dev)
    run16 = lambda: kernels.paged_prefill_attention(q, k16, v16, pt16, qsl, lens, scale, ref, tiles=tiles)  # noqa: E731
    rec["paged16_s"] = _time(run16)
    run16()

    def diff():
        return (out.float() - ref.float()).abs().max().item()

    rec["paged16"] = {}
    for bm, bn, w, s in page16 if not bc.DRY_RUN else [(16, 32, 4, 2)]:
        tl16 = bc.prefill_tiles(hq, hkv, b, q_len, ctx, dev, bm)
        for ahead in (False, True):
            run = lambda: kernels.paged_prefill_attention(q, k16, v16, pt16, qsl, lens, scale, out, tiles=tl16,  # noqa: E731
                                                          block_m=bm, block_n=bn, num_warps=w, num_stages=s,
                                                          prefetch_page_ids=ahead)
            t = _time(run)
            rec["paged16"][f"{bm}x{bn} w{w} s{s}{' ahead' if ahead else ''}"] = dict(s=t, diff=diff() if t else None)

    rec["new_kv"] = {}
    k_new, v_new = bc.step_kv(k16, v16, pt16, prefix, ctx, hq)
    for bm, bn, w, s in new_kv if not bc.DRY_RUN else [(16, 32, 4, 2), (16, 16, 4, 2)]:
        tln = bc.prefill_tiles(hq, hkv, b, q_len, ctx, dev, bm)
        for ahead in (True, False):     # the prefix's page ids a tile ahead (the default) or per tile
            run = lambda: kernels.paged_prefill_attention(q, k16, v16, pt16, qsl, lens, scale, out, tiles=tln,  # noqa: E731
                                                          block_m=bm, block_n=bn, num_warps=w, num_stages=s,
                                                          k_new=k_new, v_new=v_new, prefetch_page_ids=ahead)
            t = _time(run)
            rec["new_kv"][f"{bm}x{bn} w{w} s{s}{'' if ahead else ' per tile'}"] = dict(s=t, diff=diff() if t else None)
    if not bc.DRY_RUN:       # Gluon compiles for the GPU only: the interpreter cannot run it
        from kvshare_kernels import prefill_pages_tma as ppt

        if ppt.applies(k16, v16, q):
            tlg = bc.prefill_tiles(hq, hkv, b, q_len, ctx, dev, ppt.BLOCK_M)
            rec["pages_tma"] = {}
            for order in orders:    # prefill_pages_tma.ORDERS that passed their tests
                t = _time(lambda: ppt.paged_prefill_pages_tma(q, k16, v16, pt16, qsl, lens, scale, k_new, v_new,  # noqa: B023
                                                              out, tiles=tlg, order=order))
                rec["pages_tma"][f"128x128 w8 s2 {order}"] = dict(s=t, diff=diff() if t else None)
    if flash is not None:
        rec["fa3_s"] = _time(lambda: flash(q, k16, v16, q_len, qsl, ctx, seqused_k=lens, softmax_scale=scale,
                                           causal=True, block_table=pt16, out=out, fa_version=3))
        rec["fa3_diff"] = diff()
    del k16, v16, k_new, v_new
    bc.free()
    if not bc.DRY_RUN and prefix == 0 and not gluon_only:
        qq = q.view(b, q_len, hq, D).transpose(1, 2)
        kk = kc.view(b, ctx, hkv, D).transpose(1, 2)
        vv = vc.view(b, ctx, hkv, D).transpose(1, 2)
        rec["sdpa_s"] = _time(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=hq != hkv))
    rec["dense"] = {}
    for bm, bn, w, s, ws in dense if not bc.DRY_RUN else [(16, 16, 4, 2, False), (16, 16, 4, 2, True)]:
        if q_len % bm:
            continue
        t = _time(lambda: dense_attention(q, kc, vc, q_len, ctx, out, bm, bn, w, s, ws))
        rec["dense"][f"{bm}x{bn} w{w} s{s}{' ws' if ws else ''}"] = dict(s=t, diff=diff() if t else None)

    rec["paged"] = {}
    for page, configs in paged.items() if not bc.DRY_RUN else {32: [(16, 16, 4, 2), (16, 32, 4, 2)]}.items():
        kp, vp, ptp = paged_copy(kc, vc, b, ctx, page)
        kn, vn = bc.step_kv(kp, vp, ptp, prefix, ctx, hq)
        engine = default_launch(page, DTYPE, D, torch.device(dev), new_kv=True)
        rec["paged"][page] = {}
        for i, (bm, bn, w, s) in enumerate(configs):
            tlp = bc.prefill_tiles(hq, hkv, b, q_len, ctx, dev, bm)
            variants = ((False, False, False), (True, False, False), (True, True, False))
            # the engine's launch at this page also with the step's K/V (the dry run's pages have none)
            if (bm, bn, w, s) == (engine.block_m, engine.block_n, engine.num_warps, engine.num_stages) or (
                    bc.DRY_RUN and i == len(configs) - 1):
                variants += ((True, True, True),)
            for tma, ahead, new in variants:
                step = dict(k_new=kn, v_new=vn) if new else {}
                run = lambda: kernels.paged_prefill_attention(q, kp, vp, ptp, qsl, lens, scale, out, tiles=tlp,  # noqa: E731
                                                              block_m=bm, block_n=bn, num_warps=w, num_stages=s,
                                                              tma=tma, prefetch_page_ids=ahead, **step)
                t = _time(run)
                tag = (" tma" if tma else "") + (" ahead" if ahead else "") + (" step-kv" if new else "")
                rec["paged"][page][f"{bm}x{bn} w{w} s{s}{tag}"] = dict(s=t, diff=diff() if t else None)
        del kp, vp, kn, vn
        bc.free()
    del kc, vc, q, out, ref
    bc.free()
    return rec


def _tf(rec, s):
    return None if not s else rec["flops"] / s / 1e12


def _best(d):
    timed = {k: v for k, v in d.items() if v.get("s")}
    return min(timed.items(), key=lambda kv: kv[1]["s"]) if timed else (None, {})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--gluon-only", action="store_true",
                    help="only the page-copy kernel's orders beside the engine's launch (and FA3 when there): "
                         "a couple of minutes less on the GPU")
    ap.add_argument("--pages-tma-orders", default="serial,overlapped,producer,pingpong",
                    help="the Gluon kernel's orders to time (those whose GPU tests passed: one that hangs would "
                         "stop the whole table), or @FILE: the orders written there (none if it is missing)")
    a = ap.parse_args(argv)
    bc.set_dry_run(a.dry_run)
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("bench_prefill_ceiling: needs a CUDA GPU (or --dry-run)")
    flash, why = fa3()
    orders = a.pages_tma_orders
    if orders.startswith("@"):
        path = Path(orders[1:])
        orders = path.read_text().strip() if path.exists() else ""
    orders = [o for o in orders.split(",") if o]
    print(f"Gluon page-copy prefill, orders timed: {', '.join(orders) or 'none'}", flush=True)
    print(f"vLLM FA3: {'available' if flash else 'not available: ' + str(why)}", flush=True)
    records, rows, detail = [], [], []
    cases = CASES if not a.dry_run else [("prompt 1x32", 1, 0, 32), ("chunk 1x(16+16)", 1, 16, 16)]
    for hq, hkv in HEADS if not a.dry_run else [(4, 2)]:
        for name, b, prefix, q_len in cases:
            r = case(flash, hq, hkv, name, b, prefix, q_len, orders, a.gluon_only)
            records.append(r)
            dense = _best({k: v for k, v in r["dense"].items() if not k.endswith("ws")})
            dense_ws = _best({k: v for k, v in r["dense"].items() if k.endswith("ws")})
            fa = _tf(r, r.get("fa3_s"))
            p16 = _best(r["paged16"])
            step = _best(r["new_kv"])
            engine = r["new_kv"].get("x".join(map(str, NEW_KV[0][:2])) + f" w{NEW_KV[0][2]} s{NEW_KV[0][3]}", {})
            gluon_best = _best(r.get("pages_tma", {}))
            gluon = _tf(r, gluon_best[1].get("s"))
            cells = [_tf(r, r["paged16_s"]), _tf(r, p16[1].get("s")), _tf(r, engine.get("s")), _tf(r, step[1].get("s")),
                     gluon]
            best_tma = [p16[0], step[0], gluon_best[0]]
            for page, d in r["paged"].items():
                thread, tma = (_best({k: v for k, v in d.items() if ("tma" in k) == t}) for t in (False, True))
                cells += [_tf(r, thread[1].get("s")), _tf(r, tma[1].get("s"))]
                best_tma.append(tma[0])
            cells += [_tf(r, dense[1].get("s")), _tf(r, dense_ws[1].get("s")), _tf(r, r.get("sdpa_s")), fa]
            row = [f"{hq}/{hkv}", name] + ["-" if c is None else f"{c:.0f}" for c in cells]
            # against FA3: the engine's launch, each page size's best TMA launch, the dense kernels
            row += ["-" if not (fa and c) else f"{c / fa:.2f}" for c in (*cells[:5], *cells[6:-4:2], *cells[-4:-2])]
            row += [" / ".join(str(x) for x in (*best_tma, dense[0], dense_ws[0]))]
            rows.append(row)
            print("  " + " | ".join(row), flush=True)
            sections = ([("paged p16", r["paged16"]), ("p16 step K/V", r["new_kv"]),
                         ("p16 a copy per page (Gluon)", r.get("pages_tma", {}))]
                        + [(f"paged p{page}", d) for page, d in r["paged"].items()]
                        + [("dense", r["dense"])])
            for label, d in sections:
                for cfg, v in d.items():
                    detail.append([f"{hq}/{hkv}", name, label, cfg, "-" if not v.get("s") else f"{_tf(r, v['s']):.0f}",
                                   "-" if v.get("diff") is None else f"{v['diff']:.1e}"])
    pages = list(records[0]["paged"]) if records else []
    bc.print_table("paged prefill against its ceilings, bf16, head_dim 128, causal FLOPs (TFLOP/s): kvshare page 16 "
                   "with every key read from the pool (the launch before) and its best tile (ids read ahead or not); "
                   "page 16 with the chunk's keys from the step's K/V, the engine's launch (128 x 128) and the best "
                   "tile; page 16 with each prefix tile assembled from one bulk copy per page (Gluon, "
                   "prefill_pages_tma.py; the best of its orders); larger pages with per-thread loads and with TMA (best config each, step K/V included); the "
                   "dense TMA kernel on contiguous K/V (best config, without and with warp specialisation); torch "
                   "SDPA (cuDNN, prompts); vLLM's FA3 on page 16",
                   ["heads", "case", "p16 pool", "p16 pool best", "p16 step K/V", "p16 step K/V best", "p16 Gluon"]
                   + [f"p{p}{t}" for p in pages for t in ("", " TMA")]
                   + ["dense TMA", "dense WS", "SDPA", "FA3", "p16 pool / FA3", "p16 pool best / FA3",
                      "p16 step K/V / FA3", "p16 step K/V best / FA3", "p16 Gluon / FA3"]
                   + [f"p{p} TMA / FA3" for p in pages]
                   + ["dense / FA3", "dense WS / FA3", "best configs (" + " / ".join(
                       ["p16 pool best", "p16 step K/V best", "p16 Gluon"] + [f"p{p} TMA" for p in pages]
                       + ["dense", "dense WS"])
                      + ")"], rows, a.md)
    bc.print_table("every config (TFLOP/s)", ["heads", "case", "kernel", "config", "TFLOP/s",
                                                 "max abs diff vs p16"], detail, a.md)
    bc.dump_json(a.json, dict(fa3=flash is not None, fa3_reason=why, records=records))


if __name__ == "__main__":
    main()
