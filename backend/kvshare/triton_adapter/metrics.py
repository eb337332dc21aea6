"""kvshare's Prometheus metrics, exported through Triton's metrics port (pb_utils.MetricFamily).

Every metric carries the labels model and engine (the engine's index among the instance's data
parallel engines; "0" with one engine): summing over engine gives the instance's totals.
"""
from __future__ import annotations

from ..engine.engine import EngineStats

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class MetricFamilies:
    """One MetricFamily per name for the whole model instance: the engines' metrics are members of
    the same families, told apart by their labels."""

    def __init__(self, pb):
        self.pb = pb
        # A Metric is dead once its MetricFamily is garbage-collected: keep the families alive.
        self._families: dict[str, object] = {}

    def metric(self, name: str, kind, help_text: str, labels: dict[str, str], **kw):
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = self.pb.MetricFamily(name=name, description=help_text, kind=kind)
        return family.Metric(labels=labels, **kw)


class RouterMetrics:
    """kvshare_router_requests_total{engine, reason}: where the router sent each request and why
    (affinity, least_loaded, balance, round_robin; kvshare.core.router)."""

    def __init__(self, families: MetricFamilies, model_name: str):
        self._families = families
        self._model = model_name
        self._counters: dict[tuple[int, str], object] = {}

    def record(self, engine: int, reason: str) -> None:
        counter = self._counters.get((engine, reason))
        if counter is None:
            counter = self._counters[(engine, reason)] = self._families.metric(
                "kvshare_router_requests_total", self._families.pb.MetricFamily.COUNTER,
                "Requests the data-parallel router sent to an engine, by reason",
                {"model": self._model, "engine": str(engine), "reason": reason})
        counter.increment(1)


class EngineMetrics:
    def __init__(self, pb, model_name: str, engine: int = 0, families: MetricFamilies | None = None):
        labels = {"model": model_name, "engine": str(engine)}
        G, C, H = pb.MetricFamily.GAUGE, pb.MetricFamily.COUNTER, pb.MetricFamily.HISTOGRAM
        self.families = families or MetricFamilies(pb)

        def metric(name: str, kind, help_text: str, **kw):
            return self.families.metric(name, kind, help_text, labels, **kw)

        self.gauges = {
            "total": metric("kvshare_kv_pages_total", G, "KV pages in the pool"),
            "free": metric("kvshare_kv_pages_free", G, "KV pages holding nothing"),
            "active": metric("kvshare_kv_pages_active", G, "KV pages referenced by running requests"),
            "cached": metric("kvshare_kv_pages_cached", G, "Unreferenced KV pages holding a reusable prefix"),
            "running": metric("kvshare_requests_running", G, "Requests being generated"),
            "waiting": metric("kvshare_requests_waiting", G, "Requests queued for admission"),
            "host_total": metric("kvshare_kv_host_pages_total", G, "KV pages in the host tier (0: no tier)"),
            "host_used": metric("kvshare_kv_host_pages_used", G, "Host-tier pages holding an evicted prefix page"),
        }
        self.counters = {
            "prefix_queries_tokens_total": metric("kvshare_prefix_cache_queries_tokens_total", C, "Prompt tokens looked up in the prefix cache"),
            "prefix_hits_tokens_total": metric("kvshare_prefix_cache_hits_tokens_total", C, "Prompt tokens served from shared pages"),
            "evictions_total": metric("kvshare_kv_evictions_total", C, "Cached pages evicted"),
            "preemptions_total": metric("kvshare_preemptions_total", C, "Requests preempted for lack of pages"),
            "host_hits_tokens_total": metric("kvshare_prefix_cache_host_hits_tokens_total", C,
                                             "Prompt tokens loaded back from the host tier (part of the prefix hits)"),
            "host_spills_total": metric("kvshare_kv_host_spills_total", C, "Evicted cached pages copied to the host tier"),
            "host_loads_total": metric("kvshare_kv_host_loads_total", C, "Host-tier pages copied back to the GPU pool"),
            "prompt_tokens_total": metric("kvshare_prompt_tokens_total", C, "Prompt tokens received"),
            "generation_tokens_total": metric("kvshare_generation_tokens_total", C, "Tokens generated"),
        }
        self._last = {k: 0 for k in self.counters}
        self.ttft = metric("kvshare_time_to_first_token_seconds", H, "Time to first token", buckets=_LATENCY_BUCKETS)
        self.itl = metric("kvshare_inter_token_latency_seconds", H, "Time between consecutive tokens", buckets=_LATENCY_BUCKETS)

    def update(self, stats: EngineStats, ttfts: list[float], itls: list[float]) -> None:
        pool = stats.pool
        for key, value in (("total", pool.total), ("free", pool.free), ("active", pool.active), ("cached", pool.cached),
                           ("running", stats.requests_running), ("waiting", stats.requests_waiting),
                           ("host_total", pool.host_pages_total), ("host_used", pool.host_pages_used)):
            self.gauges[key].set(value)
        now = {
            "prefix_queries_tokens_total": pool.prefix_queries_tokens_total,
            "prefix_hits_tokens_total": pool.prefix_hits_tokens_total,
            "evictions_total": pool.evictions_total,
            "preemptions_total": pool.preemptions_total,
            "host_hits_tokens_total": pool.host_hits_tokens_total,
            "host_spills_total": pool.host_spills_total,
            "host_loads_total": pool.host_loads_total,
            "prompt_tokens_total": stats.prompt_tokens_total,
            "generation_tokens_total": stats.generation_tokens_total,
        }
        for key, value in now.items():
            if value > self._last[key]:
                self.counters[key].increment(value - self._last[key])
                self._last[key] = value
        for v in ttfts:
            self.ttft.observe(v)
        for v in itls:
            self.itl.observe(v)
