"""MetricsPublisher: the engine thread only hands over snapshots; the IPC-heavy update runs on the
publisher's own thread, and snapshots that arrive meanwhile merge without losing a latency sample."""
from __future__ import annotations

import sys
import threading
import types

import pytest


@pytest.fixture
def publisher_cls(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    monkeypatch.delitem(sys.modules, "kvshare.triton_adapter.llm_engine_model", raising=False)
    from kvshare.triton_adapter.llm_engine_model import MetricsPublisher

    yield MetricsPublisher
    sys.modules.pop("kvshare.triton_adapter.llm_engine_model", None)


class SlowMetrics:
    def __init__(self):
        self.calls: list[tuple] = []
        self.threads: set[str] = set()
        self.release = threading.Event()
        self.entered = threading.Event()

    def update(self, stats, ttft, itl):
        self.threads.add(threading.current_thread().name)
        self.entered.set()
        self.release.wait(10)
        self.calls.append((stats, list(ttft), list(itl)))


def test_updates_run_on_the_publisher_thread_and_merge_while_busy(publisher_cls):
    metrics = SlowMetrics()
    pub = publisher_cls(metrics)
    pub.offer("s1", [0.1], [0.01, 0.02])
    assert metrics.entered.wait(10)          # the first update is in progress (blocked)
    pub.offer("s2", [0.2], [0.03])
    pub.offer("s3", [], [0.04, 0.05])       # arrives meanwhile: merges with s2
    metrics.release.set()
    pub.close()
    assert metrics.threads == {"kvshare-metrics"}
    assert metrics.calls[0] == ("s1", [0.1], [0.01, 0.02])
    assert metrics.calls[1:] == [("s3", [0.2], [0.03, 0.04, 0.05])]


def test_close_publishes_what_is_pending_and_a_failing_update_is_survived(publisher_cls):
    class Flaky:
        def __init__(self):
            self.calls = []

        def update(self, stats, ttft, itl):
            self.calls.append(stats)
            if stats == "bad":
                raise RuntimeError("metrics IPC failed")

    metrics = Flaky()
    pub = publisher_cls(metrics)
    pub.offer("bad", [], [])
    pub.offer("last", [], [0.5])
    pub.close()
    assert metrics.calls[-1] == "last" and not pub._thread.is_alive()
