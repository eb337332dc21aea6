"""Argument checks shared by the Triton launchers and the torch reference.

Two levels:

* ``check_*_shapes``: cheap, host-only (shapes, dtypes, devices). Always on; they never read a
  tensor's values, so they never synchronise with the GPU.
* ``check_*_values`` (debug mode): read the page table, slot mapping, lengths and page lists back to
  the host and check them against the pool bounds, raising :class:`PageTableError` with the
  offending request/position. They synchronise, so they run only when debug mode is on:
  ``KVSHARE_KERNEL_DEBUG=1`` in the environment or ``debug=True`` on the call.

A page-table entry outside the pool is exactly the bug that turns into a silent read of another
request's KV (or an illegal address) inside a kernel, hence the clear error here.
"""

from __future__ import annotations

import os

import torch

from .kv_quant import FP8_MODE, NONE


class PageTableError(ValueError):
    """A page table, slot mapping or page list points outside the KV pool."""


def debug_enabled(debug: bool | None) -> bool:
    if debug is not None:
        return bool(debug)
    return os.environ.get("KVSHARE_KERNEL_DEBUG", "0").strip().lower() not in ("", "0", "false", "no")


def interpreter_bf16(dtype: torch.dtype, kv_mode: int = NONE) -> bool:
    """True when kernels run under TRITON_INTERPRET with bf16 dots.

    The interpreter's tl.dot multiplies bf16 operands as their raw 16-bit integers (Triton 3.9), so
    the kernels upcast to fp32 before their dots in exactly this case; compiled kernels never do.
    Over fp8 pools (kv_mode FP8_MODE) a bf16 query's dots run in fp16
    (kv_tiles.dot_query), which the interpreter multiplies right: no upcast, the GPU's dtype flow.
    """
    return dtype == torch.bfloat16 and kv_mode != FP8_MODE and os.environ.get("TRITON_INTERPRET", "0") == "1"


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _require(k_cache.dim() == 4, f"k_cache must be [num_pages, page_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}")
    _require(k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    _require(k_cache.dtype == v_cache.dtype, f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ")
    _require(k_cache.device == v_cache.device, "k_cache and v_cache are on different devices")
    _require(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "k_cache/v_cache need a contiguous head_dim")


def check_attention_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           lens: torch.Tensor, num_rows: int, what: str) -> None:
    check_cache_pair(k_cache, v_cache)
    _require(q.dim() == 3, f"q must be [tokens, num_q_heads, head_dim], got {tuple(q.shape)}")
    _, _, hkv, d = k_cache.shape
    _require(q.shape[2] == d, f"q head_dim {q.shape[2]} != cache head_dim {d}")
    _require(q.shape[1] % hkv == 0, f"num_q_heads {q.shape[1]} is not a multiple of num_kv_heads {hkv}")
    _require(page_table.dim() == 2 and page_table.dtype == torch.int32, f"page_table must be int32 [B, max_pages], got {page_table.dtype} {tuple(page_table.shape)}")
    _require(lens.dim() == 1 and lens.dtype == torch.int32, f"{what} must be int32 [B], got {lens.dtype} {tuple(lens.shape)}")
    _require(page_table.shape[0] == num_rows and lens.shape[0] == num_rows,
             f"batch mismatch: page_table {tuple(page_table.shape)}, {what} {tuple(lens.shape)}, expected B={num_rows}")
    for name, t in (("q", q), ("page_table", page_table), (what, lens)):
        _require(t.device == k_cache.device, f"{name} is on {t.device}, the cache on {k_cache.device}")


def check_window_args(window: int, softcap: float, what: str) -> tuple[int, float]:
    """window: a query at position p attends keys j with p - window < j <= p (0: all j <= p);
    softcap: scores become softcap * tanh(score / softcap) before the softmax (0: none)."""
    window, softcap = int(window), float(softcap)
    _require(window >= 0, f"{what}: window must be >= 0 (0 = full causal attention), got {window}")
    _require(softcap >= 0.0, f"{what}: softcap must be >= 0 (0 = none), got {softcap}")
    return window, softcap


def unsupported(what: str, **args) -> None:
    """Raise NotImplementedError naming the first argument this path cannot honour (non-zero), so a
    caller never gets full attention or uncapped scores in silence."""
    for name, value in args.items():
        if value:
            raise NotImplementedError(f"{what} does not support {name}={value!r}")


def first_window_key(first_query: torch.Tensor, window: int) -> torch.Tensor:
    """The first key position any query of a request can see: a query at p sees p - window < j."""
    if window <= 0:
        return torch.zeros_like(first_query)
    return (first_query - window + 1).clamp(min=0)


def check_page_table_values(page_table: torch.Tensor, context_lens: torch.Tensor, num_pages: int, page_size: int,
                            window: int = 0, query_lens: torch.Tensor | None = None) -> None:
    """Every page that holds one of the first context_lens[b] tokens must be a pool page; with a
    window, only those from the page of the request's first visible key on (pages wholly before its
    window may hold -1: the pool has taken them back). query_lens: the requests' new tokens (prefill;
    the first query sits at context_len - query_len), default one (decode)."""
    pt = page_table.detach().cpu().long()
    lens = context_lens.detach().cpu().long()
    max_pages = pt.shape[1]
    if (lens < 0).any():
        b = int((lens < 0).nonzero()[0, 0])
        raise PageTableError(f"context_lens[{b}] = {int(lens[b])} is negative")
    too_long = lens > max_pages * page_size
    if too_long.any():
        b = int(too_long.nonzero()[0, 0])
        raise PageTableError(f"context_lens[{b}] = {int(lens[b])} needs more than the page table's "
                             f"{max_pages} pages of {page_size} tokens")
    used = torch.arange(max_pages)[None, :] < (lens[:, None] + page_size - 1) // page_size
    if window > 0:
        q_lens = torch.ones_like(lens) if query_lens is None else query_lens.detach().cpu().long()
        first_page = first_window_key(lens - q_lens, window) // page_size
        used &= torch.arange(max_pages)[None, :] >= first_page[:, None]
    bad = used & ((pt < 0) | (pt >= num_pages))
    if bad.any():
        b, j = (int(x) for x in bad.nonzero()[0])
        raise PageTableError(f"page_table[{b}, {j}] = {int(pt[b, j])} is outside the pool [0, {num_pages}) "
                             f"(request {b}, tokens {j * page_size}..{(j + 1) * page_size - 1}, "
                             f"context_len {int(lens[b])})")


def check_query_values(query_start_loc: torch.Tensor, context_lens: torch.Tensor, num_tokens: int,
                       padded: bool = False) -> None:
    """padded: rows past the last request's may follow (a CUDA graph's step, padded to its size)."""
    qsl = query_start_loc.detach().cpu().long()
    lens = context_lens.detach().cpu().long()
    end = int(qsl[-1])
    if int(qsl[0]) != 0 or end > num_tokens or (end != num_tokens and not padded):
        raise PageTableError(f"query_start_loc must run from 0 to the number of query tokens {num_tokens}, "
                             f"got {int(qsl[0])}..{int(qsl[-1])}")
    q_lens = qsl[1:] - qsl[:-1]
    bad = (q_lens < 0) | (q_lens > lens)
    if bad.any():
        b = int(bad.nonzero()[0, 0])
        raise PageTableError(f"request {b}: {int(q_lens[b])} query tokens but context_len {int(lens[b])} "
                             f"(need 0 <= q_len <= context_len)")


def check_tile_values(tiles: torch.Tensor, query_start_loc: torch.Tensor, per_tile: int) -> None:
    """Every query block of every request is in the tile list exactly once; the rest are idle (-1)."""
    t = tiles.detach().cpu().long()
    qsl = query_start_loc.detach().cpu().long()
    blocks = -(-(qsl[1:] - qsl[:-1]) // per_tile)
    live = t[t[:, 0] >= 0]
    if ((t[:, 0] < -1) | (t[:, 0] >= blocks.numel())).any():
        raise PageTableError(f"tiles name requests outside 0..{blocks.numel() - 1} (or -1 for idle)")
    want = sorted((b, m) for b in range(blocks.numel()) for m in range(int(blocks[b])))
    got = sorted(map(tuple, live.tolist()))
    if got != want:
        raise PageTableError(f"tiles must list each request's {per_tile}-token query blocks once: "
                             f"{len(got)} listed, {len(want)} expected")


def check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    s = slot_mapping.detach().cpu().long()
    bad = (s < -1) | (s >= num_slots)
    if bad.any():
        t = int(bad.nonzero()[0, 0])
        raise PageTableError(f"slot_mapping[{t}] = {int(s[t])} is outside the pool's slots [0, {num_slots}) "
                             f"(-1 means skip)")


def check_page_list_values(pages: torch.Tensor, num_pages: int, what: str) -> None:
    p = pages.detach().cpu().long()
    bad = (p < 0) | (p >= num_pages)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise PageTableError(f"{what}[{i}] = {int(p[i])} is outside the pool [0, {num_pages})")


def max_offset(t: torch.Tensor) -> int:
    """The largest element offset a kernel computes into t from its base: sum of (size - 1) x stride."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)


def row_offset_flags(k_cache: torch.Tensor, v_cache: torch.Tensor, rows32: bool | None = None) -> dict:
    """The attention kernels' SAME_ROWS (K and V pools [P, S, Hkv, D] share their strides, so one
    offset tensor serves both) and ROWS32 (every offset into both fits in int32; rows32 False forces
    int64, True only where it fits)."""
    fits = max(max_offset(k_cache), max_offset(v_cache)) < 2**31
    return dict(SAME_ROWS=k_cache.stride()[:3] == v_cache.stride()[:3],
                ROWS32=fits if rows32 is None else bool(rows32) and fits)
