"""How many torch threads a CPU engine gets inside the server.

In-process the engine may take every core. Inside Triton the same cores also run the stub's
response pump and IPC, tritonserver's gRPC threads and, on a laptop, the client: torch's OpenMP
regions split work evenly and wait for the slowest thread, so one preempted thread stalls the
step. Measured on the 2-vCPU CI machine (seed-12x128 through the server, GGUF blocks): 2 threads
55.2 tok/s (ITL p50 154 ms), 1 thread 60.9-63.7 (114-120 ms). The default leaves one core to the
server; OMP_NUM_THREADS or KVSHARE_CPU_THREADS (a count, 0 = this default) decide otherwise.
"""
from __future__ import annotations

import os
from collections.abc import Mapping


def server_cpu_threads(env: Mapping[str, str], available: int) -> int | None:
    """Threads to give torch, or None to leave torch's own choice (OMP_NUM_THREADS set).

    ``available``: torch's default thread count here. Raises ValueError naming the variable."""
    raw = env.get("KVSHARE_CPU_THREADS", "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"KVSHARE_CPU_THREADS must be a whole number of threads, got '{raw}'") from None
        if n < 0:
            raise ValueError(f"KVSHARE_CPU_THREADS must be >= 0 (0: one core fewer than the machine's), got {n}")
        if n:
            return n
    elif env.get("OMP_NUM_THREADS"):
        return None
    return max(1, available - 1)


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
