"""Sequence: one request's token ids and progress, owned (and mutated) by the Scheduler only."""

from __future__ import annotations

import enum
from dataclasses import dataclass


# A sampled token whose value is still on the device (overlap scheduling: Scheduler.advance put it
# there, Scheduler.resolve replaces it). Never a vocabulary id.
PENDING_TOKEN = -1


class SeqState(enum.Enum):
    WAITING = "waiting"  # no pages: new, or preempted (its tokens are recomputed on readmission)
    RUNNING = "running"  # holds pages: prefilling (remaining > 1) or decoding (remaining == 1)
    DONE = "done"  # produced max_new_tokens; pages already released; forgotten at finish()


@dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    salt: bytes
    max_new_tokens: int
    state: SeqState = SeqState.WAITING
    num_computed: int = 0  # leading tokens whose KV is in this sequence's pages
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    num_pending: int = 0  # trailing token_ids still PENDING_TOKEN (overlap scheduling)
    fork_of: int | None = None  # first admission shares this sequence's prompt pages (see Scheduler.add)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known(self) -> int:
        """Leading token ids whose values are known on the host."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def remaining(self) -> int:
        """Tokens whose KV is still to be computed; 1 means the next step is a decode."""
        return len(self.token_ids) - self.num_computed

    @property
    def reached_max_tokens(self) -> bool:
        return self.num_generated >= self.max_new_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def max_kv_tokens(self) -> int:
        """The most tokens it can ever hold in the cache: the last sampled token is never fed back."""
        return self.num_prompt_tokens + self.max_new_tokens - 1
