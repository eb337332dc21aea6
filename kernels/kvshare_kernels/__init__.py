"""kvshare_kernels: paged KV-cache kernels written in Triton, each with a torch reference.

Entry points (see docs/develop/architecture.md for the layout; docs/develop/kernels.md for the design and numbers):

    write_kv(k, v, k_cache, v_cache, slot_mapping)
    paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale, out=None) -> [B, Hq, D]
    paged_prefill_attention(q, k_cache, v_cache, page_table, query_start_loc, context_lens, scale, out=None) -> [T, Hq, D]
    copy_pages(k_cache, v_cache, src_pages, dst_pages)
    copy_page_tensors(tensors, src_pages, dst_pages, dst_tensors=None)   (any page-first tensors: K, V, scales)
    rms_norm(x, weight, eps, residual=None) -> [T, N]       (residual += x in place when given)
    rotary_embedding(q, k, cos, sin, positions) -> (q, k)   (in place)
    silu_and_mul(gate_up) -> [T, I]                         (silu(gate) * up)

The functions of this package pick the implementation from the device of their first tensor:
the Triton kernels (``kvshare_kernels.kernels``) for CUDA tensors, the torch reference
(``kvshare_kernels.reference``) otherwise. ``ops(device)`` returns the module itself, for callers
that choose once. Triton is imported only when a CUDA tensor first arrives, so the CPU engine never
pays for it. 8-bit pools (fp8 e4m3, int8 with per-token scales; ``kv_quant``): the attention and
write entry points take ``k_scale=``/``v_scale=``. KVSHARE_KERNEL_DEBUG=1 (or ``debug=True``) checks page tables against the pool.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import reference
from .checks import PageTableError, debug_enabled

__all__ = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "copy_pages", "copy_page_tensors", "rms_norm",
           "rotary_embedding", "silu_and_mul", "ops", "reference", "PageTableError", "debug_enabled"]


def ops(device: torch.device | str) -> ModuleType:
    """The module implementing the entry points for tensors on ``device``."""
    if torch.device(device).type == "cuda":
        from . import kernels
        return kernels
    return reference


def _first_tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x[0]


def write_kv(k, v, k_cache, v_cache, slot_mapping, **kw) -> None:
    return ops(k_cache.device).write_kv(k, v, k_cache, v_cache, slot_mapping, **kw)


def paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale, out=None, **kw) -> torch.Tensor:
    return ops(q.device).paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale, out, **kw)


def paged_prefill_attention(q, k_cache, v_cache, page_table, query_start_loc, context_lens, scale, out=None,
                            **kw) -> torch.Tensor:
    return ops(q.device).paged_prefill_attention(q, k_cache, v_cache, page_table, query_start_loc, context_lens,
                                                 scale, out, **kw)


def copy_pages(k_cache, v_cache, src_pages, dst_pages, **kw) -> None:
    return ops(_first_tensor(k_cache).device).copy_pages(k_cache, v_cache, src_pages, dst_pages, **kw)


def copy_page_tensors(tensors, src_pages, dst_pages, **kw) -> None:
    return ops(tensors[0].device if tensors else "cpu").copy_page_tensors(tensors, src_pages, dst_pages, **kw)


def rms_norm(x, weight, eps, *, residual=None, out=None) -> torch.Tensor:
    if x.device.type == "cuda":
        from .fused_norm import rms_norm as impl
    else:
        impl = reference.rms_norm
    return impl(x, weight, eps, residual=residual, out=out)


def rotary_embedding(q, k, cos, sin, positions) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cuda":
        from .fused_rotary import rotary_embedding as impl
    else:
        impl = reference.rotary_embedding
    return impl(q, k, cos, sin, positions)


def silu_and_mul(gate_up, out=None) -> torch.Tensor:
    if gate_up.device.type == "cuda":
        from .fused_silu import silu_and_mul as impl
    else:
        impl = reference.silu_and_mul
    return impl(gate_up, out)
