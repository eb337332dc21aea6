"""Scheduler: continuous batching with chunked prefill and recompute preemption.

One engine step is

    plan = scheduler.schedule()                # which tokens to compute, which pages to copy
    runner.copy_pages(plan.copies); sampled = runner.forward(plan.chunks)
    scheduler.on_step_done(sampled)            # commit KV, append tokens, unpin copy sources

schedule() fills a budget of max_step_tokens in three passes, oldest sequence first:
  1. decodes of running sequences (1 token each);
  2. the next chunk (<= max_prefill_chunk) of running sequences that are still prefilling;
  3. admission of waiting sequences while len(running) < max_running, in the order of the
     admission policy: "fcfs" (default: arrival), or "cache_aware" (most prompt tokens already in
     the prefix cache first, ties by arrival; see _admission_order for the starvation bound).
A running sequence that needs a page when none is allocatable preempts the most recently
admitted running sequence not yet scheduled in this step (possibly itself): its pages are
freed (full pages stay cached, so recomputing is mostly prefix hits) and it goes to the FRONT
of the waiting queue. Admission keeps pages in reserve so that every running sequence can grow
reserve_tokens (default RESERVE_TOKENS, at most a page) past this step before anyone must be preempted; up to page 16 that
is one page per running sequence, at larger pages only the sequences near the end of their last
page count. Nothing is admitted in a step that preempted. Under either policy preempted sequences go first and the
head of the admission order blocks the rest when it does not fit (nobody jumps a blocked head).

Admission delay (admission_delay_steps = d, default 0 = off): admitting even one request turns a
cheap decode-only step into a mixed step whose decode rows pay the mixed path's attention whatever
the prefill carries (on the H200, shared-prefix: ~100 ms mixed vs ~28 ms decode-only). So while a
step has decodes and no running prefill, pass 3 is skipped for up to d consecutive steps and the
arrivals are admitted together, unless the waiting head is a preempted sequence (it already waited)
or a quarter of max_running is free (the batch is draining). A step with no room to admit anyone
does not count. The analogues are vLLM's --scheduler-delay-factor and SGLang's
--num-continuous-decode-steps.

Disk tier prefetch: each step first stages the disk pages of the first PREFETCH_WINDOW waiting
requests in host slots (KVCacheManager.prefetch). A request whose reads are in flight is not
admitted (it would recompute those pages) and does not block the others: they are admitted past it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence as SequenceOf
from dataclasses import dataclass, field

from kvshare.core.kv_cache_manager import KVCacheManager
from kvshare.core.sequence import PENDING_TOKEN, Sequence, SeqState
from kvshare.core.types import PageCopy, PoolStats, ScheduledChunk, StepPlan

ADMISSION_POLICIES: tuple[str, ...] = ("cache_aware", "fcfs")
# Admission rounds in which later arrivals may go ahead of a waiting request before it goes first.
# Chosen on perf/core/admission_policy.py --skips (shared-prefix, 256 in flight, max_running 64): from
# 24 up, steps are within 0.5% of the unbounded policy; below, steps climb (16: +6%) and preemptions
# appear; above, the hit rate gains a little (64: 81.8% vs 78.1% at 5,120 pages) while the longest
# wait grows more (+17% at 5,120 pages, +33% at 12,800). At 64 in flight the bound never binds.
DEFAULT_MAX_ADMISSION_SKIPS = 32
# Tokens of growth past this step that admission keeps pages for, for every running sequence. One page
# per running sequence at page 16 (the rule this generalises); counting pages at 128-token pages, it held
# a third of a pool of 128 + 128-token requests back (fixed-256 in 640 pages: 219 of 256 admitted).
RESERVE_TOKENS = 16
# Waiting requests probed per step; the rest wait in arrival order (SGLang: FCFS past 128).
DEFAULT_ADMISSION_PROBE_LIMIT = 128
# Queued requests at the head whose disk-tier pages are staged in host slots while they wait; reads per
# step are capped at half the host slots so that staging one prompt cannot flush the next one's pages.
PREFETCH_WINDOW = 4


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_running: int,
        max_step_tokens: int,
        max_prefill_chunk: int,
        debug_checks: bool = False,
        admission: str = "fcfs",
        max_admission_skips: int = DEFAULT_MAX_ADMISSION_SKIPS,
        admission_probe_limit: int = DEFAULT_ADMISSION_PROBE_LIMIT,
        admission_delay_steps: int = 0,
        reserve_tokens: int = RESERVE_TOKENS,
    ) -> None:
        for name, value in (("max_running", max_running), ("max_step_tokens", max_step_tokens),
                            ("max_prefill_chunk", max_prefill_chunk),
                            ("admission_probe_limit", admission_probe_limit), ("reserve_tokens", reserve_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name, value in (("max_admission_skips", max_admission_skips),
                            ("admission_delay_steps", admission_delay_steps)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        policy = admission.strip().lower().replace("-", "_")
        if policy not in ADMISSION_POLICIES:
            raise ValueError(f"unknown admission policy {admission!r}; choose one of {', '.join(ADMISSION_POLICIES)}")
        self.kv = kv
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.max_prefill_chunk = max_prefill_chunk
        # growth past a step kept in reserve for each running sequence; >= page_size: a page each
        self.reserve_tokens = min(reserve_tokens, kv.page_size)
        self.debug_checks = debug_checks
        self.admission = policy
        self.max_admission_skips = max_admission_skips
        self.admission_probe_limit = admission_probe_limit
        self.admission_delay_steps = admission_delay_steps
        # Consecutive steps whose admission pass was skipped by the admission delay (<= d).
        self._admission_deferrals = 0
        self.preemptions_total = 0
        self._seqs: dict[int, Sequence] = {}
        self._waiting: OrderedDict[int, Sequence] = OrderedDict()
        self._running: OrderedDict[int, Sequence] = OrderedDict()  # in admission order
        self._rejected: list[tuple[int, str]] = []
        self._inflight: tuple[ScheduledChunk, ...] | None = None
        # Overlap scheduling: steps advanced (on the GPU) whose sampled tokens are not resolved yet,
        # oldest first, and sequences that reached max_new_tokens there (pages kept until resolved).
        self._unresolved: deque[_AdvancedStep] = deque()
        self._done_pending: dict[int, Sequence] = {}
        # cache_aware only: one record per never-admitted waiting sequence (preempted ones need none)
        self._fresh: dict[int, _FreshInfo] = {}
        # cache_aware only: page keys that running prefills are computing now (key -> how many)
        self._prefill_keys: dict[int, tuple[bytes, ...]] = {}
        self._computing: dict[bytes, int] = {}
        self._arrivals = itertools.count()
        self._fetching: frozenset[int] = frozenset()   # waiting sequences whose disk pages are being read

    # -- requests ------------------------------------------------------------------------------

    def add(
        self, seq_id: int, prompt_ids: SequenceOf[int], *, salt: bytes | str = b"", max_new_tokens: int,
        fork_of: int | None = None,
    ) -> None:
        """Queue a request. One that can never fit in the whole pool is reported in the next plan.

        salt: the request's cache_salt (str is UTF-8 encoded); prefixes are shared only within a salt.
        fork_of: a sequence with the same prompt (num_return_sequences > 1): this one waits until the
        parent has computed all but the prompt's last token, then takes those pages from it
        (KVCacheManager.fork) and computes only the last token. If the parent is gone by then, it is
        admitted as usual.
        """
        if seq_id in self._seqs or any(seq_id == rejected for rejected, _ in self._rejected):
            raise ValueError(f"sequence {seq_id} is already known to the scheduler")
        if not prompt_ids:
            raise ValueError(f"sequence {seq_id}: empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"sequence {seq_id}: max_new_tokens must be >= 1, got {max_new_tokens}")
        salt_bytes = salt.encode() if isinstance(salt, str) else bytes(salt)
        seq = Sequence(seq_id, [int(t) for t in prompt_ids], len(prompt_ids), salt_bytes, max_new_tokens,
                       fork_of=fork_of)
        # With a sliding window a sequence holds at most its window's pages at once (the rest go back
        # as it runs), and a prefill shrinks its chunk to the pages there are: that bound must fit.
        need = self.kv.max_pages_held(seq.max_kv_tokens())
        if need > self.kv.pool.num_pages:
            held = f" at once (window {self.kv.window})" if self.kv.window else ""
            self._rejected.append((seq_id, (
                f"request needs {need} KV pages{held} ({len(prompt_ids)} prompt + {max_new_tokens} new tokens "
                f"at page_size {self.kv.page_size}) but the whole pool has {self.kv.pool.num_pages} pages"
            )))
            return
        self._seqs[seq_id] = seq
        self._waiting[seq_id] = seq
        if self.admission == "cache_aware":
            self._fresh[seq_id] = _FreshInfo(next(self._arrivals))

    def finish(self, seq_id: int) -> None:
        """Finish, cancel or fail a sequence in any state: frees its pages. Idempotent."""
        self._rejected = [item for item in self._rejected if item[0] != seq_id]
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._waiting.pop(seq_id, None)
            self._running.pop(seq_id, None)
            self._done_pending.pop(seq_id, None)
            self._fresh.pop(seq_id, None)
            self._stop_computing(seq_id)
            self.kv.free(seq_id, seq.token_ids)
            seq.state = SeqState.DONE
        self._debug_check()

    # -- the step ------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        if self._inflight is not None:
            raise RuntimeError("schedule() called again before on_step_done() for the previous plan")
        if not self._waiting:
            self._admission_deferrals = 0  # the delay counts from the first step anyone waits in
        step = _StepBuilder(self.max_step_tokens)
        self._fetching = self._prefetch_waiting()
        self._schedule_decodes(step)
        self._schedule_prefills(step)
        if not step.preempted and self._room_to_admit(step):  # a step that had to preempt has no room
            if self._defer_admission(step):
                self._admission_deferrals += 1
            else:
                self._admission_deferrals = 0
                self._admit_waiting(step)
        chunks = tuple(step.prefills + step.decodes)
        self._inflight = chunks or None
        rejected, self._rejected = tuple(self._rejected), []
        self._debug_check()
        spills, loads = self.kv.take_transfers()
        writes, reads, deletes = self.kv.take_disk_work()
        return StepPlan(chunks, tuple(step.copies), tuple(step.preempted), rejected, spills, loads,
                        writes, reads, deletes)

    def _prefetch_waiting(self) -> frozenset[int]:
        """Stage the queue head's disk pages in host slots; the ids of those still being read (their
        admission waits for the reads: it would recompute those pages otherwise)."""
        if self.kv.disk is None or not self._waiting:
            return frozenset()
        budget = max(1, self.kv.host.num_slots // 2)
        fetching = []
        for seq in itertools.islice(self._waiting.values(), PREFETCH_WINDOW):
            if seq.num_pending:
                continue
            info = self._fresh.get(seq.seq_id)      # cache_aware has hashed the prompt already
            pending, issued = self.kv.prefetch(seq.token_ids, seq.salt, max_reads=budget,
                                               keys=info.page_keys if info is not None else None)
            budget -= issued
            if pending:
                fetching.append(seq.seq_id)
        return frozenset(fetching)

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

    def _defer_admission(self, step: _StepBuilder) -> bool:
        """The admission delay: hold arrivals back so that several share one mixed step. O(1).

        Only a decode-only step is worth keeping so (one with a running prefill is mixed anyway),
        and never for more than admission_delay_steps in a row, nor when a quarter of the slots are
        free (the batch is draining: waiting would leave it half empty), nor for a preempted sequence
        (it waited once already; preempted sequences head the queue, so the head alone tells).
        """
        free_slots = self.max_running - len(self._running)
        return (
            self._admission_deferrals < self.admission_delay_steps
            and bool(step.decodes)
            and not step.prefills
            and free_slots < max(1, self.max_running // 4)
            and next(iter(self._waiting.values())).num_preemptions == 0
        )

    def _admit_waiting(self, step: _StepBuilder) -> None:
        if self.admission == "fcfs":
            self._admit_fcfs(step)
            return
        if not self._room_to_admit(step):
            return
        ordered, window = self._admission_order()
        for seq in ordered:
            if not self._room_to_admit(step):
                break
            if self._deferred(seq) or seq.seq_id in self._fetching:
                continue
            if not self._admit(seq, step):
                break  # nobody overtakes a head that does not fit (the starvation bound relies on it)
        self._count_skips(window, step.admitted_arrival)

    def _room_to_admit(self, step: _StepBuilder) -> bool:
        return bool(self._waiting) and step.budget > 0 and len(self._running) < self.max_running

    def _admit_fcfs(self, step: _StepBuilder) -> None:
        while self._room_to_admit(step):
            # a request whose pages are coming back from disk lets the next go first (as vLLM does
            # with one waiting for remote KV): a wait of milliseconds should not stall the batch
            head = next((s for s in self._waiting.values() if s.seq_id not in self._fetching), None)
            if head is None or not self._admit(head, step):
                return  # nobody overtakes the head of the queue

    def _admit(self, seq: Sequence, step: _StepBuilder) -> bool:
        if seq.num_pending:
            return False  # preempted with a token still on the device: resolve() runs before the next step
        if seq.seq_id in self._fetching:
            return False  # its prefix is coming back from disk (a few ms): wait rather than recompute it
        fork = self._fork_source(seq)
        if fork == -1:
            return False  # the parent has not computed the shared prompt yet: wait for it (it runs)
        if step.reserve is None:
            step.reserve = self._reserve_pages(step)
        if fork is not None:
            admission = self.kv.fork(seq.seq_id, fork, seq.num_prompt_tokens - 1, reserve_pages=step.reserve)
        else:
            admission = self.kv.admit(
                seq.seq_id, seq.token_ids, seq.salt,
                token_budget=min(step.budget, self.max_prefill_chunk), reserve_pages=step.reserve,
            )
        if admission is None:
            return False
        step.reserve += self._growth(seq.seq_id, admission.num_cached_tokens + admission.num_tokens)
        seq.fork_of = None  # readmission after a preemption goes through the prefix cache
        del self._waiting[seq.seq_id]
        info = self._fresh.pop(seq.seq_id, None)
        if info is not None:
            step.admitted_arrival = max(step.admitted_arrival, info.arrival)
            computing = info.page_keys[admission.num_cached_tokens // self.kv.page_size :] if info.page_keys else ()
            if computing:
                self._prefill_keys[seq.seq_id] = computing
                for key in computing:
                    self._computing[key] = self._computing.get(key, 0) + 1
        self._running[seq.seq_id] = seq
        seq.state = SeqState.RUNNING
        seq.num_computed = admission.num_cached_tokens
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = admission.num_cached_tokens
        if admission.copy is not None:
            step.copies.append(admission.copy)
        step.prefills.append(step.chunk(seq, admission.num_tokens))
        return True

    def _reserve_pages(self, step: _StepBuilder) -> int:
        """Pages that let every running sequence grow reserve_tokens past this step. O(1) when that
        is a whole page (page 16 and below by default): one page each, whatever a sequence holds."""
        if self.reserve_tokens == self.kv.page_size:
            return len(self._running)
        return sum(self._growth(s.seq_id, s.num_computed + step.scheduled.get(s.seq_id, 0))
                   for s in self._running.values())

    def _growth(self, seq_id: int, num_tokens: int) -> int:
        return self.kv.growth_pages(seq_id, num_tokens, self.reserve_tokens)

    def _fork_source(self, seq: Sequence) -> int | None:
        """The parent to fork from now, -1 to wait for it (it is running its prefill, so it will get
        there), None to admit as usual (no parent, or one that is not running: never wait on it)."""
        parent = self._seqs.get(seq.fork_of) if seq.fork_of is not None else None
        if parent is None or parent.state is not SeqState.RUNNING:
            return None
        if parent.token_ids[:seq.num_prompt_tokens] != seq.token_ids:
            return None
        # The whole prompt committed means the parent's prefill step has run: its pages hold the KV.
        # (At admission a parent's committed count already covers its cached prefix, but its
        # copy-on-write page is only filled by that step's copies, which run alongside the
        # child's: forking then copied an empty page, and the child registered it as a prefix.)
        if self.kv.num_committed(parent.seq_id) >= seq.num_prompt_tokens:
            # a windowed parent may have released pages the child still reads: the prefix cache then
            # serves them (they were registered before their release) or the child computes them
            return parent.seq_id if self.kv.can_fork(parent.seq_id, seq.num_prompt_tokens - 1) else None
        return -1

    def _admission_order(self) -> tuple[list[Sequence], list[Sequence]]:
        """(candidates in admission order, the probe window): cache_aware's ordering.

        Preempted sequences sit at the front of the queue and keep absolute priority: they already
        waited once, and their pages were taken for someone else. Next come the probe window, the
        first admission_probe_limit never-admitted sequences by arrival, sorted by
          1. starving first (passed over more than max_admission_skips rounds), oldest first: this
             bounds how long a request whose prefix is cold can be overtaken by a stream of hits;
          2. then most prompt tokens already cached, ties by arrival.
        The window keeps schedule() O(window * log(prompt pages)) however long the queue gets
        (SGLang likewise falls back to FCFS past 128 waiting requests); beyond it, arrival order.
        """
        head: list[Sequence] = []
        window: list[Sequence] = []
        queue = iter(self._waiting.values())  # [preempted..., never admitted in arrival order...]
        for seq in queue:
            if seq.seq_id not in self._fresh:
                head.append(seq)
                continue
            window.append(seq)
            if len(window) == self.admission_probe_limit:
                break
        # Snapshot as many as could still be admitted: admitting mutates the queue.
        rest = list(itertools.islice(queue, self.max_running - len(self._running)))
        if len(window) > 1:
            window.sort(key=self._window_key)
        return head + window + rest, window

    def _window_key(self, seq: Sequence) -> tuple[int, int, int]:
        info = self._fresh[seq.seq_id]
        if info.skips > self.max_admission_skips:
            return (0, 0, info.arrival)
        if info.page_keys is None:
            # Hashed once, on first probe rather than at add(): a request cancelled deep in a long
            # queue never costs anything. The keys cannot change while it waits (no tokens yet).
            info.page_keys = self.kv.page_keys(seq.token_ids, seq.salt)
        info.cached_pages = self.kv.probe_cached_tokens(info.page_keys, seq.salt) // self.kv.page_size
        return (1, -info.cached_pages, info.arrival)

    def _deferred(self, seq: Sequence) -> bool:
        """Wait a step when a running prefill is computing this prompt's next pages right now.

        Admitted now, it would compute the same KV a second time into private pages (shared
        prefixes arrive in chunks, and group members of a cold prefix queue up together); next
        step those pages are cached hits. Starving sequences are never deferred.
        """
        info = self._fresh.get(seq.seq_id)
        if info is None or info.page_keys is None or info.skips > self.max_admission_skips:
            return False
        keys = info.page_keys
        return info.cached_pages < len(keys) and keys[info.cached_pages] in self._computing

    def _stop_computing(self, seq_id: int) -> None:
        for key in self._prefill_keys.pop(seq_id, ()):
            count = self._computing.pop(key)
            if count > 1:
                self._computing[key] = count - 1

    def _count_skips(self, window: list[Sequence], admitted_arrival: int) -> None:
        """A window member still waiting was passed over if anyone who arrived after it got in."""
        for seq in window:
            info = self._fresh.get(seq.seq_id)
            if info is not None and info.arrival < admitted_arrival:
                info.skips += 1

    def on_step_done(self, sampled: Mapping[int, int]) -> None:
        """Commit the computed KV, append the sampled tokens, unpin copy sources.

        Sequences finished since schedule() are skipped; one that reaches max_new_tokens releases
        its pages here (state DONE) and is forgotten at finish().
        """
        if self._unresolved:
            raise RuntimeError("on_step_done() with advanced steps unresolved: resolve() them first")
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
            if seq.num_computed >= seq.num_prompt_tokens:
                self._stop_computing(seq.seq_id)  # its prompt pages are registered (or never will be)
            if seq.reached_max_tokens:
                del self._running[seq.seq_id]
                self.kv.free(seq.seq_id, seq.token_ids)
                seq.state = SeqState.DONE
        self.kv.release_pins()
        self._debug_check()

    def advance(self) -> None:
        """Overlap scheduling: the plan from schedule() is running on the device; account for it now.

        Like on_step_done, but before the sampled tokens are known: each sampling chunk appends a
        PENDING_TOKEN (so the next schedule() can already plan that sequence's decode at the right
        position). Only pages of known tokens are committed to the prefix cache: prefill chunks
        here, decodes whose input was still pending in resolve().
        A sequence that reaches max_new_tokens leaves the running set here but keeps its pages
        until resolve() learns its last tokens. Copy sources are unpinned at once: later steps
        run after this one on the same stream.
        """
        chunks, self._inflight = self._inflight or (), None
        sampling: list[tuple[int, int]] = []
        for chunk in chunks:
            seq = self._running.get(chunk.seq_id)
            if seq is None:
                continue
            seq.num_computed += chunk.num_tokens
            if chunk.samples:
                sampling.append((seq.seq_id, len(seq.token_ids)))
                seq.token_ids.append(PENDING_TOKEN)
                seq.num_pending += 1
            if seq.num_computed <= seq.num_known:
                # prefill chunks: their tokens are known, so their pages can be shared from the very
                # next schedule(), as with on_step_done (decodes wait for their input in resolve())
                self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed)
                if seq.num_computed >= seq.num_prompt_tokens:
                    self._stop_computing(seq.seq_id)
            elif self.kv.window:
                # a decode commits in resolve(); what fell out of its window goes back now (in stream
                # order, after this step's reads of it)
                self.kv.release_window(seq.seq_id, seq.num_computed)
            if seq.reached_max_tokens:
                del self._running[seq.seq_id]
                self._stop_computing(seq.seq_id)
                seq.state = SeqState.DONE
                self._done_pending[seq.seq_id] = seq
        self._unresolved.append(_AdvancedStep(tuple(c.seq_id for c in chunks), tuple(sampling)))
        self.kv.release_pins()
        self._debug_check()

    def resolve(self, sampled: Mapping[int, int]) -> None:
        """The oldest advanced step's tokens arrived: fill them in, commit, release finished sequences.

        Sequences finished (or cancelled) since advance() are skipped, as in on_step_done.
        """
        if not self._unresolved:
            raise RuntimeError("resolve() without an advanced step")
        step = self._unresolved[0]
        missing = [s for s, _ in step.sampling if s in self._seqs and s not in sampled]
        if missing:
            raise ValueError(f"resolve: no sampled token for sequences {missing}")
        self._unresolved.popleft()
        for seq_id, index in step.sampling:
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue
            seq.token_ids[index] = int(sampled[seq_id])
            seq.num_pending -= 1
        for seq_id in step.seq_ids:
            seq = self._seqs.get(seq_id)
            if seq is None or not self.kv.has(seq_id):
                continue                    # finished, or preempted since (its pages are gone)
            if seq.num_computed <= seq.num_known:
                # every token whose KV is (being) computed is known: register the full pages
                self.kv.commit(seq_id, seq.token_ids, seq.num_computed)
            if seq.num_computed >= seq.num_prompt_tokens:
                self._stop_computing(seq_id)
            if seq_id in self._done_pending and seq.num_pending == 0:
                del self._done_pending[seq_id]
                self.kv.free(seq_id, seq.token_ids)
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

    @property
    def num_unresolved(self) -> int:
        """Advanced steps whose tokens resolve() has not seen yet (overlap scheduling)."""
        return len(self._unresolved)

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
        self._stop_computing(seq.seq_id)
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
        assert 0 <= self._admission_deferrals <= self.admission_delay_steps, (
            f"admission deferred {self._admission_deferrals} steps in a row > {self.admission_delay_steps}")
        for seq_id, seq in self._waiting.items():
            assert seq.state is SeqState.WAITING, f"seq {seq_id} waiting in state {seq.state}"
            assert not self.kv.has(seq_id), f"waiting seq {seq_id} still holds pages"
        for seq_id, seq in self._running.items():
            assert seq.state is SeqState.RUNNING, f"seq {seq_id} running in state {seq.state}"
            assert self.kv.has(seq_id), f"running seq {seq_id} holds no pages"
            assert 0 < seq.remaining, f"running seq {seq_id} has nothing left to compute"
        if self.admission == "cache_aware":
            never_admitted = {s for s, seq in self._waiting.items() if seq.num_preemptions == 0}
            assert self._fresh.keys() == never_admitted, (
                f"admission records {sorted(self._fresh)} != never-admitted waiting {sorted(never_admitted)}"
            )
            for seq_id, info in self._fresh.items():
                assert info.skips <= self.max_admission_skips + 1, f"seq {seq_id} passed over {info.skips} times"
            computing: dict[bytes, int] = {}
            for seq_id, keys in self._prefill_keys.items():
                assert seq_id in self._running, f"seq {seq_id} is not running but listed as computing"
                for key in keys:
                    computing[key] = computing.get(key, 0) + 1
            assert computing == self._computing, "the computing-keys index is out of date"
        else:
            assert not (self._fresh or self._prefill_keys or self._computing), "fcfs keeps no admission records"
        for seq_id, seq in self._done_pending.items():
            assert seq.state is SeqState.DONE and seq.num_pending > 0, f"done seq {seq_id} kept without pending tokens"
        for seq in self._seqs.values():
            pending = [i for i, t in enumerate(seq.token_ids) if t == PENDING_TOKEN]
            assert pending == list(range(seq.num_known, len(seq.token_ids))), (
                f"seq {seq.seq_id}: pending tokens at {pending}, expected the last {seq.num_pending}")
        holders = self.kv.num_sequences
        assert holders == len(self._running) + len(self._done_pending), (
            f"{holders} sequences hold pages, {len(self._running)} running + {len(self._done_pending)} done-pending")
        if not self._running and self._inflight is None and not self._unresolved:
            active = self.kv.pool.num_active
            assert active == 0, f"nothing running or in flight but {active} pages active (leak)"


@dataclass(frozen=True)
class _AdvancedStep:
    seq_ids: tuple[int, ...]                # every chunk's sequence: commit after resolution
    sampling: tuple[tuple[int, int], ...]   # (seq id, index of its PENDING_TOKEN)


@dataclass
class _FreshInfo:
    arrival: int  # add() order: ties and starving sequences go oldest first
    skips: int = 0  # admission rounds in which a later arrival was admitted instead
    page_keys: tuple[bytes, ...] | None = None  # the prompt's chained page keys, computed on first probe
    cached_pages: int = 0  # of page_keys, cached at this step's probe


@dataclass
class _StepBuilder:
    budget: int
    scheduled: dict[int, int] = field(default_factory=dict)  # seq id -> tokens it computes in this step
    reserve: int | None = None  # admission's reserve pages (_reserve_pages), once admission starts
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    copies: list[PageCopy] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    admitted_arrival: int = -1  # latest arrival number admitted in this step (cache_aware)

    def chunk(self, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        self.scheduled[seq.seq_id] = num_tokens
        self.budget -= num_tokens
        end = seq.num_computed + num_tokens
        return ScheduledChunk(seq.seq_id, seq.num_computed, num_tokens, samples=end == seq.num_tokens)
