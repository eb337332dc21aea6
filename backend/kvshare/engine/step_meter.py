"""The engine loop's periodic log line: how long its steps took, by kind, while it had work.

vLLM logs throughput every 10 s and SGLang every 40 decode steps; this line adds what those leave
out and what a server-side latency question needs first: the period of each kind of step (decode
only, with a prefill chunk, graph or eager), so an inter-token latency seen by a client can be put
beside the steps that made it. A step's period runs from the start of one busy iteration of the
loop to the start of the next, so it holds everything the loop did for that step (scheduling,
the GPU's share under overlap scheduling, handing outputs to their sinks); a period that began
with the loop waiting for work is not counted.
"""
from __future__ import annotations

from .outputs import StepShape

# The kinds, as constant strings: no formatting per step.
DECODE, MIXED, PREFILL = "decode", "mixed", "prefill"
_GRAPH_PATHS = frozenset(("graph", "cascade-graph", "mixed-graph"))


def step_kind(shape: StepShape) -> tuple[str, bool]:
    """(kind, replayed from a CUDA graph)."""
    if shape.prefill_tokens:
        return (MIXED if shape.decode_rows else PREFILL), shape.path in _GRAPH_PATHS
    return DECODE, shape.path in _GRAPH_PATHS


class StepMeter:
    """Sums step periods per (kind, graph) between reports; `report(now)` returns the line once
    interval_s has passed since the last one (None before, or when no step ran)."""

    def __init__(self, interval_s: float, now: float):
        self.interval_s = interval_s
        self._since = now
        self._sums: dict[tuple[str, bool], list[float]] = {}   # -> [steps, seconds, decode rows, prefill tokens]

    def add(self, shape: StepShape, seconds: float) -> None:
        key = step_kind(shape)
        acc = self._sums.get(key)
        if acc is None:
            acc = self._sums[key] = [0, 0.0, 0, 0]
        acc[0] += 1
        acc[1] += seconds
        acc[2] += shape.decode_rows
        acc[3] += shape.prefill_tokens

    def report(self, now: float) -> str | None:
        if self.interval_s <= 0 or now - self._since < self.interval_s:
            return None
        window, sums = now - self._since, self._sums
        self._since, self._sums = now, {}
        if not sums:
            return None
        steps = sum(int(a[0]) for a in sums.values())
        busy = sum(a[1] for a in sums.values())
        tokens = sum(int(a[2]) for a in sums.values())
        parts = []
        for (kind, graph), (n, secs, rows, prefill) in sorted(sums.items(), key=lambda kv: -kv[1][1]):
            extra = f", {prefill / n:.0f} prefill tok" if prefill else ""
            parts.append(f"{kind}{' graph' if graph else ''} {int(n)} x {1e3 * secs / n:.2f} ms "
                         f"({rows / n:.1f} rows{extra})")
        return (f"{steps} steps in {window:.1f} s ({busy / window:.0%} busy): " + "; ".join(parts)
                + f"; {tokens / window:,.0f} decode tok/s")
