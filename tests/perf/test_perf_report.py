"""perf/report/make_report.py on small synthetic inputs: Markdown + PNGs (no server)."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.report import make_report  # noqa: E402
from perf.report.metrics_sampler import FIELDS  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
PCT = ["50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%", "99.9%", "99.99%", "100%"]


def _write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def make_locust(d: Path) -> None:
    d.mkdir(parents=True)
    head = ["Type", "Name", "Request Count", "Failure Count", "Median Response Time", "Average Response Time",
            "Min Response Time", "Max Response Time", "Average Content Size", "Requests/s", "Failures/s", *PCT]
    _write_csv(d / "locust_stats.csv", head, [
        ["stream", "llm_engine", 40, 0, 3000, 3100, 2000, 5000, 32.0, 2.0, 0, *[3000 + 100 * i for i in range(11)]],
        ["ttft", "llm_engine", 40, 0, 400, 420, 100, 900, 0.0, 2.0, 0, *[400 + 40 * i for i in range(11)]],
        ["itl", "llm_engine", 40, 0, 80, 82, 60, 120, 0.0, 2.0, 0, *[80 + 3 * i for i in range(11)]],
        ["", "Aggregated", 120, 0, 400, 1200, 60, 5000, 10.7, 6.0, 0, *[400] * 11],
    ])
    hhead = ["Timestamp", "User Count", "Type", "Name", "Requests/s", "Failures/s", *PCT, "Total Request Count",
             "Total Failure Count", "Total Median Response Time", "Total Average Response Time",
             "Total Min Response Time", "Total Max Response Time", "Total Average Content Size"]
    rows = []
    for t in range(20):
        n = 2 * t
        rows.append([1000 + t, 4, "", "Aggregated", 6, 0, *["N/A"] * 11, 3 * n, 0, 400, 1200, 60, 5000, 10.7])
        rows.append([1000 + t, 4, "stream", "llm_engine", 2, 0, *[3000] * 11, n, 0, 3000, 3100, 2000, 5000, 32.0])
        rows.append([1000 + t, 4, "ttft", "llm_engine", 2, 0, *[400 + t] * 11, n, 0, 400, 420, 100, 900, 0.0])
        rows.append([1000 + t, 4, "itl", "llm_engine", 2, 0, *[80] * 11, n, 0, 80, 82, 60, 120, 0.0])
    _write_csv(d / "locust_stats_history.csv", hhead, rows)


def make_pa_export(path: Path) -> None:
    def request(start: int, n_tokens: int) -> dict:
        times = [start + 100_000_000 + 20_000_000 * i for i in range(n_tokens)] + [start + 100_000_000 + 20_000_000 * n_tokens]
        outs = [{"output_ids": [7]} for _ in range(n_tokens)] + [{"output_ids": []}]
        return {"timestamp": start, "request_inputs": {}, "response_timestamps": times, "response_outputs": outs}

    exps = []
    for c in (1, 2, 4):
        reqs = [request(10**9 * i, 16) for i in range(4 * c)]
        exps.append({"experiment": {"mode": "concurrency", "value": c}, "requests": reqs, "window_boundaries": []})
    path.write_text(json.dumps({"experiments": exps, "version": "2.51"}))


def make_server_bench(d: Path) -> None:
    d.mkdir(parents=True)
    rows = [
        {"workload": "seed-12x128", "system": "kvshare-server", "requests": 24, "concurrency": 12, "output_tokens": 1536,
         "seconds": 20.0, "tok_per_s": 76.8, "req_per_s": 1.2, "ttft_p50_ms": 900.0, "ttft_p95_ms": 1500.0,
         "itl_p50_ms": 90.0, "itl_p95_ms": 140.0, "e2e_p50_ms": 7000.0, "e2e_p95_ms": 9000.0,
         "prefix_hit_rate": 0.0, "cached_prompt_share": 0.0, "peak_kv_pages": 144, "failures": 0},
        {"workload": "seed-12x128", "system": "hf-generate", "requests": 24, "concurrency": 12, "output_tokens": 1536,
         "seconds": 16.0, "tok_per_s": 96.0, "req_per_s": 1.5, "ttft_p50_ms": 8000.0, "ttft_p95_ms": 8100.0},
        {"workload": "seed-12x128", "system": "hf-generate_batch", "requests": 24, "concurrency": 12,
         "output_tokens": 1536, "seconds": 35.0, "tok_per_s": 43.9, "req_per_s": 0.7},
    ]
    data = {"kind": "kvshare-server-benchmark", "created": "2025-01-01 00:00:00", "command": "python perf/server/server_benchmark.py",
            "machine": {"cpus": 2, "torch": "x", "torch_threads": 2, "transformers": "y"},
            "config": {"requests": 24, "output_tokens": 64, "concurrency": 12, "model": "m.gguf", "model_name": "llm_engine"},
            "rows": rows, "ratios": {"seed-12x128": {"kvshare/hf-generate": 0.8, "kvshare/hf-generate_batch": 1.75}},
            "phases": [{"workload": "seed-12x128", "start_s": 1.0, "end_s": 8.0}], "metrics_csv": "metrics.csv"}
    (d / "server_benchmark.json").write_text(json.dumps(data))
    rows_m = []
    for i in range(20):
        act = min(i * 15, 144) if i < 16 else 0
        rows_m.append([1000 + i / 2, i / 2, act, 40 if i > 3 else 0, 1000 - act, 1049, 12 if act else 0, 0, i * 128,
                       0, i * 12, "", ""])
    _write_csv(d / "metrics.csv", FIELDS, rows_m)
    (d / "server.log").write_text("I'm a log, not an input\n")


def test_report_from_synthetic_run(tmp_path):
    run = tmp_path / "run"
    make_locust(run / "locust")
    (run / "pa").mkdir()
    make_pa_export(run / "pa" / "c_all.json")
    make_server_bench(run / "server-bench")
    out = tmp_path / "report"
    report = make_report.build_report([run], out, copy_data=True)
    md = report.read_text()
    for section in ("## Summary", "## Server benchmark", "## perf_analyzer sweep", "## Locust run `locust`",
                    "## KV cache pages over time", "kvshare/hf-generate = **0.80×**"):
        assert section in md, section
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["kv_pages_server-bench.png", "latency_percentiles.png", "locust_locust.png",
                    "server_benchmark_server-bench.png", "throughput_vs_concurrency.png"]
    for p in pngs:
        assert (out / p).read_bytes()[:8] == PNG and (out / p).stat().st_size > 5000
        assert f"]({p})" in md
    assert (out / "data" / "server-bench" / "server_benchmark.json").exists()
    assert "server.log" in md  # listed as not used


def test_pa_percentiles_come_from_pa_export_stats(tmp_path):
    make_pa_export(tmp_path / "c.json")
    inp = make_report.collect([tmp_path / "c.json"])
    assert [r["value"] for r in inp.pa_rows] == [1, 2, 4]
    r = inp.pa_rows[0]
    assert r["requests"] == 4 and r["output_tokens"] == 64
    assert abs(r["ttft_p50_ms"] - 100.0) < 1e-6 and abs(r["itl_p50_ms"] - 20.0) < 1e-6


def test_locust_summary(tmp_path):
    make_locust(tmp_path / "l")
    (run,) = make_report.collect([tmp_path / "l"]).locust
    s = make_report.locust_summary(run)
    m = s["models"]["llm_engine"]
    assert s["users"] == 4 and m["requests"] == 40 and m["failures"] == 0 and m["output_tokens"] == 1280
    assert abs(m["tok_per_s"] - 64.0) < 1e-9           # 40 requests at 2 req/s -> 20 s, 1280 tokens
    assert m["ttft"][95] == 600 and m["itl"][50] == 80


def test_only_offline_json(tmp_path):
    rows = [{"workload": "seed-hot10", "system": "kvshare", "requests": 8, "output_tokens": 64, "seconds": 1.0,
             "tok_per_s": 64.0, "ttft_p50_ms": 10.0, "ttft_p95_ms": 20.0, "peak_kv_pages": 30, "prefix_hit_rate": 0.5}]
    (tmp_path / "off.json").write_text(json.dumps(rows))
    md = make_report.build_report([tmp_path / "off.json"], tmp_path / "r").read_text()
    assert "## Offline benchmark" in md and "seed-hot10" in md


def test_metrics_csv_with_phases_file(tmp_path):
    d = tmp_path / "live"
    d.mkdir()
    _write_csv(d / "metrics.csv", FIELDS, [[1000 + i, i, 10 * i, 5, 100, 115, 1, 0, "", "", "", "", ""] for i in range(6)])
    (d / "phases.json").write_text(json.dumps([{"label": "Locust", "start_unix": 1001.0, "end_unix": 1004.0}]))
    inp = make_report.collect([d])
    ((label, rows, extra),) = inp.metrics
    assert label == "live" and extra["phases"] == [{"workload": "Locust", "start_s": 1.0, "end_s": 4.0}]
    md = make_report.build_report([d], tmp_path / "r").read_text()
    assert "![KV pages](kv_pages_live.png)" in md and (tmp_path / "r" / "kv_pages_live.png").exists()
