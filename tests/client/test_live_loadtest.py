"""Short load-generator runs against the real server: Locust (headless) and perf_analyzer."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client_live import LOADTEST

pytestmark = pytest.mark.server

VENV_BIN = Path(sys.executable).parent


def env():
    e = dict(os.environ, PYTHON=sys.executable)
    if (VENV_BIN / "locust").exists():
        e["LOCUST"] = str(VENV_BIN / "locust")
    return e


def test_headless_locust_run_has_no_failures(triton_server, tmp_path):
    p = subprocess.run(
        [
            str(LOADTEST / "run_locust.sh"),
            "-H",
            triton_server.grpc_url,
            "-u",
            "2",
            "-r",
            "2",
            "-t",
            "10s",
            "-o",
            str(tmp_path),
            "--",
            "--kvshare-max-tokens",
            "8",
            "--kvshare-slo-max-failure-ratio",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env(),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(tmp_path / "locust_stats.csv"))}
    stream = rows[("stream", "ensemble")]
    assert int(stream["Request Count"]) > 0 and int(stream["Failure Count"]) == 0
    assert int(rows[("ttft", "ensemble")]["Request Count"]) == int(stream["Request Count"])
    assert float(stream["Average Content Size"]) > 0  # output tokens per request
    assert (tmp_path / "report.html").stat().st_size > 0
    assert "SLO PASS" in p.stderr


def test_perf_analyzer_streams_llm_engine_without_errors(triton_server, tmp_path):
    inputs = tmp_path / "ids.json"
    subprocess.run(
        [
            sys.executable,
            str(LOADTEST / "make_pa_inputs.py"),
            "tokens",
            "-o",
            str(inputs),
            "--count",
            "8",
            "--input-len",
            "16",
            "--max-tokens",
            "8",
            "--min-tokens",
            "8",
        ],
        check=True,
        timeout=60,
    )
    # perf_analyzer 2.51 sometimes (about 1 run in 20) exits 0 and leaves its export empty: it exports
    # the FP32 outputs a response does not carry from uninitialized memory, and its JSON writer stops
    # at the first NaN or Inf before its first flush (docs/decisions.md). Its own failure: run again once.
    # perf_analyzer refuses (exit 99, its usage) an export path that exists, so each try writes its own.
    for attempt in range(2):
        export = tmp_path / f"c2-{attempt}.json"
        p = subprocess.run(
            [
                str(LOADTEST / "perf_analyzer.sh"),
                "-m",
                "llm_engine",
                "-u",
                triton_server.grpc_url,
                "-i",
                "grpc",
                "--streaming",
                "--concurrency-range",
                "2:2",
                "--request-count",
                "12",
                "--input-data",
                str(inputs),
                "--profile-export-file",
                str(export),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env(),
        )
        assert p.returncode == 0, p.stdout[:1500] + p.stderr[:1500] + "\n...\n" + p.stdout[-1500:] + p.stderr[-1500:]
        assert "error" not in (p.stdout + p.stderr).lower()
        if export.stat().st_size > 0 or attempt:
            break
        print(f"perf_analyzer left {export} empty (rc 0); its output:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    stats = subprocess.run(
        [sys.executable, str(LOADTEST / "pa_export_stats.py"), str(export), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stats.returncode == 0, stats.stdout + stats.stderr + p.stdout[-2000:] + p.stderr[-2000:]
    import json

    (row,) = json.loads(stats.stdout)
    assert row["requests"] >= 12 and row["output_tokens"] == 8 * row["requests"]
    assert 0 < row["ttft_p50_ms"] <= row["e2e_p50_ms"] and row["itl_p50_ms"] > 0
