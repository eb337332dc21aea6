"""Sliding-window attention and logit soft-capping (issue #39) in every attention path.

Each implementation is compared with a dense float64 computation written here independently of
them: the request's whole key sequence, scores scale * q.k, capped to C * tanh(s / C), masked to
p - W < j <= p (HF transformers' sliding-window causal mask), softmax. The pools are NaN wherever
nothing was written, and the page-table entries of pages wholly before a request's window hold -1
(and those pages are NaN too), as after the pool took them back: a kernel that reads one of them,
or a key outside the window, turns its output into NaN or into a visibly different value.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvshare_kernels import checks, cpu_decode, kv_quant, reference

FP8, INT8 = kv_quant.FP8, torch.int8
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
TOL8 = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def dense_windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
                   softcap: float) -> torch.Tensor:
    """q [M, Hq, D]: the last M tokens of a sequence with keys k, v [N, Hkv, D]; float64."""
    m, hq, _ = q.shape
    n, hkv, _ = k.shape
    g = hq // hkv
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p = (n - m + torch.arange(m))[:, None]
    j = torch.arange(n)[None, :]
    seen = j <= p
    if window:
        seen &= j > p - window
    s = s.masked_fill(~seen.to(s.device), float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s, dim=-1), vv)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class WindowCase:
    """Requests' K/V scattered into a NaN pool through shuffled pages; with ``released`` (the first
    query position of each request), the entries of pages wholly before that query's window are -1
    and their pages NaN. dense_k/v: what the pool holds (dequantized for 8-bit pools), float64."""

    def __init__(self, lens, page_size, hkv, d, device, *, dtype=torch.float32, window=0, first_query=None,
                 seed=0, fp8_scales=(0.5, 2.0)):
        gen = torch.Generator().manual_seed(seed)
        self.lens, self.page_size = list(lens), page_size
        n_pages = [math.ceil(n / page_size) for n in lens]
        width = max(n_pages) + 2
        num_pages = sum(n_pages) + 2
        perm = torch.randperm(num_pages, generator=gen).tolist()
        base_dtype = torch.float32 if kv_quant.is_8bit(dtype) else dtype
        k_cache = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=base_dtype)
        v_cache = torch.full_like(k_cache, float("nan"))
        table = torch.full((len(lens), width), -1, dtype=torch.int32)
        for i, n in enumerate(lens):
            k = torch.randn(n, hkv, d, generator=gen)
            v = torch.randn(n, hkv, d, generator=gen)
            for j in range(n_pages[i]):
                p = perm.pop()
                table[i, j] = p
                tok = slice(j * page_size, min(n, (j + 1) * page_size))
                k_cache[p, : tok.stop - tok.start] = k[tok]
                v_cache[p, : tok.stop - tok.start] = v[tok]
        if kv_quant.is_8bit(dtype):
            # Quantize the written pages only (NaN pages stay unread garbage either way: zero them,
            # int8's amax of a NaN page is NaN and fp8 has no NaN to saturate).
            k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
            kq, ks = kv_quant.quantize(k_cache, dtype, fp8_scales[0])
            vq, vs = kv_quant.quantize(v_cache, dtype, fp8_scales[1])
            if dtype == INT8:
                self.scales = dict(k_scale=ks.contiguous().to(device), v_scale=vs.contiguous().to(device))
                dk, dv = kv_quant.dequantize(kq, ks, torch.float64), kv_quant.dequantize(vq, vs, torch.float64)
            else:
                self.scales = dict(k_scale=fp8_scales[0], v_scale=fp8_scales[1])
                dk = kv_quant.dequantize(kq, fp8_scales[0], torch.float64)
                dv = kv_quant.dequantize(vq, fp8_scales[1], torch.float64)
            k_cache, v_cache = kq, vq
        else:
            self.scales = {}
            dk, dv = k_cache.double(), v_cache.double()
        self.dense_k = [dk[table[i, :n_pages[i]].long()].reshape(-1, hkv, d)[:n] for i, n in enumerate(lens)]
        self.dense_v = [dv[table[i, :n_pages[i]].long()].reshape(-1, hkv, d)[:n] for i, n in enumerate(lens)]
        if window and first_query is not None:
            for i, p0 in enumerate(first_query):
                before = max(0, p0 - window + 1) // page_size        # pages wholly before the window
                for j in range(before):
                    page = int(table[i, j])
                    table[i, j] = -1
                    if dtype == INT8:           # int8: a NaN scale poisons the page
                        self.scales["k_scale"][page] = float("nan")
                        self.scales["v_scale"][page] = float("nan")
                    elif dtype == FP8:          # 0x7f is e4m3's NaN
                        kv_quant.storage_view(k_cache)[page] = 0x7F
                        kv_quant.storage_view(v_cache)[page] = 0x7F
                    else:
                        k_cache[page] = float("nan")
                        v_cache[page] = float("nan")
        self.k_cache, self.v_cache = k_cache.to(device), v_cache.to(device)
        self.page_table = table.to(device)
        self.context_lens = torch.tensor(lens, dtype=torch.int32, device=device)


def decode_case(lens, page_size, hkv, d, device, window, **kw):
    return WindowCase(lens, page_size, hkv, d, device, window=window, first_query=[n - 1 for n in lens], **kw)


def check_decode(fn, case, hq, d, dtype, device, window, softcap, tol=None, **kw):
    torch.manual_seed(1)
    b = len(case.lens)
    q = (torch.randn(b, hq, d) * 2).to(dtype).to(device)       # x2: scores large enough for a cap to matter
    out = torch.full((b, hq, d), float("nan"), dtype=dtype, device=device)
    fn(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, d ** -0.5, out,
       window=window, softcap=softcap, **case.scales, **kw)
    tol = tol or (TOL8 if case.scales else TOL)[dtype]
    for i, n in enumerate(case.lens):
        if n == 0:
            assert torch.equal(out[i].cpu(), torch.zeros_like(out[i].cpu()))
            continue
        ref = dense_windowed(q[i: i + 1].cpu(), case.dense_k[i], case.dense_v[i], d ** -0.5, window, softcap)[0]
        err = rel_err(out[i], ref)
        assert err < tol, f"request {i} (len {n}, window {window}, softcap {softcap}): rel err {err:.2e} {kw}"
    return out


def check_prefill(fn, case, q_lens, hq, d, dtype, device, window, softcap, tol=None, **kw):
    torch.manual_seed(2)
    t = sum(q_lens)
    q = (torch.randn(t, hq, d) * 2).to(dtype).to(device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    out = torch.full((t, hq, d), float("nan"), dtype=dtype, device=device)
    fn(q, case.k_cache, case.v_cache, case.page_table, qsl, case.context_lens, d ** -0.5, out,
       window=window, softcap=softcap, **case.scales, **kw)
    tol = tol or (TOL8 if case.scales else TOL)[dtype]
    s = 0
    for i, (n, m) in enumerate(zip(case.lens, q_lens)):
        if m:
            ref = dense_windowed(q[s:s + m].cpu(), case.dense_k[i], case.dense_v[i], d ** -0.5, window, softcap)
            err = rel_err(out[s:s + m], ref)
            assert err < tol, f"request {i} (len {n}, {m} queries, window {window}, softcap {softcap}): {err:.2e} {kw}"
        s += m
    return out


def prefill_case(lens, q_lens, page_size, hkv, d, device, window, **kw):
    return WindowCase(lens, page_size, hkv, d, device, window=window,
                      first_query=[n - m for n, m in zip(lens, q_lens)], **kw)


# Windows smaller than, equal to and larger than the contexts; not multiples of the page size.
WINDOWS = [0, 1, 5, 16, 19, 1000]
LENS = [1, 9, 37, 64]
PREFILL = [(9, 9), (37, 6), (64, 23), (20, 1)]      # (context, new tokens): chunks starting mid-context


# ----------------------------------------------------------------------------------------------
# The mask itself and the argument checks
# ----------------------------------------------------------------------------------------------

def test_window_mask_is_transformers_sliding_window_mask():
    masking = pytest.importorskip("transformers.masking_utils")
    w = 4
    fn = masking.sliding_window_causal_mask_function(w)
    ours = reference._window_mask(torch.arange(12)[None, :], torch.arange(12)[:, None], w)
    theirs = torch.tensor([[bool(fn(torch.tensor(0), torch.tensor(0), torch.tensor(p), torch.tensor(j)))
                            for j in range(12)] for p in range(12)])
    assert torch.equal(ours, theirs)
    assert ours.sum(1).max() == w          # a query sees W keys, itself included


def test_bad_window_and_softcap_are_refused():
    case = decode_case([5], 4, 1, 16, "cpu", 0)
    q = torch.randn(1, 1, 16)
    with pytest.raises(ValueError, match="window"):
        reference.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, 1.0,
                                         window=-1)
    with pytest.raises(ValueError, match="softcap"):
        reference.paged_decode_attention(q, case.k_cache, case.v_cache, case.page_table, case.context_lens, 1.0,
                                         softcap=-2.0)


def test_debug_checks_skip_released_pages_before_the_window():
    case = decode_case([37, 20], 4, 1, 16, "cpu", 6)
    assert int(case.page_table[0, 0]) == -1
    q = torch.randn(2, 1, 16)
    args = (q, case.k_cache, case.v_cache, case.page_table, case.context_lens, 0.25)
    reference.paged_decode_attention(*args, window=6, debug=True)
    with pytest.raises(checks.PageTableError, match=r"page_table\[0, 0\]"):
        reference.paged_decode_attention(*args, debug=True)           # without the window they are read
    case.page_table[0, (37 - 6) // 4] = -1                             # the window's first page: in use
    with pytest.raises(checks.PageTableError):
        reference.paged_decode_attention(*args, window=6, debug=True)


# ----------------------------------------------------------------------------------------------
# Torch reference and the CPU decode op
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("page_size", [4, 16])
def test_reference_decode(window, softcap, page_size):
    case = decode_case(LENS + [0], page_size, 2, 16, "cpu", window, seed=window + page_size)
    check_decode(reference.paged_decode_attention, case, 4, 16, torch.float32, "cpu", window, softcap)
    check_decode(_cascade_ref, case, 4, 16, torch.float32, "cpu", window, softcap)


def _cascade_ref(q, k, v, pt, lens, scale, out, **kw):
    return reference.cascade_decode_attention(q, k, v, pt, lens, None, scale, out, **kw)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("page_size", [4, 16])
def test_reference_prefill(window, softcap, page_size):
    lens, q_lens = zip(*PREFILL)
    case = prefill_case(lens, q_lens, page_size, 2, 16, "cpu", window, seed=window + page_size)
    check_prefill(reference.paged_prefill_attention, case, list(q_lens), 6, 16, torch.float32, "cpu", window, softcap)


@pytest.mark.parametrize("dtype", [pytest.param(FP8, id="fp8"), pytest.param(INT8, id="int8")])
def test_reference_8bit_pages(dtype):
    case = decode_case(LENS, 4, 2, 16, "cpu", 7, dtype=dtype, seed=3)
    check_decode(reference.paged_decode_attention, case, 4, 16, torch.float32, "cpu", 7, 2.5)
    lens, q_lens = zip(*PREFILL)
    case = prefill_case(lens, q_lens, 4, 2, 16, "cpu", 7, dtype=dtype, seed=4)
    check_prefill(reference.paged_prefill_attention, case, list(q_lens), 4, 16, torch.float32, "cpu", 7, 2.5)


def test_reference_defaults_are_bit_identical_to_full_attention():
    case = decode_case(LENS, 4, 2, 16, "cpu", 0, seed=5)
    q = torch.randn(len(LENS), 4, 16)
    args = (q, case.k_cache, case.v_cache, case.page_table, case.context_lens, 0.25)
    plain = reference.paged_decode_attention(*args)
    assert torch.equal(plain, reference.paged_decode_attention(*args, window=0, softcap=0.0))
    # a window at least as long as every context is full attention too (same keys, same mask)
    assert torch.allclose(plain, reference.paged_decode_attention(*args, window=64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 3.0), (19, 3.0)])
def test_cpu_decode(window, softcap):
    case = decode_case(LENS, 16, 2, 16, "cpu", window, seed=11)
    out = check_decode(cpu_decode.paged_decode_attention, case, 4, 16, torch.float32, "cpu", window, softcap)
    assert out.shape == (len(LENS), 4, 16)


# ----------------------------------------------------------------------------------------------
# Triton decode (interpreter on the CPU)
# ----------------------------------------------------------------------------------------------

def _kernels():
    from kvshare_kernels import kernels
    return kernels


# (page size, Hq, Hkv, tuning): the launch shapes decode_attention has — a tile over several pages
# (per-token and per-page table reads), one page per tile, split-K, MHA with two heads per program
# and without dots.
DECODE_LAUNCHES = [
    (4, 4, 2, dict(num_splits=1, block_n=16)),
    (4, 4, 4, dict(num_splits=2, block_n=16, heads_per_program=2, page_ids=True)),
    (16, 6, 2, dict(num_splits=3, block_n=16)),
    (16, 2, 2, dict(num_splits=2, block_n=16, use_dot=False)),
    (4, 4, 2, dict(block_n=16)),                                  # the launcher's own split count
]


@pytest.mark.parametrize("page_size,hq,hkv,kw", DECODE_LAUNCHES)
@pytest.mark.parametrize("window,softcap", [(0, 3.0), (1, 0.0), (5, 3.0), (19, 0.0), (16, 3.0), (1000, 3.0)])
def test_triton_decode(page_size, hq, hkv, kw, window, softcap, device):
    case = decode_case(LENS + [0], page_size, hkv, 16, device, window, seed=window + page_size + hq)
    check_decode(_kernels().paged_decode_attention, case, hq, 16, torch.float32, device, window, softcap, **kw)


@pytest.mark.parametrize("dtype", [pytest.param(FP8, id="fp8"), pytest.param(INT8, id="int8")])
@pytest.mark.parametrize("page_size,hq,hkv,kw", [DECODE_LAUNCHES[0], DECODE_LAUNCHES[1], DECODE_LAUNCHES[2]])
def test_triton_decode_8bit_pages(dtype, page_size, hq, hkv, kw, device):
    case = decode_case(LENS, page_size, hkv, 16, device, 7, dtype=dtype, seed=page_size + hq)
    check_decode(_kernels().paged_decode_attention, case, hq, 16, torch.float32, device, 7, 2.5, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_decode_16bit(dtype, device):
    case = decode_case(LENS, 16, 2, 16, device, 19, dtype=dtype, seed=8)
    check_decode(_kernels().paged_decode_attention, case, 8, 16, dtype, device, 19, 3.0, num_splits=2, block_n=16)


def test_triton_decode_debug_skips_released_entries(device):
    case = decode_case([37, 20], 4, 2, 16, device, 6)
    check_decode(_kernels().paged_decode_attention, case, 4, 16, torch.float32, device, 6, 0.0, debug=True)
    with pytest.raises(checks.PageTableError):
        check_decode(_kernels().paged_decode_attention, case, 4, 16, torch.float32, device, 0, 0.0, debug=True)


# ----------------------------------------------------------------------------------------------
# Triton prefill (interpreter on the CPU)
# ----------------------------------------------------------------------------------------------

# A prompt, chunks that start mid-context (short and long), a one-token chunk, a request with no
# new tokens: blocks whose windows start inside the cached prefix and inside the chunk.
PREFILL_T = [(9, 9), (37, 6), (100, 60), (20, 1), (12, 0)]
# (page size, Hq, Hkv, tuning): every page-table read of the kernel — one id per page of a tile
# (with and without reading ahead), one page per tile, one id per token, bulk copies (TMA).
PREFILL_LAUNCHES = [
    (4, 4, 2, dict(block_m=16, block_n=16)),
    (4, 6, 2, dict(block_m=16, block_n=16, prefetch_page_ids=True)),
    (16, 2, 2, dict(block_m=16, block_n=16, prefetch_page_ids=True)),
    (1, 4, 2, dict(block_m=16, block_n=16)),
    (32, 4, 2, dict(block_m=16, block_n=16, tma=True)),
]


@pytest.mark.parametrize("page_size,hq,hkv,kw", PREFILL_LAUNCHES)
@pytest.mark.parametrize("window,softcap", [(0, 3.0), (1, 0.0), (5, 3.0), (19, 0.0), (40, 3.0), (1000, 0.0)])
def test_triton_prefill(page_size, hq, hkv, kw, window, softcap, device):
    lens, q_lens = zip(*PREFILL_T)
    case = prefill_case(lens, q_lens, page_size, hkv, 16, device, window, seed=window + page_size + hq)
    check_prefill(_kernels().paged_prefill_attention, case, list(q_lens), hq, 16, torch.float32, device, window,
                  softcap, **kw)


def test_triton_prefill_work_list_and_debug(device):
    from kvshare_kernels.prefill_tiles import plan_tiles, tokens_per_tile

    lens, q_lens = zip(*PREFILL_T)
    case = prefill_case(lens, q_lens, 4, 2, 16, device, 7, seed=21)
    tiles = plan_tiles(list(q_lens), list(lens), tokens_per_tile(4, 2, 16), capacity=20)
    check_prefill(_kernels().paged_prefill_attention, case, list(q_lens), 4, 16, torch.float32, device, 7, 2.0,
                  block_m=16, block_n=16, tiles=torch.from_numpy(tiles).to(device), debug=True)


@pytest.mark.parametrize("dtype", [pytest.param(FP8, id="fp8"), pytest.param(INT8, id="int8")])
@pytest.mark.parametrize("page_size", [4, 16])
def test_triton_prefill_8bit_pages(dtype, page_size, device):
    lens, q_lens = zip(*PREFILL_T)
    case = prefill_case(lens, q_lens, page_size, 2, 16, device, 19, dtype=dtype, seed=page_size)
    check_prefill(_kernels().paged_prefill_attention, case, list(q_lens), 4, 16, torch.float32, device, 19, 2.5,
                  block_m=16, block_n=16)


def _with_step_kv(case, q_lens, hq, dtype):
    """k_new/v_new: each chunk's keys as strided views of a fused-projection-like buffer, and the
    pool's chunk slots NaN, so the chunk can only be read from them."""
    t = sum(q_lens)
    hkv, d = case.k_cache.shape[2:]
    qkv = torch.full((t + 3, (hq + 2 * hkv) * d), float("nan"), dtype=dtype)
    k_new = qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
    v_new = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
    s = 0
    for i, (n, m) in enumerate(zip(case.lens, q_lens)):
        k_new[s:s + m] = case.dense_k[i][n - m:n].to(dtype)
        v_new[s:s + m] = case.dense_v[i][n - m:n].to(dtype)
        for pos in range(n - m, n):
            page = int(case.page_table[i, pos // case.page_size])
            case.k_cache[page, pos % case.page_size] = float("nan")
            case.v_cache[page, pos % case.page_size] = float("nan")
        s += m
    return k_new[:t].to(case.k_cache.device), v_new[:t].to(case.k_cache.device)


@pytest.mark.parametrize("page_size,block_n", [(4, 16), (16, 32)])
@pytest.mark.parametrize("window,softcap", [(0, 3.0), (5, 0.0), (19, 3.0), (40, 0.0)])
def test_triton_prefill_with_the_steps_kv(page_size, block_n, window, softcap, device):
    lens, q_lens = zip(*PREFILL_T)
    dtype = torch.bfloat16
    case = prefill_case(lens, q_lens, page_size, 2, 16, device, window, dtype=dtype, seed=window + page_size)
    k_new, v_new = _with_step_kv(case, list(q_lens), 6, dtype)
    check_prefill(_kernels().paged_prefill_attention, case, list(q_lens), 6, 16, dtype, device, window, softcap,
                  block_m=16, block_n=block_n, k_new=k_new, v_new=v_new)


def test_cascade_and_page_copy_prefill_refuse_window_and_softcap(device):
    from kvshare_kernels import cascade_decode as cd
    case = decode_case([8], 4, 1, 16, device, 0)
    q = torch.zeros(1, 1, 16, device=device)
    args = (q, case.k_cache, case.v_cache, case.page_table, case.context_lens, None, 0.25)
    with pytest.raises(NotImplementedError, match="window"):
        cd.cascade_decode_attention(*args, window=4)
    with pytest.raises(NotImplementedError, match="softcap"):
        cd.cascade_decode_attention(*args, softcap=30.0)
