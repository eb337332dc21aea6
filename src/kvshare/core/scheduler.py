"""Scheduler: continuous batching with chunked prefill and recompute preemption.

One engine step is

    plan = scheduler.schedule()                # which tokens to compute, which pages to copy
    runner.copy_pages(plan.copies); sampled = runner.forward(plan.chunks)
    scheduler.on_step_done(sampled)            # commit KV, append tokens, unpin copy sources

schedule() fills a budget of max_step_tokens in three passes, oldest sequence first:
  1. decodes of running sequences (1 token each);
  2. the next chunk (<= max_prefill_chunk) of running sequences that are still prefilling;
  3. admission of waiting sequences, FCFS, while len(running) < max_running.
A running sequence that needs a page when none is allocatable preempts the most recently
admitted running sequence not yet scheduled in this step (possibly itself): its pages are
freed (full pages stay cached, so recomputing is mostly prefix hits) and it goes to the FRONT
of the waiting queue. Admission keeps one allocatable page per running sequence in reserve, so
each running sequence can cross a page boundary before anyone must be preempted, and nothing
is admitted in a step that preempted.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping, Sequence as SequenceOf
from dataclasses import dataclass, field

from kvshare.core.kv_cache_manager import KVCacheManager
from kvshare.core.sequence import Sequence, SeqState
from kvshare.core.types import PageCopy, PoolStats, ScheduledChunk, StepPlan


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_running: int,
        max_step_tokens: int,
        max_prefill_chunk: int,
        debug_checks: bool = False,
    ) -> None:
        for name, value in (("max_running", max_running), ("max_step_tokens", max_step_tokens),
                            ("max_prefill_chunk", max_prefill_chunk)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.kv = kv
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.max_prefill_chunk = max_prefill_chunk
        self.debug_checks = debug_checks
        self.preemptions_total = 0
        self._seqs: dict[int, Sequence] = {}
        self._waiting: OrderedDict[int, Sequence] = OrderedDict()
        self._running: OrderedDict[int, Sequence] = OrderedDict()  # in admission order
        self._rejected: list[tuple[int, str]] = []
        self._inflight: tuple[ScheduledChunk, ...] | None = None

    # -- requests ------------------------------------------------------------------------------

    def add(
        self, seq_id: int, prompt_ids: SequenceOf[int], *, salt: bytes | str = b"", max_new_tokens: int
    ) -> None:
        """Queue a request. One that can never fit in the whole pool is reported in the next plan.

        salt: the request's cache_salt (str is UTF-8 encoded); prefixes are shared only within a salt.
        """
        if seq_id in self._seqs or any(seq_id == rejected for rejected, _ in self._rejected):
            raise ValueError(f"sequence {seq_id} is already known to the scheduler")
        if not prompt_ids:
            raise ValueError(f"sequence {seq_id}: empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"sequence {seq_id}: max_new_tokens must be >= 1, got {max_new_tokens}")
        salt_bytes = salt.encode() if isinstance(salt, str) else bytes(salt)
        seq = Sequence(seq_id, [int(t) for t in prompt_ids], len(prompt_ids), salt_bytes, max_new_tokens)
        need = self.kv.pages_for(seq.max_kv_tokens())
        if need > self.kv.pool.num_pages:
            self._rejected.append((seq_id, (
                f"request needs {need} KV pages ({len(prompt_ids)} prompt + {max_new_tokens} new tokens "
                f"at page_size {self.kv.page_size}) but the whole pool has {self.kv.pool.num_pages} pages"
            )))
            return
        self._seqs[seq_id] = seq
        self._waiting[seq_id] = seq

    def finish(self, seq_id: int) -> None:
        """Finish, cancel or fail a sequence in any state: frees its pages. Idempotent."""
        self._rejected = [item for item in self._rejected if item[0] != seq_id]
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._waiting.pop(seq_id, None)
            self._running.pop(seq_id, None)
            self.kv.free(seq_id, seq.token_ids)
            seq.state = SeqState.DONE
        self._debug_check()

    # -- the step ------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        if self._inflight is not None:
            raise RuntimeError("schedule() called again before on_step_done() for the previous plan")
        step = _StepBuilder(self.max_step_tokens)
        self._schedule_decodes(step)
        self._schedule_prefills(step)
        if not step.preempted:  # a step that had to preempt has no room to admit anyone
            self._admit_waiting(step)
        chunks = tuple(step.prefills + step.decodes)
        self._inflight = chunks or None
        rejected, self._rejected = tuple(self._rejected), []
        self._debug_check()
        return StepPlan(chunks, tuple(step.copies), tuple(step.preempted), rejected)

    def _schedule_decodes(self, step: _StepBuilder) -> None:
        for seq in [s for s in self._running.values() if s.remaining == 1]:
            if step.budget == 0:
                return
            if seq.seq_id in self._running and self._grow(seq, 1, step):
                step.decodes.append(step.chunk(seq, 1))

    def _schedule_prefills(self, step: _StepBuilder) -> None:
        for seq in [s for s in self._running.values() if s.remaining > 1]:
            if step.budget == 0:
                return
            if seq.seq_id not in self._running:
                continue
            if self.kv.capacity_tokens(seq.seq_id) <= seq.num_computed and not self._grow(seq, 1, step):
                continue
            # A prefill shrinks its chunk to the pages there are rather than preempt for a full one.
            room = self.kv.capacity_tokens(seq.seq_id) - seq.num_computed
            granted = min(seq.remaining, self.max_prefill_chunk, step.budget, room)
            extended = self.kv.extend(seq.seq_id, seq.num_computed + granted)
            assert extended, f"seq {seq.seq_id}: {granted} tokens fit but extend failed"
            step.prefills.append(step.chunk(seq, granted))

    def _admit_waiting(self, step: _StepBuilder) -> None:
        while self._waiting and step.budget > 0 and len(self._running) < self.max_running:
            seq = next(iter(self._waiting.values()))
            admission = self.kv.admit(
                seq.seq_id, seq.token_ids, seq.salt,
                token_budget=min(step.budget, self.max_prefill_chunk), reserve_pages=len(self._running),
            )
            if admission is None:
                return  # FCFS: nobody overtakes the head of the queue
            del self._waiting[seq.seq_id]
            self._running[seq.seq_id] = seq
            seq.state = SeqState.RUNNING
            seq.num_computed = admission.num_cached_tokens
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = admission.num_cached_tokens
            if admission.copy is not None:
                step.copies.append(admission.copy)
            step.prefills.append(step.chunk(seq, admission.num_tokens))

    def on_step_done(self, sampled: Mapping[int, int]) -> None:
        """Commit the computed KV, append the sampled tokens, unpin copy sources.

        Sequences finished since schedule() are skipped; one that reaches max_new_tokens releases
        its pages here (state DONE) and is forgotten at finish().
        """
        chunks, self._inflight = self._inflight or (), None
        live = [chunk for chunk in chunks if chunk.seq_id in self._running]
        missing = [c.seq_id for c in live if c.samples and c.seq_id not in sampled]
        if missing:
            self._inflight = chunks or None
            raise ValueError(f"on_step_done: no sampled token for sequences {missing}")
        for chunk in live:
            seq = self._running[chunk.seq_id]
            seq.num_computed += chunk.num_tokens
            if chunk.samples:
                seq.token_ids.append(int(sampled[chunk.seq_id]))
            self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed)
            if seq.reached_max_tokens:
                del self._running[seq.seq_id]
                self.kv.free(seq.seq_id, seq.token_ids)
                seq.state = SeqState.DONE
        self.kv.release_pins()
        self._debug_check()

    # -- queries -------------------------------------------------------------------------------

    def page_table(self, seq_id: int) -> tuple[int, ...]:
        return self.kv.page_table(seq_id)

    def num_cached_tokens(self, seq_id: int) -> int:
        """Prompt tokens served from the prefix cache at first admission (0 while never admitted)."""
        return self.sequence(seq_id).num_cached_tokens or 0

    def sequence(self, seq_id: int) -> Sequence:
        """Read-only view for the engine (token ids, state); mutate only through this class."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id} (finish() forgets a sequence)") from None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_inflight(self) -> bool:
        return self._inflight is not None

    def stats(self) -> PoolStats:
        return dataclasses.replace(self.kv.stats(), preemptions_total=self.preemptions_total)

    # -- internals -----------------------------------------------------------------------------

    def _grow(self, seq: Sequence, num_tokens: int, step: _StepBuilder) -> bool:
        """Pages for num_tokens more tokens of seq, preempting newer unscheduled sequences if needed."""
        while not self.kv.extend(seq.seq_id, seq.num_computed + num_tokens):
            victim = next((s for s in reversed(self._running.values()) if s.seq_id not in step.scheduled), None)
            if victim is None:
                return False
            self._preempt(victim, step.preempted)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, preempted: list[int]) -> None:
        del self._running[seq.seq_id]
        self.kv.free(seq.seq_id, seq.token_ids)
        seq.state = SeqState.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self._waiting[seq.seq_id] = seq
        self._waiting.move_to_end(seq.seq_id, last=False)
        preempted.append(seq.seq_id)
        self.preemptions_total += 1

    def _debug_check(self) -> None:
        if self.debug_checks:
            self.check_integrity()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        both = self._waiting.keys() & self._running.keys()
        assert not both, f"sequences {sorted(both)} are both waiting and running"
        assert len(self._running) <= self.max_running, f"{len(self._running)} running > max_running"
        for seq_id, seq in self._waiting.items():
            assert seq.state is SeqState.WAITING, f"seq {seq_id} waiting in state {seq.state}"
            assert not self.kv.has(seq_id), f"waiting seq {seq_id} still holds pages"
        for seq_id, seq in self._running.items():
            assert seq.state is SeqState.RUNNING, f"seq {seq_id} running in state {seq.state}"
            assert self.kv.has(seq_id), f"running seq {seq_id} holds no pages"
            assert 0 < seq.remaining, f"running seq {seq_id} has nothing left to compute"
        holders = self.kv.num_sequences
        assert holders == len(self._running), f"{holders} sequences hold pages, {len(self._running)} running"
        if not self._running and self._inflight is None:
            active = self.kv.pool.num_active
            assert active == 0, f"nothing running or in flight but {active} pages active (leak)"


@dataclass
class _StepBuilder:
    budget: int
    scheduled: set[int] = field(default_factory=set)
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    copies: list[PageCopy] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)

    def chunk(self, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        self.scheduled.add(seq.seq_id)
        self.budget -= num_tokens
        end = seq.num_computed + num_tokens
        return ScheduledChunk(seq.seq_id, seq.num_computed, num_tokens, samples=end == seq.num_tokens)
