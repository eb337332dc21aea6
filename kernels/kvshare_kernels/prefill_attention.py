"""paged_prefill_attention: varlen "extend" attention over the page table.

Request i's q_len_i new tokens are its LAST tokens: query j sits at absolute position
``context_len - q_len + j`` and sees keys 0..that position. Every key, cached prefix and new
tokens alike, is read through the page table (write_kv has already put the new K/V in the pages),
so a shared prefix page is read like any other.

One program per (block of query tokens, request, KV head). Its BLOCK_M rows are BLOCK_M // G
query tokens x the G query heads of that KV head (row r = token r // G, head r % G), so a K/V tile
is loaded once for all heads of the group and the dots stay large enough for the tensor cores.
The key loop has two phases (as in the Triton flash-attention tutorial): keys visible to every row
of the block need no causal mask, and their tiles are whole and in bounds, so their loads carry no
mask either (but over a padded head_dim); only the tiles on the diagonal are masked. A tile of
several whole pages loads one page id per page, not one per token.

The grid's first dimension covers max_query_len, which the caller knows on the host (the
scheduler chose the chunk sizes); by default it is the total number of query tokens, an upper
bound that costs only idle programs, never a synchronisation. With ``tiles`` (prefill_tiles.py:
a (request, query block) per program, built on the host) the grid is that list x KV heads, fixed
by its length alone, so a CUDA graph can hold a step of any split of its tokens; a program's
work is the same either way, only which program does it changes.

8-bit pools as in the decode kernel: tiles converted to the dots' dtype (the query's; fp16 over fp8
tiles, kv_tiles.dot_query), scales folded into the
scores and probabilities (int8) or the score scale and output (fp8); the
chunk's own new tokens are read back from the pool like the cached ones, so prefill sees exactly
the K/V that later decode steps see.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import checks, kv_quant
from .checks import interpreter_bf16
from .kv_tiles import P_GAIN, dot_query, kv_rows, load_kv_tile, page_index, softcap_scores, token_scales
from .kv_write import scale_launch_args
from .prefill_tiles import BLOCK_M, IDLE, tokens_per_tile

LOG2E = 1.4426950408889634
IDLE_TILE: tl.constexpr = tl.constexpr(IDLE)


@triton.jit
def _load_tile(C, rows, cols, mask, KV_QUANT: tl.constexpr):
    """load_kv_tile, or with mask None a load with no mask at all (load_kv_tile always passes one)."""
    if mask is None:
        x = tl.load(C + rows[:, None] + cols[None, :])
        if KV_QUANT == 1:
            x = x.to(tl.float8e4nv, bitcast=True)
    else:
        x = load_kv_tile(C, rows, cols, mask, KV_QUANT)
    return x


@triton.jit
def _accumulate(acc, l_i, m_i, m_new, p, p_v, v, PRECISION: tl.constexpr):
    """One tile's probabilities p (p_v: times V's scales, or p) into the running sum and output."""
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # Rescaled in place and accumulated by the dot itself (wgmma's accumulator), never a second
    # BLOCK_M x D float32 tile and an add; Triton folds `acc * alpha + dot` the same way today,
    # this form does not depend on that rewrite.
    acc = acc * alpha[:, None]
    acc = tl.dot(p_v.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i


@triton.jit
def _prefill_tile(acc, l_i, m_i, q, k_head, v_head, ks_head, vs_head, pt_row, pos, start, end, scale_log2,
                  stride_kp, stride_kt, stride_vp, stride_vt, stride_sp, stride_st, d, d_mask, k_desc, v_desc, kv_col,
                  BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_QUANT: tl.constexpr,
                  TMA: tl.constexpr, PREFETCH: tl.constexpr, SAME_ROWS: tl.constexpr, ROWS32: tl.constexpr,
                  lo, window, softcap_log2, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    # Keys [start, end), start a multiple of BLOCK_N. CAUSAL: the diagonal tiles, whose rows see
    # different keys and whose last tile may run past `end`. Otherwise every tile is whole and
    # in bounds (the caller's full_end), so no load is masked but over a padded head_dim.
    # WINDOWED: keys before lo (the block's first visible key) are masked in the CAUSAL tiles, their
    # page-table entries included (pages wholly before a window may be -1); each row also sees only
    # keys after pos - window. The unmasked tiles lie inside every row's window (_window_phases).
    r = tl.arange(0, BLOCK_N)
    # PREFETCH: the next tile's page id(s) are read one iteration ahead, so that no tile's address
    # waits on a table read issued in its own iteration (the launcher sets it only where a tile is
    # one page's slice or whole pages).
    if PREFETCH:
        if PAGE_SIZE % BLOCK_N == 0:
            page_next = page_index(tl.load(pt_row + start // PAGE_SIZE, mask=start < end, other=0), ROWS32)
        else:
            ids_next = start // PAGE_SIZE + tl.arange(0, BLOCK_N // PAGE_SIZE)
            if WINDOWED:
                pages_next = tl.load(pt_row + ids_next, mask=(ids_next * PAGE_SIZE < end)
                                     & ((ids_next + 1) * PAGE_SIZE > lo), other=0)
            else:
                pages_next = tl.load(pt_row + ids_next, mask=ids_next * PAGE_SIZE < end, other=0)
    for n in range(start, end, BLOCK_N):
        offs_n = n + r
        n_mask = offs_n < end
        if WINDOWED and CAUSAL:
            n_mask = n_mask & (offs_n >= lo)
        if PAGE_SIZE % BLOCK_N == 0:
            if PREFETCH:
                page = page_next
                page_next = page_index(tl.load(pt_row + (n + BLOCK_N) // PAGE_SIZE, mask=n + BLOCK_N < end,
                                               other=0), ROWS32)
            else:
                page = page_index(tl.load(pt_row + n // PAGE_SIZE), ROWS32)
            in_page = n % PAGE_SIZE + r
        elif PAGE_SIZE > 1 and BLOCK_N % PAGE_SIZE == 0:
            # One id per page of the tile, repeated over its tokens, instead of a gather per token.
            # The strides multiply after the reshape: the alignment analysis knows nothing of a
            # reshape's result, and stride x id keeps the K/V rows 16-byte aligned (vector loads).
            ids = n // PAGE_SIZE + tl.arange(0, BLOCK_N // PAGE_SIZE)
            if PREFETCH:
                pages = pages_next
                ids_next = ids + BLOCK_N // PAGE_SIZE
                pages_next = tl.load(pt_row + ids_next, mask=ids_next * PAGE_SIZE < end, other=0)
            elif CAUSAL and WINDOWED:
                pages = tl.load(pt_row + ids, mask=(ids * PAGE_SIZE < end) & ((ids + 1) * PAGE_SIZE > lo), other=0)
            elif CAUSAL:
                pages = tl.load(pt_row + ids, mask=ids * PAGE_SIZE < end, other=0)
            else:
                pages = tl.load(pt_row + ids)
            page = tl.reshape(tl.broadcast_to(pages[:, None], (BLOCK_N // PAGE_SIZE, PAGE_SIZE)), (BLOCK_N,))
            page = page_index(page, ROWS32)
            in_page = r % PAGE_SIZE
        else:
            if CAUSAL:
                page = page_index(tl.load(pt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0), ROWS32)
            else:
                page = page_index(tl.load(pt_row + offs_n // PAGE_SIZE), ROWS32)
            in_page = offs_n % PAGE_SIZE
        if CAUSAL:
            if BLOCK_D == HEAD_DIM:
                kv_mask = n_mask[:, None]
            else:
                kv_mask = n_mask[:, None] & d_mask[None, :]
        elif BLOCK_D == HEAD_DIM:
            kv_mask = None
        else:
            kv_mask = d_mask[None, :]
        s_rows = page * stride_sp + in_page * stride_st      # int8's scales of these tokens
        if TMA:
            # The tile is one page's slice (PAGE_SIZE % BLOCK_N == 0): one bulk copy per operand,
            # no address per thread. Rows past `end` are other slots of the page, possibly never
            # written: their scores are masked below, and V's are zeroed so that a NaN there
            # cannot reach the output through 0 * NaN.
            row = (page * PAGE_SIZE + n % PAGE_SIZE).to(tl.int32)
            k = k_desc.load([row, kv_col])
            v = v_desc.load([row, kv_col])
            if CAUSAL:
                v = tl.where(n_mask[:, None], v, 0.0)
        else:
            k_rows, v_rows = kv_rows(page, in_page, stride_kp, stride_kt, stride_vp, stride_vt, SAME_ROWS)
            k = _load_tile(k_head, k_rows, d, kv_mask, KV_QUANT)
            v = _load_tile(v_head, v_rows, d, kv_mask, KV_QUANT)
        if UPCAST or KV_QUANT != 0:     # the interpreter's tl.dot multiplies bf16 as raw integers
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if KV_QUANT == 2 or CAUSAL or SOFTCAP:
            if KV_QUANT == 2:   # int8 scales fold into the score columns and p (decode_attention)
                qk = qk * token_scales(ks_head, s_rows, 0, 0, n_mask, scale_log2, 1, 1, BLOCK_N)
            else:
                qk = qk * scale_log2
            if SOFTCAP:
                qk = softcap_scores(qk, softcap_log2)
            if CAUSAL and WINDOWED:
                seen = (offs_n[None, :] <= pos[:, None]) & (offs_n[None, :] > pos[:, None] - window)
                qk = tl.where(seen & n_mask[None, :], qk, float("-inf"))
            elif CAUSAL:        # masked after the scaling: -inf times a zero scale would be NaN
                qk = tl.where((offs_n[None, :] <= pos[:, None]) & n_mask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            if CAUSAL and WINDOWED:
                # A row may have seen no key yet (its window starts past this tile): exponents
                # against 0 instead of -inf - -inf = NaN; p and alpha are then 0.
                m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(qk - m_exp[:, None])
            else:
                p = tl.exp2(qk - m_new[:, None])
        else:
            # A scalar scale (> 0) commutes with the max, so it rides in the exponent's FMA instead
            # of a separate multiply of the score tile (the fused-attention tutorial's form).
            m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2)
            p = tl.exp2(qk * scale_log2 - m_new[:, None])
        if KV_QUANT == 2:
            p_v = p * token_scales(vs_head, s_rows, 0, 0, n_mask, P_GAIN, 1, 1, BLOCK_N)
        else:
            p_v = p
        if CAUSAL and WINDOWED:
            acc, l_i = _accumulate(acc, l_i, m_i, m_exp, p, p_v, v, PRECISION)
        else:
            acc, l_i = _accumulate(acc, l_i, m_i, m_new, p, p_v, v, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _new_kv_range(acc, l_i, m_i, q, kn_desc, vn_desc, row0, kv_col, tok, start, end, scale_log2,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                  window, softcap_log2, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    # The chunk's own keys [start, end) (indices into the chunk, start a multiple of BLOCK_N), read
    # from the step's K/V rows row0.. by bulk copies: contiguous whatever the page size. CAUSAL: the
    # diagonal tiles (key j visible to row token t where j <= t); rows past `end` belong to the next
    # request or the padding, so V's are zeroed as in the paged TMA path.
    cols = tl.arange(0, BLOCK_N)
    for n in range(start, end, BLOCK_N):
        k = kn_desc.load([row0 + n, kv_col])
        v = vn_desc.load([row0 + n, kv_col])
        if CAUSAL:
            j = n + cols
            v = tl.where((j < end)[:, None], v, 0.0)
        if UPCAST:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if CAUSAL and WINDOWED:     # as in _prefill_tile: the window's lower edge, rows yet to see a key
            qk = qk * scale_log2
            if SOFTCAP:
                qk = softcap_scores(qk, softcap_log2)
            seen = (j[None, :] <= tok[:, None]) & (j[None, :] > tok[:, None] - window) & (j < end)[None, :]
            qk = tl.where(seen, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk - m_exp[:, None])
        elif CAUSAL:
            qk = qk * scale_log2
            if SOFTCAP:
                qk = softcap_scores(qk, softcap_log2)
            qk = tl.where((j[None, :] <= tok[:, None]) & (j < end)[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            p = tl.exp2(qk - m_new[:, None])
        elif SOFTCAP:
            qk = softcap_scores(qk * scale_log2, softcap_log2)
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            p = tl.exp2(qk - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2)
            p = tl.exp2(qk * scale_log2 - m_new[:, None])
        if CAUSAL and WINDOWED:
            acc, l_i = _accumulate(acc, l_i, m_i, m_exp, p, p, v, PRECISION)
        else:
            acc, l_i = _accumulate(acc, l_i, m_i, m_new, p, p, v, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _window_phases(first_row, last_row, causal_end, window, BLOCK_N: tl.constexpr):
    """A block's key tiles under a window, for rows at positions first_row..last_row whose keys
    below causal_end (a multiple of BLOCK_N) are causally visible to every row: (lo, s0, s1, s2),
    lo the first key any row sees, and tiles [s0, s1) masked (the window's lower edge, where rows
    see different keys), [s1, s2) seen whole by every row (no mask), [s2, ...) masked (the causal
    diagonal). Nothing below s0 (lo's tile) is read, so the pages wholly before it never are."""
    lo = tl.maximum(first_row - window + 1, 0)
    s0 = (lo // BLOCK_N) * BLOCK_N
    all_see = tl.cdiv(tl.maximum(last_row - window + 1, 0), BLOCK_N) * BLOCK_N
    s2 = tl.maximum(causal_end, s0)
    s1 = tl.maximum(s0, tl.minimum(all_see, s2))
    return lo, s0, s1, s2


@triton.jit
def _prefill_kernel(
    Q, K, V, KS, VS, O, PT, QSL, CTX, TILES, KD, VD, KN, VN, scale_log2, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_sp, stride_st, stride_ptb,
    window, softcap_log2,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_MT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, KV_QUANT: tl.constexpr, TILED: tl.constexpr, TMA: tl.constexpr, PREFETCH: tl.constexpr,
    NEW_KV: tl.constexpr, SAME_ROWS: tl.constexpr, ROWS32: tl.constexpr,
    WINDOWED: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    if TILED:
        tile = tl.program_id(0)
        b = tl.load(TILES + 2 * tile)
        if b == IDLE_TILE:
            return
        mblk = tl.load(TILES + 2 * tile + 1)
        kvh = tl.program_id(1)
    else:
        mblk = tl.program_id(0)
        b = tl.program_id(1)
        kvh = tl.program_id(2)
    q_start = tl.load(QSL + b)
    q_len = tl.load(QSL + b + 1) - q_start
    if mblk * BLOCK_MT >= q_len:
        return
    ctx = tl.load(CTX + b)
    prefix = ctx - q_len

    r = tl.arange(0, BLOCK_M)             # BLOCK_M = BLOCK_MT * BLOCK_G rows
    tok = mblk * BLOCK_MT + r // BLOCK_G
    g = r % BLOCK_G
    row_mask = (tok < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q = dot_query(q, KV_QUANT)             # fp16 over fp8 tiles (kv_tiles.dot_query)
    pos = prefix + tok                     # absolute position of each row's token

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    pt_row = PT + b * stride_ptb
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh
    ks_head = KS + kvh            # int8's scales of this KV head (unused otherwise)
    vs_head = VS + kvh
    first_pos = prefix + mblk * BLOCK_MT                              # the block's smallest position
    if NEW_KV:
        # The cached prefix through the page table (every row sees all of it; only the tile that
        # holds its end is masked), then the chunk's own keys from the step's K/V.
        full_end = (prefix // BLOCK_N) * BLOCK_N
        last_key = prefix
    else:
        last_key = tl.minimum(first_pos + BLOCK_MT, ctx)              # one past the largest key seen
        full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N             # tiles every row sees in full
    if WINDOWED:
        last_row = tl.minimum(first_pos + BLOCK_MT, ctx) - 1
        lo, s0, s1, s2 = _window_phases(first_pos, last_row, full_end, window, BLOCK_N)
    else:
        lo, s0, s1, s2 = 0, 0, 0, full_end
    if WINDOWED:
        acc, l_i, m_i = _prefill_tile(acc, l_i, m_i, q, k_head, v_head, ks_head, vs_head, pt_row, pos, s0, s1,
                                      scale_log2, stride_kp, stride_kt, stride_vp, stride_vt, stride_sp, stride_st, d,
                                      d_mask, KD, VD, kvh * HEAD_DIM, BLOCK_N, PAGE_SIZE, HEAD_DIM, BLOCK_D, True,
                                      PRECISION, UPCAST, KV_QUANT, TMA, PREFETCH, SAME_ROWS, ROWS32,
                                      lo, window, softcap_log2, WINDOWED, SOFTCAP)
    acc, l_i, m_i = _prefill_tile(acc, l_i, m_i, q, k_head, v_head, ks_head, vs_head, pt_row, pos, s1, s2, scale_log2,
                                  stride_kp, stride_kt, stride_vp, stride_vt, stride_sp, stride_st, d, d_mask, KD, VD,
                                  kvh * HEAD_DIM, BLOCK_N, PAGE_SIZE, HEAD_DIM, BLOCK_D, False, PRECISION, UPCAST,
                                  KV_QUANT, TMA, PREFETCH, SAME_ROWS, ROWS32, lo, window, softcap_log2, WINDOWED, SOFTCAP)
    acc, l_i, m_i = _prefill_tile(acc, l_i, m_i, q, k_head, v_head, ks_head, vs_head, pt_row, pos, s2, last_key, scale_log2,
                                  stride_kp, stride_kt, stride_vp, stride_vt, stride_sp, stride_st, d, d_mask, KD, VD,
                                  kvh * HEAD_DIM, BLOCK_N, PAGE_SIZE, HEAD_DIM, BLOCK_D, True, PRECISION, UPCAST,
                                  KV_QUANT, TMA, PREFETCH, SAME_ROWS, ROWS32, lo, window, softcap_log2, WINDOWED, SOFTCAP)
    if NEW_KV:
        tok_first = mblk * BLOCK_MT
        self_full = ((tok_first + 1) // BLOCK_N) * BLOCK_N          # chunk keys every row sees
        self_end = tl.minimum(tok_first + BLOCK_MT, q_len)
        if WINDOWED:            # the same phases over the chunk's keys (chunk indices; rows at tok)
            _, c0, c1, c2 = _window_phases(tok_first, self_end - 1, self_full, window, BLOCK_N)
            acc, l_i, m_i = _new_kv_range(acc, l_i, m_i, q, KN, VN, q_start, kvh * HEAD_DIM, tok, c0, c1,
                                          scale_log2, BLOCK_N, True, PRECISION, UPCAST,
                                          window, softcap_log2, WINDOWED, SOFTCAP)
        else:
            c1, c2 = 0, self_full
        acc, l_i, m_i = _new_kv_range(acc, l_i, m_i, q, KN, VN, q_start, kvh * HEAD_DIM, tok, c1, c2,
                                      scale_log2, BLOCK_N, False, PRECISION, UPCAST,
                                      window, softcap_log2, WINDOWED, SOFTCAP)
        acc, l_i, m_i = _new_kv_range(acc, l_i, m_i, q, KN, VN, q_start, kvh * HEAD_DIM, tok, c2, self_end,
                                      scale_log2, BLOCK_N, True, PRECISION, UPCAST,
                                      window, softcap_log2, WINDOWED, SOFTCAP)
    if KV_QUANT == 2:
        v_scale = v_scale / P_GAIN
    if WINDOWED:    # padding rows (past the chunk) may see no key of the window: 0, not 0 / 0
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (v_scale / l_i)[:, None]
    o_rows = (q_start + tok).to(tl.int64)
    tl.store(O + o_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(O.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# Tuning defaults (H200, bf16, head_dim 128; see docs/develop/kernels.md); BLOCK_M (rows = query tokens x
# heads of one group) is prefill_tiles', where the work lists are built.
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
TMA_DEFAULT = True


@dataclass(frozen=True)
class PrefillLaunch:
    """A prefill launch's tile (rows = query tokens x the group's heads, keys), warps and stages, and
    whether K/V tiles come by bulk copy (TMA) with each tile's page id read one tile ahead."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False


PER_THREAD = PrefillLaunch(BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES)
# Where a page holds whole 128- or 64-key tiles, one bulk copy loads a tile and the larger tile pays:
# 0.80-0.93x FA3 at page 128 and 0.77-0.86x at page 64 on prompts and long chunks, against 0.59-0.69x
# for the page-16 launch (perf/kernels/bench_prefill_ceiling.py, H200, 2026-12-06). Largest first.
TMA_LAUNCHES = ((128, PrefillLaunch(128, 128, 8, 3, tma=True)), (64, PrefillLaunch(128, 64, 8, 3, tma=True)))
# The chunk's own keys read from the step's K/V (k_new, v_new): those tiles are bulk copies at any
# page size, so a smaller page takes the large tile too; its cached prefix keeps per-thread loads,
# each tile's page ids read one tile ahead.
NEW_KV_LAUNCH = PrefillLaunch(128, 128, 8, 3)


def default_launch(page_size: int, cache_dtype: torch.dtype, head_dim: int, device: torch.device,
                   new_kv: bool = False) -> PrefillLaunch:
    """The launch paged_prefill_attention makes when the caller names no tile, and the tile size the
    engine must build its work lists with (prefill_tiles.tokens_per_tile(..., block_m)): a function
    of the pool's shape, dtype and device, and of whether the caller passes the step's own K/V
    (``new_kv``, where new_kv_applies), so the two always agree. 16-bit pools only: float32 tiles of
    this size and depth would not fit in shared memory."""
    if TMA_DEFAULT and cache_dtype in (torch.float16, torch.bfloat16) and tma_capable(cache_dtype, head_dim, device):
        for multiple, launch in TMA_LAUNCHES:
            if page_size % multiple == 0:
                return launch
        if new_kv:
            return NEW_KV_LAUNCH
    return PER_THREAD


def new_kv_applies(cache_dtype: torch.dtype, dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether prefill can read a chunk's own keys from the step's K/V instead of the pool: the pool
    holds exactly those values (16-bit, the activations' dtype) and descriptors can load them."""
    return cache_dtype == dtype and cache_dtype in (torch.float16, torch.bfloat16) and tma_capable(
        cache_dtype, head_dim, device)


@functools.lru_cache(maxsize=None)
def _pages_tma_module():
    """prefill_pages_tma (its rows per program are NEW_KV_LAUNCH's: the same work lists), or None
    where this Triton has no Gluon (before 3.5): the Triton launch then serves every page size."""
    try:
        from . import prefill_pages_tma
    except ImportError:
        return None
    return prefill_pages_tma


@functools.lru_cache(maxsize=None)     # every eager prefill launch asks, per layer: one device query
def tma_capable(cache_dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Pages a descriptor can load: unquantized, head_dim a power of two (the box), Hopper or later
    (the interpreter on the CPU runs descriptors too)."""
    return (cache_dtype not in (torch.int8, kv_quant.FP8) and head_dim == triton.next_power_of_2(head_dim)
            and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9))


def tma_applies(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> bool:
    """Whether a K/V tile can be one bulk copy: a page holds whole tiles of a contiguous pool that
    tma_capable accepts."""
    _, page_size, _, d = k_cache.shape
    return (page_size % block_n == 0 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and tma_capable(k_cache.dtype, d, k_cache.device))


def _page_descriptor(cache: torch.Tensor, block_n: int):
    """The pool as rows of slots [P * S, Hkv * D]: a tile is the box [block_n, D] at (slot, head * D)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    p, s, hkv, d = cache.shape
    return TensorDescriptor.from_tensor(cache.view(p * s, hkv * d), [block_n, d])


def _rows_descriptor(x: torch.Tensor, block_n: int):
    """A step's K or V [T, Hkv, D] (a view of the fused projection: any token stride, heads back to
    back) as rows [T, Hkv * D]: a tile is the box [block_n, D] at (token, head * D)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    t, hkv, d = x.shape
    return TensorDescriptor(x, [t, hkv * d], [x.stride(0), 1], [block_n, d])


def _check_new_kv(k_new: torch.Tensor, v_new: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    t, _, d = q.shape
    hkv = k_cache.shape[2]
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.shape != (t, hkv, d) or x.dtype != k_cache.dtype:
            raise ValueError(f"paged_prefill_attention: {name} must be {k_cache.dtype} [{t}, {hkv}, {d}], got "
                             f"{x.dtype} {tuple(x.shape)}")
        # a bulk copy's rows: heads back to back, 16-byte aligned base and token stride
        if (x.stride(2) != 1 or x.stride(1) != d or (x.stride(0) * x.element_size()) % 16
                or x.data_ptr() % 16):
            raise ValueError(f"paged_prefill_attention: {name} needs contiguous heads and a 16-byte aligned "
                             f"token stride, got strides {x.stride()}")
    if not new_kv_applies(k_cache.dtype, q.dtype, d, q.device):
        raise ValueError("paged_prefill_attention: k_new/v_new need a 16-bit pool of q's dtype, a power-of-two "
                         "head_dim and a device with tensor descriptors (new_kv_applies)")


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            out: torch.Tensor | None = None, *, max_query_len: int | None = None,
                            k_scale=None, v_scale=None, tiles: torch.Tensor | None = None,
                            debug: bool | None = None, block_m: int | None = None, block_n: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            tma: bool | None = None, prefetch_page_ids: bool | None = None,
                            k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                            rows32: bool | None = None, page_copies: bool = False, window: int = 0,
                            softcap: float = 0.0) -> torch.Tensor:
    """q [T, Hq, D] (requests back to back); query_start_loc int32 [B+1]; context_lens int32 [B].

    k_scale/v_scale: an int8 cache's float32 [P, S, Hkv] scales, an fp8 cache's per-tensor floats.
    tiles: int32 [N, 2] (request, query block) per program (prefill_tiles.plan_tiles with this
    call's block size; unused entries request -1): the grid is N x KV heads, and max_query_len is
    not used.
    block_m, block_n, num_warps, num_stages: default_launch's for this pool unless given (a work list
    must be built with the same block_m).
    tma: load K/V tiles with the tensor-memory accelerator (Hopper's bulk copies through a tensor
    descriptor) instead of per-thread addresses; only where a tile is one page's slice (page_size a
    multiple of block_n) of a contiguous unquantized pool with a power-of-two head_dim. None: where
    the default launch does and it applies.
    prefetch_page_ids: where a tile is one page's slice or whole pages, read the next tile's page
    ids one iteration ahead. None: with TMA or k_new.
    k_new, v_new: the step's own K (rotated) and V [T, Hkv, D], the values write_kv stored in the
    pool (new_kv_applies: a 16-bit pool of q's dtype). Given, each request's chunk reads its own keys
    from them (one bulk copy a tile, whatever the page size) and only its cached prefix through the
    page table; the tiles then start at the chunk's first token, not at position 0, so the sums
    round in another order than without them.
    rows32: compute the pool's row offsets in int32 (None: where every offset into both pools fits;
    False forces int64, for tests).
    page_copies: with k_new/v_new at a page smaller than the 128-key tile on Hopper, run
    prefill_pages_tma's Gluon kernel (each prefix tile one bulk copy per page, ping-pong consumers)
    where it applies and the launch is the default one (the engine's default: 0.89-0.99x of FA3
    against this kernel's 0.73-0.98x on an H100, docs/develop/kernels.md); never with a window or a
    cap, which that kernel does not implement.
    window W > 0: a query at position p sees keys p - W < j <= p (HF's sliding-window mask); each
    program's key loop starts at the tile of its first query's window, so pages wholly before the
    first query's window are never read (their entries may be -1), with k_new/v_new too.
    softcap C > 0: scores become C * tanh(score / C) before the softmax. Both constexpr-gated."""
    t, hq, d = q.shape
    nb = page_table.shape[0]
    checks.check_attention_shapes(q, k_cache, v_cache, page_table, context_lens, nb, "context_lens")
    mode, k_scale, v_scale = kv_quant.check_scales(k_cache, v_cache, k_scale, v_scale, "paged_prefill_attention")
    window, softcap = checks.check_window_args(window, softcap, "paged_prefill_attention")
    if query_start_loc.shape != (nb + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32 [B+1], got {query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    if q.dtype != k_cache.dtype and mode == kv_quant.NONE:
        raise ValueError(f"paged_prefill_attention: q is {q.dtype}, the cache {k_cache.dtype}")
    num_pages, page_size, hkv, _ = k_cache.shape
    if tiles is not None and (tiles.dtype != torch.int32 or tiles.dim() != 2 or tiles.shape[1] != 2
                              or not tiles.is_contiguous()):
        raise ValueError(f"tiles must be contiguous int32 [N, 2], got {tiles.dtype} {tuple(tiles.shape)}")
    if checks.debug_enabled(debug):
        checks.check_query_values(query_start_loc, context_lens, t, padded=tiles is not None)
        checks.check_page_table_values(page_table, context_lens, num_pages, page_size, window,
                                       query_start_loc[1:] - query_start_loc[:-1])
    if out is None:
        out = torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"paged_prefill_attention: out must be {q.dtype} {tuple(q.shape)} with a contiguous head_dim")
    if t == 0 or nb == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if (k_new is None) != (v_new is None):
        raise ValueError("paged_prefill_attention: k_new and v_new come together")
    new_kv = k_new is not None
    if new_kv:
        _check_new_kv(k_new, v_new, q, k_cache)
    group = hq // hkv
    block_g = triton.next_power_of_2(group)
    launch = default_launch(page_size, k_cache.dtype, d, q.device, new_kv=new_kv)
    block_mt = tokens_per_tile(hq, hkv, block_m or launch.block_m)   # query tokens per program (a work list's)
    if tiles is not None and checks.debug_enabled(debug):
        checks.check_tile_values(tiles, query_start_loc, block_mt)
    if (page_copies and new_kv and launch == NEW_KV_LAUNCH and not (window or softcap)
            and not any((block_m, block_n, num_warps, num_stages, tma))):
        prefill_pages_tma = _pages_tma_module()
        if prefill_pages_tma is not None and prefill_pages_tma.applies(k_cache, v_cache, q):
            return prefill_pages_tma.paged_prefill_pages_tma(q, k_cache, v_cache, page_table, query_start_loc,
                                                             context_lens, scale, k_new, v_new, out, tiles=tiles,
                                                             max_query_len=max_query_len)
    if tiles is not None:
        grid = (tiles.shape[0], hkv)
    else:
        max_query_len = t if max_query_len is None else max_query_len
        grid = (triton.cdiv(max_query_len, block_mt), nb, hkv)
    ks, vs, stride_sp, stride_st, kf, vf = scale_launch_args(mode, k_cache, k_scale, v_scale)
    block_n = block_n or launch.block_n
    applies = tma_applies(k_cache, v_cache, block_n)
    use_tma = (launch.tma and applies) if tma is None else tma
    if use_tma and not applies:
        raise ValueError("paged_prefill_attention: tma needs page_size a multiple of block_n, contiguous unquantized "
                         f"pools and a power-of-two head_dim (page {page_size}, block_n {block_n}, "
                         f"{k_cache.dtype}, head_dim {d})")
    # reading ids ahead needs a tile of one page's slice or of whole pages; by default with TMA, and
    # with the step's K/V, where the prefix's 128-key tiles span 8 pages at page 16: 440-454 against
    # 389-399 TFLOP/s on the 32k chunk (bench_prefill_ceiling, H100, 2026-12-06)
    ahead = ((use_tma or new_kv) if prefetch_page_ids is None else prefetch_page_ids) and (
        page_size % block_n == 0 or (page_size > 1 and block_n % page_size == 0))
    kd = vd = kn = vn = None
    if use_tma:
        kd, vd = (_page_descriptor(c, block_n) for c in (k_cache, v_cache))
    if new_kv:
        kn, vn = (_rows_descriptor(x, block_n) for x in (k_new, v_new))
    _prefill_kernel[grid](
        q, kv_quant.storage_view(k_cache), kv_quant.storage_view(v_cache), ks, vs, out, page_table, query_start_loc,
        context_lens, query_start_loc if tiles is None else tiles, kd, vd, kn, vn, scale * kf * LOG2E, vf,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_sp, stride_st, page_table.stride(0),
        window, softcap * LOG2E,
        GROUP=group, BLOCK_G=block_g, BLOCK_MT=block_mt, BLOCK_M=block_mt * block_g, BLOCK_N=block_n,
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), PAGE_SIZE=page_size,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreter_bf16(q.dtype, mode), KV_QUANT=mode,
        TILED=tiles is not None, TMA=use_tma, PREFETCH=ahead, NEW_KV=new_kv,
        **checks.row_offset_flags(k_cache, v_cache, rows32), WINDOWED=window > 0, SOFTCAP=softcap > 0,
        num_warps=num_warps or launch.num_warps, num_stages=num_stages or launch.num_stages,
    )
    return out
