"""Pure-torch versions of the kernel entry points, with the kernels' signatures.

They are the ground truth for the tests and the engine's implementation on the CPU, so they are
written to be correct first and reasonably fast on the CPU second: pages are gathered per batch
with one index_select, softmax runs in fp32, and the varlen prefill uses torch's
scaled_dot_product_attention per request. They read lengths back to the host (``.tolist()``),
which is free on the CPU and a synchronisation on the GPU: on CUDA use the Triton kernels.

8-bit caches (fp8 e4m3, int8 with per-token scales; kvshare_kernels.kv_quant) are quantized on
write and dequantized on read with the same float32 operations as the kernels.

Tuning arguments of the Triton versions (``max_context``, ``num_splits``, ``max_query_len``) are
accepted and ignored, so that a caller can switch implementations without changing its call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import checks, kv_quant

__all__ = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "copy_pages", "copy_page_tensors",
           "rms_norm", "rotary_embedding"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale=None, v_scale=None, debug: bool | None = None) -> None:
    """Scatter token t's K/V ([T, Hkv, D]) into slot slot_mapping[t]; slot -1 writes nothing.

    8-bit caches: k_scale/v_scale are int8's float32 [P, S, Hkv] tensors (written) or fp8's floats."""
    checks.check_cache_pair(k_cache, v_cache)
    mode, k_scale, v_scale = kv_quant.check_scales(k_cache, v_cache, k_scale, v_scale, "write_kv")
    _, page_size, hkv, d = k_cache.shape
    if checks.debug_enabled(debug):
        checks.check_slot_values(slot_mapping, k_cache.shape[0] * page_size)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        stored, row_scales = kv_quant.quantize(x[keep], cache.dtype, scale if mode == kv_quant.FP8_MODE else None)
        kv_quant.storage_view(cache).view(-1, hkv, d).index_copy_(0, slots, kv_quant.storage_view(stored))
        if row_scales is not None:
            scale.view(-1, hkv).index_copy_(0, slots, row_scales)


def _gather_tokens(cache: torch.Tensor, pages: torch.Tensor, scale=None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """cache [P, S, H, D], pages int [..., n] -> [..., n * S, H, D] (the pages' tokens in order), in
    ``dtype`` (default the cache's); 8-bit caches come back dequantized with ``scale``."""
    _, page_size, h, d = cache.shape
    idx = pages.reshape(-1).long()
    out = kv_quant.storage_view(cache).index_select(0, idx).view(cache.dtype)
    if kv_quant.is_8bit(cache.dtype):
        s = scale.index_select(0, idx) if isinstance(scale, torch.Tensor) else scale
        out = kv_quant.dequantize(out, s, dtype or torch.float32)
    elif dtype is not None:
        out = out.to(dtype)
    return out.view(*pages.shape[:-1], pages.shape[-1] * page_size, h, d)


def _window_mask(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Which keys a query sees: j <= p, and p - window < j with a window. This is HF transformers'
    mask exactly (masking_utils: causal_mask_function kv_idx <= q_idx and'ed with
    sliding_window_overlay kv_idx > q_idx - sliding_window, used by Mistral's and Gemma 2's sliding
    layers; its flash path passes window_size (W - 1, W - 1) with causal=True: the same W keys)."""
    mask = key_pos <= query_pos
    if window > 0:
        mask &= key_pos > query_pos - window
    return mask


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                          softcap: float) -> torch.Tensor:
    """softmax(cap(scale * q k^T) masked) v over [..., Lq, D] x [..., Lk, D], where cap(s) = C tanh(s / C):
    Gemma 2's order in HF's eager attention (scale, then /C, tanh, *C, then the mask). SDPA has no
    hook between the scores and the softmax, hence the explicit scores; a row that sees no key is 0."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, v)


def _attend(q, k, v, mask, scale, softcap, enable_gqa=False):
    if softcap > 0:
        if enable_gqa:
            g = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
        return _softcapped_attention(q, k, v, mask, scale, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
                           max_context: int | None = None, num_splits: int | None = None,
                           k_scale=None, v_scale=None, window: int = 0, softcap: float = 0.0,
                           debug: bool | None = None) -> torch.Tensor:
    """One query token per request (q [B, Hq, D]) against its first context_lens[b] cached tokens.

    window W > 0: the query (position context_len - 1) sees only the last W of them, and page-table
    entries of pages wholly before those are never read (they may be -1). softcap C > 0: scores
    become C * tanh(score / C) before the softmax."""
    b, hq, d = q.shape
    checks.check_attention_shapes(q, k_cache, v_cache, page_table, context_lens, b, "context_lens")
    _, k_scale, v_scale = kv_quant.check_scales(k_cache, v_cache, k_scale, v_scale, "paged_decode_attention")
    window, softcap = checks.check_window_args(window, softcap, "paged_decode_attention")
    num_pages, page_size, hkv, _ = k_cache.shape
    if checks.debug_enabled(debug):
        checks.check_page_table_values(page_table, context_lens, num_pages, page_size, window)
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    lens = context_lens.long()
    if window > 0:
        # Gather from each request's first page touching its window, as many pages as the widest
        # window needs (at most ceil(W / S) + 1): the released pages before it are never indexed.
        first_page = checks.first_window_key(lens - 1, window) // page_size
        n_pages = max(1, int(((lens + page_size - 1) // page_size - first_page).max()))
        table_page = first_page[:, None] + torch.arange(n_pages, device=q.device)[None, :]
        pages = page_table.long().gather(1, table_page.clamp(max=page_table.shape[1] - 1))
    else:
        n_pages = max(1, (int(lens.max()) + page_size - 1) // page_size)
        first_page = torch.zeros_like(lens)
        pages = page_table[:, :n_pages].long()
    # Entries past a request's context (or before its window) may hold anything: clamp them into the
    # pool, mask them below.
    pages = pages.clamp(0, num_pages - 1)
    ct = _compute_dtype(q.dtype)
    k = _gather_tokens(k_cache, pages, k_scale, ct)                # [B, L, Hkv, D]
    v = _gather_tokens(v_cache, pages, v_scale, ct)
    length = k.shape[1]
    pos = first_page[:, None] * page_size + torch.arange(length, device=q.device)[None, :]   # [B, L]
    past = pos >= lens[:, None]
    if window > 0:
        past |= pos < lens[:, None] - window
    # Slots past a context may hold NaN, which a mask does not stop (NaN + -inf is NaN, 0 * NaN is
    # NaN): zero them in K and V. They are only the rows' tails, so index them rather than scan.
    tail = past.reshape(-1).nonzero().squeeze(1)
    if tail.numel():
        k.view(b * length, hkv, d).index_fill_(0, tail, 0.0)
        v.view(b * length, hkv, d).index_fill_(0, tail, 0.0)
    # One query token per row: a KV head's G query heads are G queries against that head's K/V, so
    # one SDPA call (the CPU's fused kernel) over [B, Hkv, G, D] x [B, Hkv, L, D], no GQA repeat,
    # and K/V read in place through a transposed view. ~2.3x faster than scores through einsum on
    # the CPU at SmolLM2's decode shapes, where this path serves every step.
    g = hq // hkv
    o = _attend(q.to(ct).view(b, hkv, g, d), k.transpose(1, 2), v.transpose(1, 2), ~past[:, None, None, :],
                scale, softcap)
    o = o.reshape(b, hq, d)
    o.masked_fill_((lens == 0)[:, None, None], 0.0)               # context_len 0 -> zeros, not NaN
    out.copy_(o)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            out: torch.Tensor | None = None, *, max_query_len: int | None = None,
                            k_scale=None, v_scale=None, tiles: torch.Tensor | None = None,
                            window: int = 0, softcap: float = 0.0, debug: bool | None = None) -> torch.Tensor:
    """Varlen extend: request i's q_len_i new tokens (its last ones) attend causally to all its cached tokens.

    window W > 0: a query at position p sees keys p - W < j <= p only; pages wholly before the
    first query's window are never read (their entries may be -1). softcap C > 0: scores become
    C * tanh(score / C) before the softmax.
    tiles: the Triton kernel's work list (prefill_tiles.py), a schedule only; the result does not
    depend on it, so the reference ignores it."""
    t, hq, d = q.shape
    nb = page_table.shape[0]
    checks.check_attention_shapes(q, k_cache, v_cache, page_table, context_lens, nb, "context_lens")
    _, k_scale, v_scale = kv_quant.check_scales(k_cache, v_cache, k_scale, v_scale, "paged_prefill_attention")
    window, softcap = checks.check_window_args(window, softcap, "paged_prefill_attention")
    if query_start_loc.shape != (nb + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32 [B+1], got {query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    num_pages, page_size, hkv, _ = k_cache.shape
    if checks.debug_enabled(debug):
        checks.check_query_values(query_start_loc, context_lens, t)
        checks.check_page_table_values(page_table, context_lens, num_pages, page_size, window,
                                       query_start_loc[1:] - query_start_loc[:-1])
    if out is None:
        out = torch.empty_like(q)
    ct = _compute_dtype(q.dtype)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for i in range(nb):
        s, e, n = starts[i], starts[i + 1], lens[i]
        if e == s:
            continue
        q_len = e - s
        # Bottom-right causal: query j sits at absolute position n - q_len + j. With a window the
        # keys start at the first query's window's first page.
        first_page = max(0, n - q_len - window + 1) // page_size if window > 0 else 0
        pages = page_table[i, first_page: (n + page_size - 1) // page_size].long()
        k0 = first_page * page_size
        k = _gather_tokens(k_cache, pages, k_scale, ct)[:n - k0].transpose(0, 1)     # [Hkv, n - k0, D]
        v = _gather_tokens(v_cache, pages, v_scale, ct)[:n - k0].transpose(0, 1)
        qi = q[s:e].to(ct).transpose(0, 1)                                 # [Hq, q_len, D]
        mask = _window_mask(torch.arange(k0, n, device=q.device)[None, :],
                            (n - q_len + torch.arange(q_len, device=q.device))[:, None], window)
        o = _attend(qi, k, v, mask, scale, softcap, enable_gqa=hq != hkv)
        out[s:e] = o.transpose(0, 1).to(out.dtype)
    return out


def _as_list(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def check_page_tensor_lists(src: list[torch.Tensor], dst: list[torch.Tensor], what: str) -> None:
    if len(src) != len(dst):
        raise ValueError(f"{what}: {len(src)} source and {len(dst)} destination page tensors")
    for i, (a, b) in enumerate(zip(src, dst)):
        if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
            raise ValueError(f"{what}: page tensor {i} differs: {a.dtype} {tuple(a.shape[1:])} vs "
                             f"{b.dtype} {tuple(b.shape[1:])} per page")


def copy_page_args(tensors, src_pages: torch.Tensor, dst_pages: torch.Tensor, dst_tensors, debug):
    """copy_pages' checked arguments (kernel and reference): the source and destination tensor lists."""
    src_list = list(tensors)
    dst_list = src_list if dst_tensors is None else list(dst_tensors)
    check_page_tensor_lists(src_list, dst_list, "copy_pages")
    if src_pages.shape != dst_pages.shape or src_pages.dim() != 1:
        raise ValueError(f"copy_pages: src_pages {tuple(src_pages.shape)} and dst_pages {tuple(dst_pages.shape)} must be equal 1-D")
    if src_list and checks.debug_enabled(debug):
        checks.check_page_list_values(src_pages, src_list[0].shape[0], "src_pages")
        checks.check_page_list_values(dst_pages, dst_list[0].shape[0], "dst_pages")
    return src_list, dst_list


def copy_page_tensors(tensors: Sequence[torch.Tensor], src_pages: torch.Tensor, dst_pages: torch.Tensor, *,
                      dst_tensors: Sequence[torch.Tensor] | None = None, debug: bool | None = None) -> None:
    """Copy pages src_pages[i] -> dst_pages[i] of every tensor (page dimension first, any dtype and
    page shape: K, V, int8's scales; KVCache.page_tensors()), into ``dst_tensors`` when given
    (another pool, possibly on another device), else within each tensor (copy on write)."""
    src_list, dst_list = copy_page_args(tensors, src_pages, dst_pages, dst_tensors, debug)
    if not src_list:
        return
    for a, b in zip(src_list, dst_list):
        a, b = kv_quant.storage_view(a), kv_quant.storage_view(b)     # torch has no fp8 index_copy on the CPU
        src = src_pages.to(a.device).long()
        dst = dst_pages.to(b.device).long()
        b.index_copy_(0, dst, _moved(a.index_select(0, src), b))


def copy_pages(k_cache: torch.Tensor | Sequence[torch.Tensor], v_cache: torch.Tensor | Sequence[torch.Tensor],
               src_pages: torch.Tensor, dst_pages: torch.Tensor, *,
               dst_k_cache: torch.Tensor | Sequence[torch.Tensor] | None = None,
               dst_v_cache: torch.Tensor | Sequence[torch.Tensor] | None = None,
               debug: bool | None = None) -> None:
    """Copy whole pages src_pages[i] -> dst_pages[i] (all layers when given lists of per-layer caches).

    Without ``dst_*_cache`` the copy stays inside one pool (copy on write). With them the pages go
    to another pool, possibly on another device (tier moves: GPU <-> pinned CPU). An int8 pool's
    scales are page tensors too: copy_page_tensors(KVCache.page_tensors(), ...) moves everything.
    """
    ks, vs = _as_list(k_cache), _as_list(v_cache)
    dks = ks if dst_k_cache is None else _as_list(dst_k_cache)
    dvs = vs if dst_v_cache is None else _as_list(dst_v_cache)
    if not (len(ks) == len(vs) == len(dks) == len(dvs)):
        raise ValueError("copy_pages: source and destination caches need the same number of layers")
    for k, v, dk, dv in zip(ks, vs, dks, dvs):
        checks.check_cache_pair(k, v)
        checks.check_cache_pair(dk, dv)
    copy_page_tensors([*ks, *vs], src_pages, dst_pages, dst_tensors=None if dst_k_cache is None else [*dks, *dvs],
                      debug=debug)


def _moved(pages: torch.Tensor, dst_cache: torch.Tensor) -> torch.Tensor:
    """pages on dst_cache's device and dtype. Host -> CUDA goes through pinned memory without waiting
    for the stream (a pageable copy would block the host until the GPU drained)."""
    if pages.device.type == "cpu" and dst_cache.device.type == "cuda":
        return pages.pin_memory().to(dst_cache.device, non_blocking=True).to(dst_cache.dtype)
    return pages.to(dst_cache.device, dst_cache.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * normalize(x) in fp32; with residual: residual += x in place first, and normalize the sum."""
    if residual is not None:
        residual.copy_(residual + x)
        x = residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (weight * xf.to(x.dtype)).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary of q [T, Hq, D] and k [T, Hkv, D] in place at positions [T]; fp32 math, one rounding."""
    c = cos.index_select(0, positions).float()[:, None, :]
    s = sin.index_select(0, positions).float()[:, None, :]
    for x in (q, k):
        xf = x.float()
        half = x.shape[-1] // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        x.copy_(xf * c + rotated * s)
    return q, k


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up over gate_up [T, 2I] (gate first), as the Llama MLP computes it in torch."""
    gate, up = gate_up.chunk(2, dim=-1)
    y = F.silu(gate) * up
    if out is None:
        return y
    out.copy_(y)
    return out


def cascade_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                             context_lens: torch.Tensor, plan, scale: float, out: torch.Tensor | None = None, *,
                             max_context: int | None = None, k_scale=None, v_scale=None, window: int = 0,
                             softcap: float = 0.0, debug: bool | None = None) -> torch.Tensor:
    """The cascade kernels' result: exactly paged decode attention (the plan only changes what is read when)."""
    return paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale, out, max_context=max_context,
                                  k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap, debug=debug)
