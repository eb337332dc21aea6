"""Decides, per decode step, whether the batch's shared prefixes are worth the cascade attention path.

The prefix cache already gives requests with a common prompt the same physical pages; the cascade
kernels (kvshare_kernels.cascade_decode) then read those pages once per group instead of once per
request. The price is a planning cost on the host (~0.2 ms at batch 256) and three extra kernels per
layer. Two ways to run it:

- inside a captured *cascade* decode graph (CudaGraphRunner, batch sizes of the ladder): the extra
  kernels cost a few microseconds each, so the plan only has to save ``min_saved_read_gb_graph``
  of KV reads per step (~0.25 ms of HBM time per GB) and ``min_saved_fraction`` of the context;
- eagerly (no graph fits: more groups than the graph holds, or no graphs): ~15-25 ms of launches per
  step on the H200 host, so a step goes there only when the plain decode would read so much KV that
  the GPU, not the launches, sets the pace (``min_plain_read_gb``). Measured on the H200: seed-hot10
  (12 rows sharing 128-token prompts) ran 3x slower on the eager cascade path than on the decode graph.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class CascadePolicy:
    min_saved_fraction: float = 0.25   # of the batch's context tokens: below it the plain decode graph wins
    min_batch: int = 4                 # smaller batches are latency-bound: the graph wins
    min_shared_pages: int = 4          # a group must share at least this many whole pages
    min_plain_read_gb: float = 40.0    # eager path: KV the plain decode would read per step (~10 ms of HBM time)
    min_saved_read_gb_graph: float = 1.0   # graph path: KV reads the plan must save per step (~0.25 ms)
    max_members: int = 16              # rows per group (one prefix program holds members x q_per_kv rows)


def plan_shared_prefixes(rows: Sequence[tuple[Sequence[int], int]], page_size: int, policy: CascadePolicy,
                         kv_bytes_per_token: int, *, graph: bool = False):
    """rows: (page table, context length after this step) per decode row -> a host CascadePlan or None.

    kv_bytes_per_token: K+V bytes of one token over all layers (what the plain decode reads per token).
    graph: a cascade decode graph can run this batch (the cheaper path; see the module docstring).
    """
    n = len(rows)
    if n < policy.min_batch:
        return None
    total_tokens = sum(c for _, c in rows)
    if not graph and total_tokens * kv_bytes_per_token < policy.min_plain_read_gb * 1e9:
        return None
    firsts = Counter(pt[0] for pt, _ in rows if pt)
    if len(firsts) == n:          # no two rows start on the same page: nothing is shared (the common case)
        return None
    # Only rows whose first page another row also starts with can save anything, and at most their
    # tokens: when even that bound misses a threshold, skip building the plan (per step on the host).
    shareable = sum(c for pt, c in rows if pt and firsts[pt[0]] > 1)
    if shareable < policy.min_saved_fraction * total_tokens:
        return None
    if graph and shareable * kv_bytes_per_token < policy.min_saved_read_gb_graph * 1e9:
        return None
    from kvshare_kernels.cascade_decode import plan_cascade

    width = max(len(pt) for pt, _ in rows)
    table = np.zeros((n, width), dtype=np.int32)
    for i, (pt, _) in enumerate(rows):
        table[i, :len(pt)] = pt
    ctx = np.fromiter((c for _, c in rows), dtype=np.int64, count=n)
    plan = plan_cascade(table, ctx, page_size, min_shared_pages=policy.min_shared_pages,
                        max_members=policy.max_members)
    if plan.num_groups == 0:
        return None
    # every grouped row's shared tokens, minus the one pass per group the prefix kernel still reads
    saved = int(plan.row_shared_len.sum()) - plan.shared_tokens_read()
    if saved < policy.min_saved_fraction * total_tokens:
        return None
    if graph and saved * kv_bytes_per_token < policy.min_saved_read_gb_graph * 1e9:
        return None
    return plan
