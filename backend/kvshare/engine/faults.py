"""Test-only fault injection: makes the engine and the response pump fail on purpose.

    KVSHARE_FAULTS="forward:0.1,sample:1:2,detokenize:0.05,pump:1:1,slow_step:200ms,seed:7"

Each ``site:probability[:max_fires]`` raises InjectedFault at that site with that probability per
call, at most max_fires times (no limit when left out); ``slow_step:<ms>ms`` sleeps before every
engine step; ``seed`` makes the draws repeatable. The sites:

    forward      inside a step, after the scheduler has allocated the step's pages, before the model runs
    sample       inside the sampler, after the forward pass
    detokenize   inside a step, while a new token is turned into text
    pump         in the response pump, while a response is built for a client

Parsed once (FaultSpec), decided by one FaultInjector that the server builds from the environment
and hands explicitly to the engine, its loop and the pump. Unset, nothing is built: every site
holds ``None`` and pays one ``is None`` test.
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

SITES = ("forward", "sample", "detokenize", "pump")
ENV = "KVSHARE_FAULTS"


class InjectedFault(RuntimeError):
    """Raised at a fault site; never raised unless KVSHARE_FAULTS asks for it."""


@dataclass(frozen=True)
class FaultRule:
    probability: float
    max_fires: int | None = None        # None: no limit


@dataclass(frozen=True)
class FaultSpec:
    rules: Mapping[str, FaultRule] = field(default_factory=dict)
    slow_step_s: float = 0.0
    seed: int = 0

    @property
    def active(self) -> bool:
        return bool(self.rules) or self.slow_step_s > 0

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        """From the KVSHARE_FAULTS syntax; anything unknown is an error naming the item."""
        rules: dict[str, FaultRule] = {}
        slow, seed = 0.0, 0
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            name, _, value = item.partition(":")
            name = name.strip()
            try:
                if name == "slow_step":
                    slow = _duration_s(value)
                elif name == "seed":
                    seed = int(value)
                elif name in SITES:
                    prob, _, limit = value.partition(":")
                    p = float(prob)
                    if not 0.0 <= p <= 1.0:
                        raise ValueError("the probability must be in [0, 1]")
                    n = int(limit) if limit else None
                    if n is not None and n < 1:
                        raise ValueError("max_fires must be >= 1")
                    rules[name] = FaultRule(p, n)
                else:
                    raise ValueError(f"unknown fault; known: {', '.join(SITES)}, slow_step, seed")
            except ValueError as exc:
                raise ValueError(f"{ENV} item '{item}': {exc}") from None
        return cls(rules, slow, seed)


def _duration_s(value: str) -> float:
    value = value.strip()
    if value.endswith("ms"):
        seconds = float(value[:-2]) / 1000
    elif value.endswith("s"):
        seconds = float(value[:-1])
    else:
        raise ValueError("a duration needs a unit: 200ms or 0.2s")
    if seconds < 0:
        raise ValueError("a duration must be >= 0")
    return seconds


class FaultInjector:
    """The one place that decides whether a site fails now. Called from the engine thread and the
    pump thread, hence the lock; it only runs when a fault was asked for."""

    def __init__(self, spec: FaultSpec):
        self.spec = spec
        self._rng = random.Random(spec.seed)
        self._lock = threading.Lock()
        self.fired: dict[str, int] = {site: 0 for site in SITES}

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> "FaultInjector | None":
        """None (the zero-cost case) unless KVSHARE_FAULTS asks for a fault."""
        spec = FaultSpec.parse(environ.get(ENV, ""))
        return cls(spec) if spec.active else None

    def check(self, site: str) -> None:
        rule = self.spec.rules.get(site)
        if rule is None:
            return
        with self._lock:
            if rule.max_fires is not None and self.fired[site] >= rule.max_fires:
                return
            if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                return
            self.fired[site] += 1
            n = self.fired[site]
        raise InjectedFault(f"injected {site} fault #{n} ({ENV})")

    def slow_step(self) -> None:
        if self.spec.slow_step_s > 0:
            time.sleep(self.spec.slow_step_s)

    def wrap(self, site: str, fn):
        """fn (a callable object, e.g. the sampler) failing at `site` when called; its other
        attributes pass through."""
        return _FailingCall(fn, site, self) if site in self.spec.rules else fn


class _FailingCall:
    def __init__(self, inner, site: str, injector: FaultInjector):
        self._inner, self._site, self._injector = inner, site, injector

    def __call__(self, *args, **kwargs):
        self._injector.check(self._site)
        return self._inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)
