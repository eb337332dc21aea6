"""How many torch threads a CPU engine gets inside the server.

In-process the engine may take every core. Inside Triton the same cores also run the stub's
response pump and IPC, tritonserver's gRPC threads and, on a laptop, the client: torch's OpenMP
regions split work evenly and wait for the slowest thread, so one preempted thread stalls the
step. On two cores, leaving one to the server idles half the machine, and since the native decode
kernels (2026-12-07, 2-vCPU Xeon, three interleaved pairs through the server) decode steps on both
cores ran seed-12x128 at 215-224 tok/s against 169-174 on one (ITL p95 36-38 against 54-56 ms).
With more cores one left to the server costs little (an unmeasured default). OMP_NUM_THREADS or
KVSHARE_CPU_THREADS (a count, 0 = this default) decide otherwise.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from ..runtime.step_threads import StepThreads


def _count(env: Mapping[str, str], name: str, zero: str) -> int:
    """The variable's thread count, 0 when unset; raises ValueError naming it."""
    raw = env.get(name, "").strip()
    if not raw:
        return 0
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number of threads, got '{raw}'") from None
    if n < 0:
        raise ValueError(f"{name} must be >= 0 (0: {zero}), got {n}")
    return n


def server_cpu_threads(env: Mapping[str, str], available: int) -> int | None:
    """Threads to give torch's decode steps, or None to leave torch's own choice (OMP_NUM_THREADS set).

    ``available``: torch's default thread count here. Raises ValueError naming the variable."""
    n = _count(env, "KVSHARE_CPU_THREADS", "every core up to two, else one core fewer than the machine's")
    if n:
        return n
    if env.get("KVSHARE_CPU_THREADS", "").strip() == "" and env.get("OMP_NUM_THREADS"):
        return None
    return default_decode_threads(available)


def default_decode_threads(available: int) -> int:
    """Every core on a machine of one or two, one fewer than ``available`` above that."""
    return available if available <= 2 else available - 1


def server_step_threads(env: Mapping[str, str], available: int) -> StepThreads | None:
    """Threads for decode and for prompt steps; None leaves torch's own count for both
    (OMP_NUM_THREADS set and neither KVSHARE variable)."""
    prefill = _count(env, "KVSHARE_CPU_PREFILL_THREADS", "every core")
    decode = server_cpu_threads(env, available)
    if decode is None and not prefill:
        return None
    return StepThreads(decode=decode or available, prefill=prefill or available)


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
