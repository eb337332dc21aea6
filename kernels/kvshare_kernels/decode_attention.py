"""paged_decode_attention: one new query token per request against its paged K/V.

Decode attention is a pass over the KV bytes (a few FLOPs per byte), so everything here serves
bandwidth:

* GQA: one program per (KV head, request, split) loads each K/V tile once and uses it for all
  ``G = Hq // Hkv`` query heads of that KV head (the G rows are padded to 16 for ``tl.dot``).
* MHA: a program takes two KV heads (``heads_per_program``) with a block-diagonal query (each
  row zero outside its own head's 128 columns), so one dot serves both heads and every token's
  read is 512 contiguous bytes; measured 2.6 -> 4.0 TB/s. (With G == 1 and one head per program
  the dots can also be done element-wise: ``use_dot=False``; it measured the same as the dot.)
* Paging: token n of request b lives at ``k_cache[page_table[b, n // P], n % P]``. When a tile of
  BLOCK_N tokens fits in one page (P >= BLOCK_N) one page id serves the whole tile; otherwise each
  row looks its own page up (P = 1 .. BLOCK_N/2, e.g. SGLang's P = 1).
* Split-K: a request's context is cut into ``num_splits`` equal ranges so that small batches still
  fill the GPU; each split writes its normalised partial output and log-sum-exp (base 2), and a
  second kernel merges them. The split count comes from shapes the host already knows (batch,
  heads, ``max_context``), never from reading context_lens, so the launcher never synchronises
  and works inside CUDA graphs. With one split the first kernel writes the output directly.
* Online softmax in fp32 with exp2 (the scale is pre-multiplied by log2(e)).
* 8-bit pools (kv_quant): the pass reads half the bytes, and a tile goes from its load to its dot
  through one convert only (int8 -> the query's dtype is exact; over fp8 e4m3 the dots run in fp16,
  whose convert is native on Hopper, where bf16's added a quarter-rate one per element:
  kv_tiles.dot_query). The scales never touch tile elements: fp8's per-tensor K scale is folded into
  the score scale and its V scale into the output; int8's per-(token, KV head) scales multiply
  the score tile's columns (q . k_int8 * k_scale[token]) and the probabilities before p @ v
  (p * v_scale[token]): one 4-byte load per token and head (kv_tiles.token_scales). The earlier
  per-element dequant gathered, with two heads per program (MHA), one float32 scale per tile
  element, 4 bytes of scale loads per byte of K/V: int8 MHA decode measured 10x slower than bf16.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import checks, kv_quant
from .checks import interpreter_bf16
from .kv_tiles import P_GAIN, dot_query, kv_rows, load_kv_tile, page_index, softcap_scores, token_scales
from .kv_write import scale_launch_args

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    Q, K, V, KS, VS, O, PO, PLSE, PT, CTX, scale_log2, v_scale, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_sp, stride_st, stride_ptb,
    window, softcap_log2,
    GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr, HEAD_FASTEST: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr, PAGE_IDS: tl.constexpr, SAME_ROWS: tl.constexpr, ROWS32: tl.constexpr,
    WINDOWED: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    # A program serves HEADS consecutive KV heads and their HEADS * GROUP query heads (rows r, padded
    # to BLOCK_R). Its K/V tile is [BLOCK_N tokens, HEADS * BLOCK_D] (columns c: head c // BLOCK_D).
    # With HEADS > 1 the query is block-diagonal: row r is zero outside its own head's columns, so
    # one dot computes every head's scores, and each row keeps only its own head's block of P @ V.
    if HEAD_FASTEST:
        hblk = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        hblk = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(CTX + b)
    if WINDOWED:
        # The query (position ctx - 1) sees keys lo .. ctx - 1. Tiles stay aligned to BLOCK_N (the
        # one-page-per-tile read relies on it) from the tile holding lo; the keys of that tile
        # before lo are masked, and so are their page-table entries, which may be -1 (released).
        lo = tl.maximum(ctx - window, 0)
        first = (lo // BLOCK_N) * BLOCK_N
        split_len = tl.cdiv(tl.cdiv(ctx - first, num_splits), BLOCK_N) * BLOCK_N
        start = first + s * split_len
    else:
        lo = 0
        # Each request cuts its own context into num_splits ranges of whole tiles.
        split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
        start = s * split_len
    end = tl.minimum(start + split_len, ctx)

    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    c_head = c // BLOCK_D                       # KV head (within the program) of each column
    c_d = c % BLOCK_D
    r_mask = r < HEADS * GROUP
    c_mask = c_d < HEAD_DIM
    head = hblk * (HEADS * GROUP) + r           # query heads of consecutive KV heads are consecutive
    q_mask = r_mask[:, None] & c_mask[None, :] & ((r // GROUP)[:, None] == c_head[None, :])
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + c_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_row = tl.sum(q.to(tl.float32), axis=0)    # the single row when GROUP == HEADS == 1 (no-dot path)
    if USE_DOT:
        q = dot_query(q, KV_QUANT)              # fp16 over fp8 tiles (kv_tiles.dot_query)

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    pt_row = PT + b * stride_ptb
    kvh0 = hblk * HEADS
    k_cols = (kvh0 + c_head) * stride_kh + c_d
    v_cols = (kvh0 + c_head) * stride_vh + c_d
    row_head = r // GROUP                       # KV head (within the program) of each row
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if WINDOWED:
            n_mask = n_mask & (offs_n >= lo)
        if PAGE_SIZE % BLOCK_N == 0:
            # The tile lies in one page (tiles start at multiples of BLOCK_N): one page-table read.
            page = tl.load(pt_row + n // PAGE_SIZE)
        elif PAGE_IDS:
            # The tile spans whole pages: one id per page, repeated over its tokens, instead of a
            # table read per token (MHA's 32-token tiles over 16-token pages).
            ids = n // PAGE_SIZE + tl.arange(0, BLOCK_N // PAGE_SIZE)
            if WINDOWED:
                pages = tl.load(pt_row + ids, mask=(ids * PAGE_SIZE < end) & ((ids + 1) * PAGE_SIZE > lo), other=0)
            else:
                pages = tl.load(pt_row + ids, mask=ids * PAGE_SIZE < end, other=0)
            page = tl.reshape(tl.broadcast_to(pages[:, None], (BLOCK_N // PAGE_SIZE, PAGE_SIZE)), (BLOCK_N,))
        else:
            page = tl.load(pt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0)
        page = page_index(page, ROWS32)
        in_page = offs_n % PAGE_SIZE
        if BLOCK_D == HEAD_DIM:
            kv_mask = n_mask[:, None]          # row-constant mask keeps the loads 16 bytes wide
        else:
            kv_mask = n_mask[:, None] & c_mask[None, :]
        s_rows = page * stride_sp + in_page * stride_st      # int8's scales of these tokens
        k_rows, v_rows = kv_rows(page, in_page, stride_kp, stride_kt, stride_vp, stride_vt, SAME_ROWS)
        k = load_kv_tile(K, k_rows, k_cols, kv_mask, KV_QUANT)
        v = load_kv_tile(V, v_rows, k_cols if SAME_ROWS else v_cols, kv_mask, KV_QUANT)
        if UPCAST or KV_QUANT != 0:     # the interpreter's tl.dot multiplies bf16 as raw integers
            if USE_DOT:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            else:                       # the multiply-adds below are float32: one convert, not two
                k = k.to(tl.float32)
                v = v.to(tl.float32)
        if USE_DOT:
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)                  # [BLOCK_R, N]
        else:   # one query row: a dot would pad it to 16 rows; multiply-add instead
            qk = tl.sum(k.to(tl.float32) * q_row[None, :], axis=1)[None, :]        # [1, N]
        if KV_QUANT == 2:   # int8: q . (k * scale) = (q . k) * scale, per token (column) and head
            qk = qk * token_scales(KS, s_rows, kvh0, row_head, n_mask, scale_log2, HEADS, BLOCK_R, BLOCK_N)
        else:
            qk = qk * scale_log2
        if SOFTCAP:
            qk = softcap_scores(qk, softcap_log2)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_QUANT == 2:   # p @ (v * scale) = (p * scale) @ v, the scale per token (row of v)
            pv_w = p * token_scales(VS, s_rows, kvh0, row_head, n_mask, P_GAIN, HEADS, BLOCK_R, BLOCK_N)
        else:
            pv_w = p
        if USE_DOT:
            pv = tl.dot(pv_w.to(v.dtype), v, input_precision=PRECISION)
        else:
            pv = tl.sum(tl.sum(pv_w, axis=0)[:, None] * v.to(tl.float32), axis=0)[None, :]
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if HEADS == 1:
        o = acc
    else:       # keep each row's own head block: [R, HEADS, D] -> [R, D]
        acc3 = tl.reshape(acc, [BLOCK_R, HEADS, BLOCK_D])
        own = (r // GROUP)[:, None, None] == tl.arange(0, HEADS)[None, :, None]
        o = tl.sum(tl.where(own, acc3, 0.0), axis=1)
    empty = l_i == 0.0                  # a split past this request's context
    if KV_QUANT == 2:
        v_scale = v_scale / P_GAIN
    o = o * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    d = tl.arange(0, BLOCK_D)
    store_mask = r_mask[:, None] & (d < HEAD_DIM)[None, :]
    if SPLIT:
        # Partial results: PO [B, Hq, S, D] fp32, PLSE [B, Hq, S] fp32 (log2 domain).
        if HEAD_FASTEST:
            num_q_heads = tl.num_programs(0) * HEADS * GROUP
        else:
            num_q_heads = tl.num_programs(1) * HEADS * GROUP
        row = (b * num_q_heads + head) * num_splits + s
        tl.store(PO + row[:, None] * HEAD_DIM + d[None, :], o, mask=store_mask)
        tl.store(PLSE + row, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))),
                 mask=r_mask)
    else:
        tl.store(O + b * stride_ob + head[:, None] * stride_oh + d[None, :], o.to(O.dtype.element_ty),
                 mask=store_mask)


@triton.jit
def _decode_merge_kernel(PO, PLSE, O, num_splits, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """out = sum_s 2^(lse_s - m) * o_s / sum_s 2^(lse_s - m): exact log-sum-exp merge of the splits."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row0 = (b * tl.num_programs(1) + h) * num_splits
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = sp < num_splits
    lse = tl.load(PLSE + row0 + sp, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)     # every split empty (context_len 0): output 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    o = tl.load(PO + (row0 + sp)[:, None] * HEAD_DIM + d[None, :],
                mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(O + b * stride_ob + h * stride_oh + d, out.to(O.dtype.element_ty), mask=d < HEAD_DIM)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4   # the interpreter: a small number keeps CPU tests quick but still exercises split-K


