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

MixedInputBuffers holds the mixed-step graphs' inputs (prefill chunks beside decode rows) the same
way, for up to T tokens in up to B chunks, each field starting 16-element aligned:

    | input_ids [T] | positions [T] | slots [T] | query_start_loc [B+1] | context_lens [B] |
    | logits_indices [B] | prefill tiles [N, 2] | page_table [B, P] |      N = tile_capacity(T, B)

A graph captured at t tokens reads the first t of the token fields, min(t, B) logits rows and
tile_capacity(t, B) tiles, and all B chunk rows: chunks past the live ones have no tokens, no
tile and context 0, so only the live rows of the page table are copied.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .forward_batch import ForwardBatch, chunk_arrays


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


class MixedInputBuffers:
    _ALIGN = 16

    def __init__(self, max_tokens: int, max_chunks: int, pages_per_seq: int, page_size: int, per_tile: int,
                 device: torch.device):
        from kvshare_kernels.prefill_tiles import tile_capacity

        self.max_tokens, self.max_chunks, self.pages_per_seq, self.page_size = max_tokens, max_chunks, pages_per_seq, page_size
        self.per_tile, self._tile_capacity = per_tile, tile_capacity
        t, b = max_tokens, max_chunks
        self._at: dict[str, int] = {}
        size = 0
        for name, n in (("ids", t), ("positions", t), ("slots", t), ("qsl", b + 1), ("ctx", b), ("logits", b),
                        ("tiles", 2 * tile_capacity(t, b, per_tile)), ("table", b * pages_per_seq)):
            self._at[name] = size
            size += -(-n // self._ALIGN) * self._ALIGN
        pin = device.type == "cuda"
        self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self.dev = torch.zeros(size, dtype=torch.int32, device=device)

    def tiles_for(self, tokens: int) -> int:
        """Work-list entries a graph of ``tokens`` tokens launches (per KV head)."""
        return self._tile_capacity(tokens, self.max_chunks, self.per_tile)

    def fits(self, chunks: Sequence[tuple[Sequence[int], int, Sequence[int], bool]]) -> bool:
        return (0 < len(chunks) <= self.max_chunks and sum(len(c[0]) for c in chunks) <= self.max_tokens
                and all(len(c[2]) <= self.pages_per_seq for c in chunks))

    def fill(self, chunks: Sequence[tuple[Sequence[int], int, Sequence[int], bool]], tokens: int) -> None:
        """chunks as build_forward_batch takes them (ids may be future refs < 0), padded to ``tokens``
        tokens; one H2D copy of every field and the live page-table rows. No chunks: every row padding
        (what a graph is captured with)."""
        from kvshare_kernels.prefill_tiles import plan_tiles

        n, t = len(chunks), sum(len(c[0]) for c in chunks)
        if not ((n == 0 or self.fits(chunks)) and t <= tokens <= self.max_tokens):
            raise ValueError(f"a step of {n} chunks / {t} tokens does not fit a mixed graph of {tokens} tokens "
                             f"({self.max_chunks} chunks, {self.pages_per_seq} pages each)")
        host = chunk_arrays(list(chunks), self.page_size, table_width=self.pages_per_seq)
        staging = self._hosts[self._turn]
        self._turn ^= 1
        h, at, b = staging.numpy(), self._at, self.max_chunks
        for name, values in (("ids", host.input_ids), ("positions", host.positions), ("slots", host.slots)):
            h[at[name]:at[name] + t] = values
        h[at["ids"] + t:at["ids"] + tokens] = 0                # padding rows: token 0 at position 0,
        h[at["positions"] + t:at["positions"] + tokens] = 0
        h[at["slots"] + t:at["slots"] + tokens] = -1            # no KV written, in no chunk
        h[at["qsl"]:at["qsl"] + n + 1] = host.query_start_loc
        h[at["qsl"] + n + 1:at["qsl"] + b + 1] = t
        h[at["ctx"]:at["ctx"] + n] = host.context_lens
        h[at["ctx"] + n:at["ctx"] + b] = 0
        s = len(host.logits_rows)
        h[at["logits"]:at["logits"] + s] = host.logits_rows
        h[at["logits"] + s:at["logits"] + b] = 0
        cap = self.tiles_for(tokens)
        plan_tiles(host.lens, host.context_lens, self.per_tile, cap,
                   out=h[at["tiles"]:at["tiles"] + 2 * cap].reshape(cap, 2))
        h[at["table"]:at["table"] + n * self.pages_per_seq] = host.page_table.ravel()
        end = at["table"] + n * self.pages_per_seq
        self.dev[:end].copy_(staging[:end], non_blocking=True)

    def forward_batch(self, tokens: int, max_context: int) -> ForwardBatch:
        """Views a graph of ``tokens`` tokens captures (a mixed step: the prefill attention, with tiles)."""
        at, b, d = self._at, self.max_chunks, self.dev
        cap = self.tiles_for(tokens)
        return ForwardBatch(
            input_ids=d[at["ids"]:at["ids"] + tokens], positions=d[at["positions"]:at["positions"] + tokens],
            slot_mapping=d[at["slots"]:at["slots"] + tokens],
            page_table=d[at["table"]:at["table"] + b * self.pages_per_seq].view(b, self.pages_per_seq),
            query_start_loc=d[at["qsl"]:at["qsl"] + b + 1], context_lens=d[at["ctx"]:at["ctx"] + b],
            logits_indices=d[at["logits"]:at["logits"] + min(tokens, b)], decode_only=False,
            max_query_len=tokens, max_context=max_context,
            prefill_tiles=d[at["tiles"]:at["tiles"] + 2 * cap].view(cap, 2))
