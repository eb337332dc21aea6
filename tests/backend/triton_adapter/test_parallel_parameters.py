"""llm_engine's data-parallel settings: config.pbtxt parameters and KVSHARE_* variables split between
EngineConfig and ParallelConfig; per-engine metrics share one MetricFamily per name (fake pb_utils)."""
from __future__ import annotations

import sys
import types

import pytest

from kvshare.engine.engine import EngineStats
from kvshare.core.types import PoolStats


@pytest.fixture
def adapter(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    monkeypatch.delitem(sys.modules, "kvshare.triton_adapter.llm_engine_model", raising=False)
    from kvshare.triton_adapter import llm_engine_model

    yield llm_engine_model
    sys.modules.pop("kvshare.triton_adapter.llm_engine_model", None)


def params(**values: str) -> dict:
    return {"parameters": {k: {"string_value": v} for k, v in values.items()}}


def test_parallel_keys_go_to_parallel_config_and_the_environment_wins(adapter, monkeypatch) -> None:
    monkeypatch.setenv("KVSHARE_ROUTING_POLICY", "round_robin")
    config = params(page_size="8", data_parallel_size="2", devices="", routing_policy="cache_aware")
    engine = adapter.engine_config_from(config, "CPU", "0")
    parallel = adapter.parallel_config_from(config)
    assert engine.page_size == 8 and engine.device == "cpu"
    assert (parallel.data_parallel_size, parallel.routing_policy, parallel.device_list) == (2, "round_robin", ())


def test_a_bad_parallel_value_names_the_parameter(adapter, monkeypatch) -> None:
    monkeypatch.setenv("KVSHARE_DATA_PARALLEL_SIZE", "0")
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        adapter.parallel_config_from(params())


class FakeFamily:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    created: list[str] = []

    def __init__(self, name, description, kind):
        FakeFamily.created.append(name)
        self.name = name

    def Metric(self, labels, **kw):
        return FakeMetric(self.name, labels)


class FakeMetric:
    values: dict = {}

    def __init__(self, name, labels):
        self.key = (name, tuple(sorted(labels.items())))
        FakeMetric.values[self.key] = 0

    def set(self, v):
        FakeMetric.values[self.key] = v

    def increment(self, v):
        FakeMetric.values[self.key] += v

    def observe(self, v):
        pass


def test_each_engine_has_its_label_in_one_family_per_name() -> None:
    from kvshare.triton_adapter.metrics import EngineMetrics, MetricFamilies, RouterMetrics

    pb = types.SimpleNamespace(MetricFamily=FakeFamily)
    FakeFamily.created, FakeMetric.values = [], {}
    families = MetricFamilies(pb)
    engines = [EngineMetrics(pb, "llm_engine", i, families) for i in range(2)]
    router = RouterMetrics(families, "llm_engine")
    assert len(FakeFamily.created) == len(set(FakeFamily.created))
    pool = PoolStats(total=10, free=4, active=2, cached=4, evictions_total=0, prefix_queries_tokens_total=32,
                     prefix_hits_tokens_total=16, preemptions_total=0)
    engines[1].update(EngineStats(pool, 1, 0, 32, 5), [], [])
    router.record(1, "affinity")
    router.record(1, "affinity")
    v = FakeMetric.values
    hits = "kvshare_prefix_cache_hits_tokens_total"
    assert v[(hits, (("engine", "1"), ("model", "llm_engine")))] == 16
    assert v[(hits, (("engine", "0"), ("model", "llm_engine")))] == 0
    assert v[("kvshare_router_requests_total", (("engine", "1"), ("model", "llm_engine"), ("reason", "affinity")))] == 2
