"""8-bit KV pages (fp8 e4m3, int8 with per-(token, head) scales) through every kernel that touches the pool.

Each kernel runs on a quantized pool and is compared with float64 attention over exactly what the
pool holds (its dequantized values): the kernels must add no error beyond the quantization
itself. The writers (write_kv, rotary_write_kv) must store what kv_quant.quantize stores, and the
quantization error itself is bounded (fp8: 2^-4 relative, int8: half a step of each head's max/127).
Pools hold NaN in every slot a kernel must not read; int8's scales there are NaN too.
"""

from __future__ import annotations

import pytest
import torch

from kvshare_kernels import cascade_decode as cd
from kvshare_kernels import decode_attention as da
from kvshare_kernels import kernels, kv_quant, reference
from kvshare_kernels.fused_rotary import rotary_write_kv
from paged_cases import dense_attention, make_case, rel_err

FP8, INT8 = kv_quant.FP8, torch.int8
QDTYPES = [pytest.param(FP8, id="fp8"), pytest.param(INT8, id="int8")]
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}     # beyond the quantization: rounding only
LENS = [1, 7, 33, 50]


class QuantCase:
    """A paged case whose pool is quantized to ``dtype``; dense_k/v: what that pool holds, float64."""

    def __init__(self, lens, page_size, hkv, d, dtype, device, seed=0, fp8_scales=(1.0, 1.0)):
        base = make_case(lens, page_size, hkv, d, torch.float32, "cpu", seed=seed)
        self.page_size, self.lens, self.dtype = page_size, lens, dtype
        self.k_cache, ks = kv_quant.quantize(base.k_cache, dtype, fp8_scales[0])
        self.v_cache, vs = kv_quant.quantize(base.v_cache, dtype, fp8_scales[1])
        if dtype == INT8:
            self.k_scale, self.v_scale = ks.contiguous(), vs.contiguous()
        else:
            self.k_scale, self.v_scale = fp8_scales
        dk = kv_quant.dequantize(self.k_cache, self.k_scale if dtype == INT8 else fp8_scales[0], torch.float64)
        dv = kv_quant.dequantize(self.v_cache, self.v_scale if dtype == INT8 else fp8_scales[1], torch.float64)
        self.dense_k, self.dense_v = [], []
        for i, n in enumerate(lens):
            pages = base.page_table[i, : -(-n // page_size)].long()
            self.dense_k.append(dk[pages].reshape(-1, hkv, d)[:n].to(device))
            self.dense_v.append(dv[pages].reshape(-1, hkv, d)[:n].to(device))
        self.page_table = base.page_table.to(device)
        self.context_lens = base.context_lens.to(device)
        self.k_cache, self.v_cache = self.k_cache.to(device), self.v_cache.to(device)
        if dtype == INT8:
            self.k_scale, self.v_scale = self.k_scale.to(device), self.v_scale.to(device)

    @property
    def scales(self) -> dict:
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)


# ----------------------------------------------------------------------------------------------
# Quantization itself
# ----------------------------------------------------------------------------------------------

def test_quantization_error_bounds():
    gen = torch.Generator().manual_seed(7)      # a seed whose draws sit on a rounding midpoint
    x = torch.randn(64, 4, 32, dtype=torch.float64, generator=gen)
    x = x * torch.logspace(-2, 1, 4, dtype=torch.float64)[None, :, None]
    x[3, 1] = 0.0                                    # an all-zero head: zeros back, scale 0
    q8, s8 = kv_quant.quantize(x, INT8)
    back = kv_quant.dequantize(q8, s8, torch.float64)
    step = x.abs().amax(-1, keepdim=True).float().double() / 127
    # half a step, plus float32's rounding of x, of the scale and of the product (quantize and
    # dequantize compute in float32): a value at a midpoint may land 3e-6 steps past half a step
    assert ((back - x).abs() <= step / 2 + (x.abs() + step) * 2 ** -21 + 1e-12).all()
    assert s8[3, 1] == 0 and (q8[3, 1] == 0).all()
    assert q8.abs().max() <= 127
    f8, _ = kv_quant.quantize(x, FP8)
    back = kv_quant.dequantize(f8, 1.0, torch.float64)
    big = x.abs() >= 2 ** -6                         # normal e4m3 range: 3 mantissa bits
    assert ((back - x).abs()[big] <= x.abs()[big] * 2 ** -4).all()
    assert kv_quant.quantize(torch.tensor([1000.0, -1e6]), FP8)[0].float().tolist() == [448.0, -448.0]


def test_scale_arguments_are_checked(device):
    case = QuantCase([5], 4, 2, 16, INT8, device)
    q = torch.randn(1, 2, 16, device=device)
    with pytest.raises(ValueError, match="int8 cache needs k_scale"):
        kernels.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, 0.25)
    with pytest.raises(ValueError, match="v_scale must be float32"):
        kernels.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, 0.25,
                                       k_scale=case.k_scale, v_scale=case.v_scale.half())
    f8 = QuantCase([5], 4, 2, 16, FP8, device)
    with pytest.raises(ValueError, match="positive float"):
        reference.write_kv(q[:, :2], q[:, :2], f8.k_cache, f8.v_cache, torch.tensor([0], device=device), k_scale=0.0)
    with pytest.raises(ValueError, match="for 8-bit caches"):
        kernels.write_kv(q, q, q.new_zeros(2, 4, 2, 16), q.new_zeros(2, 4, 2, 16),
                         torch.tensor([0], device=device), k_scale=1.0)


