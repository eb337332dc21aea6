"""The CPU's linear layer: oneDNN's values are F.linear's up to float32 rounding, for any shape,
with and without bias, in the layouts the model splits and views; other dtypes keep F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.runtime.cpu_linear import cpu_linear, onednn_linear, rows_batch_invariant

# What the three tests below check holds on the AVX2 CI machine, not on every CPU (cpu_linear.py).
invariant_rows = pytest.mark.skipif(not rows_batch_invariant(), reason="oneDNN's rows are not batch-invariant on "
                                    "this CPU (e.g. AVX-512: other kernels for some row counts)")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 80), k=st.integers(1, 96), n=st.integers(1, 130), bias=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_it_equals_f_linear(rows, k, n, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = cpu_linear(torch.float32)(x, w, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_the_float32_cpu_model_gets_onednn_and_its_output_splits_and_views():
    assert cpu_linear(torch.float32) is onednn_linear
    q, k, v = onednn_linear(torch.randn(12, 64), torch.randn(96, 64)).split([64, 16, 16], dim=-1)
    assert q.view(-1, 4, 16).shape == (12, 4, 16) and k.view(-1, 1, 16).shape == (12, 1, 16)


def test_other_dtypes_keep_f_linear():
    assert cpu_linear(torch.bfloat16) is F.linear and cpu_linear(torch.float64) is F.linear


@invariant_rows
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), extra=st.integers(1, 90), shape=st.sampled_from([(96, 64), (576, 576), (3072, 576)]),
       bias=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(rows, extra, shape, bias, seed):
    """What the engine's prefix cache and continuous batching rely on: a prompt's tail computed
    alone after a cache hit, or a row decoded beside others, gets the same bits as in a bigger batch."""
    g = torch.Generator().manual_seed(seed)
    n, k = shape
    w, x = torch.randn(n, k, generator=g), torch.randn(rows + extra, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    assert torch.equal(onednn_linear(x[:rows], w, b), onednn_linear(x, w, b)[:rows])


# SmolLM2-135M's weights [out, in]: qkv (9 + 2 * 3 heads of 64), o_proj, gate_up, down.
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


@invariant_rows
@settings(max_examples=25, deadline=None)
@given(total=st.integers(2, 600), start=st.integers(0, 599), rows=st.integers(1, 16),
       shape=st.sampled_from(SMOLLM2_SHAPES), seed=st.integers(0, 2 ** 16))
def test_a_prompts_tail_gets_the_bits_it_has_inside_the_whole_prompt(total, start, rows, shape, seed):
    """After a prefix-cache hit the engine computes the prompt's last rows alone: any rows, not only
    the first ones, must keep the bits they got within the whole prefill."""
    g = torch.Generator().manual_seed(seed)
    n, k = shape
    w, x = torch.randn(n, k, generator=g) * 0.05, torch.randn(total, k, generator=g)
    start = min(start, total - 1)
    end = min(total, start + rows)
    assert torch.equal(onednn_linear(x[start:end].clone(), w), onednn_linear(x, w)[start:end])


@invariant_rows
def test_prefill_chunk_sizes_and_the_lm_head_rows_keep_their_bits():
    """The row counts a prefill chunk reaches (max_prefill_chunk 512, a step's 2048 tokens) and the
    tied lm_head [49152, 576] over a decode batch's rows."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 576, generator=g) * 0.05
    x = torch.randn(2048, 576, generator=g)
    full = onednn_linear(x, w)
    for a, b in [(0, 512), (512, 1024), (1000, 1537), (2040, 2048), (2047, 2048), (1023, 1025)]:
        assert torch.equal(onednn_linear(x[a:b].clone(), w), full[a:b]), (a, b)
    head, h = torch.randn(49152, 576, generator=g) * 0.05, torch.randn(12, 576, generator=g)
    logits = onednn_linear(h, head)
    assert all(torch.equal(onednn_linear(h[i:i + 1], head), logits[i:i + 1]) for i in range(12))
    assert torch.equal(onednn_linear(h[3:6], head), logits[3:6])
