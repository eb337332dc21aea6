"""DiskTier: the file tier below the host tier (bookkeeping only; runtime/disk_store.py moves bytes).

    HostTier slot --- write-through: slot -> file (background) ---> key -> DiskPage(parent key, salt, tokens)
    HostTier slot <-- fill: file -> slot (background), then a load <--- a queued prompt's next keys

Every page spilled into the host tier is also written to a file (write-through), so a page the host
tier evicts later is still here, and so is everything written before a restart: warm() rebuilds the
index from the directory's headers. A page is loadable only once its write finished (write_done);
a page being read is never evicted (its file must stay). When the budget is full the least recently
written or used page goes (its file is deleted by the runtime: take_deletes()). Entries are verified
like the other tiers' (parent key, salt and tokens), and the runtime checksums what it reads back:
a torn, stale or foreign file is a miss (read_done(ok=False) drops it), never wrong KV.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DiskPage:
    parent_key: bytes
    salt: bytes
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class IndexedPage:
    """A page file found in the directory at start-up (the runtime read its header)."""
    key: bytes
    parent_key: bytes
    salt: bytes
    tokens: tuple[int, ...]


class DiskTier:
    def __init__(self, num_pages: int, *, max_inflight_writes: int = 64) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if max_inflight_writes < 1:
            raise ValueError(f"max_inflight_writes must be >= 1, got {max_inflight_writes}")
        self.num_pages = num_pages
        # Writes queue on a bounded worker; past this many the page stays on the host only.
        self.max_inflight_writes = max_inflight_writes
        self._ready: OrderedDict[bytes, DiskPage] = OrderedDict()   # least recently used first
        self._writing: dict[bytes, DiskPage] = {}
        self._reading: Counter[bytes] = Counter()
        self._deletes: list[bytes] = []
        self.writes_total = 0
        self.write_failures_total = 0
        self.reads_total = 0
        self.read_failures_total = 0
        self.evictions_total = 0

    def __len__(self) -> int:
        """Pages on disk or being written: what counts against the budget."""
        return len(self._ready) + len(self._writing)

    def __contains__(self, key: bytes) -> bool:
        return key in self._ready or key in self._writing

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def num_writing(self) -> int:
        return len(self._writing)

    def warm(self, pages: Iterable[IndexedPage]) -> int:
        """Index the pages a directory scan found, oldest first; those past the budget are deleted
        (the oldest go). Returns how many were indexed."""
        for page in pages:
            if page.key in self:
                continue
            self._ready[page.key] = DiskPage(page.parent_key, page.salt, page.tokens)
        while len(self._ready) > self.num_pages:
            key, _ = self._ready.popitem(last=False)
            self._deletes.append(key)
        return len(self._ready)

    def want_write(self, key: bytes, parent_key: bytes, salt: bytes, tokens: Sequence[int]) -> bool:
        """Should the runtime write this page? False if it is here (refreshed) or being written, if too
        many writes are in flight, or if every page is being read or written (nothing can go)."""
        if key in self._ready:
            self._ready.move_to_end(key)
            return False
        if key in self._writing or len(self._writing) >= self.max_inflight_writes:
            return False
        if len(self) >= self.num_pages and not self._evict_one():
            return False
        self._writing[key] = DiskPage(parent_key, salt, tuple(tokens))
        return True

    def can_write(self) -> bool:
        """Another write may start now (fewer than max_inflight_writes in flight)."""
        return len(self._writing) < self.max_inflight_writes

    def write_done(self, key: bytes, ok: bool) -> None:
        page = self._writing.pop(key)
        if ok:
            self._ready[key] = page
            self.writes_total += 1
        else:
            self.write_failures_total += 1
            self._deletes.append(key)        # a partial temporary file, if any

    def match(self, keys: Sequence[bytes], parent_key: bytes, salt: bytes,
              pages: Sequence[Sequence[int]]) -> list[DiskPage]:
        """The longest run keys[0..r) written completely and verified (parent, salt, tokens). Read-only."""
        run: list[DiskPage] = []
        parent = parent_key
        for key, tokens in zip(keys, pages):
            page = self._ready.get(key)
            if page is None or page.parent_key != parent or page.salt != salt or page.tokens != tuple(tokens):
                break
            run.append(page)
            parent = key
        return run

    def begin_read(self, key: bytes) -> DiskPage:
        """A read of key's file is being issued: it stays (and its file) until read_done."""
        page = self._ready[key]
        self._ready.move_to_end(key)
        self._reading[key] += 1
        return page

    def read_done(self, key: bytes, ok: bool) -> None:
        """ok: the page came back checksummed; else its file is torn, stale or gone: drop it."""
        self._reading[key] -= 1
        if not self._reading[key]:
            del self._reading[key]
        if ok:
            self.reads_total += 1
            return
        self.read_failures_total += 1
        if key in self._ready and key not in self._reading:
            del self._ready[key]
            self._deletes.append(key)

    def take_deletes(self) -> tuple[bytes, ...]:
        """Keys whose files the runtime should delete (evicted, failed, past the budget)."""
        deletes, self._deletes = tuple(self._deletes), []
        return deletes

    def _evict_one(self) -> bool:
        for key in self._ready:
            if key not in self._reading:
                del self._ready[key]
                self._deletes.append(key)
                self.evictions_total += 1
                return True
        return False

    def check_integrity(self) -> None:
        assert len(self) <= self.num_pages, f"disk tier over budget: {len(self)} > {self.num_pages} pages"
        assert not self._ready.keys() & self._writing.keys(), "a page both written and ready"
        assert len(self._writing) <= self.max_inflight_writes, "more writes in flight than allowed"
        for key, count in self._reading.items():
            assert count > 0, f"read count {count} for {key.hex()}"
            assert key in self._ready, f"a page being read is not indexed: {key.hex()}"
