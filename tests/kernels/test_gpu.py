"""Full-size checks on a CUDA GPU (compiled Triton, bf16): the kernels against the torch reference.

The reference itself is checked against dense attention by the CPU tests. Skipped without CUDA.
"""

import pytest
import torch

from kvshare_kernels import kernels, reference
from paged_cases import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1",
                       reason="needs CUDA (compiled Triton)"),
]

BF16_TOL = 1.5e-2


def _pool(lens, page_size, hkv, d, dtype, seed=0, share=True):
    """Random pool on the GPU; pages shuffled; request 1 shares request 0's prefix pages."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per = [(n + page_size - 1) // page_size for n in lens]
    max_pages = max(pages_per) + 1
    num_pages = len(lens) * max_pages + 4
    k = torch.randn(num_pages, page_size, hkv, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(num_pages, page_size, hkv, d, device="cuda", generator=g).to(dtype)
    pt = torch.randperm(num_pages, device="cuda", generator=g)[: len(lens) * max_pages].view(len(lens), max_pages)
    pt = pt.to(torch.int32).contiguous()
    if share and len(lens) > 1:
        shared = min(pages_per[0], pages_per[1]) // 2
        pt[1, :shared] = pt[0, :shared]
    return k, v, pt, torch.tensor(lens, dtype=torch.int32, device="cuda")


DECODE_LENS = [1, 17, 300, 1024, 4096, 2049, 64, 777]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (32, 32), (28, 4)])
def test_decode_full_bf16(page_size, hq, hkv):
    k, v, pt, lens = _pool(DECODE_LENS, page_size, hkv, 128, torch.bfloat16, seed=page_size + hq)
    q = torch.randn(len(DECODE_LENS), hq, 128, device="cuda", dtype=torch.bfloat16)
    ref = reference.paged_decode_attention(q, k, v, pt, lens, 128 ** -0.5)
    variants = [dict(num_splits=s) for s in (None, 1, 16)]
    variants += [dict(heads_per_program=2, head_fastest=True, block_n=32, num_splits=3),
                 dict(heads_per_program=4, block_n=32, num_warps=8), dict(head_fastest=False), dict(head_fastest=True)]
    for cfg in variants:
        out = torch.full_like(q, float("nan"))
        kernels.paged_decode_attention(q, k, v, pt, lens, 128 ** -0.5, out, **cfg)
        assert rel_err(out, ref) < BF16_TOL, (page_size, hq, hkv, cfg)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_full_other_dtypes(dtype):
    k, v, pt, lens = _pool(DECODE_LENS, 16, 8, 128, dtype, seed=3)
    q = torch.randn(len(DECODE_LENS), 32, 128, device="cuda", dtype=dtype)
    out = kernels.paged_decode_attention(q, k, v, pt, lens, 128 ** -0.5)
    ref = reference.paged_decode_attention(q, k, v, pt, lens, 128 ** -0.5)
    assert rel_err(out, ref) < (2e-3 if dtype == torch.float16 else 1e-5)


def test_decode_head_dim_64_and_large_batch():
    lens = torch.randint(1, 3000, (96,)).tolist()
    k, v, pt, cl = _pool(lens, 16, 3, 64, torch.bfloat16, seed=5)
    q = torch.randn(96, 9, 64, device="cuda", dtype=torch.bfloat16)
    out = kernels.paged_decode_attention(q, k, v, pt, cl, 0.125, max_context=3000)
    assert rel_err(out, reference.paged_decode_attention(q, k, v, pt, cl, 0.125)) < BF16_TOL


def test_decode_in_cuda_graph():
    # no host synchronisation in the launcher: it must capture into a CUDA graph and replay correctly
    k, v, pt, lens = _pool(DECODE_LENS, 16, 8, 128, torch.bfloat16, seed=7)
    q = torch.randn(len(DECODE_LENS), 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kernels.paged_decode_attention(q, k, v, pt, lens, 0.088, out, max_context=4096)   # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.paged_decode_attention(q, k, v, pt, lens, 0.088, out, max_context=4096)
    q.copy_(torch.randn_like(q))
    lens.sub_(1).clamp_(min=1)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference.paged_decode_attention(q, k, v, pt, lens, 0.088)) < BF16_TOL


PREFILL = [(1024, 1024), (3000, 500), (700, 1), (2048, 100), (64, 64), (129, 0)]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (32, 32, 128), (9, 3, 64)])
def test_prefill_full_bf16(page_size, hq, hkv, d):
    lens = [n for n, _ in PREFILL]
    q_lens = [m for _, m in PREFILL]
    k, v, pt, cl = _pool(lens, page_size, hkv, d, torch.bfloat16, seed=page_size + hq + d)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    kernels.paged_prefill_attention(q, k, v, pt, qsl, cl, d ** -0.5, out, max_query_len=max(q_lens))
    ref = reference.paged_prefill_attention(q, k, v, pt, qsl, cl, d ** -0.5)
    assert rel_err(out, ref) < BF16_TOL


def test_write_kv_and_copy_pages_full():
    k_cache = torch.randn(512, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(512 * 16, device="cuda")[:3000].to(torch.int32)
    slots[::7] = -1
    k = torch.randn(3000, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    rk, rv = k_cache.clone(), v_cache.clone()
    kernels.write_kv(k, v, k_cache, v_cache, slots)
    reference.write_kv(k, v, rk, rv, slots)
    assert torch.equal(k_cache, rk) and torch.equal(v_cache, rv)
    src = torch.randperm(512, device="cuda")[:64].to(torch.int32)
    dst = torch.randperm(512, device="cuda")[:64].to(torch.int32)
    keep = ~torch.isin(dst, src)
    src, dst = src[keep], dst[keep]
    kernels.copy_pages(k_cache, v_cache, src, dst)
    reference.copy_pages(rk, rv, src, dst)
    assert torch.equal(k_cache, rk) and torch.equal(v_cache, rv)
    pinned_k = torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16).pin_memory()
    pinned_v = torch.zeros_like(pinned_k).pin_memory()
    kernels.copy_pages(k_cache, v_cache, src[:8], torch.arange(8, dtype=torch.int32), dst_k_cache=pinned_k,
                       dst_v_cache=pinned_v)
    assert torch.equal(pinned_k, k_cache[src[:8].long()].cpu())
