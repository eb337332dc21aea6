"""The CPU's prefill attention with a row's bits independent of how many rows its chunk has.

On the CPU the engine runs kvshare_kernels' torch reference, whose prefill attention is the math
path of scaled_dot_product_attention: per request, scores = q @ K^T and out = softmax(scores) @ V,
two batched MKL sgemms with the chunk's query rows as M. MKL rounds a chunk of 1, 2 or 3 rows
differently from a chunk of 4 or more; from 4 rows on, a row's bits are the same whatever the
chunk's size, for chunks ending at the same token (measured with SmolLM2's 9 query / 3 KV heads of
64, rows 1..1000, contexts 1..2100; tests/backend/runtime/test_cpu_attention.py). A prompt
repeated after a prefix-cache hit computes only its tail, often a single token, whose row then
differed from the first run's in the last bits, enough to flip a near-tie in the greedy tokens
(docs/decisions.md). The same row in a chunk ending elsewhere (another context length, with the
extra keys masked) can round differently (row 200 with 201 vs 202 keys): that case, a prefix hit
short of the first run's last chunk, is not covered here.

So a chunk shorter than MIN_QUERY_ROWS gets zero query rows in front (at the positions just before
it) and only its own rows come back. A context shorter than MIN_QUERY_ROWS (a prompt of 1-3
tokens) has no positions for them: such a chunk keeps fewer rows, and the rounding they get.
A step of single-token chunks would take the decode attention, another computation: on the CPU a
step with a prompt's chunk takes this one (ModelRunner, build_forward_batch's prompt_prefill).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

# MKL's sgemm rounds 1-3 rows its own way; 4 rows and more agree with each other (measured above).
MIN_QUERY_ROWS = 4

PrefillAttention = Callable[..., torch.Tensor]


def padded_rows(query_start_loc: list[int], context_lens: list[int], min_rows: int) -> tuple[list[int], list[int]]:
    """(index into q's rows, -1 for a zero row; query_start_loc of the padded rows) for chunks of
    fewer than min_rows rows padded in front up to min_rows, or up to their context if it is shorter."""
    index, starts = [], [0]
    for s, e, n in zip(query_start_loc, query_start_loc[1:], context_lens):
        pad = max(0, min(min_rows, n) - (e - s)) if e > s else 0
        index += [-1] * pad + list(range(s, e))
        starts.append(len(index))
    return index, starts


def row_invariant_prefill(prefill: PrefillAttention, min_rows: int = MIN_QUERY_ROWS) -> PrefillAttention:
    """prefill (paged_prefill_attention's signature) with every chunk given at least min_rows query rows."""

    def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                  query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float, out=None, *,
                  max_query_len: int | None = None, **kw) -> torch.Tensor:
        if kw.get("window", 0) > 0:
            # Padding rows sit at earlier positions, whose window reaches pages the pool may already
            # have taken back (released slots are -1): a windowed layer keeps its chunk as it is.
            return prefill(q, k_cache, v_cache, page_table, query_start_loc, context_lens, scale, out,
                           max_query_len=max_query_len, **kw)
        qsl = query_start_loc.tolist()
        index, starts = padded_rows(qsl, context_lens.tolist(), min_rows)
        index += range(qsl[-1], q.shape[0])      # rows past the last chunk (a graph-shaped step's padding)
        if len(index) == q.shape[0]:       # no chunk was short: nothing to pad
            return prefill(q, k_cache, v_cache, page_table, query_start_loc, context_lens, scale, out,
                           max_query_len=max_query_len, **kw)
        # q_ext's last row is the zero row; the real rows' results do not depend on its values.
        q_ext = torch.cat([q, q.new_zeros((1, *q.shape[1:]))])
        rows = torch.tensor(index, device=q.device)
        padded = prefill(q_ext.index_select(0, rows.where(rows >= 0, q.shape[0])), k_cache, v_cache, page_table,
                         torch.tensor(starts, dtype=query_start_loc.dtype, device=q.device), context_lens, scale,
                         max_query_len=max(max_query_len or 0, min_rows), **kw)
        real = (rows >= 0).nonzero().squeeze(1)
        if out is None:
            return padded.index_select(0, real)
        out.copy_(padded.index_select(0, real))
        return out

    return attention
