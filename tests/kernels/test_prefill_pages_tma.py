"""prefill_pages_tma (Gluon: one bulk copy per page into a 128-key tile) against dense causal attention
on a Hopper GPU. Gluon has no interpreter: on the CPU the kernel is only compiled for sm_90
(tests/perf/test_hopper_compile.py); here it runs.

The pools are make_new_kv_case's: the chunk's slots in the pool, every unused page, and the page
table's entries past each context are NaN or -1, and the step's K/V buffer has NaN rows past its
tokens, so a read of anything the kernel must not use shows as NaN in the output.
"""

import pytest
import torch

from paged_cases import TOL, dense_attention, make_new_kv_case, rel_err

# the kernel's four orders of copies and products (prefill_pages_tma.ORDERS), importable without a GPU
ORDERS = ("serial", "overlapped", "producer", "pingpong")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs a Hopper GPU (Gluon TMA kernel)"),
]

# (context, chunk): a prompt of several tiles; prefixes that end mid-page, on a page, on a tile; a
# one-token chunk over a long prefix; nothing new; chunks that end mid-tile
REQS = [(300, 300), (700, 37), (129, 1), (9, 0), (1000, 200), (256, 128), (4096, 512), (143, 15)]


def _inputs(reqs, page_size, hq, hkv, d, dtype, seed):
    """make_new_kv_case's pools and step K/V, the queries and their start offsets, on the GPU."""
    case, k_new, v_new = make_new_kv_case(reqs, page_size, hq, hkv, d, dtype, "cuda", seed=seed)
    q_lens = [m for _, m in reqs]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return case, k_new, v_new, q.to(dtype).cuda(), qsl


def _run(reqs, page_size, hq, hkv, d, dtype, tiled, seed, order="serial"):
    """The kernel on _inputs, checked against dense attention request by request; (out, inputs)."""
    from kvshare_kernels.prefill_pages_tma import BLOCK_M, applies, paged_prefill_pages_tma
    from kvshare_kernels.prefill_tiles import plan_tiles, tokens_per_tile

    case, k_new, v_new, q, qsl = inputs = _inputs(reqs, page_size, hq, hkv, d, dtype, seed)
    q_lens = [m for _, m in reqs]
    assert applies(case.k_cache, case.v_cache, q)
    tiles = None
    if tiled:   # a graph's work list: more entries than blocks, the rest idle
        per_tile = tokens_per_tile(hq, hkv, BLOCK_M)
        tiles = torch.from_numpy(plan_tiles(q_lens, [n for n, _ in reqs], per_tile,
                                            capacity=sum(-(-m // per_tile) for m in q_lens) + 5)).cuda()
    out = torch.full_like(q, float("nan"))
    paged_prefill_pages_tma(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens, d ** -0.5,
                            k_new, v_new, out, tiles=tiles, max_query_len=max(q_lens), order=order)
    for i, (n, m) in enumerate(reqs):
        if m:
            s = int(qsl[i])
            ref = dense_attention(q[s:s + m], case.dense_k[i], case.dense_v[i], d ** -0.5)
            err = rel_err(out[s:s + m], ref)
            assert err < TOL[dtype], f"request {i} (ctx {n}, q_len {m}): rel err {err:.2e}"
    return out, inputs


# every page size, head grouping and launch in the serial order; the other orders (the same loads
# and masks, their products and copies rearranged) at pages 16 and 64 from the engine's work list
CASES = ([(page, hq, hkv, tiled, "serial") for page in (16, 32, 64) for hq, hkv in ((8, 2), (4, 4), (6, 2))
          for tiled in (True, False)]
         + [(page, hq, hkv, True, order) for order in ORDERS[1:] for page in (16, 64)
            for hq, hkv in ((8, 2), (4, 4), (6, 2))])


@pytest.mark.parametrize("page_size,hq,hkv,tiled,order", CASES)   # GQA, MHA, a group of 3 padded to 4 rows
def test_matches_dense_attention(page_size, hq, hkv, tiled, order):
    _run(REQS, page_size, hq, hkv, 128, torch.bfloat16, tiled, seed=page_size + hq, order=order)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("order", ORDERS)
def test_dtypes_and_head_dims(dtype, d, order):
    _run(REQS[:6], 16, 8, 2, d, dtype, True, seed=d, order=order)


@pytest.mark.parametrize("order", ORDERS)
def test_gives_the_triton_kernels_answer_on_the_engines_shapes(order):
    """Llama-3-8B's heads at page 16, against the engine's Triton launch on the same inputs."""
    from kvshare_kernels import kernels

    reqs = [(2560, 512), (2048, 2048), (8192 + 1024, 1024)]
    out, (case, k_new, v_new, q, qsl) = _run(reqs, 16, 32, 8, 128, torch.bfloat16, True, seed=5, order=order)
    triton_out = kernels.paged_prefill_attention(q, case.k_cache, case.v_cache, case.page_table, qsl,
                                                 case.context_lens, 128 ** -0.5, k_new=k_new, v_new=v_new)
    assert rel_err(out, triton_out) < TOL[torch.bfloat16]


def test_refuses_what_it_cannot_copy():
    from kvshare_kernels.prefill_pages_tma import applies

    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16, device="cuda")
    pool = torch.zeros(8, 16, 2, 128, dtype=torch.bfloat16, device="cuda")

    def pools(*shape):
        return torch.zeros(*shape, dtype=torch.bfloat16, device="cuda")

    assert applies(pool, pool, q)
    assert not applies(pool.float(), pool.float(), q.float())                  # 32-bit pages
    assert not applies(pools(8, 48, 2, 128), pools(8, 48, 2, 128), q)   # 48 does not divide 128
    assert not applies(pools(8, 4, 2, 128), pools(8, 4, 2, 128), q)     # under a swizzle atom
    assert not applies(pools(8, 16, 2, 96), pools(8, 16, 2, 96), q[..., :96])
    assert not applies(pool, pool, q.half())                                   # q's dtype differs
    assert not applies(pool, pools(8, 16, 2, 256)[..., :128], q)       # V in wider rows


def test_the_engines_entry_point_routes_to_it_when_asked():
    """paged_prefill_attention(..., page_copies=True), as the engine calls it on Hopper by
    default, runs this kernel: the same bits as calling it directly."""
    from kvshare_kernels import kernels
    from kvshare_kernels.prefill_pages_tma import paged_prefill_pages_tma

    case, k_new, v_new, q, qsl = _inputs(REQS[:6], 16, 8, 2, 128, torch.bfloat16, seed=21)
    args = (q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens, 128 ** -0.5)
    routed = kernels.paged_prefill_attention(*args, k_new=k_new, v_new=v_new, page_copies=True)
    direct = paged_prefill_pages_tma(*args, k_new, v_new)
    assert torch.equal(routed, direct)


def test_names_an_order_it_does_not_have():
    from kvshare_kernels.prefill_pages_tma import ORDERS as KERNEL_ORDERS, paged_prefill_pages_tma

    assert KERNEL_ORDERS == ORDERS
    case, k_new, v_new, q, qsl = _inputs(REQS[:2], 16, 8, 2, 128, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match="order 'pipelined'"):
        paged_prefill_pages_tma(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens, 0.1,
                                k_new, v_new, order="pipelined")
