"""Paged prefill at small pages with Hopper bulk copies: a 128-key tile is assembled from one TMA copy
per page (Gluon).

At page 16 a 128-key tile of the cached prefix spans 8 pages. The Triton kernel
(prefill_attention.py) gathers those rows thread by thread with cp.async: every thread computes the
addresses of its rows, and its loop runs 562 instructions a warp and iteration against 493 where a
page holds the whole tile and one descriptor copies it (sass_loop --prefill). On an H100 that gather
is what separates page 16 from page 128 on prefix-heavy shapes: extends 4 x (2048+512) at 0.71-0.76x
of FlashAttention 3 against 0.86-0.91x, a chunk after 30k cached tokens at 0.71-0.79x against
0.83-0.93x (perf/results/peer-serving/2026-12-06/kernels-h100-ahead/prefill-ceiling.md). A tensor
descriptor cannot address 8 scattered pages as one box, and Triton's compiler offers no way to copy
into a slice of one shared-memory tile; Gluon, Triton's lower-level dialect, does. Here each page
of a tile is one copy of a [PAGE_SIZE, D] box into consecutive rows of one [BLOCK_N, D] buffer,
all completing on one mbarrier, and the buffer is the tensor cores' operand as a whole.

The contract is paged_prefill_attention's with the step's own K/V (``k_new``/``v_new``, the
engine's launch on Hopper): 16-bit pools of q's dtype, a power-of-two head_dim of 64 or 128, a page
size that divides the 128-key tile. One program takes BLOCK_M rows (query tokens x the query heads of
one KV head, as in prefill_attention.py) and walks first the cached prefix's tiles through the page
table, then the chunk's own keys from the step's rows (one copy a tile), two stages deep, in one of
ORDERS (below): the next tiles' copies are in flight while this one is multiplied. Only the tile that
holds the prefix's end and the chunk's diagonal tiles are masked. Page ids past the prefix's last page
are clamped to it, so every copy reads pages of this request; rows the tile must not use (other slots
of the last page, the clamped pages, the next request's rows) get masked scores and V rows zeroed in
shared memory.

Measured on an H100 (2026-12-07, docs/develop/kernels.md): correct in every order. Copying a tile page by
page does not by itself close the gap (the producer order at 0.68-0.82x of FlashAttention 3, the
Triton launch at 0.73-0.98x); with the ping-pong consumers it does, 0.89-0.99x, so the engine runs this
kernel on Hopper wherever it applies (KVSHARE_PREFILL_PAGE_COPIES=0: prefill_attention.py's launch).

Gluon runs only compiled on a GPU (no interpreter): the CPU tests compile it for sm_90
(perf/kernels/hopper_compile.py) and the GPU tests compare it with the torch reference.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .prefill_tiles import IDLE, tokens_per_tile

LOG2E = 1.4426950408889634
# The engine builds its work lists for prefill_attention's NEW_KV_LAUNCH: the same rows per program.
BLOCK_M = 128
BLOCK_N = 128
NUM_WARPS = 8
# How a program orders its copies and products: "serial" (each tile's Q K^T, softmax and P V in turn,
# the next tile's copies in flight), "overlapped" (tile i's Q K^T and softmax beside tile i-1's P V)
# "producer" (the overlapped order, with a warp of its own issuing every copy) or "pingpong" (the
# producer's, with two consumer warpgroups of 64 rows each taking turns on the tensor cores). On an
# H100 (2026-12-07, bench_prefill_ceiling.py) pingpong ran 475-590 TFLOP/s, producer 377-473, serial
# 329-437, overlapped 284-386 (its CTA-wide barrier before each copy undoes its overlap).
ORDERS = ("serial", "overlapped", "producer", "pingpong")
ORDER = "pingpong"
IDLE_TILE: gl.constexpr = gl.constexpr(IDLE)
# The bulk copy's name: async_copy_global_to_shared in the GPU image's Triton 3.6, async_load since.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# A barrier among the warps of one partition: thread_barrier in 3.6, barrier since.
_thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# The producer warp's registers (setmaxnreg): page ids and copy coordinates need few.
PRODUCER_REGS: gl.constexpr = gl.constexpr(40)
# PINGPONG's registers: the producer warp's, and the second consumer warpgroup's; the first, the
# default partition, gets what is left of the 168 x 384 the launch holds, 240 as well with these.
PINGPONG_PRODUCER_REGS: gl.constexpr = gl.constexpr(24)
CONSUMER_REGS: gl.constexpr = gl.constexpr(240)


@gluon.jit
def _page_rows(pt_row, i, n_pre, n_pages, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, num_warps: gl.constexpr):
    """The first pool rows of prefix tile i's pages, [BLOCK_N // PAGE_SIZE], every thread holding all of
    them (0 for a tile that is not the prefix's); ids past the prefix's last page are clamped to it."""
    ids_layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // PAGE_SIZE], [32], [num_warps], [0])
    idx = gl.minimum(i * (BLOCK_N // PAGE_SIZE) + gl.arange(0, BLOCK_N // PAGE_SIZE, layout=ids_layout), n_pages - 1)
    return gl.load(pt_row + idx, mask=(idx >= 0) & (i < n_pre), other=0) * PAGE_SIZE


@gluon.jit
def _issue_copies(i, rows, n_pre, q_start, kv_col, desc, new_desc, buf, bar,
                  BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """Starts the copies of one operand (K or V) of tile i into buf, completing on bar (whose expected
    bytes are the caller's): a prefix tile one page at a time from `rows` (_page_rows, read an
    iteration earlier), or one of the chunk's own tiles from the step's rows in one copy."""
    if i < n_pre:
        which = gl.arange(0, BLOCK_N // PAGE_SIZE, layout=rows.type.layout)
        for p in gl.static_range(BLOCK_N // PAGE_SIZE):
            # every thread holds every row: the sum picks one in registers, with no shuffle
            row = gl.sum(gl.where(which == p, rows, 0), axis=0)
            _tma_load(desc, [row, kv_col], bar, buf.slice(p * PAGE_SIZE, PAGE_SIZE))
    else:
        _tma_load(new_desc, [q_start + (i - n_pre) * BLOCK_N, kv_col], bar, buf)


@gluon.jit
def _zero_unused_v_rows(v_buf, i, n_pre, prefix, q_len, n_io, io_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Rows past the prefix's end (other slots of its last page, the clamped pages) or past the chunk
    (the next request, a graph's padding) may hold anything, NaN included: their probabilities are 0,
    and 0 * NaN would still reach the output, so tile i's V rows there are zeroed. One tile per
    program at most, the others are whole."""
    valid = gl.where(i < n_pre, prefix - i * BLOCK_N, q_len - (i - n_pre) * BLOCK_N)
    if valid < BLOCK_N:
        v_tile = v_buf.load(io_layout)
        v_tile = gl.where((n_io < valid)[:, None], v_tile, gl.zeros_like(v_tile))
        v_buf.store(v_tile)
        fence_async_shared()


@gluon.jit
def _masked_scores(s, i, n_pre, prefix, q_len, first_masked, c_s, tok_s, BLOCK_N: gl.constexpr):
    """Tile i's scores with -inf where a key is past the prefix's end (the prefix's last tile) or after
    the row's token or past the chunk (the chunk's diagonal tiles); other tiles as they are."""
    if (i == n_pre - 1) & (prefix % BLOCK_N != 0):
        s = gl.where((i * BLOCK_N + c_s < prefix)[None, :], s, float("-inf"))
    elif i >= first_masked:
        j = (i - n_pre) * BLOCK_N + c_s
        s = gl.where((j[None, :] <= tok_s[:, None]) & (j < q_len)[None, :], s, float("-inf"))
    return s


@gluon.jit
def _online_softmax(s, m_i, l_i, scale_log2):
    """One tile's step of the online softmax: (p, alpha, m, l) for scores s, where alpha rescales what
    was accumulated under the running maximum m_i."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
    p = gl.exp2(s * scale_log2 - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _produce_tiles(k_desc, v_desc, kn_desc, vn_desc, k_bufs, v_bufs, bars, pt_row, n_pre, n_pages, n_tiles,
                   q_start, kv_col, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, TILE_BYTES: gl.constexpr):
    """The producer warp (PRODUCER): every tile's K and V copies, each into its stage once the
    consumers have released it (bars 4-5 / 6-7: K / V stage empty), completing on bars 0-1 / 2-3.
    An empty barrier's first wait is on the phase before its first, which has completed."""
    for i in range(n_tiles):
        slot = i % 2
        free = ((i // 2) & 1) ^ 1
        rows = _page_rows(pt_row, i, n_pre, n_pages, BLOCK_N, PAGE_SIZE, 1)
        mbarrier.wait(bars.index(4 + slot), free)
        mbarrier.expect(bars.index(slot), TILE_BYTES)
        _issue_copies(i, rows, n_pre, q_start, kv_col, k_desc, kn_desc, k_bufs.index(slot), bars.index(slot),
                      BLOCK_N, PAGE_SIZE)
        mbarrier.wait(bars.index(6 + slot), free)
        mbarrier.expect(bars.index(2 + slot), TILE_BYTES)
        _issue_copies(i, rows, n_pre, q_start, kv_col, v_desc, vn_desc, v_bufs.index(slot), bars.index(2 + slot),
                      BLOCK_N, PAGE_SIZE)


@gluon.jit
def _refill(j, rows, n_tiles, n_pre, q_start, kv_col, desc, new_desc, buf, full_bar, empty_bar,
            BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, TILE_BYTES: gl.constexpr, SELF_ISSUE: gl.constexpr):
    """A stage's last product is done. SELF_ISSUE: tile j's copies of one operand go into it now (if
    there is a tile j; `rows` are its page ids); else the producer warp is told the stage is free, once
    every warp of this partition is past it."""
    if SELF_ISSUE:
        if j < n_tiles:
            mbarrier.expect(full_bar, TILE_BYTES)
            _issue_copies(j, rows, n_pre, q_start, kv_col, desc, new_desc, buf, full_bar, BLOCK_N, PAGE_SIZE)
    else:       # one arrival per partition (PINGPONG: one per consumer warpgroup, a count of 2)
        _thread_barrier()
        mbarrier.arrive(empty_bar, count=1)


@gluon.jit
def _consume_tiles(q_buf, k_bufs, v_bufs, bars, n_tiles, n_pre, prefix, q_len, first_masked, c_s, tok_s, n_io,
                   scale_log2, m_i, l_i, acc, k_desc, v_desc, kn_desc, vn_desc, pt_row, n_pages, q_start, kv_col,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr, TILE_BYTES: gl.constexpr,
                   SELF_ISSUE: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                   io_layout: gl.constexpr, num_warps: gl.constexpr, PINGPONG: gl.constexpr = False,
                   FIRST: gl.constexpr = True):
    """FlashAttention 3's order within a warpgroup: tile i's Q K^T is issued before tile i-1's P V, and
    tile i's softmax runs while that P V is on the tensor cores; (acc, l) of the rows. K and V stages
    have barriers of their own (bars 0-1 / 2-3 full, 4-5 / 6-7 empty): a K stage is free once its
    Q K^T is done, a V stage once its P V is. SELF_ISSUE (OVERLAP): these warps refill a free stage
    themselves, tiles 0 and 1 already in flight; else (PRODUCER) they release it to the producer warp.
    PINGPONG: these warps are one of two consumer warpgroups, each with its own rows, that take turns
    issuing their products (bars 8 / 9: the first's / the second's turn), so that one's softmax runs
    under the other's products."""
    dtype: gl.constexpr = q_buf.dtype
    rows = 0
    if SELF_ISSUE:
        rows = _page_rows(pt_row, 2, n_pre, n_pages, BLOCK_N, PAGE_SIZE, num_warps)
    mbarrier.wait(bars.index(0), 0)
    s = warpgroup_mma(q_buf, k_bufs.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                      use_acc=False)
    _refill(2, rows, n_tiles, n_pre, q_start, kv_col, k_desc, kn_desc, k_bufs.index(0), bars.index(0), bars.index(4),
            BLOCK_N, PAGE_SIZE, TILE_BYTES, SELF_ISSUE)
    s = _masked_scores(s, 0, n_pre, prefix, q_len, first_masked, c_s, tok_s, BLOCK_N)
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, scale_log2)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    # entering iteration i: tile i-1's probabilities in p_op, its V copies issued; tile i's K too
    for i in range(1, n_tiles):
        slot = i % 2
        prev = 1 - slot
        rows_k = 0
        rows_v = 0
        if SELF_ISSUE:
            # page ids read well before their copies are issued: tile i+2's K's after Q K^T is done,
            # tile i+1's V's after P V (registers forbid holding them across iterations)
            rows_k = _page_rows(pt_row, i + 2, n_pre, n_pages, BLOCK_N, PAGE_SIZE, num_warps)
        # tile i-1's V before tile i's Q K^T: zeroing its unused rows while an accumulator is in
        # flight would hold registers for both (and spill)
        mbarrier.wait(bars.index(2 + prev), ((i - 1) // 2) & 1)
        _zero_unused_v_rows(v_bufs.index(prev), i - 1, n_pre, prefix, q_len, n_io, io_layout, BLOCK_N)
        mbarrier.wait(bars.index(slot), (i // 2) & 1)
        if PINGPONG:    # a turn barrier's first wait of the first warpgroup is on the completed phase before
            mbarrier.wait(bars.index(8 if FIRST else 9), ((i - 1) & 1) ^ (1 if FIRST else 0))
        s_tok = warpgroup_mma(q_buf, k_bufs.index(slot).permute((1, 0)),
                              gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(bars.index(9 if FIRST else 8), count=1)
        s, acc_tok = warpgroup_mma_wait(1, deps=[s_tok, acc_tok])
        _refill(i + 2, rows_k, n_tiles, n_pre, q_start, kv_col, k_desc, kn_desc, k_bufs.index(slot), bars.index(slot),
                bars.index(4 + slot), BLOCK_N, PAGE_SIZE, TILE_BYTES, SELF_ISSUE)
        if SELF_ISSUE:
            rows_v = _page_rows(pt_row, i + 1, n_pre, n_pages, BLOCK_N, PAGE_SIZE, num_warps)
        s = _masked_scores(s, i, n_pre, prefix, q_len, first_masked, c_s, tok_s, BLOCK_N)
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, scale_log2)
        acc = warpgroup_mma_wait(0, deps=[acc_tok])
        _refill(i + 1, rows_v, n_tiles, n_pre, q_start, kv_col, v_desc, vn_desc, v_bufs.index(prev),
                bars.index(2 + prev), bars.index(6 + prev), BLOCK_N, PAGE_SIZE, TILE_BYTES, SELF_ISSUE)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    last = n_tiles - 1
    mbarrier.wait(bars.index(2 + last % 2), (last // 2) & 1)
    _zero_unused_v_rows(v_bufs.index(last % 2), last, n_pre, prefix, q_len, n_io, io_layout, BLOCK_N)
    acc = warpgroup_mma(p_op, v_bufs.index(last % 2), acc)
    return acc, l_i


@gluon.jit
def _store_rows(O, acc, l_i, q_start, q_len, tok_first, kvh, stride_ot, stride_oh, ROW0: gl.constexpr,
                ROWS: gl.constexpr, GROUP: gl.constexpr, BLOCK_G: gl.constexpr, HEAD_DIM: gl.constexpr,
                o_layout: gl.constexpr, io_layout: gl.constexpr):
    """Normalises and stores a program's rows ROW0 .. ROW0 + ROWS (row r: token r // BLOCK_G, head of
    the group r % BLOCK_G); padding heads and tokens past the chunk are not stored."""
    r_io = ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
    d_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    tok_io = tok_first + r_io // BLOCK_G
    g_io = r_io % BLOCK_G
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    out = gl.convert_layout(out.to(O.dtype.element_ty), io_layout)
    o_rows = (q_start + tok_io).to(gl.int64) * stride_ot + (kvh * GROUP + g_io) * stride_oh
    gl.store(O + o_rows[:, None] + d_io[None, :], out, mask=((tok_io < q_len) & (g_io < GROUP))[:, None])


@gluon.jit
def _consume_half(O, q_buf, k_bufs, v_bufs, bars, n_tiles, n_pre, prefix, q_len, first_masked, tok_first, kvh,
                  stride_ot, stride_oh, scale_log2, q_start, ROW0: gl.constexpr, ROWS: gl.constexpr,
                  GROUP: gl.constexpr, BLOCK_G: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                  s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, io_layout: gl.constexpr,
                  num_warps: gl.constexpr):
    """One of PINGPONG's two consumer warpgroups: rows ROW0 .. ROW0 + ROWS of the program, from the
    producer's tiles, taking turns with the other; stores its own rows."""
    c_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    tok_s = tok_first + (ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))) // BLOCK_G
    n_io = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    # the copy arguments (descriptors, page table, page size, bytes) are the producer's: 0 here
    acc, l_i = _consume_tiles(q_buf.slice(ROW0, ROWS), k_bufs, v_bufs, bars, n_tiles, n_pre, prefix, q_len,
                              first_masked, c_s, tok_s, n_io, scale_log2, m_i, l_i, acc, 0, 0, 0, 0, 0, 0, q_start, 0,
                              ROWS, BLOCK_N, 16, 0, False, s_layout, o_layout, p_layout, io_layout, num_warps,
                              True, ROW0 == 0)
    _store_rows(O, acc, l_i, q_start, q_len, tok_first, kvh, stride_ot, stride_oh, ROW0, ROWS, GROUP, BLOCK_G,
                HEAD_DIM, o_layout, io_layout)


@gluon.jit
def _prefill_pages_tma_kernel(
    Q, O, PT, QSL, CTX, TILES, k_desc, v_desc, kn_desc, vn_desc, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ptb,
    GROUP: gl.constexpr, BLOCK_G: gl.constexpr, BLOCK_MT: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, TILED: gl.constexpr,
    OVERLAP: gl.constexpr, PRODUCER: gl.constexpr, PINGPONG: gl.constexpr, num_warps: gl.constexpr,
):
    if TILED:
        tile = gl.program_id(0)
        b = gl.load(TILES + 2 * tile)
        mblk = gl.load(TILES + 2 * tile + 1)
        kvh = gl.program_id(1)
    else:
        mblk = gl.program_id(0)
        b = gl.program_id(1)
        kvh = gl.program_id(2)
    if b == IDLE_TILE:
        return
    q_start = gl.load(QSL + b)
    q_len = gl.load(QSL + b + 1) - q_start
    if mblk * BLOCK_MT >= q_len:
        return
    prefix = gl.load(CTX + b) - q_len

    dtype: gl.constexpr = Q.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    tile_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    TILE_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM * 2

    # Rows: BLOCK_MT query tokens x BLOCK_G heads of this KV head's group (row r: token r // BLOCK_G).
    r_io = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io_layout))
    d_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    tok_io = mblk * BLOCK_MT + r_io // BLOCK_G
    g_io = r_io % BLOCK_G
    row_ok = (tok_io < q_len) & (g_io < GROUP)
    q_rows = (q_start + tok_io).to(gl.int64) * stride_qt + (kvh * GROUP + g_io) * stride_qh
    q = gl.load(Q + q_rows[:, None] + d_io[None, :], mask=row_ok[:, None], other=0.0)
    q_buf = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_smem, q)
    k_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], tile_smem)
    v_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], tile_smem)
    # barriers 0-1: each stage's K full (and V, unless OVERLAP or PRODUCER); 2-3: its V full; with
    # PRODUCER or PINGPONG, 4-5 and 6-7: its K and V empty (released by each consumer warpgroup); with
    # PINGPONG, 8-9: the first and the second consumer's turn
    bars = gl.allocate_shared_memory(gl.int64, [10, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(10):
        mbarrier.init(bars.index(j), count=2 if PINGPONG and j >= 4 and j < 8 else 1)
    fence_async_shared()        # Q's stores and the barriers' init, before the async proxy reads them

    # Tiles: the prefix's ceil(prefix / BLOCK_N) through the page table (the last one masked at
    # `prefix`), then the chunk's keys up to this block's last token (its diagonal tiles masked).
    n_pages = gl.cdiv(prefix, PAGE_SIZE)
    n_pre = gl.cdiv(prefix, BLOCK_N)
    tok_first = mblk * BLOCK_MT
    self_end = gl.minimum(tok_first + BLOCK_MT, q_len)
    n_tiles = n_pre + gl.cdiv(self_end, BLOCK_N)
    first_masked = n_pre + (tok_first + 1) // BLOCK_N      # chunk tiles every row sees in full come before
    pt_row = PT + b * stride_ptb
    kv_col = kvh * HEAD_DIM

    n_io = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io_layout))
    c_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    tok_s = tok_first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)) // BLOCK_G
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    if PINGPONG:
        # FlashAttention 3's ping-pong: the producer warp, and two consumer warpgroups of 64 rows each
        # (the default partition and a worker of as many warps) that take turns on the tensor cores
        gl.warp_specialize(
            [(_consume_half, (O, q_buf, k_bufs, v_bufs, bars, n_tiles, n_pre, prefix, q_len, first_masked, tok_first,
                              kvh, stride_ot, stride_oh, scale_log2, q_start, 0, BLOCK_M // 2, GROUP, BLOCK_G, BLOCK_N,
                              HEAD_DIM, s_layout, o_layout, p_layout, io_layout, num_warps)),
             (_produce_tiles, (k_desc, v_desc, kn_desc, vn_desc, k_bufs, v_bufs, bars, pt_row, n_pre, n_pages,
                               n_tiles, q_start, kv_col, BLOCK_N, PAGE_SIZE, TILE_BYTES)),
             (_consume_half, (O, q_buf, k_bufs, v_bufs, bars, n_tiles, n_pre, prefix, q_len, first_masked, tok_first,
                              kvh, stride_ot, stride_oh, scale_log2, q_start, BLOCK_M // 2, BLOCK_M // 2, GROUP,
                              BLOCK_G, BLOCK_N, HEAD_DIM, s_layout, o_layout, p_layout, io_layout, num_warps))],
            [1, num_warps], [PINGPONG_PRODUCER_REGS, CONSUMER_REGS])
    elif PRODUCER:
        # FlashAttention 3's split: one warp issues every copy, the two warpgroups only wait for tiles
        # and multiply; the copies' barriers leave the consumers' path
        acc, l_i = gl.warp_specialize(
            [(_consume_tiles, (q_buf, k_bufs, v_bufs, bars, n_tiles, n_pre, prefix, q_len, first_masked, c_s, tok_s,
                               n_io, scale_log2, m_i, l_i, acc, k_desc, v_desc, kn_desc, vn_desc, pt_row, n_pages,
                               q_start, kv_col, BLOCK_M, BLOCK_N, PAGE_SIZE, TILE_BYTES, False, s_layout, o_layout,
                               p_layout, io_layout, num_warps)),
             (_produce_tiles, (k_desc, v_desc, kn_desc, vn_desc, k_bufs, v_bufs, bars, pt_row, n_pre, n_pages,
                               n_tiles, q_start, kv_col, BLOCK_N, PAGE_SIZE, TILE_BYTES))],
            [1], [PRODUCER_REGS])
    elif OVERLAP:
        for j in gl.static_range(2):    # tiles 0 and 1, K and V
            rows = _page_rows(pt_row, j, n_pre, n_pages, BLOCK_N, PAGE_SIZE, num_warps)
            _refill(j, rows, n_tiles, n_pre, q_start, kv_col, k_desc, kn_desc, k_bufs.index(j), bars.index(j),
                    bars.index(4 + j), BLOCK_N, PAGE_SIZE, TILE_BYTES, True)
            _refill(j, rows, n_tiles, n_pre, q_start, kv_col, v_desc, vn_desc, v_bufs.index(j), bars.index(2 + j),
                    bars.index(6 + j), BLOCK_N, PAGE_SIZE, TILE_BYTES, True)
        acc, l_i = _consume_tiles(q_buf, k_bufs, v_bufs, bars, n_tiles, n_pre, prefix, q_len, first_masked, c_s, tok_s,
                                  n_io, scale_log2, m_i, l_i, acc, k_desc, v_desc, kn_desc, vn_desc, pt_row, n_pages,
                                  q_start, kv_col, BLOCK_M, BLOCK_N, PAGE_SIZE, TILE_BYTES, True, s_layout, o_layout,
                                  p_layout, io_layout, num_warps)
    else:
        # Page ids are read an iteration before their copies are issued, so that no copy waits on a
        # table read of its own iteration (as prefill_attention.py's PREFETCH).
        rows = _page_rows(pt_row, 0, n_pre, n_pages, BLOCK_N, PAGE_SIZE, num_warps)
        mbarrier.expect(bars.index(0), 2 * TILE_BYTES)
        _issue_copies(0, rows, n_pre, q_start, kv_col, k_desc, kn_desc, k_bufs.index(0), bars.index(0),
                      BLOCK_N, PAGE_SIZE)
        _issue_copies(0, rows, n_pre, q_start, kv_col, v_desc, vn_desc, v_bufs.index(0), bars.index(0),
                      BLOCK_N, PAGE_SIZE)
        rows = _page_rows(pt_row, 1, n_pre, n_pages, BLOCK_N, PAGE_SIZE, num_warps)
        for i in range(n_tiles):
            slot = i % 2
            if i + 1 < n_tiles:
                # the other stage's last reader, tile i - 1's wgmma, was waited for in its iteration
                mbarrier.expect(bars.index(1 - slot), 2 * TILE_BYTES)
                _issue_copies(i + 1, rows, n_pre, q_start, kv_col, k_desc, kn_desc, k_bufs.index(1 - slot),
                              bars.index(1 - slot), BLOCK_N, PAGE_SIZE)
                _issue_copies(i + 1, rows, n_pre, q_start, kv_col, v_desc, vn_desc, v_bufs.index(1 - slot),
                              bars.index(1 - slot), BLOCK_N, PAGE_SIZE)
                rows = _page_rows(pt_row, i + 2, n_pre, n_pages, BLOCK_N, PAGE_SIZE, num_warps)
            mbarrier.wait(bars.index(slot), (i // 2) & 1)
            _zero_unused_v_rows(v_bufs.index(slot), i, n_pre, prefix, q_len, n_io, io_layout, BLOCK_N)
            s = warpgroup_mma(q_buf, k_bufs.index(slot).permute((1, 0)),
                              gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False)
            s = _masked_scores(s, i, n_pre, prefix, q_len, first_masked, c_s, tok_s, BLOCK_N)
            p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, scale_log2)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(slot), acc)

    for j in gl.static_range(10):
        mbarrier.invalidate(bars.index(j))
    if not PINGPONG:
        _store_rows(O, acc, l_i, q_start, q_len, tok_first, kvh, stride_ot, stride_oh, 0, BLOCK_M, GROUP, BLOCK_G,
                    HEAD_DIM, o_layout, io_layout)


