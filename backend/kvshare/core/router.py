"""Router: which of N engines (one page pool each, data parallel) takes a request.

    request (page keys of its prompt, salt)
        │  cache_aware: for every engine, the prompt tokens it holds =
        │      max(its prefix index, prompts routed to it and still in flight)
        ▼
    best = most tokens held (ties: the less loaded) ──► too loaded?  ──► least loaded ("balance")
        │ holds less than min_match_tokens ──► least loaded ("least_loaded")
        ▼
    best ("affinity")                         round_robin: engine = turn % N, nothing looked up

The prefix index is each engine's own (KVCacheManager.probe_cached_tokens: a read-only probe of its
prefix cache, safe from another thread, see PrefixCache.probe); nothing is recomputed or copied.
The page keys hash the cache_salt into every key, so requests of different salts never attract
each other. Prompts routed but not yet prefilled are not in any index yet: without the in-flight
record a burst of one prefix would spread over every engine before the first prefill registers its
pages (SGLang's cache-aware router inserts a request into its tree at routing time for the same
reason).

Imbalance is bounded as SGLang's cache-aware router bounds it: the best engine is skipped when its
load exceeds both min_load + balance_abs and balance_ratio * min_load, so a chosen engine's load
before the request is at most max(min_load + balance_abs, balance_ratio * min_load). Load is the
number of engine requests routed and not yet released.

Thread-safe: route() runs on Triton's execute thread, release() on the engines' threads.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

POLICIES = ("cache_aware", "round_robin")
REASONS = ("affinity", "least_loaded", "balance", "round_robin")


class PrefixIndex(Protocol):
    def probe_cached_tokens(self, page_keys: Sequence[bytes], salt: bytes) -> int: ...


@dataclass(frozen=True)
class RouterSettings:
    policy: str = "cache_aware"
    balance_abs: int = 8            # in-flight requests the best engine may have beyond the least loaded ...
    balance_ratio: float = 1.5      # ... or this many times the least loaded's (whichever allows more)
    min_match_tokens: int = 1       # fewer cached tokens than this: no affinity (rounded up to a page)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(POLICIES)}, got '{self.policy}'")
        if self.balance_abs < 0:
            raise ValueError(f"routing_balance_abs must be >= 0, got {self.balance_abs}")
        if self.balance_ratio < 1.0:
            raise ValueError(f"routing_balance_ratio must be >= 1, got {self.balance_ratio}")
        if self.min_match_tokens < 1:
            raise ValueError(f"routing_min_match_tokens must be >= 1, got {self.min_match_tokens}")


@dataclass(frozen=True)
class RouteDecision:
    engine: int
    matched_tokens: int             # prompt tokens the chosen engine holds (0 under round_robin)
    reason: str                     # one of REASONS
    loads: tuple[int, ...]          # every engine's load before this request


@dataclass
class _InFlight:
    engine: int
    keys: tuple[bytes, ...]
    weight: int


class Router:
    def __init__(self, indexes: Sequence[PrefixIndex], page_size: int, settings: RouterSettings = RouterSettings(),
                 *, track_in_flight: bool = True) -> None:
        if not indexes:
            raise ValueError("a router needs at least one engine")
        self.settings = settings
        self.page_size = page_size
        self._indexes = tuple(indexes)
        self._track = track_in_flight
        self._loads = [0] * len(indexes)
        self._routed_keys = [Counter() for _ in indexes]   # page key -> in-flight prompts holding it
        self._in_flight: dict[str, _InFlight] = {}
        self._turn = 0
        self._lock = threading.Lock()
        self.decisions: Counter = Counter()                  # (engine, reason) -> requests

    @property
    def num_engines(self) -> int:
        return len(self._indexes)

    def loads(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._loads)

    def route(self, route_id: str, page_keys: Sequence[bytes], salt: bytes, weight: int = 1) -> RouteDecision:
        """Picks an engine for route_id (weight: its engine requests) and counts it there until release()."""
        with self._lock:
            if route_id in self._in_flight:
                raise ValueError(f"'{route_id}' is already routed")
            decision = self._decide(tuple(page_keys), salt)
            self._loads[decision.engine] += weight
            keys = tuple(page_keys) if self._track else ()
            self._routed_keys[decision.engine].update(keys)
            self._in_flight[route_id] = _InFlight(decision.engine, keys, weight)
            self.decisions[(decision.engine, decision.reason)] += 1
            return decision

    def reroute(self, route_id: str, engine: int) -> None:
        """route_id moves to engine (its first choice refused it: full)."""
        with self._lock:
            record = self._in_flight[route_id]
            self._loads[record.engine] -= record.weight
            self._routed_keys[record.engine].subtract(record.keys)
            self._drop_zeros(record.engine, record.keys)
            record.engine = engine
            self._loads[engine] += record.weight
            self._routed_keys[engine].update(record.keys)

    def release(self, route_id: str) -> None:
        """route_id's requests have all finished. Idempotent."""
        with self._lock:
            record = self._in_flight.pop(route_id, None)
            if record is None:
                return
            self._loads[record.engine] -= record.weight
            self._routed_keys[record.engine].subtract(record.keys)
            self._drop_zeros(record.engine, record.keys)

    def engine_of(self, route_id: str) -> int | None:
        with self._lock:
            record = self._in_flight.get(route_id)
            return None if record is None else record.engine

    # -- the decision (under the lock) ------------------------------------------------------------

    def _decide(self, keys: tuple[bytes, ...], salt: bytes) -> RouteDecision:
        loads = tuple(self._loads)
        n = len(loads)
        if self.settings.policy == "round_robin":
            engine = self._turn % n
            self._turn += 1
            return RouteDecision(engine, 0, "round_robin", loads)
        held = [self._held_tokens(e, keys, salt) for e in range(n)]
        best = max(range(n), key=lambda e: (held[e], -loads[e], -((e - self._turn) % n)))
        min_load = min(loads)
        need = -(-self.settings.min_match_tokens // self.page_size) * self.page_size
        if held[best] < need:
            return RouteDecision(self._least_loaded(loads), 0, "least_loaded", loads)
        if not self._within_balance(loads[best], min_load):
            engine = self._least_loaded(loads)
            return RouteDecision(engine, held[engine], "balance", loads)
        return RouteDecision(best, held[best], "affinity", loads)

    def _within_balance(self, load: int, min_load: int) -> bool:
        s = self.settings
        return load <= min_load + s.balance_abs or load <= s.balance_ratio * min_load

    def _least_loaded(self, loads: tuple[int, ...]) -> int:
        """Ties go to the next engine in turn, so an idle group fills evenly."""
        n = len(loads)
        engine = min(range(n), key=lambda e: (loads[e], (e - self._turn) % n))
        self._turn = engine + 1
        return engine

    def _held_tokens(self, engine: int, keys: tuple[bytes, ...], salt: bytes) -> int:
        cached = self._indexes[engine].probe_cached_tokens(keys, salt)
        if not self._track:
            return cached
        return max(cached, _chain_prefix(self._routed_keys[engine], keys) * self.page_size)

    def _drop_zeros(self, engine: int, keys: tuple[bytes, ...]) -> None:
        counter = self._routed_keys[engine]
        for key in keys:
            if counter.get(key, 1) <= 0:
                del counter[key]

    def check_integrity(self) -> None:
        with self._lock:
            want = [0] * len(self._loads)
            keys = [Counter() for _ in self._loads]
            for record in self._in_flight.values():
                want[record.engine] += record.weight
                keys[record.engine].update(record.keys)
            assert self._loads == want, f"loads {self._loads} != in-flight weights {want}"
            for e, counter in enumerate(self._routed_keys):
                assert +counter == keys[e], f"engine {e}: routed keys out of step with the in-flight requests"
                assert all(v > 0 for v in counter.values()), f"engine {e}: a key counted <= 0"


def _chain_prefix(counter: Counter, keys: tuple[bytes, ...]) -> int:
    """How many leading keys of one prompt's chain some in-flight prompt shares.

    Chain keys hash their parent's key, so an in-flight prompt holding keys[i] holds keys[:i]
    too: the held keys are a prefix of the chain, and a binary search finds its end.
    """
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if counter.get(keys[mid - 1], 0) > 0:
            lo = mid
        else:
            hi = mid - 1
    return lo
