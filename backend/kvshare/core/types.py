"""Frozen value types that cross from kvshare.core into the engine (see docs/develop/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PageCopy:
    """Copy-on-write: copy page `src` into the private page `dst` before the step's forward.

    Only the first `num_tokens` slots matter; copying the whole page (what
    kvshare_kernels.copy_pages does) is harmless because the remaining slots of `dst`
    are beyond the sequence's context until its own prefill overwrites them.
    """

    src: int
    dst: int
    num_tokens: int


@dataclass(frozen=True)
class PoolStats:
    """Counters behind the kvshare_kv_* / kvshare_prefix_cache_* Prometheus metrics.

    total == free + active + cached at all times.
    """

    total: int
    free: int
    active: int
    cached: int
    evictions_total: int
    prefix_queries_tokens_total: int
    prefix_hits_tokens_total: int
    preemptions_total: int
    # the host tier below the pool (0 when there is none); host hits are part of prefix hits
    host_pages_total: int = 0
    host_pages_used: int = 0
    host_hits_tokens_total: int = 0
    host_spills_total: int = 0
    host_loads_total: int = 0
    host_evictions_total: int = 0
    # the disk tier below the host tier (0 when there is none); disk hits are part of host hits
    disk_pages_total: int = 0
    disk_pages_used: int = 0
    disk_hits_tokens_total: int = 0
    disk_writes_total: int = 0
    disk_reads_total: int = 0
    disk_evictions_total: int = 0
    disk_read_failures_total: int = 0         # torn, stale or foreign files: misses, never served
    # page faults: full prompt pages admissions looked up and did not find in this tier or above it
    faults_gpu_total: int = 0
    faults_host_total: int = 0
    faults_disk_total: int = 0                # ... nor on disk: recomputed
    # prompt tokens a forked sequence (num_return_sequences > 1) took from its parent's pages
    fork_shared_tokens_total: int = 0

    @property
    def allocatable(self) -> int:
        return self.free + self.cached

    @property
    def prefix_hit_rate(self) -> float:
        queries = self.prefix_queries_tokens_total
        return self.prefix_hits_tokens_total / queries if queries else 0.0


@dataclass(frozen=True)
class DiskWrite:
    """Write host slot `slot` (the page of `key`, just spilled) to its file; the header carries the
    rest, so a restart can rebuild the index."""

    key: bytes
    slot: int
    parent_key: bytes
    salt: bytes
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class DiskRead:
    """Read the file of `key` into host slot `slot` (a fill), checking its checksum and layout."""

    key: bytes
    slot: int


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute the KV of tokens all_ids[start:start+num_tokens] at positions start.. .

    samples is True when the chunk reaches the sequence's last token, so the runner
    samples one new token for it and passes it to Scheduler.on_step_done.
    """

    seq_id: int
    start: int
    num_tokens: int
    samples: bool


@dataclass(frozen=True)
class StepPlan:
    """Everything the runner must do for one engine step, in order: spills, loads, copies, the forward."""

    chunks: tuple[ScheduledChunk, ...] = ()  # prefill chunks first, then decodes (num_tokens == 1)
    copies: tuple[PageCopy, ...] = ()  # copy-on-write copies to run BEFORE the forward
    preempted: tuple[int, ...] = ()  # seq ids moved back to waiting (pages freed; recomputed later)
    rejected: tuple[tuple[int, str], ...] = ()  # seq ids that can never fit, with a message
    # host tier (KVCacheManager's HostTier): run spills, then loads, then copies, then the forward
    spills: tuple[tuple[int, int], ...] = ()  # (GPU page, host slot): evicted cached pages kept on the host
    loads: tuple[tuple[int, int], ...] = ()  # (host slot, GPU page): cached prefix pages brought back
    # disk tier (background jobs; submit after the spills ran): host slots to files, files to host slots
    disk_writes: tuple[DiskWrite, ...] = ()
    disk_reads: tuple[DiskRead, ...] = ()
    disk_deletes: tuple[bytes, ...] = ()     # keys whose files go (evicted, bad)

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.copies or self.preempted or self.rejected or self.spills or self.loads
                    or self.disk_writes or self.disk_reads or self.disk_deletes)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)
