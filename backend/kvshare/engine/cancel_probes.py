"""The clients' "did you hang up?" probes, asked off the engine thread.

In the Triton stub a probe (`is_cancelled`) is an IPC round trip to the server process, and it
reads the request's response factory: once the request's final response has gone out, that memory
is freed and a probe that still ran crashed the server (SIGSEGV, 2026-11-30). So a probe runs only
under the lock, and only while registered, and `drop` takes the same lock: after it returns, no
probe of that request runs or will run, and the caller may send the final.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("kvshare.engine")

Probe = Callable[[], bool]


class CancelProbes:
    def __init__(self) -> None:
        self._probes: dict[str, Probe] = {}
        self._lock = threading.Lock()

    def add(self, request_id: str, probe: Probe) -> None:
        with self._lock:
            self._probes[request_id] = probe

    def drop(self, request_id: str) -> None:
        """Waits for a probe of this request that is running now; none runs after it returns."""
        with self._lock:
            self._probes.pop(request_id, None)

    def fired(self) -> list[str]:
        """Asks every registered probe once; the ones that say cancelled are dropped and returned.
        Each call takes the lock on its own, so the engine thread's `drop` waits for one probe at
        most, not for the whole round."""
        with self._lock:
            request_ids = list(self._probes)
        fired = []
        for rid in request_ids:
            with self._lock:
                probe = self._probes.get(rid)
                if probe is None or not _asks(probe):
                    continue
                del self._probes[rid]
            fired.append(rid)
        return fired


def _asks(probe: Probe) -> bool:
    try:
        return bool(probe())
    except Exception:       # polled again next round
        log.exception("cancellation probe %r failed", probe)
        return False
