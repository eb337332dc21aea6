"""Where an engine run's wall time goes, step by step: prefill, mixed and decode steps per runner path.

    profile = StepProfile()
    t0 = time.perf_counter(); outputs = engine.step(); profile.add(engine.last_step, time.perf_counter() - t0)
    profile.summary(total_seconds)   # {"decode graph": {...}, "prefill": {...}, "outside steps": ...}

With synchronous scheduling a step's wall time includes its GPU work (the step ends reading the
sampled ids); with overlap scheduling it is the host's share only and the GPU's shows in the next.
"""
from __future__ import annotations

from collections import defaultdict

from kvshare.engine.outputs import StepShape


def step_kind(shape: StepShape) -> str:
    if shape.prefill_tokens:
        kind = "mixed" if shape.decode_rows else "prefill"
        return f"{kind} graph" if shape.path == "mixed-graph" else kind
    return f"decode {shape.path}" if shape.decode_rows else "idle"


class StepProfile:
    def __init__(self) -> None:
        self._seconds: dict[str, float] = defaultdict(float)
        self._steps: dict[str, int] = defaultdict(int)
        self._rows: dict[str, int] = defaultdict(int)
        self._prefill: dict[str, int] = defaultdict(int)

    def add(self, shape: StepShape, seconds: float) -> None:
        kind = step_kind(shape)
        self._seconds[kind] += seconds
        self._steps[kind] += 1
        self._rows[kind] += shape.decode_rows
        self._prefill[kind] += shape.prefill_tokens

    def summary(self, total_seconds: float) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for kind in sorted(self._seconds, key=lambda k: -self._seconds[k]):
            n, s = self._steps[kind], self._seconds[kind]
            out[kind] = {"steps": n, "seconds": round(s, 4), "ms_per_step": round(1e3 * s / n, 3),
                         "decode_rows_per_step": round(self._rows[kind] / n, 1),
                         "prefill_tokens": self._prefill[kind]}
        inside = sum(self._seconds.values())
        out["outside steps"] = {"seconds": round(total_seconds - inside, 4)}
        return out


def format_summary(summary: dict[str, dict[str, float]], total_seconds: float) -> str:
    lines = []
    for kind, v in summary.items():
        share = 100 * v["seconds"] / total_seconds if total_seconds else 0.0
        if "steps" not in v:
            lines.append(f"   {kind:<22}{v['seconds']:>8.3f} s {share:5.1f}%")
            continue
        extra = f", {v['prefill_tokens']} prefill tok" if v["prefill_tokens"] else ""
        lines.append(f"   {kind:<22}{v['seconds']:>8.3f} s {share:5.1f}%  {v['steps']:>5} steps x "
                     f"{v['ms_per_step']:.2f} ms, {v['decode_rows_per_step']:.0f} decode rows{extra}")
    return "\n".join(lines)
