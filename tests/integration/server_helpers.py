"""Small helpers shared by the integration tests (they talk to the real server through kvshare_client)."""
from __future__ import annotations

import time

from kvshare_client.metrics import fetch_metrics, metric_total, parse_samples

POOL_GAUGES = ("kvshare_kv_pages_total", "kvshare_kv_pages_free", "kvshare_kv_pages_active", "kvshare_kv_pages_cached")


def pool_gauges(metrics_url: str) -> dict[str, float]:
    samples = parse_samples(fetch_metrics(metrics_url))
    return {name: metric_total(samples, name) for name in (*POOL_GAUGES, "kvshare_requests_running",
                                                          "kvshare_requests_waiting")}


def wait_for_idle_pool(metrics_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Polls the metrics port (published every ~0.5 s) until no page is referenced by a request."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = pool_gauges(metrics_url)
        if g["kvshare_kv_pages_active"] == 0 and g["kvshare_requests_running"] == 0 \
                and g["kvshare_requests_waiting"] == 0:
            return g
        if time.monotonic() > deadline:
            raise AssertionError(f"pages still referenced after {timeout_s} s: {g}")
        time.sleep(0.25)
