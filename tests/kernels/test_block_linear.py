"""kvshare_kernels.block_linear: GGUF blocks packed for the CPU kernel, its torch reference, and the
native kernel itself (cpu/block_gemm.cpp) on this CPU: values against fp64, rows independent of the
batch around them, bad tensors refused by name."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare_kernels import block_linear as bl

needs_kernel = pytest.mark.skipif(not bl.available(), reason="the CPU block kernel does not run here "
                                  "(no g++ to build it, or no AVX-512F): python -m kvshare_kernels.cpu_native")


def random_weight(fmt: str, n: int, k: int, seed: int) -> bl.BlockWeight:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4).half()
    if fmt == "q4_1":
        return bl.pack_q4_1(torch.randint(0, 16, (n, k), generator=g), d, (-torch.rand(n, k // 32, generator=g) * 0.1).half())
    return bl.pack_q8_0(torch.randint(-128, 128, (n, k), generator=g), d * 0.05)


shapes = st.tuples(st.sampled_from(["q4_1", "q8_0"]), st.integers(1, 8).map(lambda p: 16 * p),
                   st.integers(1, 6).map(lambda b: 32 * b), st.integers(0, 2**16))


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_unpack_returns_what_was_packed(case):
    fmt, n, k, seed = case
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(n, k // 32, generator=g).half()
    if fmt == "q4_1":
        q, m = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), torch.randn(n, k // 32, generator=g).half()
        w = bl.pack_q4_1(q, d, m)
    else:
        q, m = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), None
        w = bl.pack_q8_0(q, d)
    q2, d2, m2 = bl.unpack(w)
    assert w.shape == (n, k) and torch.equal(q2, q) and torch.equal(d2, d)
    assert (m2 is None and m is None) or torch.equal(m2, m)


def test_dequantize_is_a_multiply_then_an_add_in_fp32():
    q = torch.zeros(16, 32, dtype=torch.uint8)
    q[0, 0], q[0, 31], q[5, 7] = 15, 3, 9
    d = torch.full((16, 1), 0.1, dtype=torch.float16)
    m = torch.full((16, 1), -0.3, dtype=torch.float16)
    w = bl.dequantize(bl.pack_q4_1(q, d, m))
    d32, m32 = torch.tensor(0.1, dtype=torch.float16).float(), torch.tensor(-0.3, dtype=torch.float16).float()
    assert w[0, 0] == d32 * 15 + m32 and w[0, 31] == d32 * 3 + m32 and w[5, 7] == d32 * 9 + m32 and w[1, 1] == m32


def test_packing_refuses_shapes_the_kernel_cannot_tile():
    with pytest.raises(ValueError, match="N % 16"):
        bl.pack_q8_0(torch.zeros(20, 32, dtype=torch.int8), torch.zeros(20, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="K % 32"):
        bl.pack_q4_1(torch.zeros(16, 40, dtype=torch.uint8), torch.zeros(16, 1), torch.zeros(16, 1))


def test_cat_rows_stacks_output_features():
    a, b = random_weight("q4_1", 32, 64, 1), random_weight("q4_1", 48, 64, 2)
    assert torch.equal(bl.dequantize(bl.cat_rows(a, b)), torch.cat([bl.dequantize(a), bl.dequantize(b)]))
    with pytest.raises(ValueError, match="one format"):
        bl.cat_rows(a, random_weight("q8_0", 16, 64, 3))


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(shapes, st.integers(1, 70))
def test_kernel_matches_the_fp64_product_of_the_dequantized_weight(case, rows):
    fmt, n, k, seed = case
    w = random_weight(fmt, n, k, seed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1))
    ref = x.double() @ bl.dequantize(w).double().T
    got = bl.block_linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # fp32 sums of k products: a few ulps of the terms' magnitude.
    bound = 1e-6 * k * (x.abs().double() @ bl.dequantize(w).abs().double().T) + 1e-30
    assert torch.all((got.double() - ref).abs() <= bound)


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(shapes, st.integers(2, 130), st.data())
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(case, rows, data):
    fmt, n, k, seed = case
    w = random_weight(fmt, n, k, seed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 2))
    full = bl.block_linear(x, w)
    a = data.draw(st.integers(0, rows - 1))
    b = data.draw(st.integers(a + 1, rows))
    assert torch.equal(bl.block_linear(x[a:b], w), full[a:b])


@needs_kernel
def test_thread_count_does_not_change_the_bits():
    w, x = random_weight("q4_1", 256, 192, 4), torch.randn(30, 192)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bl.block_linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(bl.block_linear(x, w), one)


@needs_kernel
def test_batch_dims_bias_and_empty_inputs():
    w = random_weight("q8_0", 32, 64, 5)
    x, bias = torch.randn(2, 3, 64), torch.randn(32)
    y = bl.block_linear(x, w, bias)
    assert y.shape == (2, 3, 32)
    assert torch.equal(y, (bl.block_linear(x.reshape(6, 64), w) + bias).view(2, 3, 32))
    assert bl.block_linear(torch.empty(0, 64), w).shape == (0, 32)


@needs_kernel
def test_bad_tensors_are_refused_by_name():
    w = random_weight("q4_1", 32, 64, 6)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        bl.block_linear(torch.randn(3, 64, dtype=torch.float64), w)
    with pytest.raises(RuntimeError, match="x has 96 columns"):
        bl.block_linear(torch.randn(3, 96), w)
    with pytest.raises(RuntimeError, match="Q4_1 needs m"):
        torch.ops.kvshare_cpu.block_linear(torch.randn(3, 64), w.qs, w.d, None, 0)
    with pytest.raises(RuntimeError, match="format must be"):
        torch.ops.kvshare_cpu.block_linear(torch.randn(3, 64), w.qs, w.d, w.m, 7)