# ----------------------------------------------------------------------------------------------
# Writers
# ----------------------------------------------------------------------------------------------

def _empty_pool(dtype, pages, page_size, hkv, d, device):
    k = torch.zeros(pages, page_size, hkv, d, device=device).to(dtype)
    v = torch.zeros_like(k)
    if dtype == INT8:
        return k, v, dict(k_scale=torch.zeros(pages, page_size, hkv, device=device),
                          v_scale=torch.zeros(pages, page_size, hkv, device=device))
    return k, v, dict(k_scale=0.5, v_scale=2.0)


def _assert_same_pool(a: torch.Tensor, b: torch.Tensor, a_scale, b_scale):
    """Same stored values, int8 within one quantum (the kernels' division may round differently)."""
    if a.dtype == INT8:
        assert (a.int() - b.int()).abs().max() <= 1
        torch.testing.assert_close(a_scale, b_scale, rtol=1e-6, atol=0)
    else:
        fa, fb = a.float(), b.float()
        # one e4m3 step at most, for the same reason
        assert ((fa - fb).abs() <= fb.abs() * 2 ** -3 + 2 ** -9).all()


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_write_kv_quantizes_like_the_reference(dtype, act, device):
    t, hkv, d, page = 9, 3, 24, 4
    gen = torch.Generator().manual_seed(2)
    k = (torch.randn(t, hkv, d, generator=gen) * 3).to(act).to(device)
    v = torch.randn(t, hkv, d, generator=gen).to(act).to(device)
    slots = torch.tensor([5, -1, 0, 11, 2, 3, 7, -1, 8], dtype=torch.int32, device=device)
    kc, vc, sc = _empty_pool(dtype, 3, page, hkv, d, device)
    rk, rv, rs = _empty_pool(dtype, 3, page, hkv, d, device)
    kernels.write_kv(k, v, kc, vc, slots, **sc)
    reference.write_kv(k, v, rk, rv, slots, **rs)
    _assert_same_pool(kc, rk, sc["k_scale"], rs["k_scale"])
    _assert_same_pool(vc, rv, sc["v_scale"], rs["v_scale"])
    # what was written reads back as the input within the quantization error
    flat = slots[slots >= 0].long()
    keep = slots >= 0
    ks = sc["k_scale"].view(-1, hkv)[flat] if dtype == INT8 else sc["k_scale"]
    back = kv_quant.dequantize(kc.view(-1, hkv, d)[flat.cpu()].to(device) if dtype != FP8
                               else kv_quant.storage_view(kc).view(-1, hkv, d)[flat].view(FP8), ks, torch.float64)
    err = (back - k[keep].double()).abs().max()
    assert err <= (k.abs().max().double() * (2 ** -4 if dtype == FP8 else 1 / 254)) + 1e-6


