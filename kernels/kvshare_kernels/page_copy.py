"""copy_pages: copy whole pages (copy on write; tier moves between pools).

Inside one CUDA pool (or between two pools on the same GPU) one launch per pair of page tensors
copies every listed page: program (i, c) moves chunk c of page src_pages[i] to dst_pages[i] of
both tensors (K and V of a layer, or an int8 pool's K and V scales). A page is the tensor's
``numel / num_pages`` contiguous elements, whatever its page shape and dtype (fp8 is copied as its
bytes). Pages on different devices (GPU <-> pinned CPU tier) go through torch (index_select +
copy), which is what that move costs anyway.

``copy_page_tensors`` takes the pool's tensors as an opaque list (KVCache.page_tensors()), so a
tier copies K, V and whatever else a page carries without knowing the layout.

Source and destination lists must not overlap (a page both read and written in one call): the
programs run in no particular order. Debug mode checks it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from . import checks, kv_quant, reference


@triton.jit
def _copy_pages_kernel(SK, SV, DK, DV, SRC, DST, page_elems, stride_sk, stride_sv, stride_dk, stride_dv,
                       BLOCK: tl.constexpr, PAIR: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_elems
    src = tl.load(SRC + i).to(tl.int64)
    dst = tl.load(DST + i).to(tl.int64)
    k = tl.load(SK + src * stride_sk + offs, mask=mask)
    tl.store(DK + dst * stride_dk + offs, k.to(DK.dtype.element_ty), mask=mask)
    if PAIR:
        v = tl.load(SV + src * stride_sv + offs, mask=mask)
        tl.store(DV + dst * stride_dv + offs, v.to(DV.dtype.element_ty), mask=mask)


def _pages_contiguous(c: torch.Tensor) -> bool:
    """Each page's elements are contiguous (the page stride may be anything)."""
    return c.shape[0] == 0 or c[0].is_contiguous()


def _as_list(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _launchable(a: torch.Tensor, b: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> bool:
    same_device = a.device == b.device == src_pages.device == dst_pages.device
    return same_device and _pages_contiguous(a) and _pages_contiguous(b)


def copy_page_tensors(tensors: Sequence[torch.Tensor], src_pages: torch.Tensor, dst_pages: torch.Tensor, *,
                      dst_tensors: Sequence[torch.Tensor] | None = None, debug: bool | None = None) -> None:
    """src_pages/dst_pages int32 [N]; tensors: page dimension first, any page shape and dtype; into
    ``dst_tensors`` (same page shapes and dtypes, any number of pages, any device) when given."""
    src_list, dst_list = reference.copy_page_args(tensors, src_pages, dst_pages, dst_tensors, debug)
    if not src_list:
        return
    if dst_tensors is None and checks.debug_enabled(debug):
        both = set(src_pages.tolist()) & set(dst_pages.tolist())
        if both:
            raise checks.PageTableError(f"copy_pages: pages {sorted(both)[:8]} are both source and destination")
    n = src_pages.shape[0]
    if n == 0:
        return
    launch: list[tuple[torch.Tensor, torch.Tensor]] = []
    for a, b in zip(src_list, dst_list):
        if _launchable(a, b, src_pages, dst_pages):
            launch.append((kv_quant.storage_view(a), kv_quant.storage_view(b)))
        else:
            reference.copy_page_tensors([a], src_pages, dst_pages, dst_tensors=[b], debug=False)
    # Two tensors of the same page layout per launch (a layer's K and V): half the launches.
    i = 0
    while i < len(launch):
        (sk, dk) = launch[i]
        pair = i + 1 < len(launch) and _same_layout(launch[i], launch[i + 1])
        sv, dv = launch[i + 1] if pair else (sk, dk)
        page_elems = sk[0].numel() if sk.shape[0] else dk[0].numel()
        block = min(4096, triton.next_power_of_2(page_elems))
        _copy_pages_kernel[(n, triton.cdiv(page_elems, block))](
            sk, sv, dk, dv, src_pages, dst_pages, page_elems,
            sk.stride(0), sv.stride(0), dk.stride(0), dv.stride(0), BLOCK=block, PAIR=pair, num_warps=4,
        )
        i += 2 if pair else 1


def _same_layout(x: tuple[torch.Tensor, torch.Tensor], y: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(a.shape[1:] == b.shape[1:] and a.dtype == b.dtype for a, b in zip(x, y))


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
    for k, v, dk, dv in zip(ks, vs, dks, dvs):
        checks.check_cache_pair(k, v)
        checks.check_cache_pair(dk, dv)
        if k.shape[1:] != dk.shape[1:]:
            raise ValueError(f"copy_pages: page shapes differ: {tuple(k.shape[1:])} vs {tuple(dk.shape[1:])}")
    interleaved = [t for kv in zip(ks, vs) for t in kv]
    dst = None if dst_k_cache is None else [t for kv in zip(dks, dvs) for t in kv]
    copy_page_tensors(interleaved, src_pages, dst_pages, dst_tensors=dst, debug=debug)
