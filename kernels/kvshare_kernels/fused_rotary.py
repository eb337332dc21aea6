"""rotary_embedding: rotate q and k in place at their positions, one Triton program per token.

Rotate-half convention (Llama, HF): with x = [x1 | x2] (halves of the head dim) and the tables
cos/sin [max_position, D] whose two halves are equal (``cat([freqs, freqs])``),

    x1' = x1 * cos[p, :D/2] - x2 * sin[p, :D/2]
    x2' = x2 * cos[p, D/2:] + x1 * sin[p, D/2:]

computed in fp32 and rounded once to the activation dtype. A program reads its token's position
(int32 or int64) and cos/sin row once and rotates every q head and every k head of the token, so
one launch replaces the ~12 small kernels of the torch version (gathers, slices, cat, mul, add).
q and k may be strided views of a fused qkv projection (any token and head stride, contiguous D).

rotary_write_kv does the same for q and, in the same program, writes the rotated k and v straight
into their pool slots (write_kv's job): the rotated k never goes back to the projection buffer (the
attention reads keys from the pool only), one launch per layer instead of two. Its rounding is the
unfused pair's: rotated k is rounded to the activation dtype, then stored in the cache's dtype.
8-bit caches are quantized as write_kv quantizes (kv_tiles): int8 takes each head's max over both
rotated halves, so a program rotates a whole head before it stores either half.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import checks, kv_quant
from .kv_tiles import fp8_bits, int8_values, store_kv_rows
from .kv_write import scale_launch_args


@triton.jit
def _rotate_heads(X, t, stride_t, stride_h, cos1, sin1, cos2, sin2, DST, dst_base, stride_dh,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Token t's heads of X rotated into DST + dst_base (X itself: in place; a pool slot: the cache).
    Rounded to X's dtype first, then stored in DST's, as a rotation followed by a copy would."""
    d = tl.arange(0, BLOCK_HALF)
    for h0 in range(0, NUM_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HALF)
        p1 = X + t * stride_t + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
        o1 = DST + dst_base + h[:, None] * stride_dh + d[None, :]
        tl.store(o1, (x1 * cos1 - x2 * sin1).to(X.dtype.element_ty).to(DST.dtype.element_ty), mask=mask)
        tl.store(o1 + HALF, (x2 * cos2 + x1 * sin2).to(X.dtype.element_ty).to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads_quantized(X, t, stride_t, stride_h, cos1, sin1, cos2, sin2, DST, S, dst_base, s_base, stride_dh,
                            inv_scale, NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_HALF: tl.constexpr, KV_QUANT: tl.constexpr):
    """_rotate_heads into an 8-bit cache: rounded to X's dtype, then quantized (fp8 per tensor, int8
    per head over both halves with its scale at S + s_base + head)."""
    d = tl.arange(0, BLOCK_HALF)
    for h0 in range(0, NUM_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_mask = h < NUM_HEADS
        mask = h_mask[:, None] & (d[None, :] < HALF)
        p1 = X + t * stride_t + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
        r1 = (x1 * cos1 - x2 * sin1).to(X.dtype.element_ty).to(tl.float32)
        r2 = (x2 * cos2 + x1 * sin2).to(X.dtype.element_ty).to(tl.float32)
        o1 = DST + dst_base + h[:, None] * stride_dh + d[None, :]
        if KV_QUANT == 1:
            tl.store(o1, fp8_bits(r1, inv_scale), mask=mask)
            tl.store(o1 + HALF, fp8_bits(r2, inv_scale), mask=mask)
        else:
            amax = tl.maximum(tl.max(tl.where(mask, tl.abs(r1), 0.0), axis=1),
                              tl.max(tl.where(mask, tl.abs(r2), 0.0), axis=1))
            tl.store(o1, int8_values(r1, amax), mask=mask)
            tl.store(o1 + HALF, int8_values(r2, amax), mask=mask)
            tl.store(S + s_base + h, amax / 127.0, mask=h_mask)


@triton.jit
def _cos_sin(COS, SIN, pos, stride_cos, stride_sin, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Position pos's rows of the tables, as the fp32 [1, D/2] halves (cos1, sin1, cos2, sin2)."""
    d = tl.arange(0, BLOCK_HALF)
    dm = d < HALF
    cos1 = tl.load(COS + pos * stride_cos + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(COS + pos * stride_cos + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(SIN + pos * stride_sin + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(SIN + pos * stride_sin + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
    return cos1, sin1, cos2, sin2


@triton.jit
def _rotary_kernel(Q, K, V, COS, SIN, POS, KC, VC, KS, VS, SLOTS, inv_k_scale, inv_v_scale,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
                   stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch, stride_sp, stride_st,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, TO_CACHE: tl.constexpr, KV_QUANT: tl.constexpr,
                   K_IN_PLACE: tl.constexpr):
    """TO_CACHE: rotated k and v go to the token's pool slot (rotary_write_kv), and with K_IN_PLACE
    rotated k goes back into K too; else k is rotated in place and V, KC, VC, SLOTS are not touched
    (rotary_embedding)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    cos1, sin1, cos2, sin2 = _cos_sin(COS, SIN, pos, stride_cos, stride_sin, HALF, BLOCK_HALF)
    _rotate_heads(Q, t, stride_qt, stride_qh, cos1, sin1, cos2, sin2, Q, t * stride_qt, stride_qh,
                  NUM_Q_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    if not TO_CACHE:
        _rotate_heads(K, t, stride_kt, stride_kh, cos1, sin1, cos2, sin2, K, t * stride_kt, stride_kh,
                      NUM_K_HEADS, HALF, BLOCK_H, BLOCK_HALF)
        return
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:                     # -1: padding, or a token whose KV is not kept
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        s_base = page * stride_sp + off * stride_st
        if KV_QUANT == 0:
            _rotate_heads(K, t, stride_kt, stride_kh, cos1, sin1, cos2, sin2, KC, page * stride_kcp + off * stride_kct,
                          stride_kch, NUM_K_HEADS, HALF, BLOCK_H, BLOCK_HALF)
        else:
            _rotate_heads_quantized(K, t, stride_kt, stride_kh, cos1, sin1, cos2, sin2, KC, KS,
                                    page * stride_kcp + off * stride_kct, s_base, stride_kch, inv_k_scale,
                                    NUM_K_HEADS, HALF, BLOCK_H, BLOCK_HALF, KV_QUANT)
        e = tl.arange(0, BLOCK_D)
        for h0 in range(0, NUM_K_HEADS, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            h_mask = h < NUM_K_HEADS
            mask = h_mask[:, None] & (e[None, :] < HEAD_DIM)
            v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + e[None, :], mask=mask, other=0.0)
            if KV_QUANT != 0:
                v = v.to(tl.float32)
            store_kv_rows(VC, VS, v, page * stride_vcp + off * stride_vct + h[:, None] * stride_vch + e[None, :],
                          s_base + h, mask, h_mask, inv_v_scale, KV_QUANT)
    if K_IN_PLACE:                    # after the cache's copy, which read the unrotated k
        _rotate_heads(K, t, stride_kt, stride_kh, cos1, sin1, cos2, sin2, K, t * stride_kt, stride_kh,
                      NUM_K_HEADS, HALF, BLOCK_H, BLOCK_HALF)


def _launch(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, to_cache: bool,
            mode: int = kv_quant.NONE, k_scale=None, v_scale=None, k_in_place: bool = False) -> None:
    t, hq, d = q.shape
    hkv = k.shape[1]
    half = d // 2
    block_half = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(hq, hkv)), 2048 // block_half))
    ks, vs, stride_sp, stride_st, kf, vf = scale_launch_args(mode, k_cache, k_scale, v_scale)
    _rotary_kernel[(t,)](
        q, k, v, cos, sin, positions, kv_quant.storage_view(k_cache), kv_quant.storage_view(v_cache), ks, vs,
        slot_mapping, 1.0 / kf, 1.0 / vf,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        stride_sp, stride_st,
        NUM_Q_HEADS=hq, NUM_K_HEADS=hkv, HALF=half, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        PAGE_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_HALF=block_half, TO_CACHE=to_cache, KV_QUANT=mode,
        K_IN_PLACE=k_in_place, num_warps=4,
    )


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, *, k_scale=None, v_scale=None, k_in_place: bool = False) -> torch.Tensor:
    """rotary_embedding(q, k) and write_kv(k, v) in one launch; returns q (rotated in place).

    k, v [T, Hkv, D] are read only (k is NOT rotated in place: its rotated values go to the cache),
    unless k_in_place: then k is rotated in place too, for a prefill that reads the chunk's keys
    from the step (paged_prefill_attention's k_new), every token, slot or not;
    k_cache, v_cache [P, page_size, Hkv, D]; slot_mapping int32/int64 [T], -1 = write nothing.
    k_scale/v_scale: as write_kv's (int8 scale tensors, written; fp8 per-tensor floats).
    """
    _check(q, k, cos, sin, positions)
    checks.check_cache_pair(k_cache, v_cache)
    mode, k_scale, v_scale = kv_quant.check_scales(k_cache, v_cache, k_scale, v_scale, "rotary_write_kv")
    t, _, d = q.shape
    hkv = k_cache.shape[2]
    if k.shape != (t, hkv, d) or v.shape != (t, hkv, d):
        raise ValueError(f"rotary_write_kv: k {tuple(k.shape)} / v {tuple(v.shape)} must be [T, {hkv}, {d}]")
    if v.stride(-1) != 1:
        raise ValueError("rotary_write_kv: v needs a contiguous last dim")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rotary_write_kv: slot_mapping must be int32 [{t}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if t:
        _launch(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, True, mode, k_scale, v_scale,
                k_in_place)
    return q


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] rotated in place at positions [T] (int32/int64); returns (q, k).

    cos, sin: [max_position, D] tables (rows indexed by position; contiguous D). Positions must
    lie in [0, max_position): they are not checked (a device check would synchronise).
    """
    _check(q, k, cos, sin, positions)
    if q.shape[0]:
        # without TO_CACHE the kernel never reads V, KC, VC or SLOTS: k stands in for them
        k4 = k.unsqueeze(1)
        _launch(q, k, k, cos, sin, positions, k4, k4, positions, False)
    return q, k


def _check(q, k, cos, sin, positions) -> None:
    t, _, d = q.shape
    if k.dim() != 3 or k.shape[0] != t or k.shape[2] != d or d % 2:
        raise ValueError(f"rotary_embedding: q {tuple(q.shape)} / k {tuple(k.shape)} must be [T, H, D] with even D")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_embedding: q and k need a contiguous last dim (they are rotated in place)")
    if cos.dim() != 2 or cos.shape[1] != d or sin.shape != cos.shape or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"rotary_embedding: cos/sin must be [max_position, {d}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rotary_embedding: positions must be int32/int64 [{t}], got {positions.dtype} {tuple(positions.shape)}")


__all__ = ["rotary_embedding", "rotary_write_kv"]
