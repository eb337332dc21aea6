"""Triton helpers that read and write K/V in the pool's layout (16-bit, fp8 e4m3 bits, int8 + scales).

``KV_QUANT`` (constexpr) is kv_quant.mode_of(cache): 0 none, 1 fp8 e4m3 (uint8 storage, per-tensor
scale applied by the caller: folded into the score scale for K, into the output for V), 2 int8
with a float32 scale per (token, KV head) at S + page * stride_sp + slot * stride_st + head, which
readers fold into the scores (K: a per-column scale of q @ k^T) and the probabilities (V: p * scale
before p @ v) instead of scaling tile elements.
"""

from __future__ import annotations

import triton
import triton.language as tl


# int8: p is multiplied by the V scales (amax / 127) before it becomes a dot operand; in fp16 small
# products would fall into subnormals and lose bits. 2^7 (exact) keeps p * scale near p * amax; the
# kernels take it back out of the output.
P_GAIN = tl.constexpr(128.0)


@triton.jit
def page_index(page, ROWS32: tl.constexpr):
    """A page id as a tile's row offsets are computed from it. ROWS32 (checks.row_offset_flags):
    every offset into the pools fits in int32, so page x stride stays 32-bit instead of the 64-bit
    multiplies and adds of int64 offsets (fewer instructions per tile: docs/develop/kernels.md)."""
    if not ROWS32:
        page = page.to(tl.int64)
    return page


@triton.jit
def kv_rows(page, slot, stride_kp, stride_kt, stride_vp, stride_vt, SAME_ROWS: tl.constexpr):
    """Row offsets of tokens (page, slot) in the K and V pools. SAME_ROWS: the pools share their
    strides (the engine's do), so V reads K's offsets from its own base: one computation, not two."""
    k_rows = page * stride_kp + slot * stride_kt
    if SAME_ROWS:
        v_rows = k_rows
    else:
        v_rows = page * stride_vp + slot * stride_vt
    return k_rows, v_rows


@triton.jit
def load_kv_tile(C, rows, cols, mask, KV_QUANT: tl.constexpr):
    """Tile [N, BLOCK_C] of a cache at C + rows[:, None] + cols[None, :], as stored (fp8 bits bitcast to
    e4m3). No scale is applied here: the caller converts the tile to the dot's dtype (int8 exactly, fp8
    with the native convert) and folds the scales into the scores and probabilities, so a load feeds
    its dot through one convert, with no float32 multiply per element."""
    if KV_QUANT == 0:
        x = tl.load(C + rows[:, None] + cols[None, :], mask=mask, other=0.0)
    else:
        x = tl.load(C + rows[:, None] + cols[None, :], mask=mask, other=0)
        if KV_QUANT == 1:
            x = x.to(tl.float8e4nv, bitcast=True)
    return x


