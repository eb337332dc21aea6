"""copy_pages: copy on write inside a pool, all layers, and moves to another pool (tiers)."""

import pytest
import torch

from kvshare_kernels import PageTableError, kernels, reference


def _pool(layers, device, dtype=torch.float32, pages=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn(pages, 4, 2, 16, generator=gen).to(dtype).to(device) for _ in range(layers)]
    vs = [torch.randn(pages, 4, 2, 16, generator=gen).to(dtype).to(device) for _ in range(layers)]
    return ks, vs


@pytest.mark.parametrize("impl", [kernels, reference], ids=["triton", "reference"])
def test_copy_on_write_one_layer(impl, device):
    (k,), (v,) = _pool(1, device)
    k0, v0 = k.clone(), v.clone()
    src = torch.tensor([1, 4], dtype=torch.int32, device=device)
    dst = torch.tensor([6, 0], dtype=torch.int32, device=device)
    impl.copy_pages(k, v, src, dst)
    exp_k, exp_v = k0.clone(), v0.clone()
    exp_k[[6, 0]] = k0[[1, 4]]
    exp_v[[6, 0]] = v0[[1, 4]]
    assert torch.equal(k, exp_k) and torch.equal(v, exp_v)


@pytest.mark.parametrize("impl", [kernels, reference], ids=["triton", "reference"])
def test_copy_all_layers_to_other_pool(impl, device):
    ks, vs = _pool(3, device, torch.bfloat16, seed=1)
    dks, dvs = _pool(3, device, torch.bfloat16, pages=5, seed=2)
    src = torch.tensor([2, 3, 0], dtype=torch.int32, device=device)
    dst = torch.tensor([4, 1, 2], dtype=torch.int32, device=device)
    impl.copy_pages(ks, vs, src, dst, dst_k_cache=dks, dst_v_cache=dvs)
    for k, v, dk, dv in zip(ks, vs, dks, dvs):
        assert torch.equal(dk[[4, 1, 2]], k[[2, 3, 0]]) and torch.equal(dv[[4, 1, 2]], v[[2, 3, 0]])


def test_copy_to_cpu_tier(device):
    ks, vs = _pool(2, device, seed=3)
    cks, cvs = _pool(2, "cpu", pages=3, seed=4)
    src = torch.tensor([5, 1], dtype=torch.int32, device=device)
    dst = torch.tensor([0, 2], dtype=torch.int32)
    kernels.copy_pages(ks, vs, src, dst, dst_k_cache=cks, dst_v_cache=cvs)
    for k, ck in zip(ks, cks):
        assert torch.equal(ck[[0, 2]], k[[5, 1]].cpu())


def test_copy_overlap_rejected_in_debug(device):
    (k,), (v,) = _pool(1, device)
    pages = torch.tensor([1, 2], dtype=torch.int32, device=device)
    with pytest.raises(PageTableError, match="both source and destination"):
        kernels.copy_pages(k, v, pages, pages.flip(0), debug=True)
