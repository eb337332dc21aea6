"""PageTransfer: the host tier's page moves (GPU page <-> host slot) off the engine's critical path.

    compute stream  ..step N-1..|wait(gather)|........ forward N ........|wait(loaded)?
    copy stream                 |gather spilled pages|D2H into slots.....|H2D+scatter loads|record done
                                 ^ waits for the compute stream's work so far

On CUDA the copies run on their own stream: the spilled pages are gathered into a staging tensor
first (the compute stream waits only for that gather, since the step's forward may write those
pages once they are reallocated), the device-to-host copies into the pinned slots then overlap the
forward, and the forward waits for the loads only when the step has loads (their pages are read by
it). `done` is recorded after every batch; a disk job that reads or writes host slots waits on it
(runtime/disk_io.py), so the host thread never waits for a copy. Consecutive slots go in one copy per
tensor. On the CPU it is the same code on no stream: every copy has finished when run() returns.
Pages are moved as KVCache.page_tensors(), whatever they hold.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from kvshare_kernels.kv_quant import storage_view

from .kv_cache import KVCache


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in slots, first slot, length) of each maximal run of consecutive slot numbers."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, slots[start], i - start))
            start = i
    return runs


class PageTransfer:
    def __init__(self, kv: KVCache, device: torch.device):
        self.device = device
        self.pages = kv.page_tensors()
        self.slots = kv.host_page_tensors()
        if self.slots and len(self.slots) != len(self.pages):
            raise ValueError(f"host tier has {len(self.slots)} page tensors, the pool {len(self.pages)}")
        cuda = device.type == "cuda" and bool(self.slots)
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.done: torch.cuda.Event | None = None   # recorded after the last batch (None on the CPU)

    def run(self, spills: Sequence[tuple[int, int]], loads: Sequence[tuple[int, int]]) -> None:
        """spills (GPU page, host slot), then loads (host slot, GPU page), ordered after the work
        already queued on the current stream and before the next forward that reads a loaded page."""
        if not (spills or loads):
            return
        main = torch.cuda.current_stream(self.device) if self.stream is not None else None
        if self.stream is not None:
            self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            if spills:
                self._spill(spills, main)
            if loads:
                self._load(loads)
            if self.stream is not None:
                self.done = torch.cuda.Event()
                self.done.record(self.stream)
        if loads and main is not None:
            main.wait_event(self.done)

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        index = torch.tensor(pages, dtype=torch.long)
        if self.device.type == "cuda":
            return index.pin_memory().to(self.device, non_blocking=True)
        return index.to(self.device)

    def _spill(self, spills: Sequence[tuple[int, int]], main) -> None:
        pages = self._index([p for p, _ in spills])
        staged = [t.index_select(0, pages) for t in self.pages]
        if main is not None:          # the forward may overwrite these pages once gathered, not before
            gathered = torch.cuda.Event()
            gathered.record(self.stream)
            main.wait_event(gathered)
        slots = [s for _, s in spills]
        blocking = self.stream is None
        for at, first, n in slot_runs(slots):
            for src, dst in zip(staged, self.slots):
                dst[first:first + n].copy_(src[at:at + n], non_blocking=not blocking)

    def _load(self, loads: Sequence[tuple[int, int]]) -> None:
        slots = [s for s, _ in loads]
        pages = self._index([p for _, p in loads])
        blocking = self.stream is None
        for src, dst in zip(self.slots, self.pages):
            staged = torch.empty((len(slots),) + tuple(dst.shape[1:]), dtype=dst.dtype, device=dst.device)
            for at, first, n in slot_runs(slots):
                staged[at:at + n].copy_(src[first:first + n], non_blocking=not blocking)
            storage_view(dst).index_copy_(0, pages, storage_view(staged))   # no fp8 index_copy on the CPU
