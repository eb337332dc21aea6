"""paged_prefill_attention (varlen extend, Triton and reference) against dense causal attention."""

import pytest
import torch

from kvshare_kernels import kernels, reference
from paged_cases import TOL, dense_attention, make_case, make_new_kv_case, rel_err

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


@pytest.mark.parametrize("rows32", [True, False])
def test_row_offsets_in_either_width_and_a_v_pool_with_its_own_strides(rows32, device):
    """Tiles over several pages (the gather path) compute row offsets in int32 where the pools allow
    and in int64 otherwise, and share K's offsets with V only when their strides agree: the same
    answer all ways, also with V a strided view whose rows are wider than K's."""
    _check(kernels, REQS, 4, 4, 2, 16, torch.float32, device, seed=11, block_m=16, block_n=16, rows32=rows32)

    class WideV:    # V stored in rows of 24 with the first 16 used: strides differ from K's
        def paged_prefill_attention(self, q, k_cache, v_cache, *args, **kw):
            wide = torch.full((*v_cache.shape[:3], 24), float("nan"), dtype=v_cache.dtype, device=v_cache.device)
            wide[..., :16] = v_cache
            assert wide[..., :16].stride()[:2] != k_cache.stride()[:2]
            return kernels.paged_prefill_attention(q, k_cache, wide[..., :16], *args, **kw)

    _check(WideV(), REQS, 4, 4, 2, 16, torch.float32, device, seed=12, block_m=16, block_n=16, rows32=rows32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_prefill_tma_tiles(dtype, hq, hkv, device):
    # a tile is one page's slice (page 32, block_n 16) loaded by descriptor: the page's unwritten
    # slots are NaN (make_case), masked on the diagonal, and the answer is the per-thread loads'
    _check(kernels, REQS, 32, hq, hkv, 16, dtype, device, seed=5 + hq, block_m=16, block_n=16, tma=True)


@pytest.mark.parametrize("tma", [False, True], ids=["thread-loads", "tma"])
def test_prefill_page_ids_read_a_tile_ahead(tma, device):
    # the next tile's page id read one iteration ahead: the same answer, contexts ending mid-page
    # and on page boundaries (REQS), so the last read ahead is masked
    _check(kernels, REQS, 32, 4, 2, 16, torch.bfloat16, device, seed=11, block_m=16, block_n=16, tma=tma,
           prefetch_page_ids=True)
    _check(kernels, REQS, 16, 2, 2, 16, torch.float32, device, seed=12, block_m=16, block_n=16, tma=tma,
           prefetch_page_ids=True)


@pytest.mark.parametrize("page_size", [4, 16])
def test_prefill_page_ids_of_a_multi_page_tile_read_ahead(page_size, device):
    # a 32-key tile over 8 or 2 pages: the next tile's ids read one iteration ahead, the last read
    # masked past the context
    _check(kernels, REQS, page_size, 4, 2, 16, torch.bfloat16, device, seed=13 + page_size, block_m=16, block_n=32,
           prefetch_page_ids=True)


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


def test_default_launch_follows_the_page():
    from kvshare_kernels.prefill_attention import PER_THREAD, default_launch

    cpu = torch.device("cpu")       # the interpreter loads descriptors like Hopper
    assert default_launch(16, torch.bfloat16, 128, cpu) == PER_THREAD
    wide = default_launch(128, torch.bfloat16, 128, cpu)
    assert (wide.block_m, wide.block_n, wide.num_warps, wide.num_stages, wide.tma) == (128, 128, 8, 3, True)
    assert default_launch(256, torch.float16, 64, cpu) == wide
    assert default_launch(64, torch.bfloat16, 128, cpu).block_n == 64
    # 8-bit pages and a head_dim no box can hold keep the per-thread loads
    assert default_launch(128, torch.int8, 128, cpu) == PER_THREAD
    assert default_launch(128, torch.float32, 128, cpu) == PER_THREAD      # would not fit shared memory
    assert default_launch(128, torch.bfloat16, 96, cpu) == PER_THREAD
    # the chunk's keys from the step: the wide tile at page 16 too, TMA pages where a page holds them
    from kvshare_kernels.prefill_attention import NEW_KV_LAUNCH
    assert default_launch(16, torch.bfloat16, 128, cpu, new_kv=True) == NEW_KV_LAUNCH
    assert default_launch(128, torch.bfloat16, 128, cpu, new_kv=True) == wide
    assert default_launch(16, torch.int8, 128, cpu, new_kv=True) == PER_THREAD


def test_engine_work_list_matches_the_default_launch(device):
    """The engine builds its work list with default_launch's block_m (runtime/model_runner.py) and
    launches without naming a tile: on a page-64 pool that is the 128-row TMA launch, and every
    query row must still be covered exactly once."""
    from kvshare_kernels.prefill_attention import default_launch
    from kvshare_kernels.prefill_tiles import plan_tiles, tokens_per_tile

    reqs = [(150, 150), (70, 6), (64, 64), (9, 0)]
    hq, hkv, d = 4, 2, 16
    case = make_case([n for n, _ in reqs], 64, hkv, d, torch.bfloat16, device, seed=31)
    launch = default_launch(64, torch.bfloat16, d, torch.device(device))
    assert launch.tma
    q_lens = [m for _, m in reqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    q = q.to(torch.bfloat16).to(device)
    tiles = plan_tiles(q_lens, [n for n, _ in reqs], tokens_per_tile(hq, hkv, launch.block_m))
    out = kernels.paged_prefill_attention(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens,
                                          d ** -0.5, tiles=torch.from_numpy(tiles).to(device))
    for i, (n, m) in enumerate(reqs):
        if m:
            s = int(qsl[i])
            ref = dense_attention(q[s: s + m], case.dense_k[i], case.dense_v[i], d ** -0.5)
            assert rel_err(out[s: s + m], ref) < TOL[torch.bfloat16], f"request {i}"


def _assert_dense(out, q, case, reqs, qsl, d, dtype):
    for i, (n, m) in enumerate(reqs):
        if m:
            s = int(qsl[i])
            ref = dense_attention(q[s:s + m], case.dense_k[i], case.dense_v[i], d ** -0.5)
            assert rel_err(out[s:s + m], ref) < TOL[dtype], f"request {i} (ctx {n}, q_len {m})"


@pytest.mark.parametrize("page_size,block_n,tma", [(4, 16, False), (16, 16, False), (16, 32, False), (32, 16, True)],
                         ids=["page4", "page16", "page16-wide-tile", "page32-tma"])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2), (6, 2)])     # 6/2: a group of 3 padded to 4 rows (SmolLM2's)
