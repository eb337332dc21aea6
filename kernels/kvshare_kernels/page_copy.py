"""copy_pages: copy whole pages (copy on write; tier moves between pools).

Inside one CUDA pool (or between two pools on the same GPU) one launch per layer copies every
listed page: program (i, c) moves chunk c of page src_pages[i] to dst_pages[i], K and V together.
A page is ``page_size * Hkv * D`` contiguous elements of the cache. Pages on different devices (GPU
<-> pinned CPU tier) go through torch (index_select + copy), which is what that move costs anyway.

Source and destination lists must not overlap (a page both read and written in one call): the
programs run in no particular order. Debug mode checks it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import checks, reference


@triton.jit
def _copy_pages_kernel(SK, SV, DK, DV, SRC, DST, page_elems, stride_sk, stride_sv, stride_dk, stride_dv,
                       BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_elems
    src = tl.load(SRC + i).to(tl.int64)
    dst = tl.load(DST + i).to(tl.int64)
    k = tl.load(SK + src * stride_sk + offs, mask=mask)
    v = tl.load(SV + src * stride_sv + offs, mask=mask)
    tl.store(DK + dst * stride_dk + offs, k.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + dst * stride_dv + offs, v.to(DV.dtype.element_ty), mask=mask)


def _pages_contiguous(c: torch.Tensor) -> bool:
    _, s, h, d = c.shape
    return c.stride(3) == 1 and c.stride(2) == d and c.stride(1) == h * d


def _as_list(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def copy_pages(k_cache: torch.Tensor | Sequence[torch.Tensor], v_cache: torch.Tensor | Sequence[torch.Tensor],
               src_pages: torch.Tensor, dst_pages: torch.Tensor, *,
               dst_k_cache: torch.Tensor | Sequence[torch.Tensor] | None = None,
               dst_v_cache: torch.Tensor | Sequence[torch.Tensor] | None = None,
               debug: bool | None = None) -> None:
    """src_pages/dst_pages int32 [N]; caches a tensor [P, S, Hkv, D] or a list of them (one per layer)."""
    ks, vs = _as_list(k_cache), _as_list(v_cache)
    dks = ks if dst_k_cache is None else _as_list(dst_k_cache)
    dvs = vs if dst_v_cache is None else _as_list(dst_v_cache)
    if not (len(ks) == len(vs) == len(dks) == len(dvs)):
        raise ValueError("copy_pages: source and destination caches need the same number of layers")
    if src_pages.shape != dst_pages.shape or src_pages.dim() != 1:
        raise ValueError(f"copy_pages: src_pages {tuple(src_pages.shape)} and dst_pages {tuple(dst_pages.shape)} must be equal 1-D")
    for k, v, dk, dv in zip(ks, vs, dks, dvs):
        checks.check_cache_pair(k, v)
        checks.check_cache_pair(dk, dv)
        if k.shape[1:] != dk.shape[1:]:
            raise ValueError(f"copy_pages: page shapes differ: {tuple(k.shape[1:])} vs {tuple(dk.shape[1:])}")
    if checks.debug_enabled(debug):
        checks.check_page_list_values(src_pages, ks[0].shape[0], "src_pages")
        checks.check_page_list_values(dst_pages, dks[0].shape[0], "dst_pages")
        if dst_k_cache is None:
            both = set(src_pages.tolist()) & set(dst_pages.tolist())
            if both:
                raise checks.PageTableError(f"copy_pages: pages {sorted(both)[:8]} are both source and destination")
    n = src_pages.shape[0]
    if n == 0:
        return
    for k, v, dk, dv in zip(ks, vs, dks, dvs):
        same_device = k.device == dk.device and src_pages.device == k.device and dst_pages.device == k.device
        if not (same_device and all(_pages_contiguous(c) for c in (k, v, dk, dv))):
            reference.copy_pages(k, v, src_pages, dst_pages, dst_k_cache=dk, dst_v_cache=dv, debug=False)
            continue
        page_elems = k.shape[1] * k.shape[2] * k.shape[3]
        block = min(4096, triton.next_power_of_2(page_elems))
        _copy_pages_kernel[(n, triton.cdiv(page_elems, block))](
            k, v, dk, dv, src_pages, dst_pages, page_elems,
            k.stride(0), v.stride(0), dk.stride(0), dv.stride(0), BLOCK=block, num_warps=4,
        )
