"""DiskIO: the disk tier's jobs on background threads, off the engine thread.

    engine thread: plan.disk_{deletes,writes,reads} --submit--> shard = hash(key) % workers
                   poll() <-- (job, ok) completions <-------- worker: wait for the copies, then file I/O

Each job touches one host slot that the bookkeeping keeps busy until its completion is applied
(HostTier.mark_busy / reserve_fill), so no step reuses it meanwhile. A job first waits for the
page transfers queued before it was submitted (PageTransfer.done): a write reads a slot that a
spill is filling, a fill overwrites a slot that an earlier load may still be reading. Jobs of one
key run in order on one worker (a delete and a later rewrite of the same page cannot race). The
queue is bounded by the work itself: one job per busy host slot, at most
DiskTier.max_inflight_writes writes. On the CPU there is no event: copies are done when submitted.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from .disk_store import DiskStore

log = logging.getLogger("kvshare.runtime")


class DiskRead(Protocol):
    """A fill: the file of `key` into host slot `slot` (core.types.DiskRead has these fields)."""
    key: bytes
    slot: int


class DiskWrite(DiskRead, Protocol):
    """Host slot `slot` to the file of `key`, with the header's fields (core.types.DiskWrite)."""
    parent_key: bytes
    salt: bytes
    tokens: tuple[int, ...]


class DiskIO:
    def __init__(self, store: DiskStore, host_tensors: Sequence[torch.Tensor], *, workers: int = 2):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.store = store
        self._tensors = tuple(host_tensors)
        self._shards = [ThreadPoolExecutor(1, thread_name_prefix=f"kvshare-disk{i}") for i in range(workers)]
        # (job, is_write, ok): the caller's own job objects come back
        self._done: queue.SimpleQueue[tuple[DiskWrite | DiskRead, bool, bool]] = queue.SimpleQueue()
        self._inflight = 0
        self._idle = threading.Condition()
        self.bytes_written = 0          # written by workers; read on the engine thread (ints: atomic)
        self.bytes_read = 0

    def submit(self, writes: Sequence[DiskWrite], reads: Sequence[DiskRead], deletes: Sequence[bytes],
               after: torch.cuda.Event | None) -> None:
        """Queue a step's disk work; `after`: the event of the page transfers queued so far."""
        jobs = len(writes) + len(reads)
        if jobs:
            with self._idle:
                self._inflight += jobs
        for key in deletes:
            self._shard(key).submit(self.store.delete, key)
        for write in writes:
            self._shard(write.key).submit(self._write, write, after)
        for read in reads:
            self._shard(read.key).submit(self._read, read, after)

    def poll(self) -> list[tuple[DiskWrite | DiskRead, bool, bool]]:
        """(job, is_write, ok) of the jobs finished since the last call (never blocks)."""
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted write and read has finished (shutdown, tests)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def wait_done(self, timeout: float) -> bool:
        """Wait up to timeout for a job to finish (an engine with nothing else to do: no spinning)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._done.empty() or self._inflight == 0, timeout)

    def close(self) -> None:
        self.flush()
        for pool in self._shards:
            pool.shutdown(wait=True)

    @property
    def inflight(self) -> int:
        return self._inflight

    def _shard(self, key: bytes) -> ThreadPoolExecutor:
        return self._shards[key[0] % len(self._shards)] if key else self._shards[0]

    def _write(self, job: DiskWrite, after: torch.cuda.Event | None) -> None:
        ok = False
        try:
            if after is not None:
                after.synchronize()
            tensors = [t[job.slot] for t in self._tensors]
            self.store.write(job.key, job.parent_key, job.salt, job.tokens, tensors)
            self.bytes_written += sum(t.numel() * t.element_size() for t in tensors)
            ok = True
        except Exception:      # a full or failing disk costs the page, never the engine
            log.exception("disk tier: writing page %s failed", job.key.hex())
        self._finish(job, True, ok)

    def _read(self, job: DiskRead, after: torch.cuda.Event | None) -> None:
        ok = False
        try:
            if after is not None:
                after.synchronize()
            tensors = [t[job.slot] for t in self._tensors]
            ok = self.store.read_into(job.key, tensors)
            if ok:
                self.bytes_read += sum(t.numel() * t.element_size() for t in tensors)
            else:
                log.warning("disk tier: page %s failed its checks (torn, stale or another layout): a miss",
                            job.key.hex())
        except Exception:
            log.exception("disk tier: reading page %s failed", job.key.hex())
        self._finish(job, False, ok)

    def _finish(self, job: DiskWrite | DiskRead, is_write: bool, ok: bool) -> None:
        self._done.put((job, is_write, ok))
        with self._idle:
            self._inflight -= 1
            self._idle.notify_all()