@pytest.mark.parametrize("dtype", QDTYPES)
def test_rotary_write_kv_quantizes_like_rotary_then_write_kv(dtype, device):
    t, hq, hkv, d = 6, 4, 2, 16
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(t, hq, d, generator=gen).to(device)
    k = (torch.randn(t, hkv, d, generator=gen) * 4).to(device)
    v = torch.randn(t, hkv, d, generator=gen).to(device)
    pos = torch.tensor([0, 3, 9, 1, 2, 30], device=device)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    ang = torch.arange(64).double()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float().to(device)
    sin = torch.cat([ang.sin(), ang.sin()], -1).float().to(device)
    slots = torch.tensor([0, 5, -1, 3, 7, 1], dtype=torch.int32, device=device)
    kc, vc, sc = _empty_pool(dtype, 2, 4, hkv, d, device)
    rk, rv, rs = _empty_pool(dtype, 2, 4, hkv, d, device)
    q1 = rotary_write_kv(q.clone(), k, v, cos, sin, pos, kc, vc, slots, **sc)
    q2, k2 = reference.rotary_embedding(q.clone(), k.clone(), cos, sin, pos)
    reference.write_kv(k2, v, rk, rv, slots, **rs)
    torch.testing.assert_close(q1, q2, rtol=1e-5, atol=1e-5)
    _assert_same_pool(kc, rk, sc["k_scale"], rs["k_scale"])
    _assert_same_pool(vc, rv, sc["v_scale"], rs["v_scale"])


# ----------------------------------------------------------------------------------------------
# Readers
# ----------------------------------------------------------------------------------------------

def _check_decode(impl, case, hq, d, dtype, device, **kw):
    torch.manual_seed(1)
    b = len(case.lens)
    q = torch.randn(b, hq, d, dtype=torch.float64).to(dtype).to(device)
    out = torch.full((b, hq, d), float("nan"), dtype=dtype, device=device)
    impl.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, d ** -0.5, out,
                                **case.scales, **kw)
    for i, n in enumerate(case.lens):
        ref = dense_attention(q[i: i + 1], case.dense_k[i], case.dense_v[i], d ** -0.5)[0]
        err = rel_err(out[i], ref)
        assert err < TOL[dtype], f"request {i} (len {n}): rel err {err:.2e} {kw}"


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("page_size,hq,hkv,kw", [
    (4, 4, 2, dict(num_splits=1, block_n=16)),                       # GQA, a tile over several pages
    (16, 6, 2, dict(num_splits=3, block_n=16)),                      # GQA 3, split-K, one page per tile
    (1, 2, 2, dict(num_splits=2, block_n=16, use_dot=False)),        # MHA, page size 1, no dot
    (4, 4, 4, dict(num_splits=2, block_n=16, heads_per_program=2)),  # MHA, two KV heads per program
    (4, 8, 4, dict(num_splits=1, block_n=16, heads_per_program=2)),  # GQA 2, two KV heads per program
])
def test_decode_reads_quantized_pages(dtype, page_size, hq, hkv, kw, device):
    case = QuantCase(LENS, page_size, hkv, 16, dtype, device, seed=page_size + hq, fp8_scales=(0.5, 2.0))
    _check_decode(kernels, case, hq, 16, torch.float32, device, **kw)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_decode_reference_and_bf16_queries(dtype, device):
    case = QuantCase(LENS, 4, 2, 16, dtype, device, seed=9)
    _check_decode(reference, case, 4, 16, torch.float32, device)
    _check_decode(kernels, case, 4, 16, torch.bfloat16, device, num_splits=2, block_n=16)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_decode_mha_fp16_queries(dtype, device):
    """MHA's default path (two KV heads per program) with fp16 queries: int8's scaled probabilities
    and fp8's e4m3 -> fp16 convert feed fp16 dots; the per-head scales must reach the right rows."""
    case = QuantCase(LENS, 4, 4, 16, dtype, device, seed=13, fp8_scales=(0.5, 2.0))
    _check_decode(kernels, case, 4, 16, torch.float16, device, num_splits=2)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_decode_8bit_default_tile_bf16_queries(dtype, device):
    """8-bit GQA pages take their own default tile (128 tokens; 16-bit pages keep 64), and the default
    launch over it reads them right with bf16 queries: fp8 through fp16 dots (kv_tiles.dot_query),
    contexts of one token, of one tile and a bit, and of several tiles split over programs."""
    case = QuantCase([1, 130, 300], 16, 2, 16, dtype, device, seed=31, fp8_scales=(0.5, 2.0))
    assert da.default_config(8, 2, kv_quant.mode_of(case.k_cache))["block_n"] == 128
    assert da.default_config(8, 2)["block_n"] == 64
    _check_decode(kernels, case, 8, 16, torch.bfloat16, device)
    _check_decode(kernels, case, 8, 16, torch.bfloat16, device, num_splits=3)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_decode_8bit_mha_default_tile(dtype, device):
    """8-bit pages with as many query as KV heads take their layout's tile (fp8: four KV heads of 32
    tokens, int8: two of 64; 16-bit pages two of 32), and that default launch reads them right with
    bf16 queries, split and not, at page 16."""
    case = QuantCase([1, 40, 97], 16, 4, 16, dtype, device, seed=37, fp8_scales=(2.0, 0.5))
    mode = kv_quant.mode_of(case.k_cache)
    heads, block_n = (4, 32) if mode == kv_quant.FP8_MODE else (2, 64)
    cfg = da.default_config(4, 4, mode)
    assert (cfg["heads_per_program"], cfg["block_n"]) == (heads, block_n)
    assert (da.default_config(4, 4)["heads_per_program"], da.default_config(4, 4)["block_n"]) == (2, 32)
    assert da.default_config(2, 2, mode)["heads_per_program"] == 2   # 4 does not divide 2
    _check_decode(kernels, case, 4, 16, torch.bfloat16, device)
    _check_decode(kernels, case, 4, 16, torch.bfloat16, device, num_splits=2)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("impl", [kernels, reference], ids=["triton", "reference"])
