"""The full-stack run's pure helpers (perf/server/fullstack_*.py): workload identity with the offline
benchmark's fixed-64, result arithmetic, the summary table. No server, no GPU."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from perf.server import fullstack_client_load as fcl  # noqa: E402
from perf.server import fullstack_common as fc  # noqa: E402
from perf.server import fullstack_offline as fo  # noqa: E402
from perf.server import fullstack_pa as fpa  # noqa: E402
from perf.server import fullstack_summary as fs  # noqa: E402


def test_prompts_are_fixed_64s_and_continue_its_sequence():
    fixed = fc.wt.make_trace("fixed-64")
    ours = fc.prompts(256, 128, 32000)
    assert len(fixed.requests) == 128
    assert [r.prompt_ids for r in fixed.requests] == ours[:128]
    assert len(set(ours)) == 256 and all(len(p) == 128 for p in ours)
    assert all(max(p) < 256 for p in fc.prompts(8, 32, 256))


def test_request_fields_match_the_offline_sampling():
    f = fc.request_fields((1, 2, 3), 128, "pa")
    assert f == {"input_ids": [1, 2, 3], "max_tokens": 128, "ignore_eos": True, "temperature": 0.0,
                 "stream": True, "exclude_input_in_output": True, "cache_salt": "pa"}
    assert "cache_salt" not in fc.request_fields((1,), 4, "")


def test_offline_traces_registered(monkeypatch):
    monkeypatch.setattr(fc.wt, "TRACES", dict(fc.wt.TRACES))   # leave the shared table as it was
    fo.register(requests=96, concurrency=32, input_len=16, output_len=8, vocab=100)
    t = fc.wt.make_trace(fo.MEASURED)
    w = fc.wt.make_trace(fo.WARMUP)
    assert (len(t.requests), t.concurrency) == (96, 32)
    assert all(r.max_new_tokens == 8 and len(r.prompt_ids) == 16 for r in t.requests)
    assert [r.prompt_ids for r in t.requests] == fc.prompts(96, 16, 100)
    assert len(w.requests) == 32 and not {r.prompt_ids for r in w.requests} & {r.prompt_ids for r in t.requests}


def _export(n_req: int, tokens: int) -> dict:
    reqs = []
    for i in range(n_req):
        start = 1_000_000_000 + i * 1_000_000
        times = [start + 10_000_000 + k * 2_000_000 for k in range(tokens)]
        outs = [{"output_ids": 5 if k % 2 else [5], "text_output": "", "finish_reason": ""} for k in range(tokens)]
        outs[-1]["finish_reason"] = "length"
        reqs.append({"timestamp": start, "response_timestamps": times, "response_outputs": outs,
                     "request_inputs": {}})
    return {"experiments": [{"experiment": {"mode": "concurrency", "value": 4}, "requests": reqs}]}


def test_pa_summary_uses_the_server_counter_over_pa_window():
    export = _export(4, 5)
    before = {"generation_tokens": 100.0, "prefix_hit_tokens": 0.0}
    after = {"generation_tokens": 120.0, "prefix_hit_tokens": 0.0}
    r = fpa.summarize(export, before, after, requests=4, concurrency=4, output_len=5)
    assert r["requests_done"] == 4 and r["server_tokens"] == 20 and r["client_tokens"] == 20
    assert r["pa_export_stats_tokens"] == 16   # it drops the last response when its text is empty
    window = (1_000_000_000 + 3_000_000 + 10_000_000 + 4 * 2_000_000 - 1_000_000_000) / 1e9
    assert abs(r["window_s"] - window) < 1e-9
    assert abs(r["server_tok_per_s"] - 20 / window) < 1e-6
    assert r["ttft_ms"]["50"] == 10.0


def test_export_tokens_skips_a_flag_only_final():
    export = _export(2, 3)
    for req in export["experiments"][0]["requests"]:
        req["response_outputs"].append({"output_ids": 12345, "finish_reason": ""})   # stale flag-only final
        req["response_timestamps"].append(req["response_timestamps"][-1] + 1)
    assert fpa.export_tokens(export) == 6


def test_sampled_window():
    rows = [{"time_s": t, "generation_tokens_total": g, "requests_running": run, "requests_waiting": 0}
            for t, g, run in [(0.0, 0, 0), (1.0, 0, 4), (2.0, 100, 4), (3.0, 300, 4), (4.0, 300, 0)]]
    w = fpa.sampled_window(rows)
    assert w["peak_running"] == 4 and w["sampled_tok_per_s"] == 150.0


def test_client_summary():
    res = [{"index": 0, "sent_at": 10.0, "finished_at": 12.0, "tokens": 4, "finish_reason": "length",
            "cached_tokens": 0, "responses": 4, "content_times": [10.5, 11.0, 11.5, 12.0],
            "content_tokens": [1, 1, 1, 1]},
           {"index": 1, "sent_at": 10.0, "finished_at": 11.0, "error": "boom"}]
    s = fcl.summarize(res, {"generation_tokens": 0.0}, {"generation_tokens": 4.0}, requests=2, concurrency=2,
                      processes=1, output_len=4, client_cpu_per_s=[0.41234])
    assert s["requests_done"] == 1 and s["errors"] == 1 and s["window_s"] == 2.0
    assert s["client_cpu_per_s"] == [0.412]
    assert s["client_tok_per_s"] == 2.0 and s["server_tok_per_s"] == 2.0
    assert s["ttft_ms"]["50"] == 500.0 and s["itl_ms"]["50"] == 500.0


def test_summary_table_and_verdict(tmp_path):
    work = tmp_path / "run"
    (work / "pa").mkdir(parents=True)
    (work / "offline.json").write_text(json.dumps([
        {"workload": "fullstack-warmup", "system": "kvshare", "tok_per_s": 1.0},
        {"workload": "fullstack", "system": "kvshare", "requests": 256, "output_tokens": 32768, "seconds": 4.0,
         "tok_per_s": 8192.0, "ttft_p50_ms": 100.0, "ttft_p95_ms": 200.0}]))
    (work / "pa" / "pa_result.json").write_text(json.dumps({
        "tool": "perf_analyzer", "concurrency": 64, "requests_done": 256, "server_tokens": 32768,
        "window_s": 4.5, "server_tok_per_s": 32768 / 4.5, "client_tok_per_s": 7000.0,
        "ttft_ms": {"50": 90.0, "95": 150.0}, "itl_ms": {"50": 8.0, "95": 12.0}}))
    (work / "client_p1.json").write_text(json.dumps({"tool": "kvshare_client (1 process)", "concurrency": 64,
                                                     "requests_done": 256, "server_tokens": 32768,
                                                     "window_s": 8.0, "server_tok_per_s": 4096.0,
                                                     "client_cpu_per_s": [0.93]}))
    out = tmp_path / "out"
    assert fs.main(["--work", str(work), "--out", str(out), "--info", "machine=test"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert [round(r["ratio"], 3) for r in s["rows"]] == [1.0, round(32768 / 4.5 / 8192, 3), 0.5]
    assert s["verdict"] == "PASS" and abs(s["perf_analyzer_ratio"] - 0.889) < 1e-3
    md = (out / "summary.md").read_text()
    assert "| offline engine" in md and "perf_analyzer" in md and "- machine: test" in md
    assert "client CPU per wall second 0.93" in md


def test_summary_without_results(tmp_path):
    s = fs.build(None, [{"tool": "perf_analyzer", "error": "rc=1"}], goal=0.85, info={})
    assert s["verdict"] is None and s["rows"][0]["errors"] == "no offline result"
    assert "rc=1" in fs.markdown(s)
