"""Keeps Python's cyclic garbage collector off the engine's hot path.

After start-up the process holds millions of long-lived objects (weights' tensors, modules, the
tokenizer, the page pool's nodes). Each full collection walks all of them: on the CPU machine that
was ~0.9 ms per decode step at batch 64 (perf/engine/profile_engine_host.py), paid while the GPU
waits. Moving the start-up heap into the permanent generation (gc.freeze, as vLLM and SGLang do)
leaves only the objects created per request to collect. Call once, after the engine is built, from
the code that owns the process (the Triton model's initialize, a benchmark's main).
"""
from __future__ import annotations

import gc
import logging

log = logging.getLogger("kvshare.engine")


def freeze_startup_heap() -> int:
    """Collects once, then freezes every surviving object; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the garbage collector's reach", frozen)
    return frozen


def thaw() -> None:
    """Undo freeze_startup_heap (a benchmark that builds one engine after another): the next
    collection can reclaim the previous engine's cycles, and with them its device memory."""
    gc.unfreeze()
    gc.collect()
