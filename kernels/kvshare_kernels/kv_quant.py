"""8-bit KV pages: what a quantized pool holds, and the torch quantize/dequantize every path agrees with.

Three page layouts, told apart by the cache tensor's dtype (docs/develop/kernels.md):

* 16/32-bit (``auto``): K/V in the model's dtype; no scales.
* ``torch.float8_e4m3fn``: K/V as fp8 e4m3 with ONE scale per tensor (a Python float, default 1.0):
  stored = saturate(x / scale), read back as stored * scale. Kernels receive the bytes as uint8
  (numpy, hence the Triton interpreter, has no fp8) and bitcast them to ``tl.float8e4nv``.
* ``torch.int8``: symmetric int8 with a scale per (token, KV head): a float32 tensor
  [num_pages, page_size, Hkv] beside each cache, page dimension first, so that a page and its
  scales move together. stored = round(x * 127 / amax) (half away from zero), scale = amax / 127.

Every writer (write_kv, rotary_write_kv, the reference) quantizes with the same float32 operations
in the same order, so the Triton kernels and the torch reference store the same bytes up to the
last bit of a division (tests allow one quantum).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # largest finite e4m3 value; larger magnitudes saturate to it
INT8_MAX = 127.0
AMAX_FLOOR = 1e-30       # an all-zero head stores zeros with scale 0, never a division by zero

NONE, FP8_MODE, INT8_MODE = 0, 1, 2


def mode_of(cache: torch.Tensor) -> int:
    """The kernels' ``KV_QUANT`` constexpr for a cache tensor: 0 none, 1 fp8 e4m3, 2 int8."""
    if cache.dtype == FP8:
        return FP8_MODE
    if cache.dtype == torch.int8:
        return INT8_MODE
    return NONE


def storage_view(cache: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel (or a torch indexing op, which has no fp8 CPU kernels) reads: fp8 as uint8."""
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def is_8bit(dtype: torch.dtype) -> bool:
    return dtype in (FP8, torch.int8)


def check_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale, what: str):
    """(mode, k_scale, v_scale) with fp8's defaults filled in; a clear error for a missing or wrong scale."""
    mode = mode_of(k_cache)
    if mode == INT8_MODE:
        want = tuple(k_cache.shape[:3])
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(s, torch.Tensor):
                raise ValueError(f"{what}: an int8 cache needs {name}, a float32 tensor {list(want)}")
            if tuple(s.shape) != want or s.dtype != torch.float32 or s.device != k_cache.device or s.stride(-1) != 1:
                raise ValueError(f"{what}: {name} must be float32 {list(want)} on {k_cache.device} with a contiguous "
                                 f"last dim, got {s.dtype} {list(s.shape)} on {s.device}")
        if k_scale.stride() != v_scale.stride():
            raise ValueError(f"{what}: k_scale and v_scale need the same strides (the kernels share them)")
        return mode, k_scale, v_scale
    if mode == FP8_MODE:
        out = []
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            s = 1.0 if s is None else s
            if isinstance(s, torch.Tensor) or not s > 0:
                raise ValueError(f"{what}: an fp8 cache takes {name} as a positive float (per-tensor), got {s!r}")
            out.append(float(s))
        return mode, out[0], out[1]
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"{what}: k_scale/v_scale are for 8-bit caches, the cache is {k_cache.dtype}")
    return mode, None, None


def quantize(x: torch.Tensor, dtype: torch.dtype, scale=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., D] -> (values in ``dtype``, int8's per-row float32 scales [...] or None)."""
    if dtype == FP8:
        inv = 1.0 / (1.0 if scale is None else float(scale))
        return (x.float() * inv).clamp_(-FP8_MAX, FP8_MAX).to(FP8), None
    if dtype == torch.int8:
        xf = x.float()
        amax = xf.abs().amax(dim=-1)
        y = xf * (INT8_MAX / amax.clamp_min(AMAX_FLOOR))[..., None]
        y = torch.where(y >= 0, y + 0.5, y - 0.5).clamp_(-INT8_MAX, INT8_MAX)
        return y.to(torch.int8), amax / INT8_MAX
    return x.to(dtype), None


def dequantize(stored: torch.Tensor, scales, out_dtype: torch.dtype) -> torch.Tensor:
    """The values a kernel computes with: stored [..., D] (and int8's scales [...]) in ``out_dtype``."""
    if stored.dtype == FP8:
        return (stored.to(torch.float32) * (1.0 if scales is None else float(scales))).to(out_dtype)
    if stored.dtype == torch.int8:
        return (stored.to(torch.float32) * scales[..., None]).to(out_dtype)
    return stored.to(out_dtype)


def bytes_per_token_head(head_dim: int, dtype: torch.dtype) -> int:
    """Pool bytes one token's K (or V) of one KV head takes, int8's float32 scale included."""
    if dtype == torch.int8:
        return head_dim + 4
    if dtype == FP8:
        return head_dim
    return head_dim * torch.finfo(dtype).bits // 8
