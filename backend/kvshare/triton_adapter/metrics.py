"""kvshare's Prometheus metrics, exported through Triton's metrics port (pb_utils.MetricFamily).

Every metric carries the labels model and engine (the engine's index among the instance's data
parallel engines; "0" with one engine): summing over engine gives the instance's totals.
"""
from __future__ import annotations

from ..engine.engine import EngineStats

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
# Tier migrations: label direction -> the PoolStats page counter it counts (times EngineStats.page_bytes).
_MIGRATIONS = {"gpu_to_host": "host_spills_total", "host_to_gpu": "host_loads_total",
               "host_to_disk": "disk_writes_total", "disk_to_host": "disk_reads_total"}
# Page faults: label tier -> the PoolStats counter of prompt pages looked up and not found there (or above).
_FAULTS = {"gpu": "faults_gpu_total", "host": "faults_host_total", "disk": "faults_disk_total"}


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

        def labelled(name: str, help_text: str, label: str, values) -> dict:
            return {v: self.families.metric(name, C, help_text, {**labels, label: v}) for v in values}

        self.gauges = {
            "total": metric("kvshare_kv_pages_total", G, "KV pages in the pool"),
            "free": metric("kvshare_kv_pages_free", G, "KV pages holding nothing"),
            "active": metric("kvshare_kv_pages_active", G, "KV pages referenced by running requests"),
            "cached": metric("kvshare_kv_pages_cached", G, "Unreferenced KV pages holding a reusable prefix"),
            "running": metric("kvshare_requests_running", G, "Requests being generated"),
            "waiting": metric("kvshare_requests_waiting", G, "Requests queued for admission"),
            "host_total": metric("kvshare_kv_host_pages_total", G, "KV pages in the host tier (0: no tier)"),
            "host_used": metric("kvshare_kv_host_pages_used", G, "Host-tier pages holding an evicted prefix page"),
            "disk_total": metric("kvshare_kv_disk_pages_total", G, "KV pages the disk tier may hold (0: no tier)"),
            "disk_used": metric("kvshare_kv_disk_pages_used", G, "Disk-tier page files written and loadable"),
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
            "host_evictions_total": metric("kvshare_kv_host_evictions_total", C, "Host-tier pages evicted"),
            "disk_hits_tokens_total": metric("kvshare_prefix_cache_disk_hits_tokens_total", C,
                                             "Prompt tokens loaded back from the disk tier (part of the host hits)"),
            "disk_writes_total": metric("kvshare_kv_disk_writes_total", C, "Pages written to the disk tier"),
            "disk_reads_total": metric("kvshare_kv_disk_reads_total", C, "Disk-tier pages read back and checksummed"),
            "disk_evictions_total": metric("kvshare_kv_disk_evictions_total", C, "Disk-tier page files evicted"),
            "disk_read_failures_total": metric("kvshare_kv_disk_read_failures_total", C,
                                               "Disk-tier reads that failed their checks (torn, stale, another layout): misses"),
            "prompt_tokens_total": metric("kvshare_prompt_tokens_total", C, "Prompt tokens received"),
            "generation_tokens_total": metric("kvshare_generation_tokens_total", C, "Tokens generated"),
        }
        self.faults = labelled("kvshare_kv_page_faults_total", "Prompt pages looked up at admission and not found "
                               "in this tier or above it (tier=disk: recomputed)", "tier", _FAULTS)
        self.migrations = labelled("kvshare_kv_tier_migration_bytes_total", "Bytes of KV pages moved between tiers",
                                   "direction", _MIGRATIONS)
        self._last = {k: 0 for k in self.counters}
        self._last_faults = {k: 0 for k in _FAULTS}
        self._last_bytes = {k: 0 for k in _MIGRATIONS}
        self.ttft = metric("kvshare_time_to_first_token_seconds", H, "Time to first token", buckets=_LATENCY_BUCKETS)
        self.itl = metric("kvshare_inter_token_latency_seconds", H, "Time between consecutive tokens", buckets=_LATENCY_BUCKETS)

    def update(self, stats: EngineStats, ttfts: list[float], itls: list[float]) -> None:
        pool = stats.pool
        for key, value in (("total", pool.total), ("free", pool.free), ("active", pool.active), ("cached", pool.cached),
                           ("running", stats.requests_running), ("waiting", stats.requests_waiting),
                           ("host_total", pool.host_pages_total), ("host_used", pool.host_pages_used),
                           ("disk_total", pool.disk_pages_total), ("disk_used", pool.disk_pages_used)):
            self.gauges[key].set(value)
        now = {
            "prefix_queries_tokens_total": pool.prefix_queries_tokens_total,
            "prefix_hits_tokens_total": pool.prefix_hits_tokens_total,
            "evictions_total": pool.evictions_total,
            "preemptions_total": pool.preemptions_total,
            "host_hits_tokens_total": pool.host_hits_tokens_total,
            "host_spills_total": pool.host_spills_total,
            "host_loads_total": pool.host_loads_total,
            "host_evictions_total": pool.host_evictions_total,
            "disk_hits_tokens_total": pool.disk_hits_tokens_total,
            "disk_writes_total": pool.disk_writes_total,
            "disk_reads_total": pool.disk_reads_total,
            "disk_evictions_total": pool.disk_evictions_total,
            "disk_read_failures_total": pool.disk_read_failures_total,
            "prompt_tokens_total": stats.prompt_tokens_total,
            "generation_tokens_total": stats.generation_tokens_total,
        }
        self._advance(self.counters, self._last, now)
        self._advance(self.faults, self._last_faults, {t: getattr(pool, f) for t, f in _FAULTS.items()})
        self._advance(self.migrations, self._last_bytes,
                      {d: getattr(pool, f) * stats.page_bytes for d, f in _MIGRATIONS.items()})
        for v in ttfts:
            self.ttft.observe(v)
        for v in itls:
            self.itl.observe(v)

    @staticmethod
    def _advance(metrics: dict, last: dict, now: dict) -> None:
        for key, value in now.items():
            if value > last[key]:
                metrics[key].increment(value - last[key])
                last[key] = value
