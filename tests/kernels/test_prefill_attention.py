"""paged_prefill_attention (varlen extend, Triton and reference) against dense causal attention."""

import pytest
import torch

from kvshare_kernels import kernels, reference
from paged_cases import TOL, dense_attention, make_case, rel_err

# (context_len, q_len): whole prompt, prefix + chunk, one token (decode-like), nothing new, long chunk
REQS = [(20, 20), (37, 5), (16, 1), (9, 0), (45, 30)]


def _check(impl, reqs, page_size, hq, hkv, d, dtype, device, seed=0, **kw):
    lens = [n for n, _ in reqs]
    case = make_case(lens, page_size, hkv, d, dtype, device, seed=seed)
    q_lens = [m for _, m in reqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    t = sum(q_lens)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(t, hq, d, generator=gen, dtype=torch.float64).to(dtype).to(device)
    scale = d ** -0.5
    out = torch.full((t, hq, d), float("nan"), dtype=dtype, device=device)
    res = impl.paged_prefill_attention(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens, scale,
                                       out, **kw)
    assert res is out
    for i, (n, m) in enumerate(reqs):
        if m == 0:
            continue
        s = int(qsl[i])
        ref = dense_attention(q[s : s + m], case.dense_k[i], case.dense_v[i], scale)
        err = rel_err(out[s : s + m], ref)
        assert err < TOL[dtype], f"request {i} (ctx {n}, q_len {m}): rel err {err:.2e}"


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2), (6, 2)])
def test_prefill_fp32(page_size, hq, hkv, device):
    _check(kernels, REQS, page_size, hq, hkv, 16, torch.float32, device, seed=page_size + hq,
           block_m=16, block_n=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_half(dtype, device):
    _check(kernels, REQS, 4, 4, 2, 16, dtype, device, seed=2, block_m=16, block_n=16)


def test_prefill_tiles_larger_than_pages_and_odd_head_dim(device):
    # block_n 32 over page size 4 and 16 (several pages per tile), head_dim 24 (masked), max_query_len given
    for ps in (4, 16):
        _check(kernels, REQS, ps, 2, 1, 24, torch.float32, device, seed=ps, block_m=32, block_n=32,
               max_query_len=30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_prefill_tma_tiles(dtype, hq, hkv, device):
    # a tile is one page's slice (page 32, block_n 16) loaded by descriptor: the page's unwritten
    # slots are NaN (make_case), masked on the diagonal, and the answer is the per-thread loads'
    _check(kernels, REQS, 32, hq, hkv, 16, dtype, device, seed=5 + hq, block_m=16, block_n=16, tma=True)


def test_prefill_tma_refuses_what_it_cannot_load(device):
    case = make_case([8], 4, 1, 16, torch.float32, device)
    q = torch.zeros(8, 1, 16, device=device)
    qsl = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="tma needs page_size a multiple of block_n"):
        kernels.paged_prefill_attention(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens,
                                        0.25, block_m=16, block_n=16, tma=True)


def test_prefill_default_config(device):
    _check(kernels, [(70, 70), (90, 17)], 16, 8, 2, 32, torch.float32, device, seed=3)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_reference_prefill(page_size, hq, hkv, device):
    _check(reference, REQS, page_size, hq, hkv, 16, torch.float32, device, seed=page_size)


def test_prefill_one_token_equals_decode(device):
    # a q_len-1 extend is a decode step: both kernels must agree
    case = make_case([13, 40], 4, 2, 16, torch.float32, device, seed=21)
    q = torch.randn(2, 4, 16, device=device)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    a = kernels.paged_prefill_attention(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens, 0.3,
                                        block_m=16, block_n=16)
    b = kernels.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, 0.3,
                                       block_n=16)
    assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("hq,hkv,block_m", [(4, 2, 16), (2, 2, 16), (8, 2, 32)])
def test_tiled_grid_gives_the_grid_launch_bits(hq, hkv, block_m, device):
    """A work list (the CUDA graphs' launch) runs the same programs as the grid, in another order:
    the same bits, idle entries write nothing, query rows past the last request are left alone."""
    from kvshare_kernels.prefill_tiles import plan_tiles, tile_capacity, tokens_per_tile

    reqs = [(45, 30), (16, 1), (9, 0), (37, 5), (20, 20), (33, 1)]
    case = make_case([n for n, _ in reqs], 4, hkv, 16, torch.float32, device, seed=hq + block_m)
    q_lens = [m for _, m in reqs]
    t, padded = sum(q_lens), sum(q_lens) + 7           # a graph's step: 7 padding rows at the end
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(padded, hq, 16, generator=torch.Generator().manual_seed(hq), dtype=torch.float32).to(device)
    kw = dict(block_m=block_m, block_n=16)
    grid = kernels.paged_prefill_attention(q[:t], case.k_cache, case.v_cache, case.page_table, qsl,
                                           case.context_lens, 0.25, **kw)
    per_tile = tokens_per_tile(hq, hkv, block_m)
    tiles = plan_tiles(q_lens, [n for n, _ in reqs], per_tile, tile_capacity(padded, len(reqs) + 2, per_tile))
    assert (tiles[:, 0] == -1).any()
    out = torch.full_like(q, 7.0)
    kernels.paged_prefill_attention(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens, 0.25,
                                    out, tiles=torch.from_numpy(tiles).to(device), debug=True, **kw)
    assert torch.equal(out[:t], grid)
    assert (out[t:] == 7.0).all()


def test_tiles_must_be_int32_pairs(device):
    case = make_case([8], 4, 1, 16, torch.float32, device)
    q = torch.zeros(8, 1, 16, device=device)
    qsl = torch.tensor([0, 8], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="tiles must be contiguous int32"):
        kernels.paged_prefill_attention(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens, 1.0,
                                        tiles=torch.zeros(4, dtype=torch.int64, device=device))
