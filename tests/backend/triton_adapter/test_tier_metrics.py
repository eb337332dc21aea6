"""The tier metrics on the metrics port (a stand-in for pb_utils' MetricFamily): occupancy gauges,
eviction counters, page faults by tier and migration bytes by direction (pages x page bytes)."""
from __future__ import annotations

from kvshare.core.types import PoolStats
from kvshare.engine.engine import EngineStats
from kvshare.triton_adapter.metrics import EngineMetrics


class _Metric:
    def __init__(self, labels):
        self.labels, self.value = labels, 0

    def set(self, value):
        self.value = value

    def increment(self, value):
        self.value += value

    def observe(self, value):
        pass


class _Family:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    made: list["_Family"] = []

    def __init__(self, name, description, kind):
        self.name, self.metrics = name, []
        _Family.made.append(self)

    def Metric(self, labels, **kw):
        metric = _Metric(labels)
        self.metrics.append(metric)
        return metric


class _Pb:
    MetricFamily = _Family


def samples() -> dict[tuple[str, tuple], int]:
    return {(f.name, tuple(sorted((k, v) for k, v in m.labels.items() if k not in ("model", "engine")))): m.value
            for f in _Family.made for m in f.metrics}


def stats(**pool) -> EngineStats:
    return EngineStats(PoolStats(total=10, free=10, active=0, cached=0, evictions_total=0,
                                 prefix_queries_tokens_total=0, prefix_hits_tokens_total=0, preemptions_total=0,
                                 **pool), 0, 0, 0, 0, page_bytes=1000)


def test_tier_gauges_counters_faults_and_bytes():
    _Family.made = []
    metrics = EngineMetrics(_Pb, "llm_engine")
    metrics.update(stats(host_spills_total=3, host_loads_total=1, disk_writes_total=2, disk_reads_total=1,
                         disk_pages_total=50, disk_pages_used=2, host_evictions_total=1, disk_evictions_total=0,
                         faults_gpu_total=5, faults_host_total=4, faults_disk_total=2), [], [])
    metrics.update(stats(host_spills_total=4, host_loads_total=1, disk_writes_total=3, disk_reads_total=2,
                         disk_pages_total=50, disk_pages_used=3, host_evictions_total=2, disk_evictions_total=1,
                         disk_read_failures_total=1, faults_gpu_total=6, faults_host_total=4, faults_disk_total=2),
                   [], [])
    got = samples()
    assert got[("kvshare_kv_disk_pages_total", ())] == 50 and got[("kvshare_kv_disk_pages_used", ())] == 3
    assert got[("kvshare_kv_host_evictions_total", ())] == 2 and got[("kvshare_kv_disk_evictions_total", ())] == 1
    assert got[("kvshare_kv_disk_read_failures_total", ())] == 1
    assert got[("kvshare_kv_page_faults_total", (("tier", "gpu"),))] == 6
    assert got[("kvshare_kv_page_faults_total", (("tier", "host"),))] == 4
    assert got[("kvshare_kv_page_faults_total", (("tier", "disk"),))] == 2
    moved = {d: got[("kvshare_kv_tier_migration_bytes_total", (("direction", d),))]
             for d in ("gpu_to_host", "host_to_gpu", "host_to_disk", "disk_to_host")}
    assert moved == {"gpu_to_host": 4000, "host_to_gpu": 1000, "host_to_disk": 3000, "disk_to_host": 2000}