def applies(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether this kernel takes a pair of pools: 16-bit of q's dtype, contiguous (a descriptor's
    rows), a head_dim of 64 or 128, a page size of at least 8 that divides the 128-key tile (the
    swizzle's 8-row atoms), on a Hopper GPU."""
    _, page_size, _, d = k_cache.shape
    return (k_cache.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype and d in (64, 128)
            and BLOCK_N % page_size == 0 and page_size % 8 == 0 and k_cache.is_contiguous()
            and v_cache.is_contiguous() and q.device.type == "cuda"
            and torch.cuda.get_device_capability(q.device)[0] == 9)


def _descriptor(rows: torch.Tensor, box_rows: int, head_dim: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], _GL_DTYPES[rows.dtype])
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [box_rows, head_dim], layout)


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def paged_prefill_pages_tma(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            k_new: torch.Tensor, v_new: torch.Tensor, out: torch.Tensor | None = None, *,
                            tiles: torch.Tensor | None = None, max_query_len: int | None = None,
                            order: str = ORDER, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """paged_prefill_attention(q, k_cache, v_cache, page_table, query_start_loc, context_lens, scale,
    out, k_new=k_new, v_new=v_new, tiles=tiles) for a pool that ``applies``; the same shapes and
    argument checks are the caller's (paged_prefill_attention makes them). A work list must be built
    with ``tokens_per_tile(Hq, Hkv, BLOCK_M)``; order: one of ORDERS. window > 0 and softcap > 0
    raise NotImplementedError (paged_prefill_attention's Triton launch takes such layers)."""
    if window or softcap:
        raise NotImplementedError(f"paged_prefill_pages_tma does not support "
                                  f"{'window' if window else 'softcap'}={window or softcap!r}")
    if order not in ORDERS:
        raise ValueError(f"paged_prefill_pages_tma: order {order!r} is none of {ORDERS}")
    t, hq, d = q.shape
    num_pages, page_size, hkv, _ = k_cache.shape
    nb = page_table.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or nb == 0:
        return out
    group = hq // hkv
    block_g = triton.next_power_of_2(group)
    block_mt = tokens_per_tile(hq, hkv, BLOCK_M)
    if tiles is not None:
        grid = (tiles.shape[0], hkv)
    else:
        grid = (triton.cdiv(t if max_query_len is None else max_query_len, block_mt), nb, hkv)
    k_desc = _descriptor(k_cache.view(num_pages * page_size, hkv * d), page_size, d)
    v_desc = _descriptor(v_cache.view(num_pages * page_size, hkv * d), page_size, d)
    kn_desc = _descriptor(k_new.view(t, hkv * d) if k_new.is_contiguous() else _rows(k_new), BLOCK_N, d)
    vn_desc = _descriptor(v_new.view(t, hkv * d) if v_new.is_contiguous() else _rows(v_new), BLOCK_N, d)
    _prefill_pages_tma_kernel[grid](
        q, out, page_table, query_start_loc, context_lens, query_start_loc if tiles is None else tiles,
        k_desc, v_desc, kn_desc, vn_desc, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), page_table.stride(0),
        GROUP=group, BLOCK_G=block_g, BLOCK_MT=block_mt, BLOCK_M=block_mt * block_g, BLOCK_N=BLOCK_N, HEAD_DIM=d,
        PAGE_SIZE=page_size, TILED=tiles is not None, OVERLAP=order == "overlapped", PRODUCER=order == "producer",
        PINGPONG=order == "pingpong", num_warps=NUM_WARPS // 2 if order == "pingpong" else NUM_WARPS,
    )
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A step's K or V [T, Hkv, D] with contiguous heads and any token stride (a view of the fused
    projection) as rows [T, Hkv * D] of that stride."""
    t, hkv, d = x.shape
    return x.as_strided((t, hkv * d), (x.stride(0), 1))
