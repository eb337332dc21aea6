"""paged_decode_attention: one new query token per request against its paged K/V.

Decode attention is a pass over the KV bytes (a few FLOPs per byte), so everything here serves
bandwidth:

* GQA: one program per (request, KV head, split) loads each K/V tile once and uses it for all
  ``G = Hq // Hkv`` query heads of that KV head (the G rows are padded to 16 for ``tl.dot``; with
  G == 1 the dot products are done element-wise instead, no padding).
* Paging: token n of request b lives at ``k_cache[page_table[b, n // P], n % P]``. When a tile of
  BLOCK_N tokens fits in one page (P >= BLOCK_N) one page id serves the whole tile; otherwise each
  row looks its own page up (P = 1 .. BLOCK_N/2, e.g. SGLang's P = 1).
* Split-K: a request's context is cut into ``num_splits`` equal ranges so that small batches still
  fill the GPU; each split writes its normalised partial output and log-sum-exp (base 2), and a
  second kernel merges them. The split count comes from shapes the host already knows (batch,
  heads, ``max_context``), never from reading context_lens, so the launcher never synchronises
  and works inside CUDA graphs. With one split the first kernel writes the output directly.
* Online softmax in fp32 with exp2 (the scale is pre-multiplied by log2(e)).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from . import checks
from .checks import interpreter_bf16

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    Q, K, V, O, PO, PLSE, PT, CTX, scale_log2, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_ptb,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(CTX + b)
    # Each request cuts its own context into num_splits ranges of whole tiles.
    split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    head = kvh * GROUP + g
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_row = tl.sum(q.to(tl.float32), axis=0)        # the single row when GROUP == 1 (no-dot path)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    pt_row = PT + b * stride_ptb
    k_head = K + kvh * stride_kh
    v_head = V + kvh * stride_vh
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        if PAGE_SIZE % BLOCK_N == 0:
            # The tile lies in one page (tiles start at multiples of BLOCK_N): one page-table read.
            page = tl.load(pt_row + n // PAGE_SIZE).to(tl.int64)
        else:
            page = tl.load(pt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = offs_n % PAGE_SIZE
        if BLOCK_D == HEAD_DIM:
            kv_mask = n_mask[:, None]          # row-constant mask keeps the loads 16 bytes wide
        else:
            kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_head + (page * stride_kp + in_page * stride_kt)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_head + (page * stride_vp + in_page * stride_vt)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:      # the interpreter's tl.dot multiplies bf16 as raw integers
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if USE_DOT:
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)                  # [BLOCK_G, N]
        else:   # GROUP == 1: a one-row dot would be padded to 16 rows; multiply-add instead
            qk = tl.sum(k.to(tl.float32) * q_row[None, :], axis=1)[None, :]        # [1, N]
        qk = tl.where(n_mask[None, :], qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        else:
            pv = tl.sum(tl.sum(p, axis=0)[:, None] * v.to(tl.float32), axis=0)[None, :]
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    empty = l_i == 0.0                  # a split past this request's context
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # Partial results: PO [B, Hq, S, D] fp32, PLSE [B, Hq, S] fp32 (log2 domain).
        row = (b * (tl.num_programs(1) * GROUP) + head) * num_splits + s
        tl.store(PO + row[:, None] * HEAD_DIM + d[None, :], out, mask=store_mask)
        tl.store(PLSE + row, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))),
                 mask=g_mask)
    else:
        tl.store(O + b * stride_ob + head[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=store_mask)


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


# Tuning defaults (chosen on the H200, see docs/kernels.md).
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
MIN_SPLIT_TOKENS = 256      # fewer tokens per split cost more in merge traffic than they gain
MAX_SPLITS = 64
TARGET_WAVES = 2            # aim for this many programs per SM before splitting stops


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device,
                      block_n: int = BLOCK_N) -> int:
    """Static split-K heuristic: enough programs to fill the GPU, never splits shorter than MIN_SPLIT_TOKENS."""
    programs = batch * num_kv_heads
    want = triton.cdiv(TARGET_WAVES * _num_sms(device), max(1, programs))
    by_len = triton.cdiv(max(1, max_context), max(MIN_SPLIT_TOKENS, block_n))
    return max(1, min(want, by_len, MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
                           max_context: int | None = None, num_splits: int | None = None,
                           debug: bool | None = None, block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, use_dot: bool | None = None) -> torch.Tensor:
    """q [B, Hq, D]; page_table int32 [B, max_pages]; context_lens int32 [B] -> out [B, Hq, D].

    max_context: an upper bound of context_lens known on the host (default: the page table's
    capacity, max_pages * page_size); it only sizes the split-K heuristic. num_splits overrides the
    heuristic. block_n/num_warps/num_stages/use_dot are tuning knobs for tests and benchmarks.
    """
    b, hq, d = q.shape
    checks.check_attention_shapes(q, k_cache, v_cache, page_table, context_lens, b, "context_lens")
    num_pages, page_size, hkv, _ = k_cache.shape
    if checks.debug_enabled(debug):
        checks.check_page_table_values(page_table, context_lens, num_pages, page_size)
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    if q.dtype != k_cache.dtype:
        raise ValueError(f"paged_decode_attention: q is {q.dtype}, the cache {k_cache.dtype}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = hq // hkv
    block_n = block_n or BLOCK_N
    if max_context is None:
        max_context = page_table.shape[1] * page_size
    if num_splits is None:
        num_splits = choose_num_splits(b, hkv, max_context, q.device, block_n)
    if use_dot is None:
        use_dot = group > 1
    if not use_dot and group != 1:
        raise ValueError("paged_decode_attention: use_dot=False needs one query head per KV head")
    block_g = max(16, triton.next_power_of_2(group)) if use_dot else 1
    block_d = triton.next_power_of_2(d)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    split = num_splits > 1
    if split:
        po = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
        plse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        po = plse = out        # unused
    _decode_split_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, out, po, plse, page_table, context_lens, scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0),
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=block_n, PAGE_SIZE=page_size,
        SPLIT=split, USE_DOT=use_dot, PRECISION=precision, UPCAST=interpreter_bf16(q.dtype),
        num_warps=num_warps or NUM_WARPS, num_stages=num_stages or NUM_STAGES,
    )
    if split:
        _decode_merge_kernel[(b, hq)](
            po, plse, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4,
        )
    return out
