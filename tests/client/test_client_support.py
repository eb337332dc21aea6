"""workload files, SLO gates, metrics parsing, import hygiene."""

import json
import subprocess
import sys

import pytest

from kvshare_client.metrics import filter_lines, metric_total, metrics_url, parse_samples
from kvshare_client.slo import SloGates, evaluate
from kvshare_client.types import GenerationRequest
from kvshare_client.workload import RoundRobin, load_workload, synthetic_token_requests


def test_workload_formats(tmp_path):
    jl = tmp_path / "w.jsonl"
    jl.write_text('{"prompt": "a", "max_tokens": 5}\n\n{"input_ids": [1, 2], "cache_salt": "s"}\n')
    assert load_workload(jl) == (
        GenerationRequest(prompt="a", max_tokens=5),
        GenerationRequest(input_ids=(1, 2), cache_salt="s"),
    )
    js = tmp_path / "w.json"
    js.write_text(json.dumps({"requests": [{"prompt": "x"}]}))
    assert load_workload(js)[0].prompt == "x"
    txt = tmp_path / "w.txt"
    txt.write_text("first prompt\n\n第二\n")
    assert [r.prompt for r in load_workload(txt)] == ["first prompt", "第二"]


def test_workload_overrides_win_and_none_means_keep(tmp_path):
    jl = tmp_path / "w.jsonl"
    jl.write_text('{"prompt": "a", "max_tokens": 5, "temperature": 0.7}\n')
    (r,) = load_workload(jl, {"max_tokens": 64, "temperature": None, "stream": True})
    assert (r.max_tokens, r.temperature, r.stream) == (64, 0.7, True)


def test_workload_rejects_unknown_fields_and_empty_files(tmp_path):
    jl = tmp_path / "w.jsonl"
    jl.write_text('{"prompt": "a", "max_new_tokens": 5}\n')
    with pytest.raises(ValueError, match="max_new_tokens"):
        load_workload(jl)
    empty = tmp_path / "e.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_workload(empty)


def test_synthetic_token_requests_are_deterministic_and_in_range():
    a = synthetic_token_requests(3, 16, seed=1, overrides={"max_tokens": 4})
    assert a == synthetic_token_requests(3, 16, seed=1, overrides={"max_tokens": 4})
    assert all(len(r.input_ids) == 16 and r.max_tokens == 4 for r in a)
    assert all(1000 <= i < 30000 for r in a for i in r.input_ids)


def test_round_robin_cycles_from_offset():
    reqs = tuple(GenerationRequest(prompt=str(i)) for i in range(3))
    rr = RoundRobin(reqs, start=2)
    assert [rr.next().prompt for _ in range(4)] == ["2", "0", "1", "2"]


@pytest.mark.parametrize(
    "requests, failures, p95, gates, ok",
    [
        (100, 0, 250.0, SloGates(0.0, 500.0), True),
        (100, 1, 250.0, SloGates(0.0, 500.0), False),
        (100, 1, 250.0, SloGates(0.02, None), True),
        (100, 0, 900.0, SloGates(0.0, 500.0), False),
        (0, 0, None, SloGates(), False),
        (5, 5, None, SloGates(1.0, 100.0), False),  # no TTFT at all cannot pass a TTFT gate
    ],
)
def test_slo_gates(requests, failures, p95, gates, ok):
    report = evaluate(requests, failures, p95, gates)
    assert report.ok is ok
    assert ("PASS" in report.summary()) is ok


PROM = """# HELP kvshare_kv_pages_free Free pages
# TYPE kvshare_kv_pages_free gauge
kvshare_kv_pages_free{model="llm_engine",version="1"} 96
kvshare_requests_running{model="llm_engine"} 2
kvshare_requests_running{model="other"} 1
nv_inference_count{model="ensemble"} 4
kvshare_time_to_first_token_seconds_bucket{le="0.1"} 3
"""


def test_metrics_parsing():
    assert filter_lines(PROM)[:3] == PROM.splitlines()[:3]
    assert not any(line.startswith("nv_") for line in filter_lines(PROM))
    samples = parse_samples(PROM)
    assert metric_total(samples, "kvshare_requests_running") == 3
    assert metric_total(samples, "kvshare_kv_pages_active") is None
    free = [s for s in samples if s.name == "kvshare_kv_pages_free"][0]
    assert free.labels == (("model", "llm_engine"), ("version", "1")) and free.value == 96
    assert metrics_url("h:8002") == "http://h:8002/metrics" == metrics_url("http://h:8002/metrics")


def test_client_package_imports_neither_torch_nor_the_server_nor_gevent():
    code = (
        "import sys, kvshare_client, kvshare_client.cli, kvshare_client.workload, kvshare_client.metrics;"
        "heavy = ('torch', 'kvshare', 'locust', 'gevent', 'triton_python_backend_utils');"
        "bad = [m for m in heavy if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