# Tuning defaults, chosen on the H200 with perf/kernels/bench_decode_attention.py --sweep
# (docs/develop/kernels.md has the sweeps). GQA: one KV head per program, 64-token tiles. MHA (one query
# head per KV head): two KV heads per program with 32-token tiles read 512 contiguous bytes per
# token instead of 256 and went from 2.6 to 4.0 TB/s (64 x 2k); the same change did not help GQA.
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
MHA_HEADS_PER_PROGRAM = 2
MHA_BLOCK_N = 32
HEAD_FASTEST = True         # grid order: consecutive programs are the KV heads of one request
PROGRAMS_PER_SM = 4         # split-K until about this many programs per SM (graph-timed sweep)
MAX_SPLITS = 64
# One page-table read per page of a tile instead of per token (bench_decode_attention --page16,
# H200, 2026-12-06): +3-7% with 32/32 heads at page 16 (block_n 32), -20% with GQA 32/8 (block_n 64),
# where the broadcast of the ids costs more than the gathers it saves.
MHA_PAGE_IDS = True
PAGE_IDS = False
# 8-bit pages with GQA: a tile of 128 tokens (4 warps) halves the per-tile softmax and bookkeeping per
# byte, which weighs twice as much when a byte is one element: 1.17x (fp8) and 1.24x (int8) over the
# 16-bit tile at 64 x 2k on the H200 (kv-dtype suite's variant table, 2026-12-01).
KV8_GQA_BLOCK_N = 128
# 8-bit pages with 32/32 heads, (KV heads per program, tile tokens) by layout. fp8: four KV heads of
# 32 tokens (512 contiguous bytes of a token, as the 16-bit tile's two heads read) once the dots run
# in fp16 over fp8: 1.14x / 1.06x over the 16-bit tile at 64 / 256 x 2k (kv-dtype suite, H100,
# 2026-12-06), level with two heads of 64 tokens on 2026-12-07. int8: two heads of 64 tokens. Four
# heads put its dequantising loop at ptxas' 255-register cap with 21-41 spill instructions an iteration
# under the GPU image's Triton 3.6 (perf/kernels/hopper_compile.py), and on an H100 that tile ran
# *below* bf16 pages (0.91x / 0.84x); two heads of 64 tokens: 1.37x / 1.54x over it, 1.24x / 1.29x
# over bf16 (bench_decode_attention.py --kv-dtypes, 2026-12-07).
KV8_MHA_TILES = {kv_quant.FP8_MODE: (4, 32), kv_quant.INT8_MODE: (2, 64)}


