"""KVCacheManager: per-sequence page tables over the PagePool and the PrefixCache.

    page table (seq 7)      pool                                    prefix cache
    [ 3 | 9 | 12 ]  ---->   page 3  rc=2  full, registered  <---->  entry(parent=root, tokens 0..15)
    [ 3 | 5 ]       ---->   page 9  rc=1  full, registered  <---->  entry(parent=3's entry, ...)
    (seq 8)                 page 12 rc=1  private tail: the only page seq 7 writes
                            page 5  rc=1  private tail of seq 8 (filled by a PageCopy from 9)
                            page 4  rc=0  cached (registered, evictable)   page 6 rc=0 free

With a HostTier below the pool, an evicted full cached page that admissions shared (and such pages
below it in the prefix tree, which its eviction unregisters) is first copied to a host slot (a *spill*), and an
admission whose prompt continues past the GPU hits into host-resident pages gets fresh pages filled
from the slots (a *load*) and registers them, instead of recomputing. take_transfers() hands the
step's spills and loads to the scheduler's plan; the runner runs spills, then loads, then copies.

With a DiskTier below the host tier, every spilled page is also written to a file in the background
(write-through; take_disk_work() hands the jobs to the engine), and prefetch() stages a queued
prompt's disk pages into host slots (fills) so that its admission finds them in the host tier. The
engine reports finished jobs back (on_disk_written, on_disk_read) before it schedules a step.

With a sliding window (window W > 0: every layer reads only its last W keys), a sequence's pages
lying wholly before the window of its next query go back to the pool while it runs
(release_window, called from commit): its page-table slot becomes RELEASED (-1), the page is
decref'd (a page another sequence or the prefix cache holds stays; a registered one becomes cached
and evictable as usual). Full pages are registered before they are released, so a later prompt
with the same prefix still hits them while they are cached; an admission or fork never takes a
reference on hit pages wholly before its window (core/window.py draws the slots).

Rules: only a page with refcount 1 owned by one sequence is ever written (its tail, at positions
>= num_committed); shared pages are full and immutable; a prompt always leaves >= 1 token to
compute; allocation is all-or-nothing. Copy-on-write sources are *pinned* (refcount + 1) from
admit() until release_pins(), which the scheduler calls in on_step_done, after the runner has
executed the step's copies.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvshare.core.disk_tier import DiskTier
from kvshare.core.eviction import EvictionPolicy
from kvshare.core.host_tier import HostTier
from kvshare.core.page_pool import PagePool
from kvshare.core.prefix_cache import (
    CachedPage,
    HashFn,
    PrefixCache,
    PrefixMatch,
    PrefixNode,
    blake2b_128,
)
from kvshare.core.types import DiskRead, DiskWrite, PageCopy, PoolStats
from kvshare.core.window import RELEASED, max_pages_held, pages_before_window

log = logging.getLogger("kvshare.core")

# Chosen with perf/core/page_size_tuner.py; see docs/develop/core.md.
DEFAULT_PAGE_SIZE = 16


@dataclass(frozen=True)
class Admission:
    num_cached_tokens: int  # prompt tokens served from the cache (shared pages + copied run)
    num_tokens: int  # tokens of the first chunk to compute, starting at num_cached_tokens
    copy: PageCopy | None  # copy on write to run before the forward


@dataclass
class _SeqPages:
    salt: bytes
    table: list[int]
    chain: list[CachedPage]  # chain[j] verifies the content of table[j] (may be a duplicate's entry)
    num_committed: int
    registrable: bool = True  # False once the chain broke (collision, dropped parent)
    num_released: int = 0  # table[:num_released] are RELEASED: wholly before the window (window > 0)
    next_query: int = 0  # the furthest first query release_window() was told of (>= num_committed there)


class KVCacheManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int = DEFAULT_PAGE_SIZE,
        *,
        policy: EvictionPolicy | str = "lru",
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = blake2b_128,
        max_partial_candidates: int = 8,
        low_watermark: float = 0.05,
        host_tier: HostTier | None = None,
        host_min_hits: int = 1,
        disk_tier: DiskTier | None = None,
        window: int = 0,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if window < 0:
            raise ValueError(f"window must be >= 0 (0 = full attention), got {window}")
        if host_min_hits < 0:
            raise ValueError(f"host_min_hits must be >= 0, got {host_min_hits}")
        self.page_size = page_size
        # sliding window of every layer (ModelConfig.kv_release_window): pages before it go back
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = PagePool(num_pages, policy, on_evict=self._on_evict)
        self.prefix = PrefixCache(
            page_size, hash_fn=hash_fn, max_partial_candidates=max_partial_candidates, on_drop=self._on_drop
        )
        self.low_watermark_pages = int(low_watermark * num_pages)
        self._watermark_armed = True
        self._seqs: dict[int, _SeqPages] = {}
        self._pins: list[int] = []
        self.host = host_tier if enable_prefix_caching else None
        if disk_tier is not None and self.host is None:
            raise ValueError("a disk tier needs a host tier: its pages come back through host slots")
        self.disk = disk_tier if self.host is not None else None
        self._disk_writes: list[DiskWrite] = []
        self._disk_reads: list[DiskRead] = []
        # Spill only pages that at least this many admissions shared (SGLang's selective write-through):
        # on the shared-prefix replay, spilling every evicted page filled the tier with private tails
        # and pushed the shared prefixes out (563k prompt tokens computed vs 383k at 1; none: 724k).
        self.host_min_hits = host_min_hits
        self._spills: list[tuple[int, int]] = []   # (GPU page, host slot) to copy before this step's forward
        self._loads: list[tuple[int, int]] = []    # (host slot, GPU page)
        self.prefix_queries_tokens_total = 0
        self.prefix_hits_tokens_total = 0
        self.host_hits_tokens_total = 0
        self.disk_hits_tokens_total = 0         # part of the host hits: pages filled from the disk tier
        # page faults: full prompt pages an admission looked up and did not find in that tier or above
        self.faults_gpu_total = 0
        self.faults_host_total = 0
        self.faults_disk_total = 0
        self.fork_shared_tokens_total = 0

    # -- queries -------------------------------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def page_table(self, seq_id: int) -> tuple[int, ...]:
        record = self._seqs.get(seq_id)
        return tuple(record.table) if record else ()

    def pages_held(self, seq_id: int) -> int:
        """Pages the sequence references now: its table less the released slots."""
        record = self._seqs.get(seq_id)
        return len(record.table) - record.num_released if record else 0

    def max_pages_held(self, num_tokens: int, chunk: int = 1) -> int:
        """The most pages a sequence of num_tokens tokens needs at once, computing chunk tokens a
        step: all of them with full attention, its window's with a sliding window."""
        return max_pages_held(num_tokens, self.window, self.page_size, chunk)

    def growth_pages(self, seq_id: int, num_tokens: int, more: int) -> int:
        """Pages the sequence lacks to hold `more` tokens past its first num_tokens."""
        return max(0, self.pages_for(num_tokens + more) - len(self._seqs[seq_id].table))

    def capacity_tokens(self, seq_id: int) -> int:
        """Tokens the sequence could hold right now if it took every allocatable page."""
        return (len(self._seqs[seq_id].table) + self.pool.num_allocatable) * self.page_size

    def page_keys(self, token_ids: Sequence[int], salt: bytes) -> tuple[bytes, ...]:
        """Prefix-cache keys of the prompt pages admit() could hit (never the last token's page)."""
        if not self.enable_prefix_caching:
            return ()
        return self.prefix.chain_keys(token_ids, salt, max_tokens=len(token_ids) - 1)

    def probe_cached_tokens(self, page_keys: Sequence[bytes], salt: bytes) -> int:
        """Prompt tokens in full pages cached right now, read-only: an ordering hint for admission.

        Partial (copy-on-write) runs are left out: at most page_size - 1 tokens, not worth a scan.
        """
        return self.prefix.probe(page_keys, salt) * self.page_size

    def stats(self) -> PoolStats:
        pool = self.pool
        return PoolStats(
            total=pool.num_pages,
            free=pool.num_free,
            active=pool.num_active,
            cached=pool.num_cached,
            evictions_total=pool.evictions_total,
            prefix_queries_tokens_total=self.prefix_queries_tokens_total,
            prefix_hits_tokens_total=self.prefix_hits_tokens_total,
            preemptions_total=0,
            fork_shared_tokens_total=self.fork_shared_tokens_total,
            **({} if self.host is None else {
                "host_pages_total": self.host.num_slots, "host_pages_used": len(self.host),
                "host_hits_tokens_total": self.host_hits_tokens_total, "host_spills_total": self.host.spills_total,
                "host_loads_total": self.host.loads_total, "host_evictions_total": self.host.evictions_total}),
            **({} if self.disk is None else {
                "disk_pages_total": self.disk.num_pages, "disk_pages_used": self.disk.num_ready,
                "disk_hits_tokens_total": self.disk_hits_tokens_total, "disk_writes_total": self.disk.writes_total,
                "disk_reads_total": self.disk.reads_total, "disk_evictions_total": self.disk.evictions_total,
                "disk_read_failures_total": self.disk.read_failures_total}),
            faults_gpu_total=self.faults_gpu_total, faults_host_total=self.faults_host_total,
            faults_disk_total=self.faults_disk_total,
        )

    # -- lifecycle of a sequence's pages -------------------------------------------------------

    def admit(
        self, seq_id: int, token_ids: Sequence[int], salt: bytes, *, token_budget: int, reserve_pages: int = 0
    ) -> Admission | None:
        """Give a new (or preempted) sequence its cached prefix and pages for its first chunk.

        Returns None, changing nothing, if the chunk's pages would leave fewer than reserve_pages
        allocatable. The lookup is capped at len(token_ids) - 1 so the last token is computed.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already holds pages")
        if token_budget < 1 or not token_ids:
            return None
        match = self._match(token_ids, salt)
        host_run = self._host_run(match, token_ids, salt)
        if host_run:
            match = PrefixMatch(match.full)   # whole host pages go further than a partial run
        plan = self._fit(match, len(token_ids), token_budget, reserve_pages, len(host_run))
        if plan is None and host_run:
            host_run = []                     # loading needs the pages a chunk of that size would
            plan = self._fit(match, len(token_ids), token_budget, reserve_pages)
        if plan is None and match.partial is not None:
            # The pinned copy source costs one page for a step: without it, a request as large
            # as the whole pool could never be admitted.
            match = PrefixMatch(match.full)
            plan = self._fit(match, len(token_ids), token_budget, reserve_pages)
        if plan is None:
            return None
        num_cached, num_tokens, need, hit_pages, skip = plan
        for entry in match.full[:skip]:  # hits wholly before the window: recency only, no reference
            self.pool.touch(entry.page)
        for page in hit_pages:  # retain first: the allocation below must not evict a hit
            self.pool.touch(page)
            self.pool.retain(page)
        for entry in match.full:
            entry.hits += 1
        # take before allocating: the allocation's evictions spill into the tier and must not
        # overwrite the slots this admission loads from
        taken = [self.host.take(key) for key, _, _ in host_run] if host_run else []
        slots = [entry.slot for entry in taken]
        from_disk = sum(1 for entry in taken if entry.from_disk)
        self.disk_hits_tokens_total += from_disk * self.page_size
        fresh = self.pool.allocate(need)
        copy = None
        if match.partial is not None:
            copy = PageCopy(match.partial.page, fresh[0], match.partial_tokens)
            self._pins.append(match.partial.page)
        table = [RELEASED] * skip + [entry.page for entry in match.full[skip:]] + fresh
        record = _SeqPages(salt, table, list(match.full), num_committed=num_cached, num_released=skip)
        self._load(record, host_run, slots, fresh)
        self._back_up([entry for entry in match.full if entry.alive])
        self._seqs[seq_id] = record
        self.prefix_queries_tokens_total += len(token_ids)
        self.prefix_hits_tokens_total += num_cached
        self.host_hits_tokens_total += len(host_run) * self.page_size
        self._count_faults(len(token_ids), len(match.full), len(taken), from_disk)
        self._check_watermark()
        return Admission(num_cached, num_tokens, copy)

    def fork(self, seq_id: int, parent_id: int, num_shared: int, *, reserve_pages: int = 0) -> Admission | None:
        """Give seq_id the parent's first num_shared tokens without computing them: the parent's
        full pages are shared (refcount + 1), the page holding the rest of them is copied (copy on
        write), and one fresh page (or none) holds what follows.

            parent [ A | B | C* ]      C*: the parent's tail, still written by the parent
            child  [ A | B | C' ]      C': fresh, filled by PageCopy(C -> C', num_shared % page_size)

        The first chunk computes token num_shared (the prompt's last token, so the child samples its
        own first token). Returns None, changing nothing, if the pages would leave fewer than
        reserve_pages allocatable.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already holds pages")
        parent = self._seqs[parent_id]
        if num_shared > parent.num_committed:
            raise ValueError(f"parent {parent_id} has {parent.num_committed} tokens computed, not {num_shared}")
        if not self.can_fork(parent_id, num_shared):
            raise ValueError(f"parent {parent_id} released pages inside the window of token {num_shared}")
        full, used = divmod(num_shared, self.page_size)
        skip = pages_before_window(num_shared, self.window, self.page_size)
        need = self.pages_for(num_shared + 1) - full
        if need + reserve_pages > self.pool.num_allocatable:
            return None
        shared = parent.table[skip:full]
        for page in shared:
            self.pool.retain(page)
        fresh = self.pool.allocate(need)
        copy = None
        if used:
            # Not pinned: the source is the running parent's private tail, which it keeps through this
            # step, and the copy runs before the step's forward (where the parent writes only past
            # num_shared), in stream order before anything that could reuse the page.
            copy = PageCopy(parent.table[full], fresh[0], used)
        chain = parent.chain[:full]
        self._seqs[seq_id] = _SeqPages(parent.salt, [RELEASED] * skip + shared + fresh, chain,
                                       num_committed=num_shared,
                                       registrable=parent.registrable and len(chain) == full, num_released=skip)
        self.fork_shared_tokens_total += num_shared
        self._check_watermark()
        return Admission(num_shared, 1, copy)

    def can_fork(self, parent_id: int, num_shared: int) -> bool:
        """Whether the parent still holds every page a child sharing its first num_shared tokens
        reads (a windowed parent that ran on may have released some; then admit the child through
        the prefix cache instead)."""
        parent = self._seqs[parent_id]
        return parent.num_released <= pages_before_window(num_shared, self.window, self.page_size)

    def num_committed(self, seq_id: int) -> int:
        record = self._seqs.get(seq_id)
        return record.num_committed if record else 0

    def take_transfers(self) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """(spills, loads) decided since the last call, for the step being planned: spills (GPU page,
        host slot) must run before loads (host slot, GPU page), both before the forward."""
        spills, loads = tuple(self._spills), tuple(self._loads)
        self._spills.clear()
        self._loads.clear()
        return spills, loads

    def take_disk_work(self) -> tuple[tuple[DiskWrite, ...], tuple[DiskRead, ...], tuple[bytes, ...]]:
        """(writes, reads, deletes) for the disk worker, decided since the last call. Writes read host
        slots that this step's spills fill: submit them after the step's transfers."""
        if self.disk is None:
            return (), (), ()
        writes, reads = tuple(self._disk_writes), tuple(self._disk_reads)
        self._disk_writes.clear()
        self._disk_reads.clear()
        return writes, reads, self.disk.take_deletes()

    def prefetch(self, token_ids: Sequence[int], salt: bytes, *, max_reads: int,
                 keys: Sequence[bytes] | None = None) -> tuple[int, int]:
        """Stage a queued prompt's disk pages in host slots: (this prompt's pages being filled now,
        reads issued by this call, at most max_reads). Only the run right after what the GPU pool
        and the host tier hold is fetched; admission waits while the first number is > 0.
        keys: the prompt's page_keys() when the caller has them (saves hashing it every step)."""
        if self.disk is None or not (self.disk.num_ready or self.host.num_filling) or len(token_ids) < 2:
            return 0, 0
        keys = self.page_keys(token_ids, salt) if keys is None else keys
        size = self.page_size
        pending = issued = 0
        on_gpu = self.prefix.probe(keys, salt)
        parent = keys[on_gpu - 1] if on_gpu else self.prefix.root_key(salt)
        for j in range(on_gpu, len(keys)):
            key, tokens = keys[j], tuple(token_ids[j * size:(j + 1) * size])
            if self.host.is_filling(key):
                pending += 1
            elif not self.host.match((key,), parent, salt, (tokens,)):
                if issued >= max_reads or not self.disk.match((key,), parent, salt, (tokens,)):
                    break
                slot = self.host.reserve_fill(key, parent, salt, tokens)
                if slot is None:
                    break
                self.disk.begin_read(key)
                self._disk_reads.append(DiskRead(key, slot))
                pending += 1
                issued += 1
            parent = key
        return pending, issued

    def on_disk_written(self, write: DiskWrite, ok: bool) -> None:
        """A write-through job finished: the page is loadable from disk (ok), its host slot reusable."""
        self.disk.write_done(write.key, ok)
        self.host.io_done(write.slot)

    def on_disk_read(self, read: DiskRead, ok: bool) -> None:
        """A fill finished: the host entry is matchable (ok), or the file was bad and both go."""
        self.disk.read_done(read.key, ok)
        self.host.fill_done(read.key, ok)

    def extend(self, seq_id: int, num_tokens: int) -> bool:
        """Grow the page table to hold num_tokens tokens; False (changing nothing) if it can't."""
        record = self._seqs[seq_id]
        need = self.pages_for(num_tokens) - len(record.table)
        if need <= 0:
            return True
        if need > self.pool.num_allocatable:
            return False
        record.table.extend(self.pool.allocate(need))
        self._check_watermark()
        return True

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """The KV of token_ids[:num_computed] is in the pages: register the newly full ones."""
        record = self._seqs[seq_id]
        assert num_computed <= len(record.table) * self.page_size, (
            f"seq {seq_id}: {num_computed} tokens computed into {len(record.table)} pages"
        )
        record.num_committed = num_computed
        self._register_full_pages(record, token_ids, num_computed)
        if self.window:
            self.release_window(seq_id, num_computed)

    def release_window(self, seq_id: int, first_query: int) -> int:
        """Give back the pages wholly before the window of the sequence's next query, at position
        first_query (its computed length), that are settled: registered in the prefix cache, or
        never to be (a page whose tokens are still pending waits for commit()). Returns how many
        went back. O(pages released): each slot is released once."""
        record = self._seqs[seq_id]
        record.next_query = max(record.next_query, first_query)
        end = min(pages_before_window(first_query, self.window, self.page_size), self._settled(record))
        start = record.num_released
        for index in range(start, end):
            self.pool.release(record.table[index])
            record.table[index] = RELEASED
        record.num_released = max(start, end)
        return max(0, end - start)

    def _settled(self, record: _SeqPages) -> int:
        """Leading pages whose prefix-cache registration is decided."""
        if self.enable_prefix_caching and record.registrable:
            return len(record.chain)
        return len(record.table)

    def _register_full_pages(self, record: _SeqPages, token_ids: Sequence[int], num_computed: int) -> None:
        if not (self.enable_prefix_caching and record.registrable):
            return
        size = self.page_size
        while (len(record.chain) + 1) * size <= num_computed:
            index = len(record.chain)
            tokens = token_ids[index * size : (index + 1) * size]
            page = record.table[index]
            entry = self.prefix.register_full(self._parent(record), record.salt, tokens, page)
            if entry is None:
                record.registrable = False
                return
            if entry.page == page:
                self.pool.mark_reusable(page)
            record.chain.append(entry)

    def free(self, seq_id: int, token_ids: Sequence[int] | None = None) -> None:
        """Release every page of the sequence (idempotent). With token_ids, keep its partial tail."""
        record = self._seqs.pop(seq_id, None)
        if record is None:
            return
        if token_ids is not None:
            self._register_tail(record, token_ids)
        # Children first, so recency-based policies evict a chain from its tail, not its root.
        for page in reversed(record.table[record.num_released:]):
            self.pool.release(page)

    def release_pins(self) -> None:
        """The step's copies ran: copy-on-write sources may be evicted again, host slots reused."""
        pins, self._pins = self._pins, []
        self.pool.release_all(pins)
        if self.host is not None:
            self.host.release_pins()

    # -- internals -----------------------------------------------------------------------------

    def _fit(
        self, match: PrefixMatch, num_prompt: int, token_budget: int, reserve_pages: int, loaded_pages: int = 0
    ) -> tuple[int, int, int, list[int], int] | None:
        """(cached tokens, chunk tokens, fresh pages, hit pages to retain, leading hits before the
        window: not retained) if the admission fits, else None.
        loaded_pages: full pages after the match that come from the host tier (fresh, but cached)."""
        num_cached = match.num_tokens(self.page_size) + loaded_pages * self.page_size
        num_tokens = min(num_prompt - num_cached, token_budget)
        need = self.pages_for(num_cached + num_tokens) - len(match.full)
        skip = min(len(match.full), pages_before_window(num_cached, self.window, self.page_size))
        hit_pages = [entry.page for entry in match.full[skip:]]
        if match.partial is not None:
            hit_pages.append(match.partial.page)
        revived = sum(1 for page in hit_pages if self.pool.refcount(page) == 0)
        room = self.pool.num_allocatable - revived - reserve_pages
        if need > room and self.window:
            # A windowed request may be longer than the pool: its first chunk shrinks to the pages
            # there are, as a running prefill's does (Scheduler.add checked that its window fits).
            num_tokens = min(num_tokens, (len(match.full) + room) * self.page_size - num_cached)
            if num_tokens < 1:
                return None
            need = self.pages_for(num_cached + num_tokens) - len(match.full)
        if need > room:
            return None
        return num_cached, num_tokens, need, hit_pages, skip

    def _host_run(self, match: PrefixMatch, token_ids: Sequence[int], salt: bytes
                  ) -> list[tuple[bytes, bytes, tuple[int, ...]]]:
        """(key, parent key, tokens) of the prompt's full pages right after the GPU match that the
        host tier holds, verified, in order; never the last token's page (it is computed)."""
        if self.host is None or not len(self.host):
            return []
        size = self.page_size
        parent_key = match.full[-1].key if match.full else self.prefix.root_key(salt)
        first = len(match.full)
        last = (len(token_ids) - 1) // size                 # full pages before the last token's
        if first >= last:
            return []
        pages = [tuple(token_ids[j * size:(j + 1) * size]) for j in range(first, last)]
        keys = self.prefix.keys_after(parent_key, salt, pages)
        run = self.host.match(keys, parent_key, salt, pages)
        parents = [parent_key] + keys
        return [(keys[j], parents[j], pages[j]) for j in range(len(run))]

    def _load(self, record: _SeqPages, host_run: list[tuple[bytes, bytes, tuple[int, ...]]],
              slots: list[int], fresh: list[int]) -> None:
        """Schedule the host->GPU copies of an admission's host run into its first fresh pages and
        register those pages, as commit() would once they were computed."""
        for (_, _, tokens), slot, page in zip(host_run, slots, fresh):
            self._loads.append((slot, page))
            if not record.registrable:
                continue
            entry = self.prefix.register_full(self._parent(record), record.salt, tokens, page)
            if entry is None or entry.page != page:
                record.registrable = False       # cannot happen after a miss on this chain; stay safe
                continue
            self.pool.mark_reusable(page)
            record.chain.append(entry)

    def _match(self, token_ids: Sequence[int], salt: bytes) -> PrefixMatch:
        if not self.enable_prefix_caching:
            return PrefixMatch()
        return self.prefix.match(token_ids, salt, max_tokens=len(token_ids) - 1)

    def _parent(self, record: _SeqPages) -> PrefixNode:
        return record.chain[-1] if record.chain else self.prefix.root(record.salt)

    def _register_tail(self, record: _SeqPages, token_ids: Sequence[int]) -> None:
        size = self.page_size
        index, used = divmod(record.num_committed, size)
        if not (self.enable_prefix_caching and record.registrable and used and index == len(record.chain)):
            return
        page = record.table[index]
        tokens = token_ids[index * size : index * size + used]
        if self.prefix.register_partial(self._parent(record), record.salt, tokens, page):
            self.pool.mark_reusable(page)

    def _on_evict(self, page: int) -> None:
        if self.host is not None:   # keep the evicted page and the cached pages below it on the host
            for entry in self.prefix.subtree(page):
                if entry.is_full and entry.hits >= self.host_min_hits:
                    slot = self.host.store(entry.key, entry.parent.key, entry.salt, entry.tokens)
                    if slot is not None:
                        self._spills.append((entry.page, slot))
                        self._write_through(entry.key, entry.parent.key, entry.salt, entry.tokens, slot)
        self.prefix.drop(page)

    def _back_up(self, hits: Sequence[CachedPage]) -> None:
        """With a disk tier, a GPU page that admissions share (host_min_hits) is copied to a host slot
        and written through while it is still cached (SGLang's write-through on hit count): a hot
        system prompt is the one the pool never evicts, and it must survive a restart too. Pages
        on disk or being written are skipped, so each hot page is copied about once."""
        if self.disk is None:
            return
        for entry in hits:
            if entry.hits < max(1, self.host_min_hits) or entry.key in self.disk or entry.key in self.host:
                continue
            if not self.disk.can_write():
                return
            slot = self.host.store(entry.key, entry.parent.key, entry.salt, entry.tokens)
            if slot is None:
                return
            self._spills.append((entry.page, slot))
            self._write_through(entry.key, entry.parent.key, entry.salt, entry.tokens, slot)

    def _write_through(self, key: bytes, parent_key: bytes, salt: bytes, tokens: tuple[int, ...], slot: int) -> None:
        if self.disk is not None and self.disk.want_write(key, parent_key, salt, tokens):
            self.host.mark_busy(slot)
            self._disk_writes.append(DiskWrite(key, slot, parent_key, salt, tuple(tokens)))

    def _count_faults(self, num_prompt: int, gpu_pages: int, host_pages: int, disk_pages: int) -> None:
        """host_pages: loaded from host slots, disk_pages of them filled from the disk tier."""
        if not self.enable_prefix_caching:
            return
        lookups = (num_prompt - 1) // self.page_size      # full pages before the last token's
        self.faults_gpu_total += lookups - gpu_pages
        self.faults_host_total += lookups - gpu_pages - host_pages + disk_pages
        self.faults_disk_total += lookups - gpu_pages - host_pages

    def _on_drop(self, page: int) -> None:
        self.pool.unmark_reusable(page)

    def _check_watermark(self) -> None:
        allocatable = self.pool.num_allocatable
        if allocatable >= 2 * self.low_watermark_pages:
            self._watermark_armed = True  # hysteresis: one warning per dip, not one per step
        elif allocatable < self.low_watermark_pages and self._watermark_armed:
            self._watermark_armed = False
            log.warning("KV pool below its low watermark (%d pages): %s", self.low_watermark_pages, self.describe())

    def describe(self, top: int = 3) -> str:
        held = lambda record: len(record.table) - record.num_released  # noqa: E731
        holders = sorted(self._seqs.items(), key=lambda item: held(item[1]), reverse=True)[:top]
        listed = ", ".join(f"seq {seq_id}: {held(r)} pages" for seq_id, r in holders)
        return (
            f"{self.pool.describe()} pins={len(self._pins)} sequences={len(self._seqs)} "
            f"prefix_entries={len(self.prefix)} top holders: [{listed}]"
        )

    def check_integrity(self) -> None:
        """O(num_pages + table entries): pool, prefix index, and who references what."""
        self.pool.check_integrity()
        self.prefix.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
            spilled = [slot for _, slot in self._spills]
            assert len(set(spilled)) == len(spilled), f"two spills into one host slot in a step: {self._spills}"
        if self.disk is not None:
            self.disk.check_integrity()
        refs: Counter[int] = Counter(self._pins)
        for seq_id, record in self._seqs.items():
            released, live = record.table[:record.num_released], record.table[record.num_released:]
            assert all(page == RELEASED for page in released), f"seq {seq_id}: a released slot holds a page"
            assert all(page >= 0 for page in live), f"seq {seq_id}: a RELEASED slot after the first live page"
            bound = pages_before_window(max(record.num_committed, record.next_query), self.window, self.page_size)
            assert record.num_released <= bound, (
                f"seq {seq_id}: {record.num_released} pages released, only {bound} lie before its window")
            refs.update(live)
            assert len(set(live)) == len(live), f"seq {seq_id} lists a page twice: {record.table}"
            assert record.num_committed <= len(record.table) * self.page_size, f"seq {seq_id}: table too short"
            assert len(record.chain) <= len(record.table), f"seq {seq_id}: chain longer than table"
            for entry in record.chain:
                assert entry.is_full, f"seq {seq_id}: partial entry {entry!r} in its chain"
            for page in record.table[max(record.num_released, record.num_committed // self.page_size):]:
                count = self.pool.refcount(page)
                assert count == 1, f"seq {seq_id}: writable page {page} has refcount {count} (must be private)"
        for page in range(self.pool.num_pages):
            count = self.pool.refcount(page)
            assert count == refs[page], f"page {page}: refcount {count} but {refs[page]} table/pin references"
            registered = self.prefix.entry_of(page) is not None
            assert registered == self.pool.is_reusable(page), (
                f"page {page}: registered={registered} but reusable={self.pool.is_reusable(page)}"
            )
