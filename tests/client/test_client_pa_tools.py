"""perf/load's perf_analyzer helpers: input-data generation and export statistics."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

LOADTEST = Path(__file__).resolve().parents[2] / "perf" / "load"


def load(name):
    spec = importlib.util.spec_from_file_location(f"kvshare_loadtest_{name}", LOADTEST / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


mk = load("make_pa_inputs")
stats = load("pa_export_stats")


def test_text_inputs_leave_out_the_batch_dim(tmp_path):
    out = tmp_path / "t.json"
    assert mk.main(["text", "-o", str(out), "--max-tokens", "16", "--chat"]) == 0
    data = json.loads(out.read_text())["data"]
    assert len(data) == len(mk.BUILTIN_PROMPTS)
    first = data[0]
    assert first["text_input"] == {"content": [mk.BUILTIN_PROMPTS[0]], "shape": [1]}
    assert first["max_tokens"] == {"content": [16], "shape": [1]}
    assert first["stream"] == {"content": [True], "shape": [1]}
    assert first["apply_chat_template"] == {"content": [True], "shape": [1]}
    assert "temperature" not in first  # unset options stay server defaults


def test_token_inputs_share_the_requested_prefix(tmp_path):
    out = tmp_path / "ids.json"
    mk.main(
        [
            "tokens",
            "-o",
            str(out),
            "--count",
            "4",
            "--input-len",
            "10",
            "--prefix-len",
            "6",
            "--max-tokens",
            "8",
            "--min-tokens",
            "8",
        ]
    )
    data = json.loads(out.read_text())["data"]
    ids = [d["input_ids"]["content"] for d in data]
    assert all(d["input_ids"]["shape"] == [10] for d in data)
    assert len({tuple(i[:6]) for i in ids}) == 1 and len({tuple(i[6:]) for i in ids}) == 4
    assert data[0]["min_tokens"] == {"content": [8], "shape": [1]}


def test_text_inputs_from_a_workload_file(tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt": "你好", "cache_salt": "a"}\n')
    out = tmp_path / "t.json"
    mk.main(["text", "-o", str(out), "--workload", str(wl)])
    (entry,) = json.loads(out.read_text(encoding="utf-8"))["data"]
    assert entry["text_input"]["content"] == ["你好"] and entry["cache_salt"]["content"] == ["a"]


def request(ts, times, outputs, **inputs):
    return {"timestamp": ts, "request_inputs": inputs, "response_timestamps": times, "response_outputs": outputs}


MS = 1_000_000
EXPORT = {
    "experiments": [
        {
            "experiment": {"mode": "concurrency", "value": 2},
            "requests": [
                # 3 tokens, then the flag-only final response whose numbers are perf_analyzer garbage
                request(
                    0,
                    [10 * MS, 20 * MS, 30 * MS, 31 * MS],
                    [
                        {"text_output": "a", "num_output_tokens": 1},
                        {"text_output": "b", "num_output_tokens": 1},
                        {"text_output": "c", "num_output_tokens": 1},
                        {"text_output": "", "num_output_tokens": 365886114, "num_input_tokens": 365879811},
                    ],
                    return_num_output_tokens=True,
                ),
                # counts not requested: num_output_tokens is stale buffer content, ids tell the truth;
                # the second response carries 2 tokens
                request(
                    5 * MS,
                    [25 * MS, 45 * MS],
                    [
                        {"output_ids": 7, "num_output_tokens": 0},
                        {"output_ids": [8, 9], "num_output_tokens": 1575638417},
                    ],
                ),
                # a request that got nothing (failed) is left out
                request(6 * MS, [], []),
            ],
            "window_boundaries": [0, 50 * MS],
        }
    ],
    "version": "2.51.0",
}


def test_export_statistics():
    (s,) = stats.export_stats(EXPORT)
    assert (s.mode, s.value, s.requests, s.output_tokens) == ("concurrency", 2, 2, 6)
    assert s.ttft_ms[50] == pytest.approx(15.0)  # ttfts 10 and 20 ms
    # gaps per token: 10, 10 (first request), 20/2 = 10 (second)
    assert s.itl_ms[50] == pytest.approx(10.0) and s.itl_ms[99] == pytest.approx(10.0)
    assert s.tpot_ms[50] == pytest.approx(10.0)  # (30-10)/2 and (45-25)/2
    assert s.e2e_ms[50] == pytest.approx((31 + 40) / 2)
    assert s.duration_s == pytest.approx(0.045)  # first send (0) to last response (45 ms)


def test_percentile_interpolates_like_numpy():
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert stats.percentile([5], 95) == 5


def test_cli_writes_csv_and_fails_on_empty_runs(tmp_path):
    path = tmp_path / "c2.json"
    path.write_text(json.dumps(EXPORT))
    out_csv = tmp_path / "s.csv"
    assert stats.main([str(path), "--csv", str(out_csv)]) == 0
    header, row = out_csv.read_text().splitlines()[:2]
    assert "ttft_p95_ms" in header and "itl_p50_ms" in header and row.split(",")[2] == "2"
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"experiments": [{"experiment": {}, "requests": []}]}))
    assert stats.main([str(empty)]) == 1
