"""A shadow 'model runner' for core tests: it executes StepPlans on a fake KV cache.

Every slot holds the fingerprint of the prefix whose last token was written there
(salt + all token ids up to that position), so any mistake in sharing, copy on write,
salt isolation or preemption shows up as a slot that reads the wrong prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvshare.core import KVCacheManager, Scheduler, StepPlan
from kvshare.core.host_tier import HostTier


def make_runner(num_pages: int = 16, page_size: int = 4, *, max_running: int = 8, max_step_tokens: int = 64,
                max_prefill_chunk: int = 64, policy: str = "lru", host_slots: int = 0, host_min_hits: int = 1,
                window: int = 0, **scheduler_kw) -> "ShadowRunner":
    """A ShadowRunner over a fresh pool (no watermark warnings) and a Scheduler with debug checks on;
    host_slots > 0 puts a HostTier of that many pages below the pool."""
    kv = KVCacheManager(num_pages, page_size, policy=policy, low_watermark=0.0,
                        host_tier=HostTier(host_slots) if host_slots else None, host_min_hits=host_min_hits,
                        window=window)
    scheduler = Scheduler(kv, max_running=max_running, max_step_tokens=max_step_tokens,
                          max_prefill_chunk=max_prefill_chunk, debug_checks=True, **scheduler_kw)
    return ShadowRunner(scheduler)


class ShadowRunner:
    def __init__(self, scheduler: Scheduler, vocab: int = 50) -> None:
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.page_size = scheduler.kv.page_size
        self.vocab = vocab
        self.slots: dict[int, bytes] = {}
        self.host: dict[int, list[bytes | None]] = {}   # host slot -> the page's slot contents
        self.tokens: dict[int, list[int]] = {}
        self.fingerprints: dict[int, list[bytes]] = {}
        self.salts: dict[int, bytes] = {}
        self.pending: dict[int, int] | None = None
        self.launched: list[dict[int, int]] = []   # overlap scheduling: advanced steps' samples, oldest first
        self.tokens_computed = 0

    # -- requests ------------------------------------------------------------------------------

    def add(self, seq_id: int, prompt: Sequence[int], *, salt: bytes | str = b"", max_new_tokens: int = 4) -> None:
        self.scheduler.add(seq_id, prompt, salt=salt, max_new_tokens=max_new_tokens)
        self.tokens[seq_id] = list(prompt)
        self.salts[seq_id] = salt.encode() if isinstance(salt, str) else salt
        self.fingerprints[seq_id] = []

    def fingerprint(self, seq_id: int, pos: int) -> bytes:
        prints = self.fingerprints[seq_id]
        tokens = self.tokens[seq_id]
        while len(prints) <= pos:
            parent = prints[-1] if prints else self.salts[seq_id]
            token = tokens[len(prints)].to_bytes(8, "little")
            prints.append(hashlib.blake2b(parent + b"|" + token, digest_size=12).digest())
        return prints[pos]

    # -- the step ------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        self.execute(plan)
        return plan

    def step(self) -> StepPlan:
        plan = self.schedule()
        self.complete()
        return plan

    def run_until_idle(self, max_steps: int = 10_000) -> int:
        for steps in range(max_steps):
            if not (self.scheduler.num_running or self.scheduler.num_waiting):
                return steps
            self.step()
        raise AssertionError(f"not idle after {max_steps} steps")

    def slot(self, seq_id: int, pos: int) -> int:
        table = self.scheduler.page_table(seq_id)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    def execute(self, plan: StepPlan) -> None:
        pool, size = self.kv.pool, self.page_size
        for page, host_slot in plan.spills:          # the order the runner keeps: spills, loads, copies
            self.host[host_slot] = [self.slots.get(page * size + offset) for offset in range(size)]
        for host_slot, page in plan.loads:
            # a request admitted later in the same step may already share the page: it reads it in
            # the forward, after this load, so a refcount above 1 is fine; a free page is not
            assert pool.refcount(page) >= 1, f"load destination {page} is not held by anyone"
            for offset, value in enumerate(self.host[host_slot]):
                self.slots[page * size + offset] = value  # type: ignore[assignment]
        for copy in plan.copies:
            assert pool.refcount(copy.src) >= 1, f"copy source {copy.src} is not pinned"
            assert pool.refcount(copy.dst) == 1, f"copy destination {copy.dst} is shared"
            assert 0 < copy.num_tokens <= size
            for offset in range(size):
                value = self.slots.get(copy.src * size + offset)
                self.slots[copy.dst * size + offset] = value  # type: ignore[assignment]
        seen: set[int] = set()
        for chunk in plan.chunks:
            assert chunk.seq_id not in seen, f"seq {chunk.seq_id} scheduled twice in one step"
            seen.add(chunk.seq_id)
            tokens = self.tokens[chunk.seq_id]
            end = chunk.start + chunk.num_tokens
            assert chunk.num_tokens >= 1 and end <= len(tokens), f"{chunk} past {len(tokens)} tokens"
            assert chunk.samples == (end == len(tokens)), f"{chunk}: samples flag wrong"
            table = self.scheduler.page_table(chunk.seq_id)
            assert len(table) * size >= end, f"{chunk}: page table {table} too short"
            window = self.kv.window     # a sliding window reads only its last `window` keys
            first = max(0, chunk.start - window + 1) if window else 0
            for pos in range(first, chunk.start):  # attention reads the cached context
                got = self.slots.get(self.slot(chunk.seq_id, pos))
                assert got == self.fingerprint(chunk.seq_id, pos), (
                    f"seq {chunk.seq_id} position {pos}: page {table[pos // size]} holds another prefix"
                )
            for pos in range(chunk.start, end):
                page = table[pos // size]
                assert pool.refcount(page) == 1, f"seq {chunk.seq_id} writes shared page {page}"
                self.slots[self.slot(chunk.seq_id, pos)] = self.fingerprint(chunk.seq_id, pos)
            self.tokens_computed += chunk.num_tokens
        self.pending = {c.seq_id: self.sample(c.seq_id, c.start + c.num_tokens - 1) for c in plan.chunks if c.samples}

    def sample(self, seq_id: int, pos: int) -> int:
        """Greedy decoding of a fake model: the next token is a function of the whole prefix."""
        return self.fingerprint(seq_id, pos)[0] % self.vocab

    def complete(self) -> None:
        sampled, self.pending = self.pending or {}, None
        self.scheduler.on_step_done(sampled)
        for seq_id, token in sampled.items():  # a sequence finished mid-step keeps a stale record
            self.tokens[seq_id].append(token)

    def finish(self, seq_id: int) -> None:
        self.scheduler.finish(seq_id)

    # -- overlap scheduling --------------------------------------------------------------------

    def launch(self) -> StepPlan:
        """schedule + execute + advance: the 'device' knows its samples at once (they extend the
        shadow's token lists, as the GPU's ids buffer would); the scheduler learns them in resolve."""
        plan = self.scheduler.schedule()
        self.execute(plan)
        sampled, self.pending = self.pending or {}, None
        for seq_id, token in sampled.items():
            self.tokens[seq_id].append(token)
        self.scheduler.advance()
        self.launched.append(sampled)
        return plan

    def resolve(self) -> None:
        self.scheduler.resolve(self.launched.pop(0))