@pytest.mark.parametrize("qdt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_reads_quantized_pages(dtype, impl, qdt, device):
    """float32 queries, and bf16 ones (over fp8 tiles the kernel's dots then run in fp16)."""
    lens, q_lens = [9, 33, 20], [9, 5, 1]              # a whole prompt, an extend chunk, one token
    case = QuantCase(lens, 4, 2, 16, dtype, device, seed=21, fp8_scales=(1.0, 0.25))
    hq, d = 4, 16
    q = torch.randn(sum(q_lens), hq, d, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(qdt)
    q = q.to(device)
    qsl = torch.tensor([0, 9, 14, 15], dtype=torch.int32, device=device)
    out = impl.paged_prefill_attention(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens,
                                       d ** -0.5, **case.scales)
    for i in range(len(lens)):
        s, e = int(qsl[i]), int(qsl[i + 1])
        ref = dense_attention(q[s:e], case.dense_k[i], case.dense_v[i], d ** -0.5)
        assert rel_err(out[s:e], ref) < TOL[qdt], f"request {i}"


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("block_n", [16, 32])
def test_prefill_unmasked_tiles_read_quantized_pages(dtype, block_n, device):
    """An extend chunk after 75 cached tokens: its first 64 keys are tiles every row sees in full, read
    without masks (page 16: one page a tile at block_n 16, two pages a tile at 32), scales folded as
    on the diagonal."""
    lens, q_lens = [80, 20], [5, 20]
    case = QuantCase(lens, 4, 2, 16, dtype, device, seed=23, fp8_scales=(0.5, 2.0))
    hq, d = 4, 16
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(4)).to(device)
    qsl = torch.tensor([0, 5, 25], dtype=torch.int32, device=device)
    out = kernels.paged_prefill_attention(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens,
                                          d ** -0.5, block_n=block_n, **case.scales)
    for i in range(len(lens)):
        s, e = int(qsl[i]), int(qsl[i + 1])
        ref = dense_attention(q[s:e], case.dense_k[i], case.dense_v[i], d ** -0.5)
        assert rel_err(out[s:e], ref) < TOL[torch.float32], f"request {i}"


@pytest.mark.parametrize("dtype", QDTYPES)
def test_cascade_reads_quantized_pages(dtype, device):
    lens = [40, 40, 41, 44, 9]                          # a chain of shared prefix pages, one short row
    case = QuantCase(lens, 4, 2, 16, dtype, device, seed=5, fp8_scales=(2.0, 0.5))
    plan = cd.plan_cascade(case.page_table.cpu(), case.context_lens.cpu(), 4)
    assert plan.num_groups >= 1
    hq, d = 4, 16
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(8)).to(device)
    for impl in (cd.cascade_decode_attention, cd.cascade_decode_reference):
        out = impl(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, plan.to(device), d ** -0.5,
                   **case.scales)
        for i in range(len(lens)):
            ref = dense_attention(q[i: i + 1], case.dense_k[i], case.dense_v[i], d ** -0.5)[0]
            assert rel_err(out[i], ref) < TOL[torch.float32], f"{impl.__name__} row {i}"


