"""Keeps a finished BLS response stream alive for a while, so that the GIL is held when it is freed.

In Triton 2.51's Python backend (24.10) a decoupled BLS call's response iterator keeps every
response it gave, and the stub's own map holds the iterator too. Once the last response is in,
the iterator asks the stub's stub-to-parent thread to drop that map entry, and that thread drops it
without the GIL. When the model's thread has already let the iterator go (its `for` loop ended),
the map's reference is the last: the iterator, its responses and their tensors are freed on that
thread, and each tensor's numpy array with them, without the GIL. That corrupts the stub's object
allocator and, later, crashes the stub (a soak reproduced it: a segfault in pymalloc on the stub's
BLS-response thread, in vllm_model's and in llm_bls's stub). Upstream takes the GIL in the tensor's
destructor since (python_backend #390, after 24.10).

A model that keeps its finished iterators for a few seconds lets the stub drop its entry first;
the model's own release then frees them, on a thread that holds the GIL. The entry is dropped as
soon as that thread reaches the message, milliseconds under load; HOLD_S leaves a wide margin.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

HOLD_S = 5.0


class FinishedStreams:
    """Finished BLS response iterators, each released HOLD_S after it finished, by a later keep()
    or clear() (on a model thread: they hold the GIL)."""

    def __init__(self, hold_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic):
        self._hold_s = hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._held: deque[tuple[float, object]] = deque()

    def keep(self, stream: object) -> None:
        now = self._clock()
        with self._lock:
            self._held.append((now + self._hold_s, stream))
            expired = []
            while self._held and self._held[0][0] <= now:
                expired.append(self._held.popleft())
        expired.clear()         # released here, outside the lock

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def clear(self) -> None:
        with self._lock:
            held, self._held = self._held, deque()
        held.clear()
