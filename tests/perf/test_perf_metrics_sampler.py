"""perf/report/metrics_sampler.py: parsing an exposition and sampling a (fake) metrics endpoint."""
from __future__ import annotations

import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.report.metrics_sampler import FIELDS, MetricsSampler, is_metrics_csv, parse_row, read_csv  # noqa: E402

EXPOSITION = """\
# HELP kvshare_kv_pages_active KV pages referenced by running requests
# TYPE kvshare_kv_pages_active gauge
kvshare_kv_pages_active{model="llm_engine",version="1"} 42
kvshare_kv_pages_cached{model="llm_engine",version="1"} 7
kvshare_kv_pages_free{model="llm_engine",version="1"} 1000
kvshare_kv_pages_total{model="llm_engine",version="1"} 1049
kvshare_requests_running{model="llm_engine",version="1"} 3
kvshare_requests_waiting{model="llm_engine",version="1"} 0
kvshare_prefix_cache_queries_tokens_total{model="llm_engine",version="1"} 1.5e+03
kvshare_prefix_cache_hits_tokens_total{model="llm_engine",version="1"} 512
kvshare_generation_tokens_total{model="llm_engine",version="1",replica="0"} 100
kvshare_generation_tokens_total{model="llm_engine",version="1",replica="1"} 23
nv_inference_count{model="llm_engine",version="1"} 9
"""


def test_parse_row_sums_label_sets_and_marks_absent():
    row = parse_row(EXPOSITION)
    assert row["kv_pages_active"] == 42 and row["kv_pages_cached"] == 7 and row["kv_pages_free"] == 1000
    assert row["kv_pages_total"] == 1049 and row["requests_running"] == 3 and row["requests_waiting"] == 0
    assert row["prefix_query_tokens_total"] == 1500 and row["prefix_hit_tokens_total"] == 512
    assert row["generation_tokens_total"] == 123
    assert row["evictions_total"] is None and row["preemptions_total"] is None


def test_parse_row_of_empty_exposition():
    assert all(v is None for v in parse_row("").values())


class _Handler(BaseHTTPRequestHandler):
    calls = 0

    def do_GET(self):  # noqa: N802
        type(self).calls += 1
        body = EXPOSITION.replace(" 42\n", f" {40 + type(self).calls}\n").encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_sampler_writes_csv_rows(tmp_path):
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "m.csv"
        with MetricsSampler(f"127.0.0.1:{server.server_port}", out, interval_s=0.05) as s:
            time.sleep(0.4)
        assert len(s.rows) >= 3 and s.errors == 0
        assert is_metrics_csv(out)
        rows = read_csv(out)
        assert list(rows[0]) == FIELDS and len(rows) == len(s.rows)
        assert [r["kv_pages_active"] for r in rows] == sorted(r["kv_pages_active"] for r in rows)
        assert rows[-1]["elapsed_s"] > rows[0]["elapsed_s"] >= 0
        assert rows[0]["evictions_total"] is None
    finally:
        server.shutdown()


def test_sampler_survives_unreachable_server(tmp_path):
    with MetricsSampler("127.0.0.1:1", tmp_path / "m.csv", interval_s=0.05, timeout_s=0.2) as s:
        time.sleep(0.2)
    assert s.rows == [] and s.errors >= 1
    assert is_metrics_csv(tmp_path / "m.csv") and read_csv(tmp_path / "m.csv") == []
