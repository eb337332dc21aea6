"""The soak's pass criteria, as pure functions of what was recorded (unit-tested on their own).

    no unexpected outcome     every request ended in a result expected for its kind (outcomes.py)
    bursts refused            every burst got at least one overload refusal and none hung
    pages exact at idle       active 0 and free + cached = total once the server is idle
    RSS growth < 5%           server + stubs, median of the last window vs. the window after warm-up
    TTFT p99 <= bound         client-side TTFT of the completed streams
    server alive              the server and every stub it started still run and still answer
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def histogram_quantile(start: dict[float, float], end: dict[float, float], q: float) -> Optional[float]:
    """Upper bucket bound holding quantile q of the observations between two cumulative snapshots."""
    bounds = sorted(end)
    counts = [end[b] - start.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    for b, c in zip(bounds, counts):
        if c >= q * total:
            return b
    return bounds[-1]


def rss_growth(rows: Sequence[dict[str, Any]], warmup_end_s: float, load_end_s: float,
               window_s: float) -> Optional[dict[str, float]]:
    """Median RSS (server + stubs) in [warm-up end, + window] vs. in [load end - window, load end]."""
    def window(lo: float, hi: float) -> list[float]:
        return [r["rss_total_mb"] for r in rows
                if r.get("rss_total_mb") is not None and lo <= r["elapsed_s"] <= hi]
    after_warmup = window(warmup_end_s, warmup_end_s + window_s)
    at_end = window(load_end_s - window_s, load_end_s)
    if not after_warmup or not at_end:
        return None
    start, end = median(after_warmup), median(at_end)
    return {"start_mb": round(start, 1), "end_mb": round(end, 1), "growth": round((end - start) / start, 5)}


def pages_exact(gauges: dict[str, Optional[float]]) -> Check:
    a, c, f, t = (gauges.get(k) for k in ("kv_pages_active", "kv_pages_cached", "kv_pages_free", "kv_pages_total"))
    ok = None not in (a, c, f, t) and a == 0 and f + c == t
    return Check("pages exact at idle", bool(ok), f"active={a} cached={c} free={f} total={t}")


def evaluate(*, unexpected: int, requests: int, bursts: Sequence[dict[str, Any]], bursts_open: int,
             idle_gauges: dict[str, Optional[float]], rss: Optional[dict[str, float]], rss_limit: float,
             ttft_p99_s: Optional[float], ttft_bound_s: float, alive: tuple[bool, str],
             kinds_seen: dict[str, int], kinds_required: Sequence[str]) -> list[Check]:
    missing = [k for k in kinds_required if not kinds_seen.get(k)]
    refused = [b for b in bursts if b["refused"] > 0 and b["hung"] == 0]
    return [
        Check("no unexpected outcome", unexpected == 0 and requests > 0, f"{unexpected} unexpected of {requests}"),
        Check("every kind sent", not missing, "missing: " + ", ".join(missing) if missing else "all kinds"),
        Check("bursts refused, none hung", bool(bursts) and len(refused) == len(bursts) and bursts_open == 0,
              f"{len(refused)} of {len(bursts)} bursts refused some and hung none; {bursts_open} never ended"),
        pages_exact(idle_gauges),
        Check(f"RSS growth < {rss_limit:.0%}", rss is not None and rss["growth"] < rss_limit,
              "not measured" if rss is None else f"{rss['start_mb']} -> {rss['end_mb']} MiB ({rss['growth']:+.2%})"),
        Check(f"TTFT p99 <= {ttft_bound_s:g} s", ttft_p99_s is not None and ttft_p99_s <= ttft_bound_s,
              "no completed stream" if ttft_p99_s is None else f"p99 {ttft_p99_s:.2f} s"),
        Check("server alive", alive[0], alive[1]),
    ]
