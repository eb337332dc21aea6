"""The CPU's prefill attention (runtime/cpu_attention.py): for chunks that end at the same token, a
row's bits do not depend on how many rows its chunk has or on the requests beside it; its values
are the reference's, and only short chunks are padded. (A chunk ending elsewhere, i.e. another
context length, may round its rows differently: cpu_attention.py says so.)"""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvshare_kernels import reference

from kvshare.runtime.cpu_attention import MIN_QUERY_ROWS, padded_rows, row_invariant_prefill

HQ, HKV, D, PAGE = 9, 3, 64, 16          # SmolLM2-135M's heads


def pool(context: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pages = -(-context // PAGE)
    k, v = torch.randn(pages, PAGE, HKV, D, generator=g), torch.randn(pages, PAGE, HKV, D, generator=g)
    return k, v, torch.randn(context, HQ, D, generator=g)


def attend(attention, q_all, k, v, chunks: list[tuple[int, int]]) -> torch.Tensor:
    """chunks (start, end) of one sequence each, over the same pages: q_all[start:end] against end tokens."""
    q = torch.cat([q_all[s:e] for s, e in chunks])
    qsl = torch.tensor([0] + [e - s for s, e in chunks], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    table = torch.arange(k.shape[0], dtype=torch.int32).repeat(len(chunks), 1)
    ends = torch.tensor([e for _, e in chunks], dtype=torch.int32)
    return attention(q, k, v, table, qsl, ends, D ** -0.5)


def test_padded_rows_put_zero_rows_in_front_of_short_chunks_only():
    # chunks of 1, 5 and 2 rows with contexts 40, 5 and 2; an empty chunk stays empty
    index, starts = padded_rows([0, 1, 6, 8, 8], [40, 5, 2, 9], 4)
    assert index == [-1, -1, -1, 0, 1, 2, 3, 4, 5, 6, 7]
    assert starts == [0, 4, 9, 11, 11]


@settings(max_examples=30, deadline=None)
@given(context=st.integers(1, 300), tail=st.integers(1, 12), seed=st.integers(0, 2 ** 16))
def test_a_prompts_tail_gets_the_bits_of_the_whole_prompts_prefill(context, tail, seed):
    """A prompt's tail computed alone after a prefix-cache hit, versus within the whole prompt."""
    k, v, q = pool(context, seed)
    attention = row_invariant_prefill(reference.paged_prefill_attention)
    tail = min(tail, context)
    whole = attend(attention, q, k, v, [(0, context)])
    assert torch.equal(attend(attention, q, k, v, [(context - tail, context)]), whole[context - tail:])


@settings(max_examples=20, deadline=None)
@given(context=st.integers(8, 700), rows=st.integers(1, 6), other=st.integers(1, 700), seed=st.integers(0, 2 ** 16))
def test_a_short_chunk_beside_another_request_gets_the_bits_of_its_whole_prompt(context, rows, other, seed):
    """Continuous batching: a prompt's tail in one step with another request's chunk."""
    k, v, q = pool(max(context, other), seed)
    attention = row_invariant_prefill(reference.paged_prefill_attention)
    whole = attend(attention, q, k, v, [(0, context)])
    batched = attend(attention, q, k, v, [(0, other), (context - rows, context)])
    assert torch.equal(batched[other:], whole[context - rows:])


def test_values_are_the_references_and_long_chunks_go_through_untouched():
    k, v, q = pool(90, seed=3)
    attention = row_invariant_prefill(reference.paged_prefill_attention)
    for chunk in [(89, 90), (87, 90), (0, 2), (80, 90)]:
        torch.testing.assert_close(attend(attention, q, k, v, [chunk]),
                                   attend(reference.paged_prefill_attention, q, k, v, [chunk]), rtol=1e-5, atol=1e-6)
    long = (90 - MIN_QUERY_ROWS, 90)
    assert torch.equal(attend(attention, q, k, v, [long]), attend(reference.paged_prefill_attention, q, k, v, [long]))
    out = torch.full((1, HQ, D), float("nan"))
    got = attention(q[89:90], k, v, torch.arange(6, dtype=torch.int32)[None], torch.tensor([0, 1], dtype=torch.int32),
                    torch.tensor([90], dtype=torch.int32), D ** -0.5, out)
    assert got is out and torch.equal(out, attend(attention, q, k, v, [(89, 90)]))
