"""Data parallelism: N engines (one per device, each with its own page pool, scheduler and engine
thread) behind one router (kvshare.core.router), inside one llm_engine model instance.

    execute() ──► EngineGroup.try_submit_all(route id, members)
                     │ Router.route(page keys of the first member's prompt, salt)
                     ▼
       EngineLoop 0 (engine 0, pool 0, cuda:0)   EngineLoop 1 (engine 1, pool 1, cuda:1)  ...
                     │ outputs ──► the caller's sinks; a request's last final output releases its route

One Triton request (all its batch rows and sequences) goes to one engine: forks must share their
parent's pool, and all-or-none admission stays one engine's decision. A cancel goes to every engine
(the ones without the request ignore it). On the CPU the engines share one copy of the weights.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.router import POLICIES, RouteDecision, Router, RouterSettings
from .engine import EngineStats, LLMEngine
from .engine_config import EngineConfig
from .engine_loop import EngineLoop, Submission
from .faults import FaultInjector
from .outputs import RequestOutput


ENGINE_PROCESS = ("off", "on")


@dataclass(frozen=True)
class ParallelConfig:
    """How many engines and where (config.pbtxt parameters / KVSHARE_<NAME>, beside EngineConfig's)."""
    data_parallel_size: int = 1
    # Comma-separated devices, one per engine ("cuda:0,cuda:1"). Empty: cuda:0..N-1 when the engine's
    # device is CUDA, else N engines on that device.
    devices: str = ""
    routing_policy: str = "cache_aware"     # cache_aware | round_robin
    routing_balance_abs: int = 8
    routing_balance_ratio: float = 1.5
    routing_min_match_tokens: int = 1
    # "on": the engines run in a process of their own (engine/engine_process.py), so the stub's
    # response pump does not share the engine thread's GIL; "off": on a thread of the stub.
    engine_process: str = "off"

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.routing_policy not in POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(POLICIES)}, got '{self.routing_policy}'")
        if self.engine_process not in ENGINE_PROCESS:
            raise ValueError(f"engine_process must be one of {', '.join(ENGINE_PROCESS)}, got '{self.engine_process}'")
        listed = self.device_list
        if listed and len(listed) != self.data_parallel_size:
            raise ValueError(f"devices lists {len(listed)} devices ({self.devices}) for data_parallel_size "
                             f"{self.data_parallel_size}")

    @property
    def device_list(self) -> tuple[str, ...]:
        return tuple(d.strip() for d in self.devices.split(",") if d.strip())

    def engine_devices(self, device: str, tensor_parallel_size: int = 1) -> tuple[str, ...]:
        """Each engine's device (with tensor parallelism, its rank 0's: rank r runs on that + r)."""
        if self.device_list:
            return self.device_list
        n = self.data_parallel_size
        if n > 1 and device.split(":", 1)[0] == "cuda":
            return tuple(f"cuda:{i * tensor_parallel_size}" for i in range(n))
        return (device,) * n

    @property
    def router_settings(self) -> RouterSettings:
        return RouterSettings(self.routing_policy, self.routing_balance_abs, self.routing_balance_ratio,
                              self.routing_min_match_tokens)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, values: dict[str, str]) -> "ParallelConfig":
        """From string key/values; keys that are not this class's fields are left alone."""
        kwargs: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            if f.name not in values:
                continue
            raw = values[f.name].strip()
            try:
                kwargs[f.name] = int(raw) if f.type == "int" else float(raw) if f.type == "float" else raw
            except ValueError:
                raise ValueError(f"engine parameter '{f.name}' must be {f.type}, got '{raw}'") from None
        return cls(**kwargs)


@dataclass(frozen=True)
class EngineTick:
    """What an engine reports on its loop's tick (every ~0.5 s, and when it falls idle): the
    metrics' input, taken on its engine thread."""
    engine: int                       # index in the group
    stats: EngineStats
    ttft: list[float]                 # latency samples (s) since the previous tick
    itl: list[float]

    @classmethod
    def of(cls, index: int, engine: LLMEngine) -> "EngineTick":
        ttft, itl = engine.drain_latencies()
        return cls(index, engine.stats(), ttft, itl)


def build_engines(config: EngineConfig, parallel: ParallelConfig, *,
                  faults: FaultInjector | None = None) -> list[LLMEngine]:
    """One engine per device; engines on the same device share the loaded weights (read-only).
    With tensor_parallel_size T each engine is T ranks: on CUDA, engine i on cuda:iT..iT+T-1."""
    from ..runtime.weights import load_model
    from .model_dtypes import MODEL_DTYPES

    loaded: dict[str, object] = {}
    engines = []
    for device in parallel.engine_devices(config.device, config.tensor_parallel_size):
        if device not in loaded:
            loaded[device] = load_model(config.model, dtype=MODEL_DTYPES[config.dtype], device=device, seed=config.seed,
                                        cpu_blocks=config.cpu_weights == "blocks")
        engines.append(LLMEngine(dataclasses.replace(config, device=device), loaded[device], faults=faults))
    return engines


