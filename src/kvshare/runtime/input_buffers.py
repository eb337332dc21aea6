"""Persistent decode inputs for CUDA graphs: one int32 device buffer, filled by ONE host->device copy.

    device buffer (int32):  | input_ids [M] | positions [M] | slots [M] | context_lens [M] | page_table [M, P] |
                            M = max batch (the largest captured graph), P = pages per sequence (max_model_len)

A graph captured at batch size B reads the first B rows of every field. Each step writes the live
rows (and the padding rows up to B) into a pinned host staging copy of the same layout, then
copies the prefix [0, 4M + B*P) once. Padding rows are token 0 at position 0, slot -1 (write_kv
writes nothing) and context 0 (attention gives a zero row); their page-table rows are never read.
A live row's page-table entries past its context are stale but never read either.
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
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self.dev = torch.zeros(size, dtype=torch.int32, device=device)
        self._np = self.host.numpy()
        self._pt_np = self._np[4 * m:].reshape(m, pages_per_seq)
        self._np[2 * m:3 * m] = -1                    # every row starts as padding
        self.dev.copy_(self.host)
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
        n, m, ps, h = len(rows), self.max_batch, self.page_size, self._np
        if not 0 < n <= batch <= m:
            raise ValueError(f"decode batch of {n} rows does not fit a graph of {batch} (max {m})")
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
        table = self._pt_np
        for i, (_, _, pt) in enumerate(rows):
            table[i, :len(pt)] = pt
        end = 4 * m + batch * self.pages_per_seq
        self.dev[:end].copy_(self.host[:end], non_blocking=True)

    def forward_batch(self, batch: int, max_context: int) -> ForwardBatch:
        """Views of the first ``batch`` rows, as a decode-only ForwardBatch (what a graph captures)."""
        return ForwardBatch(
            input_ids=self.input_ids[:batch], positions=self.positions[:batch],
            slot_mapping=self.slot_mapping[:batch], page_table=self.page_table[:batch],
            query_start_loc=self.query_start_loc[:batch + 1], context_lens=self.context_lens[:batch],
            logits_indices=self.arange[:batch], decode_only=True, max_query_len=1, max_context=max_context)

    def live_view(self) -> np.ndarray:
        """The staging buffer (tests)."""
        return self._np