@pytest.mark.parametrize("dtype", QDTYPES)
def test_cascade_mha_two_heads_per_program(dtype, device):
    """MHA cascade with two KV heads per program on both sides (block-diagonal queries): each row's
    int8 scales are its own KV head's."""
    lens = [40, 40, 41, 9]
    case = QuantCase(lens, 4, 4, 16, dtype, device, seed=6, fp8_scales=(0.5, 2.0))
    plan = cd.plan_cascade(case.page_table.cpu(), case.context_lens.cpu(), 4)
    assert plan.num_groups >= 1
    q = torch.randn(len(lens), 4, 16, generator=torch.Generator().manual_seed(9)).to(device)
    out = cd.cascade_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens,
                                      plan.to(device), 16 ** -0.5, heads_per_program=2, suffix_heads_per_program=2,
                                      prefix_splits=2, num_splits=2, **case.scales)
    for i in range(len(lens)):
        ref = dense_attention(q[i: i + 1], case.dense_k[i], case.dense_v[i], 16 ** -0.5)[0]
        assert rel_err(out[i], ref) < TOL[torch.float32], f"row {i}"


# ----------------------------------------------------------------------------------------------
# Page copies: a page's scales move with it
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("impl", [kernels, reference], ids=["triton", "reference"])
def test_copy_page_tensors_moves_values_and_scales(dtype, impl, device):
    case = QuantCase([20, 12], 4, 2, 16, dtype, device, seed=7)
    tensors = [case.k_cache, case.v_cache] + ([case.k_scale, case.v_scale] if dtype == INT8 else [])
    before = [kv_quant.storage_view(t).clone() for t in tensors]
    src = torch.tensor([1, 4], dtype=torch.int32, device=device)
    dst = torch.tensor([6, 0], dtype=torch.int32, device=device)
    impl.copy_page_tensors(tensors, src, dst)
    for t, b in zip(tensors, before):
        exp = b.clone()
        exp[[6, 0]] = b[[1, 4]]
        torch.testing.assert_close(kv_quant.storage_view(t), exp, rtol=0, atol=0, equal_nan=True)
    # to a host pool (the tier): every tensor, dtype kept
    host = [torch.zeros((3,) + tuple(t.shape[1:]), dtype=t.dtype) for t in tensors]
    impl.copy_page_tensors(tensors, src, torch.tensor([2, 0], dtype=torch.int32), dst_tensors=host)
    for t, h in zip(tensors, host):
        torch.testing.assert_close(kv_quant.storage_view(h)[[2, 0]], kv_quant.storage_view(t)[[1, 4]].cpu(),
                                   rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="page tensor 0 differs"):
        impl.copy_page_tensors(tensors[:1], src, dst, dst_tensors=[torch.zeros(3, 4, 2, 16)])
