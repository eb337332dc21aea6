"""Random paged KV scenarios and dense (unpaged) attention, the ground truth of the kernel tests.

A case holds each request's K/V as a dense [len, Hkv, D] tensor and the same tokens scattered into
a pool through a random page table: pages out of order, later requests sharing whole prefix pages
of earlier ones (same physical page, same tokens), entries past each context pointing at a "trap"
page full of NaN or at -1, and every unused page full of NaN, so a kernel that reads a token it
should not turns the output into NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass
class PagedCase:
    k_cache: torch.Tensor          # [P, S, Hkv, D]
    v_cache: torch.Tensor
    page_table: torch.Tensor       # int32 [B, max_pages]
    context_lens: torch.Tensor     # int32 [B]
    dense_k: list[torch.Tensor]    # per request [len, Hkv, D], float64
    dense_v: list[torch.Tensor]
    page_size: int

    @property
    def lens(self) -> list[int]:
        return [int(x) for x in self.context_lens.tolist()]


def make_case(lens: list[int], page_size: int, hkv: int, d: int, dtype: torch.dtype, device: str,
              seed: int = 0, share: bool = True, extra_pages: int = 3) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [math.ceil(n / page_size) for n in lens]
    max_pages = max(pages_per_req) + 2                   # spare columns past every context
    num_pages = sum(pages_per_req) + extra_pages + 1     # +1: the trap page
    perm = torch.randperm(num_pages, generator=gen).tolist()
    trap = perm.pop()
    k_cache = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    page_table = torch.full((len(lens), max_pages), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    for i, n in enumerate(lens):
        k = torch.randn(n, hkv, d, generator=gen, dtype=torch.float64)
        v = torch.randn(n, hkv, d, generator=gen, dtype=torch.float64)
        shared = 0
        if share and i > 0:
            # Share as many whole pages of request i-1's prefix as both requests fill.
            shared = min(lens[i - 1], n) // page_size
            if shared:
                page_table[i, :shared] = page_table[i - 1, :shared]
                k[: shared * page_size] = dense_k[i - 1][: shared * page_size]
                v[: shared * page_size] = dense_v[i - 1][: shared * page_size]
        for j in range(shared, pages_per_req[i]):
            p = perm.pop()
            page_table[i, j] = p
            tok = slice(j * page_size, min(n, (j + 1) * page_size))
            k_cache[p, : tok.stop - tok.start] = k[tok].to(dtype)
            v_cache[p, : tok.stop - tok.start] = v[tok].to(dtype)
        page_table[i, pages_per_req[i]:: 2] = trap       # garbage past the context: trap page / -1
        # what the pool holds, rounded to its dtype, is the truth the kernels see
        dense_k.append(k.to(dtype).double())
        dense_v.append(v.to(dtype).double())
    return PagedCase(k_cache.to(device), v_cache.to(device), page_table.to(device),
                     torch.tensor(lens, dtype=torch.int32, device=device),
                     [x.to(device) for x in dense_k], [x.to(device) for x in dense_v], page_size)


def make_new_kv_case(reqs, page_size, hq, hkv, d, dtype, device, seed):
    """A case whose chunk slots in the pool are NaN, with the chunk's K/V given instead as strided
    views of a fused-projection-like buffer [T + 3 padding rows of NaN, (hq + 2 hkv) * d]."""
    case = make_case([n for n, _ in reqs], page_size, hkv, d, dtype, device, seed=seed, share=False)
    q_lens = [m for _, m in reqs]
    t = sum(q_lens)
    qkv = torch.full((t + 3, (hq + 2 * hkv) * d), float("nan"), dtype=dtype, device=device)
    k_new = qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
    v_new = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
    s = 0
    for i, (n, m) in enumerate(reqs):
        k_new[s:s + m] = case.dense_k[i][n - m:n].to(dtype)
        v_new[s:s + m] = case.dense_v[i][n - m:n].to(dtype)
        for pos in range(n - m, n):         # the pool no longer holds the chunk: only k_new/v_new do
            page = int(case.page_table[i, pos // page_size])
            case.k_cache[page, pos % page_size] = float("nan")
            case.v_cache[page, pos % page_size] = float("nan")
        s += m
    return case, k_new[:t], v_new[:t]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [M, Hq, D] the last M tokens of a sequence whose K/V are k, v [N, Hkv, D]; causal; float64."""
    m, hq, _ = q.shape
    n, hkv, _ = k.shape
    g = hq // hkv
    kk = k.double().repeat_interleave(g, dim=1)           # [N, Hq, D]
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), kk) * scale
    pos = n - m + torch.arange(m, device=q.device)
    s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s, dim=-1), vv)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