def page_ids_apply(wanted: bool, page_size: int, block_n: int) -> bool:
    """Whether a launch reads the page table once per page: wanted and a tile spans several whole
    pages; otherwise the per-token read is the only correct one."""
    return bool(wanted) and 1 < page_size < block_n and block_n % page_size == 0


def default_config(num_q_heads: int, num_kv_heads: int, kv_mode: int = kv_quant.NONE) -> dict:
    """Tile, warps, stages and KV heads per program for this head layout and pool layout
    (kv_quant.mode_of)."""
    if num_q_heads == num_kv_heads and num_kv_heads % MHA_HEADS_PER_PROGRAM == 0:
        heads, block_n = KV8_MHA_TILES.get(kv_mode, (MHA_HEADS_PER_PROGRAM, MHA_BLOCK_N))
        if num_kv_heads % heads:
            heads, block_n = MHA_HEADS_PER_PROGRAM, MHA_BLOCK_N
        return dict(block_n=block_n, num_warps=NUM_WARPS, num_stages=NUM_STAGES, heads_per_program=heads,
                    page_ids=MHA_PAGE_IDS)
    block_n = BLOCK_N if kv_mode == kv_quant.NONE else KV8_GQA_BLOCK_N
    return dict(block_n=block_n, num_warps=NUM_WARPS, num_stages=NUM_STAGES, heads_per_program=1,
                page_ids=PAGE_IDS)


