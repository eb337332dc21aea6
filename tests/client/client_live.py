"""Helpers for the live tests (they run against the real server of the `triton_server` fixture)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from kvshare_client.metrics import fetch_metrics, metric_total, parse_samples

ROOT = Path(__file__).resolve().parents[2]
LOADTEST = ROOT / "perf" / "load"


def metric(metrics_url: str, name: str) -> Optional[float]:
    return metric_total(parse_samples(fetch_metrics(metrics_url)), name)


def wait_for_metric(metrics_url: str, name: str, ok: Callable[[float], bool], timeout: float) -> Optional[float]:
    """Poll until the metric satisfies ok(); return its last value (None if never exported)."""
    deadline = time.monotonic() + timeout
    value = metric(metrics_url, name)
    while (value is None or not ok(value)) and time.monotonic() < deadline:
        time.sleep(0.2)
        value = metric(metrics_url, name)
    return value
