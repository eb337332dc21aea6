"""paged_decode_attention (Triton, and the torch reference) against dense attention."""

import pytest
import torch

from kvshare_kernels import kernels, reference
from paged_cases import TOL, dense_attention, make_case, rel_err

LENS = [1, 7, 33, 50]          # ragged: a single token, a partial page, page-aligned on 1/4/16... and longer


def _check(impl, case, hq, d, dtype, device, **kw):
    torch.manual_seed(1)
    b = len(case.lens)
    q = torch.randn(b, hq, d, dtype=torch.float64).to(dtype).to(device)
    scale = d ** -0.5
    out = torch.full((b, hq, d), float("nan"), dtype=dtype, device=device)   # poisoned: all must be written
    res = impl.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, scale,
                                      out, **kw)
    assert res is out
    for i, n in enumerate(case.lens):
        ref = dense_attention(q[i : i + 1], case.dense_k[i], case.dense_v[i], scale)[0]
        err = rel_err(out[i], ref)
        assert err < TOL[dtype], f"request {i} (len {n}): rel err {err:.2e} {kw}"


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2), (6, 2)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_fp32(page_size, hq, hkv, num_splits, device):
    case = make_case(LENS, page_size, hkv, 16, torch.float32, device, seed=page_size * 7 + hq)
    _check(kernels, case, hq, 16, torch.float32, device, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_dot", [True, False])
def test_decode_half(dtype, use_dot, device):
    case = make_case(LENS, 4, 2, 16, dtype, device, seed=3)
    _check(kernels, case, 4 if use_dot else 2, 16, dtype, device, num_splits=2, block_n=16, use_dot=use_dot)


def test_decode_default_config_and_odd_head_dim(device):
    # default block_n / split heuristic; head_dim 24 pads to 32 (masked head dimension)
    case = make_case([5, 70, 129], 16, 1, 24, torch.float32, device, seed=5)
    _check(kernels, case, 3, 24, torch.float32, device)
    _check(kernels, case, 3, 24, torch.float32, device, max_context=129)


@pytest.mark.parametrize("use_dot", [True, False])
def test_decode_mha_dot_or_not(use_dot, device):
    case = make_case(LENS, 32, 2, 16, torch.float32, device, seed=13)     # page 32 = two tiles of 16
    _check(kernels, case, 2, 16, torch.float32, device, num_splits=2, block_n=16, use_dot=use_dot)


@pytest.mark.parametrize("hq,hkv,heads", [(4, 2, 2), (2, 2, 2), (8, 4, 2), (4, 4, 4)])
@pytest.mark.parametrize("head_fastest", [False, True])
def test_decode_several_kv_heads_per_program(hq, hkv, heads, head_fastest, device):
    # block-diagonal query: one program, several KV heads; both grid orders; split and not
    case = make_case(LENS, 4, hkv, 16, torch.float32, device, seed=hq + heads)
    for splits in (1, 2):
        _check(kernels, case, hq, 16, torch.float32, device, num_splits=splits, block_n=16,
               heads_per_program=heads, head_fastest=head_fastest)


def test_decode_several_heads_odd_head_dim_bf16(device):
    case = make_case([3, 29], 16, 2, 24, torch.bfloat16, device, seed=17)
    _check(kernels, case, 2, 24, torch.bfloat16, device, num_splits=2, block_n=16, heads_per_program=2)


def test_decode_many_splits_some_empty(device):
    # more splits than a short request has tiles: empty splits must merge as nothing
    case = make_case([3, 40], 4, 2, 16, torch.float32, device, seed=9)
    _check(kernels, case, 4, 16, torch.float32, device, num_splits=7, block_n=16)


def test_decode_strided_q_view(device):
    # q as a view of a fused qkv projection: token stride larger than Hq * D
    case = make_case([9, 20], 4, 2, 16, torch.float32, device, seed=11)
    qkv = torch.randn(2, 8, 16, dtype=torch.float32, device=device)
    q = qkv[:, :4]
    out = kernels.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, 0.25,
                                         block_n=16)
    ref = reference.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, 0.25)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_reference_decode(page_size, hq, hkv, device):
    case = make_case(LENS, page_size, hkv, 16, torch.float32, device, seed=page_size + hq)
    _check(reference, case, hq, 16, torch.float32, device)


def test_reference_decode_bf16(device):
    case = make_case(LENS, 4, 2, 16, torch.bfloat16, device, seed=4)
    _check(reference, case, 4, 16, torch.bfloat16, device)


def test_decode_empty_batch(device):
    case = make_case([4], 4, 2, 16, torch.float32, device)
    q = torch.empty(0, 4, 16, device=device)
    out = kernels.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table[:0], case.context_lens[:0], 1.0)
    assert out.shape == (0, 4, 16)


@pytest.mark.parametrize("impl", [kernels, reference], ids=["triton", "reference"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_padding_request_with_empty_context(impl, num_splits, device):
    # CUDA-graph batches are padded with dummy requests: context_len 0 must give zeros, not NaN
    case = make_case([5, 9], 4, 2, 16, torch.float32, device, seed=23)
    lens = torch.tensor([0, 9], dtype=torch.int32, device=device)
    q = torch.randn(2, 4, 16, device=device)
    kw = dict(num_splits=num_splits, block_n=16) if impl is kernels else {}
    out = impl.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, lens, 0.25, **kw)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out[1], dense_attention(q[1:], case.dense_k[1], case.dense_v[1], 0.25)[0]) < TOL[torch.float32]


@pytest.mark.parametrize("page_ids", [False, True])
@pytest.mark.parametrize("hq,hkv,heads", [(2, 2, 2), (4, 2, 1)])
def test_decode_tile_over_several_pages(page_ids, hq, hkv, heads, device):
    # a 16-token tile over 4-token pages: one table read per page or per token, same attention;
    # ragged lengths end inside a page and inside a tile, split and not
    case = make_case(LENS, 4, hkv, 16, torch.float32, device, seed=23 + hq)
    for splits in (1, 3):
        _check(kernels, case, hq, 16, torch.float32, device, num_splits=splits, block_n=16,
               heads_per_program=heads, page_ids=page_ids)


@pytest.mark.parametrize("rows32", [True, False])
@pytest.mark.parametrize("hq,hkv,heads", [(4, 2, 1), (4, 4, 2)])
def test_row_offsets_in_either_width_and_a_v_pool_with_its_own_strides(rows32, hq, hkv, heads, device):
    """Row offsets in int32 (where the pools allow) or int64, and V reading K's offsets only where
    their strides agree: a V pool stored in wider rows (its strides differ) gives the same answer."""
    case = make_case(LENS, 4, hkv, 16, torch.float32, device, seed=21 + hkv)
    _check(kernels, case, hq, 16, torch.float32, device, num_splits=2, block_n=8, heads_per_program=heads,
           rows32=rows32)
    wide = torch.full((*case.v_cache.shape[:3], 24), float("nan"), dtype=case.v_cache.dtype, device=device)
    wide[..., :16] = case.v_cache
    case.v_cache = wide[..., :16]
    assert case.v_cache.stride()[:3] != case.k_cache.stride()[:3]
    _check(kernels, case, hq, 16, torch.float32, device, num_splits=2, block_n=8, heads_per_program=heads,
           rows32=rows32)
