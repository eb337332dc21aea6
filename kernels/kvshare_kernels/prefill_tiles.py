"""The prefill kernel's work list: which (request, block of query tokens) each program takes.

Without a list, paged_prefill_attention launches a grid of (query blocks of the longest chunk) x
requests x KV heads, and every program past its request's chunk returns at once: right for one
step's shapes, but a CUDA graph must fix the grid at capture, and a fixed grid of max_tokens x
max_requests programs is mostly idle ones (at 1,024 tokens and 256 requests, ~16k per KV head
and layer). With a list the grid is its length x KV heads, and a graph captured for T tokens and
B requests needs no more than ``tile_capacity(T, B)`` entries: a request of n tokens takes
ceil(n / tokens_per_tile) blocks, at most n / tokens_per_tile + 1.

The list is built on the host from the lengths the scheduler chose (numpy, no device sync), in
the grid's own order (request by request, blocks in order), and idle entries (-1, 0) pad it to the
graph's capacity. The order changes when programs run, never what any program computes. Longest
first (``longest_first``, the textbook schedule for a makespan) was not faster on the H200's
prefill shapes: 3-5% behind the grid launch on the 32/32 rows in one lease, within -8..+5% of it
per shape in another (perf/results/peer-serving/2026-12-02/kernels*.md), so the list keeps the
grid's order.
"""
from __future__ import annotations

import numpy as np

# Rows of one program: query tokens x the query heads of one KV head (H200, bf16, head_dim 128;
# docs/develop/kernels.md). prefill_attention.py launches with the same default.
BLOCK_M = 64
IDLE = -1


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tokens_per_tile(num_heads: int, num_kv_heads: int, block_m: int | None = None) -> int:
    """Query tokens one program takes: its BLOCK_M rows over the group's query heads (padded to a
    power of two), as paged_prefill_attention launches them."""
    block_g = _next_power_of_2(num_heads // num_kv_heads)
    return max(block_m or BLOCK_M, 16, block_g) // block_g


def tile_capacity(num_tokens: int, num_requests: int, per_tile: int) -> int:
    """Entries that hold the blocks of any split of num_tokens query tokens over up to num_requests
    requests (each request of n tokens: ceil(n / per_tile) <= n / per_tile + 1 blocks)."""
    return -(-num_tokens // per_tile) + min(num_tokens, num_requests)


def plan_tiles(query_lens: np.ndarray, context_lens: np.ndarray, per_tile: int, capacity: int | None = None,
               out: np.ndarray | None = None, longest_first: bool = False) -> np.ndarray:
    """int32 [capacity, 2]: (request, query block) per program, request by request (longest_first:
    the blocks that see the most keys first); entries past the last block are (IDLE, 0).
    query_lens / context_lens per request (a request of 0 query tokens has no block). ``out``: an
    int32 [capacity, 2] array to fill instead."""
    q = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    if q.shape != ctx.shape or (q < 0).any() or (q > ctx).any():
        raise ValueError("plan_tiles: query_lens must be 0..context_lens, one per request")
    blocks = -(-q // per_tile)
    total = int(blocks.sum())
    capacity = total if capacity is None else capacity
    if total > capacity:
        raise ValueError(f"plan_tiles: {total} query blocks do not fit a list of {capacity}")
    req = np.repeat(np.arange(len(q)), blocks)
    block = np.arange(total) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    if longest_first:
        # keys the block's last token sees: the request's prefix plus the chunk up to that token
        keys = (ctx - q)[req] + np.minimum((block + 1) * per_tile, q[req])
        order = np.argsort(-keys, kind="stable")
        req, block = req[order], block[order]
    if out is None:
        out = np.empty((capacity, 2), dtype=np.int32)
    elif out.shape != (capacity, 2) or out.dtype != np.int32:
        raise ValueError(f"plan_tiles: out must be int32 [{capacity}, 2], got {out.dtype} {out.shape}")
    out[:total, 0] = req
    out[:total, 1] = block
    out[total:, 0] = IDLE
    out[total:, 1] = 0
    return out
