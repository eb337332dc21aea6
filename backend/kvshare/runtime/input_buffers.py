"""Persistent decode inputs for CUDA graphs: one int32 device buffer, filled by ONE host->device copy.

    device buffer (int32):  | input_ids [M] | positions [M] | slots [M] | context_lens [M] | page_table [M, P] |
                            M = max batch (the largest captured graph), P = pages per sequence (max_model_len)

A graph captured at batch size B reads the first B rows of every field. Each step writes the live
rows (and the padding rows up to B) into a pinned host staging copy of the same layout, then
copies the prefix [0, 4M + B*P) once. Padding rows are token 0 at position 0, slot -1 (write_kv
writes nothing) and context 0 (attention gives a zero row); their page-table rows are never read.
A live row's page-table entries past its context are stale but never read either.

There are two host staging copies, used in turn: with overlap scheduling the host fills step N+1
while step N's copy may still be queued on the device; it waited for step N-1 (the ids it
resolved), so the staging copy that step N-1 used is free again.

CascadePlanBuffers does the same for the cascade decode graphs: per captured batch size, one
CascadePlan whose buffer lives on the device, padded to the batch and to max_groups(batch) groups.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .forward_batch import ForwardBatch


class DecodeInputBuffers:
    def __init__(self, max_batch: int, pages_per_seq: int, page_size: int, device: torch.device):
        self.max_batch, self.pages_per_seq, self.page_size, self.device = max_batch, pages_per_seq, page_size, device
        m = max_batch
        size = 4 * m + m * pages_per_seq
        pin = device.type == "cuda"
        self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        for h in self._hosts:
            h[2 * m:3 * m] = -1                       # every row starts as padding
        self._turn = 0
        self.dev = torch.zeros(size, dtype=torch.int32, device=device)
        self.dev.copy_(self._hosts[0])
        self.input_ids = self.dev[0:m]
        self.positions = self.dev[m:2 * m]
        self.slot_mapping = self.dev[2 * m:3 * m]
        self.context_lens = self.dev[3 * m:4 * m]
        self.page_table = self.dev[4 * m:].view(m, pages_per_seq)
        self.arange = torch.arange(m + 1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=device)

    def fits(self, token_ids: Sequence[int], page_table: Sequence[int]) -> bool:
        return len(token_ids) == 1 and len(page_table) <= self.pages_per_seq

    def fill(self, rows: Sequence[tuple[int, int, Sequence[int]]], batch: int) -> None:
        """rows: (token id, position, page table) per live request; pads up to ``batch``; one H2D copy."""
        n, m, ps = len(rows), self.max_batch, self.page_size
        if not 0 < n <= batch <= m:
            raise ValueError(f"decode batch of {n} rows does not fit a graph of {batch} (max {m})")
        host = self._hosts[self._turn]
        self._turn ^= 1
        h = host.numpy()
        positions = [p for _, p, _ in rows]
        h[0:n] = [t for t, _, _ in rows]
        h[m:m + n] = positions
        h[2 * m:2 * m + n] = [pt[p // ps] * ps + p % ps for (_, p, pt) in rows]
        h[3 * m:3 * m + n] = positions
        h[3 * m:3 * m + n] += 1
        if batch > n:
            h[n:batch] = 0
            h[m + n:m + batch] = 0
            h[2 * m + n:2 * m + batch] = -1
            h[3 * m + n:3 * m + batch] = 0
        table = h[4 * m:].reshape(m, self.pages_per_seq)
        for i, (_, _, pt) in enumerate(rows):
            table[i, :len(pt)] = pt
        end = 4 * m + batch * self.pages_per_seq
        self.dev[:end].copy_(host[:end], non_blocking=True)

    def forward_batch(self, batch: int, max_context: int) -> ForwardBatch:
        """Views of the first ``batch`` rows, as a decode-only ForwardBatch (what a graph captures)."""
        return ForwardBatch(
            input_ids=self.input_ids[:batch], positions=self.positions[:batch],
            slot_mapping=self.slot_mapping[:batch], page_table=self.page_table[:batch],
            query_start_loc=self.query_start_loc[:batch + 1], context_lens=self.context_lens[:batch],
            logits_indices=self.arange[:batch], decode_only=True, max_query_len=1, max_context=max_context)

    def live_view(self) -> np.ndarray:
        """The staging buffer the last fill wrote (tests)."""
        return self._hosts[self._turn ^ 1].numpy()


def max_groups(batch: int) -> int:
    """Groups a cascade graph of ``batch`` rows holds: every group has at least two rows."""
    return max(1, batch // 2)


class CascadePlanBuffers:
    """One device-resident CascadePlan per captured batch size B (rows padded to B, groups to
    max_groups(B)), filled from a host plan by one H2D copy out of two alternating pinned copies."""

    def __init__(self, batch_sizes: Sequence[int], page_size: int, max_members: int, max_shared_len: int,
                 prefix_splits: dict[int, int], device: torch.device):
        from kvshare_kernels.cascade_decode import CascadePlan

        self.max_members = max_members
        pin = device.type == "cuda"
        self._plans: dict[int, CascadePlan] = {}
        self._hosts: dict[int, list[torch.Tensor]] = {}
        self._turn = 0
        for b in batch_sizes:
            g = max_groups(b)
            host = torch.zeros(b + g + g * max_members, dtype=torch.int32)
            host[b + g:] = -1                           # no group has members: every prefix program is idle
            self._hosts[b] = [host.clone().pin_memory() if pin else host.clone() for _ in range(2)]
            self._plans[b] = CascadePlan(page_size=page_size, num_rows=b, num_groups=g, max_members=max_members,
                                         max_shared_len=max_shared_len, buffer=host.to(device),
                                         prefix_splits=prefix_splits[b])

    def plan(self, batch: int):
        """The graph-resident plan of batch size ``batch`` (what the graph captured)."""
        return self._plans[batch]

    def covers(self, batch: int) -> bool:
        return batch in self._plans

    def holds(self, plan, batch: int) -> bool:
        """Whether a host plan of plan.num_rows rows fits the graph plan of ``batch`` rows."""
        return (batch in self._plans and plan.num_rows <= batch and plan.num_groups <= max_groups(batch)
                and plan.max_members == self.max_members)

    def fill(self, plan, batch: int) -> None:
        """Copies a host plan (plan_cascade's) into the graph plan of ``batch`` rows, padded."""
        if not self.holds(plan, batch):
            raise ValueError(f"a cascade plan of {plan.num_rows} rows / {plan.num_groups} groups does not fit "
                             f"the graph plan of batch {batch}")
        n, g, mm = plan.num_rows, plan.num_groups, self.max_members
        gmax = max_groups(batch)
        host = self._hosts[batch][self._turn]
        self._turn ^= 1
        h, src = host.numpy(), plan.buffer.numpy()
        h[:n] = src[:n]
        h[n:batch] = 0
        h[batch:batch + g] = src[n:n + g]
        h[batch + g:batch + gmax] = 0
        rows = h[batch + gmax:].reshape(gmax, mm)
        rows[:g] = src[n + g:].reshape(g, mm)
        rows[g:] = -1
        self._plans[batch].buffer.copy_(host, non_blocking=True)

    def check_integrity(self) -> None:
        """Every graph plan is one a cascade kernel may replay: whole-page shared lengths, members
        within the batch and in one group each, a member's shared length its group's. Reads the
        device buffers back (a sync): tests and debugging only."""
        for batch, plan in self._plans.items():
            assert plan.buffer.numel() == batch + plan.num_groups * (1 + plan.max_members), batch
            row_len = plan.row_shared_len.cpu()
            group_len = plan.group_shared_len.cpu()
            rows = plan.group_rows.cpu()
            assert (row_len >= 0).all() and (row_len % plan.page_size == 0).all(), batch
            assert (group_len >= 0).all() and (group_len % plan.page_size == 0).all(), batch
            members = rows[rows >= 0]
            assert (members < batch).all() and members.unique().numel() == members.numel(), batch
            expected = torch.zeros_like(row_len)
            for g in range(plan.num_groups):
                mine = rows[g][rows[g] >= 0]
                assert mine.numel() == 0 or group_len[g] > 0, (batch, g)
                expected[mine.long()] = group_len[g]
            assert torch.equal(row_len, expected), batch

