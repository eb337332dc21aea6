"""kvshare.core: pure-Python KV-cache bookkeeping (page pool, prefix cache, eviction, scheduler).

No torch, no numpy: page accounting and scheduling are plain Python tested on the CPU with exact
page ids. See docs/develop/architecture.md for the contract and docs/develop/core.md for the ownership picture.
"""

from kvshare.core.eviction import (
    POLICY_NAMES,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    SecondChancePolicy,
    make_policy,
)
from kvshare.core.kv_cache_manager import DEFAULT_PAGE_SIZE, Admission, KVCacheManager
from kvshare.core.page_pool import PagePool, PoolExhausted
from kvshare.core.prefix_cache import CachedPage, PrefixCache, PrefixMatch
from kvshare.core.scheduler import Scheduler
from kvshare.core.sequence import Sequence, SeqState
from kvshare.core.types import PageCopy, PoolStats, ScheduledChunk, StepPlan

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "POLICY_NAMES",
    "Admission",
    "CachedPage",
    "EvictionPolicy",
    "FIFOPolicy",
    "KVCacheManager",
    "LFUPolicy",
    "LRUPolicy",
    "PageCopy",
    "PagePool",
    "PoolExhausted",
    "PoolStats",
    "PrefixCache",
    "PrefixMatch",
    "ScheduledChunk",
    "Scheduler",
    "SecondChancePolicy",
    "SeqState",
    "Sequence",
    "StepPlan",
    "make_policy",
]
