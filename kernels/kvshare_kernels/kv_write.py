"""write_kv: scatter the new tokens' K/V into their pool slots (prefill and decode alike).

One program per (token, block of heads): it reads the slot once, and if the slot is -1 (padding,
or a token whose KV is not kept) it writes nothing. A slot is page_id * page_size + offset, so a
token lands at k_cache[page_id, offset]; the kernel computes the address from the cache's strides
and never assumes the pages are contiguous in memory beyond one token's [Hkv, D].

8-bit caches (kv_quant): fp8 e4m3 values are x / scale saturated; int8 rows are quantized per
(token, head) and their scales written to k_scale/v_scale [P, S, Hkv] beside the page. A program
always holds whole heads (BLOCK_D covers head_dim), which int8's per-head max needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import checks, kv_quant
from .kv_tiles import store_kv_rows


@triton.jit
def _write_kv_kernel(K, V, KC, VC, KS, VS, SLOTS, inv_k_scale, inv_v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
                     stride_sp, stride_st,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, KV_QUANT: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < NUM_HEADS
    mask = h_mask[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(K + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(V + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    if KV_QUANT != 0:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s_offs = page * stride_sp + off * stride_st + h
    store_kv_rows(KC, KS, k, page * stride_kcp + off * stride_kct + h[:, None] * stride_kch + d[None, :], s_offs,
                  mask, h_mask, inv_k_scale, KV_QUANT)
    store_kv_rows(VC, VS, v, page * stride_vcp + off * stride_vct + h[:, None] * stride_vch + d[None, :], s_offs,
                  mask, h_mask, inv_v_scale, KV_QUANT)


def scale_launch_args(mode: int, k_cache: torch.Tensor, k_scale, v_scale):
    """(KS, VS, stride_sp, stride_st, k_factor, v_factor) for a launch: int8's scale tensors, or the
    cache standing in for them (never read); fp8's per-tensor scales as floats, else 1.0."""
    if mode == kv_quant.INT8_MODE:
        return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1), 1.0, 1.0
    if mode == kv_quant.FP8_MODE:
        return k_cache, k_cache, 0, 0, k_scale, v_scale
    return k_cache, k_cache, 0, 0, 1.0, 1.0


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale=None, v_scale=None, debug: bool | None = None) -> None:
    """k, v [T, Hkv, D] (any token/head strides, contiguous D); slot_mapping int32 [T], -1 = skip.

    k_scale/v_scale: int8 caches' float32 [P, S, Hkv] scale tensors (written); fp8's per-tensor floats."""
    checks.check_cache_pair(k_cache, v_cache)
    mode, k_scale, v_scale = kv_quant.check_scales(k_cache, v_cache, k_scale, v_scale, "write_kv")
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
    ks, vs, stride_sp, stride_st, kf, vf = scale_launch_args(mode, k_cache, k_scale, v_scale)
    kc, vc = kv_quant.storage_view(k_cache), kv_quant.storage_view(v_cache)
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(hkv), 4096 // block_d))   # <= 4096 elements per program
    grid = (t, triton.cdiv(hkv, block_h))
    _write_kv_kernel[grid](
        k, v, kc, vc, ks, vs, slot_mapping, 1.0 / kf, 1.0 / vf,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_sp, stride_st,
        NUM_HEADS=hkv, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, PAGE_SIZE=page_size, KV_QUANT=mode,
        num_warps=4,
    )
