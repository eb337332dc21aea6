"""kvshare_kernels.cpu_decode: the native paged decode attention (cpu/paged_decode.cpp) against the
torch reference and fp64, its outputs independent of the thread count and of the other sequences,
bad tables refused by name, and the reference taking over where the op does not apply."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare_kernels import cpu_decode, cpu_native, reference

needs_kernel = pytest.mark.skipif(not cpu_native.available(), reason="the CPU kernels do not run here "
                                  "(no g++ to build them, or no AVX-512F): python -m kvshare_kernels.cpu_native")


def case(seed: int, batch: int, hkv: int, group: int, d: int, page: int, max_len: int):
    """q, a shuffled pool, page tables and lengths (0 included) for `batch` sequences."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (batch,), generator=g, dtype=torch.int32)
    width = max(1, math.ceil(max_len / page))
    pool = batch * width + 3
    k = torch.randn(pool, page, hkv, d, generator=g)
    v = torch.randn(pool, page, hkv, d, generator=g)
    table = torch.randperm(pool, generator=g)[: batch * width].view(batch, width).int()
    q = torch.randn(batch, hkv * group, d, generator=g) * 2     # peaked enough for tiny probabilities
    return q, k, v, table, lens


def fp64_attention(q, k, v, table, lens, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    _, page, hkv, d = k.shape
    group = q.shape[1] // hkv
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        rows = torch.tensor([table[b, t // page].item() * page + t % page for t in range(n)])
        kb = k.view(-1, hkv, d)[rows].double().repeat_interleave(group, dim=1)    # [n, Hq, d]
        vb = v.view(-1, hkv, d)[rows].double().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), kb) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, vb)
    return out


shapes = st.tuples(st.integers(0, 2**16), st.integers(1, 6), st.sampled_from([1, 2, 3, 8]), st.sampled_from([1, 3, 4]),
                   st.sampled_from([16, 64, 128]), st.sampled_from([1, 16, 32]), st.integers(1, 200))


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(shapes)
def test_matches_fp64_and_the_reference(shape):
    q, k, v, table, lens = case(*shape)
    scale = q.shape[-1] ** -0.5
    out = cpu_decode.paged_decode_attention(q, k, v, table, lens, scale)
    exact = fp64_attention(q, k, v, table, lens, scale)
    assert torch.allclose(out.double(), exact, atol=2e-5, rtol=1e-4)
    assert torch.allclose(out, reference.paged_decode_attention(q, k, v, table, lens, scale), atol=2e-5, rtol=1e-4)
    assert torch.equal(out[lens == 0], torch.zeros_like(out[lens == 0]))


@needs_kernel
@settings(max_examples=20, deadline=None)
@given(shapes, st.data())
def test_a_sequence_gets_the_same_bits_alone_or_in_a_batch_on_any_thread_count(shape, data):
    q, k, v, table, lens = case(*shape)
    b = data.draw(st.integers(0, q.shape[0] - 1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch = cpu_decode.paged_decode_attention(q, k, v, table, lens, 0.125)
        torch.set_num_threads(2)
        again = cpu_decode.paged_decode_attention(q, k, v, table, lens, 0.125)
        alone = cpu_decode.paged_decode_attention(q[b:b + 1].clone(), k, v, table[b:b + 1].clone(), lens[b:b + 1].clone(),
                                                  0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, again)
    assert torch.equal(batch[b:b + 1], alone)


@needs_kernel
def test_the_out_argument_is_filled():
    q, k, v, table, lens = case(3, 4, 2, 2, 64, 16, 40)
    out = torch.full_like(q, float("nan"))
    assert cpu_decode.paged_decode_attention(q, k, v, table, lens, 0.125, out) is out
    assert torch.equal(out, cpu_decode.paged_decode_attention(q, k, v, table, lens, 0.125))


@needs_kernel
@pytest.mark.parametrize("edit, message", [
    (lambda a: a.__setitem__(3, a[3].clone().fill_(10_000)), "is outside the pool"),
    (lambda a: a.__setitem__(4, torch.full_like(a[4], 10_000)), "needs more pages than page_table"),
    (lambda a: a.__setitem__(3, a[3][:, :0].contiguous()), "needs more pages than page_table"),
    (lambda a: a.__setitem__(0, a[0][:, :5].contiguous()), "query heads for"),
    (lambda a: a.__setitem__(2, a[2][:-1]), "k_cache, v_cache equal"),
    (lambda a: a.__setitem__(3, a[3][:2]), "one row per query"),
])
def test_bad_tables_and_shapes_are_refused_by_name(edit, message):
    args = list(case(5, 4, 2, 3, 64, 16, 40))
    args[4] = args[4].clamp(min=1)
    edit(args)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvshare_cpu.paged_decode_attention(*args, 0.125)


def test_where_the_op_does_not_apply_the_reference_answers():
    q, k, v, table, lens = case(7, 3, 2, 2, 24, 16, 30)          # head_dim 24: not a multiple of 16
    assert not cpu_decode.native_applies(q, k, {})
    assert torch.equal(cpu_decode.paged_decode_attention(q, k, v, table, lens, 0.2),
                       reference.paged_decode_attention(q, k, v, table, lens, 0.2))
    q, k, v, table, lens = case(7, 3, 2, 2, 64, 16, 30)
    assert not cpu_decode.native_applies(q.double(), k.double(), {})
    assert not cpu_decode.native_applies(q, k, {"k_scale": 1.0, "v_scale": 1.0})    # 8-bit pages