class EngineGroup:
    """The engines, their loops and the router; the submit/cancel/shutdown surface of one EngineLoop."""

    def __init__(self, engines: Sequence[LLMEngine], settings: RouterSettings = RouterSettings(), *,
                 max_in_flight: int | None = None, on_tick: Callable[[EngineTick], None] | None = None,
                 faults: FaultInjector | None = None, serving: Callable[[], bool | None] | None = None,
                 on_route: Callable[[RouteDecision], None] | None = None):
        if not engines:
            raise ValueError("an engine group needs at least one engine")
        self.engines = list(engines)
        self.router = Router([e.scheduler.kv for e in self.engines], self.engines[0].kv.page_size, settings)
        tick = (lambda i: (lambda engine: on_tick(EngineTick.of(i, engine)))) if on_tick is not None else (lambda i: None)
        self._on_route = on_route
        # max_in_flight is per engine: each has its own pool and queue
        self.loops = [EngineLoop(e, on_tick=tick(i), max_in_flight=max_in_flight, faults=faults, serving=serving,
                                 step_log_s=e.config.step_log_interval_s,
                                 label=f"engine {i}: " if len(self.engines) > 1 else "")
                      for i, e in enumerate(self.engines)]
        self._lock = threading.Lock()
        self._members_left: dict[str, int] = {}     # route id -> members not finished yet
        self._route_of: dict[str, str] = {}         # member request id -> route id
        self._taps: list[dict[object, object]] = [{} for _ in self.engines]   # per engine: caller's sink -> tap

    @property
    def engine(self) -> LLMEngine:
        """The first engine: tokenizer, config and validation are the same on all of them."""
        return self.engines[0]

    @property
    def in_flight(self) -> int:
        return sum(loop.in_flight for loop in self.loops)

    @property
    def max_in_flight(self) -> int | None:
        limits = [loop.max_in_flight for loop in self.loops]
        return None if None in limits else sum(limits)

    def try_submit_all(self, route_id: str, subs: list[Submission]) -> RouteDecision | None:
        """Routes the request and queues all of subs on one engine, or refuses (None) when every
        engine is full. The first member's prompt and salt are the routing key."""
        first = subs[0]
        salt = first.cache_salt.encode()
        # one engine: nothing to choose, nothing to hash
        keys = self.engine.scheduler.kv.page_keys(first.prompt_ids, salt) if len(self.engines) > 1 else ()
        with self._lock:
            self._members_left[route_id] = len(subs)
            for sub in subs:
                self._route_of[sub.request_id] = route_id
        decision = self.router.route(route_id, keys, salt, weight=len(subs))
        order = [decision.engine] + sorted((e for e in range(len(self.loops)) if e != decision.engine),
                                           key=lambda e: self.loops[e].in_flight)
        for engine in order:
            if engine != decision.engine:
                self.router.reroute(route_id, engine)
            if self.loops[engine].try_submit_all([self._tapped(engine, sub) for sub in subs]):
                if engine != decision.engine:
                    decision = dataclasses.replace(decision, engine=engine)
                if self._on_route is not None:
                    self._on_route(decision)
                return decision
        self._forget(route_id, subs)
        return None

    def cancel(self, request_id: str) -> None:
        for loop in self.loops:
            loop.cancel(request_id)

    def abandon(self, request_id: str) -> None:
        """EngineLoop.abandon on every engine: the caller answers the request itself."""
        for loop in self.loops:
            loop.abandon(request_id)

    def drain(self) -> None:
        """EngineLoop.drain on every engine: the server no longer serves this model."""
        for loop in self.loops:
            loop.drain()

    def shutdown(self, timeout: float = 10.0) -> None:
        for loop in self.loops:
            loop.shutdown(timeout)
        for engine in self.engines:     # after its loop: no step runs while its ranks stop
            engine.close()

    # -- finishing: the tap in front of the caller's sinks (engine threads) ---------------------------

    def _tapped(self, engine: int, sub: Submission) -> Submission:
        """The same submission, its sink wrapped so that its final output counts down its route.
        A batch sink keeps one tap per engine, so a step's outputs still reach it in one call."""
        taps = self._taps[engine]
        if sub.batch_sink is not None:
            tap = taps.get(sub.batch_sink)
            if tap is None:
                tap = taps.setdefault(sub.batch_sink, self._batch_tap(sub.batch_sink))
            return dataclasses.replace(sub, batch_sink=tap)
        sink = sub.sink

        def single(out: RequestOutput) -> None:
            try:
                if sink is not None:
                    sink(out)
            finally:
                if out.finished:
                    self._finished(out.request_id)
        return dataclasses.replace(sub, sink=single)

    def _batch_tap(self, batch_sink: Callable[[list[RequestOutput]], None]):
        def tap(outs: list[RequestOutput]) -> None:
            try:
                batch_sink(outs)
            finally:
                for out in outs:
                    if out.finished:
                        self._finished(out.request_id)
        return tap

    def _finished(self, request_id: str) -> None:
        with self._lock:
            route_id = self._route_of.pop(request_id, None)
            if route_id is None:
                return
            left = self._members_left[route_id] - 1
            if left:
                self._members_left[route_id] = left
                return
            del self._members_left[route_id]
        self.router.release(route_id)

    def _forget(self, route_id: str, subs: list[Submission]) -> None:
        with self._lock:
            self._members_left.pop(route_id, None)
            for sub in subs:
                self._route_of.pop(sub.request_id, None)
        self.router.release(route_id)
