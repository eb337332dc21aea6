"""Pure-torch versions of the kernel entry points, with the kernels' signatures.

They are the ground truth for the tests and the engine's implementation on the CPU, so they are
written to be correct first and reasonably fast on the CPU second: pages are gathered per batch
with one index_select, softmax runs in fp32, and the varlen prefill uses torch's
scaled_dot_product_attention per request. They read lengths back to the host (``.tolist()``),
which is free on the CPU and a synchronisation on the GPU: on CUDA use the Triton kernels.

Tuning arguments of the Triton versions (``max_context``, ``num_splits``, ``max_query_len``) are
accepted and ignored, so that a caller can switch implementations without changing its call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import checks

__all__ = ["write_kv", "paged_decode_attention", "paged_prefill_attention", "copy_pages", "rms_norm",
           "rotary_embedding"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, debug: bool | None = None) -> None:
    """Scatter token t's K/V ([T, Hkv, D]) into slot slot_mapping[t]; slot -1 writes nothing."""
    checks.check_cache_pair(k_cache, v_cache)
    _, page_size, hkv, d = k_cache.shape
    if checks.debug_enabled(debug):
        checks.check_slot_values(slot_mapping, k_cache.shape[0] * page_size)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, hkv, d).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def _gather_tokens(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [P, S, H, D], pages int [..., n] -> [..., n * S, H, D] (the pages' tokens in order)."""
    _, page_size, h, d = cache.shape
    out = cache.index_select(0, pages.reshape(-1).long())
    return out.view(*pages.shape[:-1], pages.shape[-1] * page_size, h, d)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
                           max_context: int | None = None, num_splits: int | None = None,
                           debug: bool | None = None) -> torch.Tensor:
    """One query token per request (q [B, Hq, D]) against its first context_lens[b] cached tokens."""
    b, hq, d = q.shape
    checks.check_attention_shapes(q, k_cache, v_cache, page_table, context_lens, b, "context_lens")
    num_pages, page_size, hkv, _ = k_cache.shape
    if checks.debug_enabled(debug):
        checks.check_page_table_values(page_table, context_lens, num_pages, page_size)
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    lens = context_lens.long()
    n_pages = max(1, (int(lens.max()) + page_size - 1) // page_size)
    # Entries past a request's context may hold anything: clamp them into the pool, mask them below.
    pages = page_table[:, :n_pages].long().clamp(0, num_pages - 1)
    ct = _compute_dtype(q.dtype)
    k = _gather_tokens(k_cache, pages).to(ct)                      # [B, L, Hkv, D]
    v = _gather_tokens(v_cache, pages).to(ct)
    g = hq // hkv
    qg = q.to(ct).view(b, hkv, g, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale       # [B, Hkv, G, L]
    past = torch.arange(k.shape[1], device=q.device)[None, :] >= lens[:, None]     # [B, L]
    scores.masked_fill_(past[:, None, None, :], float("-inf"))
    v.masked_fill_(past[:, :, None, None], 0.0)    # slots past a context may hold NaN: 0 * NaN = NaN
    p = torch.softmax(scores, dim=-1).nan_to_num_(0.0)            # context_len 0 -> zeros, not NaN
    o = torch.einsum("bhgl,blhd->bhgd", p, v).reshape(b, hq, d)
    out.copy_(o)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            out: torch.Tensor | None = None, *, max_query_len: int | None = None,
                            debug: bool | None = None) -> torch.Tensor:
    """Varlen extend: request i's q_len_i new tokens (its last ones) attend causally to all its cached tokens."""
    t, hq, d = q.shape
    nb = page_table.shape[0]
    checks.check_attention_shapes(q, k_cache, v_cache, page_table, context_lens, nb, "context_lens")
    if query_start_loc.shape != (nb + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32 [B+1], got {query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    num_pages, page_size, hkv, _ = k_cache.shape
    if checks.debug_enabled(debug):
        checks.check_query_values(query_start_loc, context_lens, t)
        checks.check_page_table_values(page_table, context_lens, num_pages, page_size)
    if out is None:
        out = torch.empty_like(q)
    ct = _compute_dtype(q.dtype)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for i in range(nb):
        s, e, n = starts[i], starts[i + 1], lens[i]
        if e == s:
            continue
        pages = page_table[i, : (n + page_size - 1) // page_size].long()
        k = _gather_tokens(k_cache, pages)[:n].to(ct).transpose(0, 1)     # [Hkv, n, D]
        v = _gather_tokens(v_cache, pages)[:n].to(ct).transpose(0, 1)
        qi = q[s:e].to(ct).transpose(0, 1)                                 # [Hq, q_len, D]
        q_len = e - s
        # Bottom-right causal: query j sits at absolute position n - q_len + j.
        mask = torch.arange(n, device=q.device)[None, :] <= (n - q_len + torch.arange(q_len, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
        out[s:e] = o.transpose(0, 1).to(out.dtype)
    return out


def _as_list(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def copy_pages(k_cache: torch.Tensor | Sequence[torch.Tensor], v_cache: torch.Tensor | Sequence[torch.Tensor],
               src_pages: torch.Tensor, dst_pages: torch.Tensor, *,
               dst_k_cache: torch.Tensor | Sequence[torch.Tensor] | None = None,
               dst_v_cache: torch.Tensor | Sequence[torch.Tensor] | None = None,
               debug: bool | None = None) -> None:
    """Copy whole pages src_pages[i] -> dst_pages[i] (all layers when given lists of per-layer caches).

    Without ``dst_*_cache`` the copy stays inside one pool (copy on write). With them the pages go
    to another pool, possibly on another device (tier moves: GPU <-> pinned CPU).
    """
    ks, vs = _as_list(k_cache), _as_list(v_cache)
    dks = ks if dst_k_cache is None else _as_list(dst_k_cache)
    dvs = vs if dst_v_cache is None else _as_list(dst_v_cache)
    if not (len(ks) == len(vs) == len(dks) == len(dvs)):
        raise ValueError("copy_pages: source and destination caches need the same number of layers")
    if src_pages.shape != dst_pages.shape or src_pages.dim() != 1:
        raise ValueError(f"copy_pages: src_pages {tuple(src_pages.shape)} and dst_pages {tuple(dst_pages.shape)} must be equal 1-D")
    if checks.debug_enabled(debug):
        checks.check_page_list_values(src_pages, ks[0].shape[0], "src_pages")
        checks.check_page_list_values(dst_pages, dks[0].shape[0], "dst_pages")
    for k, v, dk, dv in zip(ks, vs, dks, dvs):
        src = src_pages.to(k.device).long()
        dst = dst_pages.to(dk.device).long()
        dk.index_copy_(0, dst, _moved(k.index_select(0, src), dk))
        dv.index_copy_(0, dst, _moved(v.index_select(0, src), dv))


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
                             max_context: int | None = None, debug: bool | None = None) -> torch.Tensor:
    """The cascade kernels' result: exactly paged decode attention (the plan only changes what is read when)."""
    return paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale, out, max_context=max_context,
                                  debug=debug)
