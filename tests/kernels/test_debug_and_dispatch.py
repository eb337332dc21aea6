"""Debug mode (page-table bounds checks before launch) and the CPU/CUDA dispatch."""

import pytest
import torch

import kvshare_kernels
from kvshare_kernels import PageTableError, kernels, reference
from paged_cases import make_case


@pytest.fixture
def case(device):
    return make_case([6, 13], 4, 2, 16, torch.float32, device, seed=0)


@pytest.mark.parametrize("impl", [kernels, reference], ids=["triton", "reference"])
def test_decode_bad_page_entry(impl, case, device, monkeypatch):
    pt = case.page_table.clone()
    pt[1, 2] = case.k_cache.shape[0] + 5               # request 1, tokens 8..11: inside its context
    q = torch.randn(2, 4, 16, device=device)
    with pytest.raises(PageTableError, match=r"page_table\[1, 2\] = .* outside the pool"):
        impl.paged_decode_attention(q, case.k_cache, case.v_cache, pt, case.context_lens, 1.0, debug=True)
    monkeypatch.setenv("KVSHARE_KERNEL_DEBUG", "1")
    with pytest.raises(PageTableError):
        impl.paged_decode_attention(q, case.k_cache, case.v_cache, pt, case.context_lens, 1.0)


def test_debug_ignores_entries_past_context(case, device):
    # make_case fills the spare columns with -1 and a trap page: legal, they are never read
    q = torch.randn(2, 4, 16, device=device)
    out = kernels.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, 1.0,
                                         debug=True)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("impl", [kernels, reference], ids=["triton", "reference"])
def test_prefill_bad_inputs(impl, case, device):
    q = torch.randn(5, 4, 16, device=device)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    pt = case.page_table.clone()
    pt[0, 0] = -1
    with pytest.raises(PageTableError, match=r"page_table\[0, 0\] = -1"):
        impl.paged_prefill_attention(q, case.k_cache, case.v_cache, pt, qsl, case.context_lens, 1.0, debug=True)
    too_many = torch.tensor([0, 7, 5], dtype=torch.int32, device=device)
    with pytest.raises(PageTableError, match="query tokens"):
        impl.paged_prefill_attention(q, case.k_cache, case.v_cache, case.page_table, too_many, case.context_lens,
                                     1.0, debug=True)


def test_context_longer_than_page_table(case, device):
    lens = torch.tensor([6, 4 * case.page_table.shape[1] + 1], dtype=torch.int32, device=device)
    with pytest.raises(PageTableError, match="context_lens\\[1\\]"):
        kernels.paged_decode_attention(torch.randn(2, 4, 16, device=device), case.k_cache, case.v_cache,
                                       case.page_table, lens, 1.0, debug=True)


@pytest.mark.parametrize("impl", [kernels, reference], ids=["triton", "reference"])
def test_write_kv_bad_slot(impl, device):
    k_cache = torch.zeros(2, 4, 1, 16, device=device)
    slots = torch.tensor([3, 8], dtype=torch.int32, device=device)
    with pytest.raises(PageTableError, match=r"slot_mapping\[1\] = 8"):
        impl.write_kv(torch.ones(2, 1, 16, device=device), torch.ones(2, 1, 16, device=device), k_cache,
                      k_cache.clone(), slots, debug=True)


def test_copy_pages_bad_page(device):
    k = torch.zeros(3, 4, 1, 16, device=device)
    with pytest.raises(PageTableError, match=r"dst_pages\[0\] = 3"):
        kernels.copy_pages(k, k.clone(), torch.tensor([0], dtype=torch.int32, device=device),
                           torch.tensor([3], dtype=torch.int32, device=device), debug=True)


def test_shape_errors_are_clear(case, device):
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kernels.paged_decode_attention(torch.randn(2, 3, 16, device=device), case.k_cache, case.v_cache,
                                       case.page_table, case.context_lens, 1.0)
    with pytest.raises(ValueError, match="page_table must be int32"):
        reference.paged_decode_attention(torch.randn(2, 4, 16, device=device), case.k_cache, case.v_cache,
                                         case.page_table.long(), case.context_lens, 1.0)


def test_dispatch():
    # the public names stay the dispatching functions after the Triton modules are imported
    for name in ("write_kv", "paged_decode_attention", "paged_prefill_attention", "copy_pages"):
        assert callable(getattr(kvshare_kernels, name)), name
    assert kvshare_kernels.ops("cpu") is reference
    assert kvshare_kernels.ops(torch.device("cuda")) is kernels
    case = make_case([5, 9], 4, 2, 16, torch.float32, "cpu", seed=1)
    q = torch.randn(2, 4, 16)
    a = kvshare_kernels.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens,
                                               0.25, max_context=9)
    b = reference.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, 0.25)
    assert torch.equal(a, b)
