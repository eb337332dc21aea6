"""rms_norm: RMSNorm with an optional fused residual add, one Triton program per row.

    rms_norm(x, weight, eps)                     -> weight * normalize(x)
    rms_norm(x, weight, eps, residual=residual)  -> residual += x (in place); weight * normalize(residual)

The math follows the Llama reference (and kvshare.runtime.llama.rms_norm) step by step: the sum
x + residual is rounded to the activation dtype and stored, the mean of squares and the scaling run
in fp32 on that rounded value, the normalised row is rounded to the dtype and then multiplied by
the weight (a product of two fp16/bf16 values is exact in fp32, so rounding it once equals torch's
``weight * x.to(dtype)``). Only the order of the sum of squares differs from torch. One kernel
replaces the ~8 small fp32 kernels of the torch version (plus the residual add).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, stride_x, stride_r, stride_o, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(R.dtype.element_ty)
        tl.store(R + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(OUT.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (normed * w).to(OUT.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, N] (rows may be strided, the last dim contiguous), weight [N]; returns out [T, N] in x's dtype.

    With residual ([T, N], x's dtype) the kernel first does ``residual += x`` in place and
    normalises the sum.
    """
    _check(x, weight, residual)
    t, n = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    r = residual if residual is not None else x
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(t,)](
        x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), n, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=max(1, min(16, block // 512)),
    )
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: x must be [T, N] and weight [N], got {tuple(x.shape)} / {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"rms_norm: residual must be {x.dtype} {tuple(x.shape)} with a contiguous last dim, "
                         f"got {residual.dtype} {tuple(residual.shape)}")


__all__ = ["rms_norm"]
