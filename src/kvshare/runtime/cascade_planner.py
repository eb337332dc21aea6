"""Decides, per decode step, whether the batch's shared prefixes are worth the cascade attention path.

The prefix cache already gives requests with a common prompt the same physical pages; the cascade
kernels (kvshare_kernels.cascade_decode) then read those pages once per group instead of once per
request. They pay a planning cost on the host (~0.2 ms at batch 256), three extra launches per
layer and an eager forward (no CUDA graph): ~15-25 ms of launches per step on the H200 host, which a
graph replay avoids. So a step takes the cascade path only when the plain decode would read so much
KV that the GPU, not the launches, sets the pace (``min_plain_read_gb``), and the rows' page tables
show groups whose shared pages are at least ``min_saved_fraction`` of that context. Measured on the
H200: seed-hot10 (12 rows sharing 128-token prompts) ran 3x slower on the eager cascade path than
on the decode graph, which is what the first condition rules out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class CascadePolicy:
    min_saved_fraction: float = 0.25   # of the batch's context tokens: below it the plain decode graph wins
    min_batch: int = 4                 # smaller batches are latency-bound: the graph wins
    min_shared_pages: int = 4          # a group must share at least this many whole pages
    min_plain_read_gb: float = 40.0    # KV the plain decode would read per step (~10 ms of HBM time)


def plan_shared_prefixes(rows: Sequence[tuple[Sequence[int], int]], page_size: int, device: torch.device,
                         policy: CascadePolicy, kv_bytes_per_token: int):
    """rows: (page table, context length after this step) per decode row -> a device CascadePlan or None.

    kv_bytes_per_token: K+V bytes of one token over all layers (what the plain decode reads per token).
    """
    n = len(rows)
    if n < policy.min_batch:
        return None
    if sum(c for _, c in rows) * kv_bytes_per_token < policy.min_plain_read_gb * 1e9:
        return None
    firsts = {pt[0] for pt, _ in rows if pt}
    if len(firsts) == n:          # no two rows start on the same page: nothing is shared (the common case)
        return None
    from kvshare_kernels.cascade_decode import plan_cascade

    width = max(len(pt) for pt, _ in rows)
    table = np.zeros((n, width), dtype=np.int32)
    for i, (pt, _) in enumerate(rows):
        table[i, :len(pt)] = pt
    ctx = np.fromiter((c for _, c in rows), dtype=np.int64, count=n)
    plan = plan_cascade(table, ctx, page_size, min_shared_pages=policy.min_shared_pages)
    if plan.num_groups == 0:
        return None
    # every grouped row's shared tokens, minus the one pass per group the prefix kernel still reads
    saved = int(plan.row_shared_len.sum()) - plan.shared_tokens_read()
    if saved < policy.min_saved_fraction * int(ctx.sum()):
        return None
    return plan.to(device)
