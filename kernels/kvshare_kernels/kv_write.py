"""write_kv: scatter the new tokens' K/V into their pool slots (prefill and decode alike).

One program per (token, block of heads): it reads the slot once, and if the slot is -1 (padding,
or a token whose KV is not kept) it writes nothing. A slot is page_id * page_size + offset, so a
token lands at k_cache[page_id, offset]; the kernel computes the address from the cache's strides
and never assumes the pages are contiguous in memory beyond one token's [Hkv, D].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import checks


@triton.jit
def _write_kv_kernel(K, V, KC, VC, SLOTS,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(K + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(V + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(KC + page * stride_kcp + off * stride_kct + h[:, None] * stride_kch + d[None, :],
             k.to(KC.dtype.element_ty), mask=mask)
    tl.store(VC + page * stride_vcp + off * stride_vct + h[:, None] * stride_vch + d[None, :],
             v.to(VC.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, debug: bool | None = None) -> None:
    """k, v [T, Hkv, D] (any token/head strides, contiguous D); slot_mapping int32 [T], -1 = skip."""
    checks.check_cache_pair(k_cache, v_cache)
    num_pages, page_size, hkv, d = k_cache.shape
    t = k.shape[0]
    if k.shape != (t, hkv, d) or v.shape != (t, hkv, d):
        raise ValueError(f"write_kv: k {tuple(k.shape)} / v {tuple(v.shape)} must be [T, {hkv}, {d}]")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"write_kv: slot_mapping must be int32 [{t}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if checks.debug_enabled(debug):
        checks.check_slot_values(slot_mapping, num_pages * page_size)
    if t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(hkv), 4096 // block_d))   # <= 4096 elements per program
    grid = (t, triton.cdiv(hkv, block_h))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=hkv, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, PAGE_SIZE=page_size,
        num_warps=4,
    )
