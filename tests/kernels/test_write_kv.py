"""write_kv: slot-mapping scatter, -1 skips; then the written pages read back through attention."""

import pytest
import torch

from kvshare_kernels import kernels, reference
from paged_cases import TOL, dense_attention, rel_err


@pytest.mark.parametrize("impl", [kernels, reference], ids=["triton", "reference"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_scatter(impl, page_size, dtype, device):
    gen = torch.Generator().manual_seed(page_size)
    num_pages, hkv, d, t = 12, 2, 16, 11
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(dtype).to(device)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_pages * page_size, generator=gen)[:t].to(torch.int32)
    slots[[2, 7]] = -1
    # k as a view of a fused [T, 3, Hkv, D] projection (token stride > Hkv * D)
    kv = torch.randn(t, 3, hkv, d, generator=gen).to(dtype).to(device)
    k, v = kv[:, 1], kv[:, 2]
    impl.write_kv(k, v, k_cache, v_cache, slots.to(device))
    exp_k, exp_v = before_k.view(-1, hkv, d).clone(), before_v.view(-1, hkv, d).clone()
    keep = slots >= 0
    exp_k[slots[keep].long()] = k[keep.to(device)].to(dtype)
    exp_v[slots[keep].long()] = v[keep.to(device)].to(dtype)
    assert torch.equal(k_cache.view(-1, hkv, d), exp_k)
    assert torch.equal(v_cache.view(-1, hkv, d), exp_v)


def test_write_kv_casts_to_cache_dtype(device):
    # fp32 activations into a bf16 pool (the interpreter truncates where the GPU rounds: 1 ulp)
    k_cache = torch.zeros(3, 4, 2, 16, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(2, 2, 16, device=device), torch.randn(2, 2, 16, device=device)
    kernels.write_kv(k, v, k_cache, v_cache, torch.tensor([9, 0], dtype=torch.int32, device=device))
    torch.testing.assert_close(k_cache[2, 1].float(), k[0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(v_cache[0, 0].float(), v[1], rtol=1e-2, atol=1e-2)


def test_write_then_decode(device):
    # the engine's decode step: write the new token's K/V, then attend over all of the request's pages
    gen = torch.Generator().manual_seed(7)
    page_size, hkv, hq, d, n = 4, 2, 4, 16, 10
    k_cache = torch.full((8, page_size, hkv, d), float("nan"), device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    pages = torch.tensor([5, 0, 3], dtype=torch.int32)
    slots = (pages.repeat_interleave(page_size) * page_size + torch.arange(page_size).repeat(3))[:n].to(torch.int32)
    k = torch.randn(n, hkv, d, generator=gen).to(device)
    v = torch.randn(n, hkv, d, generator=gen).to(device)
    kernels.write_kv(k[: n - 1], v[: n - 1], k_cache, v_cache, slots[: n - 1].to(device))   # prefill
    kernels.write_kv(k[n - 1 :], v[n - 1 :], k_cache, v_cache, slots[n - 1 :].to(device))   # decode token
    q = torch.randn(1, hq, d, generator=gen).to(device)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, pages[None].to(device),
                                         torch.tensor([n], dtype=torch.int32, device=device), 0.25, block_n=16)
    assert rel_err(out[0], dense_attention(q, k, v, 0.25)[0]) < TOL[torch.float32]


def test_write_kv_empty(device):
    k_cache = torch.zeros(2, 4, 1, 16, device=device)
    kernels.write_kv(torch.empty(0, 1, 16, device=device), torch.empty(0, 1, 16, device=device), k_cache,
                     k_cache.clone(), torch.empty(0, dtype=torch.int32, device=device))
    assert not k_cache.any()