@triton.jit
def dot_query(q, KV_QUANT: tl.constexpr):
    """The query as the dots over this pool's tiles take it: over fp8 e4m3 tiles, fp16.

    e4m3 -> fp16 is one native convert per pair on Hopper (cvt.rn.f16x2.e4m3x2); e4m3 -> bf16 takes
    that plus a scalar convert per element at a quarter of the ALU rate, which held fp8 decode to the
    elements per second of bf16 decode (1.6-2.0 TB/s of fp8 bytes against 3.9-4.3 for bf16 pages on
    the H200). So over fp8 tiles the dots run in fp16: q is rounded to fp16 once per program (clamped
    to its range, so that a bf16 query cannot become inf), the tiles convert natively, and p goes to
    fp16 too (11 bits for [0, 1] instead of bf16's 8); scores and the output accumulate in float32 as
    before. checks.interpreter_bf16 does not upcast bf16 for the interpreter here (its fp16 dots are
    right), so CPU tests run this same path. int8 keeps the query's dtype: Triton converts int8 to bf16 by integer
    tricks at full rate and to fp16 by a quarter-rate I2F (perf/kernels/sass_loop.py counts both)."""
    if KV_QUANT == 1 and q.dtype != tl.float32:     # a float32 query keeps exact float32 dots
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def token_scales(S, s_rows, kvh0, row_head, n_mask, factor, HEADS: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """int8 per-(token, KV head) scales times ``factor`` as a multiplier of a score or probability tile:
    element (r, n) is token n's scale for row r's KV head kvh0 + row_head[r], read at S + s_rows[n] +
    that head. One head: [1, BLOCK_N] (one 4-byte load per token); HEADS > 1: [BLOCK_R, BLOCK_N] from
    HEADS such loads (never one load per tile element)."""
    if HEADS == 1:
        sc = (tl.load(S + s_rows + kvh0, mask=n_mask, other=0.0) * factor)[None, :]
    else:
        sc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        for h in tl.static_range(HEADS):
            sh = tl.load(S + s_rows + (kvh0 + h), mask=n_mask, other=0.0) * factor
            sc = tl.where((row_head == h)[:, None], sh[None, :], sc)
    return sc


@triton.jit
def fp8_bits(x, inv_scale):
    """float32 x as the uint8 bits of saturate(x * inv_scale) in e4m3, rounded to nearest even
    (kv_quant.quantize: torch's conversion).

    Encoded with integer and float32 arithmetic instead of ``.to(tl.float8e4nv)``: Triton 3.9's
    interpreter converts to fp8 wrongly when rounding carries into the exponent (7.9 -> 4.0) and
    flushes values below 2^-6, so the CPU tests could not check the cast. Adding and subtracting
    2^23 times the value's quantum rounds to a multiple of that quantum, ties to even, in any
    IEEE float32 unit; the result is then re-read as exponent and 3 mantissa bits.
    """
    y = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)     # -6: subnormals share 2^-9
    magic = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True)                # 2^(e - 3 + 23)
    r = (a + magic) - magic                                                      # a rounded to 2^(e-3)
    rb = r.to(tl.int32, bitcast=True)
    normal = (((rb >> 23) - 120) << 3) | ((rb >> 20) & 7)                       # exponent - 127 + 7
    sub = (r * 512.0).to(tl.int32)                                               # multiples of 2^-9
    code = tl.where(r >= 0.015625, normal, sub)
    code = tl.where(y < 0, code | 0x80, code)
    return code.to(tl.uint8)


@triton.jit
def int8_values(x, amax):
    """float32 x [H, D] quantized with its rows' max magnitudes amax [H] (kv_quant.quantize)."""
    y = x * (127.0 / tl.maximum(amax, 1e-30))[:, None]
    return tl.minimum(tl.maximum(tl.where(y >= 0, y + 0.5, y - 0.5), -127.0), 127.0).to(tl.int8)


@triton.jit
def store_kv_rows(C, S, x, offs, s_offs, mask, row_mask, inv_scale, KV_QUANT: tl.constexpr):
    """One token's heads x [BLOCK_H, BLOCK_D] (float32 unless KV_QUANT is 0) into C + offs, quantized
    as kv_quant.quantize does: fp8 saturate(x * inv_scale); int8 per row (head) with its scale at
    S + s_offs [BLOCK_H]."""
    if KV_QUANT == 0:
        tl.store(C + offs, x.to(C.dtype.element_ty), mask=mask)
    elif KV_QUANT == 1:
        tl.store(C + offs, fp8_bits(x, inv_scale), mask=mask)
    else:
        amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
        tl.store(C + offs, int8_values(x, amax), mask=mask)
        tl.store(S + s_offs, amax / 127.0, mask=row_mask)


@triton.jit
def softcap_scores(qk, cap):
    """cap * tanh(qk / cap) (Gemma 2's attention logit soft-capping) of a score tile; qk and cap in
    the same units (the kernels' log2-scaled scores, so cap is C * log2(e)). tanh through exp2 of
    the magnitude: Triton has no tanh that runs both compiled and under the interpreter, and
    exp2(+large) = inf gives tanh = 1 exactly instead of inf / inf. Its absolute error near 0 is
    fp32's epsilon, C * 6e-8 on a score: far below the softmax's rounding."""
    x = qk / cap
    t = 1.0 - 2.0 / (tl.exp2(2.8853900817779268 * tl.abs(x)) + 1.0)     # 2 * log2(e) * |x|
    return cap * tl.where(x < 0.0, -t, t)