def test_prefill_reads_the_chunk_from_the_steps_kv(page_size, block_n, tma, hq, hkv, device):
    """k_new/v_new: each chunk's own keys come from the step's K/V (the pool's chunk slots are NaN
    here) and only the cached prefix through the page table, prefixes ending mid-tile included."""
    reqs = [(20, 20), (37, 5), (16, 1), (9, 0), (45, 30), (70, 41)]
    d, dtype = 16, torch.bfloat16
    case, k_new, v_new = make_new_kv_case(reqs, page_size, hq, hkv, d, dtype, device, seed=40 + page_size + hq)
    q_lens = [m for _, m in reqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    q = q.to(dtype).to(device)
    out = kernels.paged_prefill_attention(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens,
                                          d ** -0.5, block_m=16, block_n=block_n, tma=tma, k_new=k_new, v_new=v_new)
    _assert_dense(out, q, case, reqs, qsl, d, dtype)


def test_prefill_new_kv_default_launch_and_work_list(device):
    """The engine's page-16 launch with the step's K/V: default_launch gives the 128-row tile, the
    work list is built with it, and every row is covered exactly once (NaN otherwise)."""
    from kvshare_kernels.prefill_attention import NEW_KV_LAUNCH, default_launch
    from kvshare_kernels.prefill_tiles import plan_tiles, tokens_per_tile

    reqs = [(150, 150), (300, 6), (64, 64), (9, 0), (200, 131)]
    hq, hkv, d, dtype = 4, 2, 16, torch.bfloat16
    launch = default_launch(16, dtype, d, torch.device(device), new_kv=True)
    assert launch == NEW_KV_LAUNCH
    case, k_new, v_new = make_new_kv_case(reqs, 16, hq, hkv, d, dtype, device, seed=77)
    q_lens = [m for _, m in reqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    q = q.to(dtype).to(device)
    tiles = plan_tiles(q_lens, [n for n, _ in reqs], tokens_per_tile(hq, hkv, launch.block_m), capacity=12)
    out = torch.full_like(q, float("nan"))
    kernels.paged_prefill_attention(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens,
                                    d ** -0.5, out, tiles=torch.from_numpy(tiles).to(device), k_new=k_new, v_new=v_new)
    _assert_dense(out, q, case, reqs, qsl, d, dtype)


def test_prefill_new_kv_refuses_what_it_cannot_read(device):
    case = make_case([8], 16, 2, 16, torch.bfloat16, device)
    q = torch.zeros(8, 2, 16, dtype=torch.bfloat16, device=device)
    qsl = torch.tensor([0, 8], dtype=torch.int32, device=device)
    k = torch.zeros(8, 2, 16, dtype=torch.bfloat16, device=device)
    call = lambda **kw: kernels.paged_prefill_attention(  # noqa: E731
        q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens, 0.25, **kw)
    with pytest.raises(ValueError, match="k_new and v_new come together"):
        call(k_new=k)
    with pytest.raises(ValueError, match=r"v_new must be torch.bfloat16 \[8, 2, 16\]"):
        call(k_new=k, v_new=k[:4])
    with pytest.raises(ValueError, match="k_new needs contiguous heads"):
        call(k_new=k.transpose(1, 2).contiguous().transpose(1, 2), v_new=k)
    f32 = make_case([8], 16, 2, 16, torch.float32, device)
    with pytest.raises(ValueError, match="16-bit pool"):
        kernels.paged_prefill_attention(q.float(), f32.k_cache, f32.v_cache, f32.page_table, qsl, f32.context_lens,
                                        0.25, k_new=k.float(), v_new=k.float())


def test_page_copies_falls_back_where_the_gluon_kernel_does_not_apply(device):
    """page_copies asks for prefill_pages_tma's kernel (Hopper only, no interpreter): elsewhere, and
    for a launch other than the default one, the Triton launch runs and gives its own bits."""
    from kvshare_kernels import prefill_pages_tma
    from kvshare_kernels.prefill_attention import NEW_KV_LAUNCH

    assert prefill_pages_tma.BLOCK_M == NEW_KV_LAUNCH.block_m      # the engine's work lists serve both
    reqs = [(150, 150), (300, 6), (9, 0), (200, 131)]
    hq, hkv, d, dtype = 4, 2, 16, torch.bfloat16
    case, k_new, v_new = make_new_kv_case(reqs, 16, hq, hkv, d, dtype, device, seed=12)
    q_lens = [m for _, m in reqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    q = q.to(dtype).to(device)
    args = (q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens, d ** -0.5)
    plain = kernels.paged_prefill_attention(*args, k_new=k_new, v_new=v_new)
    asked = kernels.paged_prefill_attention(*args, k_new=k_new, v_new=v_new, page_copies=True)
    if not prefill_pages_tma.applies(case.k_cache, case.v_cache, q):      # d = 16: never the Gluon kernel's
        assert torch.equal(plain, asked)
    _assert_dense(asked, q, case, reqs, qsl, d, dtype)