def choose_num_splits(batch: int, num_programs_per_request: int, max_context: int, device: torch.device,
                      block_n: int = BLOCK_N) -> int:
    """Static split-K heuristic from host-known shapes: about PROGRAMS_PER_SM programs per SM, and
    at least one tile per split. Measured (graph-timed): 1 x 8k GQA best at 32 splits, 64 x 512 at 1."""
    programs = max(1, batch * num_programs_per_request)
    want = PROGRAMS_PER_SM * _num_sms(device) // programs
    by_len = triton.cdiv(max(1, max_context), block_n)
    return max(1, min(want, by_len, MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
                           max_context: int | None = None, num_splits: int | None = None,
                           k_scale=None, v_scale=None, window: int = 0, softcap: float = 0.0,
                           debug: bool | None = None, block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, use_dot: bool | None = None,
                           heads_per_program: int | None = None, head_fastest: bool | None = None,
                           page_ids: bool | None = None, rows32: bool | None = None) -> torch.Tensor:
    """q [B, Hq, D]; page_table int32 [B, max_pages]; context_lens int32 [B] -> out [B, Hq, D].

    max_context: an upper bound of context_lens known on the host (default: the page table's
    capacity, max_pages * page_size); it only sizes the split-K heuristic. num_splits overrides the
    heuristic. block_n, num_warps, num_stages, use_dot, heads_per_program (KV heads per program)
    head_fastest (grid order) and page_ids (a tile of several whole pages reads one table entry
    per page, not per token; default_config's choice) are tuning knobs for tests and benchmarks;
    rows32 False forces int64 row offsets (None: int32 where every offset into both pools fits).
    k_scale/v_scale: an int8 cache's float32 [P, S, Hkv] scales, an fp8 cache's per-tensor floats
    (default 1.0). window W > 0: the query sees its last W keys only; the key loop starts at the
    tile holding the first of them, so pages wholly before it are never read (entries may be -1)
    and the split-K heuristic sizes for W keys, not max_context. softcap C > 0: scores become
    C * tanh(score / C) before the softmax. Both are constexpr-gated: off, the kernel is unchanged.
    """
    b, hq, d = q.shape
    checks.check_attention_shapes(q, k_cache, v_cache, page_table, context_lens, b, "context_lens")
    mode, k_scale, v_scale = kv_quant.check_scales(k_cache, v_cache, k_scale, v_scale, "paged_decode_attention")
    window, softcap = checks.check_window_args(window, softcap, "paged_decode_attention")
    num_pages, page_size, hkv, _ = k_cache.shape
    if checks.debug_enabled(debug):
        checks.check_page_table_values(page_table, context_lens, num_pages, page_size, window)
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    if q.dtype != k_cache.dtype and mode == kv_quant.NONE:
        raise ValueError(f"paged_decode_attention: q is {q.dtype}, the cache {k_cache.dtype}")
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"paged_decode_attention: out must be {q.dtype} {tuple(q.shape)} with a contiguous head_dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = hq // hkv
    cfg = default_config(hq, hkv, mode)
    block_n = block_n or cfg["block_n"]
    heads = heads_per_program or (1 if use_dot is False else cfg["heads_per_program"])
    if hkv % heads:
        raise ValueError(f"paged_decode_attention: heads_per_program {heads} does not divide {hkv} KV heads")
    if max_context is None:
        max_context = page_table.shape[1] * page_size
    if window:      # a window's keys span at most W + BLOCK_N - 1 positions from an aligned tile
        max_context = min(max_context, window + block_n)
    if num_splits is None:
        num_splits = choose_num_splits(b, hkv // heads, max_context, q.device, block_n)
    if use_dot is None:
        use_dot = group * heads > 1
    if not use_dot and group * heads != 1:
        raise ValueError("paged_decode_attention: use_dot=False needs one query head per program")
    block_r = max(16, triton.next_power_of_2(group * heads)) if use_dot else 1
    block_d = triton.next_power_of_2(d)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    split = num_splits > 1
    if split:
        po = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
        plse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        po = plse = out        # unused
    head_fastest = HEAD_FASTEST if head_fastest is None else head_fastest
    grid = (hkv // heads, b, num_splits) if head_fastest else (b, hkv // heads, num_splits)
    ks, vs, stride_sp, stride_st, kf, vf = scale_launch_args(mode, k_cache, k_scale, v_scale)
    _decode_split_kernel[grid](
        q, kv_quant.storage_view(k_cache), kv_quant.storage_view(v_cache), ks, vs, out, po, plse, page_table,
        context_lens, scale * kf * LOG2E, vf, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_sp, stride_st, page_table.stride(0),
        window, softcap * LOG2E,
        GROUP=group, HEADS=heads, BLOCK_R=block_r, BLOCK_C=heads * block_d, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=block_n,
        PAGE_SIZE=page_size, SPLIT=split, USE_DOT=use_dot, HEAD_FASTEST=head_fastest, PRECISION=precision,
        UPCAST=interpreter_bf16(q.dtype, mode), KV_QUANT=mode,
        PAGE_IDS=page_ids_apply(cfg["page_ids"] if page_ids is None else page_ids, page_size, block_n),
        **checks.row_offset_flags(k_cache, v_cache, rows32), WINDOWED=window > 0, SOFTCAP=softcap > 0,
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )
    if split:
        _decode_merge_kernel[(b, hq)](
            po, plse, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4,
        )
    return out
