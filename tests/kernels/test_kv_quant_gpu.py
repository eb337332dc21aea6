"""Full-size 8-bit KV pages on a CUDA GPU (compiled Triton, bf16 queries, head_dim 128): every kernel
that touches the pool against the torch reference on the same quantized pool (the reference itself
is checked against dense attention by the CPU tests in test_kv_quant.py). Skipped without CUDA.
"""

import os

import pytest
import torch

from kvshare_kernels import cascade_decode as cd
from kvshare_kernels import kernels, kv_quant, reference
from kvshare_kernels.fused_rotary import rotary_write_kv
from paged_cases import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                       reason="needs CUDA (compiled Triton)"),
]

BF16_TOL = 1.5e-2
QDTYPES = [pytest.param(kv_quant.FP8, id="fp8"), pytest.param(torch.int8, id="int8")]
LENS = [1, 17, 300, 1024, 4096, 2049, 64, 777]


def _pool(lens, page_size, hkv, dtype, seed=0, d=128):
    """A quantized pool of random bf16 K/V (shuffled pages; row 1 shares half of row 0's pages) and its scales."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per = [(n + page_size - 1) // page_size for n in lens]
    max_pages = max(pages_per) + 1
    num_pages = len(lens) * max_pages + 4
    k = (torch.randn(num_pages, page_size, hkv, d, device="cuda", generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(num_pages, page_size, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    kc, ks = kv_quant.quantize(k, dtype)
    vc, vs = kv_quant.quantize(v, dtype)
    scales = dict(k_scale=ks, v_scale=vs) if dtype == torch.int8 else dict(k_scale=1.0, v_scale=1.0)
    pt = torch.randperm(num_pages, device="cuda", generator=g)[: len(lens) * max_pages].view(len(lens), max_pages)
    pt = pt.to(torch.int32).contiguous()
    shared = min(pages_per[0], pages_per[1]) // 2
    pt[1, :shared] = pt[0, :shared]
    return kc, vc, scales, pt, torch.tensor(lens, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (32, 32)])
def test_decode_full(dtype, page_size, hq, hkv):
    k, v, scales, pt, lens = _pool(LENS, page_size, hkv, dtype, seed=page_size + hq)
    q = torch.randn(len(LENS), hq, 128, device="cuda", dtype=torch.bfloat16)
    ref = reference.paged_decode_attention(q, k, v, pt, lens, 128 ** -0.5, **scales)
    for cfg in (dict(), dict(num_splits=1), dict(num_splits=16), dict(heads_per_program=2, block_n=32)):
        out = kernels.paged_decode_attention(q, k, v, pt, lens, 128 ** -0.5, max_context=4096, **scales, **cfg)
        assert rel_err(out, ref) < BF16_TOL, cfg


@pytest.mark.parametrize("dtype", QDTYPES)
def test_prefill_full(dtype):
    lens, q_lens = [2048, 1500, 700], [2048, 300, 1]
    k, v, scales, pt, ctx = _pool(lens, 16, 8, dtype, seed=3)
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0, 2048, 2348, 2349], dtype=torch.int32, device="cuda")
    ref = reference.paged_prefill_attention(q, k, v, pt, qsl, ctx, 128 ** -0.5, **scales)
    out = kernels.paged_prefill_attention(q, k, v, pt, qsl, ctx, 128 ** -0.5, max_query_len=2048, **scales)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize("dtype", QDTYPES)
def test_cascade_full(dtype):
    # 16 rows over one 1024-token prefix (64 shared pages), private tails of 1..300 tokens
    lens = [1024 + 1 + 19 * i for i in range(16)]
    k, v, scales, pt, ctx = _pool(lens, 16, 8, dtype, seed=11)
    pt[:, :64] = pt[0, :64]
    q = torch.randn(16, 32, 128, device="cuda", dtype=torch.bfloat16)
    plan = cd.plan_cascade(pt.cpu(), ctx.cpu(), 16)
    assert plan.num_groups >= 1
    ref = reference.paged_decode_attention(q, k, v, pt, ctx, 128 ** -0.5, **scales)
    out = cd.cascade_decode_attention(q, k, v, pt, ctx, plan.to("cuda"), 128 ** -0.5, **scales)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize("dtype", QDTYPES)
def test_writers_and_copies_full(dtype):
    """write_kv and rotary_write_kv store what the reference stores; copy_page_tensors moves values and scales,
    GPU pool to pinned host slots and back."""
    t, hkv, d, pages, page = 512, 8, 128, 64, 16
    k = (torch.randn(t, hkv, d, device="cuda") * 3).to(torch.bfloat16)
    v = torch.randn(t, hkv, d, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(pages * page, device="cuda")[:t].to(torch.int32)
    slots[::7] = -1

    def pool():
        kc = torch.zeros(pages, page, hkv, d, device="cuda").to(dtype)
        vc = torch.zeros_like(kc)
        if dtype == torch.int8:
            return kc, vc, dict(k_scale=torch.zeros(pages, page, hkv, device="cuda"),
                                v_scale=torch.zeros(pages, page, hkv, device="cuda"))
        return kc, vc, dict(k_scale=0.5, v_scale=1.0)

    def close(a, b, sa, sb):
        fa = kv_quant.dequantize(a, sa["k_scale"], torch.float32)
        fb = kv_quant.dequantize(b, sb["k_scale"], torch.float32)
        step = fb.abs().amax(-1, keepdim=True) / (127 if dtype == torch.int8 else 8) + 1e-6
        assert ((fa - fb).abs() <= step).all()

    kc, vc, sc = pool()
    rk, rv, rs = pool()
    kernels.write_kv(k, v, kc, vc, slots, **sc)
    reference.write_kv(k, v, rk, rv, slots, **rs)
    close(kc, rk, sc, rs)
    # rotary + write in one kernel vs rotary then the reference write
    pos = torch.randint(0, 4096, (t,), device="cuda")
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").double() / d))
    ang = torch.arange(4096, device="cuda").double()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(torch.bfloat16)
    q = torch.randn(t, 32, d, device="cuda").to(torch.bfloat16)
    kc, vc, sc = pool()
    rk, rv, rs = pool()
    rotary_write_kv(q.clone(), k, v, cos, sin, pos, kc, vc, slots, **sc)
    _, k2 = reference.rotary_embedding(q.clone(), k.clone(), cos, sin, pos)
    reference.write_kv(k2, v, rk, rv, slots, **rs)
    close(kc, rk, sc, rs)
    # pages out to pinned host slots and back into other pages
    tensors = [kc, vc] + ([sc["k_scale"], sc["v_scale"]] if dtype == torch.int8 else [])
    host = [torch.zeros((8,) + tuple(x.shape[1:]), dtype=x.dtype, pin_memory=True) for x in tensors]
    src = torch.tensor([3, 9, 17, 40], dtype=torch.int32, device="cuda")
    slots_h = torch.tensor([0, 5, 2, 7], dtype=torch.int32)
    kernels.copy_page_tensors(tensors, src, slots_h, dst_tensors=host)
    back = torch.tensor([60, 61, 62, 63], dtype=torch.int32, device="cuda")
    kernels.copy_page_tensors(host, slots_h, back, dst_tensors=tensors)
    torch.cuda.synchronize()
    for x in tensors:
        assert torch.equal(kv_quant.storage_view(x)[back.long()], kv_quant.storage_view(x)[src.long()])
