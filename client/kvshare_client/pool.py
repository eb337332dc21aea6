"""A bounded pool of tritonclient gRPC clients.

tritonclient's sync ``InferenceServerClient`` holds at most one active stream, so concurrent
streams need one client each. Clients (and their channels) are kept and reused: creating a channel
per request would pay a TCP + HTTP/2 handshake on every completion.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, Optional, TypeVar

T = TypeVar("T")


class ClientPool(Generic[T]):
    """Hands out at most ``max_size`` clients at a time; ``acquire`` blocks when all are busy."""

    def __init__(self, factory: Callable[[], T], max_size: int, close: Callable[[T], None]) -> None:
        if max_size < 1:
            raise ValueError("max_size must be >= 1")
        self._factory = factory
        self._close = close
        self._slots = threading.BoundedSemaphore(max_size)
        self._lock = threading.Lock()
        self._idle: list[T] = []
        self._all: list[T] = []
        self._closed = False
        self.max_size = max_size

    def acquire(self, timeout: Optional[float] = None) -> T:
        if not self._slots.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"all {self.max_size} stream slots stayed busy for {timeout}s")
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the client is closed")
                if self._idle:
                    return self._idle.pop()
            client = self._factory()
            with self._lock:
                self._all.append(client)
            return client
        except BaseException:
            self._slots.release()
            raise

    def release(self, client: T) -> None:
        with self._lock:
            if self._closed:
                self._close(client)
            else:
                self._idle.append(client)
        self._slots.release()

    @property
    def size(self) -> int:
        """Clients created so far (idle + busy)."""
        with self._lock:
            return len(self._all)

    def close(self) -> None:
        """Close idle clients now; busy ones are closed when released."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for client in idle:
            self._close(client)
